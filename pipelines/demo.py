"""``make demo``: the nightly job end to end on an embedded default (local files, no server).

On MovieLens-1M from ``../shared/datasets`` when present (per-event samples, history up to 512),
otherwise on generated samples with a heavy-tailed (lognormal) length distribution. Prints where
the output went and the predicted bubble before and after balancing. Then it balances the same
samples for a world size of 2 and ends with a short training run on those shards: 2 processes
(``torch.distributed.run``), the prioritized, overlapped embedding pipeline, and the shared-memory
(SM-free on CPU) all-to-all backend, logging loss, throughput and the measured bubble.

Run: ``python -m pipelines.demo [--out demo-output] [--ranks 256] [--batch-size-per-rank 32]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipelines.nightly import NightlyConfig, run_nightly

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("FREESCALE_DATASETS", REPO_ROOT.parent / "shared" / "datasets"))
ML1M = DATASETS / "ml-1m_ensfm" / "sequences.txt"


def synthetic_input(out_dir: Path, num_samples: int = 300_000, seed: int = 0) -> Path:
    """Generated samples whose lengths follow a lognormal (median ~55, capped at 512 like the
    MovieLens-1M per-event histories: the same cap users train with)."""
    from fsdata.synth import write_synth_samples

    path = out_dir / "synthetic-samples.parquet"
    if not path.exists():
        rng = np.random.default_rng(seed)
        source = np.clip(rng.lognormal(mean=4.0, sigma=1.0, size=100_000), 1, 512).astype(np.int64)
        write_synth_samples(path, num_samples, source, seed=seed)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "demo-output"))
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--batch-size-per-rank", type=int, default=32)
    p.add_argument("--cost-model", default="quadratic")
    p.add_argument("--train-steps", type=int, default=30, help="steps of the closing training run (0: skip)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if ML1M.exists():
        print(f"demo: MovieLens-1M from {ML1M} (per-event samples, history <= 512)")
        cfg = NightlyConfig(input=str(ML1M), format="sequences", samples="per-event", max_seq_len=512,
                            num_ranks=a.ranks, batch_size_per_rank=a.batch_size_per_rank, cost_model=a.cost_model)
    else:
        print(f"demo: {DATASETS} is absent; using generated heavy-tailed samples")
        cfg = NightlyConfig(input=str(synthetic_input(out)), format="samples", num_ranks=a.ranks,
                            batch_size_per_rank=a.batch_size_per_rank, cost_model=a.cost_model)
    r = run_nightly(cfg, out / "nightly", progress=not a.no_progress)
    v = r["verify"]
    shards = Path(r["run_dir"]) / "shards"
    print()
    print(f"output:            {out / 'nightly' / 'latest' / 'shards'}  (-> {shards})")
    print(f"ranks x steps:     {v['num_ranks']} x {v['num_steps']}, {v['num_samples_written']:,} samples written, "
          f"{v['num_samples_dropped']:,} dropped (listed in the manifest)")
    print(f"bubble before:     {v['baseline_predicted_bubble']:.2%}  (shuffled, equal counts per rank: today)")
    print(f"bubble after:      {v['predicted_bubble']:.4%}  (fsdata balance, verified)")
    if a.train_steps > 0:
        converted = Path(r["run_dir"]) / "samples.parquet"
        samples = converted if converted.exists() else Path(cfg.input)
        train_demo(samples, out, a.train_steps, progress=not a.no_progress)
    return 0


def train_demo(samples: Path, out: Path, steps: int, *, progress: bool = True) -> dict:
    """Balance ``samples`` for 2 ranks and train ``steps`` steps on them with 2 processes.

    Returns:
        The rank-0 training summary (``measured_bubble``, ``num_steps``, ...).

    Raises:
        RuntimeError: the training processes failed.
    """
    from fsdata.cli import main as fsdata_main

    shards = out / "train-shards-2ranks"
    if not (shards / "_manifest.json").exists():
        rc = fsdata_main(["balance", str(samples), str(shards), "--ranks", "2", "--batch-size-per-rank", "32",
                          "--overwrite"] + ([] if progress else ["--no-progress"]))
        if rc:
            raise RuntimeError(f"fsdata balance for the training demo failed with status {rc}")
    metrics = out / "train-metrics"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fstrain.cli", "train", str(shards), "--max-steps", str(steps), "--log-every-steps", "5",
           "--pipeline", "prioritized", "--backend", "shm", "--metrics-dir", str(metrics),
           "--embedding-dim", "32", "--num-layers", "1", "--num-heads", "2", "--num-negatives", "64", "--json"]
    print()
    print("training: " + " ".join(cmd[2:]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"training failed with status {proc.returncode}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"trained:           {summary['num_steps']} steps on 2 ranks (prioritized pipeline, shm backend); "
          f"measured bubble {summary['measured_bubble']:.2%}; metrics in {metrics}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
