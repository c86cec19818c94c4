"""Bubble metrics: the idle fraction of a data-parallel step.

Definitions (docs/format.md, BACKGROUND.md "Bubble, as we measure it"). For step ``s`` with per-rank
compute times or predicted costs ``C[s, r]``:

* ``bubble(s) = 1 - mean_r C[s, r] / max_r C[s, r]``
* over a run: ``sum_s (max_r C - mean_r C) / sum_s max_r C`` (time-weighted, what a run loses).
* reduction: ``1 - bubble(ours) / bubble(baseline)``.

Lower bound for one step with ``B`` samples per rank and ``R`` ranks, costs ``c``:
``max(sum(c) / R, max(c) + sum of the B - 1 smallest c)``: no rank can carry less than the
average, and the rank that takes the largest sample also takes ``B - 1`` others.
"""

from __future__ import annotations

import numpy as np


def run_bubble(per_rank_cost: np.ndarray) -> float:
    """Bubble fraction of a run.

    Args:
        per_rank_cost: shape ``[S x R]`` (steps x ranks), float; compute time (any unit) or
            predicted cost of each rank in each step.

    Returns:
        ``sum_s (max_r - mean_r) / sum_s max_r`` in [0, 1); 0.0 for an empty or all-zero input.

    Raises:
        ValueError: if ``per_rank_cost`` is not 2-D.
    """
    c = np.asarray(per_rank_cost, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"per_rank_cost must be 2-D [steps x ranks], got shape {c.shape}")
    if c.size == 0:
        return 0.0
    mx = c.max(axis=1)
    total_max = float(mx.sum())
    if total_max <= 0.0:
        return 0.0
    return float((mx - c.mean(axis=1)).sum() / total_max)


def step_bubbles(per_rank_cost: np.ndarray) -> np.ndarray:
    """Per-step bubble ``1 - mean_r / max_r``.

    Args:
        per_rank_cost: shape ``[S x R]``, float.

    Returns:
        shape ``[S]``, float64; 0.0 where a step's max is 0.
    """
    c = np.asarray(per_rank_cost, dtype=np.float64)
    mx = c.max(axis=1)
    out = np.zeros(len(c))
    nz = mx > 0
    out[nz] = 1.0 - c.mean(axis=1)[nz] / mx[nz]
    return out


def step_lower_bound(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Lower bound on the most loaded rank of each step under equal per-rank counts.

    Args:
        step_costs: shape ``[S x (R*B)]``, float; the costs of each step's samples.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        shape ``[S]``, float64: ``max(sum / R, max + sum of the B-1 smallest)`` (BACKGROUND.md).
    """
    c = np.sort(np.asarray(step_costs, dtype=np.float64), axis=1)
    avg = c.sum(axis=1) / num_ranks
    heavy = c[:, -1] + c[:, : batch_size_per_rank - 1].sum(axis=1)
    return np.maximum(avg, heavy)


def lower_bound_bubble(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> float:
    """Smallest run bubble any per-step assignment with equal counts can reach.

    Args:
        step_costs: shape ``[S x (R*B)]``, float.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        ``sum_s (LB_s - mean_s) / sum_s LB_s`` where ``mean_s = sum / R``; in [0, 1).
    """
    c = np.asarray(step_costs, dtype=np.float64)
    if c.size == 0:
        return 0.0
    lb = step_lower_bound(c, num_ranks, batch_size_per_rank)
    mean = c.sum(axis=1) / num_ranks
    denom = float(lb.sum())
    # lb >= mean holds exactly; clamp the float rounding that can leave -1e-17
    return 0.0 if denom <= 0 else max(0.0, float((lb - mean).sum() / denom))


def reduction(ours: float, baseline: float) -> float:
    """Relative bubble reduction ``1 - ours / baseline`` (0.0 when the baseline has no bubble)."""
    return 0.0 if baseline <= 0 else 1.0 - ours / baseline
