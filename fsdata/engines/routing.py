"""The write stage's routing, shared by both engines: check a record batch of input rows against
the plan and cast it to the rank-file schema (:func:`input_columns`); hold 64-bit integer columns
whose values fit as 32-bit ones (:func:`narrow_types`); split rows by rank group in destination
order (:func:`route_by_destination`: the local engine's in-memory and spilled groups, the Ray
engine's object-store pieces); and gather a rank group's rows into rank files with one permutation
from the plan, no sort (:func:`group_writer`), so both engines write the same bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.errors import InputError
from fsdata.samples import schema as S
from fsdata.samples.io import SampleSource, row_groups_from, skip_rows
from fsdata.shards import writer
from fsdata.shards.manifest import FileEntry
from fsdata.shards.writer import check_seq_len


def rows_differ(path: str) -> InputError:
    """The error of input rows that are not the plan's (another input, or the file changed)."""
    return InputError(f"input file {path}: rows differ from the plan's sample_id order; the plan "
                      "was made from another input: rerun 'fsdata plan' on this input")


def input_columns(batch: pa.RecordBatch, schema: pa.Schema, path: str, *, expected_ids: np.ndarray | None,
                  has_seq_len: bool) -> list[pa.Array]:
    """Check one record batch of input rows and cast its columns to the rank-file schema.

    Args:
        batch: input rows, contract-named or not (columns in file order).
        schema: the rank-file schema (:func:`fsdata.shards.writer.output_schema`; it ends with
            ``step`` and ``rank``).
        path: the input file, for the error.
        expected_ids: shape ``[n]`` int64, the plan's ``sample_id`` of these rows (shorter when the
            plan ends before them); None: not checked (the plan was made from this very read).
        has_seq_len: check ``seq_len`` against ``len(item_ids)``.

    Returns:
        The batch's input columns, cast to the schema's types (``len(schema) - 2`` arrays).

    Raises:
        InputError: the rows are not the plan's, or ``seq_len`` differs from ``len(item_ids)``.
    """
    if expected_ids is not None:
        sid = batch.column(schema.get_field_index(S.SAMPLE_ID)).to_numpy(zero_copy_only=False)
        if len(expected_ids) != batch.num_rows or not np.array_equal(sid.astype(np.int64), expected_ids):
            raise rows_differ(path)
    if has_seq_len:
        check_seq_len(batch, schema, path)
    return [batch.column(i).cast(schema.field(i).type) for i in range(len(schema) - 2)]


#: Name of the held column with each row's destination (:func:`destinations`).
DESTINATION = "__fsdata_destination"


def rank_step_starts(counts: np.ndarray) -> np.ndarray:
    """First row of every (rank, step) in the concatenation of the rank files (rank 0's rows by
    step, then rank 1's, ...).

    Args:
        counts: shape ``[S x R]``, the plan's samples per (step, rank).

    Returns:
        Shape ``[R*S + 1]`` int64: entry ``r*S + s`` is the first row of rank ``r``'s step ``s``,
        the last the total; every ``S``-th entry is a rank's first row.
    """
    by_rank = np.ascontiguousarray(counts.T, dtype=np.int64).ravel()  # (rank, step) order
    starts = np.zeros(len(by_rank) + 1, dtype=np.int64)
    np.cumsum(by_rank, out=starts[1:])
    return starts


def rank_starts(starts: np.ndarray, num_steps: int, num_ranks: int) -> np.ndarray:
    """The first row of every rank in the concatenation of the rank files, then the total: shape
    ``[R+1]`` int64, every ``S``-th entry of :func:`rank_step_starts`."""
    return starts[::num_steps] if num_steps else np.zeros(num_ranks + 1, dtype=np.int64)


def destinations(starts: np.ndarray, num_steps: int, step: np.ndarray, rank: np.ndarray,
                 position: np.ndarray) -> np.ndarray:
    """Each plan entry's row in the concatenation of the rank files (inside a rank by step, then position).

    Args:
        starts: :func:`rank_step_starts` of the plan's counts.
        num_steps: S.
        step, rank, position: shape ``[n]``, the plan's entries (step -1: dropped).

    Returns:
        Shape ``[n]`` int64, -1 for a dropped entry.
    """
    dest = np.full(len(step), -1, dtype=np.int64)
    kept = step >= 0
    dest[kept] = starts[rank[kept].astype(np.int64) * num_steps + step[kept]] + position[kept]
    return dest


