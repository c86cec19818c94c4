"""Batch composition (fsdata.compose), the proven lower bound (fsdata.bubble) and their reporting."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdata.balancer import bubble
from fsdata.cli import main
from fsdata.balancer.compose import SHIPPED_WINDOWS, compose_steps
from fsdata.errors import ConfigError
from fsdata.balancer.partition import per_rank_loads
from fsdata.balancer.partitioners import AutoPartitioner, partition_steps
from fsdata.balancer.plan import high_bubble_warning, make_plan, shuffled_steps
from tests.fsdata.helpers import write_samples


def _heavy_costs(n, seed, tail=1.2):
    rng = np.random.default_rng(seed)
    L = np.minimum(1 + rng.pareto(tail, n) * 4, 512).astype(np.int64)
    return (L * L + 64 * L).astype(np.float64)


@st.composite
def _cases(draw):
    R = draw(st.integers(1, 6))
    B = draw(st.integers(1, 5))
    S = draw(st.integers(1, 9))
    extra = draw(st.integers(0, R * B - 1))
    W = draw(st.sampled_from([1, 2, 3, 4, 16, 1000]))
    kind = draw(st.sampled_from(["heavy", "ties", "zeros"]))
    seed = draw(st.integers(0, 2**16))
    n = S * R * B + extra
    if kind == "heavy":
        c = _heavy_costs(n, seed)
    elif kind == "ties":
        c = np.random.default_rng(seed).integers(1, 4, n).astype(np.float64)
    else:
        c = np.zeros(n)
    return R, B, W, seed, c


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_compose_keeps_contract_and_window(case):
    R, B, W, seed, c = case
    steps, rest = shuffled_steps(len(c), R, B, seed)
    out = compose_steps(steps, c, num_ranks=R, batch_size_per_rank=B, compose_window=W, seed=seed)
    assert out.shape == steps.shape
    Wn = min(W, len(steps))
    for w0 in range(0, len(steps), Wn):
        # departure bound: a window holds exactly the rows it held before (each once)
        np.testing.assert_array_equal(np.sort(out[w0:w0 + Wn].ravel()), np.sort(steps[w0:w0 + Wn].ravel()))
    assert len(np.unique(out)) == out.size
    # the full plan: exactly B per rank per step, nothing lost or duplicated, remainder unchanged
    p = make_plan(c, num_ranks=R, batch_size_per_rank=B, seed=seed, compose_window=W, partitioner="lpt-swap")
    assert (p.counts == B).all()
    kept = np.flatnonzero(p.step >= 0)
    assert len(kept) + len(p.dropped) == len(c)
    np.testing.assert_array_equal(np.sort(p.dropped), np.sort(rest))
    # the proven bound of the composed steps is below what was achieved
    assert p.lower_bound_bubble <= p.predicted_bubble + 1e-9


def test_compose_deterministic_and_w1_is_todays_plan():
    c = _heavy_costs(64 * 8 * 12 + 5, 1)
    steps, _ = shuffled_steps(len(c), 64, 8, 3)
    a = compose_steps(steps, c, num_ranks=64, batch_size_per_rank=8, compose_window=4, seed=3)
    b = compose_steps(steps, c, num_ranks=64, batch_size_per_rank=8, compose_window=4, seed=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, steps)
    np.testing.assert_array_equal(compose_steps(steps, c, num_ranks=64, batch_size_per_rank=8, compose_window=1),
                                  steps)
    # W=1: the plan is today's: shuffled global batches, lpt-swap per step
    p = make_plan(c, num_ranks=64, batch_size_per_rank=8, seed=3, compose_window=1, partitioner="lpt-swap")
    ranks = partition_steps(c[steps], 64, 8, method="lpt-swap")
    np.testing.assert_array_equal(p.step[steps.ravel()], np.repeat(np.arange(len(steps)), 64 * 8))
    np.testing.assert_array_equal(p.rank[steps.ravel()], ranks.ravel())
    assert p.compose_window == 1 and p.compose_info["algorithm"] == "none"
    p2 = make_plan(c, num_ranks=64, batch_size_per_rank=8, seed=3, compose_window=4, partitioner="lpt-swap")
    p3 = make_plan(c, num_ranks=64, batch_size_per_rank=8, seed=3, compose_window=4, partitioner="lpt-swap")
    np.testing.assert_array_equal(p2.step, p3.step)
    np.testing.assert_array_equal(p2.rank, p3.rank)


def test_compose_lowers_the_bound_on_heavy_tails():
    """Per-event-like heavy tail at small B: composition lowers the proven bound and the result."""
    c = _heavy_costs(32 * 8 * 64, 7)
    R, B = 32, 8
    base = make_plan(c, num_ranks=R, batch_size_per_rank=B, compose_window=1, partitioner="lpt-swap")
    comp = make_plan(c, num_ranks=R, batch_size_per_rank=B, compose_window=64, partitioner="lpt-swap")
    assert base.lower_bound_bubble > 0.3
    assert comp.lower_bound_bubble < 0.5 * base.lower_bound_bubble
    assert comp.predicted_bubble < 0.5 * base.predicted_bubble
    assert comp.compose_info["uncomposed_lower_bound_bubble"] == pytest.approx(base.lower_bound_bubble)
    assert comp.baseline_bubble == pytest.approx(base.baseline_bubble)  # today's bubble: uncomposed batches
    with pytest.raises(ConfigError, match="^compose_window must be an integer"):
        make_plan(c, num_ranks=R, batch_size_per_rank=B, compose_window=0)


def _brute_force_optimum(c, R, B):
    """Smallest max load over all assignments with exactly B samples per rank."""
    best = np.inf

    def rec(rest, loads):
        nonlocal best
        if not rest:
            best = min(best, max(loads))
            return
        first, others = rest[0], rest[1:]
        # the rank of the first remaining sample takes B-1 others: all combinations
        for combo in itertools.combinations(range(len(others)), B - 1):
            load = c[first] + sum(c[others[i]] for i in combo)
            if max(loads + [load]) >= best:
                continue
            rec([o for i, o in enumerate(others) if i not in combo], loads + [load])

    rec(list(range(len(c))), [])
    return best


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**16), st.sampled_from(["heavy", "ties", "uniform"]))
def test_proven_bound_never_above_optimum(R, B, seed, kind):
    rng = np.random.default_rng(seed)
    n = R * B
    c = {"heavy": _heavy_costs(n, seed), "ties": rng.integers(0, 3, n).astype(float),
         "uniform": rng.random(n)}[kind]
    opt = _brute_force_optimum(c, R, B)
    lb = bubble.step_proven_bound(c[None, :], R, B)[0]
    simple = bubble.step_lower_bound(c[None, :], R, B)[0]
    assert simple <= lb + 1e-9
    assert lb <= opt * (1 + 1e-12) + 1e-12
    # the run-bubble bound is below the optimum's bubble too
    assert bubble.bound_bubble(c[None, :], np.array([lb]), R) <= (1 - c.sum() / R / opt if opt > 0 else 0) + 1e-12


def test_proven_bound_strictly_above_the_old_formula():
    # R=64-like step at B=4: 65 giants among 256 samples: some rank holds two of them
    R, B = 64, 4
    c = np.ones(R * B)
    c[: R + 1] = 100.0
    lb = bubble.step_proven_bound(c[None, :], R, B)[0]
    simple = bubble.step_lower_bound(c[None, :], R, B)[0]
    assert simple == pytest.approx(max(c.sum() / R, 100 + 3))
    assert lb == pytest.approx(202.0)
    proven = bubble.lower_bound_bubble(c[None, :], R, B)
    assert proven > bubble.lower_bound_bubble(c[None, :], R, B, kind="simple") + 0.4
    # and it is tight here: lpt-swap reaches it
    ranks = partition_steps(c[None, :], R, B)
    assert per_rank_loads(c[None, :], ranks, R).max() == pytest.approx(lb)


def test_auto_cpsat_only_where_the_gap_is_worth_it_and_never_worse():
    c = _heavy_costs(8 * 4 * 40, 11, tail=1.0)
    sc = c[: 8 * 4 * 40].reshape(40, 32)
    fast = per_rank_loads(sc, partition_steps(sc, 8, 4), 8).max(axis=1)
    auto = AutoPartitioner(cpsat_max_steps=4)
    ranks, info = auto.partition(sc, 8, 4), auto.info
    assert (per_rank_loads(sc, ranks, 8).max(axis=1) <= fast * (1 + 1e-12)).all()
    assert info["cpsat_steps"] == min(4, info["steps_above_threshold"])
    # a threshold nothing reaches: no CP-SAT at all
    auto = AutoPartitioner(gap_threshold=1.0)
    auto.partition(sc, 8, 4)
    info = auto.info
    assert info["cpsat_steps"] == 0 and info["method"] == "lpt-swap"


def test_auto_cpsat_steps_on_threads_give_the_one_thread_result():
    """The refined steps run on a thread pool (CP-SAT's limit is deterministic time): any thread
    count gives the same assignment, so outputs stay byte-identical."""
    from fsdata.balancer.partitioners import PartitionerConfig

    sc = np.floor(np.random.default_rng(5).pareto(2.0, size=(60, 32)) * 100 + 1) ** 2  # R=4, B=8
    runs = []
    for threads in (1, 3):
        auto = AutoPartitioner(PartitionerConfig(num_threads=threads), cpsat_max_steps=6, gap_threshold=0.0)
        runs.append((auto.partition(sc, 4, 8), auto.info))
    assert runs[0][1]["cpsat_steps"] == 6 and runs[0][1]["cpsat_improved_steps"] >= 1 and runs[0][1] == runs[1][1]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])


def test_high_bubble_warning():
    assert high_bubble_warning({"predicted_bubble": 0.05}) is None
    w = high_bubble_warning({"predicted_bubble": 0.4, "lower_bound_bubble": 0.39, "batch_policy": "fixed",
                             "settings": {"compose_window": 4}})
    assert "40.0%" in w and "--compose-window" in w and "cost-budget" in w and "proven bound" in w
    assert high_bubble_warning({"predicted_bubble": 0.4, "strategy": "shuffle"}) is None


def test_cli_compose_flag_manifest_and_profile(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=2000)
    out = tmp_path / "out"
    assert main(["balance", str(inp), str(out), "--ranks", "4", "--batch-size-per-rank", "4", "--no-progress",
                 "--cost-model", "quadratic", "--compose-window", "16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compose_window"] == 16
    mpath = out / "_manifest.json" if (out / "_manifest.json").exists() else out / "manifest.json"
    m = json.loads(mpath.read_text())
    assert m["lower_bound_kind"] == "pigeonhole"
    assert m["lower_bound_bubble"] >= m["lower_bound_bubble_simple"]
    assert m["settings"]["compose_window"] == 16 and m["settings"]["compose"]["algorithm"] == "stratified-heavy"
    assert m["per_rank_count"] == {"min": 4, "median": 4.0, "max": 4, "mean": 4.0}
    assert main(["balance", str(inp), str(tmp_path / "bad"), "--ranks", "4", "--batch-size-per-rank", "4",
                 "--compose-window", "0"]) == 2
    assert "--compose-window" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert main(["profile", str(inp), "--ranks", "4", "--batch-size-per-rank", "4", "--cost-model", "quadratic",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    names = [o["option"] for o in r["options"]]
    assert names[0] == "per-step balancing" and "cost-budget" in names
    assert any(n.startswith("compose W=") for n in names)
    cb = next(o for o in r["options"] if o["option"] == "cost-budget")
    assert cb["budget"] > 0 and cb["per_rank_count"]["min"] >= 1
    assert set(SHIPPED_WINDOWS) >= {1, 4, 16, 64}


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 3), st.integers(1, 3), st.integers(0, 2**16))
def test_cpsat_exact_bound_between_pigeonhole_and_optimum(R, B, seed):
    from fsdata.balancer.cpsat import cpsat_step_bound

    c = _heavy_costs(R * B, seed) + np.random.default_rng(seed).random(R * B)
    opt = _brute_force_optimum(c, R, B)
    b, optimal = cpsat_step_bound(c, R, B, time_limit_seconds=2.0)
    assert bubble.step_proven_bound(c[None, :], R, B)[0] <= b <= opt * (1 + 1e-12)
    if optimal:  # floor-scaled costs: within the rounding of the scale
        assert b >= opt * (1 - 1e-5)


def test_one_sort_for_both_bounds_and_a_given_input_bound_change_nothing():
    """``step_bounds`` gives each bound's own values (simple: the formula on ``np.sort``), across
    its chunk boundary; composing with the caller's bound of the input steps gives the same steps."""
    R, B = 16, 4
    c = _heavy_costs(R * B * 300, 5)
    sc = c.reshape(300, R * B).copy()
    sc[3] = 1.0
    sc[3, : R + 1] = 100.0  # R + 1 giants: some rank holds two, so the proven bound is the higher one
    proven, simple = bubble.step_bounds(sc, R, B)
    asc = np.sort(sc, axis=1)
    np.testing.assert_array_equal(simple, np.maximum(asc.sum(axis=1) / R, asc[:, -1] + asc[:, : B - 1].sum(axis=1)))
    np.testing.assert_array_equal(simple, bubble.step_lower_bound(sc, R, B))
    np.testing.assert_array_equal(proven, bubble.step_proven_bound(sc, R, B))
    for a, b in ((0, 1), (17, 170)):  # rows bounded alone give the same values as inside the whole
        np.testing.assert_array_equal(bubble.step_bounds(sc[a:b], R, B)[0], proven[a:b])
    assert (proven >= simple).all() and proven[3] == 202.0 > simple[3]
    big = np.random.default_rng(0).random((70_000, 64))  # more than one ~4M-sample chunk
    p_big, s_big = bubble.step_bounds(big, 16, 4)
    np.testing.assert_array_equal(s_big, bubble.step_lower_bound(big, 16, 4))
    np.testing.assert_array_equal(p_big[65_000:], bubble.step_bounds(big[65_000:], 16, 4)[0])
    steps, _ = shuffled_steps(len(c), R, B, 9)
    plain = compose_steps(steps, c, num_ranks=R, batch_size_per_rank=B, compose_window=16, seed=9)
    given_bound = compose_steps(steps, c, num_ranks=R, batch_size_per_rank=B, compose_window=16, seed=9,
                                input_bound=bubble.step_proven_bound(c[steps], R, B))
    np.testing.assert_array_equal(plain, given_bound)
    assert not np.array_equal(plain, steps)
