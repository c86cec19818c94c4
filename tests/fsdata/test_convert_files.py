"""``fsdata convert`` takes logs as they come: compression and Parquet by content, sniffed separator and
header, standard and typed column names, ISO times, ``--bad-lines`` (each file shape with at most the flags
docs/fsdata.md shows for it)."""

import bz2
import gzip
import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from fsdata.samples.convert import CONVERT_META_KEY


def _convert(src, out, *flags):
    return main(["convert", str(src), str(out), "--format", "events", "--no-progress", *flags])


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _rows(n=60, seed=0, users=8, items=25):
    rng = np.random.default_rng(seed)
    return [(f"user{u}", f"item {i}", t) for t, (u, i) in
            enumerate(zip(rng.integers(0, users, n), rng.integers(0, items, n)), start=1_600_000_000)]


def test_semicolon_log_with_free_text_items_and_stray_separators(tmp_path, capsys):
    lines = ["userId;tag;timestamp"] + [f"{u};{i};{t}" for u, i, t in _rows()]
    lines[7] = "user1;a tag; with a semicolon;1600000100"  # a stray separator inside the free text
    lines[30] = "user2;another;one;1600000200"
    src = tmp_path / "tags.csv"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tags.parquet"
    assert _convert(src, out, "--item-col", "tag") == 2
    err = _one_error_line(capsys)
    assert "line 8 has 4 fields" in err and "'user1;a tag; with a semicolon;1600000100'" in err
    assert "--bad-lines skip" in err and not out.exists()
    assert _convert(src, out, "--item-col", "tag", "--bad-lines", "skip") == 0
    assert "skipped 2 bad lines" in capsys.readouterr().out
    meta = json.loads(pq.read_metadata(out).metadata[CONVERT_META_KEY])
    assert meta["bad_lines_skipped"] == 2 and meta["num_events"] == 58
    assert (tmp_path / "tags.parquet.vocab" / "items.parquet").exists()


def test_tab_dat_with_header(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / "user_artists.dat"
    src.write_text("userID\tartistID\tweight\n" + "".join(
        f"{u}\t{a}\t{w}\n" for u, a, w in zip(rng.integers(2, 30, 300), rng.integers(1, 90, 300),
                                              rng.integers(1, 999, 300))))
    out = tmp_path / "artists.parquet"
    assert _convert(src, out, "--item-col", "artistID") == 0
    df = pl.read_parquet(out)
    raw = pl.read_csv(src, separator="\t")
    assert set(df["user_id"].to_list()) <= set(raw["userID"].to_list())
    assert df["target_item_id"].max() <= raw["artistID"].max()


def test_recbole_typed_header_needs_no_flags(tmp_path):
    src = tmp_path / "ml.inter"
    src.write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(
        f"{u}\t{i}\t4.0\t{t}.0\n" for u, i, t in [(1, 10, 5), (1, 11, 3), (2, 12, 1), (2, 10, 2)]))
    out = tmp_path / "ml.parquet"
    assert _convert(src, out, "--samples", "per-user") == 0
    df = pl.read_parquet(out)
    # sorted by the float timestamps; typed names matched by their base names
    assert df["item_ids"].to_list() == [[11], [12]] and df["target_item_id"].to_list() == [10, 10]
    assert df["timestamps"].to_list() == [[3], [1]]


