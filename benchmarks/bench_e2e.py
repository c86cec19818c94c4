"""End-to-end ``fsdata balance`` at scale against a plain Polars copy of the same input.

Usage::

    python -m benchmarks.bench_e2e [--num-samples 20000000] [--work DIR] [--out DIR] [--ranks 256]
                                   [--batch-size-per-rank 32] [--keep-input]

Generates (once, reused while it exists) ``--num-samples`` synthetic samples whose lengths are
resampled from MovieLens-1M per-event lengths (``fsdata synth``), then measures, each in its own
child process, side by side in one run:

* ``polars copy``: ``pl.scan_parquet(INPUT).sink_parquet(COPY)``: the I/O floor;
* ``fsdata balance``: the full command (lengths, plan, bucket, rank files, manifest).

Columns: wall seconds, peak resident memory of the child (``wait4`` rusage), and the ratio of
balance to copy. Writes a table and ``OUT/bench_e2e.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DATASETS = Path(os.environ.get("FREESCALE_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))


def run_child(args: list[str]) -> dict:
    """Run a command; return wall seconds, peak RSS (bytes) and exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {err.strip()[-500:]}")
    return {"wall_seconds": wall, "peak_rss_bytes": usage.ru_maxrss * 1024, "stdout": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-samples", type=int, default=20_000_000)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--batch-size-per-rank", type=int, default=32)
    p.add_argument("--work", default="bench-output/e2e-work", help="scratch folder for input, copy and shards")
    p.add_argument("--out", default="bench-output")
    p.add_argument("--lengths-from", default=str(DATASETS / "ml-1m_ensfm" / "sequences.txt"))
    p.add_argument("--max-seq-len", type=int, default=64,
                   help="history cap of the resampled per-event lengths (64: mean ~55 items, ~2.5 GB at 20M)")
    p.add_argument("--keep-input", action="store_true", help="keep the generated input for a rerun")
    a = p.parse_args(argv)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    inp = work / f"synth-{a.num_samples}-L{a.max_seq_len}.parquet"
    py = sys.executable
    if not inp.exists():
        if not Path(a.lengths_from).exists():
            print(f"{a.lengths_from} is absent; pass --lengths-from a dataset file", file=sys.stderr)
            return 2
        print(f"generating {a.num_samples:,} samples -> {inp}", flush=True)
        run_child([py, "-m", "fsdata", "synth", str(inp), "--num-samples", str(a.num_samples),
                   "--lengths-from", a.lengths_from, "--layout", "event", "--max-seq-len", str(a.max_seq_len),
                   "--no-progress"])
    input_bytes = inp.stat().st_size
    copy, shards = work / "copy.parquet", work / "shards"
    for path in (copy, shards):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    rows = []
    print("polars copy ...", flush=True)
    r = run_child([py, "-c", f"import polars as pl; pl.scan_parquet({str(inp)!r}).sink_parquet({str(copy)!r})"])
    rows.append({"stage": "polars copy (floor)", **r})
    copy.unlink()
    print("fsdata balance ...", flush=True)
    r = run_child([py, "-m", "fsdata", "balance", str(inp), str(shards), "--ranks", str(a.ranks),
                   "--batch-size-per-rank", str(a.batch_size_per_rank), "--no-progress", "--json"])
    summary = json.loads(r.pop("stdout"))
    rows.append({"stage": "fsdata balance", **r, "summary": summary})
    shutil.rmtree(shards)
    if not a.keep_input:
        inp.unlink()
    ratio = rows[1]["wall_seconds"] / rows[0]["wall_seconds"]
    print()
    print(f"input: {a.num_samples:,} samples, {input_bytes / 1e9:.2f} GB Parquet; "
          f"R={a.ranks}, B={a.batch_size_per_rank}")
    print(f"{'stage':<22}{'wall s':>10}{'peak RSS GiB':>14}")
    for row in rows:
        print(f"{row['stage']:<22}{row['wall_seconds']:>10.1f}{row['peak_rss_bytes'] / 2**30:>14.2f}")
    print(f"balance / copy wall-time ratio: {ratio:.2f}")
    print("balance stages (s): " + ", ".join(f"{k} {v:.1f}" for k, v in summary["stage_seconds"].items()))
    for row in rows:
        row.pop("stdout", None)
    result = {"num_samples": a.num_samples, "input_bytes": input_bytes, "num_ranks": a.ranks,
              "batch_size_per_rank": a.batch_size_per_rank, "rows": rows, "balance_over_copy": ratio,
              "cpu_count": os.cpu_count()}
    (out / "bench_e2e.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'bench_e2e.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