def footers(src: SampleSource) -> list[tuple[str, pq.ColumnChunkMetaData]]:
    """Every row group's column chunks of the input, from the Parquet footers only (one read of
    each footer, shared by :func:`narrow_types` and :func:`held_row_bytes`):
    ``(top-level column name after --columns, ColumnChunkMetaData)`` per chunk; only the row groups
    that hold rows read (``src.row_starts``) and the columns read (not ``src.drop_columns``)."""
    out = []
    for i, path in enumerate(src.files):
        fs, where = fsio.filesystem_and_path(path)
        md = pq.ParquetFile(where, filesystem=fs).metadata
        for g in row_groups_from(md, 0 if src.row_starts is None else src.row_starts[i]):
            rg = md.row_group(g)
            for j in range(rg.num_columns):
                c = rg.column(j)
                top = c.path_in_schema.split(".")[0]
                if top not in src.drop_columns:
                    out.append((src.rename.get(top, top), c))
    return out


def leaf_type(t: pa.DataType) -> pa.DataType:
    """The value type of a list type, else ``t`` itself."""
    return t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else t


def narrow_types(footers: list, schema: pa.Schema) -> dict[str, pa.DataType]:
    """The input columns the write stage holds and spills as 32-bit integers: 64-bit integer
    columns (or lists of them) whose values all lie in int32's range by the Parquet footers'
    statistics (a column without statistics in some row group is kept as it is). Cast back to
    the schema's type before a rank file is encoded, so the output does not change; the held and
    spilled rows take about half the bytes (docs/results/bench_offline_stage.md)."""
    lo: dict[str, int] = {}
    hi: dict[str, int] = {}
    bad: set[str] = set()
    for name, c in footers:
        st = c.statistics
        if st is None or not st.has_min_max or not isinstance(st.min, int):
            bad.add(name)
            continue
        lo[name] = min(lo.get(name, st.min), st.min)
        hi[name] = max(hi.get(name, st.max), st.max)
    out = {}
    for f in schema:
        leaf = leaf_type(f.type)
        if (f.name in lo and f.name not in bad and pa.types.is_int64(leaf)
                and -(2**31) <= lo[f.name] and hi[f.name] < 2**31):
            out[f.name] = pa.list_(pa.int32()) if leaf is not f.type else pa.int32()
    return out


def held_schema(schema: pa.Schema, narrow: dict[str, pa.DataType], num_destinations: int) -> pa.Schema:
    """The schema rows are held and moved in by the write stage: the rank-file schema's input
    columns (without ``step`` and ``rank``), narrowed by ``narrow`` (:func:`narrow_types`), then
    :data:`DESTINATION` (int32 when ``num_destinations`` < 2**31, else int64)."""
    return pa.schema([pa.field(f.name, narrow.get(f.name, f.type)) for f in list(schema)[:-2]]
                     + [pa.field(DESTINATION, pa.int32() if num_destinations < 2**31 else pa.int64())])


def held_row_bytes(footers: list, num_rows: int, schema: pa.Schema, narrow: dict[str, pa.DataType]) -> float:
    """Mean bytes per input row as the write stage holds it (Arrow, in memory), from the Parquet
    footers only: values x width per fixed-width leaf column (4 for a narrowed one) plus 4-byte
    list offsets, else the column's uncompressed size; plus the 4- or 8-byte destination."""
    total = 0
    for name, c in footers:
        t = narrow.get(name, schema.field(name).type if name in schema.names else None)
        leaf = leaf_type(t) if t is not None else None
        width = leaf.bit_width // 8 if leaf is not None and pa.types.is_primitive(leaf) and leaf.bit_width >= 8 else 0
        total += c.num_values * width if width else c.total_uncompressed_size
    rows = max(num_rows, 1)
    lists = sum(1 for f in schema if leaf_type(f.type) is not f.type)
    return total / rows + 4 * lists + 8


def open_parquet(path: str) -> pq.ParquetFile:
    """One input file (a local file memory-mapped: measured at less CPU than ``pq.read_table`` and
    than Polars' batches for list columns)."""
    fs, where = fsio.filesystem_and_path(path)
    return pq.ParquetFile(where, memory_map=True) if fs is None else pq.ParquetFile(where, filesystem=fs)


