"""The plan stage in one process (``fsdata plan``, the local engine, and the Ray engine's
cost-budget path): read lengths, cost them, plan every epoch (:func:`fsdata.balancer.plan.make_plan`
through :func:`fsdata.balancer.plan.plan_costs`), and wrap the result as a
:class:`~fsdata.shards.plan_file.PlanTable`.
"""

from __future__ import annotations

import time

import numpy as np

from fsdata.balancer.cost import CostModel, load_cost_model
from fsdata.balancer.plan import Plan, plan_costs
from fsdata.errors import ConfigError
from fsdata.balancer.settings import PlanSettings
from fsdata.samples.io import SampleSource
from fsdata.shards.plan_file import PlanTable, plan_positions, plan_table_from_plan
from fsdata.shards.writer import check_reserved_columns


def make_plan_table(src: SampleSource, settings: PlanSettings, *,
                    timings: dict[str, float] | None = None) -> PlanTable:
    """Stage 1: read lengths, cost them, plan (:func:`fsdata.balancer.plan.make_plan`).

    ``timings``, if given, receives seconds for ``read_lengths`` and ``plan``.

    Raises:
        InputError: bad input (including a reserved column name).
        ConfigError: impossible settings or an unknown cost model.
    """
    check_reserved_columns(src)
    return plan_table(src, settings, load_cost_model(settings.cost_model), timings=timings)


#: Most rows a plan holds (E epochs x N samples): steps and positions are int32.
MAX_PLAN_ROWS = 2**31 - 1


def plan_table(src: SampleSource, settings: PlanSettings, cost_model: CostModel, *,
               timings: dict[str, float] | None = None, first_epoch_mask: np.ndarray | None = None) -> PlanTable:
    """:func:`make_plan_table` after the pre-flight (:meth:`fsdata.engines.base.Engine.run` checked
    the columns and settings and loaded ``cost_model``).

    ``first_epoch_mask`` (shape ``[N]`` bool, with ``settings.epochs > 1``): epoch 0 is a partial
    epoch of these samples only (a resharded OUTPUT's rest of an epoch,
    :mod:`fsdata.shards.as_input`); the others' epoch-0 entries get step -2 (neither written nor
    dropped)."""
    if settings.epochs * src.num_rows > MAX_PLAN_ROWS:  # before anything is allocated for E x N rows
        raise ConfigError(f"--epochs {settings.epochs} x {src.num_rows} samples = {settings.epochs * src.num_rows} "
                          f"plan rows, over {MAX_PLAN_ROWS} (2^31-1; about 28 bytes of memory each): lower --epochs")
    t0 = time.perf_counter()
    lengths, ids = src.lengths_and_ids()
    t1 = time.perf_counter()
    costs = cost_model.cost(lengths)
    del lengths
    if settings.epochs == 1 and first_epoch_mask is None:
        plan = plan_costs(costs, settings)
        table = plan_table_from_plan(src, plan, ids, costs, cost_model, settings)
    else:
        table = _plan_epochs(src, costs, ids, cost_model, settings, first_epoch_mask)
    if timings is not None:
        timings.update(read_lengths=t1 - t0, plan=time.perf_counter() - t1)
    return table


