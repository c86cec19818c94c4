"""The vocabulary pass of ``fsdata convert``: each id column's distinct ids in order of first appearance, with
their counts, in memory proportional to the distinct ids (issue 36: the 2 GB benchmark input under 1 GiB).

Each id column has a :class:`FirstSeen`: the distinct ids met so far as 64-bit keys (Polars' ``hash`` of a
string id with seed 0, an integer id as it is) kept sorted in NumPy arrays with each key's position in order of
first appearance, the counts by position, and the ids themselves in that order (string ids as one Arrow string
array: 4 B offset + the id's bytes, ``u3119865`` 12 B; integer ids 8 B). A block of rows is grouped on its own
(``group_by(maintain_order=True)``: its distinct ids in order of first appearance), its keys looked up with
``np.searchsorted`` and the new ones added to a small second sorted level, merged into the large one in place
once it holds :data:`SMALL_KEYS` keys (so no copy of the large level is made beside it). String ids are compared
with the ids met before when their key is found: two distinct ids of one 64-bit hash (about n^2 / 2^65) raise
:class:`HashCollision` and the caller falls back to the grouping of :func:`fsdata.samples.ids.build_maps`.

Every array grows in place (``ndarray.resize``: ``realloc``, which moves a large buffer's pages rather than
copying them beside the old ones). Without an earlier vocabulary, :class:`PassVocabulary` writes the vocabulary
from these arrays in row groups and turns the sorted keys into the conversion's
:class:`~fsdata.samples.vocab.IdMap` without hashing the ids again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.samples import vocab as V

#: Rows gathered from the reader's blocks before they are grouped and merged.
BLOCK_ROWS = 1 << 19
#: Keys of the small sorted level before it is merged into the large one.
SMALL_KEYS = 1 << 20
#: Keys of the large level moved at a time by the in-place merge.
_SEGMENT = 1 << 20
#: Rows per row group of the written vocabulary: pyarrow's default maximum, so the files are byte-identical to
#: ``pq.write_table`` of the whole table (:meth:`fsdata.samples.vocab.Vocabulary.write`).
WRITE_ROWS = 1 << 20
_INT32_MAX = np.iinfo(np.int32).max


class HashCollision(Exception):
    """Two distinct ids share a 64-bit hash: the hashed pass cannot tell them apart."""


def _reserve(a: np.ndarray, need: int) -> np.ndarray:
    """``a`` (owning its data, no views of it alive) with room for ``need`` elements, grown by an eighth in place
    (the new room is zero-filled, so it counts in RSS: small steps, each a cheap ``mremap``)."""
    if need > len(a):
        a.resize(max(need, len(a) + len(a) // 8), refcheck=False)
    return a


class FirstSeen:
    """Distinct ids of one column in order of first appearance, with counts.

    Args:
        dtype: ``pl.String`` or ``pl.Int64`` (the id dtype of :func:`fsdata.samples.vocab.id_dtype`).
    """

    def __init__(self, dtype: pl.DataType) -> None:
        self.dtype = dtype
        self.string = dtype == pl.String
        self.keys = np.zeros(1 << 16, np.uint64)  # large level: keys[:nb] sorted
        self.pos = np.zeros(1 << 16, np.uint32)  # position in order of first appearance, aligned with keys
        self.nb = 0
        self.small_keys = np.empty(0, np.uint64)  # small level, sorted
        self.small_pos = np.empty(0, np.uint32)
        self.counts = np.zeros(1 << 16, np.uint32)  # by position, Int64 in the table
        if self.string:  # ids[i] = data[offsets[i]:offsets[i + 1]] (int32 offsets, int64 past 2 GiB of ids)
            self.offsets = np.zeros(1 << 16, np.int32)
            self.data = np.zeros(1 << 20, np.uint8)
        else:
            self.ids = np.zeros(1 << 16, np.int64)
        self.n = 0

    def _hash(self, s: pl.Series) -> np.ndarray:
        if self.string:
            return s.hash(seed=0).to_numpy()
        return s.cast(pl.Int64).to_numpy().view(np.uint64)

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, pos)``: whether each key was met, and its position where it was."""
        found = np.zeros(len(keys), bool)
        pos = np.zeros(len(keys), np.uint32)
        for level, at_pos, n in ((self.keys, self.pos, self.nb),
                                 (self.small_keys, self.small_pos, len(self.small_keys))):
            if not n:
                continue
            at = np.searchsorted(level[:n], keys)
            inside = np.flatnonzero(at < n)
            hit = inside[level[at[inside]] == keys[inside]]
            pos[hit] = at_pos[at[hit]]
            found[hit] = True
        return found, pos

    def _arrow(self) -> pa.Array:
        """The string ids so far, as an Arrow array over this object's buffers (no copy; drop it before growing)."""
        typ = pa.string() if self.offsets.dtype == np.int32 else pa.large_string()
        return pa.Array.from_buffers(typ, self.n, [None, pa.py_buffer(self.offsets[:self.n + 1]),
                                                    pa.py_buffer(self.data[:int(self.offsets[self.n])])])

    def add(self, s: pl.Series) -> None:
        """Count the non-null ids of ``s`` (a block, in input order) and append the new ones."""
        g = (pl.DataFrame({"id": s.cast(self.dtype)}).drop_nulls().group_by("id", maintain_order=True)
             .agg(pl.len().cast(pl.Int64).alias("count")))
        if g.height == 0:
            return
        keys = self._hash(g["id"])
        cnt = g["count"].to_numpy()
        found, pos = self._find(keys)
        if self.string and found.any():  # the ids of the keys found are the ids met before: else two share a hash
            met = pl.Series(self._arrow().take(pa.array(pos[found])))
            if (met != g["id"].filter(pl.Series(found))).any():
                raise HashCollision
            del met
        np.add.at(self.counts, pos[found], cnt[found].astype(np.uint32))
        new = ~found
        k = int(new.sum())
        if not k:
            return
        new_keys = keys[new]
        order = np.argsort(new_keys, kind="stable")
        new_keys = new_keys[order]
        if k > 1 and bool(np.any(new_keys[1:] == new_keys[:-1])):
            raise HashCollision
        self.counts = _reserve(self.counts, self.n + k)
        self.counts[self.n:self.n + k] = cnt[new].astype(np.uint32)
        self._append_ids(g["id"].filter(pl.Series(new)))
        new_pos = np.arange(self.n, self.n + k, dtype=np.uint32)[order]
        where = np.searchsorted(self.small_keys, new_keys)
        self.small_keys = np.insert(self.small_keys, where, new_keys)
        self.small_pos = np.insert(self.small_pos, where, new_pos)
        self.n += k
        if len(self.small_keys) >= SMALL_KEYS:
            self._merge()

    def _append_ids(self, s: pl.Series) -> None:
        k = len(s)
        if not self.string:
            self.ids = _reserve(self.ids, self.n + k)
            self.ids[self.n:self.n + k] = s.to_numpy()
            return
        arr = s.to_arrow()
        arr = (arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr).cast(pa.large_string())
        off = np.frombuffer(arr.buffers()[1], np.int64, k + 1, arr.offset * 8)
        size = int(off[-1] - off[0])
        used = int(self.offsets[self.n])
        if used + size > _INT32_MAX and self.offsets.dtype == np.int32:
            self.offsets = self.offsets.astype(np.int64)
        self.data = _reserve(self.data, used + size)
        if size:
            self.data[used:used + size] = np.frombuffer(arr.buffers()[2], np.uint8, size, int(off[0]))
        self.offsets = _reserve(self.offsets, self.n + k + 1)
        self.offsets[self.n + 1:self.n + k + 1] = off[1:] - off[0] + used

    def _merge(self) -> None:
        """Merge the small level into the large one in place: the large level's keys are moved towards the end
        from the last segment backwards (each to its index + the small keys below it), then the small keys
        placed in the gaps."""
        sk, sp = self.small_keys, self.small_pos
        m, nb = len(sk), self.nb
        if not m:
            return
        self.keys = _reserve(self.keys, nb + m)
        self.pos = _reserve(self.pos, nb + m)
        dest_small = np.searchsorted(self.keys[:nb], sk) + np.arange(m)
        b, lo = nb, int(dest_small[0])  # the keys below the first small key stay
        while b > lo:
            a = max(lo, b - _SEGMENT)
            seg_k, seg_p = self.keys[a:b].copy(), self.pos[a:b].copy()
            dest = np.searchsorted(sk, seg_k) + np.arange(a, b)
            self.keys[dest], self.pos[dest] = seg_k, seg_p
            b = a
        self.keys[dest_small], self.pos[dest_small] = sk, sp
        self.nb = nb + m
        self.small_keys, self.small_pos = np.empty(0, np.uint64), np.empty(0, np.uint32)

    def finish(self) -> None:
        """End of the pass: one sorted level, every array cut to its length (in place)."""
        self._merge()
        for name, n in (("keys", self.n), ("pos", self.n), ("counts", self.n)):
            getattr(self, name).resize(n, refcheck=False)
        if self.string:
            self.offsets.resize(self.n + 1, refcheck=False)
            self.data.resize(int(self.offsets[self.n]), refcheck=False)
        else:
            self.ids.resize(self.n, refcheck=False)

    def ids_arrow(self, a: int, b: int) -> pa.Array:
        """Ids ``a:b`` in order of first appearance: ``large_string`` (a copy of the offsets) or ``int64``."""
        if not self.string:
            return pa.array(self.ids[a:b])
        off = self.offsets[a:b + 1].astype(np.int64)
        start = int(off[0])
        off -= start
        data = self.data[start:start + int(off[-1])]
        return pa.Array.from_buffers(pa.large_string(), b - a, [None, pa.py_buffer(off), pa.py_buffer(data)])

    def chunk(self, a: int, b: int) -> pa.Table:
        """Rows ``a:b`` of the vocabulary table: ``id``, ``index`` (from 1, in order of first appearance), ``count``."""
        return pa.Table.from_arrays([self.ids_arrow(a, b), pa.array(np.arange(a + 1, b + 1, dtype=np.int64)),
                                     pa.array(self.counts[a:b].astype(np.int64))], names=["id", "index", "count"])

    def table(self) -> pl.DataFrame:
        """``id``, ``count`` (Int64), in order of first appearance (after :meth:`finish`)."""
        t = self.chunk(0, self.n)
        return pl.DataFrame([pl.Series("id", t["id"], dtype=self.dtype), pl.Series("count", t["count"])])

    def write(self, path: Path) -> None:
        """Write the vocabulary table (``id``, ``index``, ``count``) to ``path`` as
        :meth:`fsdata.samples.vocab.Vocabulary.write` does (the same bytes), :data:`WRITE_ROWS` rows at a time."""
        with pq.ParquetWriter(path, self.chunk(0, 0).schema, compression="zstd") as w:
            for a in range(0, self.n, WRITE_ROWS):
                w.write_table(self.chunk(a, min(self.n, a + WRITE_ROWS)))
            if not self.n:
                w.write_table(self.chunk(0, 0))

    def id_map(self) -> V.IdMap:
        """The conversion's lookup from the sorted keys (indices = position + 1); frees this object's arrays."""
        index = self.pos
        index += 1  # in place: the uint32 positions become the int32 indices
        m = V.IdMap.from_sorted(self.dtype, self.keys, index.view(np.int32))
        self.keys = self.pos = self.counts = self.offsets = self.data = self.ids = None
        return m


