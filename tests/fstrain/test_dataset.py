"""ShardDataset: every column carried, DataLoader with 0 and 1 workers, pin_memory, resume, errors."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from fsdata.cli import main as fsdata_main
from fstrain.data import JaggedColumn, ShardDataset, ShardReader, ShardStep, column_value, load_manifest
from fstrain.errors import ConfigError, ShardError, ShardMismatchError
from tests.conftest import dataset_path
from tests.fsdata.helpers import write_samples
from tests.fstrain.shards import write_shards


def _value_rows(v) -> list:
    """A column value of ShardStep.columns as one Python value per row."""
    if isinstance(v, JaggedColumn):
        o = v.offsets.tolist()
        return [v.values[o[i]:o[i + 1]].tolist() for i in range(len(o) - 1)]
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return v.to_pylist()


@pytest.fixture
def rich_shards(tmp_path):
    """An fsdata balance output whose input has user columns of several Arrow types."""
    inp = write_samples(tmp_path / "in.parquet", n=300, seed=3, with_timestamps=True)
    t = pq.read_table(inp)
    n = t.num_rows
    rng = np.random.default_rng(0)
    t = (t.append_column("rating", pa.array(rng.random(n).astype(np.float32)))
          .append_column("is_click", pa.array(rng.random(n) < 0.5))
          .append_column("country", pa.array([f"c{i % 7}" for i in range(n)]))
          .append_column("tags", pa.array([list(range(i % 4)) for i in range(n)], pa.list_(pa.int32()))))
    pq.write_table(t, inp)
    out = tmp_path / "shards"
    assert fsdata_main(["balance", str(inp), str(out), "--ranks", "2", "--batch-size-per-rank", "16",
                        "--no-progress"]) == 0
    return str(out)


def test_every_column_carried_with_types(rich_shards):
    m = load_manifest(rich_shards)
    for rank in range(2):
        rows = pq.read_table(m.rank_file(rank))
        ds = ShardDataset(rich_shards, rank, 2)
        assert ds.columns == [c for c in rows.column_names if c != "step"]
        assert {"sample_id", "user_id", "item_ids", "target_item_id", "timestamps", "rating", "is_click",
                "country", "tags"} <= set(ds.columns)
        steps = list(DataLoader(ds, batch_size=None, num_workers=0))
        assert len(steps) == len(ds) == m.num_steps and [s.step for s in steps] == list(range(m.num_steps))
        first = steps[0].columns
        assert first["rating"].dtype == torch.float32 and first["is_click"].dtype == torch.bool
        assert first["user_id"].dtype == torch.int64 and isinstance(first["country"], pa.Array)
        assert isinstance(first["tags"], JaggedColumn) and first["tags"].values.dtype == torch.int32
        assert first["timestamps"].offsets.dtype == torch.int64 and first["timestamps"].offsets[0] == 0
        for name in ds.columns:
            got = [x for s in steps for x in _value_rows(s.columns[name])]
            want = rows.column(name).to_pylist()
            if name == "rating":
                np.testing.assert_array_equal(np.float32(got), np.float32(want))
            else:
                assert got == want, name
        for s in steps:  # the columns are row-aligned with the Batch
            assert s.columns["sample_id"].tolist() == s.batch.sample_ids.tolist()
            assert s.columns["item_ids"].lengths.tolist() == s.batch.lengths.tolist()
            assert s.columns["target_item_id"].tolist() == s.batch.target_ids.tolist()


def test_dataloader_one_worker_pin_memory_equals_in_process(rich_shards):
    ds = ShardDataset(rich_shards, 1, 2, columns=["tags", "rating", "country"])
    assert isinstance(ds, IterableDataset)
    plain = list(DataLoader(ds, batch_size=None, num_workers=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pinned = list(DataLoader(ds, batch_size=None, num_workers=1, pin_memory=True))
    assert len(pinned) == len(plain) == len(ds)
    for a, b in zip(plain, pinned):
        assert isinstance(b, ShardStep) and a.step == b.step and list(b.columns) == ["tags", "rating", "country"]
        assert b.batch.sample_ids.tolist() == a.batch.sample_ids.tolist()
        for name in a.columns:
            assert _value_rows(b.columns[name]) == _value_rows(a.columns[name])
    if torch.cuda.is_available():  # pinned for real: ShardStep.pin_memory was called
        assert pinned[0].batch.sample_ids.is_pinned() and pinned[0].columns["tags"].values.is_pinned()
    else:  # CPU-only torch: the DataLoader warns and does not pin (documented in docs/api.md)
        assert any("no accelerator is found" in str(w.message) for w in caught)
        assert not pinned[0].batch.sample_ids.is_pinned()


def test_more_than_one_worker_refused(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=4, batch_size_per_rank=2)
    with pytest.raises(ConfigError, match="num_workers=2"):
        list(DataLoader(ShardDataset(out, 0, 1), batch_size=None, num_workers=2))


def test_resume_from_step(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=9, batch_size_per_rank=3, steps_per_row_group=2)
    full = list(ShardDataset(out, 0, 2))
    part = list(DataLoader(ShardDataset(out, 0, 2, start_step=5, max_steps=3), batch_size=None, num_workers=1))
    assert [s.step for s in part] == [5, 6, 7]
    for a, b in zip(full[5:8], part):
        assert {k: _value_rows(v) for k, v in a.columns.items()} == {k: _value_rows(v) for k, v in b.columns.items()}
    assert [s.batch.sample_ids.tolist() for s in part] == [b.sample_ids.tolist() for b in
                                                           ShardReader(out, 0, 2, start_step=5, max_steps=3)]


def test_pickles_and_iterates_twice(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=2)
    ds = pickle.loads(pickle.dumps(ShardDataset(out, 1, 2, num_prefetch_batches=0)))
    a, b = list(ds), list(ds)
    assert [s.columns["user_id"].tolist() for s in a] == [s.columns["user_id"].tolist() for s in b]


def test_bad_arguments_fail_at_construction(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=2)
    with pytest.raises(ShardError, match=r"no columns \['rating'\]"):
        ShardDataset(out, 0, 2, columns=["user_id", "rating"])
    with pytest.raises(ShardMismatchError, match="world size 3"):
        ShardDataset(out, 0, 3)


def test_column_value_slices_and_nulls():
    lists = pa.array([[1, 2], [3], [], [4, 5, 6]], pa.list_(pa.int64())).slice(1, 3)
    v = column_value(lists)
    assert isinstance(v, JaggedColumn) and v.offsets.tolist() == [0, 1, 1, 4] and v.values.tolist() == [3, 4, 5, 6]
    assert v.lengths.tolist() == [1, 0, 3]
    with_null = pa.array([1, None, 3], pa.int64())
    assert column_value(with_null) is with_null  # nulls stay Arrow: no silent fill value
    assert column_value(pa.chunked_array([[1.5], [2.5]], pa.float64())).tolist() == [1.5, 2.5]


def test_movielens_shards_every_column(tmp_path):
    """Real data: ml-1m (first 60 users, per-event) converted and balanced by fsdata, read back."""
    src = dataset_path("ml-1m_ensfm/sequences.txt")
    small = tmp_path / "ml1m_head.txt"
    small.write_text("".join(open(src).readlines()[:60]))
    assert fsdata_main(["convert", str(small), str(tmp_path / "s.parquet"), "--format", "sequences",
                        "--samples", "per-event", "--max-seq-len", "200", "--no-progress"]) == 0
    out = str(tmp_path / "shards")
    assert fsdata_main(["balance", str(tmp_path / "s.parquet"), out, "--ranks", "2",
                        "--batch-size-per-rank", "16", "--no-progress"]) == 0
    rows = pq.read_table(load_manifest(out).rank_file(1))
    ds = ShardDataset(out, 1, 2)
    steps = list(DataLoader(ds, batch_size=None, num_workers=1))
    assert len(steps) == len(ds) > 10
    for name in ds.columns:
        assert [x for s in steps for x in _value_rows(s.columns[name])] == rows.column(name).to_pylist(), name


def test_stopping_early_joins_the_reader_thread(tmp_path):
    """A `break` (or an abandoned DataLoader) stops the prefetch thread: none is left running."""
    import threading
    out = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=8, batch_size_per_rank=2)
    it = iter(ShardDataset(out, 0, 1, num_prefetch_batches=2))
    assert next(it).step == 0
    assert [t.name for t in threading.enumerate()].count("fstrain-shard-reader") == 1
    it.close()
    assert "fstrain-shard-reader" not in [t.name for t in threading.enumerate()]
    loader = iter(DataLoader(ShardDataset(out, 0, 1), batch_size=None, num_workers=1))
    assert [next(loader).step for _ in range(2)] == [0, 1]
    del loader  # shuts the worker down while its reader is mid-shard


@pytest.mark.parametrize("num_workers", [0, 1])
def test_automatic_batching_refused_with_one_clear_error(tmp_path, num_workers):
    """DataLoader's default batch_size=1 would hand ShardSteps to default_collate: one ConfigError instead."""
    import gc
    import threading

    def refusal(loader) -> str:
        try:
            list(loader)
        except ConfigError as e:
            return str(e)
        return ""

    out = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=3, batch_size_per_rank=2)
    msg = refusal(DataLoader(ShardDataset(out, 0, 1), num_workers=num_workers))
    # in a worker process torch prefixes "Caught ConfigError in DataLoader worker process 0" and the
    # worker's traceback; the message itself is the last line, and never torch's own collate error
    assert "create the DataLoader with batch_size=None" in msg.strip().splitlines()[-1], msg
    assert "batch must contain" not in msg and (num_workers or len(msg.splitlines()) == 1), msg
    assert "batch_size=None" in refusal(DataLoader(ShardDataset(out, 0, 1), batch_size=4))
    gc.collect()  # the abandoned iterators close, and with them their reader threads
    assert "fstrain-shard-reader" not in [t.name for t in threading.enumerate()]