def route_by_destination(columns: list, held_schema: pa.Schema, dest: np.ndarray,
                         group_start: np.ndarray) -> list[pa.Table | None]:
    """One record batch's kept rows, split by rank group, each group's rows sorted by destination.

    Args:
        columns: the batch's input columns in ``held_schema`` order (without the destination).
        held_schema: the held/spilled schema (input columns, narrowed, then the destination).
        dest: shape ``[n]`` int64, each row's destination (:func:`_destinations`; -1: dropped).
        group_start: shape ``[G + 1]`` int64, the first destination of each rank group, then the total.

    Returns:
        ``G`` entries: group ``g``'s rows with their destination column, in destination order, or
        None when it has none. Each entry owns its buffers (one ``take`` per group: a slice would
        keep every group's rows alive with the first group's, which stays in memory). In
        destination order, the later gather into rank order reads each batch's rows forwards
        (at 2M rows: 0.47 CPU s against 0.99 in arrival order, docs/results/bench_offline_stage.md).
        Integer and integer-list columns are gathered by Polars (about 0.4x the CPU of Arrow's
        ``take`` on these rows, docs/results/bench_offline_stage.md, issue 39), others by Arrow:
        the same values either way.
    """
    order = np.argsort(dest)
    order = order[np.searchsorted(dest[order], 0, side="left"):]  # without the dropped rows
    d = dest[order]
    cuts = np.searchsorted(d, group_start, side="left")
    dtype = held_schema.field(DESTINATION).type
    out: list[pa.Table | None] = []
    base = pa.Table.from_arrays(columns, names=held_schema.names[:-1])
    input_schema = pa.schema(list(held_schema)[:-1])
    simple = all(pa.types.is_integer(leaf_type(t)) for t in base.schema.types)
    source = pl.from_arrow(base, rechunk=False) if simple else base
    for g in range(len(group_start) - 1):
        if cuts[g + 1] <= cuts[g]:
            out.append(None)
            continue
        sel = order[cuts[g]:cuts[g + 1]]
        # Polars hands lists back as large lists: the cast makes the held types again (offsets only)
        piece = source[sel].to_arrow().cast(input_schema) if simple else base.take(pa.array(sel))
        out.append(piece.append_column(held_schema.field(DESTINATION), pa.array(d[cuts[g]:cuts[g + 1]], type=dtype)))
    return out


def group_writer(batches: list[pa.Table], ranks: tuple[int, int], rank_start: np.ndarray, counts: np.ndarray,
                 num_steps: int, out: Path | str, schema: pa.Schema, digest: str):
    """Prepare the rank files of ranks ``ranks[0] .. ranks[1]-1`` from their rows: one permutation
    into (rank, step, position) order from the destinations (no sort).

    Args:
        batches: the group's rows in any order, in the held schema (input columns, narrowed, then
            :data:`DESTINATION`); emptied (the rows then live in the returned function).
        ranks: ``(a, b)``, the group's first rank and one past its last.
        rank_start: shape ``[R+1]`` int64, the first destination of every rank, then the total.
        counts: shape ``[S x R]``, the plan's samples per (step, rank).
        num_steps: S.
        out: the OUTPUT folder (or URI prefix).
        schema: the rank-file schema (:func:`fsdata.shards.writer.output_schema`).
        digest: the plan digest recorded in every rank file.

    Returns:
        A function of a block of ranks ``(i, j)`` inside ``(a, b)`` that gathers the block's rows at
        once (callers cut blocks of about :data:`fsdata.engines.local.GATHER_BLOCK_ROWS` rows with
        :func:`rank_blocks`), casts them back to the rank-file types, adds each rank's ``step``
        and ``rank`` columns, writes every rank file with :func:`fsdata.shards.writer.write_rank`
        and returns their :class:`~fsdata.shards.manifest.FileEntry` records, by rank.

    Raises:
        AssertionError: the group received another number of rows than the plan gives it.
    """
    a, b = ranks
    base = int(rank_start[a])
    table = pa.concat_tables(batches)
    batches.clear()
    d = table.column(DESTINATION).to_numpy().astype(np.int64, copy=False)
    if len(d) != rank_start[b] - base:
        raise AssertionError(f"ranks {a}..{b - 1} received {len(d)} rows, the plan gives {rank_start[b] - base}")
    perm = np.empty(len(d), dtype=np.int64)  # perm[i]: the table row of output row base + i
    perm[d - base] = np.arange(len(d), dtype=np.int64)
    table = table.drop_columns([DESTINATION])
    input_schema = pa.schema(list(schema)[:-2])
    steps = np.arange(num_steps, dtype=np.int32)

    # Polars' gather takes about half the CPU of Arrow's take on list columns (measured); used for
    # integer and integer-list columns, which it hands back with the same values
    simple = all(pa.types.is_integer(leaf_type(t)) for t in table.schema.types)
    # Polars gathers from the chunks as read (no combined copy of the group: less memory and CPU,
    # docs/results/bench_offline_stage.md); Arrow's take from one combined table
    source = pl.from_arrow(table, rechunk=False) if simple else table.combine_chunks()
    del table

    def block(ranks: tuple[int, int]) -> list[FileEntry]:
        i, j = ranks
        lo = int(rank_start[i]) - base
        idx = perm[lo:int(rank_start[j]) - base]
        rows = source[idx].to_arrow() if simple else source.take(pa.array(idx))
        rows = rows.cast(input_schema)  # narrowed columns back to 64 bits: the same values
        files = []
        for r in range(i, j):
            part = rows.slice(int(rank_start[r]) - base - lo, int(rank_start[r + 1] - rank_start[r]))
            step = np.repeat(steps, counts[:, r])
            part = part.append_column(schema.field(S.STEP), pa.array(step, type=pa.int32()))
            part = part.append_column(schema.field(S.RANK), pa.array(np.full(len(step), r, dtype=np.int32)))
            files.append(writer.write_rank(r, part, out, schema, num_steps, plan_digest=digest, sorted_rows=True))
        return files

    return block


