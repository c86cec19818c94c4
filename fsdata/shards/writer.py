"""The rank-file writer of ``fsdata balance`` (docs/format.md): the rank-file schema
(:func:`output_schema`) and :func:`write_rank`, the one function every engine writes a rank file
with, so engines give byte-identical files.

A rank file ``rank-XXXXX/part-00000.parquet`` holds the rank's rows in (step, position) order,
with the input's columns (contract types for contract columns), then ``step`` int32 and ``rank``
int32; the Parquet settings of :func:`rank_file_options` (format_version 4: integer-list columns
such as ``item_ids`` delta-encoded without a codec, the other columns LZ4 with dictionary pages of
at most :data:`DICTIONARY_PAGE_BYTES`; statistics on every column), row groups of whole steps
(:data:`ROW_GROUP_ROWS`), and the plan digest in its key-value metadata. The file is
encoded in memory, hashed and written with one write (no re-read), to a local folder or a
:mod:`pyarrow.fs` URI.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.errors import InputError
from fsdata.samples import schema as S
from fsdata.samples.io import SampleSource
from fsdata.shards.manifest import FORMAT_VERSION, FileEntry, rank_dir_name, rank_file_path
from fsdata.shards.plan_file import PLAN_DIGEST_KEY, POSITION

#: Target rows per Parquet row group in rank files (rounded to whole steps).
ROW_GROUP_ROWS = 16384
#: ``pyarrow.parquet.ParquetWriter`` settings of a rank file in format_version 2 and 3 (still
#: read; version 4 is :func:`rank_file_options`).
#: Version 3 writes LZ4 (``LZ4_RAW``) instead of zstd, dictionary pages and statistics
#: as version 2. Measured on the 256 rank files of 1M samples (docs/results/bench_offline_stage.md,
#: "Format version 3"): ml-1m per-event samples (real ids) encode in 0.89x version 2's CPU seconds
#: for 1.07x its bytes; ``fsdata synth`` samples (uniform random ids) in 0.84x for 1.16x.
#: Without dictionary pages the synthetic files encode cheaper still (0.41x) but real ones cost
#: more CPU (1.14x) and 2.2x the bytes: their histories repeat a small vocabulary. Column
#: statistics stay on every column: readers resume at a step from ``step``'s and fstrain infers the
#: item vocabulary from ``item_ids``' and ``target_item_id``'s (their cost is within the noise).
#: Version 3's dictionary pages hold at most :data:`DICTIONARY_PAGE_BYTES` per column chunk.
#: Version 2 is kept to describe (and test) outputs still read.
RANK_FILE_PARQUET_OPTIONS: dict[int, dict] = {
    2: {"compression": "zstd", "use_dictionary": True, "write_statistics": True},
    3: {"compression": "lz4", "use_dictionary": True, "write_statistics": True,
        "dictionary_pagesize_limit": 256 * 1024},
}
#: Bytes a rank file's dictionary page may hold per column chunk (format_version 3): Parquet's
#: standard fallback writes the rest of a column chunk as plain pages once its dictionary passes
#: this size (PyArrow's default is 1 MiB). 256 KiB holds 32,768 distinct int64 values per row
#: group (a row group is about :data:`ROW_GROUP_ROWS` samples): a column with one value per sample,
#: and the item ids of the real datasets here (at most 18K items), keep their whole dictionary and
#: the bytes of a 1 MiB limit (tested). A larger vocabulary stops hashing values early: building
#: a dictionary of up to 131K distinct ids costs about 50 ns per value more than plain pages
#: (cache misses in the dictionary's hash table, so the cost grows with the host's load).
#: Measured at 20M ``fsdata synth`` samples (100K uniform item ids, R=256, B=32): the whole
#: ``fsdata balance`` in 0.76-0.97x the CPU seconds of the 1 MiB limit (four pairs) for 1.52x the
#: bytes (docs/results/bench_offline_stage.md, "Dictionary pages of at most 256 KiB").
DICTIONARY_PAGE_BYTES = RANK_FILE_PARQUET_OPTIONS[3]["dictionary_pagesize_limit"]


@functools.lru_cache(maxsize=64)
def _leaf_paths(schema: pa.Schema) -> tuple[tuple[str, str], ...]:
    """``(top-level column, Parquet leaf path)`` of every leaf column ``schema`` is written as
    (``item_ids.list.element`` for ``item_ids``), from the Parquet schema PyArrow derives."""
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    ps = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    return tuple((ps.column(i).path.split(".")[0], ps.column(i).path) for i in range(len(ps)))


def rank_file_options(schema: pa.Schema, version: int | None = None) -> dict:
    """The ``pyarrow.parquet.ParquetWriter`` settings of a rank file with ``schema`` in format
    ``version`` (default :data:`FORMAT_VERSION`): the one place every engine takes them from
    (:func:`write_rank`), so engines write the same bytes.

    Version 4 (written today): every column whose type is a list of integers (``item_ids``,
    ``timestamps``, integer-list feature columns) is written with Parquet's ``DELTA_BINARY_PACKED``
    encoding (differences of consecutive values, bit-packed per miniblock) and no codec; every
    other column as in version 3 (LZ4, dictionary pages of at most :data:`DICTIONARY_PAGE_BYTES`).
    Statistics stay on every column (readers resume at a step from ``step``'s, fstrain infers the
    item vocabulary from ``item_ids``'). Measured on rank files re-encoded one at a time
    (docs/results/bench_offline_stage.md, "Format version 4"): uniform random item ids
    (``fsdata synth``, 100K items) encode in 0.45x version 3's CPU seconds for 0.59x its bytes;
    ml-1m per-event samples (3.7K items) in 0.96x for 1.10x; Sports and Outdoors (18K items) in
    0.75x for 0.90x. Decoding costs the same within 10%. Versions 2 and 3
    (:data:`RANK_FILE_PARQUET_OPTIONS`) are kept to describe (and test) outputs still read.

    Returns:
        A new dict of keyword arguments for ``ParquetWriter``.
    """
    version = FORMAT_VERSION if version is None else version
    if version in RANK_FILE_PARQUET_OPTIONS:
        return dict(RANK_FILE_PARQUET_OPTIONS[version])
    delta = {f.name for f in schema
             if (pa.types.is_list(f.type) or pa.types.is_large_list(f.type)) and pa.types.is_integer(f.type.value_type)}
    leaves = _leaf_paths(schema)
    v3 = RANK_FILE_PARQUET_OPTIONS[3]
    return {"compression": {path: ("none" if top in delta else v3["compression"]) for top, path in leaves},
            "use_dictionary": [path for top, path in leaves if top not in delta],
            "column_encoding": {path: "DELTA_BINARY_PACKED" for top, path in leaves if top in delta},
            "write_statistics": True, "dictionary_pagesize_limit": v3["dictionary_pagesize_limit"]}


def check_reserved_columns(src: SampleSource) -> None:
    """Refuse an input column named like a column fsdata adds (``step``, ``rank``).

    Raises:
        InputError: one line naming the column and how to rename it.
    """
    for name in src.columns:
        if name in S.RESERVED_COLUMNS:
            theirs = next((k for k, v in src.rename.items() if v == name), name)
            raise InputError(f"input {src.path}: column '{theirs}' would be named '{name}', a column fsdata adds to "
                             f"every rank file ({', '.join(S.RESERVED_COLUMNS)} are reserved); rename it in the "
                             f"input, or map it onto a sample-schema column with --columns (e.g. --columns "
                             f"item_ids={theirs})")


def output_schema(src: SampleSource) -> pa.Schema:
    """Schema of every rank file: contract types for contract columns, others as in the input
    (without ``src.drop_columns``), then ``step`` int32 and ``rank`` int32.

    Raises:
        InputError: an input column is named ``step`` or ``rank``.
    """
    check_reserved_columns(src)
    fs, first_path = fsio.filesystem_and_path(src.files[0])
    first = pq.read_schema(first_path, filesystem=fs)
    fields = []
    contract = {**S.REQUIRED_COLUMNS, **S.OPTIONAL_COLUMNS}
    for f in first:
        if f.name in src.drop_columns:  # an OUTPUT's step and rank, read back as INPUT
            continue
        name = src.rename.get(f.name, f.name)
        fields.append(pa.field(name, contract.get(name, f.type)))
    fields.append(pa.field(S.STEP, pa.int32()))
    fields.append(pa.field(S.RANK, pa.int32()))
    return pa.schema(fields)


def check_seq_len(batch: pa.RecordBatch, schema: pa.Schema, path: str) -> None:
    """The stored ``seq_len`` must equal ``len(item_ids)``: the plan was made from it."""
    items = batch.column(schema.get_field_index(S.ITEM_IDS))
    stored = batch.column(schema.get_field_index(S.SEQ_LEN))
    actual = pc.list_value_length(items).cast(pa.int64())
    if not pc.all(pc.equal(actual, stored.cast(pa.int64()))).as_py():
        raise InputError(f"input file {path}: column seq_len differs from len(item_ids) in some rows; "
                         "drop the seq_len column or recompute it")



def write_rank(rank: int, table: pa.Table, output: str | os.PathLike, schema: pa.Schema, num_steps: int, *,
               plan_digest: str | None = None, sorted_rows: bool = False) -> FileEntry:
    """Write one rank's file; the unit a distributed engine calls once per rank.

    Contract (byte-identical output for the same rows, whatever their order or chunking):

    * ``table`` holds exactly this rank's rows, in any order and chunking, with the columns of
      ``schema`` (the rank-file schema from :func:`output_schema`: input columns, ``step`` int32,
      ``rank`` int32) plus ``position`` int32 (the row's index in its (step, rank) batch, from
      the plan); extra columns are ignored.
    * Rows are sorted by (``step``, ``position``), ``position`` is dropped, and the file is
      written to ``output/rank-XXXXX/part-00000.parquet`` (the folder is created) with the
      Parquet settings of :func:`rank_file_options` for :data:`FORMAT_VERSION` (delta-encoded
      integer lists, LZ4 and dictionary pages for the rest, column statistics), and row groups of
      whole steps: each row group ends at the first step boundary at or past :data:`ROW_GROUP_ROWS` rows.
    * ``output`` may be a :mod:`pyarrow.fs` URI (``s3://...``): the file is then encoded in memory
      (its compressed size; the decoded rows are held anyway), hashed, and stored with one write
      through the URI's ``FileSystem``: the same bytes as a local file.
    * Nothing else is written; the caller collects the returned records for :func:`fsdata.shards.finalize.finalize`.

    Args:
        rank: the rank, ``0 <= rank < R``.
        table: this rank's rows (see above).
        output: the OUTPUT folder (or its temporary stand-in), a local path or a URI.
        schema: the rank-file schema.
        num_steps: S; every step ``0..S-1`` must hold at least one row.
        plan_digest: the :func:`~fsdata.shards.plan_file.plan_digest` of the plan the rows come from, recorded in the
            file's key-value metadata (``fsdata.plan_digest``) so finalize can refuse files of
            another plan; None records nothing.
        sorted_rows: the rows are already in (``step``, ``position``) order and ``table`` has no
            ``position`` column (the local engine's gather): written as they are, same bytes.

    Returns:
        The file's :class:`~fsdata.shards.manifest.FileEntry` (path relative to ``output``, rows, bytes, SHA-256).

    Raises:
        ValueError: rows of another rank, a missing step, or a repeated (step, position).
    """
    if sorted_rows:
        return _write_sorted_rank(rank, table, output, schema, num_steps, plan_digest=plan_digest)
    table = table.select([*schema.names, POSITION])
    table = table.take(pc.sort_indices(table, sort_keys=[(S.STEP, "ascending"), (POSITION, "ascending")]))
    table = table.drop_columns([POSITION])
    return _write_sorted_rank(rank, table, output, schema, num_steps, plan_digest=plan_digest)


def _write_sorted_rank(rank: int, table: pa.Table, output: str | os.PathLike, schema: pa.Schema, num_steps: int, *,
                       plan_digest: str | None = None) -> FileEntry:
    """:func:`write_rank` of rows already in (``step``, ``position``) order, without ``position``:
    the file is encoded in memory, hashed, and written with one write (no re-read for the SHA-256)."""
    table = table.cast(schema)
    if plan_digest is not None:
        schema = schema.with_metadata({**(schema.metadata or {}), PLAN_DIGEST_KEY: plan_digest.encode()})
    step = table.column(S.STEP).to_numpy()
    ranks = table.column(S.RANK).to_numpy()
    if len(ranks) and (ranks != rank).any():
        raise ValueError(f"write_rank({rank}): the table holds rows of other ranks")
    counts = np.bincount(step, minlength=num_steps) if len(step) else np.zeros(num_steps, np.int64)
    if len(counts) != num_steps or (counts == 0).any():
        raise ValueError(f"write_rank({rank}): steps must cover 0..{num_steps - 1} with rows in each")
    rel = rank_file_path(rank)
    ends = np.cumsum(counts)
    tokens = _step_tokens(step, pc.list_value_length(table.column(S.ITEM_IDS)), num_steps)
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema, **rank_file_options(schema)) as w:
        _write_whole_steps(w, table, ends)
    n = table.num_rows
    del table
    data = sink.getvalue()
    output = fsio.normalize(output)
    if fsio.is_remote(output):
        fsio.write_bytes(fsio.join(output, rel), data)
    else:
        out = Path(output)
        (out / rank_dir_name(rank)).mkdir(exist_ok=True)
        with open(out / rel, "wb") as f:
            f.write(memoryview(data))
    return FileEntry(rank=rank, path=rel, num_rows=n, num_bytes=data.size, sha256=hashlib.sha256(data).hexdigest(),
                     step_tokens=tokens)


def _step_tokens(step: np.ndarray, lengths, num_steps: int) -> np.ndarray:
    """History tokens per step of one rank: ``sum(len(item_ids))`` over the rows of each step;
    shape ``[num_steps]`` int64 (exact: integer sums)."""
    if not len(step):
        return np.zeros(num_steps, dtype=np.int64)
    lengths = lengths.to_numpy(zero_copy_only=False) if hasattr(lengths, "to_numpy") else lengths
    # float64 sums of integers stay exact below 2**53 tokens per step
    return np.bincount(np.asarray(step, dtype=np.int64), weights=np.asarray(lengths, dtype=np.float64),
                       minlength=num_steps).astype(np.int64)


def rank_step_tokens(path: str | os.PathLike, num_steps: int) -> np.ndarray:
    """History tokens per step of a written rank file (``step`` and the ``item_ids`` lengths, read
    one row group at a time); shape ``[num_steps]`` int64.

    Raises:
        InputError: the file is unreadable.
    """
    out = np.zeros(num_steps, dtype=np.int64)
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        pf = pq.ParquetFile(where, filesystem=fs)
        for g in range(pf.metadata.num_row_groups):
            t = pf.read_row_group(g, columns=[S.STEP, S.ITEM_IDS])
            out += _step_tokens(t.column(S.STEP).to_numpy(), pc.list_value_length(t.column(S.ITEM_IDS)), num_steps)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: cannot read the rank file ({str(e).splitlines()[0]}); "
                         "rerun 'fsdata write'") from None
    return out


def _write_whole_steps(w: pq.ParquetWriter, table: pa.Table, ends: np.ndarray) -> None:
    """Write ``table`` (sorted by step; ``ends`` = cumulative rows per step) in row groups of whole
    steps: each ends at the first step end at or past :data:`ROW_GROUP_ROWS` rows."""
    start = 0
    while start < table.num_rows:
        j = int(np.searchsorted(ends, start + ROW_GROUP_ROWS, side="left"))
        stop = int(ends[min(j, len(ends) - 1)])
        w.write_table(table.slice(start, stop - start), row_group_size=stop - start)
        start = stop

