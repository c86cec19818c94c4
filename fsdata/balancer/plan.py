"""Composing global batches and assigning their samples to ranks: the balancing plan.

A plan maps every input row to ``(step, rank)`` (``-1`` when dropped) plus a sort key that orders
a rank's rows by step, then by position in the step. It is computed from per-sample costs only
(one int per row), so it fits in memory for hundreds of millions of samples; the rows themselves
are streamed by :mod:`fsdata.balance`.

Global batches: a seeded permutation of the input rows (``numpy.random.default_rng(seed)``) cut
into steps of ``R*B`` samples (fixed policy). The equal-count baseline is today's practice on the
same global batches: each step's shuffled samples cut into ``R`` contiguous per-rank batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdata.balancer import bubble
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW, check_window, compose_steps
from fsdata.errors import ConfigError, InputError
from fsdata.balancer.partition import DEFAULT_METHOD, METHODS, per_rank_loads  # noqa: F401 (DEFAULT_METHOD re-exported)
from fsdata.balancer.partitioners import (CPSAT_GAP_THRESHOLD, CPSAT_MAX_STEPS, CPSAT_STEP_BUDGET_SECONDS,  # noqa: F401
                                          AutoPartitioner, Partitioner, get_partitioner)

STRATEGIES = ("balanced", "shuffle")
BATCH_POLICIES = ("fixed", "cost-budget")
REMAINDER_POLICIES = ("drop", "error")
#: ``auto``: lpt-swap, plus CP-SAT refinement of the worst steps when B is small (where it helps).
DEFAULT_PARTITIONER = "auto"
PARTITIONERS = ("auto", *METHODS)


def partition_auto(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, *,
                   cpsat_max_steps: int = CPSAT_MAX_STEPS, gap_threshold: float = CPSAT_GAP_THRESHOLD,
                   step_bound: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """``lpt-swap`` for every step, then CP-SAT on the steps whose gap to the proven bound is worth it
    (:class:`~fsdata.balancer.partitioners.AutoPartitioner`, the ``auto`` partitioner, as a function).

    A step is refined only if its straggler is above the step's proven lower bound by more than
    ``gap_threshold`` times ``sum_s max_s`` (its possible gain in run-bubble points); of those, the ``cpsat_max_steps`` with the largest absolute gap
    (they dominate the run bubble ``sum(max - mean) / sum(max)``), each for
    :data:`CPSAT_STEP_BUDGET_SECONDS` of CP-SAT deterministic time. The refinement only accepts
    strictly better assignments, so the result is never worse than ``lpt-swap``.

    Args:
        step_costs: shape ``[S x (R*B)]``, float64.
        num_ranks: R.
        batch_size_per_rank: B.
        cpsat_max_steps: most steps CP-SAT refines (0 disables it).
        gap_threshold: gap to the proven bound, as a fraction of the run's total straggler cost,
            below which a step is left alone.
        step_bound: shape ``[S]``, the proven bound per step if already computed.

    Returns:
        ``(ranks [S x (R*B)] int32, info)``; ``info`` holds ``method``, ``cpsat_gap_threshold``,
        ``steps_above_threshold``, ``cpsat_steps``, ``cpsat_improved_steps``,
        ``cpsat_budget_seconds_per_step``.
    """
    p = AutoPartitioner(cpsat_max_steps=cpsat_max_steps, gap_threshold=gap_threshold)
    ranks = p.partition(step_costs, num_ranks, batch_size_per_rank, step_bound=step_bound)
    return ranks, p.info


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


def check_settings(num_samples: int, num_ranks: int, batch_size_per_rank: int) -> None:
    """Validate R and B against the input size.

    Raises:
        ConfigError: ``num_ranks < 1`` or ``batch_size_per_rank < 1``.
        InputError: fewer samples than one step (``R*B``).
    """
    if num_ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {num_ranks}")
    if batch_size_per_rank < 1:
        raise ConfigError(f"--batch-size-per-rank must be >= 1, got {batch_size_per_rank}")
    if num_samples < num_ranks * batch_size_per_rank:
        raise InputError(f"--ranks {num_ranks} --batch-size-per-rank {batch_size_per_rank} needs at least "
                         f"{num_ranks * batch_size_per_rank} samples for one step; the input has {num_samples}: "
                         "lower --ranks or --batch-size-per-rank")


def shuffled_steps(num_samples: int, num_ranks: int, batch_size_per_rank: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded global batches.

    Returns:
        ``(steps [S x R*B] int64 row indices, remainder [D] int64 row indices)``.
    """
    perm = np.random.default_rng(seed).permutation(num_samples)
    per_step = num_ranks * batch_size_per_rank
    num_steps = num_samples // per_step
    return perm[: num_steps * per_step].reshape(num_steps, per_step), perm[num_steps * per_step:]


