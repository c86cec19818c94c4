"""CP-SAT large-neighbourhood refinement of a per-step assignment (method ``lpt-swap-cpsat``).

A whole step is too big for an exact model at R >= 64 (R*B*R booleans; BACKGROUND.md measured a
29 s build at R=256), so the heuristic's assignment is refined piece by piece (large-neighbourhood
search, Shaw 1998): take the most loaded rank (the straggler) plus the ``num_light_ranks`` lightest
ranks, and re-solve the assignment of their ``(k+1)*B`` samples exactly with OR-Tools CP-SAT:

* boolean ``x[i, j]``: sample i goes to sub-rank j; each sample exactly once, each sub-rank
  exactly B samples;
* integer load per sub-rank from integer-scaled costs (CP-SAT is integer-only: costs are scaled so
  the largest sample of the step becomes ``cost_scale`` and rounded); minimise the largest load;
* a complete hint (the current assignment) and a time limit per sub-solve.

The float loads of the solution are recomputed and the move is accepted only if the neighbourhood's
largest float load strictly drops, so the result is never worse than the heuristic. Rounds repeat
until the step reaches its proven lower bound (:func:`fsdata.balancer.bubble.step_proven_bound`), no neighbourhood
improves, or the per-step time budget is spent. Useful mainly for small per-rank batches B, where
single swaps get stuck.
"""

from __future__ import annotations

import numpy as np

from fsdata.balancer.bubble import step_proven_bound
from fsdata.errors import ConfigError

#: Integer value the largest sample cost of a step is scaled to before rounding.
DEFAULT_COST_SCALE = 1_000_000


def _solver(time_limit_seconds: float, num_workers: int, seed: int):
    """A CP-SAT solver limited by deterministic time (CP-SAT's work units, ~seconds) rather than
    wall time: the same input gives the same answer on a loaded machine, so balance output stays
    byte-identical across runs."""
    from ortools.sat.python import cp_model  # noqa: PLC0415 (OR-Tools import is slow; only when used)

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(time_limit_seconds, 1e-3)
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    return solver


def _solve_neighbourhood(c_int: np.ndarray, hint: np.ndarray, k: int, B: int,
                         time_limit_seconds: float, num_workers: int, seed: int):
    """Exactly re-assign ``len(c_int)`` samples to k sub-ranks with B each; minimise the max load.

    Returns:
        sub-rank per sample (int array) or None when CP-SAT returned no solution; and whether
        the solution is proven optimal.
    """
    from ortools.sat.python import cp_model

    n = len(c_int)
    model = cp_model.CpModel()
    x = [[model.new_bool_var(f"x{i}_{j}") for j in range(k)] for i in range(n)]
    upper = int(c_int.sum())
    max_load = model.new_int_var(0, upper, "max_load")
    for i in range(n):
        model.add_exactly_one(x[i])
        for j in range(k):
            model.add_hint(x[i][j], int(hint[i] == j))
    for j in range(k):
        col = [x[i][j] for i in range(n)]
        model.add(sum(col) == B)
        model.add(sum(int(c_int[i]) * x[i][j] for i in range(n)) <= max_load)
    model.minimize(max_load)
    solver = _solver(time_limit_seconds, num_workers, seed)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, False
    sub = np.array([next(j for j in range(k) if solver.value(x[i][j])) for i in range(n)])
    return sub, status == cp_model.OPTIMAL