def _plan_epochs(src: SampleSource, costs: np.ndarray, ids: np.ndarray, cost_model: CostModel,
                 settings: PlanSettings, first_epoch_mask: np.ndarray | None = None) -> PlanTable:
    """Plan ``settings.epochs`` epochs, one :func:`~fsdata.balancer.plan.plan_costs` call per epoch with
    :func:`fsdata.balancer.order.epoch_seed`, and join them as one :class:`PlanTable` of ``E*N``
    entries (epoch e's steps shifted by the steps of the epochs before it: ``e*S`` under the fixed
    policy, where every epoch has ``S = N // (R*B)`` steps; under cost-budget each epoch has its own
    count, recorded in ``epoch_num_steps``). Planning memory is one epoch's plan at a time (itself
    planned window by window under the fixed policy); the joined table holds ``E*N`` entries.

    Run figures are over all steps: loads and counts concatenated, the proven bounds recombined
    from per-step bounds (:func:`fsdata.balancer.bubble.bound_bubble`'s formula) of the steps
    :func:`fsdata.balancer.plan.make_plan` bounds (the written steps under the fixed policy, the
    seeded global batches under cost-budget).
    """
    from fsdata.balancer import bubble  # noqa: PLC0415
    from fsdata.balancer.order import epoch_seed  # noqa: PLC0415
    from fsdata.balancer.plan import shuffled_steps  # noqa: PLC0415
    from fsdata.balancer.windows import bound_ratio as _bound_ratio, merge_infos as _merge_info  # noqa: PLC0415

    E, N = int(settings.epochs), len(costs)
    R, B = settings.num_ranks, settings.batch_size_per_rank
    step = np.full(E * N, -1, dtype=np.int32)
    rank = np.full(E * N, -1, dtype=np.int32)
    position = np.full(E * N, -1, dtype=np.int32)
    loads, counts, baseline, pinfos, cinfos = [], [], [], [], []
    bound, bound_simple, mean, un_bound, un_mean = [], [], [], [], []
    first: Plan | None = None
    epoch_steps: list[int] = []
    offset = 0
    all_costs = costs
    for e in range(E):
        seed_e = epoch_seed(settings.seed, e)
        # a partial first epoch (first_epoch_mask): planned from its samples; the others get step -2
        sub = np.flatnonzero(first_epoch_mask) if e == 0 and first_epoch_mask is not None else slice(None)
        costs = all_costs[sub]
        N_e = len(costs)
        plan = plan_costs(costs, settings, seed=seed_e)
        if first is None:
            first = plan
        S = plan.num_steps
        sl = np.arange(e * N, (e + 1) * N)[sub]
        if N_e < N:
            step[e * N:(e + 1) * N] = -2
        kept = plan.step >= 0
        step[sl] = np.where(kept, plan.step + offset, -1)
        rank[sl] = plan.rank
        position[sl] = (plan.position if plan.position is not None
                        else plan_positions(plan.step, plan.rank, plan.order_key))  # cost-budget
        loads.append(plan.loads)
        counts.append(plan.counts)
        baseline.append(plan.baseline_loads)
        pinfos.append(plan.partition_info)
        cinfos.append(plan.compose_info)
        if plan.position is None:  # cost-budget: make_plan bounds the seeded global batches
            g, _ = shuffled_steps(N_e, R, B, seed_e)
            sc = costs[g]
            del g
        else:  # the written (possibly composed) steps
            rows = np.flatnonzero(kept)
            rows = rows[np.argsort(plan.step[rows], kind="stable")]
            sc = costs[rows].reshape(S, R * B)
            del rows
        proven, simple = bubble.step_bounds(sc, R, B)  # one sort for both
        bound.append(proven)
        bound_simple.append(simple)
        del proven, simple
        mean.append(sc.sum(axis=1) / R)
        epoch_steps.append(int(S))
        offset += S
        if plan.compose_window > 1:
            g, _ = shuffled_steps(N_e, R, B, seed_e)
            gc = costs[g]
            un_bound.append(bubble.step_proven_bound(gc, R, B))
            un_mean.append(gc.sum(axis=1) / R)
            del g, gc
        del plan, sc, kept
    costs = all_costs
    cat = np.concatenate
    compose_info = first.compose_info
    if first.compose_window > 1 and all(c is not None and "uncomposed_lower_bound_bubble" in c for c in cinfos):
        compose_info = _merge_info(cinfos)
        compose_info.update(compose_window=first.compose_info["compose_window"],
                            compose_window_requested=first.compose_info.get("compose_window_requested"),
                            uncomposed_lower_bound_bubble=_bound_ratio(cat(un_bound), cat(un_mean)))
        if "sub_window_sizes_used" in compose_info:
            compose_info["sub_window_sizes_used"] = dict(sorted(compose_info["sub_window_sizes_used"].items(),
                                                                key=lambda kv: int(kv[0])))
    joined = Plan(num_ranks=R, batch_size_per_rank=B, num_steps=offset, step=step, rank=rank,
                  order_key=np.empty(0, dtype=np.int64), dropped=np.empty(0, dtype=np.int64), loads=cat(loads),
                  counts=cat(counts), baseline_loads=cat(baseline),
                  lower_bound_bubble=_bound_ratio(cat(bound), cat(mean)), partition_info=_merge_info(pinfos),
                  lower_bound_bubble_simple=_bound_ratio(cat(bound_simple), cat(mean)),
                  compose_window=first.compose_window, compose_info=compose_info, budget_used=first.budget_used,
                  position=position, plan_window=first.plan_window)
    table = plan_table_from_plan(src, joined, np.tile(np.asarray(ids, dtype=np.int64), E),
                                 np.tile(np.asarray(costs, dtype=np.float64), E), cost_model, settings)
    table.meta.num_samples_input = int(N)
    # steps_per_epoch when every epoch has the same count (always under the fixed policy);
    # epoch_num_steps under cost-budget, whose epochs differ by a few steps (or a resharded partial first epoch)
    table.meta.set_epochs(E, epoch_steps, per_epoch_list=settings.batch_policy == "cost-budget")
    return table

