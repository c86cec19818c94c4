"""Merging without re-planning (fstrain.data.merge): a world size dividing R reads k rank files per
rank per step; any other world size is refused with the reshard command."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from fsdata.errors import cli_terms
from fstrain.data import ShardDataset, ShardReader
from fstrain.data.merge import MergedShardReader, open_rank_reader
from fstrain.errors import ShardMismatchError
from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards
from tests.fstrain.test_train import _world_worker


def _ids_by_step(reader) -> list[list[int]]:
    return [b.sample_ids.tolist() for b in reader]


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_reads_its_k_rank_files_per_step(tmp_path, world):
    out = write_shards(str(tmp_path / "s"), num_ranks=4, num_steps=3, batch_size_per_rank=2, steps_per_row_group=1)
    k = 4 // world
    per_rank = [_ids_by_step(ShardReader(out, r, None)) for r in range(4)]
    seen = []
    for rp in range(world):
        reader = open_rank_reader(out, rp, world)
        assert isinstance(reader, MergedShardReader) and reader.k == k and len(reader) == 3
        batches = list(reader)
        for s, b in enumerate(batches):
            want = [i for r in range(rp * k, rp * k + k) for i in per_rank[r][s]]
            assert b.sample_ids.tolist() == want and b.num_samples == k * 2 and b.step == s
            assert b.global_num_samples == 8
            assert int(b.lengths.sum()) == b.features.values().numel() - b.num_samples  # histories + targets
        seen += [i for b in batches for i in b.sample_ids.tolist()]
    assert sorted(seen) == sorted(i for r in per_rank for s in r for i in s)  # every sample once


def test_shard_dataset_merges_with_columns_and_resume(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=4, num_steps=4, batch_size_per_rank=2)
    ds = ShardDataset(out, 1, 2, start_step=1)
    steps = list(DataLoader(ds, batch_size=None, num_workers=0))
    assert len(ds) == 3 and [s.step for s in steps] == [1, 2, 3]
    r2, r3 = ShardReader(out, 2, None, start_step=1), ShardReader(out, 3, None, start_step=1)
    for st, a, b in zip(steps, r2, r3, strict=True):
        assert st.batch.sample_ids.tolist() == a.sample_ids.tolist() + b.sample_ids.tolist()
        assert st.columns["sample_id"].tolist() == st.batch.sample_ids.tolist()
        assert np.array_equal(st.columns["user_id"].numpy().shape, [4])


def test_world_size_not_dividing_r_names_the_reshard_command(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=4, num_steps=2, batch_size_per_rank=2)
    with pytest.raises(ShardMismatchError) as e:
        ShardDataset(out, 0, 3)
    msg = str(e.value)
    assert "\n" not in msg and "BalanceSettings(num_ranks=3, from_step=S" in msg
    assert "fsdata balance OUTPUT NEW --ranks R' --from-step S" in msg
    with cli_terms(), pytest.raises(ShardMismatchError) as e:
        ShardDataset(out, 0, 3)
    assert f"fsdata balance {out} NEW --ranks 3 --from-step S" in str(e.value)
    with pytest.raises(ShardMismatchError, match="world size 8"):
        ShardDataset(out, 0, 8)  # more ranks than files: re-plan too


@pytest.mark.multiproc
def test_train_on_half_the_ranks_equals_one_rank_with_the_whole_global_batch(tmp_path):
    """fstrain train with world size 1 on a 2-rank output (k = 2) trains like the 1-rank output of the
    same global batches (the loss normalisation is per global batch; dropout is keyed by sample)."""
    one = write_shards(str(tmp_path / "r1"), num_ranks=1, num_steps=3, batch_size_per_rank=12, seed=7,
                       samples="per-user")
    two = write_shards(str(tmp_path / "r2"), num_ranks=2, num_steps=3, batch_size_per_rank=6, seed=7,
                       samples="per-user")
    [(ref, _)] = run_ranks(_world_worker, 1, one, "gloo")
    [(merged, _)] = run_ranks(_world_worker, 1, two, "gloo")
    for key in ref:
        torch.testing.assert_close(merged[key], ref[key], atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")


def test_real_data_merge_4_to_2_trains_every_sample_once_per_epoch(tmp_path):
    """ml-1m per-user samples, three epochs planned for R=4, read by a 2-rank job: every step holds
    the 4 rank files' rows, and every sample is trained once per epoch or listed as dropped."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from fsdata.cli import main as fsdata_main
    from fsdata.shards.manifest import Manifest
    from tests.conftest import dataset_path

    data = dataset_path("ml-1m_ensfm/sequences.txt")
    assert fsdata_main(["convert", str(data), str(tmp_path / "s.parquet"), "--format", "sequences", "--samples",
                        "per-user", "--no-progress"]) == 0
    out = str(tmp_path / "old")
    assert fsdata_main(["balance", str(tmp_path / "s.parquet"), out, "--ranks", "4", "--batch-size-per-rank", "16",
                        "--epochs", "3", "--compose-window", "1", "--no-progress"]) == 0
    m = Manifest.read(out)
    ids, steps = [], []
    for rp in range(2):
        for st in ShardDataset(out, rp, 2, columns=[], num_prefetch_batches=0):
            assert st.batch.num_samples == 2 * 16
            ids += st.batch.sample_ids.tolist()
            steps += [st.step] * st.batch.num_samples
    ids, epoch = np.array(ids), m.epoch_of_step(np.array(steps))
    dropped = pq.read_table(tmp_path / "old" / m.dropped_file)
    every = np.sort(pq.read_table(tmp_path / "s.parquet", columns=["sample_id"]).column(0).to_numpy())
    for e in range(3):
        held = np.concatenate([ids[epoch == e],
                               dropped.filter(pc.equal(dropped.column("epoch"), e)).column(0).to_numpy()])
        assert np.array_equal(np.sort(held), every), e