def cpsat_refine_step(costs: np.ndarray, ranks: np.ndarray, num_ranks: int, batch_size_per_rank: int, *,
                      time_limit_seconds: float = 1.0, num_light_ranks: int = 3,
                      solve_time_limit_seconds: float = 0.2, num_workers: int = 1, seed: int = 0,
                      cost_scale: int = DEFAULT_COST_SCALE) -> tuple[np.ndarray, int]:
    """Refine one step's assignment with CP-SAT neighbourhoods (see module docstring).

    Args:
        costs: shape ``[R*B]``, float; the step's sample costs.
        ranks: shape ``[R*B]``, int; the starting assignment (exactly B per rank), e.g. lpt-swap.
        num_ranks: R.
        batch_size_per_rank: B.
        time_limit_seconds: budget for the whole step, in CP-SAT deterministic time (about seconds
            on an unloaded core; used instead of wall time so results are reproducible): at most
            ``ceil(time_limit_seconds / solve_time_limit_seconds)`` neighbourhood solves.
        num_light_ranks: lightest ranks re-solved together with the straggler (k).
        solve_time_limit_seconds: cap on one CP-SAT sub-solve (deterministic time).
        num_workers: CP-SAT search workers per sub-solve.
        seed: CP-SAT random seed.
        cost_scale: integer the step's largest cost maps to.

    Returns:
        ``(ranks int32[R*B], accepted_moves)``; the max per-rank load is never above the input's.
    """
    c = np.asarray(costs, dtype=np.float64)
    R, B = num_ranks, batch_size_per_rank
    out = np.asarray(ranks, dtype=np.int32).copy()
    k = min(num_light_ranks + 1, R)
    if k < 2 or c.size == 0:
        return out, 0
    lb = float(step_proven_bound(c[None, :], R, B)[0])
    cmax = float(c.max())
    c_int = np.rint(c * (cost_scale / cmax)).astype(np.int64) if cmax > 0 else np.zeros(len(c), np.int64)
    # the budget is spent in deterministic sub-solve units (see _solve_neighbourhood), not wall time
    rounds_left = max(1, int(np.ceil(time_limit_seconds / max(solve_time_limit_seconds, 1e-3))))
    moves = 0
    while True:
        loads = np.bincount(out, weights=c, minlength=R)
        m = int(np.argmax(loads))
        if loads[m] <= lb * (1 + 1e-12):
            break
        if rounds_left <= 0:
            break
        rounds_left -= 1
        light = [int(r) for r in np.argsort(loads, kind="stable") if r != m][: k - 1]
        subset = np.sort(np.array([m] + light))
        idx = np.flatnonzero(np.isin(out, subset))
        hint = np.searchsorted(subset, out[idx])
        sub, _ = _solve_neighbourhood(c_int[idx], hint, k, B, solve_time_limit_seconds,
                                            num_workers, seed)
        if sub is None:
            break
        new_loads = np.bincount(sub, weights=c[idx], minlength=k)
        if new_loads.max() < loads[subset].max() * (1 - 1e-12):
            out[idx] = subset[sub]
            moves += 1
        else:
            break  # this neighbourhood cannot lower the straggler (proven, or not found in time)
    return out, moves


def cpsat_refine_steps(step_costs: np.ndarray, ranks: np.ndarray, num_ranks: int, batch_size_per_rank: int,
                       **kwargs) -> np.ndarray:
    """Apply :func:`cpsat_refine_step` to every step.

    Args:
        step_costs: shape ``[S x (R*B)]``, float.
        ranks: shape ``[S x (R*B)]``, int; starting assignment.
        num_ranks: R.
        batch_size_per_rank: B.
        **kwargs: passed to :func:`cpsat_refine_step` (``time_limit_seconds`` is per step).

    Returns:
        shape ``[S x (R*B)]``, int32.

    Raises:
        ConfigError: non-positive time limit or negative ``num_light_ranks``.
    """
    if kwargs.get("time_limit_seconds", 1.0) <= 0 or kwargs.get("num_light_ranks", 3) < 1:
        raise ConfigError("cpsat: time_limit_seconds must be > 0 and num_light_ranks >= 1 "
                          f"(got {kwargs.get('time_limit_seconds')}, {kwargs.get('num_light_ranks')})")
    c = np.asarray(step_costs, dtype=np.float64)
    out = np.asarray(ranks, dtype=np.int32).copy()
    for s in range(c.shape[0]):
        out[s], _ = cpsat_refine_step(c[s], out[s], num_ranks, batch_size_per_rank, **kwargs)
    return out


#: Largest exact model :func:`cpsat_step_bound` builds (booleans sample x rank = R*B*R).
EXACT_MAX_BOOLEANS = 20_000


