"""Bubble metrics: the idle fraction of a data-parallel step.

Definitions (docs/format.md, BACKGROUND.md "Bubble, as we measure it"). For step ``s`` with per-rank
compute times or predicted costs ``C[s, r]``:

* ``bubble(s) = 1 - mean_r C[s, r] / max_r C[s, r]``
* over a run: ``sum_s (max_r C - mean_r C) / sum_s max_r C`` (time-weighted, what a run loses).
* reduction: ``1 - bubble(ours) / bubble(baseline)``.

Lower bounds on the most loaded rank of one step with ``B`` samples per rank, ``R`` ranks, costs
``c`` sorted in decreasing order ``c_1 >= c_2 >= ...`` (every equal-count assignment is at least this):

* ``simple`` (the formula reported before issue 10): ``max(sum(c) / R, c_1 + sum of the B - 1
  smallest)``: no rank carries less than the average, and the rank holding the largest sample
  also holds ``B - 1`` others.
* ``pigeonhole`` (the proven bound reported now, :func:`step_proven_bound`): for ``k = 1 .. B``,
  among the ``(k-1)R + 1`` costliest samples some rank holds ``k`` (pigeonhole), so that rank
  carries at least the ``k`` smallest of those plus the ``B - k`` smallest of the whole step:
  ``LB_k = c_{(k-1)R-k+2} + ... + c_{(k-1)R+1} + (sum of the B-k smallest)``. The bound is
  ``max(sum / R, max_k LB_k)``; ``k = 1`` is the simple formula, so it is never lower. At small
  B with a heavy tail it is much higher (e.g. per-event data at R=64, B=4).

Run bound: the run bubble ``1 - sum_s mean_s / sum_s max_s`` increases with every step's max, so
``1 - sum_s mean_s / sum_s LB_s`` is a lower bound on the run bubble of any equal-count
assignment of the same steps.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


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


@njit(cache=True, parallel=True)
def _sort_rows(c):
    out = np.empty_like(c)
    for i in prange(c.shape[0]):
        out[i] = np.sort(c[i])
    return out


def sort_rows(step_costs: np.ndarray) -> np.ndarray:
    """Each row sorted ascending, rows on numba threads: the values of ``np.sort(c, axis=1)``.

    Args:
        step_costs: shape ``[S x n]``, float.

    Returns:
        shape ``[S x n]``, float64.
    """
    c = np.ascontiguousarray(step_costs, dtype=np.float64)
    return _sort_rows(c) if c.ndim == 2 and c.size else np.sort(c, axis=-1)


def step_lower_bound(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Lower bound on the most loaded rank of each step under equal per-rank counts.

    Args:
        step_costs: shape ``[S x (R*B)]``, float; the costs of each step's samples.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        shape ``[S]``, float64: ``max(sum / R, max + sum of the B-1 smallest)`` (BACKGROUND.md).
    """
    c = sort_rows(step_costs)
    return _simple_from_sorted(c, num_ranks, batch_size_per_rank)


def _simple_from_sorted(asc: np.ndarray, R: int, B: int) -> np.ndarray:
    avg = asc.sum(axis=1) / R
    heavy = asc[:, -1] + asc[:, : B - 1].sum(axis=1)
    return np.maximum(avg, heavy)


