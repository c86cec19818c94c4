"""``fsdata convert --feature-cols``: event columns travel as lists aligned with ``item_ids`` (training
samples, evaluation file, and through ``fsdata balance`` into the shards and the manifest)."""

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from fsdata.samples.convert import convert


def _log(tmp_path, n=400, seed=5):
    rng = np.random.default_rng(seed)
    u, i = rng.integers(0, 20, n), rng.integers(0, 50, n)
    rating = rng.integers(1, 6, n) / 2  # 0.5 .. 2.5
    action = rng.integers(0, 3, n)
    p = tmp_path / "ev.csv"
    p.write_text("user,item,rating,action,ts\n" + "".join(
        f"{a},{b},{c},{d},{t}\n" for t, (a, b, c, d) in enumerate(zip(u, i, rating, action))))
    return p


@pytest.mark.parametrize("per_bucket", [None, 100])
def test_features_are_aligned_and_truncated_like_item_ids(tmp_path, per_bucket):
    src = _log(tmp_path)
    out, ev = tmp_path / "s.parquet", tmp_path / "eval.parquet"
    s = convert(src, out, fmt="events", time_col="ts", feature_cols="rating,action", max_seq_len=4,
                holdout="last", holdout_output=ev, progress=False, events_per_bucket=per_bucket)
    assert s.feature_columns == ["rating", "action"]
    df = pl.read_parquet(out)
    assert df.schema["rating"] == pl.List(pl.Float64) and df.schema["action"] == pl.List(pl.Int64)
    assert (df["rating"].list.len() == df["item_ids"].list.len()).all()
    assert (df["action"].list.len() == df["seq_len"]).all()
    raw = pl.read_csv(src)
    # every (item, rating, action) triple of a history is an event of that user at that time
    events = set(raw.select("user", "item", "rating", "action", "ts").iter_rows())
    for row in df.head(200).iter_rows(named=True):
        for it, r, a, t in zip(row["item_ids"], row["rating"], row["action"], row["timestamps"]):
            assert (row["user_id"], it, r, a, t) in events
    held = pl.read_parquet(ev)
    assert held.columns[-2:] == ["rating", "action"]
    assert (held["rating"].list.len() == held["item_ids"].list.len()).all()
    assert json.loads(pq.read_metadata(out).metadata[b"freescale.convert"])["feature_columns"] == ["rating", "action"]


def test_balance_carries_features_into_shards_and_manifest(tmp_path):
    src = _log(tmp_path)
    out = tmp_path / "s.parquet"
    convert(src, out, fmt="events", time_col="ts", feature_cols=["rating"], progress=False)
    assert main(["balance", str(out), str(tmp_path / "shards"), "--ranks", "2", "--batch-size-per-rank", "4",
                 "--no-progress"]) == 0
    m = json.loads((tmp_path / "shards" / "_manifest.json").read_text())
    assert m["feature_columns"] == ["rating"] and "rating" in m["columns"]
    shards = pl.read_parquet(str(tmp_path / "shards" / "*" / "*.parquet"))
    assert shards.schema["rating"] == pl.List(pl.Float64)
    assert (shards["rating"].list.len() == shards["item_ids"].list.len()).all()
    joined = shards.select("sample_id", "rating").join(pl.read_parquet(out).select("sample_id", pl.col("rating")
                                                                                   .alias("r0")), on="sample_id")
    assert (joined["rating"] == joined["r0"]).all()


def test_feature_errors_are_one_line(tmp_path, capsys):
    src = tmp_path / "ev.csv"
    src.write_text("user,item,action\n1,2,click\n1,3,buy\n")
    assert main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "events", "--feature-cols", "action",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds text" in err[0]
    assert main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "events", "--feature-cols", "nope",
                 "--no-progress"]) == 2
    assert "no column 'nope'" in capsys.readouterr().err