def rank_blocks(rank_start: np.ndarray, a: int, b: int, rows: int) -> list[tuple[int, int]]:
    """Consecutive rank ranges ``[i, j)`` covering ``[a, b)``, each of at least ``rows`` rows
    (whole ranks; the last one may hold fewer)."""
    blocks, i = [], a
    while i < b:
        j = int(np.searchsorted(rank_start, rank_start[i] + rows, side="left"))
        j = min(max(j, i + 1), b)
        blocks.append((i, j))
        i = j
    return blocks


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """A run of whole row groups of one input file: the unit of the Ray engine's
    lengths and partition tasks and of the local engine's gather threads.

    Attributes:
        path: the input file (local path or URI).
        row_groups: row-group indices, consecutive.
        offset: global input-row index of the chunk's first row (input order = file order, then row order).
        num_rows: rows in the chunk (without the ``skip`` ones).
        skip: rows of the first row group not read (a file read from a row on, ``SampleSource.row_starts``).
        columns: the file columns read (None: every one; ``SampleSource.file_columns``).
    """

    path: str
    row_groups: tuple[int, ...]
    offset: int
    num_rows: int
    skip: int = 0
    columns: tuple[str, ...] | None = None


def chunk_batches(chunk: Chunk, batch_size: int):
    """Record batches of a chunk's rows (``chunk.columns``, without its ``skip`` rows), in order.

    Raises:
        pyarrow.ArrowException, OSError: the file fails to read.
    """
    columns = None if chunk.columns is None else list(chunk.columns)
    yield from skip_rows(open_parquet(chunk.path).iter_batches(batch_size=batch_size, row_groups=list(chunk.row_groups),
                                                               columns=columns, use_threads=False), chunk.skip)


def row_group_chunks(files: list[str], chunk_rows: int, *, row_starts: list[int] | None = None,
                     columns: list[str] | None = None) -> list[Chunk]:
    """Cut the input into chunks of whole row groups of one file, about ``chunk_rows`` rows each
    (footers only; empty row groups are skipped). With ``row_starts`` (per file, the first row
    read) the rows before it are left out: row groups wholly before it, and the first ``skip``
    rows of the one it falls in. ``columns``: the file columns the chunks read (None: all).

    Raises:
        InputError: a file's footer cannot be read.
    """
    chunks: list[Chunk] = []
    offset = 0
    cols = None if columns is None else tuple(columns)
    for i, path in enumerate(files):
        fs, inner = fsio.resolve_fs(path)
        try:
            with fs.open_input_file(inner) as f:
                meta = pq.ParquetFile(f).metadata
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"input file {path} is not readable Parquet ({str(e).splitlines()[0]}); "
                             "it is corrupt or truncated: regenerate it") from None
        groups: list[int] = []
        rows = skip = 0
        left = 0 if row_starts is None else row_starts[i]  # rows still to leave out of this file
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if left and left >= n:  # a row group wholly before the first row read
                left -= n
                continue
            if not groups:
                skip = left
            groups.append(rg)
            rows += n - left
            left = 0
            if rows >= chunk_rows or rg == meta.num_row_groups - 1:
                if rows:
                    chunks.append(Chunk(path=path, row_groups=tuple(groups), offset=offset, num_rows=rows, skip=skip,
                                        columns=cols))
                offset += rows
                groups, rows, skip = [], 0, 0
    return chunks


def source_chunks(src: SampleSource, chunk_rows: int) -> list[Chunk]:
    """:func:`row_group_chunks` of a source's rows read (``src.row_starts``, ``src.file_columns``)."""
    return row_group_chunks(src.files, chunk_rows, row_starts=src.row_starts, columns=src.file_columns)


