"""benchmarks.bench_offline_stage (``bench_engines --engines copy,local``): rounds, load marks, ratio of record."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import bench_engines
from benchmarks.bench_offline_stage import ratio_of_record, settle, warm_page_cache
from tests.fsdata.helpers import write_samples


def _round(ratio: float, loaded: bool) -> dict:
    return {"ratio": ratio, "loaded": loaded}


def test_ratio_of_record_leaves_out_loaded_rounds():
    rounds = [_round(1.2, True), _round(1.6, False), _round(1.4, False), _round(1.5, False), _round(0.9, True)]
    assert ratio_of_record(rounds, 3) == 1.5  # median of 1.6, 1.4, 1.5; the loaded 1.2 and 0.9 not used
    assert ratio_of_record(rounds, 4) is None  # three quiet rounds only
    assert ratio_of_record([_round(1.1, True)] * 5, 1) is None


def test_settle_gives_up_after_its_timeout_and_reports_the_load():
    r = settle(max_load=-1.0, timeout_s=0.05, poll_s=0.01)  # never quiet enough: waits the timeout
    assert r["settle_seconds"] >= 0.05 and r["load_average_1m"] == pytest.approx(os.getloadavg()[0], abs=1.0)
    assert settle(max_load=1e9, timeout_s=60)["settle_seconds"] < 1.0


def test_warm_page_cache_reads_every_byte(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 3_000_000)
    (tmp_path / "d" / "b").write_bytes(b"y" * 10)
    assert warm_page_cache(tmp_path / "d")["bytes"] == 3_000_010


def test_quick_run_reports_rounds_cpu_and_load(tmp_path):
    # the benchmark reuses an input already at its path: a small valid one, no dataset needed
    (tmp_path / "work").mkdir()
    write_samples(tmp_path / "work" / "synth-2000-L64.parquet", n=2000, seed=1)
    rc = bench_engines.main(["--engines", "copy,local", "--quick", "--sizes", "2000", "--ranks", "4",
                             "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--keep-input",
                             "--max-load", "1e9", "--ray-cpus", "1"])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "bench_offline_stage.json").read_text())["results"][0]
    assert len(res["rounds"]) == 3 and res["quiet_rounds"] == 3
    assert res["page_cache_warm"]["bytes"] == res["input_bytes"]
    for r in res["rounds"]:
        assert r["loaded"] is False and r["load_average_1m"] >= 0
        for side in ("copy", "balance"):
            assert r[side]["cpu_seconds"] == pytest.approx(r[side]["cpu_user_seconds"] + r[side]["cpu_system_seconds"])
            assert r[side]["cpu_user_seconds"] > 0 and r[side]["wall_seconds"] > 0
        assert r["ratio"] == pytest.approx(r["balance"]["wall_seconds"] / r["copy"]["wall_seconds"])
        assert set(r["balance"]["stage_seconds"]) >= {"plan", "write_ranks"}
    assert res["ratio_of_record"] == pytest.approx(sorted(res["ratio_per_round"])[1])
    assert not list((tmp_path / "work").glob("out-local-*")) and not list((tmp_path / "work").glob("copy-*"))


def test_reshard_rounds_alternate_the_order_and_mark_loaded_rounds(tmp_path):
    """``--engines reshard``: the run order flips every round; a round is of record only when both of
    its runs started at most ``--max-load`` (a negative bound marks every round: no ratio of record)."""
    (tmp_path / "work").mkdir()
    write_samples(tmp_path / "work" / "synth-2000-L64.parquet", n=2000, seed=1)
    common = ["--engines", "reshard", "--sizes", "2000", "--ranks", "4", "--batch-size-per-rank", "8",
              "--work", str(tmp_path / "work"), "--keep-outputs", "--ray-cpus", "1", "--settle-seconds", "0"]
    assert bench_engines.main(common + ["--rounds", "2", "--min-quiet-rounds", "2", "--max-load", "1e9",
                                        "--out", str(tmp_path / "quiet")]) == 0
    res = json.loads((tmp_path / "quiet" / "bench_reshard.json").read_text())["results"][0]
    assert [r["order"] for r in res["rounds"]] == [["balance", "reshard"], ["reshard", "balance"]]
    ratios = [r["reshard"]["wall_seconds"] / r["balance"]["wall_seconds"] for r in res["rounds"]]
    assert res["quiet_rounds"] == 2 and res["ratio_of_record"] == pytest.approx(sum(ratios) / 2)
    assert bench_engines.main(common + ["--rounds", "1", "--min-quiet-rounds", "1", "--max-load", "-1",
                                        "--out", str(tmp_path / "loaded")]) == 0
    res = json.loads((tmp_path / "loaded" / "bench_reshard.json").read_text())["results"][0]
    assert res["rounds"][0]["loaded"] is True and res["quiet_rounds"] == 0 and res["ratio_of_record"] is None
