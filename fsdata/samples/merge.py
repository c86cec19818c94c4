"""Merging grouped bucket files of an ``events`` input back into one stream in order of each user's first
event (:mod:`fsdata.samples.events`)."""

from __future__ import annotations

from collections.abc import Iterator

import polars as pl
import pyarrow.parquet as pq


def merge_by_first(files: list[pq.ParquetFile]) -> Iterator[pl.DataFrame]:
    """Merge grouped bucket files (each sorted by ``_first``) into one stream sorted by ``_first``.

    Before each step, every file whose buffer holds fewer rows than its last row group read reads
    its next row group, so each buffer spans at least one row group; the step yields every buffered
    user with ``_first`` up to the smallest buffer end among files with unread groups (all users up
    to there are buffered: unread groups of a file start after its buffer). Memory: at most two row
    groups per file; each step yields about one row group per file, so the number of steps is about
    the row groups of one file. (Refilling only emptied buffers, as before, made about one step per
    row group of all files, each step touching every file: quadratic in the input.)
    """
    n = len(files)
    next_group = [0] * n
    bufs: list[pl.DataFrame | None] = [None] * n
    group_rows = [0] * n

    def top_up(i: int) -> None:
        while (bufs[i] is None or bufs[i].height < group_rows[i]) and next_group[i] < files[i].num_row_groups:
            df = pl.from_arrow(files[i].read_row_group(next_group[i]))
            next_group[i] += 1
            group_rows[i] = df.height
            if df.height:
                bufs[i] = df if bufs[i] is None else pl.concat([bufs[i], df])
                return

    while True:
        for i in range(n):
            top_up(i)
        if all(b is None for b in bufs):
            return
        more = [int(bufs[i]["_first"][-1]) for i in range(n)
                if bufs[i] is not None and next_group[i] < files[i].num_row_groups]
        threshold = min(more) if more else None
        out = []
        for i, b in enumerate(bufs):
            if b is None:
                continue
            k = b.height if threshold is None else int(b["_first"].search_sorted(threshold, side="right"))
            if k:
                out.append(b.slice(0, k))
                bufs[i] = b.slice(k) if k < b.height else None
        yield pl.concat(out).sort("_first")

