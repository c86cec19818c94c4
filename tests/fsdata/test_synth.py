"""Dataset length readers and the synthetic sample writer."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from fsdata.errors import ConfigError
from fsdata.samples.schema import sample_schema
from fsdata.samples.synth import (detect_format, per_event_lengths, read_lengths, synth_lengths,
                          user_item_counts, write_synth_samples)
from tests.conftest import dataset_path


def test_formats_from_small_files(tmp_path):
    seq = tmp_path / "seq.txt"
    seq.write_text("1 10 11 12\n2 13 14\n3 15 16 17 18 19\n")
    ev = tmp_path / "ev.txt"
    ev.write_text("1 10\n1 11\n2 12\n1 13\n3 14\n3 15\n")
    csv = tmp_path / "r.csv"
    csv.write_text("userId,Id,rating,timestamp\n5,1,4.0,9\n5,2,3.0,10\n6,3,1.0,11\n")
    assert [detect_format(p) for p in (seq, ev, csv)] == ["sequences", "events", "csv"]
    assert list(user_item_counts(seq)) == [3, 2, 5]
    assert list(user_item_counts(ev)) == [3, 1, 2]
    assert list(user_item_counts(csv)) == [2, 1]
    assert list(read_lengths(seq, "user")) == [2, 1, 4]
    assert list(read_lengths(seq, "event", max_seq_len=3)) == [1, 2, 1, 1, 2, 3, 3]


def test_per_event_lengths_cap():
    assert list(per_event_lengths(np.array([1, 4]), max_seq_len=2)) == [1, 2, 2]


def test_movielens_counts_match_dataset_readme():
    counts = user_item_counts(dataset_path("ml-1m_ensfm/sequences.txt"))
    assert (len(counts), counts.sum(), counts.max()) == (6040, 1_000_209, 2314)
    assert np.median(counts) == 96


def test_synth_lengths_follow_source_distribution():
    rng = np.random.default_rng(0)
    src = np.rint(rng.lognormal(3, 1, size=5000)).astype(np.int64) + 1
    out = synth_lengths(200_000, src, seed=1)
    assert set(np.unique(out)) <= set(np.unique(src))
    for q in (10, 50, 90, 99):
        assert abs(np.percentile(out, q) - np.percentile(src, q)) <= 0.05 * np.percentile(src, q) + 1
    np.testing.assert_array_equal(out, synth_lengths(200_000, src, seed=1))
    with pytest.raises(ConfigError):
        synth_lengths(3, np.array([0, 1]))


def test_write_synth_samples_schema_and_content(tmp_path):
    src = np.array([1, 2, 3, 50])
    path = tmp_path / "s.parquet"
    stats = write_synth_samples(path, 2500, src, seed=3, num_items=1000, rows_per_group=1000)
    meta = pq.ParquetFile(path)
    assert meta.schema_arrow.equals(sample_schema(with_seq_len=True))
    assert meta.num_row_groups == stats["num_row_groups"] == 3
    df = pl.read_parquet(path)
    assert df.height == 2500 and df["sample_id"].n_unique() == 2500
    lengths = df["item_ids"].list.len()
    assert (df["seq_len"] == lengths).all()
    assert set(lengths.unique().to_list()) <= {1, 2, 3, 50} and lengths.min() >= 1
    assert int(lengths.cast(pl.Int64).sum()) == stats["num_items_total"]
    items = df["item_ids"].explode()
    assert items.min() >= 1 and items.max() <= 1000
    assert not (tmp_path / "s.parquet.tmp").exists()
