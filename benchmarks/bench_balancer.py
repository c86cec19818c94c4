"""Benchmark of the per-step balancers and the cost-budget policy on real and synthetic lengths.

Usage::

    python -m benchmarks.bench_balancer [--quick] [--out DIR] [--big-samples N]

Rows: every dataset in ``../shared/datasets`` under two sample layouts (per-user: one sample per
user, length ``n - 1``; per-event: one sample per interaction, history capped at 512), every
``R in {8, 64, 256}`` and ``B in {4, 8, 32, 128}`` with at least one full step, then synthetic
lengths resampled from MovieLens-1M per-event (10M samples), then 100M samples through
:func:`fsdata.balancer.partitioners.partition_steps_chunked` in a child process (peak RSS of that process).
Cost model: ``quadratic`` (``L^2 + 64 L``), plus the cost-budget headline on MovieLens-1M per-user
with ``hstu`` and ``quadratic``.

Columns: predicted run bubble (:func:`fsdata.balancer.bubble.run_bubble`), gap to the equal-count lower
bound of the same steps in percentage points, samples per second (wall) and per CPU-second,
tracemalloc peak (Python/NumPy heap; numba's per-thread scratch, O(R*B), is not traced).
Slow methods (``lpt`` pure Python, ``kk``) run on a prefix of steps, ``lpt-swap-cpsat`` on fewer;
each row's gap is against the lower bound of its own steps. Writes ``DIR/bench_balancer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from fsdata.balancer.bubble import lower_bound_bubble, run_bubble
from fsdata.balancer.cost import load_cost_model
from fsdata.balancer.cost_budget import plan_cost_budget, step_rank_loads
from fsdata.errors import ConfigError
from fsdata.balancer.partition import per_rank_loads
from fsdata.balancer.partitioners import partition_steps
from fsdata.samples.synth import read_lengths

DATASETS = Path(os.environ.get("FREESCALE_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
FILES = ["ml-1m_ensfm/sequences.txt", "ml-latest-small/ratings.csv", "amazon-beauty_bert4rec/beauty.txt",
         "s3rec_sports_and_outdoors/Sports_and_Outdoors.txt", "s3rec_toys_and_games/Toys_and_Games.txt"]
METHODS = ["shuffle", "roundrobin", "kk", "lpt", "lpt-swap", "lpt-swap-cpsat", "cost-budget"]
SLOW = {"lpt", "kk"}


def _run(fn, trace: bool):
    """Run fn(); return (result, wall_s, cpu_s, tracemalloc peak bytes or None)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = None
    if trace and wall < 1.0:
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, wall, cpu, peak


