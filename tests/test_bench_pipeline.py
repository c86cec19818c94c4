"""benchmarks.bench_pipeline: CPU profile and idle-core estimate (pure functions on recorded clocks); `--ranks`."""

from __future__ import annotations

import pytest

from benchmarks.bench_pipeline import add_cpu, cpu_clocks, cpu_profile, format_table, idle_core_estimate


def test_cpu_clocks_advance_and_add_up():
    acc: dict[str, float] = {}
    before = cpu_clocks()
    sum(i * i for i in range(300_000))  # main-thread CPU
    add_cpu(acc, before, cpu_clocks())
    assert acc["wall"] > 0 and acc["main_thread_cpu"] > 0
    assert acc["process_cpu"] >= acc["main_thread_cpu"] - 1e-3  # the process includes its main thread
    if "machine_total" in acc:
        assert 0 <= acc["machine_busy"] <= acc["machine_total"]


def test_cpu_profile_per_step_and_cores_busy():
    ranks = [{"wall": 1.0, "process_cpu": 0.9, "main_thread_cpu": 0.6, "machine_busy": 1.8, "machine_total": 2.0},
             {"wall": 1.0, "process_cpu": 0.7, "main_thread_cpu": 0.5, "machine_busy": 1.7, "machine_total": 2.0}]
    p = cpu_profile(ranks, num_steps=10, num_cpus=2)
    assert p["wall_ms"] == pytest.approx(100.0) and p["process_cpu_ms"] == pytest.approx(80.0)
    assert p["main_thread_cpu_ms"] == pytest.approx(55.0) and p["other_threads_cpu_ms"] == pytest.approx(25.0)
    assert p["cores_busy"] == pytest.approx(1.6) and p["machine_busy_share"] == pytest.approx(0.9)
    assert cpu_profile([{k: v for k, v in ranks[0].items() if not k.startswith("machine")}], 10, 2)[
        "machine_busy_share"] is None


def _s(step, compute):
    return {"step_ms": step, "compute_ms": compute}


def test_idle_core_estimate_removes_the_compute_the_prefetch_thread_took():
    summary = {"plain": _s(66.0, 45.0), "sparse-dist": _s(64.0, 44.0),
               "prioritized-no-overlap": _s(70.0, 43.0), "prioritized": _s(72.0, 50.0)}
    est = idle_core_estimate(summary)
    assert est["compute_inflation_ms"] == pytest.approx(7.0) and est["step_ms"] == pytest.approx(65.0)
    assert est["step_over_better_stock"] == pytest.approx(65.0 / 64.0) and "floor_ms" not in est  # no CPU profile
    summary["prioritized"] = {**_s(72.0, 50.0), "straggler_wait_ms": 5.0,
                              "cpu": {"process_cpu_ms": 55.0, "main_thread_cpu_ms": 48.0}}
    est = idle_core_estimate(summary)
    assert est["floor_ms"] == pytest.approx(60.0) and est["idle_core_floor_ms"] == pytest.approx(53.0)
    assert est["floor_over_better_stock"] == pytest.approx(60.0 / 64.0)
    assert est["idle_core_floor_over_better_stock"] == pytest.approx(53.0 / 64.0)
    summary["prioritized"] = _s(72.0, 40.0)  # less compute than inline: nothing to remove
    assert idle_core_estimate(summary)["step_ms"] == pytest.approx(72.0)
    assert idle_core_estimate({"plain": _s(1, 1), "prioritized": _s(1, 1)}) is None
    table = format_table({"pipelines": {k: {**v, "straggler_wait_ms": 0, "exposed_comm_ms": 0,
                                           "exposed_comm_ms_median": 0, "exposed_share": 0, "rows_ahead_share": None}
                                        for k, v in summary.items()},
                          "idle_core_estimate": idle_core_estimate(summary)})
    assert "idle core for the prefetch thread (estimate)" in table and "floor on this machine" not in table


@pytest.mark.multiproc
def test_ranks_one_runs_every_schedule_with_no_peer(tmp_path):
    """``--ranks 1``: the schedules with no peer (their own CPU cost; nothing to hide); bad counts refused."""
    import json

    from benchmarks.bench_pipeline import main

    with pytest.raises(SystemExit):
        main(["--ranks", "0"])
    assert main(["--quick", "--ranks", "1", "--steps", "2", "--pipelines", "plain,prioritized",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_pipeline.json").read_text())
    assert result["config"]["num_ranks"] == 1 and result["machine"]["load_average_1m_at_start"] >= 0
    assert all(result["pipelines"][n]["num_steps"] == 2 and result["pipelines"][n]["step_ms"] > 0
               for n in ("plain", "prioritized"))