class PassVocabulary:
    """The vocabulary of an input without an earlier one, as the pass left it (indices in order of first
    appearance): written and turned into lookups without building Polars tables.

    Attributes:
        seen: ``user_id`` / ``item_id`` -> finished :class:`FirstSeen`.
    """

    def __init__(self, seen: dict[str, FirstSeen]) -> None:
        self.seen = seen

    @property
    def items(self) -> pl.DataFrame:
        """``id``, ``index``, ``count`` (as :attr:`fsdata.samples.vocab.Vocabulary.items`)."""
        return self._frame("item_id")

    @property
    def users(self) -> pl.DataFrame:
        """``id``, ``index``, ``count`` (as :attr:`fsdata.samples.vocab.Vocabulary.users`)."""
        return self._frame("user_id")

    def _frame(self, c: str) -> pl.DataFrame:
        t = self.seen[c].table()
        return t.select("id", pl.int_range(1, pl.len() + 1, dtype=pl.Int64).alias("index"), "count")

    @property
    def num_items(self) -> int:
        """Embedding-table size of the items: largest index + 1 (0 is padding)."""
        return self.seen["item_id"].n + 1

    def write(self, folder: str | Path) -> str:
        """Write ``items.parquet`` and ``users.parquet`` into ``folder``; returns the content digest
        (:meth:`fsdata.samples.vocab.Vocabulary.write`: the same bytes and digest)."""
        h = hashlib.sha256()
        for kind, name in V.FILES.items():
            f = Path(folder) / name
            self.seen[f"{kind}_id"].write(f)
            h.update(hashlib.sha256(f.read_bytes()).digest())
        return f"sha256:{h.hexdigest()}"

    def id_maps(self) -> dict[str, V.IdMap]:
        """``user_id`` / ``item_id`` -> :class:`~fsdata.samples.vocab.IdMap`; the pass's arrays are handed over."""
        return {c: self.seen.pop(c).id_map() for c in ("user_id", "item_id")}


