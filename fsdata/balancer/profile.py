"""``fsdata profile``: length statistics, costs, and the bubble today's practice would have.

For R ranks and B samples per rank, the input is cut into seeded global batches (as ``fsdata
balance`` does) and the bubbles are reported (definitions in :mod:`fsdata.balancer.bubble`):

* ``baseline_bubble``: equal counts per rank, shuffled (a DistributedSampler; today's practice);
* ``lower_bound_bubble``: the proven (pigeonhole) bound: no equal-count per-step assignment of
  these global batches goes below it;
* ``options``: what each way out reaches, each computed for real: per-step balancing (lpt-swap,
  composition window 1) with its proven bound, every composition window of
  :data:`fsdata.balancer.compose.SHIPPED_WINDOWS` (same contract: B per rank), and cost-budget with the
  batch-size change it implies (per-rank count range, step count).

A step is *heavy-tailed beyond repair* when its largest sample alone (plus the B-1 smallest)
costs more than a rank's fair share (the step's total over R): then no per-step assignment helps.
The report says so and lists remedies, with a what-if table for length caps and larger B.
"""

from __future__ import annotations

import numpy as np

from fsdata.balancer import bubble
from fsdata.balancer.cost import CostModel
from fsdata.errors import FsdataError
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW, SHIPPED_WINDOWS
from fsdata.balancer.plan import check_settings, make_plan, shuffled_steps
from fsdata.balancer.settings import PlanSettings

DEFAULT_CAPS = (256, 512, 1024, 2048)


def _bubbles(costs: np.ndarray, R: int, B: int, seed: int) -> dict:
    steps, _ = shuffled_steps(len(costs), R, B, seed)
    sc = costs[steps]
    base = np.add.reduceat(sc, np.arange(0, R * B, B), axis=1) if len(sc) else np.zeros((0, R))
    lb_per_step = bubble.step_lower_bound(sc, R, B)
    fair = sc.sum(axis=1) / R
    return {"num_steps": int(len(sc)), "baseline_bubble": bubble.run_bubble(base),
            "lower_bound_bubble": bubble.lower_bound_bubble(sc, R, B),
            "lower_bound_bubble_simple": bubble.lower_bound_bubble(sc, R, B, kind="simple"),
            "steps_beyond_fair_share": int((lb_per_step > fair * (1 + 1e-12)).sum())}


def options(costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, seed: int = 0,
            compose_windows: tuple[int, ...] = SHIPPED_WINDOWS, partitioner: str = "lpt-swap") -> list[dict]:
    """What each option reaches for this input at R, B, each computed with the real planner.

    Args:
        costs: shape ``[N]``, float64.
        num_ranks: R.
        batch_size_per_rank: B.
        seed: global-batch seed.
        compose_windows: composition windows to try (1 = per-step balancing only).
        partitioner: per-step method (``lpt-swap``: fast; ``auto`` adds CP-SAT on the worst steps).

    Returns:
        rows ``{"option", "compose_window", "predicted_bubble", "lower_bound_bubble", "num_steps",
        "per_rank_count": {min, median, max, mean}}`` (cost-budget rows add ``budget``).
    """
    R, B = num_ranks, batch_size_per_rank
    rows = []
    for w in sorted(set(int(w) for w in compose_windows)):
        p = make_plan(costs, num_ranks=R, batch_size_per_rank=B, seed=seed, partitioner=partitioner, compose_window=w)
        if w > 1 and p.compose_window < w and any(r["compose_window"] == p.compose_window for r in rows):
            continue  # the window covers all steps already (same plan as a smaller window)
        rows.append({"option": "per-step balancing" if w == 1 else f"compose W={p.compose_window}",
                     "compose_window": p.compose_window, "predicted_bubble": p.predicted_bubble,
                     "lower_bound_bubble": p.lower_bound_bubble, "num_steps": p.num_steps,
                     "per_rank_count": p.count_distribution()})
    try:
        p = make_plan(costs, num_ranks=R, batch_size_per_rank=B, seed=seed, batch_policy="cost-budget")
        rows.append({"option": "cost-budget", "compose_window": 1, "predicted_bubble": p.predicted_bubble,
                     "lower_bound_bubble": None, "num_steps": p.num_steps, "budget": p.budget_used,
                     "per_rank_count": p.count_distribution()})
    except FsdataError:
        pass  # too little data for one cost-budget step: no row
    return rows


