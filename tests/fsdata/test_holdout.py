"""Leave-one-out holdout of fsdata convert (--holdout last --holdout-output)."""

import json

import polars as pl
import pyarrow.parquet as pq

from fsdata.samples import schema as S
from fsdata.cli import main
from fsdata.samples.convert import convert
from fsdata.samples.holdout import HOLDOUT_META_KEY
from tests.conftest import dataset_path


def test_holdout_last_sequences(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("7 1 2 3 4\n8 5 6\n9 9\n10 1 3 5 7 9 11\n")
    out, ev = tmp_path / "t.parquet", tmp_path / "e.parquet"
    s = convert(src, out, fmt="sequences", samples="per-event", max_seq_len=3, progress=False,
                holdout="last", holdout_output=ev)
    df = pl.read_parquet(out)
    rows = list(zip(df[S.USER_ID].to_list(), df[S.ITEM_IDS].to_list(), df[S.TARGET_ITEM_ID].to_list()))
    # user 7: item 4 held out; user 8 (2 items) kept whole; user 10: item 11 held out
    assert rows == [(7, [1], 2), (7, [1, 2], 3), (8, [5], 6), (10, [1], 3), (10, [1, 3], 5), (10, [1, 3, 5], 7),
                    (10, [3, 5, 7], 9)]
    e = pl.read_parquet(ev)
    assert e.columns == [S.USER_ID, S.ITEM_IDS, S.TARGET_ITEM_ID, S.SEQ_LEN]
    assert e.rows() == [(7, [1, 2, 3], 4, 3), (10, [5, 7, 9], 11, 3)]
    meta = json.loads(pq.read_schema(ev).metadata[HOLDOUT_META_KEY])
    assert meta["num_users_evaluated"] == 2 and meta["num_users_kept_whole"] == 2 and meta["num_items_truncated"] == 2
    assert s.num_events == 13 and s.holdout["num_users_evaluated"] == 2


def test_holdout_events_with_time_holds_out_the_latest(tmp_path):
    src = tmp_path / "ev.csv"
    src.write_text("u,i,t\n1,10,5\n1,11,1\n1,12,9\n1,13,3\n")  # chronological: 11, 13, 10, 12
    out, ev = tmp_path / "t.parquet", tmp_path / "e.parquet"
    convert(src, out, fmt="events", user_col="u", item_col="i", time_col="t", progress=False, holdout="last",
            holdout_output=ev)
    assert pl.read_parquet(ev).rows() == [(1, [11, 13, 10], 12, 3)]
    df = pl.read_parquet(out)
    assert df[S.TARGET_ITEM_ID].to_list() == [13, 10]
    assert df["timestamps"].to_list() == [[1], [1, 3]]


def test_holdout_bad_flags(tmp_path, capsys):
    src = tmp_path / "seq.txt"
    src.write_text("7 1 2 3\n")
    out = tmp_path / "t.parquet"
    assert main(["convert", str(src), str(out), "--format", "sequences", "--holdout", "last"]) == 2
    assert "--holdout-output" in capsys.readouterr().err and not out.exists()
    ev = tmp_path / "e.parquet"
    ev.write_text("x")
    assert main(["convert", str(src), str(out), "--format", "sequences", "--holdout", "last",
                 "--holdout-output", str(ev)]) == 2
    assert "already exists" in capsys.readouterr().err and not out.exists() and ev.read_text() == "x"


def test_real_ml1m_holdout_excludes_the_last_interaction(tmp_path):
    path = dataset_path("ml-1m_ensfm/sequences.txt")
    out, ev = tmp_path / "t.parquet", tmp_path / "e.parquet"
    assert main(["convert", str(path), str(out), "--format", "sequences", "--max-seq-len", "50", "--holdout", "last",
                 "--holdout-output", str(ev), "--no-progress"]) == 0
    full = {}
    for line in path.read_text().splitlines():
        parts = [int(x) for x in line.split()]
        full[parts[0]] = parts[1:]
    e = pl.read_parquet(ev)
    assert e.height == len(full)
    for u, hist, tgt, n in e.rows()[:200]:
        assert tgt == full[u][-1] and hist == full[u][:-1][-50:] and n == len(hist)
    df = pl.read_parquet(out, columns=[S.USER_ID, S.TARGET_ITEM_ID, S.SEQ_LEN])
    # every user's training targets are exactly items 1 .. n-2 (the last, held-out one never appears)
    got = df.group_by(S.USER_ID, maintain_order=True).agg(pl.col(S.TARGET_ITEM_ID))
    for u, targets in got.rows()[:200]:
        assert targets == full[u][1:-1]
    assert df.height == sum(len(v) - 2 for v in full.values())
