"""Batch composition benchmark (issue 10): predicted bubble per setting and the proven bound.

Every visible dataset in ``../shared/datasets`` is converted per event (``fsdata convert ...
--samples per-event --max-seq-len 512``, cached in ``--work``), costed with ``L^2 + 64L``
(``--cost-model quadratic``) and planned exactly as ``fsdata balance`` plans it
(:func:`fsdata.balancer.plan.make_plan`), for R in {8, 64, 256} and B in {4, 8, 32}:

* ``shuffle``: today's practice (equal contiguous per-rank batches of the random global batch);
* ``W=1``: per-step balancing only (no composition), with its proven (pigeonhole) bound;
* ``W=w`` for every shipped window (:data:`fsdata.balancer.compose.SHIPPED_WINDOWS`), with the proven bound
  of the composed steps; a window larger than the data is all steps (rows deduplicated);
* ``cost-budget``: variable per-rank counts (count range and step count given).

Exact check of the bound: at R=8 (B=4, 8) the 8 steps furthest above their pigeonhole bound are
solved exactly with CP-SAT (:func:`fsdata.balancer.cpsat.tighten_step_bounds`, 0.5 deterministic s each):
proven optima confirm or raise the bound.

The grid uses ``--partitioner lpt-swap`` (fast); the target rows (Amazon Beauty and Sports at
R=256 B=32 and R=64 B=8, MovieLens-1M at R=256 B=32) are also planned with ``auto`` (what
``fsdata balance`` uses: lpt-swap plus time-bounded CP-SAT on steps far from the bound).
Composition time: ``make_plan`` on MovieLens-1M R=256 B=32 with and without the default window,
side by side (the whole ``fsdata balance`` wall time is measured with the CLI, docs/balancer.md).

Prints markdown tables; writes ``bench_compose.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW, SHIPPED_WINDOWS
from fsdata.samples.convert import convert
from fsdata.balancer.cost import load_cost_model
from fsdata.errors import FsdataError
from fsdata.balancer.plan import make_plan
from fsdata.samples.synth import detect_format

DATASETS = Path(os.environ.get("FREESCALE_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
RANKS = (8, 64, 256)
BATCHES = (4, 8, 32)
TARGETS = {("amazon-beauty_bert4rec", 256, 32), ("amazon-beauty_bert4rec", 64, 8),
           ("s3rec_sports_and_outdoors", 256, 32), ("s3rec_sports_and_outdoors", 64, 8),
           ("ml-1m_ensfm", 256, 32)}


def dataset_files() -> list[tuple[str, Path]]:
    """(name, interaction file) of every dataset folder present, sorted by name."""
    out = []
    if DATASETS.is_dir():
        for d in sorted(p for p in DATASETS.iterdir() if p.is_dir()):
            files = sorted(f for f in d.iterdir() if f.suffix in (".txt", ".csv") and f.name != "README.txt")
            if files:
                out.append((d.name, files[0]))
    return out


def per_event_costs(name: str, path: Path, work: Path) -> np.ndarray:
    """Convert ``path`` per event (cached under ``work``) and return quadratic costs in row order."""
    out = work / f"{name}.parquet"
    if not out.exists():
        fmt = detect_format(path)
        if fmt == "csv":
            convert(path, out, fmt="events", samples="per-event", max_seq_len=512, user_col="userId",
                    item_col="Id", time_col="timestamp", sep=",", has_header=True, progress=False)
        else:
            convert(path, out, fmt=fmt, samples="per-event", max_seq_len=512, progress=False)
    lengths = pq.read_table(out, columns=["seq_len"]).column(0).to_numpy()
    return load_cost_model("quadratic").cost(lengths)


def bench_setting(name: str, costs: np.ndarray, R: int, B: int, windows: tuple[int, ...],
                  partitioner: str) -> dict | None:
    """All options for one (dataset, R, B); None when the data do not fill one step."""
    if len(costs) < R * B:
        return None
    row: dict = {"dataset": name, "num_ranks": R, "batch_size_per_rank": B, "partitioner": partitioner,
                 "num_samples": int(len(costs)), "windows": []}
    seen = set()
    for w in windows:
        t0 = time.perf_counter()
        p = make_plan(costs, num_ranks=R, batch_size_per_rank=B, compose_window=w, partitioner=partitioner)
        dt = time.perf_counter() - t0
        row["num_steps"] = p.num_steps
        row["shuffle_bubble"] = p.baseline_bubble
        if p.compose_window in seen:
            continue
        seen.add(p.compose_window)
        row["windows"].append({"compose_window_requested": w, "compose_window": p.compose_window,
                               "predicted_bubble": p.predicted_bubble, "lower_bound_bubble": p.lower_bound_bubble,
                               "lower_bound_bubble_simple": p.lower_bound_bubble_simple,
                               "partition_info": p.partition_info, "plan_seconds": dt})
    try:
        p = make_plan(costs, num_ranks=R, batch_size_per_rank=B, batch_policy="cost-budget")
        c = p.count_distribution()
        row["cost_budget"] = {"predicted_bubble": p.predicted_bubble, "num_steps": p.num_steps,
                              "budget_used": p.budget_used, "per_rank_count": c}
    except FsdataError as e:
        row["cost_budget"] = {"error": str(e)}
    return row


def exact_row(name: str, costs: np.ndarray, R: int, B: int) -> dict:
    """Per-step balancing (W=1, lpt-swap) with the bound tightened by exact CP-SAT on 8 steps."""
    from fsdata.balancer import bubble
    from fsdata.balancer.cpsat import tighten_step_bounds

    p = make_plan(costs, num_ranks=R, batch_size_per_rank=B, compose_window=1, partitioner="lpt-swap")
    kept = np.flatnonzero(p.step >= 0)
    order = kept[np.argsort(p.step[kept], kind="stable")]
    sc = costs[order].reshape(p.num_steps, R * B)
    lb = bubble.step_proven_bound(sc, R, B)
    tight, info = tighten_step_bounds(sc, R, B, lb, p.loads.max(axis=1), max_steps=8, time_limit_seconds=0.5)
    return {"dataset": name, "num_ranks": R, "batch_size_per_rank": B, **info,
            "bound_pigeonhole": bubble.bound_bubble(sc, lb, R), "bound_tightened": bubble.bound_bubble(sc, tight, R),
            "predicted_bubble": p.predicted_bubble}


def _fmt_cb(cb: dict) -> str:
    if "error" in cb:
        return "-"
    c = cb["per_rank_count"]
    return f"{cb['predicted_bubble']:.3%} [{c['min']}..{c['max']}/rank, {cb['num_steps']} steps]"


def print_table(rows: list[dict], windows: tuple[int, ...]) -> None:
    print("| dataset | R | B | steps | shuffle | " + " | ".join(f"W={w}" for w in windows) + " | cost-budget |")
    print("|---|---|---|---|---|" + "---|" * len(windows) + "---|")
    for r in rows:
        by_req = {}
        for x in r["windows"]:
            by_req[x["compose_window_requested"]] = x
        cells = []
        last = None
        for w in windows:
            x = by_req.get(w)
            if x is None:
                cells.append(f"= W={last}" if last else "-")
                continue
            last = x["compose_window"]
            tag = "" if x["compose_window"] == w else f" (all {x['compose_window']})"
            cells.append(f"{x['predicted_bubble']:.3%} (bound {x['lower_bound_bubble']:.3%}){tag}")
        print(f"| {r['dataset']} | {r['num_ranks']} | {r['batch_size_per_rank']} | {r['num_steps']} | "
              f"{r['shuffle_bubble']:.2%} | " + " | ".join(cells) + f" | {_fmt_cb(r['cost_budget'])} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_compose", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-output", help="folder for bench_compose.json")
    ap.add_argument("--work", default=None, help="cache of converted datasets (default OUT/compose-work)")
    ap.add_argument("--quick", action="store_true", help="smoke run: two datasets, R=64 only, W in {1, 16}")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else out / "compose-work"
    work.mkdir(parents=True, exist_ok=True)
    files = dataset_files()
    if not files:
        print(f"no datasets under {DATASETS}; set FREESCALE_DATASETS", file=sys.stderr)
        return 2
    windows = tuple(sorted(set(SHIPPED_WINDOWS) | {DEFAULT_COMPOSE_WINDOW}))
    ranks, batches = RANKS, BATCHES
    if a.quick:
        files, windows, ranks = files[:2], (1, 16), (64,)
    t_start = time.perf_counter()
    rows, targets = [], []
    costs_by_name = {}
    for name, path in files:
        costs_by_name[name] = costs = per_event_costs(name, path, work)
        for R in ranks:
            for B in batches:
                row = bench_setting(name, costs, R, B, windows, "lpt-swap")
                if row is not None:
                    rows.append(row)
    print("\n### Predicted bubble, per event, cost L^2+64L, lpt-swap per step (proven bound of the same steps)\n")
    print_table(rows, windows)
    if not a.quick:
        for name, R, B in sorted(TARGETS):
            if name in costs_by_name:
                row = bench_setting(name, costs_by_name[name], R, B, windows, "auto")
                if row is not None:
                    targets.append(row)
        print("\n### Target rows with `--partitioner auto` (what fsdata balance uses)\n")
        print_table(targets, windows)
    exact = []
    if not a.quick:
        print("\n### Exact CP-SAT on sampled steps (W=1, lpt-swap; the 8 steps furthest above the pigeonhole "
              "bound, 0.5 deterministic s each)\n")
        print("| dataset | R | B | steps solved | proven optimal | lpt-swap optimal | run bound pigeonhole | "
              "run bound tightened | lpt-swap bubble |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, costs in costs_by_name.items():
            for R, B in ((8, 4), (8, 8)):
                if len(costs) >= R * B:
                    exact.append(exact_row(name, costs, R, B))
                    e = exact[-1]
                    print(f"| {name} | {R} | {B} | {e['steps_tried']} | {e['steps_proven_optimal']} | "
                          f"{e['steps_heuristic_optimal']} | {e['bound_pigeonhole']:.3%} | "
                          f"{e['bound_tightened']:.3%} | "
                          f"{e['predicted_bubble']:.3%} |", flush=True)
    timing = {}
    if "ml-1m_ensfm" in costs_by_name and not a.quick:
        c = costs_by_name["ml-1m_ensfm"]
        for label, w in (("W=1", 1), (f"W={DEFAULT_COMPOSE_WINDOW}", DEFAULT_COMPOSE_WINDOW), ("W=1 again", 1)):
            t0 = time.perf_counter()
            make_plan(c, num_ranks=256, batch_size_per_rank=32, compose_window=w)
            timing[label] = time.perf_counter() - t0
        print("\nmake_plan seconds, MovieLens-1M per event, R=256 B=32 (auto): "
              + ", ".join(f"{k} {v:.2f}" for k, v in timing.items()))
    result = {"benchmark": "bench_compose", "windows": list(windows), "default_compose_window": DEFAULT_COMPOSE_WINDOW,
              "datasets_dir": str(DATASETS), "rows": rows, "target_rows_auto": targets, "plan_seconds_ml1m": timing,
              "exact_cpsat_rows": exact,
              "wall_seconds": time.perf_counter() - t_start, "python": sys.version.split()[0],
              "machine": platform.machine(), "cpu_count": os.cpu_count()}
    (out / "bench_compose.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out / 'bench_compose.json'} ({result['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
