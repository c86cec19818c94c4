"""Cost-budget batch policy: invariants on random and real lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsdata.balancer.bubble import lower_bound_bubble, run_bubble
from fsdata.balancer.cost import load_cost_model
from fsdata.balancer.cost_budget import default_budget, plan_cost_budget, step_rank_loads
from fsdata.errors import ConfigError
from fsdata.samples.synth import read_lengths
from tests.conftest import dataset_path


def _check_invariants(c, step, rank, R, budget):
    assert step.dtype == np.int32 and rank.dtype == np.int32
    assert ((step < 0) == (rank < 0)).all()
    kept = step >= 0
    S = int(step.max()) + 1 if kept.any() else 0
    if S:
        assert set(np.unique(step[kept])) == set(range(S))  # steps numbered 0..S-1
    loads, counts = step_rank_loads(c, step, rank, R)
    assert (counts >= 1).all()  # every rank has a sample in every step
    over = loads > budget * (1 + 1e-12)
    assert (counts[over] == 1).all()  # only a lone oversize sample exceeds the budget
    # each sample placed once (or dropped): the per-step counts add up to the kept samples
    assert counts.sum() == kept.sum()
    return loads, counts


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 12), st.integers(1, 8), st.integers(0, 2**31 - 1), st.integers(1, 600),
       st.sampled_from([None, 0.5, 2.0]))
@example(R=1, B=1, seed=1, n_extra=23, budget_factor=None)  # last step [21, 15] undone, [96, 68] still waiting
def test_invariants_random(R, B, seed, n_extra, budget_factor):
    rng = np.random.default_rng(seed)
    c = np.rint(rng.lognormal(3, 1.2, size=R + n_extra)) + 1
    budget = None if budget_factor is None else budget_factor * default_budget(c, B)
    try:
        step, rank = plan_cost_budget(c, R, B, budget)
    except ConfigError as e:
        assert "cannot fill one step" in str(e)
        return
    b = default_budget(c, B) if budget is None else budget
    _check_invariants(c, step, rank, R, b)
    dropped = step < 0
    if dropped.any():
        # only a tail is dropped: the undone last step (each rank at most the budget, or one oversize
        # sample) plus the samples skipped in it, fewer than the look-ahead (R * max(B, 64)); every
        # sample skipped in earlier steps was a candidate of the last one
        assert c[dropped].sum() <= R * max(b, c.max()) + (R * max(B, 64) - 1) * c.max()
        assert dropped.sum() < R * max(B, 64) + (np.sort(c).cumsum() <= R * max(b, c.max())).sum() + R


def test_steps_stay_mixed_not_sorted():
    rng = np.random.default_rng(0)
    c = rng.lognormal(3, 1, size=20_000)
    step, rank = plan_cost_budget(c, 8, 16)
    kept = step >= 0
    # the order of placement follows the shuffled order closely: step grows with position
    assert np.corrcoef(np.flatnonzero(kept), step[kept])[0, 1] > 0.99
    # heavy and light samples appear in every step (no step of only-long samples)
    per_step_mean = np.bincount(step[kept], weights=c[kept]) / np.bincount(step[kept])
    assert per_step_mean.max() < 3 * c.mean()


def test_movielens_per_user_reaches_5_percent():
    lengths = read_lengths(dataset_path("ml-1m_ensfm/sequences.txt"), layout="user")
    c = load_cost_model("hstu").cost(np.random.default_rng(0).permutation(lengths))
    R, B = 16, 16
    step, rank = plan_cost_budget(c, R, B)
    loads, counts = _check_invariants(c, step, rank, R, default_budget(c, B))
    S = len(c) // (R * B)
    fixed_lb = lower_bound_bubble(c[: S * R * B].reshape(S, R * B), R, B)
    assert run_bubble(loads) <= 0.05 < fixed_lb
    assert (step < 0).sum() < R * counts.mean() * 2  # only a tail remainder is dropped


def test_too_little_data_for_one_step_is_an_error():
    c = np.array([100.0] + [1.0] * 50)  # budget = 100: one step of 4 ranks needs ~400
    with pytest.raises(ConfigError, match="cannot fill one step"):
        plan_cost_budget(c, 4, 2)
    step, rank = plan_cost_budget(c, 1, 2)
    assert (step >= 0).all() and step.max() == 1  # the 100 alone, then the fifty 1s (half full: kept)


def test_errors():
    with pytest.raises(ConfigError, match="at least 4 samples"):
        plan_cost_budget(np.ones(3), 4, 2)
    with pytest.raises(ConfigError, match="budget"):
        plan_cost_budget(np.ones(10), 2, 2, budget=0.0)
    with pytest.raises(ConfigError, match="non-negative"):
        plan_cost_budget(np.array([1.0, -1.0, 2.0]), 2, 2)
