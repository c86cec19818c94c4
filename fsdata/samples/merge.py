"""The temporary buckets of an ``events`` input (:mod:`fsdata.samples.events`): splitting events by a hash of
the user id into spool files, and merging grouped bucket files back into one stream in order of each
user's first event."""

from __future__ import annotations

from collections.abc import Iterator

from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.guards import raise_if_environment


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


def write_buckets(batches, folder: Path, num_buckets: int, spool_events: int,
                  on_error) -> list[tuple[Path, dict[int, list[int]]]]:
    """Split the cast events (an iterator of frames) by a hash of the user id into ``num_buckets`` buckets.

    Every ``spool_events`` events are stably sorted by bucket and written as one Parquet file
    (lz4) whose row groups each hold rows of one bucket, so each bucket keeps file order.

    Returns:
        ``(spool file, {bucket: its row group indices})`` per spool file, in input order.

    Raises:
        InputError: ``on_error(exception)`` for a read that failed (a value that is not an integer, a null
            or a negative id, named by its line, or a file the reader cannot parse).
    """
    folder.mkdir()
    spooled: list[tuple[Path, dict[int, list[int]]]] = []
    pending: list[pl.DataFrame] = []
    rows = 0

    def flush() -> None:
        df = pl.concat(pending).with_columns(_bucket=(pl.col("user_id").hash(seed=0) % num_buckets).cast(pl.UInt32))
        pending.clear()
        df = df.sort("_bucket", maintain_order=True)
        counts = df.group_by("_bucket", maintain_order=True).len()  # buckets ascending: df is sorted
        table = df.drop("_bucket").to_arrow()
        del df
        path = folder / f"spool-{len(spooled):05d}.parquet"
        start = 0
        with pq.ParquetWriter(path, table.schema, compression="lz4") as w:
            for _, n in counts.iter_rows():
                w.write_table(table.slice(start, n), row_group_size=n)  # one or more whole row groups
                start += n
        # the writer may split a long bucket into several row groups (its maximum row group length)
        md, index, g = pq.read_metadata(path), {}, 0
        for b, n in counts.iter_rows():
            index[int(b)] = []
            while n > 0:
                index[int(b)].append(g)
                n -= md.row_group(g).num_rows
                g += 1
        spooled.append((path, index))

    try:
        for df in batches:
            pending.append(df)
            rows += df.height
            if rows >= spool_events:
                flush()
                rows = 0
        if pending:
            flush()
    except (pa.ArrowException, pl.exceptions.PolarsError, OSError) as e:
        raise_if_environment(e, folder, action="write")
        raise on_error(e) from None
    return spooled

