import json

import polars as pl
import pyarrow.parquet as pq
import pytest

from fsdata.samples import schema as S
from fsdata.cli import main
from fsdata.samples.convert import CONVERT_META_KEY, convert
from tests.conftest import dataset_path


def _write(p, text):
    p.write_text(text)
    return p


def test_sequences_per_event_windows(tmp_path):
    src = _write(tmp_path / "seq.txt", "7 10 11 12 13\n8 20\n9 30 31\n")
    out = tmp_path / "s.parquet"
    s = convert(src, out, fmt="sequences", samples="per-event", max_seq_len=2, progress=False)
    df = pl.read_parquet(out)
    assert df.columns == [S.SAMPLE_ID, S.USER_ID, S.ITEM_IDS, S.TARGET_ITEM_ID, S.SEQ_LEN]
    assert (df[S.SEQ_LEN] == df[S.ITEM_IDS].list.len()).all()
    assert df[S.SAMPLE_ID].to_list() == list(range(4))
    rows = list(zip(df[S.USER_ID].to_list(), df[S.ITEM_IDS].to_list(), df[S.TARGET_ITEM_ID].to_list()))
    # user 8 has a single item: no (history, target) pair; it is counted as skipped
    assert rows == [(7, [10], 11), (7, [10, 11], 12), (7, [11, 12], 13), (9, [30], 31)]
    assert s.num_samples == 4 and s.num_users == 3 and s.num_users_skipped == 1
    assert s.num_items_truncated == 1  # t=3 of user 7 drops item 10
    meta = json.loads(pq.read_metadata(out).metadata[CONVERT_META_KEY])
    assert meta["num_samples"] == 4


def test_sequences_per_user(tmp_path):
    src = _write(tmp_path / "seq.txt", "7 10 11 12 13\n9 30 31\n")
    out = tmp_path / "s.parquet"
    convert(src, out, fmt="sequences", samples="per-user", max_seq_len=2, progress=False)
    df = pl.read_parquet(out)
    assert df[S.ITEM_IDS].to_list() == [[11, 12], [30]]
    assert df[S.TARGET_ITEM_ID].to_list() == [13, 31]


def test_events_csv_with_time_sorts_per_user(tmp_path):
    src = _write(tmp_path / "ev.csv", "uid,item,ts\n1,100,30\n2,200,5\n1,101,10\n1,102,20\n2,201,6\n")
    out = tmp_path / "s.parquet"
    convert(src, out, fmt="events", samples="per-user", user_col="uid", item_col="item", time_col="ts",
            progress=False)
    df = pl.read_parquet(out)
    assert df[S.USER_ID].to_list() == [1, 2]
    assert df[S.ITEM_IDS].to_list() == [[101, 102], [200]]
    assert df[S.TARGET_ITEM_ID].to_list() == [100, 201]
    assert df[S.TIMESTAMPS].to_list() == [[10, 20], [5]]


def test_events_parquet(tmp_path):
    src = tmp_path / "ev.parquet"
    pl.DataFrame({"u": [5, 5, 5], "i": [1, 2, 3]}).write_parquet(src)
    out = tmp_path / "s.parquet"
    s = convert(src, out, fmt="events", samples="per-event", user_col="u", item_col="i", progress=False)
    assert s.num_samples == 2
    assert pl.read_parquet(out)[S.ITEM_IDS].to_list() == [[1], [1, 2]]


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("1 2 x\n", "integer"),
    ("1\n2\n", "no user has 2"),
])
def test_sequences_bad_input(tmp_path, capsys, text, fragment):
    src = _write(tmp_path / "seq.txt", text)
    out = tmp_path / "s.parquet"
    rc = main(["convert", str(src), str(out), "--format", "sequences", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".s.parquet*"))


def test_events_missing_column(tmp_path, capsys):
    src = _write(tmp_path / "ev.csv", "a,b\n1,2\n")
    rc = main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "events", "--user-col", "userId",
               "--no-progress"])
    assert rc == 2 and "no column 'userId'" in capsys.readouterr().err


def test_events_null_values(tmp_path, capsys):
    src = _write(tmp_path / "ev.csv", "u,i\n1,2\n1,\n")
    rc = main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "events", "--user-col", "u",
               "--item-col", "i", "--no-progress"])
    assert rc == 2 and "null" in capsys.readouterr().err


@pytest.mark.slow
def test_real_ml1m_per_event_matches_dataset_card(tmp_path):
    src = dataset_path("ml-1m_ensfm/sequences.txt")
    out = tmp_path / "ml1m.parquet"
    s = convert(src, out, fmt="sequences", samples="per-event", max_seq_len=512, progress=False)
    # 6,040 users, 1,000,209 interactions: one sample per interaction after each user's first
    assert (s.num_users, s.num_events, s.num_samples) == (6040, 1_000_209, 1_000_209 - 6040)
    lengths = pl.scan_parquet(out).select(pl.col(S.ITEM_IDS).list.len()).collect().to_series().to_numpy()
    assert lengths.max() == 512 and lengths.min() == 1


@pytest.mark.parametrize("rel,args,num_users", [
    ("ml-latest-small/ratings.csv", ["--user-col", "userId", "--item-col", "Id", "--time-col", "timestamp"], 610),
    ("amazon-beauty_bert4rec/beauty.txt", [], 22363),
])
def test_real_events_formats(tmp_path, rel, args, num_users):
    src = dataset_path(rel)
    out = tmp_path / "o.parquet"
    rc = main(["convert", str(src), str(out), "--format", "events", "--samples", "per-user", "--no-progress", *args])
    assert rc == 0
    df = pl.read_parquet(out)
    assert df[S.SAMPLE_ID].is_unique().all()
    assert df.height <= num_users * 2 and df.height > 0
    assert (df[S.ITEM_IDS].list.len() >= 1).all()
