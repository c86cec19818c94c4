"""Per-step partitioners: invariants, fast kernel vs the pure-Python reference, baselines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdata.balancer.bubble import lower_bound_bubble, run_bubble, step_lower_bound
from fsdata.errors import ConfigError
from fsdata.balancer.kk import kk_equal_size
from fsdata.balancer.partition import lpt_reference, per_rank_loads
from fsdata.balancer.partitioners import names, partition_steps, partition_steps_chunked
from fsdata.balancer.partition_fast import lpt_swap_steps, snake_steps

FAST_METHODS = [m for m in names() if m not in ("lpt-swap-cpsat", "auto")]  # the ones without CP-SAT


def _assert_valid(ranks: np.ndarray, R: int, B: int) -> None:
    assert ranks.dtype == np.int32
    for row in np.atleast_2d(ranks):
        assert row.min() >= 0 and row.max() < R
        assert (np.bincount(row, minlength=R) == B).all()


def _quadratic(lengths):
    L = np.asarray(lengths, dtype=np.float64)
    return L * L + 64 * L


@st.composite
def step_instances(draw):
    R = draw(st.integers(1, 12))
    B = draw(st.integers(1, 8))
    S = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["float", "int", "ties", "one-huge"]))
    n = S * R * B
    if kind == "float":
        c = draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n, max_size=n))
    elif kind == "int":
        c = _quadratic(draw(st.lists(st.integers(1, 600), min_size=n, max_size=n)))
    elif kind == "ties":
        c = [float(draw(st.integers(0, 3)))] * n
        c = [x + draw(st.sampled_from([0.0, 1.0, 1e-9])) for x in c]
    else:
        c = [1.0] * n
        c[draw(st.integers(0, n - 1))] = 1e9
    return np.asarray(c, dtype=np.float64).reshape(S, R * B), R, B


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_instances())
def test_lpt_swap_never_worse_than_reference_and_valid(inst):
    c, R, B = inst
    fast = lpt_swap_steps(c, R, B)
    _assert_valid(fast, R, B)
    ref = np.stack([lpt_reference(row, R, B) for row in c])
    fast_max = per_rank_loads(c, fast, R).max(axis=1)
    ref_max = per_rank_loads(c, ref, R).max(axis=1)
    eps = 1e-9 * np.maximum(1.0, c.sum(axis=1))
    assert (fast_max <= ref_max + eps).all()
    assert (fast_max >= step_lower_bound(c, R, B) - eps).all()


@settings(max_examples=100, deadline=None)
@given(step_instances())
def test_fast_lpt_without_swaps_reproduces_reference_loads(inst):
    c, R, B = inst
    fast = lpt_swap_steps(c, R, B, max_swap_iters=0)
    ref = np.stack([lpt_reference(row, R, B) for row in c])
    # equal-cost samples may land on other ranks, so sums differ only in float summation order
    np.testing.assert_allclose(np.sort(per_rank_loads(c, fast, R), axis=1),
                               np.sort(per_rank_loads(c, ref, R), axis=1), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("R,B", [(1, 7), (9, 1), (16, 8), (256, 4)])
def test_reaches_lower_bound_where_it_is_achievable(R, B):
    rng = np.random.default_rng(R * 100 + B)
    # B distinct values, each R times: giving every rank one of each value reaches sum / R.
    values = rng.lognormal(5, 1.5, size=B)
    c = rng.permutation(np.repeat(values, R))[None, :]
    loads = per_rank_loads(c, lpt_swap_steps(c, R, B), R)
    np.testing.assert_allclose(loads.max(), step_lower_bound(c, R, B)[0], rtol=1e-12)


def test_swap_pass_fixes_lpt_straggler():
    c = np.array([[8.0, 7.0, 6.0, 5.0, 4.0, 2.0]])  # R=2, B=3: LPT gives 8+5+4=17 vs 7+6+2=15
    ref = per_rank_loads(c, lpt_reference(c[0], 2, 3)[None], 2).max()
    fast = per_rank_loads(c, lpt_swap_steps(c, 2, 3, swap_tolerance=0), 2).max()
    assert ref == 17.0 and fast == 16.0


def test_real_shaped_lengths_within_0p01_points_of_lower_bound():
    rng = np.random.default_rng(0)
    R, B, S = 64, 32, 6
    lengths = np.minimum(np.rint(rng.lognormal(4.0, 1.0, size=(S, R * B))) + 1, 512)
    c = _quadratic(lengths)
    ranks = partition_steps(c, R, B)  # default method: lpt-swap
    gap = run_bubble(per_rank_loads(c, ranks, R)) - lower_bound_bubble(c, R, B)
    assert 0 <= gap < 1e-4
    shuffle_bubble = run_bubble(per_rank_loads(c, partition_steps(c, R, B, "shuffle"), R))
    assert shuffle_bubble > 0.1  # the baseline really is unbalanced on these lengths


@pytest.mark.parametrize("method", FAST_METHODS)
def test_every_method_gives_exactly_b_per_rank(method):
    rng = np.random.default_rng(3)
    R, B = 8, 5
    c = _quadratic(rng.integers(1, 400, size=(4, R * B)))
    _assert_valid(partition_steps(c, R, B, method), R, B)


def test_methods_rank_as_expected_on_heavy_tail():
    rng = np.random.default_rng(7)
    R, B = 16, 8
    c = _quadratic(np.rint(rng.lognormal(4.0, 1.0, size=(20, R * B))) + 1)
    b = {m: run_bubble(per_rank_loads(c, partition_steps(c, R, B, m), R)) for m in FAST_METHODS}
    assert b["lpt-swap"] <= b["lpt"] + 1e-12
    assert b["lpt"] < b["roundrobin"] < b["shuffle"]
    assert b["kk"] < b["shuffle"]


def test_kk_equal_size_counts_and_known_instance():
    rng = np.random.default_rng(11)
    for R, B in [(1, 5), (4, 1), (7, 6), (32, 16)]:
        c = rng.lognormal(3, 1, size=R * B)
        _assert_valid(kk_equal_size(c, R, B)[None], R, B)
    # Two chunks {1,2} and {3,4}, merged heaviest with lightest: {1,4} and {2,3}.
    out = kk_equal_size(np.array([1.0, 2.0, 3.0, 4.0]), 2, 2)
    assert out[0] == out[3] and out[1] == out[2] and out[0] != out[1]


def test_snake_order():
    c = np.array([[1.0, 6.0, 2.0, 5.0, 3.0, 4.0]])  # sorted desc: 6 5 4 3 2 1
    out = snake_steps(c, 2, 3)[0]
    # ranks along the sorted order: 0 1 1 0 0 1
    assert list(out[[1, 3, 5, 4, 2, 0]]) == [0, 1, 1, 0, 0, 1]


def test_chunked_equals_whole_and_threads_do_not_change_result():
    rng = np.random.default_rng(5)
    R, B = 8, 4
    c = _quadratic(rng.integers(1, 500, size=(23, R * B)))
    whole = partition_steps(c, R, B, num_threads=1)
    np.testing.assert_array_equal(partition_steps(c, R, B, steps_per_chunk=5), whole)
    chunks = list(partition_steps_chunked((c[i:i + 7] for i in range(0, 23, 7)), R, B))
    np.testing.assert_array_equal(np.concatenate(chunks), whole)


def test_kernel_stats_match_bubble_module():
    rng = np.random.default_rng(9)
    c = _quadratic(rng.integers(1, 300, size=(6, 48)))
    ranks, stats = lpt_swap_steps(c, 6, 8, return_stats=True)
    np.testing.assert_allclose(stats["lower_bound"], step_lower_bound(c, 6, 8), rtol=1e-12)
    assert stats["swaps"].shape == (6,) and (stats["swaps"] >= 0).all()


def test_empty_input_and_errors():
    assert partition_steps(np.empty((0, 8)), 2, 4).shape == (0, 8)
    with pytest.raises(ConfigError, match="unknown partition method"):
        partition_steps(np.ones((1, 8)), 2, 4, method="nope")
    with pytest.raises(ConfigError, match="expected"):
        partition_steps(np.ones((1, 7)), 2, 4)
    with pytest.raises(ConfigError, match="finite and >= 0"):
        partition_steps(np.array([[1.0, -2.0]]), 2, 1)
    with pytest.raises(ConfigError, match="num_threads"):
        lpt_swap_steps(np.ones((1, 8)), 2, 4, num_threads=0)


def test_movielens_per_event_r256_b32_within_0p01_points():
    from fsdata.samples.synth import read_lengths
    from tests.conftest import dataset_path

    lengths = read_lengths(dataset_path("ml-1m_ensfm/sequences.txt"), "event", max_seq_len=512)
    R, B, S = 256, 32, 8
    c = _quadratic(np.random.default_rng(0).permutation(lengths)[: S * R * B].reshape(S, R * B))
    ranks = partition_steps(c, R, B)
    _assert_valid(ranks, R, B)
    gap = run_bubble(per_rank_loads(c, ranks, R)) - lower_bound_bubble(c, R, B)
    assert 0 <= gap < 1e-4


def test_partitioner_object_matches_functions():
    from fsdata.balancer.partitioners import from_config as Partitioner, PartitionerConfig

    rng = np.random.default_rng(4)
    c = _quadratic(rng.integers(1, 300, size=(5, 32)))
    p = Partitioner(PartitionerConfig(method="lpt-swap", num_threads=1, steps_per_chunk=2))
    np.testing.assert_array_equal(p.partition(c, 4, 8), partition_steps(c, 4, 8))
    np.testing.assert_array_equal(np.concatenate(list(p.partition_chunks([c[:3], c[3:]], 4, 8))),
                                  partition_steps(c, 4, 8))
    with pytest.raises(ConfigError, match="unknown partition method"):
        Partitioner(PartitionerConfig(method="greedy"))
