"""The shard reader: contents, variable counts, resume, and every way shards can be wrong."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from fsdata.shards import manifest as schema  # the shard format's file names
from fsdata.cli import main as fsdata_main
from fstrain.data import ShardReader, infer_num_items, load_manifest, load_step_counts
from fstrain.errors import ShardError, ShardMismatchError
from tests.conftest import dataset_path
from tests.fsdata.helpers import write_samples
from tests.fstrain.shards import write_shards


def _rows(path):
    return pq.read_table(path).to_pylist()


def test_batches_match_file_rows(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=3, num_steps=5, batch_size_per_rank=4)
    for rank in range(3):
        rows = _rows(load_manifest(out).rank_file(rank))
        batches = list(ShardReader(out, rank, 3))
        assert [b.step for b in batches] == list(range(5))
        got = [(int(sid), list(map(int, hist)), int(t)) for b in batches
               for sid, hist, t in zip(b.sample_ids, b.features["item_ids"].to_dense(), b.target_ids)]
        assert got == [(r["sample_id"], r["item_ids"], r["target_item_id"]) for r in rows]
        b = batches[2]
        assert b.num_samples == 4 and b.global_num_samples == 12
        assert b.features.keys() == ["item_ids", "target_item_id"]
        assert b.features["target_item_id"].values().tolist() == b.target_ids.tolist()
        assert b.features.stride() == 4


def test_variable_counts_cost_budget(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=4, num_steps=4, batch_size_per_rank=5, policy="cost-budget")
    counts = load_step_counts(load_manifest(out))
    assert (counts.sum(axis=1) == 20).all() and len(set(counts.ravel().tolist())) > 1
    for rank in range(4):
        for b in ShardReader(out, rank, 4):
            assert b.num_samples == counts[b.step, rank] == len(b.target_ids) == b.features.stride()
            assert b.global_num_samples == 20


def test_resume_from_step_skips_row_groups(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=9, batch_size_per_rank=3, steps_per_row_group=2)
    full = list(ShardReader(out, 1, 2))
    rd = ShardReader(out, 1, 2, start_step=5, max_steps=3)
    assert rd._row_groups == [2, 3]  # steps 4-5 and 6-7; row groups 0, 1 skipped by statistics
    part = list(rd)
    assert len(rd) == 3 and [b.step for b in part] == [5, 6, 7]
    assert [b.sample_ids.tolist() for b in part] == [b.sample_ids.tolist() for b in full[5:8]]
    assert list(ShardReader(out, 1, 2, start_step=9)) == []
    with pytest.raises(ShardMismatchError, match="cannot start at step 10"):
        ShardReader(out, 1, 2, start_step=10)


def test_world_size_and_version_mismatch(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=2, batch_size_per_rank=2)
    with pytest.raises(ShardMismatchError, match="written for 2 ranks but this job has world size 4"):
        ShardReader(out, 0, 4)
    mpath = os.path.join(out, schema.MANIFEST_NAME)
    m = json.load(open(mpath))
    m["format_version"] = 99
    json.dump(m, open(mpath, "w"))
    with pytest.raises(ShardMismatchError, match="format_version 99"):
        ShardReader(out, 0, 2)
    with pytest.raises(ShardError, match="not found"):
        ShardReader(str(tmp_path / "nowhere"), 0, 2)


def test_unequal_steps_rejected(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=2)
    mpath = os.path.join(out, schema.MANIFEST_NAME)
    m = json.load(open(mpath))
    m["num_steps"] = 4  # step_stats and files say 3
    json.dump(m, open(mpath, "w"))
    with pytest.raises(ShardError, match="rows"):
        ShardReader(out, 0, 2)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing"])
def test_truncated_or_corrupt_file(tmp_path, damage):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=2)
    path = load_manifest(out).rank_file(1)
    data = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "garbage":
        open(path, "wb").write(data[:4] + b"\x00" * (len(data) - 8) + data[-4:])
    else:
        os.remove(path)
    ShardReader(out, 0, 2)  # the healthy rank opens fine
    with pytest.raises(ShardError, match="rank 1"):
        list(ShardReader(out, 1, 2))


def test_step_count_disagreeing_with_step_stats(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=2)
    import pyarrow as pa

    st = pq.read_table(os.path.join(out, schema.STEP_STATS_NAME)).to_pydict()
    st["num_samples"][0] += 1  # step 0 rank 0 claims 3 rows ...
    st["num_samples"][2] -= 1  # ... step 1 rank 0 claims 1: same total, wrong split
    pq.write_table(pa.table(st), os.path.join(out, schema.STEP_STATS_NAME))
    with pytest.raises(ShardError, match="step 0 has 2 rows but step_stats says 3"):
        list(ShardReader(out, 0, 2, num_prefetch_batches=2))  # raised through the prefetch thread


def test_prefetch_thread_never_outlives_the_reader(tmp_path):
    """Stopping early (``break``, ``max_steps``) or an error joins the reader thread: a reader
    thread still inside Arrow at interpreter exit aborts the process."""
    import threading

    def readers():
        return [t for t in threading.enumerate() if t.name == "fstrain-shard-reader"]

    out = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=8, batch_size_per_rank=2)
    it = iter(ShardReader(out, 0, 1, num_prefetch_batches=2))
    assert next(it).step == 0 and len(readers()) == 1  # running, a queue's worth ahead
    it.close()  # what a `for` loop's break does
    assert readers() == []
    assert [b.step for b in ShardReader(out, 0, 1, max_steps=3, num_prefetch_batches=2)] == [0, 1, 2]
    assert readers() == []


@pytest.mark.parametrize("policy", ["fixed", "cost-budget"])
def test_reads_fsdata_balance_output(tmp_path, policy):
    if policy == "cost-budget":
        pytest.importorskip("fsdata.balancer.cost_budget", reason="fsdata's cost-budget policy is not merged yet")
    inp = write_samples(tmp_path / "in.parquet", n=600, seed=1)
    out = tmp_path / policy
    assert fsdata_main(["balance", str(inp), str(out), "--ranks", "3", "--batch-size-per-rank", "8",
                        "--batch-policy", policy, "--no-progress"]) == 0
    m = load_manifest(str(out))
    seen = []
    for r in range(3):
        for b in ShardReader(str(out), r, 3):
            assert int(b.lengths.min()) >= 1
            seen.extend(b.sample_ids.tolist())
    assert len(seen) == len(set(seen)) == m.raw["num_samples_written"]
    assert infer_num_items(m) <= 5000


def test_reads_movielens_shards(tmp_path):
    src = dataset_path("ml-1m_ensfm/sequences.txt")
    small = tmp_path / "ml1m_head.txt"
    small.write_text("".join(open(src).readlines()[:60]))
    assert fsdata_main(["convert", str(small), str(tmp_path / "s.parquet"), "--format", "sequences",
                        "--samples", "per-event", "--max-seq-len", "512", "--no-progress"]) == 0
    out = tmp_path / "shards"
    assert fsdata_main(["balance", str(tmp_path / "s.parquet"), str(out), "--ranks", "2",
                        "--batch-size-per-rank", "16", "--no-progress"]) == 0
    lengths = np.concatenate([b.lengths.numpy() for b in ShardReader(str(out), 0, 2)])
    assert lengths.max() <= 512 and lengths.min() >= 1 and len(lengths) > 100
