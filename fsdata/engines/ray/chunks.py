"""Chunks of the input for the Ray engine's tasks, and the lengths task.

A *chunk* is a run of whole row groups of one input file (about :data:`CHUNK_ROWS` rows), the
unit of the lengths, windowed-lengths and partition tasks. The lengths task reads ``sample_id``
and the sequence length (``seq_len`` when present, else ``len(item_ids)``) plus the validation
counts (nulls by :func:`fsdata.samples.io.unknown_null_columns`, misaligned ``timestamps``); the
driver raises the local engine's errors, word for word (:func:`check_lengths`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.engines.ray.session import node_id
from fsdata.engines.routing import Chunk, row_group_chunks, source_chunks
from fsdata.errors import InputError
from fsdata.samples import schema as S
from fsdata.samples.io import SampleSource, check_lengths_and_ids, unknown_null_columns

#: Target rows per chunk (a run of whole row groups of one file) read by one lengths/partition task.
CHUNK_ROWS = 262_144


def make_chunks(src: SampleSource | list[str], chunk_rows: int | None = None) -> list[Chunk]:
    """Cut the input (a source: its rows read, :func:`fsdata.engines.routing.source_chunks`; or a
    list of files: all their rows) into chunks of whole row groups, about ``chunk_rows`` rows each
    (default :data:`CHUNK_ROWS`; :func:`fsdata.engines.routing.row_group_chunks`).

    Raises:
        InputError: a file's footer cannot be read.
    """
    if isinstance(src, SampleSource):
        return source_chunks(src, chunk_rows or CHUNK_ROWS)
    return row_group_chunks(src, chunk_rows or CHUNK_ROWS)


def open_chunk(chunk: Chunk) -> pq.ParquetFile:
    fs, inner = fsio.resolve_fs(chunk.path)
    return pq.ParquetFile(fs.open_input_file(inner))


def lengths_task(chunk: Chunk, rename: dict[str, str], has_seq_len: bool, has_timestamps: bool) -> dict:
    """Lengths and validation counts of one chunk (runs as a Ray task).

    Returns:
        ``{"ids": int64 [n], "lengths": int64 [n], "nulls": {column: count}, "tlen_mismatch": int}``.
    """
    theirs = {v: k for k, v in rename.items()}
    name = lambda c: theirs.get(c, c)  # noqa: E731
    try:
        pf = open_chunk(chunk)
        unknown = unknown_null_columns(pf.metadata, chunk.row_groups, rename)
        if chunk.columns is not None:  # not the columns left unread (an OUTPUT's step and rank)
            unknown &= {rename.get(c, c) for c in chunk.columns}
        want = {S.SAMPLE_ID, S.SEQ_LEN if has_seq_len else S.ITEM_IDS} | unknown
        if has_timestamps:
            want |= {S.TIMESTAMPS, S.ITEM_IDS} if not has_seq_len else {S.TIMESTAMPS}
        t = pf.read_row_groups(list(chunk.row_groups), columns=[name(c) for c in sorted(want)]).slice(chunk.skip)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"input {chunk.path}: cannot read ({str(e).splitlines()[0]}); "
                         "the file is corrupt or not Parquet: regenerate it") from None
    t = t.rename_columns([rename.get(c, c) for c in t.column_names])
    nulls: dict[str, int] = {}
    for c in unknown:
        col = t.column(c)
        n = col.null_count
        if c in (S.ITEM_IDS, S.TIMESTAMPS):
            n += pc.list_flatten(col).null_count
        nulls[c] = int(n)
    if has_seq_len:
        lengths = t.column(S.SEQ_LEN).cast(pa.int64()).fill_null(0).to_numpy()
    else:
        lengths = pc.list_value_length(t.column(S.ITEM_IDS)).cast(pa.int64()).fill_null(0).to_numpy()
    tlen_mismatch = 0
    if has_timestamps:
        tlen = pc.list_value_length(t.column(S.TIMESTAMPS)).cast(pa.int64()).fill_null(0).to_numpy()
        tlen_mismatch = int((tlen != lengths).sum())
    ids = t.column(S.SAMPLE_ID).cast(pa.int64()).fill_null(0).to_numpy()
    return {"ids": ids, "lengths": lengths, "nulls": nulls, "tlen_mismatch": tlen_mismatch, "node": node_id()}


def check_lengths(src: SampleSource, parts: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the chunks' lengths and ids and raise the local engine's errors (same words as
    :meth:`fsdata.samples.io.SampleSource.lengths_and_ids`)."""
    nulls = {c: 0 for c in src.columns}
    for p in parts:
        for c, n in p["nulls"].items():
            nulls[c] = nulls.get(c, 0) + n
    lengths = np.concatenate([p["lengths"] for p in parts])
    ids = np.concatenate([p["ids"] for p in parts])
    check_lengths_and_ids(src.path, lengths, ids, nulls=nulls,
                          timestamp_mismatches=sum(p["tlen_mismatch"] for p in parts))
    return lengths, ids

