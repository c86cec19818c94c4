"""The seeded shuffle computable per row (fsdata.balancer.order) and planning by windows of steps
(fsdata.balancer.plan.PlanLayout / plan_one_window): what lets a distributed engine plan one
window at a time with the same result as one process (issue 12)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdata.balancer.order import SHUFFLE, shuffled_order, shuffled_positions
from fsdata.balancer.plan import (LEGACY_SHUFFLE, make_plan, plan_layout, plan_one_window, shuffled_steps)
from fsdata.errors import ConfigError


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**31))
def test_positions_are_a_permutation(n, seed):
    pos = shuffled_positions(np.arange(n), n, seed)
    assert pos.dtype == np.int64
    assert np.array_equal(np.sort(pos), np.arange(n))


def test_positions_of_any_subset_match_the_whole():
    n, seed = 100_003, 11
    whole = shuffled_positions(np.arange(n), n, seed)
    rows = np.random.default_rng(0).choice(n, 777, replace=False)
    assert np.array_equal(shuffled_positions(rows, n, seed), whole[rows])
    order = shuffled_order(n, seed)
    assert np.array_equal(order[whole], np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 65_536, 65_537])
@pytest.mark.parametrize("seed", [0, 3])
def test_order_by_the_inverse_network_inverts_the_positions(n, seed):
    """shuffled_order runs the Feistel network backwards (cycle-walked); it is the inverse of the
    forward positions at sizes whose domain 4^h is barely or far above n."""
    pos = shuffled_positions(np.arange(n), n, seed)
    order = shuffled_order(n, seed)
    assert order.dtype == np.int64 and len(order) == n
    assert np.array_equal(order[pos], np.arange(n))


def test_seed_changes_the_order_and_it_is_not_trivial():
    n = 10_000
    a, b = shuffled_order(n, 0), shuffled_order(n, 1)
    assert not np.array_equal(a, b)
    assert np.array_equal(a, shuffled_order(n, 0))
    # the first tenth of positions draws rows from every tenth of the input, about evenly
    hist = np.bincount(a[: n // 10] // (n // 10), minlength=10)
    assert hist.min() > 60 and hist.max() < 140, hist
    # and neighbours in the input do not stay neighbours
    pos = shuffled_positions(np.arange(n), n, 0)
    assert np.median(np.abs(np.diff(pos))) > n / 10


def test_rows_outside_the_input_are_refused():
    with pytest.raises(ValueError):
        shuffled_positions(np.array([5]), 5, 0)


def test_legacy_shuffle_still_reads_old_outputs():
    steps, rest = shuffled_steps(100, 2, 8, 3, shuffle=LEGACY_SHUFFLE)
    perm = np.random.default_rng(3).permutation(100)
    assert np.array_equal(steps.ravel(), perm[:96]) and np.array_equal(rest, perm[96:])
    steps, rest = shuffled_steps(100, 2, 8, 3)
    assert np.array_equal(np.concatenate([steps.ravel(), rest]), shuffled_order(100, 3))
    with pytest.raises(ConfigError):
        shuffled_steps(100, 2, 8, 3, shuffle="nope")
    assert SHUFFLE != LEGACY_SHUFFLE


def _costs(n, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(3.0, 1.2, n).astype(np.int64) + 1, 2000)
    return (lengths.astype(np.float64) ** 2 + 64 * lengths)


@pytest.mark.parametrize("compose_window", [1, 4])
@pytest.mark.parametrize("partitioner", ["lpt-swap", "kk"])
def test_the_plan_does_not_depend_on_the_plan_window(compose_window, partitioner):
    """K only groups the work: with a partitioner that has no run-wide budget, every K gives the
    same plan and the same figures, bit for bit."""
    costs = _costs(8 * 16 * 23 + 37, seed=3)
    plans = [make_plan(costs, num_ranks=8, batch_size_per_rank=16, seed=5, partitioner=partitioner,
                       compose_window=compose_window, plan_window=k) for k in (1, 4, 8, 1024)]
    ref = plans[0]
    assert ref.plan_window == compose_window  # K rounded up to a multiple of W
    for p in plans[1:]:
        for name in ("step", "rank", "position", "loads", "counts", "baseline_loads", "dropped"):
            assert np.array_equal(getattr(p, name), getattr(ref, name)), name
        assert p.lower_bound_bubble == ref.lower_bound_bubble
        assert p.lower_bound_bubble_simple == ref.lower_bound_bubble_simple
        assert p.predicted_bubble == ref.predicted_bubble
        if compose_window > 1:
            assert p.compose_info["uncomposed_lower_bound_bubble"] == ref.compose_info["uncomposed_lower_bound_bubble"]
            assert p.compose_info["windows_composed"] == ref.compose_info["windows_composed"] > 0


def test_a_window_plans_from_its_own_samples_only():
    """plan_one_window sees only its window's costs; samples never leave their window, every
    position is planned once, and the remainder sits in the last window."""
    R, B, n = 4, 8, 4 * 8 * 10 + 5
    costs = _costs(n, seed=1)
    layout = plan_layout(n, R, B, compose=True, compose_window=2, plan_window=3)
    assert (layout.compose_window, layout.plan_window, layout.num_windows, layout.num_steps) == (2, 4, 3, 10)
    order = shuffled_order(n, 9)
    seen = []
    for w in range(layout.num_windows):
        a, b = layout.window_positions(w)
        rows = order[a:b]
        wp = plan_one_window(costs[rows], rows, w, layout, seed=9, partitioner="lpt-swap")
        s0, s1 = layout.window_steps(w)
        kept = wp.step >= 0
        assert ((wp.step[kept] >= s0) & (wp.step[kept] < s1)).all()
        assert (wp.counts == B).all() and wp.loads.shape == (s1 - s0, R)
        assert int((~kept).sum()) == (5 if w == layout.num_windows - 1 else 0)
        seen.append(wp.rows)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(n))
    assert np.array_equal(layout.window_of(np.array([0, 4 * 32 - 1, 4 * 32, n - 1])), [0, 0, 1, 2])


def test_bad_plan_window_is_a_config_error():
    """Checked once, where the settings are made (a direct make_plan call makes them too)."""
    from fsdata.balancer.settings import BalanceSettings, PlanSettings

    for make in (PlanSettings, BalanceSettings):
        with pytest.raises(ConfigError, match="^plan_window must be an integer"):
            make(num_ranks=4, batch_size_per_rank=8, plan_window=0)
    with pytest.raises(ConfigError, match="^plan_window must be an integer"):
        make_plan(np.ones(1000), num_ranks=4, batch_size_per_rank=8, plan_window=0)


def test_what_the_plan_window_changes_under_auto():
    """docs/fsdata.md: under ``auto`` K changes only which steps CP-SAT refines (each window's
    share ``ceil(32 * S_w / S)`` and its own threshold); the global batches, the steps' samples and
    everything lpt-swap decides are the same for every K, and no step is worse than lpt-swap's."""
    from fsdata.balancer.partitioners import CPSAT_MAX_STEPS

    R, B = 4, 3
    costs = _costs(R * B * 120, seed=0)
    ref = make_plan(costs, num_ranks=R, batch_size_per_rank=B, seed=1, partitioner="lpt-swap", compose_window=1)
    S = ref.num_steps
    seen_cpsat = set()
    for k in (1, 7, 1024):
        p = make_plan(costs, num_ranks=R, batch_size_per_rank=B, seed=1, plan_window=k, compose_window=1)
        assert np.array_equal(p.step, ref.step) and np.array_equal(p.counts, ref.counts)  # same samples per step
        assert (p.loads.max(axis=1) <= ref.loads.max(axis=1) + 1e-9).all()  # never worse than lpt-swap
        changed = int((~np.isclose(p.loads.max(axis=1), ref.loads.max(axis=1))).sum())
        windows = -(-S // k)
        cap = sum(-(-CPSAT_MAX_STEPS * min(k, S - w * k) // S) for w in range(windows))
        info = p.partition_info
        assert changed <= info["cpsat_improved_steps"] <= info["cpsat_steps"] <= min(cap, S)
        assert p.plan_window == k
        seen_cpsat.add(info["cpsat_steps"])
    assert len(seen_cpsat) > 1  # K does change how many steps CP-SAT refines: recorded in the manifest


def test_threaded_kernels_equal_the_numpy_they_replace():
    """The plan's numba kernels on threads give numpy's values: rows sorted as ``np.sort(axis=1)``
    (with ties), and each sample's index in its (step, rank) batch and the batch counts as a
    stable sort by (step, rank) and a bincount."""
    from fsdata.balancer.bubble import sort_rows
    from fsdata.balancer.windows import _batch_positions

    rng = np.random.default_rng(0)
    c = rng.random((50, 512)) * 100
    c[:, :10] = 3.0
    assert np.array_equal(sort_rows(c), np.sort(c, axis=1))
    Sw, R, B = 40, 16, 8
    ranks = np.stack([rng.permutation(np.repeat(np.arange(R), B)) for _ in range(Sw)]).astype(np.int32)
    key = (np.arange(Sw, dtype=np.int64)[:, None] * R + ranks).ravel()
    order = np.argsort(key, kind="stable")
    want = np.empty(len(key), dtype=np.int64)
    for a in range(0, len(key), B):  # each (step, rank) batch holds B consecutive sorted entries
        want[order[a:a + B]] = np.arange(B)
    pos, counts = _batch_positions(ranks, R)
    assert np.array_equal(pos.ravel(), want)
    assert np.array_equal(counts, np.bincount(key, minlength=Sw * R).reshape(Sw, R))
