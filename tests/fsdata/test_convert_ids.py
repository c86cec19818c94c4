"""``fsdata convert`` ids of any type: string, integer and integer-valued float ids, one vocabulary
(``OUTPUT.vocab/``, ``--vocab``, ``--remap-ids``, :class:`fsdata.Vocabulary`)."""

import hashlib
import json

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.errors import ConfigError
from fsdata.samples.convert import CONVERT_META_KEY, convert


def _rows_digest(path) -> str:
    """sha256 of the rows of a Parquet file (values, types and order; not the file's metadata)."""
    table = pq.read_table(path).replace_schema_metadata(None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def _int_log(tmp_path, n=3000, seed=7):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 120, n)
    items = rng.integers(0, 900, n)
    ts = rng.integers(1_000_000, 2_000_000, n)
    lines = "".join(f"{u},{i},{t}\n" for u, i, t in zip(users, items, ts))
    p = tmp_path / "ev.csv"
    p.write_text("user,item,ts\n" + lines)
    q = tmp_path / "ev.txt"
    q.write_text("".join(f"{u} {i}\n" for u, i in zip(users, items)))
    return p, q


#: Row digests of today's outputs for :func:`_int_log` (recorded before ids of any type were accepted):
#: integer ids without --remap-ids keep their values, rows and order.
GOLDEN = {
    "csv_time_holdout": ("17c3f527fba7e4a0bb7c5f0ff9bedf25bb665781723b98924bfbf8f485656653",
                         "3886300fec05056bc287b274860944f04a83375256397962aae100d68bcf0583"),
    "text_per_user": ("098a9ba30acc1c1c17d3fccd57f2abbd58a56b8fa24eb3a6fbd1cd6d6ec0eb48",),
    "text_per_event_small_buckets": ("fde9b1542e80e5d2ce45228d24f1e74c9479f2d03661545a6abaefabdaf98a32",),
}


@pytest.mark.parametrize("case", ["csv_time_holdout", "text_per_user", "text_per_event_small_buckets"])
def test_integer_ids_keep_todays_rows(tmp_path, case):
    csv, txt = _int_log(tmp_path)
    out, ev = tmp_path / "s.parquet", tmp_path / "eval.parquet"
    if case == "csv_time_holdout":
        convert(csv, out, fmt="events", user_col="user", item_col="item", time_col="ts", holdout="last",
                holdout_output=ev, progress=False)
        got = (_rows_digest(out), _rows_digest(ev))
    elif case == "text_per_user":
        convert(txt, out, fmt="events", samples="per-user", progress=False)
        got = (_rows_digest(out),)
    else:
        convert(txt, out, fmt="events", max_seq_len=5, events_per_bucket=500, progress=False)
        got = (_rows_digest(out),)
    assert got == GOLDEN[case]


def _meta(path, key=CONVERT_META_KEY):
    return json.loads(pq.read_metadata(path).metadata[key])


def test_string_ids_map_to_dense_indices_from_one(tmp_path):
    src = tmp_path / "ev.csv"
    src.write_text("user,item,ts\nalice,B00X,3\nbob,B00Y,1\nalice,B00Y,1\nbob,B00Z,2\nalice,B00W,5\n")
    out = tmp_path / "s.parquet"
    s = convert(src, out, fmt="events", samples="per-user", user_col="user", item_col="item", time_col="ts",
                progress=False)
    from fsdata import Vocabulary
    v = Vocabulary.read(tmp_path / "s.parquet.vocab")
    assert v.items.rows() == [("B00X", 1, 1), ("B00Y", 2, 2), ("B00Z", 3, 1), ("B00W", 4, 1)]
    assert v.users.rows() == [("alice", 1, 3), ("bob", 2, 2)]
    df = pl.read_parquet(out)
    assert df["user_id"].to_list() == [1, 2]
    assert df["item_ids"].to_list() == [[2, 1], [2]]
    assert df["target_item_id"].to_list() == [4, 3]
    assert v.decode(df["target_item_id"].to_list()) == ["B00W", "B00Z"]
    assert v.encode(["B00Z", "B00X"]).tolist() == [3, 1]
    with pytest.raises(Exception, match="not in the vocabulary"):
        v.encode(["nope"])
    assert v.encode(["nope"], strict=False).tolist() == [0]
    meta = _meta(out)
    assert meta["num_items"] == 5 == s.num_items
    assert meta["vocab"]["path"] == "s.parquet.vocab" and meta["vocab"]["digest"].startswith("sha256:")


