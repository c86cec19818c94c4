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

from fsdata import bubble
from fsdata.errors import ConfigError, InputError
from fsdata.partition import DEFAULT_METHOD, partition_steps, per_rank_loads

STRATEGIES = ("balanced", "shuffle")
BATCH_POLICIES = ("fixed", "cost-budget")
REMAINDER_POLICIES = ("drop", "error")
DEFAULT_PARTITIONER = DEFAULT_METHOD


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
        lower_bound_bubble: smallest run bubble of any equal-count per-step assignment.
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

    @property
    def predicted_bubble(self) -> float:
        return bubble.run_bubble(self.loads)

    @property
    def baseline_bubble(self) -> float:
        return bubble.run_bubble(self.baseline_loads)


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
              partitioner: str = DEFAULT_PARTITIONER, budget: float | None = None) -> Plan:
    """Compose global batches and assign samples to ranks.

    Args:
        costs: shape ``[N]`` float64, predicted cost of each input row (input order).
        num_ranks: R (world size).
        batch_size_per_rank: B.
        seed: seed of the global-batch shuffle.
        strategy: ``balanced`` or ``shuffle`` (equal counts, no balancing: today's practice).
        batch_policy: ``fixed`` (B per rank per step) or ``cost-budget`` (variable counts, equal cost).
        remainder: ``drop`` (record the samples that do not fill a last step) or ``error``.
        partitioner: per-step method for the fixed policy (see :mod:`fsdata.partition`).
        budget: per-rank per-step cost budget for ``cost-budget`` (default: chosen by the policy).

    Returns:
        :class:`Plan`.

    Raises:
        ConfigError: unknown strategy/policy, or ``remainder='error'`` with a remainder.
        InputError: fewer samples than one step.
    """
    N = len(costs)
    check_settings(N, num_ranks, batch_size_per_rank)
    for value, allowed, flag in ((strategy, STRATEGIES, "--strategy"), (batch_policy, BATCH_POLICIES, "--batch-policy"),
                                 (remainder, REMAINDER_POLICIES, "--remainder")):
        if value not in allowed:
            raise ConfigError(f"unknown {flag} '{value}'; use one of {', '.join(allowed)}")
    R, B = num_ranks, batch_size_per_rank
    steps, rest = shuffled_steps(N, R, B, seed)
    step_costs = costs[steps]
    baseline_ranks = np.broadcast_to(np.arange(R * B, dtype=np.int32) // B, steps.shape)
    baseline_loads = per_rank_loads(step_costs, baseline_ranks, R)
    lower = bubble.lower_bound_bubble(step_costs, R, B)
    step = np.full(N, -1, dtype=np.int32)
    rank = np.full(N, -1, dtype=np.int32)
    order_key = np.full(N, -1, dtype=np.int64)
    if batch_policy == "cost-budget" and strategy == "balanced":
        from fsdata.cost_budget import plan_cost_budget  # noqa: PLC0415 (optional policy module)

        perm = np.concatenate([steps.ravel(), rest])
        s_, r_ = plan_cost_budget(costs[perm], R, B, budget)
        step[perm], rank[perm] = s_, r_
        # a rank's rows are ordered by step, then by position in the shuffled order
        order_key[perm] = s_.astype(np.int64) * N + np.arange(N)
        order_key[step < 0] = -1
    else:
        method = "shuffle" if strategy == "shuffle" else partitioner
        ranks = baseline_ranks if method == "shuffle" else partition_steps(step_costs, R, B, method=method)
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
                baseline_loads=baseline_loads, lower_bound_bubble=lower)