def make_plan(costs: np.ndarray, *, num_ranks: int, batch_size_per_rank: int, seed: int = 0,
              strategy: str = "balanced", batch_policy: str = "fixed", remainder: str = "drop",
              partitioner: str | Partitioner = DEFAULT_PARTITIONER, budget: float | None = None,
              compose_window: int = DEFAULT_COMPOSE_WINDOW) -> Plan:
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
            (:data:`PARTITIONERS`, :mod:`fsdata.balancer.partitioners`) or a
            :class:`~fsdata.balancer.partitioners.Partitioner` instance (injected).
        budget: per-rank per-step cost budget for ``cost-budget`` (default: chosen by the policy).
        compose_window: W; regroup the samples of W consecutive global batches so the per-step
            bound drops (:mod:`fsdata.balancer.compose`); 1 = none; default
            :data:`fsdata.balancer.compose.DEFAULT_COMPOSE_WINDOW` (as ``fsdata balance``). Applies to
            ``balanced`` + ``fixed`` only (the shuffle baseline and cost-budget keep the random
            global batches).

    Returns:
        :class:`Plan`.

    Raises:
        ConfigError: unknown strategy/policy, ``compose_window < 1``, or ``remainder='error'`` with a
            remainder.
        InputError: fewer samples than one step.
    """
    N = len(costs)
    check_settings(N, num_ranks, batch_size_per_rank)
    for value, allowed, flag in ((strategy, STRATEGIES, "--strategy"), (batch_policy, BATCH_POLICIES, "--batch-policy"),
                                 (remainder, REMAINDER_POLICIES, "--remainder")):
        if value not in allowed:
            raise ConfigError(f"unknown {flag} '{value}'; use one of {', '.join(allowed)}")
    check_window(compose_window)
    R, B = num_ranks, batch_size_per_rank
    steps, rest = shuffled_steps(N, R, B, seed)
    step_costs = costs[steps]
    baseline_ranks = np.broadcast_to(np.arange(R * B, dtype=np.int32) // B, steps.shape)
    baseline_loads = per_rank_loads(step_costs, baseline_ranks, R)
    W = 1
    compose_info = {"algorithm": "none", "compose_window": 1}
    if compose_window > 1 and strategy == "balanced" and batch_policy == "fixed" and len(steps) > 1:
        W = int(min(compose_window, len(steps)))
        uncomposed = bubble.lower_bound_bubble(step_costs, R, B)
        steps, compose_info = compose_steps(steps, costs, num_ranks=R, batch_size_per_rank=B, compose_window=W,
                                            seed=seed, return_info=True)
        step_costs = costs[steps]
        compose_info.update(compose_window_requested=int(compose_window), uncomposed_lower_bound_bubble=uncomposed)
    step_bound = bubble.step_proven_bound(step_costs, R, B)
    lower = bubble.bound_bubble(step_costs, step_bound, R)
    lower_simple = bubble.lower_bound_bubble(step_costs, R, B, kind="simple")
    budget_used = None
    step = np.full(N, -1, dtype=np.int32)
    rank = np.full(N, -1, dtype=np.int32)
    order_key = np.full(N, -1, dtype=np.int64)
    name = partitioner.name if isinstance(partitioner, Partitioner) else partitioner
    info: dict = {"method": "shuffle" if strategy == "shuffle" else name}
    if batch_policy == "cost-budget" and strategy == "balanced":
        from fsdata.balancer.cost_budget import plan_cost_budget  # noqa: PLC0415 (optional policy module)

        from fsdata.balancer.cost_budget import default_budget  # noqa: PLC0415

        perm = np.concatenate([steps.ravel(), rest])
        budget_used = float(budget) if budget is not None else default_budget(costs[perm], B)
        s_, r_ = plan_cost_budget(costs[perm], R, B, budget_used)
        info = {"method": "cost-budget", "budget": budget, "budget_used": budget_used}
        step[perm], rank[perm] = s_, r_
        # a rank's rows are ordered by step, then by position in the shuffled order
        order_key[perm] = s_.astype(np.int64) * N + np.arange(N)
        order_key[step < 0] = -1
    else:
        if strategy == "shuffle" or not isinstance(partitioner, Partitioner):
            method = "shuffle" if strategy == "shuffle" else partitioner
            if method not in PARTITIONERS:
                raise ConfigError(f"unknown --partitioner '{method}'; use one of {', '.join(PARTITIONERS)}")
            partitioner = get_partitioner(method)
        ranks = partitioner.partition(step_costs, R, B, step_bound=step_bound)
        info = partitioner.info
        flat = steps.ravel()
        step[flat] = np.repeat(np.arange(len(steps), dtype=np.int32), R * B)
        rank[flat] = ranks.ravel()
        order_key[flat] = np.arange(len(flat))
    dropped = np.flatnonzero(step < 0)
    if len(dropped) and remainder == "error":
        raise ConfigError(f"{len(dropped)} samples do not fill a whole step of {R}x{B}; "
                          "pass --remainder drop to record and drop them, or change --ranks/--batch-size-per-rank")
    num_steps = int(step.max()) + 1
    kept = step >= 0
    flat_sr = step[kept].astype(np.int64) * R + rank[kept]
    loads = np.bincount(flat_sr, weights=costs[kept], minlength=num_steps * R).reshape(num_steps, R)
    counts = np.bincount(flat_sr, minlength=num_steps * R).reshape(num_steps, R).astype(np.int32)
    if counts.min() == 0:
        raise AssertionError("plan left a rank without samples in a step")
    return Plan(num_ranks=R, batch_size_per_rank=B, num_steps=num_steps, step=step, rank=rank,
                order_key=order_key, dropped=dropped, loads=loads, counts=counts,
                baseline_loads=baseline_loads, lower_bound_bubble=lower, partition_info=info,
                lower_bound_bubble_simple=lower_simple, compose_window=W, compose_info=compose_info,
                budget_used=budget_used)