@pytest.mark.parametrize("codec", ["gzip", "bz2", "zstd"])
def test_compressed_csv_with_string_ids_detected_by_content(tmp_path, codec):
    text = ("user_id,item_id,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in _rows())).encode()
    src = tmp_path / "events.log"  # no telling extension
    if codec == "gzip":
        src.write_bytes(gzip.compress(text))
    elif codec == "bz2":
        src.write_bytes(bz2.compress(text))
    else:
        import pyarrow as pa
        with pa.output_stream(str(src), compression="zstd") as f:
            f.write(text)
    out = tmp_path / "s.parquet"
    assert _convert(src, out) == 0
    plain = tmp_path / "plain.csv"
    plain.write_bytes(text)
    assert _convert(plain, tmp_path / "p.parquet") == 0
    assert pl.read_parquet(out).equals(pl.read_parquet(tmp_path / "p.parquet"))


def test_parquet_event_table_with_string_ids_detected_by_content(tmp_path):
    rows = _rows()
    src = tmp_path / "events.data"  # Parquet without the .parquet name
    pl.DataFrame({"user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows],
                  "ts": [r[2] for r in rows]}).write_parquet(src)
    out = tmp_path / "s.parquet"
    assert _convert(src, out) == 0
    assert "timestamps" in pl.read_parquet(out).columns


def test_header_csv_without_column_flags_uses_standard_names(tmp_path, capsys, caplog):
    src = tmp_path / "ratings.csv"
    src.write_text("userId,rating,movieId\n1,5,100\n1,3,101\n2,4,102\n2,1,103\n")
    out = tmp_path / "s.parquet"
    assert _convert(src, out, "--samples", "per-user") == 0
    df = pl.read_parquet(out)
    assert df["target_item_id"].to_list() == [101, 103]  # movieId, never column 1 (the rating)
    assert "user 'userId', item 'movieId'" in caplog.text
    other = tmp_path / "other.csv"
    other.write_text("a,b,c\n1,2,3\n")
    assert _convert(other, tmp_path / "o.parquet") == 2
    err = _one_error_line(capsys)
    assert "['a', 'b', 'c']" in err and "--user-col NAME and --item-col NAME" in err


def test_double_colon_dat_and_iso_times(tmp_path):
    src = tmp_path / "ratings.dat"
    src.write_text("1::1193::5::978300760\n1::661::3::978302109\n2::1357::5::978298709\n2::3068::4::978299000\n")
    out = tmp_path / "ml.parquet"
    assert _convert(src, out, "--time-col", "3", "--samples", "per-user") == 0
    df = pl.read_parquet(out)
    assert df["item_ids"].to_list() == [[1193], [1357]] and df["target_item_id"].to_list() == [661, 3068]
    iso = tmp_path / "iso.csv"
    iso.write_text("user,item,time\nu1,a,2024-01-02T00:00:00Z\nu1,b,2024-01-01T00:00:00Z\nu2,c,2024-01-03T10:00:00Z\n"
                   "u2,a,2024-01-03T09:00:00Z\n")
    assert _convert(iso, tmp_path / "iso.parquet", "--samples", "per-user") == 0
    df = pl.read_parquet(tmp_path / "iso.parquet")
    assert df["timestamps"].to_list() == [[1704067200], [1704272400]]


def test_binary_and_mislabeled_inputs_are_one_line(tmp_path, capsys):
    pq_src = tmp_path / "events.parquet"
    pl.DataFrame({"user_id": [1, 1], "item_id": [2, 3]}).write_parquet(pq_src)
    assert main(["convert", str(pq_src), str(tmp_path / "o.parquet"), "--format", "sequences", "--no-progress"]) == 2
    assert "--format events" in _one_error_line(capsys)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 4)
    assert _convert(blob, tmp_path / "o.parquet") == 2
    assert "binary" in _one_error_line(capsys)
    seq = tmp_path / "seq.txt"
    seq.write_text("1 10 11 12\n2 20 21 22\n3 30 31 32\n")
    assert _convert(seq, tmp_path / "o.parquet") == 2
    assert "--format sequences" in _one_error_line(capsys)
    seq.write_text("1 10 11 12\n2 20 21\n3 30 31 32 33\n")  # lengths differ: lines of other field counts
    assert _convert(seq, tmp_path / "o.parquet") == 2
    assert "--format sequences" in _one_error_line(capsys)
    gz = tmp_path / "seq.txt.gz"
    gz.write_bytes(gzip.compress(b"1 10 11 12\n2 20 21\n"))
    assert main(["convert", str(gz), str(tmp_path / "g.parquet"), "--format", "sequences", "--no-progress"]) == 0
    assert pl.read_parquet(tmp_path / "g.parquet")["target_item_id"].to_list() == [11, 12, 21]
    meta = json.loads(pq.read_metadata(tmp_path / "g.parquet").metadata[CONVERT_META_KEY])
    assert meta["input"] == "seq.txt.gz"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin", "events.parquet", "g.parquet", "seq.txt",
                                                         "seq.txt.gz"]