def profile(lengths: np.ndarray, cost_model: CostModel, *, num_ranks: int, batch_size_per_rank: int,
            seed: int = 0, caps: tuple[int, ...] = DEFAULT_CAPS, batch_multipliers: tuple[int, ...] = (2, 4, 8),
            compose_window: int | None = None, compose_windows: tuple[int, ...] = SHIPPED_WINDOWS,
            with_options: bool = True) -> dict:
    """Profile sequence lengths for a data-parallel setting.

    Args:
        lengths: shape ``[N]`` int, sequence lengths L.
        cost_model: per-sample cost model.
        num_ranks: R.
        batch_size_per_rank: B.
        seed: seed of the global-batch shuffle.
        caps: length caps for the what-if table (samples longer than a cap are truncated to it).
        batch_multipliers: larger per-rank batches for the what-if table (``B * k``).
        compose_window: the window ``balance`` would use (default
            :data:`fsdata.balancer.compose.DEFAULT_COMPOSE_WINDOW`); added to ``compose_windows``.
        compose_windows: windows to evaluate in ``options``.
        with_options: compute ``options`` (runs the planner once per option).

    Returns:
        JSON-able dict: ``lengths`` (count, mean, p50/p90/p99/max), ``cost`` (mean, max, max/mean),
        ``num_ranks``, ``batch_size_per_rank``, ``num_steps``, ``baseline_bubble``,
        ``lower_bound_bubble``, ``steps_beyond_fair_share``, ``heavy_tail_warning`` (str or None),
        ``what_if`` (rows: ``{"change", "lower_bound_bubble", "baseline_bubble"}``), ``options``
        (:func:`options`), ``compose_window`` (the default one), ``lower_bound_kind``.

    Raises:
        ConfigError: a value :class:`~fsdata.balancer.settings.PlanSettings` refuses.
        InputError: fewer samples than one step (:func:`fsdata.balancer.plan.check_settings`).
    """
    L = np.asarray(lengths)
    R, B = num_ranks, batch_size_per_rank
    compose_window = DEFAULT_COMPOSE_WINDOW if compose_window is None else compose_window
    PlanSettings(num_ranks=R, batch_size_per_rank=B, seed=seed, compose_window=compose_window)  # checks them
    check_settings(len(L), R, B)
    c = cost_model.cost(L)
    p50, p90, p99 = np.percentile(L, [50, 90, 99])
    report = {
        "num_samples": int(len(L)),
        "lengths": {"count": int(len(L)), "mean": float(L.mean()), "p50": float(p50), "p90": float(p90),
                    "p99": float(p99), "max": int(L.max()), "total": int(L.astype(np.int64).sum())},
        "cost_model": cost_model.to_json(),
        "cost": {"mean": float(c.mean()), "max": float(c.max()), "max_over_mean": float(c.max() / c.mean())},
        "num_ranks": R,
        "batch_size_per_rank": B,
        "seed": seed,
    }
    report.update(_bubbles(c, R, B, seed))
    report["lower_bound_kind"] = "pigeonhole"
    report["compose_window"] = int(compose_window)
    report["options"] = options(c, R, B, seed, (*compose_windows, compose_window)) if with_options else []
    report["heavy_tail_warning"] = None
    if report["steps_beyond_fair_share"]:
        report["heavy_tail_warning"] = (
            f"in {report['steps_beyond_fair_share']} of {report['num_steps']} steps the longest sample alone costs "
            "more "
            f"than a rank's fair share, so no per-step assignment of these global batches can go below "
            f"{report['lower_bound_bubble']:.1%} bubble; remedies: batch composition (--compose-window, options "
            "below), a larger --batch-size-per-rank, a length cap (fsdata convert --max-seq-len), "
            "or --batch-policy cost-budget (variable per-rank counts under a cost budget)")
    what_if = []
    for cap in caps:
        if cap >= L.max():
            continue
        row = _bubbles(cost_model.cost(np.minimum(L, cap)), R, B, seed)
        what_if.append({"change": f"max_seq_len={cap}",
                        "items_cut_fraction": float(np.maximum(L - cap, 0).sum() / L.sum()),
                        "lower_bound_bubble": row["lower_bound_bubble"], "baseline_bubble": row["baseline_bubble"]})
    for k in batch_multipliers:
        if len(L) < R * B * k:
            continue
        row = _bubbles(c, R, B * k, seed)
        what_if.append({"change": f"batch_size_per_rank={B * k}", "items_cut_fraction": 0.0,
                        "lower_bound_bubble": row["lower_bound_bubble"], "baseline_bubble": row["baseline_bubble"]})
    report["what_if"] = what_if
    return report


