"""Benchmark the shard reader against the model that consumes it.

Reads one rank's shard of an ``fsdata balance`` OUTPUT end to end (synchronous and with a prefetch
thread), times a resume from the middle, and compares the reader's steps per second with the
forward + backward rate of a small model on the same batches. Prints a table and writes JSON.

    PYTHONPATH=. python -m benchmarks.bench_reader SHARDS [--rank 0] [--model-steps 20] [--out bench_reader.json]

Build SHARDS e.g. with:
    python -m fsdata convert ../shared/datasets/ml-1m_ensfm/sequences.txt ml1m.parquet --format sequences \\
        --samples per-event --max-seq-len 512
    python -m fsdata balance ml1m.parquet shards16 --ranks 16 --batch-size-per-rank 32
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from fstrain.data import ShardReader, infer_num_items, load_manifest
from fstrain.models import with_negatives
from fstrain.measure.replay import make_replay_model, time_forward_backward


def _read_all(shards: str, rank: int, prefetch: int, start: int = 0) -> dict:
    t0 = time.perf_counter()
    rd = ShardReader(shards, rank, None, start_step=start, num_prefetch_batches=prefetch)
    t_open = time.perf_counter() - t0
    steps = samples = tokens = 0
    first = None
    for b in rd:
        if first is None:
            first = time.perf_counter() - t0
        steps += 1
        samples += b.num_samples
        tokens += int(b.lengths.sum())
    dt = time.perf_counter() - t0
    return {"steps": steps, "samples": samples, "tokens": tokens, "seconds": dt, "open_seconds": t_open,
            "first_batch_seconds": first or 0.0, "steps_per_second": steps / dt, "samples_per_second": samples / dt,
            "tokens_per_second": tokens / dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shards")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--model-steps", type=int, default=20, help="batches timed through the model")
    p.add_argument("--out", default="bench_reader.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    m = load_manifest(a.shards)
    rows = {}
    rows["sync"] = _read_all(a.shards, a.rank, 0)
    rows["prefetch=2"] = _read_all(a.shards, a.rank, 2)
    rows[f"resume@{m.num_steps // 2}"] = _read_all(a.shards, a.rank, 0, start=m.num_steps // 2)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    mdl = make_replay_model(infer_num_items(m), dict(embedding_dim=32, num_layers=1, num_heads=2, num_negatives=64),
                            0, torch.device("cpu"))
    rd = ShardReader(a.shards, a.rank, None, max_steps=a.model_steps, num_prefetch_batches=0)
    t_model = 0.0
    n = 0
    for b in rd:
        b = with_negatives(b, mdl.config.num_items, mdl.config.num_negatives, 0)
        t_model += time_forward_backward(mdl, b, repeats=1, device=torch.device("cpu"), clock=time.perf_counter)
        n += 1
    model_sps = n / t_model
    print(f"{a.shards} rank {a.rank}: {m.num_ranks} ranks x {m.num_steps} steps, B={m.batch_size_per_rank}")
    print(f"{'mode':<14}{'steps':>8}{'seconds':>10}{'steps/s':>10}{'samples/s':>12}{'Mtokens/s':>11}{'first ms':>10}")
    for k, r in rows.items():
        print(f"{k:<14}{r['steps']:>8}{r['seconds']:>10.2f}{r['steps_per_second']:>10.0f}"
              f"{r['samples_per_second']:>12.0f}{r['tokens_per_second'] / 1e6:>11.2f}"
              f"{r['first_batch_seconds'] * 1e3:>10.1f}")
    print(f"{'model fwd+bwd':<14}{n:>8}{t_model:>10.2f}{model_sps:>10.1f}   (embedding_dim 32, 1 layer, 1 thread)")
    ratio = rows["sync"]["steps_per_second"] / model_sps
    print(f"reader is {ratio:.0f}x faster than the model consumes; peak RSS {peak_rss_mb:.0f} MB")
    out = {"shards": a.shards, "rank": a.rank, "num_ranks": m.num_ranks, "num_steps": m.num_steps,
           "reader": rows, "model_steps_per_second": model_sps, "reader_over_model": ratio,
           "peak_rss_mb": peak_rss_mb}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