def bench_steps(costs: np.ndarray, R: int, B: int, cfg: dict, label: dict) -> list[dict]:
    """All methods on one (lengths, R, B); costs in shuffled order, ``[N]``."""
    S = len(costs) // (R * B)
    rows = []
    for method in METHODS:
        if method == "cost-budget":
            try:
                (step, rank), wall, cpu, peak = _run(lambda: plan_cost_budget(costs, R, B), cfg["trace"])
            except ConfigError as e:  # too little data for one step of R budgets
                print(f"skip cost-budget {label} R={R} B={B}: {e}", flush=True)
                continue
            loads, counts = step_rank_loads(costs, step, rank, R)
            n = len(costs)
            fixed = costs[: S * R * B].reshape(S, R * B)
            lb = lower_bound_bubble(fixed, R, B)
            extra = {"mean_samples_per_rank_step": float(counts.mean()) if counts.size else 0.0,
                     "num_dropped": int((step < 0).sum())}
            bubble, steps = run_bubble(loads), loads.shape[0]
        else:
            cap = cfg["max_samples"]
            if method in SLOW:
                cap = min(cap, cfg["max_slow_samples"])
            if method == "lpt-swap-cpsat":
                if B > cfg["cpsat_max_b"]:
                    continue
                cap = min(cap, cfg["cpsat_steps"] * R * B)
            steps = max(1, min(S, cap // (R * B)))
            C = costs[: steps * R * B].reshape(steps, R * B)
            kw = {"time_limit_seconds": cfg["cpsat_seconds"]} if method == "lpt-swap-cpsat" else {}
            ranks, wall, cpu, peak = _run(lambda: partition_steps(C, R, B, method, **kw), cfg["trace"])
            bubble, lb, n, extra = run_bubble(per_rank_loads(C, ranks, R)), lower_bound_bubble(C, R, B), C.size, {}
        rows.append({**label, "R": R, "B": B, "method": method, "steps": int(steps), "samples": int(n),
                     "bubble_pct": 100 * bubble, "gap_pp": 100 * (bubble - lb), "lower_bound_pct": 100 * lb,
                     "samples_per_s": n / wall if wall > 0 else float("inf"),
                     "samples_per_cpu_s": n / cpu if cpu > 0 else float("inf"),
                     "peak_mib": None if peak is None else peak / 2**20, **extra})
        print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r: dict) -> str:
    mem = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
    more = f"  {r['mean_samples_per_rank_step']:.1f}/rank/step drop={r['num_dropped']}" \
        if "num_dropped" in r else ""
    return (f"{r['data']:<28} {r['layout']:<5} R={r['R']:<3} B={r['B']:<3} {r['method']:<14} "
            f"steps={r['steps']:<6} bubble={r['bubble_pct']:8.4f}% gap={r['gap_pp']:+8.4f}pp "
            f"{r['samples_per_s'] / 1e6:8.3f} M/s {r['samples_per_cpu_s'] / 1e6:8.3f} M/cpu-s mem={mem} MiB{more}")


def _peak_rss_mib() -> float:
    """Peak resident memory of this process (VmHWM; ru_maxrss would include the parent's at fork)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def big_child(num_samples: int, R: int, B: int, steps_per_chunk: int, num_threads: int) -> None:
    """Child process: ``num_samples`` synthetic costs through partition_steps_chunked; prints JSON."""
    from fsdata.samples.synth import synth_lengths

    src = read_lengths(DATASETS / FILES[0], "event")
    cost = load_cost_model("quadratic")
    S = num_samples // (R * B)
    stats = {"max": 0.0, "mean": 0.0, "lb": 0.0}

    def chunks():
        for k, start in enumerate(range(0, S, steps_per_chunk)):
            s = min(steps_per_chunk, S - start)
            yield cost.cost(synth_lengths(s * R * B, src, seed=k)).reshape(s, R * B)

    t0 = time.perf_counter()
    it = chunks()
    from fsdata.balancer.partition_fast import lpt_swap_steps

    rss_first = None
    for C in it:
        ranks, st = lpt_swap_steps(C, R, B, num_threads=num_threads, return_stats=True)
        if rss_first is None:
            rss_first = _peak_rss_mib()
        loads = per_rank_loads(C, ranks, R)
        stats["max"] += loads.max(axis=1).sum()
        stats["mean"] += loads.mean(axis=1).sum()
        stats["lb"] += st["lower_bound"].sum()
    wall = time.perf_counter() - t0
    # generation alone, for subtraction
    t1 = time.perf_counter()
    for C in chunks():
        pass
    gen_wall = time.perf_counter() - t1
    bubble = (stats["max"] - stats["mean"]) / stats["max"]
    lb = (stats["lb"] - stats["mean"]) / stats["lb"]
    print(json.dumps({"samples": S * R * B, "R": R, "B": B, "steps_per_chunk": steps_per_chunk,
                      "num_threads": num_threads, "wall_s_total": wall, "wall_s_generation": gen_wall,
                      "samples_per_s_partition": S * R * B / max(wall - gen_wall, 1e-9),
                      "bubble_pct": 100 * bubble, "gap_pp": 100 * (bubble - lb),
                      "peak_rss_mib_after_first_chunk": rss_first,
                      "peak_rss_mib": _peak_rss_mib(),
                      "costs_mib_if_held_at_once": S * R * B * 8 / 2**20}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    p.add_argument("--out", default="bench-output", help="folder for bench_balancer.json")
    p.add_argument("--big-samples", type=int, default=None, help="samples of the chunked run (default 100M; quick 0)")
    p.add_argument("--synth-samples", type=int, default=None, help="synthetic samples (default 10M; quick 1M)")
    p.add_argument("--num-threads", type=int, default=None, help="numba threads (default: all)")
    p.add_argument("--_big-child", nargs=5, type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._big_child:
        big_child(*a._big_child)
        return 0
    cfg = {"trace": True, "max_samples": 1 << 18, "max_slow_samples": 1 << 16, "cpsat_steps": 2,
           "cpsat_seconds": 0.25, "cpsat_max_b": 32}
    files, Rs, Bs = FILES, [8, 64, 256], [4, 8, 32, 128]
    synth_n = a.synth_samples or 10_000_000
    big_n = 100_000_000 if a.big_samples is None else a.big_samples
    if a.quick:
        cfg.update(max_samples=1 << 14, max_slow_samples=1 << 12, cpsat_steps=1, cpsat_seconds=0.1, cpsat_max_b=8)
        files, Rs, Bs = FILES[:1], [8, 64], [8, 32]
        synth_n = a.synth_samples or 1_000_000
        big_n = 0 if a.big_samples is None else a.big_samples
    cost = load_cost_model("quadratic")
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    t_start = time.perf_counter()
    partition_steps(np.ones((2, 8)), 2, 4)  # compile the kernels outside the timings
    for f in files:
        path = DATASETS / f
        if not path.exists():
            print(f"skip {path}: not present", file=sys.stderr)
            continue
        for layout in ("user", "event"):
            lengths = rng.permutation(read_lengths(path, layout, max_seq_len=512))
            costs = cost.cost(lengths)
            for R in Rs:
                for B in Bs:
                    if len(costs) >= R * B:
                        rows += bench_steps(costs, R, B, cfg, {"data": f.split("/")[0], "layout": layout})
    # cost-budget headline: MovieLens-1M per-user, hstu and quadratic costs, R=16, B=16
    ml = DATASETS / FILES[0]
    headline = []
    if ml.exists():
        user_lengths = rng.permutation(read_lengths(ml, "user"))
        for name in ("hstu", "quadratic"):
            cc = load_cost_model(name).cost(user_lengths)
            (step, rank), wall, _, _ = _run(lambda: plan_cost_budget(cc, 16, 16), False)
            loads, counts = step_rank_loads(cc, step, rank, 16)
            S = len(cc) // 256
            fixed = cc[: S * 256].reshape(S, 256)
            shuffle = per_rank_loads(fixed, partition_steps(fixed, 16, 16, "shuffle"), 16)
            headline.append({"cost_model": name, "R": 16, "B": 16, "cost_budget_bubble_pct": 100 * run_bubble(loads),
                             "fixed_lower_bound_pct": 100 * lower_bound_bubble(fixed, 16, 16),
                             "shuffle_bubble_pct": 100 * run_bubble(shuffle),
                             "steps": int(loads.shape[0]), "mean_samples_per_rank_step": float(counts.mean()),
                             "min_samples_per_rank_step": int(counts.min()),
                             "max_samples_per_rank_step": int(counts.max()),
                             "mean_samples_per_step": float(counts.sum(axis=1).mean()),
                             "num_dropped": int((step < 0).sum()), "num_samples": int(len(cc)), "wall_s": wall})
            print("cost-budget headline (ml-1m per-user, R=16, B=16):", json.dumps(headline[-1]), flush=True)
    # synthetic: lengths resampled from MovieLens-1M per-event
    if ml.exists() and synth_n:
        from fsdata.samples.synth import synth_lengths

        costs = cost.cost(synth_lengths(synth_n, read_lengths(ml, "event"), seed=1))
        for R, B in ([(256, 32), (64, 8), (8, 4)] if not a.quick else [(256, 32)]):
            rows += bench_steps(costs, R, B, {**cfg, "max_samples": synth_n},
                                {"data": "synthetic-ml1m", "layout": "event"})
    big = None
    if big_n and ml.exists():
        cmd = [sys.executable, "-m", "benchmarks.bench_balancer", "--_big-child", str(big_n), "256", "32", "128",
               str(a.num_threads or os.cpu_count() or 1)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        big = json.loads(res.stdout.strip().splitlines()[-1])
        print("chunked 100M-class run:", json.dumps(big), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
           "numba_threads": __import__("numba").get_num_threads(), "wall_s": time.perf_counter() - t_start,
           "argv": sys.argv[1:], "quick": a.quick}
    (out / "bench_balancer.json").write_text(json.dumps({"env": env, "config": cfg, "rows": rows,
                                                         "cost_budget_headline": headline, "chunked": big},
                                                        indent=1, default=float))
    print(f"wrote {out / 'bench_balancer.json'} ({len(rows)} rows, {env['wall_s']:.0f} s, load {env['loadavg_end']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