def step_proven_bound(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Pigeonhole lower bound on the most loaded rank of each step under equal per-rank counts.

    For ``k = 1 .. B``: among the ``(k-1)R + 1`` costliest samples of a step some rank holds ``k``
    of them, so its load is at least the sum of the ``k`` smallest of those plus the sum of the
    ``B - k`` smallest samples of the step (those lie outside the top set since
    ``R*B - (B-k) > (k-1)R``). The bound is the max over k and ``sum / R`` (module docstring).
    Pure function of the costs (verify recomputes it from the files).

    Args:
        step_costs: shape ``[S x (R*B)]``, float; the costs of each step's samples.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        shape ``[S]``, float64; ``>=`` :func:`step_lower_bound` elementwise.

    Raises:
        ValueError: ``step_costs`` is not ``[S x R*B]``.
    """
    return step_bounds(step_costs, num_ranks, batch_size_per_rank)[0]


def step_bounds(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Both bounds of each step from one sort of its costs: ``(step_proven_bound, step_lower_bound)``.

    The same values as the two functions (the sorting of each step's costs is their main cost,
    shared here).

    Args:
        step_costs: shape ``[S x (R*B)]``, float; the costs of each step's samples.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        Two arrays of shape ``[S]``, float64: the pigeonhole and the simple bound.

    Raises:
        ValueError: ``step_costs`` is not ``[S x R*B]``.
    """
    c = np.asarray(step_costs, dtype=np.float64)
    R, B = int(num_ranks), int(batch_size_per_rank)
    if c.ndim != 2 or c.shape[1] != R * B:
        raise ValueError(f"step_costs has shape {c.shape}; expected [steps x {R * B}]")
    n = R * B
    out = np.zeros(c.shape[0])
    simple = np.zeros(c.shape[0])
    per = max(1, (1 << 22) // max(n, 1))  # ~4M samples per chunk bounds the temporaries
    for a in range(0, c.shape[0], per):
        asc = sort_rows(c[a:a + per])
        simple[a:a + per] = _simple_from_sorted(asc, R, B)
        pre = np.zeros((asc.shape[0], n + 1))
        np.cumsum(asc, axis=1, out=pre[:, 1:])
        best = pre[:, n] / R
        for k in range(1, B + 1):
            # ascending order: the top set is positions n-((k-1)R+1) .. n-1; its k smallest start there
            lo = n - ((k - 1) * R + 1)
            best = np.maximum(best, pre[:, lo + k] - pre[:, lo] + pre[:, B - k])
        out[a:a + per] = best
    return out, simple


#: Names of the bounds :func:`lower_bound_bubble` can compute (module docstring).
BOUND_KINDS = ("pigeonhole", "simple")


def lower_bound_bubble(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int,
                       kind: str = "pigeonhole") -> float:
    """Proven lower bound on the run bubble of any equal-count per-step assignment of these steps.

    Args:
        step_costs: shape ``[S x (R*B)]``, float.
        num_ranks: R.
        batch_size_per_rank: B.
        kind: ``pigeonhole`` (:func:`step_proven_bound`, default) or ``simple``
            (:func:`step_lower_bound`, the older and weaker formula).

    Returns:
        ``sum_s (LB_s - mean_s) / sum_s LB_s`` where ``mean_s = sum / R``; in [0, 1).

    Raises:
        ValueError: unknown ``kind``.
    """
    c = np.asarray(step_costs, dtype=np.float64)
    if kind not in BOUND_KINDS:
        raise ValueError(f"unknown bound kind {kind!r}; use one of {BOUND_KINDS}")
    if c.size == 0:
        return 0.0
    lb = (step_proven_bound if kind == "pigeonhole" else step_lower_bound)(c, num_ranks, batch_size_per_rank)
    return bound_bubble(c, lb, num_ranks)


def bound_bubble(step_costs: np.ndarray, step_bound: np.ndarray, num_ranks: int) -> float:
    """Run bubble lower bound from per-step bounds on the max: ``1 - sum mean / sum bound``.

    Args:
        step_costs: shape ``[S x N]``, float.
        step_bound: shape ``[S]``, float; a lower bound on each step's most loaded rank.
        num_ranks: R.

    Returns:
        in [0, 1); 0.0 for no steps.
    """
    c = np.asarray(step_costs, dtype=np.float64)
    lb = np.asarray(step_bound, dtype=np.float64)
    if c.size == 0:
        return 0.0
    mean = c.sum(axis=1) / num_ranks
    lb = np.maximum(lb, mean)
    denom = float(lb.sum())
    # lb >= mean holds exactly; clamp the float rounding that can leave -1e-17
    return 0.0 if denom <= 0 else max(0.0, float((lb - mean).sum() / denom))


#: The lower bound of each kind in words (``fsdata report``'s caption and docs/fsdata.md use these).
BOUND_TEXT = {
    "pigeonhole": "the least possible most-loaded rank of each step's samples as written, over every equal-count "
                  "assignment (pigeonhole bound: max(sum / R, max over k of the k smallest of the (k-1)R+1 costliest "
                  "plus the B-k smallest), docs/balancer.md)",
    "simple": "the least possible most-loaded rank of each step's samples as written, over every equal-count "
              "assignment (max(sum / R, largest + the B-1 smallest))",
    "any-count": "the least possible most-loaded rank of each step's samples as written, over every assignment with "
                 "any per-rank counts (max(sum / R, largest sample))",
}


def any_count_bound(costs: np.ndarray, steps: np.ndarray, num_steps: int, num_ranks: int) -> np.ndarray:
    """Lower bound on the most loaded rank of each step under *any* per-rank counts.

    Args:
        costs: shape ``[N]`` float, each written sample's cost.
        steps: shape ``[N]`` int, each sample's step in ``0..num_steps-1``.
        num_steps: S.
        num_ranks: R.

    Returns:
        shape ``[S]`` float64: ``max(sum / R, largest sample)`` of each step.
    """
    c = np.asarray(costs, dtype=np.float64)
    out = np.bincount(steps, weights=c, minlength=num_steps)[:num_steps] / num_ranks
    np.maximum.at(out, steps, c)
    return out


def written_bound_bubbles(loads: np.ndarray, step_bound: np.ndarray) -> tuple[np.ndarray, float]:
    """The lower bound as a bubble, per step and over the run, of steps as written.

    Per step ``1 - mean_s / LB_s``, over the run ``1 - sum_s mean_s / sum_s LB_s``
    (:func:`bound_bubble`'s formula), with ``mean_s`` the step's per-rank mean load and ``LB_s``
    (raised to ``mean_s``) a bound on the most loaded rank of *the same samples* (e.g.
    :func:`step_proven_bound` of the written step). Since ``LB_s <= max_r loads[s, r]``, neither
    value exceeds the achieved :func:`step_bubbles` / :func:`run_bubble` (up to float rounding).

    Args:
        loads: shape ``[S x R]`` float, per-rank load of each written step.
        step_bound: shape ``[S]`` float.

    Returns:
        ``(per step [S] float64 in [0, 1), run value in [0, 1))``; zeros for empty input.
    """
    mean = np.asarray(loads, dtype=np.float64).mean(axis=1) if np.size(loads) else np.zeros(0)
    lb = np.maximum(np.asarray(step_bound, dtype=np.float64), mean)
    per = np.where(lb > 0, 1 - mean / np.where(lb > 0, lb, 1), 0.0)
    run = float(1 - mean.sum() / lb.sum()) if lb.sum() > 0 else 0.0
    return np.maximum(per, 0.0), max(0.0, run)


def reduction(ours: float, baseline: float) -> float:
    """Relative bubble reduction ``1 - ours / baseline`` (0.0 when the baseline has no bubble)."""
    return 0.0 if baseline <= 0 else 1.0 - ours / baseline
