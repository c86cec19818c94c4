"""``fsdata profile``: length statistics, costs, and the bubble today's practice would have.

For R ranks and B samples per rank, the input is cut into seeded global batches (as ``fsdata
balance`` does) and two bubbles are reported (definitions in :mod:`fsdata.bubble`):

* ``baseline_bubble``: equal counts per rank, shuffled (a DistributedSampler);
* ``lower_bound_bubble``: the least any equal-count per-step assignment can reach.

A step is *heavy-tailed beyond repair* when its largest sample alone (plus the B-1 smallest)
costs more than a rank's fair share (the step's total over R): then no per-step assignment helps.
The report says so and lists remedies, with a what-if table for length caps and larger B.
"""

from __future__ import annotations

import numpy as np

from fsdata import bubble
from fsdata.cost import CostModel
from fsdata.plan import check_settings, shuffled_steps

DEFAULT_CAPS = (256, 512, 1024, 2048)


def _bubbles(costs: np.ndarray, R: int, B: int, seed: int) -> dict:
    steps, _ = shuffled_steps(len(costs), R, B, seed)
    sc = costs[steps]
    base = np.add.reduceat(sc, np.arange(0, R * B, B), axis=1) if len(sc) else np.zeros((0, R))
    lb_per_step = bubble.step_lower_bound(sc, R, B)
    fair = sc.sum(axis=1) / R
    return {"num_steps": int(len(sc)), "baseline_bubble": bubble.run_bubble(base),
            "lower_bound_bubble": bubble.lower_bound_bubble(sc, R, B),
            "steps_beyond_fair_share": int((lb_per_step > fair * (1 + 1e-12)).sum())}


def profile(lengths: np.ndarray, cost_model: CostModel, *, num_ranks: int, batch_size_per_rank: int,
            seed: int = 0, caps: tuple[int, ...] = DEFAULT_CAPS, batch_multipliers: tuple[int, ...] = (2, 4, 8)) -> dict:
    """Profile sequence lengths for a data-parallel setting.

    Args:
        lengths: shape ``[N]`` int, sequence lengths L.
        cost_model: per-sample cost model.
        num_ranks: R.
        batch_size_per_rank: B.
        seed: seed of the global-batch shuffle.
        caps: length caps for the what-if table (samples longer than a cap are truncated to it).
        batch_multipliers: larger per-rank batches for the what-if table (``B * k``).

    Returns:
        JSON-able dict: ``lengths`` (count, mean, p50/p90/p99/max), ``cost`` (mean, max, max/mean),
        ``num_ranks``, ``batch_size_per_rank``, ``num_steps``, ``baseline_bubble``,
        ``lower_bound_bubble``, ``steps_beyond_fair_share``, ``heavy_tail_warning`` (str or None),
        ``what_if`` (rows: ``{"change", "lower_bound_bubble", "baseline_bubble"}``).

    Raises:
        ConfigError / InputError: as :func:`fsdata.plan.check_settings`.
    """
    L = np.asarray(lengths)
    R, B = num_ranks, batch_size_per_rank
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
    report["heavy_tail_warning"] = None
    if report["steps_beyond_fair_share"]:
        report["heavy_tail_warning"] = (
            f"in {report['steps_beyond_fair_share']} of {report['num_steps']} steps the longest sample alone costs more "
            f"than a rank's fair share, so no per-step assignment can go below {report['lower_bound_bubble']:.1%} "
            "bubble; remedies: a larger --batch-size-per-rank, a length cap (fsdata convert --max-seq-len), "
            "or --batch-policy cost-budget (variable per-rank counts under a cost budget)")
    what_if = []
    for cap in caps:
        if cap >= L.max():
            continue
        row = _bubbles(cost_model.cost(np.minimum(L, cap)), R, B, seed)
        what_if.append({"change": f"max_seq_len={cap}", "items_cut_fraction": float(np.maximum(L - cap, 0).sum() / L.sum()),
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
        f"lower bound        {r['lower_bound_bubble']:.4%}  (best any equal-count per-step assignment can do)",
    ]
    if r["heavy_tail_warning"]:
        lines.append(f"WARNING            {r['heavy_tail_warning']}")
    if r["what_if"]:
        lines.append("")
        lines.append(f"{'what if':<28}{'items cut':>10}{'bubble today':>14}{'lower bound':>13}")
        for w in r["what_if"]:
            lines.append(f"{w['change']:<28}{w['items_cut_fraction']:>10.1%}{w['baseline_bubble']:>14.2%}"
                         f"{w['lower_bound_bubble']:>13.4%}")
    return "\n".join(lines)
