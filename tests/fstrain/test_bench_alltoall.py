"""``benchmarks.bench_alltoall``: memcpy rows beside shm and gloo, and the one-rank fixed cost."""

from __future__ import annotations

import pytest


@pytest.mark.multiproc
def test_rows_carry_memcpy_next_to_shm_and_gloo():
    from benchmarks.bench_alltoall import _cpu_worker, _spawn

    rows = _spawn(_cpu_worker, 2, [4 << 10], True, {"spin_us": 10}, 1)
    shm = next(r for r in rows if r["backend"] == "shm")
    # Where shm reads peers in one copy, the rings alone ("shm-copy") are timed in the same run.
    rings = ["shm-copy"] if shm["data_path"] == "cma" else []
    assert sorted(r["backend"] for r in rows) == sorted(["gloo", "memcpy", "shm", *rings])
    assert all(r["data_path"] == "copy" for r in rows if r["backend"] == "shm-copy")
    off = _spawn(_cpu_worker, 2, [4 << 10], True, {"cma": False}, 1)
    assert sorted(r["backend"] for r in off) == ["gloo", "memcpy", "shm"]
    reason = next(r for r in off if r["backend"] == "shm")["cma_reason"]
    assert reason == "rank 0: disabled (ShmBackend.Config.cma=False)"
    assert all(r["bytes_per_rank"] == 4 << 10 and r["latency_us"] > 0 for r in rows)
    assert all(r["calls_per_sample"] == 1 for r in rows)
    one = _spawn(_cpu_worker, 1, [4 << 10], True, {}, 1)
    assert [r["backend"] for r in one] == ["shm-1rank"]


@pytest.mark.multiproc
def test_calls_per_sample_times_back_to_back_calls():
    """``--calls-per-sample K``: each timed sample runs the function K times after one barrier and
    reports the time per call."""
    from benchmarks import bench_alltoall

    rows = bench_alltoall._spawn(bench_alltoall._cpu_worker, 2, [1 << 10], True, {}, 4)
    assert {r["calls_per_sample"] for r in rows} == {4}
    with pytest.raises(SystemExit):
        bench_alltoall.main(["--calls-per-sample", "0"])


@pytest.mark.multiproc
def test_steady_rows_time_small_messages_back_to_back(tmp_path, capsys):
    """``--steady K``: every size, K calls per barrier up to 64 KB and fewer above (K x 64 KB / size, at
    least min(K, 32)), shm and gloo with 2 ranks and shm with one rank, printed side by side and written to
    the JSON; with 2 ranks, the paired one-rank null control and the two-core exchange floor of messages up
    to 64 KB per rank."""
    import json

    from benchmarks import bench_alltoall

    assert bench_alltoall.main(["--quick", "--ranks", "2", "--fixed-cost", "--steady", "20",
                                "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_alltoall.json").read_text())
    steady = [r for r in payload["cpu"] if r["backend"].endswith("-steady")]
    floor = [r for r in payload["cpu"] if r["backend"] == "cross-core-floor"]  # 2 ranks, up to 64 KB per rank
    assert sorted(r["bytes_per_rank"] for r in floor) == [1 << 10, 64 << 10] and all(r["latency_us"] > 0 for r in floor)
    # The null control: both ranks' one-rank calls at once, paired call by call (the slower counts), so the
    # mean of the pairs' maxima is at least the slower rank's mean; alternated with two-rank calls.
    paired = [r for r in payload["cpu"] if r["backend"] == "shm-1rank-paired"]
    assert sorted(r["bytes_per_rank"] for r in paired) == [1 << 10, 64 << 10]
    assert all(0 < r["slowest_total_us"] <= r["latency_us"] * (1 + 1e-9) and r["shm_alternated_us"] > 0
               and r["calls_per_sample"] == 20 for r in paired)
    sizes = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]  # --quick
    assert sorted((r["backend"], r["bytes_per_rank"]) for r in steady) == sorted(
        (b, n) for b in ("shm-steady", "gloo-steady", "shm-1rank-steady") for n in sizes)
    assert {(r["bytes_per_rank"], r["calls_per_sample"]) for r in steady} == {(n, 20) for n in sizes}
    assert bench_alltoall.steady_calls(1 << 20, 2000) == 125 and bench_alltoall.steady_calls(64 << 20, 2000) == 32
    assert all(r["latency_us"] > 0 for r in steady) and payload["steady_calls"] == 20
    out = capsys.readouterr().out
    table = out.split("steady state: 20 calls back to back")[1].splitlines()
    assert "alt shm/(paired+floor)" in table[2]
    assert [line.split()[:4] for line in table[3:5]] == [["2", "1", "KB", "20"], ["2", "64", "KB", "20"]]
    with pytest.raises(SystemExit):
        bench_alltoall.main(["--steady", "-1"])