def _mmap_large_buffers() -> None:
    """Have glibc map every allocation of 1 MiB or more on its own (``mallopt(M_MMAP_THRESHOLD)``, which also stops
    glibc raising the threshold to 32 MiB after a free): the pass's growing arrays are then ``mremap``-ed in place
    and given back to the system when freed, rather than copied and kept in the heap. No-op off glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def first_seen_pass(batches, columns, dtypes: dict, prepare) -> dict[str, FirstSeen]:
    """Each column's finished :class:`FirstSeen` over ``batches`` (frames in input order).

    Args:
        batches: frames holding ``columns``.
        columns: the id columns.
        dtypes: column -> id dtype.
        prepare: ``frame -> frame``, applied to each gathered block (casts, as the ids are matched).

    Raises:
        HashCollision: two distinct ids of one hash (the caller falls back to grouping).
    """
    _mmap_large_buffers()
    seen = {c: FirstSeen(dtypes[c]) for c in columns}
    pending: list[pl.DataFrame] = []
    rows = 0

    def flush() -> None:
        df = prepare(pl.concat(pending, how="vertical_relaxed") if len(pending) > 1 else pending[0])
        pending.clear()
        for c in columns:
            seen[c].add(df[c])

    for df in batches:
        pending.append(df.select(columns))
        rows += df.height
        if rows >= BLOCK_ROWS:
            flush()
            rows = 0
    if pending:
        flush()
    if hasattr(batches, "close"):  # the reader's buffers go before the vocabulary is written
        batches.close()
    for s in seen.values():
        s.finish()
    return seen


def first_seen_tables(batches, columns, dtypes: dict, prepare) -> dict[str, pl.DataFrame]:
    """Each column's ``id``, ``count`` (:meth:`FirstSeen.table`) over ``batches``; see :func:`first_seen_pass`."""
    return {c: s.table() for c, s in first_seen_pass(batches, columns, dtypes, prepare).items()}
