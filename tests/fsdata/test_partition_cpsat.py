"""CP-SAT neighbourhood refinement: never worse than its hint, and reaches optima swaps miss."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fsdata.balancer.cpsat import cpsat_refine_step, cpsat_refine_steps
from fsdata.errors import ConfigError
from fsdata.balancer.partition import per_rank_loads
from fsdata.balancer.partitioners import partition_steps
from fsdata.balancer.partition_fast import lpt_swap_steps


def _max_load(c, ranks, R):
    return per_rank_loads(c[None, :], np.asarray(ranks)[None, :], R).max()


def _optimum(c, R, B):
    """Brute-force smallest max load with exactly B per rank (tiny instances only)."""
    best = np.inf
    n = len(c)
    for assign in itertools.product(range(R), repeat=n):
        if all(assign.count(r) == B for r in range(R)):
            best = min(best, np.bincount(assign, weights=c, minlength=R).max())
    return best


def test_never_worse_than_hint_on_random_steps():
    rng = np.random.default_rng(0)
    R, B = 6, 3
    for _ in range(15):
        c = rng.lognormal(4, 1.2, size=R * B)
        hint = rng.permutation(np.repeat(np.arange(R, dtype=np.int32), B))  # a poor start
        out, moves = cpsat_refine_step(c, hint, R, B, time_limit_seconds=2.0)
        assert (np.bincount(out, minlength=R) == B).all()
        assert _max_load(c, out, R) <= _max_load(c, hint, R)
        assert moves >= 0


def test_reaches_optimum_where_single_swaps_get_stuck():
    rng = np.random.default_rng(1)
    R, B = 2, 5
    stuck = 0
    for _ in range(40):
        c = np.rint(rng.lognormal(3, 1, size=R * B)) + 1
        start = lpt_swap_steps(c[None, :], R, B, swap_tolerance=0)[0]
        opt = _optimum(c, R, B)
        out, _ = cpsat_refine_step(c, start, R, B, time_limit_seconds=5.0, num_light_ranks=1)
        assert _max_load(c, out, R) == pytest.approx(opt, rel=1e-9)  # whole step in one neighbourhood
        stuck += _max_load(c, start, R) > opt * (1 + 1e-9)
    assert stuck > 0  # the instances include ones where lpt-swap alone is not optimal


def test_method_lpt_swap_cpsat_valid_and_not_worse():
    rng = np.random.default_rng(2)
    R, B = 8, 4
    c = np.rint(rng.lognormal(4, 1, size=(3, R * B))) ** 2
    base = partition_steps(c, R, B, "lpt-swap")
    ref = partition_steps(c, R, B, "lpt-swap-cpsat", time_limit_seconds=1.0)
    assert all((np.bincount(row, minlength=R) == B).all() for row in ref)
    assert (per_rank_loads(c, ref, R).max(axis=1) <= per_rank_loads(c, base, R).max(axis=1)).all()


def test_bad_settings():
    with pytest.raises(ConfigError, match="time_limit_seconds"):
        cpsat_refine_steps(np.ones((1, 4)), np.array([[0, 0, 1, 1]]), 2, 2, time_limit_seconds=0)
