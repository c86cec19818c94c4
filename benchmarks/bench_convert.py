"""Benchmark ``fsdata convert`` on large generated inputs: wall seconds and peak RSS per input format.

Generates one input per format (about ``--size-gb`` GB each; the Parquet input holds the same
events as the CSV) under ``--work`` (default: a new folder under /tmp), converts each with the
``fsdata convert`` command line in a child process, reports the child's wall seconds and peak RSS
(GNU time's ``%M``: ``/usr/bin/time`` forks the child from its own small process, so the figure is
the converting process's own peak; ``ru_maxrss`` from ``os.wait4`` of a child of this large process
would also count the pages the child inherited before ``exec``), deletes the inputs and outputs, prints a table and
writes JSON.

    PYTHONPATH=. python -m benchmarks.bench_convert [--size-gb 2] [--samples per-user] [--out bench_convert.json]
    PYTHONPATH=/work/main python -m benchmarks.bench_convert --python-path OLD_TREE   # the same inputs, other code

The generated logs are sparse (issue 19, item 12): events of uniformly drawn users (about
``--events-per-user`` each) in random order, so a user's events are spread over the whole file,
which is the hard case for per-user grouping; items uniform in [0, 10^6).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

#: Events generated per write while building an input (bounds this process's memory).
_EVENTS_PER_BLOCK = 4_000_000
_NUM_ITEMS = 1_000_000


def _write_events(path: Path, size_bytes: int, events_per_user: int, seed: int, *, csv: bool,
                  strings: bool = False) -> int:
    """Append blocks of random events until ``path`` holds ``size_bytes``; returns the number of events.
    ``strings``: ids as strings (``u12345``, Amazon-style ``B000012345`` items), mapped by convert."""
    rng = np.random.default_rng(seed)
    num_users = max(1, size_bytes // (16 * events_per_user))
    n = 0
    with open(path, "wb") as f:
        if csv:
            f.write(b"user,item,timestamp\n")
        while f.tell() < size_bytes:
            k = _EVENTS_PER_BLOCK
            df = pl.DataFrame({"user": rng.integers(0, num_users, k), "item": rng.integers(0, _NUM_ITEMS, k)})
            if strings:
                df = df.select(user=pl.lit("u") + pl.col("user").cast(pl.String),
                               item=pl.lit("B") + pl.col("item").cast(pl.String).str.pad_start(9, "0"))
            if csv:
                df = df.with_columns(timestamp=pl.int_range(n, n + k) + 1_600_000_000)
            df.write_csv(f, include_header=False, separator="," if csv else " ")
            n += k
    return n


def _write_sequences(path: Path, size_bytes: int, events_per_user: int, seed: int) -> int:
    """``user item1 item2 ...`` lines, lengths 2 + Poisson(events_per_user - 2); returns the number of events."""
    rng = np.random.default_rng(seed)
    user = n = 0
    with open(path, "wb") as f:
        while f.tell() < size_bytes:
            lengths = 2 + rng.poisson(max(0, events_per_user - 2), _EVENTS_PER_BLOCK // events_per_user)
            items = rng.integers(0, _NUM_ITEMS, int(lengths.sum()))
            users = np.arange(user, user + len(lengths))
            line_of = np.repeat(np.arange(len(lengths)), lengths)
            text = (pl.DataFrame({"line": line_of, "item": items}).group_by("line", maintain_order=True)
                    .agg(pl.col("item").cast(pl.String).str.join(" "))
                    .select(pl.concat_str([pl.Series(users).cast(pl.String), pl.col("item")], separator=" ")))
            f.write(("\n".join(text.to_series().to_list()) + "\n").encode())
            user += len(lengths)
            n += int(lengths.sum())
    return n


def _run(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; wall seconds and the child's own peak RSS in MiB (GNU time's ``%M``, KiB on Linux).

    Falls back to ``ru_maxrss`` of ``os.wait4`` (an upper bound, see the module docstring) when
    ``/usr/bin/time`` is absent; ``peak_rss_source`` says which.
    """
    gnu_time = shutil.which("time", path="/usr/bin")
    with tempfile.NamedTemporaryFile("r", suffix=".maxrss") as rss_file:
        full = [gnu_time, "-f", "%M", "-o", rss_file.name, *cmd] if gnu_time else cmd
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        timed = rss_file.read().strip().splitlines() if gnu_time else []
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    kib, source = ((int(timed[-1]), "GNU time %M") if timed and timed[-1].isdigit()
                   else (usage.ru_maxrss, "os.wait4 ru_maxrss (upper bound)"))
    return {"exit_code": proc.returncode, "wall_seconds": round(wall, 1), "peak_rss_mib": round(kib / 1024, 1),
            "peak_rss_source": source, "stdout": out.decode().strip(), "stderr": err.decode().strip()[-400:]}


