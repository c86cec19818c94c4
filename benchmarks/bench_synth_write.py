"""Throughput and memory of :func:`fsdata.samples.synth.write_synth_samples`.

Usage::

    python -m benchmarks.bench_synth_write OUT.parquet [--samples 20000000] [--dataset ml-1m_ensfm/sequences.txt]
        [--layout event] [--max-seq-len 50] [--rows-per-group 1048576]

Prints one JSON line: file stats, seconds, mean length of the source, peak RSS (MiB).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from benchmarks.bench_balancer import DATASETS
from fsdata.samples.synth import read_lengths, write_synth_samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--samples", type=int, default=20_000_000)
    p.add_argument("--dataset", default="ml-1m_ensfm/sequences.txt")
    p.add_argument("--layout", default="event", choices=["event", "user"])
    p.add_argument("--max-seq-len", type=int, default=50)
    p.add_argument("--rows-per-group", type=int, default=1 << 20)
    a = p.parse_args(argv)
    src = read_lengths(DATASETS / a.dataset, a.layout, max_seq_len=a.max_seq_len)
    t = time.perf_counter()
    stats = write_synth_samples(a.out, a.samples, src, seed=0, num_items=50_000, rows_per_group=a.rows_per_group)
    print(json.dumps({**stats, "seconds": round(time.perf_counter() - t, 1), "mean_len": float(src.mean()),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