def test_to_padded_rows_and_padding(rich_shards):
    """Real shard columns: every row of to_padded equals the jagged row, then pad_value to the step's longest row."""
    steps = list(DataLoader(ShardDataset(rich_shards, 0, 2), batch_size=None))
    for s in steps:
        for name in ("item_ids", "tags", "timestamps"):
            col = s.columns[name]
            dense = col.to_padded(-1)
            lengths = col.lengths
            assert dense.dtype == col.values.dtype and dense.shape == (len(lengths), int(lengths.max()))
            for i, row in enumerate(_value_rows(col)):
                assert dense[i, :len(row)].tolist() == row
                assert (dense[i, len(row):] == -1).all()
            mask = torch.arange(dense.shape[1]) < lengths[:, None]
            assert torch.equal(dense[mask], col.values)  # the docstring's mask recipe


def test_to_padded_edge_cases():
    empty_rows = JaggedColumn(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0, 0]))
    assert empty_rows.to_padded(7).shape == (2, 0)
    no_rows = JaggedColumn(torch.zeros(0, dtype=torch.float32), torch.tensor([0]))
    assert no_rows.to_padded(0.5).shape == (0, 0)
    v = JaggedColumn(torch.tensor([1.5, 2.5, 3.5], dtype=torch.float32), torch.tensor([0, 0, 1, 3]))
    assert v.to_padded(float("nan")).isnan().tolist() == [[True, True], [False, True], [False, False]]
    assert v.to_padded(0).tolist() == [[0.0, 0.0], [1.5, 0.0], [2.5, 3.5]]