def _save(a: argparse.Namespace, tree: str, rows: list[dict]) -> None:
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": {
        "host": platform.node(), "cpus": os.cpu_count(), "memory_gib": round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "load_average_1min":
            round(os.getloadavg()[0], 1), "python": platform.python_version(), "polars": pl.__version__},
        "command": " ".join(["python -m benchmarks.bench_convert", *sys.argv[1:]]), "python_path": tree,
        "samples": a.samples, "events_per_user": a.events_per_user, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="bytes of each text input, in GB (10^9)")
    p.add_argument("--samples", default="per-user", choices=["per-user", "per-event"])
    p.add_argument("--events-per-user", type=int, default=10)
    p.add_argument("--formats", default="sequences,events-text,events-csv,events-parquet,events-csv-strings")
    p.add_argument("--work", default=None, help="folder for inputs and outputs (default: new under /tmp)")
    p.add_argument("--python-path", default=None, help="PYTHONPATH of the child (default: this tree)")
    p.add_argument("--keep", action="store_true", help="keep the generated inputs")
    p.add_argument("--out", default="bench_convert.json")
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-convert-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    size = int(a.size_gb * 1e9)
    tree = a.python_path or str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    rows = []
    try:
        for fmt in a.formats.split(","):
            t0 = time.perf_counter()
            if fmt == "sequences":
                src = work / "seq.txt"
                num_events = _write_sequences(src, size, a.events_per_user, seed=1)
                args = ["--format", "sequences"]
            elif fmt == "events-text":
                src = work / "events.txt"
                num_events = _write_events(src, size, a.events_per_user, seed=2, csv=False)
                args = ["--format", "events"]
            elif fmt in ("events-csv", "events-parquet"):
                csv = work / "events.csv"
                if not csv.exists():
                    num_events = _write_events(csv, size, a.events_per_user, seed=3, csv=True)
                args = ["--format", "events", "--user-col", "user", "--item-col", "item", "--time-col", "timestamp"]
                src = csv
                if fmt == "events-parquet":
                    src = work / "events.parquet"
                    pl.scan_csv(csv).sink_parquet(src, row_group_size=1 << 20)
                    num_events = pl.scan_parquet(src).select(pl.len()).collect().item()
            elif fmt == "events-csv-strings":  # string ids: mapped to indices, OUTPUT.vocab/ written
                src = work / "events-strings.csv"
                num_events = _write_events(src, size, a.events_per_user, seed=4, csv=True, strings=True)
                args = ["--format", "events", "--time-col", "timestamp"]
            else:
                raise SystemExit(f"unknown format {fmt}")
            gen = time.perf_counter() - t0
            out = work / f"{fmt}.parquet"
            cmd = [sys.executable, "-m", "fsdata", "convert", str(src), str(out), *args, "--samples", a.samples,
                   "--no-progress", "--json"]
            r = _run(cmd, env)
            r.update(format=fmt, input_bytes=src.stat().st_size, num_events=num_events,
                     output_bytes=out.stat().st_size if out.exists() else None, generate_seconds=round(gen, 1))
            if r["exit_code"] == 0:
                s = json.loads(r.pop("stdout"))
                r.update(num_users=s["num_users"], num_samples=s["num_samples"], num_events_counted=s["num_events"],
                         events_match=s["num_events"] == num_events)  # no event silently lost or added
            rows.append(r)
            _save(a, tree, rows)  # after every format, so a long run that is stopped keeps what it measured
            print(f"{fmt:15s} input {r['input_bytes'] / 1e9:5.2f} GB  {num_events:>12,} events  "
                  f"exit {r['exit_code']}  {r['wall_seconds']:7.1f} s  peak RSS {r['peak_rss_mib']:8.1f} MiB"
                  + ("" if r.get("events_match", True) else
                     f"  EVENTS COUNTED {r['num_events_counted']:,} != {num_events:,} WRITTEN"), flush=True)
            out.unlink(missing_ok=True)
            shutil.rmtree(f"{out}.vocab", ignore_errors=True)
            if not a.keep and (fmt != "events-csv" or "events-parquet" not in a.formats):
                src.unlink(missing_ok=True)
                if fmt == "events-parquet":
                    (work / "events.csv").unlink(missing_ok=True)
    finally:
        if not a.keep and not a.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {a.out}")
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