def test_integer_valued_floats_are_ids_and_a_fraction_is_refused(tmp_path):
    src = tmp_path / "ev.csv"
    src.write_text("u,i\n1.0,10.0\n1.0,11.0\n2,12\n2,13.0\n")
    out = tmp_path / "s.parquet"
    convert(src, out, fmt="events", samples="per-user", user_col="u", item_col="i", progress=False)
    df = pl.read_parquet(out)
    assert df["item_ids"].to_list() == [[10], [12]] and df["target_item_id"].to_list() == [11, 13]
    assert not (tmp_path / "s.parquet.vocab").exists()
    bad = tmp_path / "bad.csv"
    bad.write_text("u,i\n1,10\n1,10.7\n")
    with pytest.raises(Exception, match=r"line 3, column 'i': 10.7 is not a whole number"):
        convert(bad, tmp_path / "b.parquet", fmt="events", user_col="u", item_col="i", progress=False)
    assert not (tmp_path / "b.parquet").exists()


def test_vocab_keeps_old_indices_and_appends_new_ones(tmp_path):
    a = tmp_path / "a.csv"
    a.write_text("u,i\nx,p\nx,q\ny,q\ny,r\n")
    b = tmp_path / "b.csv"
    b.write_text("u,i\nz,s\nz,q\ny,t\ny,p\n")
    convert(a, tmp_path / "a.parquet", fmt="events", user_col="u", item_col="i", progress=False)
    before = (tmp_path / "a.parquet.vocab" / "items.parquet").read_bytes()
    s = convert(b, tmp_path / "b.parquet", fmt="events", user_col="u", item_col="i", progress=False,
                vocab=tmp_path / "a.parquet.vocab")
    assert (tmp_path / "a.parquet.vocab" / "items.parquet").read_bytes() == before  # an input: untouched
    from fsdata import Vocabulary
    v = Vocabulary.read(tmp_path / "b.parquet.vocab")
    assert v.items.rows() == [("p", 1, 1), ("q", 2, 1), ("r", 3, 0), ("s", 4, 1), ("t", 5, 1)]
    assert v.users.rows() == [("x", 1, 0), ("y", 2, 2), ("z", 3, 2)]
    assert s.num_items == 6
    again = convert(b, tmp_path / "c.parquet", fmt="events", user_col="u", item_col="i", progress=False,
                    vocab=tmp_path / "a.parquet.vocab")
    assert again.vocab["digest"] == s.vocab["digest"]
    for name in ("items.parquet", "users.parquet"):
        assert (tmp_path / "c.parquet.vocab" / name).read_bytes() == (tmp_path / "b.parquet.vocab" / name).read_bytes()
    assert _rows_digest(tmp_path / "c.parquet") == _rows_digest(tmp_path / "b.parquet")


def test_remap_ids_maps_integer_ids_and_holdout_num_items(tmp_path):
    csv, _ = _int_log(tmp_path)
    out, ev = tmp_path / "s.parquet", tmp_path / "eval.parquet"
    s = convert(csv, out, fmt="events", user_col="user", item_col="item", time_col="ts", holdout="last",
                holdout_output=ev, progress=False, remap_ids=True)
    from fsdata import Vocabulary
    v = Vocabulary.read(tmp_path / "s.parquet.vocab")
    assert v.items["index"].to_list() == list(range(1, v.items.height + 1))
    assert v.items["count"].sum() == 3000
    train, held = pl.read_parquet(out), pl.read_parquet(ev)
    top = max(train["item_ids"].list.max().max(), train["target_item_id"].max(), held["target_item_id"].max())
    assert s.num_items == top + 1 == v.num_items
    assert _meta(ev, b"freescale.holdout")["num_items"] == s.num_items
    # the original ids come back
    raw = pl.read_csv(csv)
    first_user = raw["user"][0]
    assert v.decode([train["user_id"][0]], kind="user") == [first_user]


def test_integer_ids_record_num_items_without_vocab(tmp_path):
    csv, _ = _int_log(tmp_path)
    out, ev = tmp_path / "s.parquet", tmp_path / "eval.parquet"
    s = convert(csv, out, fmt="events", user_col="user", item_col="item", holdout="last", holdout_output=ev,
                progress=False)
    assert s.num_items == pl.read_csv(csv)["item"].max() + 1 == _meta(out)["num_items"]
    assert _meta(out)["vocab"] is None and not (tmp_path / "s.parquet.vocab").exists()
    assert _meta(ev, b"freescale.holdout")["num_items"] == s.num_items


