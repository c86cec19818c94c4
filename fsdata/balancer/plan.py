"""Composing global batches and assigning their samples to ranks: the balancing plan.

A plan maps every input row to ``(step, rank)`` (``-1`` when dropped) plus a sort key that orders
a rank's rows by step, then by position in the step. It is computed from per-sample costs only
(one int per row), so it fits in memory for hundreds of millions of samples; the rows themselves
are streamed by :mod:`fsdata.balance`.

Global batches: a seeded permutation of the input rows (:mod:`fsdata.balancer.order`, computable
per row) cut into steps of ``R*B`` samples (fixed policy). The equal-count baseline is today's
practice on the same global batches: each step's shuffled samples cut into ``R`` contiguous
per-rank batches.

Plan windows (fixed policy): the steps are planned in windows of ``K`` consecutive steps
(:class:`PlanLayout`; ``K`` a multiple of the composition window), each by :func:`plan_one_window` from
that window's samples alone, so a distributed engine plans window by window with memory bounded
by one window (the Ray engine: one task per window). :func:`make_plan` runs the same windows one
after the other; run-level figures are combined from per-step values (:func:`combine_windows`),
so both engines produce the same plan and the same numbers, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdata.balancer import bubble
from fsdata.balancer.order import SHUFFLE, shuffled_order
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW, check_window, compose_steps
from fsdata.errors import ConfigError, InputError, in_cli, setting
from fsdata.balancer.partition import DEFAULT_METHOD, METHODS, per_rank_loads  # noqa: F401 (DEFAULT_METHOD re-exported)
from fsdata.balancer.partitioners import CPSAT_MAX_STEPS, AutoPartitioner, Partitioner, get_partitioner

STRATEGIES = ("balanced", "shuffle")
BATCH_POLICIES = ("fixed", "cost-budget")
REMAINDER_POLICIES = ("drop", "error")
#: ``auto``: lpt-swap, plus CP-SAT refinement of the worst steps when B is small (where it helps).
DEFAULT_PARTITIONER = "auto"
PARTITIONERS = ("auto", *METHODS)
#: Steps per plan window (``--plan-window``; rounded up to a multiple of the composition window).
#: Memory of planning one window: about 80 bytes x K x R x B (K=1024, R=256, B=32: ~0.7 GB).
DEFAULT_PLAN_WINDOW = 1024
#: The shuffle of fsdata 0.1 (``numpy.random.default_rng(seed).permutation(N)``): outputs whose
#: manifest records no ``settings.shuffle`` were made with it (verify and the report still read them).
LEGACY_SHUFFLE = "numpy-permutation"


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


def check_settings(num_samples: int, num_ranks: int, batch_size_per_rank: int) -> None:
    """Validate R and B against the input size.

    Raises:
        ConfigError: ``num_ranks < 1`` or ``batch_size_per_rank < 1``.
        InputError: fewer samples than one step (``R*B``).
    """
    if num_ranks < 1:
        raise ConfigError(f"{setting('num_ranks')} must be >= 1, got {num_ranks}")
    if batch_size_per_rank < 1:
        raise ConfigError(f"{setting('batch_size_per_rank')} must be >= 1, got {batch_size_per_rank}")
    if num_samples < num_ranks * batch_size_per_rank:
        r, b = setting("num_ranks"), setting("batch_size_per_rank")
        given = (" " if in_cli() else ", ").join([setting("num_ranks", num_ranks, owner=None),
                                                  setting("batch_size_per_rank", batch_size_per_rank, owner=None)])
        raise InputError(f"{given} needs at least {num_ranks * batch_size_per_rank} samples for one step; the "
                         f"input has {num_samples}: lower {r} or {b}")


def check_policies(strategy: str, batch_policy: str, remainder: str) -> None:
    """Raises ConfigError naming the flag when a policy name is unknown."""
    for value, allowed, flag in ((strategy, STRATEGIES, "--strategy"), (batch_policy, BATCH_POLICIES, "--batch-policy"),
                                 (remainder, REMAINDER_POLICIES, "--remainder")):
        if value not in allowed:
            raise ConfigError(f"unknown {flag} '{value}'; use one of {', '.join(allowed)}")


def shuffled_steps(num_samples: int, num_ranks: int, batch_size_per_rank: int, seed: int,
                   shuffle: str = SHUFFLE) -> tuple[np.ndarray, np.ndarray]:
    """Seeded global batches.

    Args:
        num_samples: N.
        num_ranks: R.
        batch_size_per_rank: B.
        seed: the shuffle's seed.
        shuffle: :data:`fsdata.balancer.order.SHUFFLE` (today) or :data:`LEGACY_SHUFFLE` (to re-read
            outputs of fsdata 0.1).

    Returns:
        ``(steps [S x R*B] int64 row indices, remainder [D] int64 row indices)``.

    Raises:
        ConfigError: unknown ``shuffle``.
    """
    if shuffle == SHUFFLE:
        perm = shuffled_order(num_samples, seed)
    elif shuffle == LEGACY_SHUFFLE:
        perm = np.random.default_rng(seed).permutation(num_samples)
    else:
        raise ConfigError(f"unknown shuffle {shuffle!r}; this fsdata knows {SHUFFLE!r} and {LEGACY_SHUFFLE!r}")
    per_step = num_ranks * batch_size_per_rank
    num_steps = num_samples // per_step
    return perm[: num_steps * per_step].reshape(num_steps, per_step), perm[num_steps * per_step:]


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

    Raises:
        ConfigError: ``plan_window < 1`` or ``compose_window < 1``; InputError: fewer samples than a step.
    """
    check_settings(num_samples, num_ranks, batch_size_per_rank)
    check_window(compose_window)
    if int(plan_window) != plan_window or plan_window < 1:
        raise ConfigError(f"{setting('plan_window')} must be an integer >= 1 (steps planned together), "
                          f"got {plan_window}")
    S = num_samples // (num_ranks * batch_size_per_rank)
    W = int(min(compose_window, S)) if compose and compose_window > 1 and S > 1 else 1
    K = -(-int(plan_window) // W) * W
    return PlanLayout(num_samples=int(num_samples), num_ranks=int(num_ranks), batch_size_per_rank=int(batch_size_per_rank),
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
    if method not in PARTITIONERS:
        raise ConfigError(f"unknown {setting('partitioner')} '{method}'; use one of {', '.join(PARTITIONERS)}")
    if method == "auto":
        return AutoPartitioner(cpsat_max_steps=-(-CPSAT_MAX_STEPS * steps_in_window // max(num_steps, 1)))
    return get_partitioner(method)


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
    if layout.compose_window > 1 and strategy == "balanced":
        un_mean = step_costs.sum(axis=1) / R
        un_bound = bubble.step_proven_bound(step_costs, R, B)
        local, compose_info = compose_steps(local, costs, num_ranks=R, batch_size_per_rank=B,
                                            compose_window=layout.compose_window, seed=seed,
                                            first_window=s0 // layout.compose_window, return_info=True)
        step_costs = costs[local]
    step_bound = bubble.step_proven_bound(step_costs, R, B)
    p = _window_partitioner(partitioner, strategy, Sw, layout.num_steps)
    ranks = p.partition(step_costs, R, B, step_bound=step_bound).astype(np.int32)
    flat = local.ravel()
    key = (np.arange(Sw, dtype=np.int64)[:, None] * R + ranks).ravel()
    order = np.argsort(key, kind="stable")  # by (step, rank), then position order inside the step
    grp = key[order]
    starts = np.flatnonzero(np.concatenate([[True], grp[1:] != grp[:-1]]))
    first = np.repeat(starts, np.diff(np.append(starts, len(order))))
    pos_in_batch = np.empty(len(order), dtype=np.int32)
    pos_in_batch[order] = (np.arange(len(order)) - first).astype(np.int32)
    m = p1 - p0
    step = np.full(m, -1, dtype=np.int32)
    rank = np.full(m, -1, dtype=np.int32)
    position = np.full(m, -1, dtype=np.int32)
    step[flat] = np.repeat(np.arange(s0, s1, dtype=np.int32), n)
    rank[flat] = ranks.ravel()
    position[flat] = pos_in_batch
    loads = per_rank_loads(step_costs, ranks, R)
    counts = np.bincount(key, minlength=Sw * R).reshape(Sw, R).astype(np.int32)
    return WindowPlan(index=int(window), rows=rows, step=step, rank=rank, position=position, loads=loads,
                      counts=counts, baseline_loads=baseline_loads, step_mean=step_costs.sum(axis=1) / R,
                      step_bound=step_bound, step_bound_simple=bubble.step_lower_bound(step_costs, R, B),
                      uncomposed_mean=un_mean, uncomposed_bound=un_bound, partition_info=dict(p.info),
                      compose_info=compose_info)


def _bound_ratio(bound: np.ndarray, mean: np.ndarray) -> float:
    """``sum(LB - mean) / sum(LB)`` with ``LB = max(bound, mean)`` (:func:`fsdata.balancer.bubble.bound_bubble`)."""
    if not len(mean):
        return 0.0
    lb = np.maximum(bound, mean)
    denom = float(lb.sum())
    return 0.0 if denom <= 0 else max(0.0, float((lb - mean).sum() / denom))


def _merge_info(infos: list[dict]) -> dict:
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
        info = _merge_info(composed)
        info.update(compose_window=layout.compose_window, compose_window_requested=int(compose_window_requested),
                    uncomposed_lower_bound_bubble=_bound_ratio(cat("uncomposed_bound"), cat("uncomposed_mean")))
        info["sub_window_sizes_used"] = {k: v for k, v in sorted(info.get("sub_window_sizes_used", {}).items(),
                                                                 key=lambda kv: int(kv[0]))}
    else:
        info = {"algorithm": "none", "compose_window": 1}
    return WindowTotals(loads=np.concatenate([w.loads for w in windows]), counts=np.concatenate([w.counts for w in windows]),
                        baseline_loads=np.concatenate([w.baseline_loads for w in windows]),
                        lower_bound_bubble=_bound_ratio(cat("step_bound"), mean),
                        lower_bound_bubble_simple=_bound_ratio(cat("step_bound_simple"), mean),
                        partition_info=_merge_info([w.partition_info for w in windows]), compose_info=info)


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
            (:data:`PARTITIONERS`, :mod:`fsdata.balancer.partitioners`) or a
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
        ConfigError: unknown strategy/policy, ``compose_window < 1``, or ``remainder='error'`` with a
            remainder.
        InputError: fewer samples than one step.
    """
    N = len(costs)
    check_settings(N, num_ranks, batch_size_per_rank)
    check_policies(strategy, batch_policy, remainder)
    check_window(compose_window)
    R, B = num_ranks, batch_size_per_rank
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
            step[rows], rank[rows], position[rows] = wp.step, wp.rank, wp.position
            order_key[rows] = np.where(wp.step >= 0, np.arange(a, b), -1)
            windows.append(wp.summary())
        del order
        totals = combine_windows(windows, layout, compose_window)
        baseline_loads, lower, lower_simple = totals.baseline_loads, totals.lower_bound_bubble, totals.lower_bound_bubble_simple
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
