"""Every benchmark from one command: ``make bench`` (full) or ``python -m benchmarks.run_all --quick``.

Runs, one after another in child processes (so one's memory does not skew the next), writing
tables to stdout and JSON under ``--out``:

1. ``bench_balancer``: per-step partitioners and cost-budget on every dataset + synthetic (issue 3);
2. ``bench_e2e``: ``fsdata balance`` end to end vs a Polars copy (20M samples; 1M with --quick);
3. ``bench_reader``: fstrain's shard reader vs the model's consumption (on shards made here);
4. ``bench_alltoall``: shared-memory all-to-all-v vs gloo (and the GPU section where CUDA exists);
5. ``bench_pipeline``: exposed communication per step with and without overlap;
6. ``bench_compose``: batch composition per dataset, R and B (bubble per window and the proven bound).
7. ``bench_quality``: held-out NDCG@10/HR@10 per balancing setting, mean +- std over seeds (issue 10).
8. ``bench_engines``: ``fsdata balance --engine local`` vs ``--engine ray`` (1M, 5M, 20M; 1M with --quick).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke sizes (a few minutes in all)")
    p.add_argument("--out", default=str(REPO_ROOT / "bench-output"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = ["--quick"] if a.quick else []
    py = [sys.executable, "-m"]
    shards = out / "reader-shards"
    jobs = [
        ("balancer", py + ["benchmarks.bench_balancer", "--out", str(out)] + quick),
        ("e2e", py + ["benchmarks.bench_e2e", "--out", str(out), "--work", str(out / "e2e-work"),
                      "--num-samples", "1000000" if a.quick else "20000000"]),
        ("reader shards", py + ["fsdata", "synth", str(out / "reader-samples.parquet"), "--num-samples", "200000",
                                "--lengths-from", str(REPO_ROOT.parent / "shared" / "datasets" / "ml-1m_ensfm" /
                                                      "sequences.txt"), "--overwrite", "--no-progress"]),
        ("reader balance", py + ["fsdata", "balance", str(out / "reader-samples.parquet"), str(shards), "--ranks", "16",
                                 "--batch-size-per-rank", "32", "--overwrite", "--no-progress"]),
        ("reader", py + ["benchmarks.bench_reader", str(shards), "--out", str(out / "bench_reader.json")]),
        ("alltoall", py + ["benchmarks.bench_alltoall", "--out", str(out)] + quick),
        ("pipeline", py + ["benchmarks.bench_pipeline", "--out", str(out)] + quick),
        ("compose", py + ["benchmarks.bench_compose", "--out", str(out)] + quick),
        ("quality", py + ["benchmarks.bench_quality", "--out", str(out), "--work", str(out / "quality-work"),
                          "--compose-windows", "4,16,64"] + quick),
        ("engines", py + ["benchmarks.bench_engines", "--out", str(out), "--work", str(out / "engines-work"),
                          "--sizes", "1000000" if a.quick else "1000000,5000000,20000000"]),
    ]
    failed = []
    for name, cmd in jobs:
        print(f"\n=== {name}: {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=REPO_ROOT)
        print(f"=== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print(f"\nJSON results in {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
