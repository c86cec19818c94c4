"""benchmarks.quality_convergence: which runs share their global batches (and so their training)."""

from __future__ import annotations

import json

import pytest

from benchmarks.quality_convergence import _reuse, find_identical, global_batches_digest, load_reusable
from fsdata.cli import main as fsdata_main
from tests.fsdata.helpers import write_samples


def _balance(src, out, *flags):
    assert fsdata_main(["balance", str(src), str(out), "--no-progress", "--num-threads", "1", *flags]) == 0
    return out


def test_digest_sees_global_batches_not_ranks(tmp_path):
    src = write_samples(tmp_path / "s.parquet", n=600, seed=3)
    r4 = _balance(src, tmp_path / "r4", "--ranks", "4", "--batch-size-per-rank", "8", "--strategy", "shuffle",
                  "--seed", "5", "--epochs", "2")
    r1 = _balance(src, tmp_path / "r1", "--ranks", "1", "--batch-size-per-rank", "32", "--strategy", "shuffle",
                  "--seed", "5", "--epochs", "2")
    other_seed = _balance(src, tmp_path / "s6", "--ranks", "4", "--batch-size-per-rank", "8", "--strategy",
                          "shuffle", "--seed", "6", "--epochs", "2")
    balanced = _balance(src, tmp_path / "bal", "--ranks", "4", "--batch-size-per-rank", "8", "--seed", "5",
                        "--epochs", "2", "--compose-window", "1")
    d4, d1 = global_batches_digest(r4), global_batches_digest(r1)
    assert d4 == d1  # same shuffle, 4 ranks x 8 or 1 rank x 32: the same 32 samples per step
    assert global_batches_digest(other_seed) != d4
    # per-step balancing without composition moves samples between ranks, not between steps
    assert global_batches_digest(balanced) == d4


def test_reuse_needs_same_recipe_seed_epochs_and_batches(tmp_path):
    runs = [{"recipe": "ml-1m-sasrec", "seed": 1, "epochs": 100, "global_batches_sha256": "a" * 64,
             "ndcg@10": 0.15, "strategy": "shuffle", "ranks": 16, "batch_size_per_rank": 8},
            {"recipe": "ml-1m-sasrec", "seed": 2, "epochs": 100, "global_batches_sha256": "b" * 64,
             "ndcg@10": 0.16, "reused_from": "shuffle R=16 B=8 seed 2"}]
    path = tmp_path / "bench_quality_parity.json"
    path.write_text(json.dumps({"runs": runs}))
    pool = load_reusable([str(path)])
    assert len(pool) == 2  # a reused run is a source too (a committed table regenerates from itself)
    assert find_identical(pool, "ml-1m-sasrec", 1, 100, "a" * 64)["ndcg@10"] == 0.15
    twin = find_identical(pool, "ml-1m-sasrec", 2, 100, "b" * 64)
    assert _reuse({}, twin)["reused_from"] == "shuffle R=16 B=8 seed 2"  # the origin, not the table
    assert _reuse({}, pool[0])["reused_from"] == "shuffle R=16 B=8 seed 1 (bench_quality_parity.json)"
    # a trained run wins over one that reused figures for the same batches
    trained = runs[1] | {"reused_from": None, "ndcg@10": 0.17}
    path.write_text(json.dumps({"runs": runs + [trained]}))
    assert find_identical(load_reusable([str(path)]), "ml-1m-sasrec", 2, 100, "b" * 64)["ndcg@10"] == 0.17
    assert find_identical(pool, "ml-1m-sasrec", 1, 50, "a" * 64) is None
    assert find_identical(pool, "ml-1m-sasrec", 2, 100, "a" * 64) is None
    assert find_identical(pool, "sports-sasrec", 1, 100, "a" * 64) is None
    assert find_identical(pool, "ml-1m-sasrec", 1, 100, "c" * 64) is None


def test_a_missing_reuse_file_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"--reuse .*absent\.json: cannot read it"):
        load_reusable([str(tmp_path / "absent.json")])


def test_reshard_summary_compares_against_the_uninterrupted_seed_spread():
    from benchmarks.bench_quality_reshard import summarize

    runs = [{"uninterrupted": {"ndcg@10": u, "hr@10": u}, "resharded": {"ndcg@10": r, "hr@10": r + 0.01}}
            for u, r in ((0.030, 0.031), (0.034, 0.033), (0.032, 0.032))]
    s = summarize(runs)
    nd, hr = s["comparison"]["ndcg@10"], s["comparison"]["hr@10"]
    assert s["arms"]["uninterrupted"]["ndcg@10"]["min"] == 0.030 and s["arms"]["resharded"]["ndcg@10"]["max"] == 0.033
    assert nd["within_min_max"] and nd["within_one_std"] and abs(nd["mean_diff"]) < 1e-12
    assert [round(d, 4) for d in nd["per_seed_diff"]] == [0.001, -0.001, 0.0]
    assert not hr["within_min_max"] and not hr["within_one_std"]  # 0.01 above every uninterrupted run
