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
until the step reaches its lower bound (:func:`fsdata.bubble.step_lower_bound`), no neighbourhood
improves, or the per-step time budget is spent. Useful mainly for small per-rank batches B, where
single swaps get stuck.
"""

from __future__ import annotations

import time

import numpy as np

from fsdata.bubble import step_lower_bound
from fsdata.errors import ConfigError

#: Integer value the largest sample cost of a step is scaled to before rounding.
DEFAULT_COST_SCALE = 1_000_000


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
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit_seconds, 1e-3)
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
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
        time_limit_seconds: wall-clock budget for the whole step.
        num_light_ranks: lightest ranks re-solved together with the straggler (k).
        solve_time_limit_seconds: cap on one CP-SAT sub-solve.
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
    lb = float(step_lower_bound(c[None, :], R, B)[0])
    cmax = float(c.max())
    c_int = np.rint(c * (cost_scale / cmax)).astype(np.int64) if cmax > 0 else np.zeros(len(c), np.int64)
    deadline = time.perf_counter() + time_limit_seconds
    moves = 0
    while True:
        loads = np.bincount(out, weights=c, minlength=R)
        m = int(np.argmax(loads))
        if loads[m] <= lb * (1 + 1e-12):
            break
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        light = [int(r) for r in np.argsort(loads, kind="stable") if r != m][: k - 1]
        subset = np.sort(np.array([m] + light))
        idx = np.flatnonzero(np.isin(out, subset))
        hint = np.searchsorted(subset, out[idx])
        sub, _ = _solve_neighbourhood(c_int[idx], hint, k, B, min(remaining, solve_time_limit_seconds),
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
