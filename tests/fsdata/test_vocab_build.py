"""The vocabulary pass of ``fsdata convert`` (:mod:`fsdata.samples.vocab_build`): first appearance and counts by
sorted 64-bit keys, equal to Polars' grouping, and the grouping taken when two ids share a hash."""

import numpy as np
import polars as pl
import pytest

from fsdata.samples import ids as I
from fsdata.samples import vocab as V
from fsdata.samples import vocab_build as VB


def _batches(n=5000, seed=3, strings=True, nulls=False):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 700, n)
    items = rng.integers(0, 2000, n)
    df = pl.DataFrame({"_row": pl.int_range(0, n, dtype=pl.UInt32, eager=True),
                       "user_id": [f"u{u}" for u in users] if strings else users,
                       "item_id": [f"B{i:09d}" for i in items] if strings else items})
    if nulls:
        df = df.with_columns(pl.when(pl.col("_row") % 97 == 5).then(None).otherwise(pl.col("item_id")).alias("item_id"))
    return [df.slice(o, 700) for o in range(0, n, 700)]  # several blocks, not a multiple of the gathering


@pytest.mark.parametrize("strings", [True, False])
def test_sorted_key_pass_equals_the_grouping(monkeypatch, strings):
    monkeypatch.setattr(VB, "BLOCK_ROWS", 1500)  # several merges into the sorted keys
    monkeypatch.setattr(VB, "SMALL_KEYS", 300)  # the small level merged into the large one in place, in segments
    monkeypatch.setattr(VB, "_SEGMENT", 128)
    kind = "string" if strings else "int"
    kinds = {"user_id": kind, "item_id": kind}
    fast = I.build_maps(_batches(strings=strings, nulls=strings), kinds, None)
    shells = {c: pl.DataFrame(schema={"id": pl.String if strings else pl.Int64}) for c in I.ID_COLUMNS}
    grouped = I._grouped_first_seen(_batches(strings=strings, nulls=strings), kinds, shells)
    for c, table in (("user_id", fast.users), ("item_id", fast.items)):
        want = grouped[c].sort("first")
        assert table["id"].to_list() == want["id"].to_list()  # order of first appearance
        assert table["index"].to_list() == list(range(1, want.height + 1))
        assert table["count"].to_list() == want["count"].to_list()
        assert table.schema == {"id": pl.String if strings else pl.Int64, "index": pl.Int64, "count": pl.Int64}


def test_a_shared_hash_falls_back_to_the_grouping(monkeypatch):
    monkeypatch.setattr(VB.FirstSeen, "_hash", lambda self, s: (s.str.len_bytes().cast(pl.UInt64).to_numpy()))
    kinds = {"user_id": "string", "item_id": "string"}
    with pytest.raises(VB.HashCollision):
        VB.first_seen_tables(_batches(), I.ID_COLUMNS, {c: pl.String for c in I.ID_COLUMNS}, lambda df: df)
    reread = []
    out = I.build_maps(iter(_batches()), kinds, None, reread=lambda: reread.append(1) or iter(_batches()))
    assert reread == [1]
    monkeypatch.undo()
    assert out.items.equals(I.build_maps(_batches(), kinds, None).items)
    assert out.users.equals(I.build_maps(_batches(), kinds, None).users)


@pytest.mark.parametrize("strings", [True, False])
def test_pass_vocabulary_writes_the_tables_bytes_and_maps_as_the_tables(tmp_path, strings):
    # more rows than one row group, negative integer ids (sorted as unsigned keys), string ids of several lengths
    n = VB.WRITE_ROWS + 1234
    ids = np.random.default_rng(5).permutation(np.arange(-n // 2, n - n // 2))
    s = pl.Series("id", ids).cast(pl.String) + "x" if strings else pl.Series("id", ids)
    seen = VB.FirstSeen(s.dtype)
    seen.add(pl.concat([s, s.head(10)]))
    seen.finish()
    built = VB.PassVocabulary({"user_id": seen, "item_id": VB.FirstSeen(s.dtype)})
    want = V.Vocabulary(items=built.items, users=built.users)
    assert want.users["id"].to_list() == s.to_list() and want.users["count"][:10].to_list() == [2] * 10
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert built.write(tmp_path / "a") == want.write(tmp_path / "b")
    for name in V.FILES.values():
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    maps = built.id_maps()
    probe = pl.concat([s.gather([0, 7, n - 1]), pl.Series("id", ["nope" if strings else n + 5, None], dtype=s.dtype)])
    got = maps["user_id"].encode(probe).to_list()
    assert got == V.IdMap(want.users).encode(probe).to_list() == [1, 8, n, None, None]