def test_cross_core_exchange_floor_moves_the_bytes_between_two_pinned_threads():
    """``benchmarks.cross_core``: two threads on two CPUs exchange through rings (bytes checked inside)."""
    import os

    from benchmarks import cross_core

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    assert cross_core.exchange_floor_us(4096, iters=50) > 0
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        cross_core.exchange_floor_us(0)
    with pytest.raises(ValueError, match="needs two CPUs"):
        _one_cpu(cross_core)


def _one_cpu(cross_core):
    import os

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        cross_core.exchange_floor_us(64)
    finally:
        os.sched_setaffinity(0, allowed)


def test_bench_cma_times_both_copies_in_two_processes(tmp_path):
    """``benchmarks.bench_cma``: a local memcpy and a process_vm_readv of the same bytes, per size."""
    import json

    from benchmarks import bench_cma

    assert bench_cma.main(["--sizes-mb", "1", "--rounds", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_cma.json").read_text())["rows"]
    assert [r["bytes"] for r in rows] == [1 << 20]
    assert rows[0]["memcpy_ms"] > 0 and rows[0]["process_vm_readv_ms"] > 0 and rows[0]["memcpy_alone_ms"] > 0
    assert rows[0]["concurrent_over_alone"] == pytest.approx(rows[0]["memcpy_ms"] / rows[0]["memcpy_alone_ms"])
    with pytest.raises(SystemExit):
        bench_cma.main(["--rounds", "0"])


@pytest.mark.multiproc
def test_breakdown_splits_each_call_into_its_parts():
    """``--breakdown``: per rank and size, the call's median and its parts (copies, the compiled
    small-message step, the Python loop's doorbells, sleeping, Python outside and inside the exchange loop);
    one rank rings nobody and never sleeps."""
    from benchmarks.bench_alltoall import _spawn
    from benchmarks.shm_breakdown import PARTS, breakdown_worker, format_breakdown

    # 8 calls per barrier: the medians are calls in step, not the first after a barrier, whose wait for the
    # later rank (100-300 us) is spent spinning inside the compiled step.
    rows = _spawn(breakdown_worker, 2, [4 << 10, 4 << 20], True, {}, 8)
    assert sorted((r["bytes_per_rank"], r["rank"]) for r in rows) == [(4 << 10, 0), (4 << 10, 1),
                                                                      (4 << 20, 0), (4 << 20, 1)]
    for r in rows:
        m = r["median_us"]
        assert set(m) == {"call", *PARTS} and r["calls"] >= 2 * 5
        assert m["doorbell"] == 0 and m["outside"] > 0 and m["call"] > m["outside"]  # compiled: rings inside
        assert m["rest"] > -1.0  # the exchange less its timed parts (clock granularity aside)
        assert m["compiled"] > 0 and m["copies"] == 0  # one ring chunk or a pull per message: compiled
    big = [r["median_us"]["compiled"] for r in rows if r["bytes_per_rank"] == 4 << 20]
    small = [r["median_us"]["compiled"] for r in rows if r["bytes_per_rank"] == 4 << 10]
    assert min(big) > max(small)  # 1024x the bytes
    one = _spawn(breakdown_worker, 1, [4 << 10], True, {}, 1)
    assert [(r["median_us"]["doorbell"], r["median_us"]["sleep"]) for r in one] == [(0.0, 0.0)]
    table = format_breakdown(rows + one).splitlines()
    assert len(table) == 1 + 5 and table[1].split()[:4] == ["1", "4", "KB", "0"]