def format_report(r: dict) -> str:
    """Human-readable table of a :func:`profile` report."""
    lg = r["lengths"]
    lines = [
        f"samples            {r['num_samples']:,}",
        f"length             mean {lg['mean']:.1f}  p50 {lg['p50']:.0f}  p90 {lg['p90']:.0f}  "
        f"p99 {lg['p99']:.0f}  max {lg['max']}",
        f"cost model         {r['cost_model']['name']}  (c0, c1, c2) = {tuple(r['cost_model']['coefficients'])}",
        f"cost per sample    mean {r['cost']['mean']:.4g}  max {r['cost']['max']:.4g}  "
        f"max/mean {r['cost']['max_over_mean']:.1f}",
        f"setting            R={r['num_ranks']} ranks x B={r['batch_size_per_rank']} per rank, "
        f"{r['num_steps']} steps (seed {r['seed']})",
        f"bubble today       {r['baseline_bubble']:.2%}  (shuffled, equal counts per rank)",
        f"proven bound       {r['lower_bound_bubble']:.4%}  (pigeonhole: no equal-count per-step assignment of "
        f"these global batches goes lower; old formula {r['lower_bound_bubble_simple']:.4%})",
    ]
    if r.get("options"):
        lines.append("")
        lines.append(f"{'option (same R, B)':<26}{'bubble':>10}{'proven bound':>14}{'steps':>8}  per-rank count")
        lines.append(f"{'shuffle (today)':<26}{r['baseline_bubble']:>10.3%}{'':>14}{r['num_steps']:>8}  "
                     f"{r['batch_size_per_rank']}")
        for o in r["options"]:
            pc = o["per_rank_count"]
            cnt = str(pc["min"]) if pc["min"] == pc["max"] else f"{pc['min']}..{pc['max']} (mean {pc['mean']:.1f})"
            bound = "" if o["lower_bound_bubble"] is None else f"{o['lower_bound_bubble']:.3%}"
            name = o["option"] + (" (default)" if o["compose_window"] == min(r["compose_window"], r["num_steps"])
                                  and o["option"] != "cost-budget" and r["compose_window"] > 1 else "")
            lines.append(f"{name:<26}{o['predicted_bubble']:>10.3%}{bound:>14}{o['num_steps']:>8}  {cnt}")
    if r["heavy_tail_warning"]:
        lines.append(f"WARNING            {r['heavy_tail_warning']}")
    if r["what_if"]:
        lines.append("")
        lines.append(f"{'what if':<28}{'items cut':>10}{'bubble today':>14}{'lower bound':>13}")
        for w in r["what_if"]:
            lines.append(f"{w['change']:<28}{w['items_cut_fraction']:>10.1%}{w['baseline_bubble']:>14.2%}"
                         f"{w['lower_bound_bubble']:>13.4%}")
    return "\n".join(lines)