def test_string_ids_after_integer_looking_rows_and_in_parquet(tmp_path):
    rows = [f"{u},{1000 + i}\n" for i, u in enumerate(range(12000))] + ["7,B00X\n", "7,B00Y\n"]
    src = tmp_path / "ev.csv"
    src.write_text("u,i\n" + "".join(rows))
    s = convert(src, tmp_path / "s.parquet", fmt="events", user_col="u", item_col="i", progress=False,
                events_per_bucket=2000)
    assert s.vocab is not None and s.num_items == 12003
    pq_src = tmp_path / "ev.parquet"
    pl.DataFrame({"user": ["a", "a", "b", "b"], "asin": ["X1", "X2", "X2", "X3"]}).write_parquet(pq_src)
    convert(pq_src, tmp_path / "p.parquet", fmt="events", user_col="user", item_col="asin", progress=False)
    assert pl.read_parquet(tmp_path / "p.parquet")["target_item_id"].to_list() == [2, 3]


def _string_log(tmp_path, n=4000, seed=3, name="ev.csv", new_items=0):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 150, n)
    items = rng.integers(0, 400 + new_items, n)
    p = tmp_path / name
    p.write_text("user,item,ts\n" + "".join(f"U{u},ASIN{i:05d},{t}\n" for t, (u, i) in enumerate(zip(users, items))))
    return p


def test_balance_carries_num_items_and_vocab_into_the_manifest(tmp_path):
    from fsdata.cli import main
    from fsdata.shards.manifest import Manifest
    from fsdata.shards.verify import verify

    src = _string_log(tmp_path)
    out, ev = tmp_path / "train.parquet", tmp_path / "eval.parquet"
    s = convert(src, out, fmt="events", user_col="user", item_col="item", time_col="ts", holdout="last",
                holdout_output=ev, progress=False)
    assert main(["balance", str(out), str(tmp_path / "shards"), "--ranks", "2", "--batch-size-per-rank", "8",
                 "--no-progress"]) == 0
    raw = json.loads((tmp_path / "shards" / "_manifest.json").read_text())
    keys = list(raw)
    assert keys[-3:] == ["num_items", "vocab", "plan_digest"]  # after every existing key; plan_digest last
    m = Manifest.read(tmp_path / "shards")
    assert m.num_items == s.num_items and m.vocab == {"digest": s.vocab["digest"], "path": "../train.parquet.vocab"}
    assert m.feature_columns is None
    verify(tmp_path / "shards", out, progress=False)
    # an input without convert metadata: no key
    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(out).replace_schema_metadata(None), plain)
    assert main(["balance", str(plain), str(tmp_path / "s2"), "--ranks", "2", "--batch-size-per-rank", "8",
                 "--no-progress"]) == 0
    m2 = Manifest.read(tmp_path / "s2")
    assert m2.num_items is None and m2.vocab is None and "num_items" not in m2.to_json()


def test_id_map_lookup_by_hash_equals_the_join_fallback():
    from fsdata.samples.vocab import IdMap

    table = pl.DataFrame({"id": [f"id{i}" for i in range(1000)], "index": pl.int_range(1, 1001, eager=True)})
    m = IdMap(table)
    batch = pl.Series("item_id", ["id5", None, "id999", "unknown", "id0"])
    fast = m.encode(batch)
    m._exact, m.table = False, table  # as after a hash collision (the table is kept for the joins)
    assert fast.to_list() == m.encode(batch).to_list() == [6, None, 1000, None, 1]
    ints = IdMap(pl.DataFrame({"id": [30, 10, 20], "index": [1, 2, 3]}))
    assert ints.encode(pl.Series([10, 30, 99])).to_list() == [2, 1, None]


def test_overwrite_replaces_its_own_vocabulary_only(tmp_path):
    """A second convert with overwrite replaces OUTPUT.vocab/ it wrote; a vocabulary folder holding a
    user's file is refused before any work, and nothing is replaced."""
    src = tmp_path / "log.csv"
    src.write_text("user,item,ts\n" + "".join(f"u{i % 7},it{i % 11},{i}\n" for i in range(200)))
    out = tmp_path / "s.parquet"
    convert(src, out, fmt="events", progress=False)
    before = out.read_bytes()
    convert(src, out, fmt="events", progress=False, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "s.parquet.vocab").iterdir()) == ["items.parquet", "users.parquet"]
    (tmp_path / "s.parquet.vocab" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="vocabulary output .* holds files FreeScale did not write"):
        convert(src, out, fmt="events", progress=False, overwrite=True)
    assert (tmp_path / "s.parquet.vocab" / "notes.txt").read_text() == "mine" and out.read_bytes() == before