def cpsat_step_bound(costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, *,
                     time_limit_seconds: float = 1.0, num_workers: int = 1, seed: int = 0,
                     cost_scale: int = DEFAULT_COST_SCALE) -> tuple[float, bool] | None:
    """Exact lower bound on one step's straggler from CP-SAT over the whole step (small steps only).

    The model is the one of the module docstring over all R ranks, with costs scaled by
    ``cost_scale / max(cost)`` and rounded *down* (every scaled load is at most the true one, so
    the solver's bound, scaled back, stays a valid lower bound), ranks ordered by decreasing load
    (symmetry breaking) and the max load bounded below by the pigeonhole bound. Time-bounded in
    deterministic time, so the answer is reproducible.

    Args:
        costs: shape ``[R*B]``, float; one step's sample costs.
        num_ranks: R.
        batch_size_per_rank: B.
        time_limit_seconds: CP-SAT deterministic time limit (about seconds).
        num_workers: CP-SAT workers.
        seed: CP-SAT random seed.
        cost_scale: integer the largest cost maps to.

    Returns:
        ``(bound, proven_optimal)`` with ``bound`` in cost units (never above the true optimum,
        and at least the pigeonhole bound), or None when the model is above
        :data:`EXACT_MAX_BOOLEANS` booleans.
    """
    from ortools.sat.python import cp_model

    c = np.asarray(costs, dtype=np.float64)
    R, B = int(num_ranks), int(batch_size_per_rank)
    n = R * B
    pigeon = float(step_proven_bound(c[None, :], R, B)[0])
    if n * R > EXACT_MAX_BOOLEANS or R < 2:
        return None if R >= 2 else (pigeon, True)
    cmax = float(c.max())
    if cmax <= 0:
        return 0.0, True
    scale = cost_scale / cmax
    ci = np.floor(c * scale).astype(np.int64)
    order = np.argsort(-ci, kind="stable")
    ci = ci[order]
    model = cp_model.CpModel()
    x = [[model.new_bool_var(f"x{i}_{j}") for j in range(R)] for i in range(n)]
    upper = int(ci.sum())
    loads = [model.new_int_var(0, upper, f"l{j}") for j in range(R)]
    lb_int = int(np.floor(pigeon * scale * (1 - 1e-9)))
    max_load = model.new_int_var(min(lb_int, upper), upper, "max_load")
    for i in range(n):
        model.add_exactly_one(x[i])
    for j in range(R):
        col = [x[i][j] for i in range(n)]
        model.add(sum(col) == B)
        model.add(loads[j] == sum(int(ci[i]) * x[i][j] for i in range(n)))
        model.add(loads[j] <= max_load)
    for j in range(1, R):
        model.add(loads[j - 1] >= loads[j])
    model.minimize(max_load)
    solver = _solver(time_limit_seconds, num_workers, seed)
    status = solver.solve(model)
    optimal = status == cp_model.OPTIMAL
    found = solver.objective_value if optimal else solver.best_objective_bound
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = solver.best_objective_bound if status == cp_model.UNKNOWN else 0
    return max(pigeon, float(found) / scale), optimal


def tighten_step_bounds(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, step_bound: np.ndarray,
                        step_max: np.ndarray, *, max_steps: int = 8, time_limit_seconds: float = 1.0
                        ) -> tuple[np.ndarray, dict]:
    """Tighten (or confirm) per-step bounds with exact CP-SAT on the steps furthest from them.

    Args:
        step_costs: shape ``[S x R*B]``, float.
        num_ranks: R.
        batch_size_per_rank: B.
        step_bound: shape ``[S]``, float; current lower bound per step (e.g. the pigeonhole bound).
        step_max: shape ``[S]``, float; the achieved straggler per step.
        max_steps: most steps to solve (largest ``step_max - step_bound`` first).
        time_limit_seconds: CP-SAT deterministic time per step.

    Returns:
        ``(bound [S] float64, info)``: the bound, raised where CP-SAT proved more; ``info`` holds
        ``steps_tried``, ``steps_proven_optimal``, ``steps_heuristic_optimal`` (the achieved
        straggler equals the proven optimum), ``exact_model`` (False when the step is too big).
    """
    c = np.asarray(step_costs, dtype=np.float64)
    bound = np.asarray(step_bound, dtype=np.float64).copy()
    info = {"steps_tried": 0, "steps_proven_optimal": 0, "steps_heuristic_optimal": 0,
            "exact_model": num_ranks * num_ranks * batch_size_per_rank <= EXACT_MAX_BOOLEANS}
    if not info["exact_model"] or max_steps <= 0 or len(c) == 0:
        return bound, info
    gap = np.asarray(step_max) - bound
    for s in [int(s) for s in np.argsort(-gap, kind="stable")[:max_steps] if gap[s] > 0]:
        res = cpsat_step_bound(c[s], num_ranks, batch_size_per_rank, time_limit_seconds=time_limit_seconds)
        info["steps_tried"] += 1
        if res is None:
            continue
        b, optimal = res
        bound[s] = max(bound[s], b)
        info["steps_proven_optimal"] += int(optimal)
        info["steps_heuristic_optimal"] += int(optimal and step_max[s] <= b * (1 + 1e-6))
    return bound, info
