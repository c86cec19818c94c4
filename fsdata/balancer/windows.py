"""Plan windows: planning the steps of a run window by window, each from its samples alone.

Under the fixed policy the steps are planned in windows of ``K`` consecutive steps
(:class:`PlanLayout`; ``K`` a multiple of the composition window), each by :func:`plan_one_window`
from that window's samples alone, so a distributed engine plans window by window with memory
bounded by one window (the Ray engine: one task per window). :func:`fsdata.balancer.plan.make_plan`
runs the same windows one after the other; run-level figures are combined from per-step values
(:func:`combine_windows`), so both engines produce the same plan and the same numbers, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from fsdata.balancer import bubble
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW, compose_steps
from fsdata.balancer.partition import per_rank_loads
from fsdata.balancer.partitioners import CPSAT_MAX_STEPS, AutoPartitioner, Partitioner, get_partitioner
from fsdata.balancer.policies import DEFAULT_PARTITIONER, DEFAULT_PLAN_WINDOW, check_partitioner


@dataclass(frozen=True, slots=True)
class PlanLayout:
    """How a run's positions split into steps and plan windows (fixed policy).

    Attributes:
        num_samples: N.
        num_ranks: R.
        batch_size_per_rank: B.
        num_steps: S = N // (R*B) (the remainder positions ``S*R*B .. N-1`` are dropped).
        compose_window: W used (1: no composition; at most S).
        plan_window: K, steps per plan window (a multiple of W; the last window may be shorter).
    """

    num_samples: int
    num_ranks: int
    batch_size_per_rank: int
    num_steps: int
    compose_window: int
    plan_window: int

    @property
    def per_step(self) -> int:
        return self.num_ranks * self.batch_size_per_rank

    @property
    def num_windows(self) -> int:
        return max(1, -(-self.num_steps // self.plan_window))

    def window_steps(self, w: int) -> tuple[int, int]:
        """Steps ``[first, end)`` of window ``w``."""
        a = w * self.plan_window
        return a, min(self.num_steps, a + self.plan_window)

    def window_positions(self, w: int) -> tuple[int, int]:
        """Positions ``[first, end)`` of window ``w`` (the last window also holds the remainder)."""
        a, b = self.window_steps(w)
        return a * self.per_step, (self.num_samples if w == self.num_windows - 1 else b * self.per_step)

    def window_of(self, positions: np.ndarray) -> np.ndarray:
        """Plan window of each position: shape like ``positions``, int64."""
        return np.minimum(np.asarray(positions, dtype=np.int64) // (self.plan_window * self.per_step),
                          self.num_windows - 1)


def plan_layout(num_samples: int, num_ranks: int, batch_size_per_rank: int, *, compose: bool,
                compose_window: int = DEFAULT_COMPOSE_WINDOW, plan_window: int = DEFAULT_PLAN_WINDOW) -> PlanLayout:
    """The :class:`PlanLayout` of a run.

    Args:
        num_samples: N. num_ranks: R. batch_size_per_rank: B.
        compose: whether composition applies (``balanced`` strategy, ``fixed`` policy).
        compose_window: W requested (capped at S; 1 when not composing).
        plan_window: K requested (rounded up to a multiple of W).

    The values are those of a :class:`~fsdata.balancer.settings.PlanSettings` (checked when it was
    made) and an input of at least one step (:func:`fsdata.balancer.policies.check_settings`).
    """
    S = num_samples // (num_ranks * batch_size_per_rank)
    W = int(min(compose_window, S)) if compose and compose_window > 1 and S > 1 else 1
    K = -(-int(plan_window) // W) * W
    return PlanLayout(num_samples=int(num_samples), num_ranks=int(num_ranks),
                      batch_size_per_rank=int(batch_size_per_rank),
                      num_steps=int(S), compose_window=W, plan_window=int(K))


@dataclass(kw_only=True, slots=True)
class WindowPlan:
    """The plan of one window of steps (:func:`plan_one_window`).

    Attributes:
        index: window index w.
        rows: shape ``[n_w]`` int64, the input rows of the window's positions, in position order.
        step: shape ``[n_w]`` int32, global step of each row (-1: dropped, the remainder).
        rank: shape ``[n_w]`` int32 (-1: dropped).
        position: shape ``[n_w]`` int32, index inside the (step, rank) per-rank batch (-1: dropped).
        loads: shape ``[S_w x R]`` float64, predicted cost per (step, rank), summed in position order.
        counts: shape ``[S_w x R]`` int32.
        baseline_loads: shape ``[S_w x R]`` float64, equal-count loads of the uncomposed global batches.
        step_mean: shape ``[S_w]`` float64, each step's total cost / R.
        step_bound: shape ``[S_w]`` float64, the pigeonhole bound of each (composed) step.
        step_bound_simple: shape ``[S_w]`` float64, the simple bound of each (composed) step.
        uncomposed_mean: shape ``[S_w]``, per-step mean before composition (None: not composed).
        uncomposed_bound: shape ``[S_w]``, per-step pigeonhole bound before composition (None: not composed).
        partition_info: what the partitioner did in this window.
        compose_info: what composition did in this window (None: not composed).
    """

    index: int
    rows: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    position: np.ndarray
    loads: np.ndarray
    counts: np.ndarray
    baseline_loads: np.ndarray
    step_mean: np.ndarray
    step_bound: np.ndarray
    step_bound_simple: np.ndarray
    uncomposed_mean: np.ndarray | None
    uncomposed_bound: np.ndarray | None
    partition_info: dict
    compose_info: dict | None

    def summary(self) -> "WindowPlan":
        """This window without its per-row arrays (what a distributed engine sends to the driver)."""
        empty = np.empty(0, dtype=np.int32)
        return WindowPlan(index=self.index, rows=np.empty(0, dtype=np.int64), step=empty, rank=empty, position=empty,
                          loads=self.loads, counts=self.counts, baseline_loads=self.baseline_loads,
                          step_mean=self.step_mean, step_bound=self.step_bound,
                          step_bound_simple=self.step_bound_simple, uncomposed_mean=self.uncomposed_mean,
                          uncomposed_bound=self.uncomposed_bound, partition_info=self.partition_info,
                          compose_info=self.compose_info)


def _window_partitioner(partitioner: str | Partitioner, strategy: str, steps_in_window: int,
                        num_steps: int) -> Partitioner:
    """The partitioner one window uses. ``auto`` gets its CP-SAT step budget pro rata:
    ``ceil(CPSAT_MAX_STEPS * S_w / S)`` steps in a window of ``S_w`` of the run's ``S`` steps."""
    if isinstance(partitioner, Partitioner) and strategy != "shuffle":
        return partitioner
    method = "shuffle" if strategy == "shuffle" else partitioner
    check_partitioner(method)
    if method == "auto":
        return AutoPartitioner(cpsat_max_steps=-(-CPSAT_MAX_STEPS * steps_in_window // max(num_steps, 1)))
    return get_partitioner(method)


@njit(cache=True, parallel=True)
def _scatter(rows, first_position, wstep, wrank, wpos, step, rank, position, order_key):
    for i in prange(rows.shape[0]):
        r = rows[i]
        step[r] = wstep[i]
        rank[r] = wrank[i]
        position[r] = wpos[i]
        order_key[r] = first_position + i if wstep[i] >= 0 else -1


def scatter_window(wp: WindowPlan, first_position: int, step: np.ndarray, rank: np.ndarray, position: np.ndarray,
                   order_key: np.ndarray) -> None:
    """Write a window's plan into the run's per-input-row arrays, in one pass on numba threads.

    ``step[rows] = wp.step``, ``rank[rows] = wp.rank``, ``position[rows] = wp.position`` and
    ``order_key[rows]`` = the row's shuffled position (``first_position + i``; -1 where the row is
    dropped), with ``rows = wp.rows`` (distinct input rows: no two threads write one entry).

    Args:
        wp: the window's :class:`WindowPlan`.
        first_position: the window's first shuffled position (:meth:`PlanLayout.window_positions`).
        step, rank, position: shape ``[N]`` int32, written in place.
        order_key: shape ``[N]`` int64, written in place.
    """
    _scatter(np.ascontiguousarray(wp.rows, dtype=np.int64), np.int64(first_position), wp.step, wp.rank, wp.position,
             step, rank, position, order_key)


@njit(cache=True, parallel=True)
def _batch_positions(ranks, R):
    """Each sample's index in its (step, rank) batch, in the step's position order, and the
    per-(step, rank) counts: ``([Sw x n] int32, [Sw x R] int32)`` for ``ranks`` ``[Sw x n]``
    (steps on numba threads; the same as a stable sort by (step, rank))."""
    S, n = ranks.shape
    pos = np.empty((S, n), dtype=np.int32)
    counts = np.zeros((S, R), dtype=np.int32)
    for s in prange(S):
        for j in range(n):
            r = ranks[s, j]
            pos[s, j] = counts[s, r]
            counts[s, r] += 1
    return pos, counts


def plan_one_window(costs: np.ndarray, rows: np.ndarray, window: int, layout: PlanLayout, *, seed: int = 0,
                strategy: str = "balanced", partitioner: str | Partitioner = DEFAULT_PARTITIONER) -> WindowPlan:
    """Plan one window of steps from its samples alone (fixed policy).

    Args:
        costs: shape ``[n_w]`` float64, the costs of the window's positions
            (:meth:`PlanLayout.window_positions`), in position order.
        rows: shape ``[n_w]`` int64, the input row at each of those positions.
        window: w.
        layout: the run's :class:`PlanLayout`.
        seed: the run's seed (composition randomness; the shuffle already placed the rows).
        strategy: ``balanced`` or ``shuffle``.
        partitioner: as :func:`make_plan`.

    Returns:
        :class:`WindowPlan`.

    Raises:
        ValueError: ``costs``/``rows`` do not have the window's length.
        ConfigError: unknown partitioner.
    """
    R, B, n = layout.num_ranks, layout.batch_size_per_rank, layout.per_step
    s0, s1 = layout.window_steps(window)
    p0, p1 = layout.window_positions(window)
    costs = np.asarray(costs, dtype=np.float64)
    rows = np.asarray(rows, dtype=np.int64)
    if len(costs) != p1 - p0 or len(rows) != p1 - p0:
        raise ValueError(f"window {window} has {p1 - p0} positions; got {len(costs)} costs and {len(rows)} rows")
    Sw = s1 - s0
    local = np.arange(Sw * n, dtype=np.int64).reshape(Sw, n)
    step_costs = costs[: Sw * n].reshape(Sw, n)
    baseline_ranks = np.broadcast_to(np.arange(n, dtype=np.int32) // B, local.shape)
    baseline_loads = per_rank_loads(step_costs, baseline_ranks, R)
    compose_info = None
    un_mean = un_bound = None
    bounds = None
    if layout.compose_window > 1 and strategy == "balanced":
        un_mean = step_costs.sum(axis=1) / R
        bounds = bubble.step_bounds(step_costs, R, B)  # one sort for both bounds
        un_bound = bounds[0]
        local, compose_info = compose_steps(local, costs, num_ranks=R, batch_size_per_rank=B,
                                            compose_window=layout.compose_window, seed=seed,
                                            first_window=s0 // layout.compose_window, return_info=True,
                                            input_bound=un_bound)
        if compose_info["windows_composed"]:  # else every step is the input's: the same bounds
            step_costs = costs[local]
            bounds = None
    step_bound, step_bound_simple = bounds if bounds is not None else bubble.step_bounds(step_costs, R, B)
    p = _window_partitioner(partitioner, strategy, Sw, layout.num_steps)
    ranks = p.partition(step_costs, R, B, step_bound=step_bound).astype(np.int32)
    flat = local.ravel()
    pos_in_batch, counts = _batch_positions(np.ascontiguousarray(ranks), R)
    pos_in_batch = pos_in_batch.ravel()
    m = p1 - p0
    step = np.full(m, -1, dtype=np.int32)
    rank = np.full(m, -1, dtype=np.int32)
    position = np.full(m, -1, dtype=np.int32)
    step[flat] = np.repeat(np.arange(s0, s1, dtype=np.int32), n)
    rank[flat] = ranks.ravel()
    position[flat] = pos_in_batch
    loads = per_rank_loads(step_costs, ranks, R)
    return WindowPlan(index=int(window), rows=rows, step=step, rank=rank, position=position, loads=loads,
                      counts=counts, baseline_loads=baseline_loads, step_mean=step_costs.sum(axis=1) / R,
                      step_bound=step_bound, step_bound_simple=step_bound_simple,
                      uncomposed_mean=un_mean, uncomposed_bound=un_bound, partition_info=dict(p.info),
                      compose_info=compose_info)


def bound_ratio(bound: np.ndarray, mean: np.ndarray) -> float:
    """``sum(LB - mean) / sum(LB)`` with ``LB = max(bound, mean)`` (:func:`fsdata.balancer.bubble.bound_bubble`)."""
    if not len(mean):
        return 0.0
    lb = np.maximum(bound, mean)
    denom = float(lb.sum())
    return 0.0 if denom <= 0 else max(0.0, float((lb - mean).sum() / denom))


def merge_infos(infos: list[dict]) -> dict:
    """Window infos as one: integer counters summed, ``method`` the most refined one used, dicts
    of counters merged, other values from the first window."""
    out: dict = {}
    for info in infos:
        for k, v in info.items():
            if k not in out:
                out[k] = dict(v) if isinstance(v, dict) else v
            elif k == "method":
                out[k] = v if len(str(v)) > len(str(out[k])) else out[k]  # lpt-swap+cpsat over lpt-swap
            elif isinstance(v, bool) or not isinstance(v, (int, dict)):
                continue
            elif isinstance(v, int):
                out[k] += v
            else:
                for kk, vv in v.items():
                    out[k][kk] = out[k].get(kk, 0) + vv
    return out


@dataclass(kw_only=True, slots=True)
class WindowTotals:
    """Run-level figures combined from every window's summary (:func:`combine_windows`)."""

    loads: np.ndarray
    counts: np.ndarray
    baseline_loads: np.ndarray
    lower_bound_bubble: float
    lower_bound_bubble_simple: float
    partition_info: dict
    compose_info: dict


def combine_windows(windows: list[WindowPlan], layout: PlanLayout, compose_window_requested: int) -> WindowTotals:
    """Combine window plans (in window order) into the run's figures, the same whatever engine made them.

    Raises:
        ValueError: the windows are not exactly ``0 .. num_windows-1``.
    """
    if [w.index for w in windows] != list(range(layout.num_windows)):
        raise ValueError(f"expected windows 0..{layout.num_windows - 1}, got {[w.index for w in windows][:8]}")
    cat = lambda name: np.concatenate([getattr(w, name) for w in windows])  # noqa: E731
    mean = cat("step_mean")
    composed = [w.compose_info for w in windows if w.compose_info is not None]
    if composed:
        info = merge_infos(composed)
        info.update(compose_window=layout.compose_window, compose_window_requested=int(compose_window_requested),
                    uncomposed_lower_bound_bubble=bound_ratio(cat("uncomposed_bound"), cat("uncomposed_mean")))
        info["sub_window_sizes_used"] = {k: v for k, v in sorted(info.get("sub_window_sizes_used", {}).items(),
                                                                 key=lambda kv: int(kv[0]))}
    else:
        info = {"algorithm": "none", "compose_window": 1}
    return WindowTotals(loads=np.concatenate([w.loads for w in windows]),
                        counts=np.concatenate([w.counts for w in windows]),
                        baseline_loads=np.concatenate([w.baseline_loads for w in windows]),
                        lower_bound_bubble=bound_ratio(cat("step_bound"), mean),
                        lower_bound_bubble_simple=bound_ratio(cat("step_bound_simple"), mean),
                        partition_info=merge_infos([w.partition_info for w in windows]), compose_info=info)
