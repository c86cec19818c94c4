"""The vocabulary pass of ``fsdata convert``: each id column's distinct ids in order of first appearance, with
their counts, in memory proportional to the distinct ids (issue 36: the 2 GB benchmark input under 1 GiB).

Each id column has a :class:`FirstSeen`: the distinct ids met so far as 64-bit keys kept sorted in NumPy
arrays (Polars' ``hash`` of a string id with seed 0, an integer id as it is), each key's position in order of
first appearance, the counts by position, and the ids themselves as Polars chunks in that order. A block of
rows is grouped on its own (``group_by(maintain_order=True)``: its distinct ids in order of first appearance),
its keys looked up with ``np.searchsorted`` and the new ones merged in. String ids are compared with the ids met
before when their key is found: two distinct ids of one 64-bit hash (about n^2 / 2^65) raise
:class:`HashCollision` and the caller falls back to the grouping of :func:`fsdata.samples.ids.build_maps`.

NumPy's buffers go back to the operating system when freed, where the Polars group-by over the running table
that this replaces left hundreds of MiB with the allocator (1.3 GiB peak on a 0.6 GB string-id log).
"""

from __future__ import annotations

import numpy as np
import polars as pl

#: Rows gathered from the reader's blocks before they are grouped and merged (fewer, larger merges: each
#: merge copies the sorted keys once).
BLOCK_ROWS = 1 << 19


class HashCollision(Exception):
    """Two distinct ids share a 64-bit hash: the hashed pass cannot tell them apart."""


class FirstSeen:
    """Distinct ids of one column in order of first appearance, with counts.

    Args:
        dtype: ``pl.String`` or ``pl.Int64`` (the id dtype of :func:`fsdata.samples.vocab.id_dtype`).
    """

    def __init__(self, dtype: pl.DataType) -> None:
        self.dtype = dtype
        self.string = dtype == pl.String
        self.keys = np.empty(0, np.uint64)  # sorted
        self.pos = np.empty(0, np.uint32)  # position in order of first appearance, aligned with keys
        self.counts = np.zeros(1 << 16, np.uint32)  # by position (grown by a quarter), Int64 in the table
        self.ids = pl.Series("id", [], dtype=dtype)  # in order of first appearance (one chunk per block)
        self.n = 0

    def _hash(self, s: pl.Series) -> np.ndarray:
        if self.string:
            return s.hash(seed=0).to_numpy()
        return s.cast(pl.Int64).to_numpy().view(np.uint64)

    def add(self, s: pl.Series) -> None:
        """Count the non-null ids of ``s`` (a block, in input order) and append the new ones."""
        g = (pl.DataFrame({"id": s.cast(self.dtype)}).drop_nulls().group_by("id", maintain_order=True)
             .agg(pl.len().cast(pl.Int64).alias("count")))
        if g.height == 0:
            return
        keys = self._hash(g["id"])
        cnt = g["count"].to_numpy()
        at = np.searchsorted(self.keys, keys)
        found = np.zeros(len(keys), bool)
        if len(self.keys):
            inside = at < len(self.keys)
            found[inside] = self.keys[at[inside]] == keys[inside]
        if self.string and found.any():  # the ids of the keys found are the ids met before: else two share a hash
            if (self.ids.gather(self.pos[at[found]]) != g["id"].filter(pl.Series(found))).any():
                raise HashCollision
        np.add.at(self.counts, self.pos[at[found]], cnt[found].astype(np.uint32))
        new = ~found
        k = int(new.sum())
        if not k:
            return
        new_keys = keys[new]
        if len(np.unique(new_keys)) != k:
            raise HashCollision
        new_pos = np.arange(self.n, self.n + k, dtype=np.uint32)
        if self.n + k > len(self.counts):
            grown = np.zeros(max(len(self.counts) + len(self.counts) // 4, self.n + k), np.uint32)
            grown[:self.n] = self.counts[:self.n]
            self.counts = grown
        self.counts[new_pos] = cnt[new].astype(np.uint32)
        self.ids.append(g["id"].filter(pl.Series(new)))
        order = np.argsort(new_keys, kind="stable")
        where = np.searchsorted(self.keys, new_keys[order])
        self.keys = np.insert(self.keys, where, new_keys[order])
        self.pos = np.insert(self.pos, where, new_pos[order])
        self.n += k

    def table(self) -> pl.DataFrame:
        """``id``, ``count`` (Int64), in order of first appearance; the running arrays are freed as they are
        turned into the table (the sorted keys first, then the id chunks once joined, then the counts)."""
        self.keys = self.pos = np.empty(0, np.uint64)
        ids, self.ids = self.ids.rechunk(), None
        count = pl.Series("count", self.counts[:self.n]).cast(pl.Int64)
        self.counts = np.empty(0, np.uint32)
        return pl.DataFrame([ids, count])


def first_seen_tables(batches, columns, dtypes: dict, prepare) -> dict[str, pl.DataFrame]:
    """Each column's :meth:`FirstSeen.table` over ``batches`` (frames in input order).

    Args:
        batches: frames holding ``columns``.
        columns: the id columns.
        dtypes: column -> id dtype.
        prepare: ``frame -> frame``, applied to each gathered block (casts, as the ids are matched).

    Raises:
        HashCollision: two distinct ids of one hash (the caller falls back to grouping).
    """
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
    if hasattr(batches, "close"):  # the reader's buffers go before the tables are built
        batches.close()
    return {c: seen[c].table() for c in columns}
