"""The offline stage against the I/O floor: ``python -m benchmarks.bench_engines --engines copy,local``.

Per size, on one generated input (``fsdata synth``, lengths resampled from a real dataset, as
:mod:`benchmarks.bench_engines`), after reading the input once so it is in the page cache
(untimed), ``--rounds`` rounds (at least 3 for a ratio of record), each:

1. waits up to ``--settle-seconds`` for the 1-minute load average to fall to ``--max-load``
   (a run raises it by itself: the load average of a 2-core machine busy for a minute is ~1.3);
2. records the 1-minute load average, then runs a Polars copy of the input
   (``pl.scan_parquet(INPUT).sink_parquet(OUT)``) and ``fsdata balance --engine local``, each in
   a child process that reports its own figures at exit: wall seconds, balance's stage seconds
   (``read_lengths``, ``plan``, ``write_ranks``, ``finalize``), bytes read and written
   (``/proc/self/io``: ``rchar``/``wchar`` through system calls, ``read_bytes``/``write_bytes`` at
   the storage layer, i.e. pages dirtied), peak resident memory (``ru_maxrss``), and CPU seconds,
   user and system apart, of the whole child (``getrusage(RUSAGE_CHILDREN)`` in this process
   around it: interpreter start and imports included; all threads).

A round whose load average before it exceeds ``--max-load`` (0.5: on a 2-core machine, more
than a quarter of the cores already busy) is **marked** (``"loaded": true``) and left out of the
**ratio of record**: the median of the per-round ratios balance / copy over the unmarked rounds
(None when fewer than ``--min-quiet-rounds`` are unmarked). The ratio of the medians over every
round is reported next to it. The output is deleted before each run (not timed). Writes
``OUT/bench_offline_stage.json`` and prints a table per round and per size.

``--quick``: 20,000 samples, R=8, 3 rounds, no settling: exercises every part in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD_FLAG = "--measure-child"
#: ``--quick`` settings (applied where the flag was not given).
QUICK = {"sizes": "20000", "ranks": 8, "rounds": 3, "settle_seconds": 0.0}


def proc_io() -> dict[str, int]:
    """This process's I/O counters (``/proc/self/io``; all threads, including ended ones)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def measure_child(argv: list[str]) -> int:
    """Child side: ``--measure-child RESULT.json (-m MODULE ARGS... | -c CODE)``: run the target in
    this process, then write its wall seconds, I/O counters, CPU seconds and peak RSS to RESULT.json."""
    result, kind, target, *rest = argv
    t0 = time.perf_counter()
    code = 0
    try:
        if kind == "-m":
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            exec(compile(target, "<copy>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    wall = time.perf_counter() - t0
    sys.stdout.flush()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(result).write_text(json.dumps({"inner_wall_seconds": wall, "io": proc_io(),
                                        "inner_cpu_seconds": ru.ru_utime + ru.ru_stime,
                                        "peak_rss_bytes": ru.ru_maxrss * 1024}))
    return code


def run_child_measured(target: list[str], env: dict, result: Path) -> dict:
    """Run ``python -m benchmarks.bench_offline_stage --measure-child`` on ``target``: wall seconds
    and CPU seconds (user, system) of the whole child, plus its own report."""
    cmd = [sys.executable, "-m", "benchmarks.bench_offline_stage", CHILD_FLAG, str(result), *target]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    rep = json.loads(result.read_text())
    result.unlink()
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"wall_seconds": wall, "cpu_user_seconds": user, "cpu_system_seconds": sys_,
            "cpu_seconds": user + sys_, **rep, "stdout": r.stdout}


def warm_page_cache(path: Path) -> dict:
    """Read every file under ``path`` once (1 MiB reads) so the rounds find it in the page cache."""
    t0, n = time.perf_counter(), 0
    for p in ([path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())):
        with open(p, "rb", buffering=0) as f:
            while b := f.read(1 << 20):
                n += len(b)
    return {"bytes": n, "seconds": time.perf_counter() - t0}


def settle(max_load: float, timeout_s: float, poll_s: float = 5.0) -> dict:
    """Wait until the 1-minute load average is at most ``max_load`` or ``timeout_s`` passed;
    returns the load average then and the seconds waited."""
    t0 = time.perf_counter()
    while os.getloadavg()[0] > max_load and time.perf_counter() - t0 < timeout_s:
        time.sleep(min(poll_s, max(0.0, timeout_s - (time.perf_counter() - t0))))
    return {"load_average_1m": os.getloadavg()[0], "settle_seconds": time.perf_counter() - t0}


def ratio_of_record(rounds: list[dict], min_rounds: int = 3) -> float | None:
    """Median of ``round["ratio"]`` over the rounds not marked ``"loaded"``; None when fewer than
    ``min_rounds`` are unmarked (then no figure may be quoted as the ratio of record)."""
    quiet = [r["ratio"] for r in rounds if not r["loaded"]]
    return statistics.median(quiet) if len(quiet) >= max(1, min_rounds) else None


def _rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_vs_copy(n: int, a: argparse.Namespace, work: Path) -> dict:
    """Alternate a Polars copy and ``fsdata balance --engine local`` ``a.rounds`` times on one input."""
    py = sys.executable
    env = {**os.environ}
    inp = work / f"synth-{n}-L{a.max_seq_len}.parquet"
    if not inp.exists():
        subprocess.run([py, "-m", "fsdata", "synth", str(inp), "--num-samples", str(n), "--lengths-from",
                        a.lengths_from, "--layout", "event", "--max-seq-len", str(a.max_seq_len), "--no-progress"],
                       check=True, env=env)
    warm = warm_page_cache(inp)
    copy_out, bal_out, res = work / f"copy-{n}.parquet", work / f"out-local-{n}", work / f"child-{n}.json"
    copy_code = f"import polars as pl; pl.scan_parquet({str(inp)!r}).sink_parquet({str(copy_out)!r})"
    bal = ["-m", "fsdata", "balance", str(inp), str(bal_out), "--ranks", str(a.ranks), "--batch-size-per-rank",
           str(a.batch_size_per_rank), "--cost-model", a.cost_model, "--num-threads", str(a.ray_cpus),
           "--bucket-compression", a.bucket_compression, "--no-progress", "--json",
           *(["--plan-window", str(a.plan_window)] if a.plan_window else [])]
    rounds = []
    for i in range(a.rounds):
        _rm(copy_out)
        _rm(bal_out)
        before = settle(a.max_load, a.settle_seconds)
        c = run_child_measured(["-c", copy_code], env, res)
        c.pop("stdout")
        c["output_bytes"] = _tree_bytes(copy_out)
        _rm(copy_out)
        b = run_child_measured(bal, env, res)
        b["stage_seconds"] = json.loads(b.pop("stdout")).get("stage_seconds", {})
        b["output_bytes"] = _tree_bytes(bal_out)
        b["format_version"] = json.loads((bal_out / "_manifest.json").read_text())["format_version"]
        if not a.keep_outputs or i + 1 < a.rounds:
            _rm(bal_out)
        loaded = before["load_average_1m"] > a.max_load
        rounds.append({"round": i + 1, **before, "loaded": loaded, "load_average_1m_after": os.getloadavg()[0],
                       "copy": c, "balance": b, "ratio": b["wall_seconds"] / c["wall_seconds"],
                       "cpu_ratio": b["cpu_seconds"] / c["cpu_seconds"]})
        print(f"  {n:,} round {i + 1}: load {before['load_average_1m']:.2f}"
              f"{' (LOADED: not of record)' if loaded else ''}"
              f"; copy {c['wall_seconds']:.1f} s, balance {b['wall_seconds']:.1f} s "
              f"({', '.join(f'{k} {v:.1f}' for k, v in b['stage_seconds'].items())}), "
              f"ratio {rounds[-1]['ratio']:.2f}; CPU s copy {c['cpu_seconds']:.1f}, balance {b['cpu_seconds']:.1f}",
              flush=True)
    copy_s = _med([r["copy"]["wall_seconds"] for r in rounds])
    bal_s = _med([r["balance"]["wall_seconds"] for r in rounds])
    last = rounds[-1]["balance"]
    row = {"num_samples": n, "input_bytes": inp.stat().st_size, "page_cache_warm": warm, "rounds": rounds,
           "max_load": a.max_load, "quiet_rounds": sum(not r["loaded"] for r in rounds),
           "ratio_of_record": ratio_of_record(rounds, a.min_quiet_rounds),
           "copy_seconds_median": copy_s, "balance_seconds_median": bal_s, "ratio_of_medians": bal_s / copy_s,
           "ratio_per_round": [r["ratio"] for r in rounds],
           "load_average_1m_per_round": [r["load_average_1m"] for r in rounds],
           "stage_seconds_median": {k: _med([r["balance"]["stage_seconds"][k] for r in rounds])
                                    for k in last["stage_seconds"]},
           "balance_peak_rss_bytes": max(r["balance"]["peak_rss_bytes"] for r in rounds),
           "copy_peak_rss_bytes": max(r["copy"]["peak_rss_bytes"] for r in rounds),
           "balance_output_bytes": last["output_bytes"], "copy_output_bytes": rounds[-1]["copy"]["output_bytes"],
           "format_version": last["format_version"], "bucket_compression": a.bucket_compression,
           "balance_write_bytes": max(r["balance"]["io"]["write_bytes"] for r in rounds),
           "balance_wchar": max(r["balance"]["io"]["wchar"] for r in rounds),
           "balance_read_bytes": max(r["balance"]["io"]["read_bytes"] for r in rounds),
           "balance_rchar": max(r["balance"]["io"]["rchar"] for r in rounds),
           "copy_write_bytes": max(r["copy"]["io"]["write_bytes"] for r in rounds),
           "copy_rchar": max(r["copy"]["io"]["rchar"] for r in rounds),
           "copy_cpu_seconds_median": _med([r["copy"]["cpu_seconds"] for r in rounds]),
           "balance_cpu_seconds_median": _med([r["balance"]["cpu_seconds"] for r in rounds])}
    row["written_over_output"] = row["balance_write_bytes"] / max(row["balance_output_bytes"], 1)
    row["cpu_ratio_of_medians"] = row["balance_cpu_seconds_median"] / row["copy_cpu_seconds_median"]
    if not a.keep_input:
        inp.unlink()
    return row


def print_vs_copy(rows: list[dict], a: argparse.Namespace) -> None:
    gib, gb = 1024**3, 1e9
    print(f"\nfsdata balance --engine local vs pl.scan_parquet(IN).sink_parquet(OUT), R={a.ranks} "
          f"B={a.batch_size_per_rank}, cost {a.cost_model}, max_seq_len {a.max_seq_len}, {a.rounds} rounds "
          f"alternated, input in the page cache, format_version {rows[0]['format_version'] if rows else '?'}, "
          f"--bucket-compression {a.bucket_compression}; rounds starting above load {a.max_load} are not of record")
    print("| samples | round | load 1m before | copy s | balance s | ratio | CPU s copy (user+sys) | "
          "CPU s balance (user+sys) | read_lengths | plan | write_ranks | finalize |")
    print("|" + "---|" * 12)
    for r in rows:
        for x in r["rounds"]:
            c, b, st = x["copy"], x["balance"], x["balance"]["stage_seconds"]
            print(f"| {r['num_samples']:,} | {x['round']} | "
                  f"{x['load_average_1m']:.2f}{' LOADED' if x['loaded'] else ''}"
                  f" | {c['wall_seconds']:.1f} | {b['wall_seconds']:.1f} | {x['ratio']:.2f} | "
                  f"{c['cpu_user_seconds']:.1f}+{c['cpu_system_seconds']:.1f} | "
                  f"{b['cpu_user_seconds']:.1f}+{b['cpu_system_seconds']:.1f} | {st.get('read_lengths', 0):.1f} | "
                  f"{st.get('plan', 0):.1f} | {st.get('write_ranks', 0):.1f} | {st.get('finalize', 0):.1f} |")
    print("\n| samples | input GB | quiet rounds | **ratio of record** (median, quiet rounds) | "
          "ratio of medians (all) | "
          "copy s | balance s | CPU s copy | CPU s balance | CPU ratio | balance peak RSS GiB | copy peak RSS GiB | "
          "balance written GB | output GB | written / output |")
    print("|" + "---|" * 15)
    for r in rows:
        rec = r["ratio_of_record"]
        print(f"| {r['num_samples']:,} | {r['input_bytes'] / gb:.2f} | {r['quiet_rounds']}/{len(r['rounds'])} | "
              f"**{'none (too few quiet rounds)' if rec is None else f'{rec:.2f}'}** | {r['ratio_of_medians']:.2f} | "
              f"{r['copy_seconds_median']:.1f} | {r['balance_seconds_median']:.1f} | "
              f"{r['copy_cpu_seconds_median']:.1f} | {r['balance_cpu_seconds_median']:.1f} | "
              f"{r['cpu_ratio_of_medians']:.2f} | {r['balance_peak_rss_bytes'] / gib:.2f} | "
              f"{r['copy_peak_rss_bytes'] / gib:.2f} | {r['balance_write_bytes'] / gb:.2f} | "
              f"{r['balance_output_bytes'] / gb:.2f} | {r['written_over_output']:.2f} |")


def run(a: argparse.Namespace, given: set[str]) -> int:
    """``--engines copy,local``: every size of ``a.sizes``; ``given``: the options set on the command
    line (``--quick`` fills in the others from :data:`QUICK`)."""
    if a.quick:
        for k, v in QUICK.items():
            if k not in given:
                setattr(a, k, v)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in [int(x) for x in a.sizes.split(",") if x]:
        rows.append(bench_vs_copy(n, a, work))
        (out / "bench_offline_stage.json").write_text(json.dumps(
            {"settings": vars(a), "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
             "results": rows}, indent=2) + "\n")
    print_vs_copy(rows, a)
    print(f"JSON: {out / 'bench_offline_stage.json'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD_FLAG:
        sys.exit(measure_child(sys.argv[2:]))
    sys.exit("run it as: python -m benchmarks.bench_engines --engines copy,local [--quick]")
