"""Composing global batches and assigning their samples to ranks: the balancing plan.

A plan maps every input row to ``(step, rank)`` (``-1`` when dropped) plus a sort key that orders
a rank's rows by step, then by position in the step. It is computed from per-sample costs only
(one int per row), so it fits in memory for hundreds of millions of samples; the rows themselves
are streamed by :mod:`fsdata.balance`.

Global batches: a seeded permutation of the input rows (:mod:`fsdata.balancer.order`, computable
per row) cut into steps of ``R*B`` samples (fixed policy). The equal-count baseline is today's
practice on the same global batches: each step's shuffled samples cut into ``R`` contiguous
per-rank batches.

Plan windows (fixed policy): :func:`make_plan` plans the steps in windows of ``K`` consecutive
steps, each from its own samples (:mod:`fsdata.balancer.windows`: :class:`PlanLayout`,
:func:`plan_one_window`, :func:`combine_windows`), the same functions a distributed engine calls
per window, so every engine produces the same plan and the same numbers, bit for bit.

This module is the planning API: it also exports the settings' names and checks
(:mod:`fsdata.balancer.policies`), the global batches (:func:`shuffled_steps`,
:mod:`fsdata.balancer.order`) and the window functions, so ``from fsdata.balancer.plan import
...`` reaches all of planning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdata.balancer import bubble
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW
from fsdata.balancer.order import LEGACY_SHUFFLE, shuffled_order, shuffled_steps
from fsdata.balancer.partition import per_rank_loads
from fsdata.balancer.partitioners import Partitioner
from fsdata.balancer.settings import PlanSettings
from fsdata.balancer.policies import (BATCH_POLICIES, DEFAULT_PARTITIONER, DEFAULT_PLAN_WINDOW, REMAINDER_POLICIES,
                                      STRATEGIES, check_policies, check_settings)
from fsdata.balancer.windows import (PlanLayout, WindowPlan, WindowTotals, combine_windows, plan_layout,
                                     plan_one_window, scatter_window)
from fsdata.errors import ConfigError, setting

__all__ = ["BATCH_POLICIES", "DEFAULT_PARTITIONER", "DEFAULT_PLAN_WINDOW", "HIGH_BUBBLE_WARNING_THRESHOLD",
           "LEGACY_SHUFFLE", "REMAINDER_POLICIES", "STRATEGIES", "Plan", "PlanLayout", "WindowPlan", "WindowTotals",
           "check_policies", "check_settings", "combine_windows", "high_bubble_warning", "make_plan", "plan_costs",
           "plan_layout", "plan_one_window", "shuffled_steps"]


@dataclass(kw_only=True, slots=True)
class Plan:
    """Where every input row goes.

    Attributes:
        num_ranks: R.
        batch_size_per_rank: B (nominal for cost-budget).
        num_steps: S.
        step: shape ``[N]`` int32, step of each input row; -1 when dropped.
        rank: shape ``[N]`` int32, rank of each input row; -1 when dropped.
        order_key: shape ``[N]`` int64, sorts a rank's rows by step, then by shuffled position.
        dropped: shape ``[D]`` int64, input row indices that were dropped (the remainder).
        loads: shape ``[S x R]`` float64, predicted cost per rank per step.
        counts: shape ``[S x R]`` int32, samples per rank per step.
        baseline_loads: shape ``[S' x R]`` float64, equal-count shuffled per-rank loads of the same
            global batches (S' = S for the fixed policy).
        lower_bound_bubble: proven lower bound on the run bubble of any equal-count per-step
            assignment of the (composed) steps: the pigeonhole bound (:mod:`fsdata.balancer.bubble`).
        lower_bound_bubble_simple: the older, weaker formula ``max(sum/R, largest + B-1 smallest)``.
        partition_info: what the partitioner did (method, CP-SAT steps refined).
        compose_window: W actually used (1: no composition; capped at the number of steps).
        compose_info: what composition did (``algorithm``, ``compose_window``, ``num_windows``,
            ``windows_composed`` and the proven bound of the uncomposed steps
            ``uncomposed_lower_bound_bubble``).
        budget_used: the per-rank per-step budget cost-budget used (None for the fixed policy).
        position: shape ``[N]`` int32, index of each row inside its (step, rank) batch (-1 when
            dropped); None for cost-budget (derived from ``order_key``).
        plan_window: K used (None for cost-budget, which plans the run as one sequence).
    """

    num_ranks: int
    batch_size_per_rank: int
    num_steps: int
    step: np.ndarray
    rank: np.ndarray
    order_key: np.ndarray
    dropped: np.ndarray
    loads: np.ndarray
    counts: np.ndarray
    baseline_loads: np.ndarray
    lower_bound_bubble: float
    partition_info: dict
    lower_bound_bubble_simple: float = 0.0
    compose_window: int = 1
    compose_info: dict | None = None
    budget_used: float | None = None
    position: np.ndarray | None = None
    plan_window: int | None = None

    @property
    def predicted_bubble(self) -> float:
        return bubble.run_bubble(self.loads)

    @property
    def baseline_bubble(self) -> float:
        return bubble.run_bubble(self.baseline_loads)

    def count_distribution(self) -> dict:
        """Per-(step, rank) sample counts: ``{"min", "median", "max", "mean"}`` (B everywhere for fixed)."""
        c = self.counts
        return {"min": int(c.min()), "median": float(np.median(c)), "max": int(c.max()), "mean": float(c.mean())}


#: ``balance`` and the nightly job warn when the predicted bubble stays above this fraction.
HIGH_BUBBLE_WARNING_THRESHOLD = 0.10


def high_bubble_warning(manifest: dict, threshold: float = HIGH_BUBBLE_WARNING_THRESHOLD) -> str | None:
    """Warning text with the remedy when a balanced output's predicted bubble stays high.

    Works on a manifest dict as written by ``fsdata balance`` (keys ``predicted_bubble``,
    ``lower_bound_bubble``, ``batch_policy``, ``strategy``, ``settings.compose_window``), so the
    nightly job can call it on the manifest it just verified.

    Args:
        manifest: the output's manifest (v1 or v2 layout; missing keys are treated as defaults).
        threshold: bubble fraction above which to warn (default 0.10).

    Returns:
        One line of text, or None when the bubble is at most ``threshold`` (or for the shuffle
        strategy, which is the baseline on purpose).
    """
    b = float(manifest.get("predicted_bubble") or 0.0)
    if b <= threshold or manifest.get("strategy", "balanced") == "shuffle":
        return None
    lb = manifest.get("lower_bound_bubble")
    settings = manifest.get("settings") or {}
    w = int(settings.get("compose_window") or 1)
    head = f"predicted bubble {b:.1%} stays above {threshold:.0%}"
    if manifest.get("batch_policy", "fixed") == "cost-budget":
        return (f"{head} under --batch-policy cost-budget (usually too few samples per step); remedies: fewer "
                "--ranks, a larger --budget, or more data")
    why = (f"; no equal-count assignment of these steps can go below {lb:.1%} (proven bound), the global batches "
           "themselves are the limit" if lb is not None and lb > threshold / 2 else "")
    bigger = f"a larger --compose-window (now {w}; e.g. {max(4 * w, 64)})"
    return (f"{head}{why}; remedies: {bigger}, a larger --batch-size-per-rank, a length cap "
            "(fsdata convert --max-seq-len), or --batch-policy cost-budget (variable per-rank counts); "
            "fsdata profile shows what each reaches")


def make_plan(costs: np.ndarray, *, num_ranks: int, batch_size_per_rank: int, seed: int = 0,
              strategy: str = "balanced", batch_policy: str = "fixed", remainder: str = "drop",
              partitioner: str | Partitioner = DEFAULT_PARTITIONER, budget: float | None = None,
              compose_window: int = DEFAULT_COMPOSE_WINDOW, plan_window: int = DEFAULT_PLAN_WINDOW) -> Plan:
    """Compose global batches and assign samples to ranks.

    Args:
        costs: shape ``[N]`` float64, predicted cost of each input row (input order).
        num_ranks: R (world size).
        batch_size_per_rank: B.
        seed: seed of the global-batch shuffle.
        strategy: ``balanced`` or ``shuffle`` (equal counts, no balancing: today's practice).
        batch_policy: ``fixed`` (B per rank per step) or ``cost-budget`` (variable counts, equal cost).
        remainder: ``drop`` (record the samples that do not fill a last step) or ``error``.
        partitioner: per-step partitioner for the fixed policy: a registered name
            (:func:`fsdata.balancer.partitioners.names`) or a
            :class:`~fsdata.balancer.partitioners.Partitioner` instance (injected).
        budget: per-rank per-step cost budget for ``cost-budget`` (default: chosen by the policy).
        compose_window: W; regroup the samples of W consecutive global batches so the per-step
            bound drops (:mod:`fsdata.balancer.compose`); 1 = none; default
            :data:`fsdata.balancer.compose.DEFAULT_COMPOSE_WINDOW` (as ``fsdata balance``). Applies to
            ``balanced`` + ``fixed`` only (the shuffle baseline and cost-budget keep the random
            global batches).
        plan_window: K, steps planned together (:class:`PlanLayout`; rounded up to a multiple of
            the composition window). The ``auto`` partitioner's CP-SAT budget is spread over the
            windows pro rata; otherwise K does not change the plan.

    Returns:
        :class:`Plan`.

    Raises:
        ConfigError: a value :class:`~fsdata.balancer.settings.PlanSettings` refuses (R or B < 1,
            unknown strategy/policy, ``compose_window < 1`` ...), or ``remainder='error'`` with a
            remainder.
        InputError: fewer samples than one step.
    """
    settings = PlanSettings(num_ranks=num_ranks, batch_size_per_rank=batch_size_per_rank, seed=seed,
                            strategy=strategy, batch_policy=batch_policy, remainder=remainder,  # type: ignore[arg-type]
                            budget=budget, compose_window=compose_window, plan_window=plan_window)  # checks them
    return plan_costs(costs, settings, partitioner=partitioner)


def plan_costs(costs: np.ndarray, settings: PlanSettings, *, seed: int | None = None,
               partitioner: str | Partitioner | None = None) -> Plan:
    """:func:`make_plan` under ``settings``, checked when it was made (the one call every engine plans with).

    Args:
        costs: shape ``[N]`` float64, per-sample cost in input order.
        settings: the planning settings (R, B, seed, strategy, policy, partitioner, composition).
        seed: the seed to plan with instead of ``settings.seed`` (an epoch's seed).
        partitioner: a :class:`~fsdata.balancer.partitioners.Partitioner` instance (injected) or
            name instead of ``settings.partitioner``.

    Raises:
        ConfigError: ``remainder='error'`` with a remainder; an unknown partitioner.
        InputError: fewer samples than one step (the one check that needs the data).
    """
    s = settings
    N = len(costs)
    check_settings(N, s.num_ranks, s.batch_size_per_rank)
    R, B = s.num_ranks, s.batch_size_per_rank
    seed = s.seed if seed is None else seed
    strategy, batch_policy, remainder, budget = s.strategy, s.batch_policy, s.remainder, s.budget
    compose_window, plan_window = s.compose_window, s.plan_window
    partitioner = s.partitioner if partitioner is None else partitioner
    costs = np.asarray(costs, dtype=np.float64)
    budget_used = None
    step = np.full(N, -1, dtype=np.int32)
    rank = np.full(N, -1, dtype=np.int32)
    order_key = np.full(N, -1, dtype=np.int64)
    position = None
    W = 1
    compose_info = {"algorithm": "none", "compose_window": 1}
    if batch_policy == "cost-budget" and strategy == "balanced":
        from fsdata.balancer.cost_budget import plan_cost_budget  # noqa: PLC0415 (optional policy module)

        from fsdata.balancer.cost_budget import default_budget  # noqa: PLC0415

        steps, rest = shuffled_steps(N, R, B, seed)
        step_costs = costs[steps]
        baseline_ranks = np.broadcast_to(np.arange(R * B, dtype=np.int32) // B, steps.shape)
        baseline_loads = per_rank_loads(step_costs, baseline_ranks, R)
        lower = bubble.lower_bound_bubble(step_costs, R, B)
        lower_simple = bubble.lower_bound_bubble(step_costs, R, B, kind="simple")
        perm = np.concatenate([steps.ravel(), rest])
        budget_used = float(budget) if budget is not None else default_budget(costs[perm], B)
        s_, r_ = plan_cost_budget(costs[perm], R, B, budget_used)
        info = {"method": "cost-budget", "budget": budget, "budget_used": budget_used}
        step[perm], rank[perm] = s_, r_
        # a rank's rows are ordered by step, then by position in the shuffled order
        order_key[perm] = s_.astype(np.int64) * N + np.arange(N)
        order_key[step < 0] = -1
        plan_window_used = None
    else:
        layout = plan_layout(N, R, B, compose=strategy == "balanced" and batch_policy == "fixed",
                             compose_window=compose_window, plan_window=plan_window)
        W = layout.compose_window
        order = shuffled_order(N, seed)
        position = np.full(N, -1, dtype=np.int32)
        windows = []
        for w in range(layout.num_windows):
            a, b = layout.window_positions(w)
            rows = order[a:b]
            wp = plan_one_window(costs[rows], rows, w, layout, seed=seed, strategy=strategy, partitioner=partitioner)
            scatter_window(wp, a, step, rank, position, order_key)
            windows.append(wp.summary())
        del order
        totals = combine_windows(windows, layout, compose_window)
        baseline_loads, lower = totals.baseline_loads, totals.lower_bound_bubble
        lower_simple = totals.lower_bound_bubble_simple
        info, compose_info = totals.partition_info, totals.compose_info
        plan_window_used = layout.plan_window
    dropped = np.flatnonzero(step < 0)
    if len(dropped) and remainder == "error":
        raise ConfigError(f"{len(dropped)} samples do not fill a whole step of {R}x{B}; pass "
                          f"{setting('remainder', 'drop')} to record and drop them, or change "
                          f"{setting('num_ranks')}/{setting('batch_size_per_rank')}")
    num_steps = int(step.max()) + 1
    if position is not None:
        loads, counts = totals.loads, totals.counts
    else:
        # summed in position order inside each (step, rank): the order every engine and the plan
        # artifact use (PlanTable.counts_and_loads), so the figures agree bit for bit
        kept = np.flatnonzero(step >= 0)
        kept = kept[np.lexsort((order_key[kept], rank[kept], step[kept]))]
        flat_sr = step[kept].astype(np.int64) * R + rank[kept]
        loads = np.bincount(flat_sr, weights=costs[kept], minlength=num_steps * R).reshape(num_steps, R)
        counts = np.bincount(flat_sr, minlength=num_steps * R).reshape(num_steps, R).astype(np.int32)
    if counts.min() == 0:
        raise AssertionError("plan left a rank without samples in a step")
    return Plan(num_ranks=R, batch_size_per_rank=B, num_steps=num_steps, step=step, rank=rank,
                order_key=order_key, dropped=dropped, loads=loads, counts=counts,
                baseline_loads=baseline_loads, lower_bound_bubble=lower, partition_info=info,
                lower_bound_bubble_simple=lower_simple, compose_window=W, compose_info=compose_info,
                budget_used=budget_used, position=position, plan_window=plan_window_used)
