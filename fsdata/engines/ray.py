"""The Ray engine of ``fsdata balance``: the stages as Ray tasks, byte-identical to the local engine.

Stages (docs/cluster.md has the commands and what runs where):

1. **lengths** (Ray tasks, one per *chunk* = a run of whole row groups of one input file, about
   :data:`CHUNK_ROWS` rows): read ``sample_id`` and the sequence length (``seq_len`` when present,
   else ``len(item_ids)``) plus the validation counts (nulls, empty histories, misaligned
   ``timestamps``). The driver gathers ``sample_id`` and length for every row (16 bytes per
   sample) and raises the local engine's errors, word for word.
2. **plan** (driver): :func:`fsdata.balancer.plan.make_plan` on the gathered costs, exactly as the local
   engine does (same seed, same global permutation, same partitioner), wrapped as a
   :class:`~fsdata.shards.writer.PlanTable`. This is the central part; its memory is O(N) today (see
   docs/cluster.md, "Scaling", for the windowed plan that bounds it per window of steps).
3. **partition** (Ray tasks, one per chunk): read the chunk's rows, check they are the plan's rows
   (``sample_id`` in plan order), cast to the rank-file schema, attach ``step``, ``rank`` and
   ``position`` from the plan, and split the rows into ``G`` *rank groups* (contiguous rank
   ranges): ``G`` objects per task in the Ray object store (spilled to disk by Ray when full;
   ``--bucket-compression lz4|zstd`` stores them as compressed Arrow IPC, as the local engine's
   temporary buckets).
4. **write** (Ray tasks, one per rank group): gather the group's pieces from every chunk and call
   :func:`fsdata.shards.writer.write_rank` once per rank, the same function the local engine calls, so
   the rank files are byte-identical (whole-step row groups, zstd, statistics).
5. **verify** (Ray tasks, one per rank group): re-read each written file's ``step`` column and
   bytes: rows ordered by step, the plan's count per step, the SHA-256 returned by the writer.
6. **finalize** (driver): :func:`fsdata.shards.writer.finalize` writes ``_step_stats.parquet``,
   ``_dropped.parquet`` and, last, ``_manifest.json`` from the plan and the writers' records.

The OUTPUT (and its temporary sibling) must be on storage every node sees: a shared file system,
or an object store named by a URI (``s3://bucket/prefix``; :mod:`fsdata.fsio`), which the write and
verify tasks reach through :mod:`pyarrow.fs` (then published as :mod:`fsdata.atomic` describes for
object stores). The input is read through :mod:`pyarrow.fs` too (``FileSystem.from_uri`` for URIs).
Nothing is written when any stage fails: the temporary folder (or the written prefix) is removed
and pending tasks are cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.samples import schema as S
from fsdata.errors import ConfigError, FsdataError, InputError, setting

log = logging.getLogger("fsdata.engines.ray")

#: Target rows per chunk (a run of whole row groups of one file) read by one lengths/partition task.
CHUNK_ROWS = 262_144
#: Target rows per rank group (the rows one write task holds at once).
GROUP_ROWS = 262_144
#: Rows per record batch when a partition task streams a chunk.
BATCH_ROWS = 32_768


def _ray():
    try:
        import ray  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise ConfigError("--engine ray needs Ray: pip install 'freescale[ray]' (or pip install 'ray[data]')") from None
    return ray


def filesystem_and_path(path: str) -> tuple[pafs.FileSystem, str]:
    """The :mod:`pyarrow.fs` filesystem of ``path`` and the path inside it.

    ``scheme://...`` goes through :meth:`pyarrow.fs.FileSystem.from_uri` (``s3://``, ``gs://``,
    ``hdfs://``; resolved once per file system, :func:`fsdata.fsio.resolve_fs`); anything else,
    and ``file://``, is a local path.
    """
    return fsio.resolve_fs(path)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """A run of whole row groups of one input file: the unit of the lengths and partition tasks.

    Attributes:
        path: the input file (local path or URI).
        row_groups: row-group indices, consecutive.
        offset: global input-row index of the chunk's first row (input order = file order, then row order).
        num_rows: rows in the chunk.
    """

    path: str
    row_groups: tuple[int, ...]
    offset: int
    num_rows: int


def make_chunks(files: list[str], chunk_rows: int | None = None) -> list[Chunk]:
    """Cut the input into chunks of whole row groups, about ``chunk_rows`` rows each (default
    :data:`CHUNK_ROWS`; footers only).

    Raises:
        InputError: a file's footer cannot be read.
    """
    chunk_rows = chunk_rows or CHUNK_ROWS
    chunks: list[Chunk] = []
    offset = 0
    for path in files:
        fs, inner = filesystem_and_path(path)
        try:
            with fs.open_input_file(inner) as f:
                meta = pq.ParquetFile(f).metadata
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"input file {path} is not readable Parquet ({str(e).splitlines()[0]}); "
                             "it is corrupt or truncated: regenerate it") from None
        groups: list[int] = []
        rows = 0
        for rg in range(meta.num_row_groups):
            groups.append(rg)
            rows += meta.row_group(rg).num_rows
            if rows >= chunk_rows or rg == meta.num_row_groups - 1:
                if rows:
                    chunks.append(Chunk(path=path, row_groups=tuple(groups), offset=offset, num_rows=rows))
                offset += rows
                groups, rows = [], 0
    return chunks


def _open_chunk(chunk: Chunk) -> pq.ParquetFile:
    fs, inner = filesystem_and_path(chunk.path)
    return pq.ParquetFile(fs.open_input_file(inner))


def _unknown_null_columns(meta: pq.FileMetaData, row_groups: tuple[int, ...], rename: dict[str, str]) -> set[str]:
    """Contract-named columns whose null count the footer does not prove to be 0 in these row groups
    (the rule of :meth:`fsdata.samples.io.SampleSource._null_counts`)."""
    unknown: set[str] = set()
    for rg in row_groups:
        group = meta.row_group(rg)
        for j in range(group.num_columns):
            col = group.column(j)
            top = col.path_in_schema.split(".")[0]
            st = col.statistics
            if st is None or not st.has_null_count or st.null_count:
                unknown.add(rename.get(top, top))
    return unknown


def _lengths_task(chunk: Chunk, rename: dict[str, str], has_seq_len: bool, has_timestamps: bool) -> dict:
    """Lengths and validation counts of one chunk (runs as a Ray task).

    Returns:
        ``{"ids": int64 [n], "lengths": int64 [n], "nulls": {column: count}, "tlen_mismatch": int}``.
    """
    theirs = {v: k for k, v in rename.items()}
    name = lambda c: theirs.get(c, c)  # noqa: E731
    try:
        pf = _open_chunk(chunk)
        unknown = _unknown_null_columns(pf.metadata, chunk.row_groups, rename)
        want = {S.SAMPLE_ID, S.SEQ_LEN if has_seq_len else S.ITEM_IDS} | unknown
        if has_timestamps:
            want |= {S.TIMESTAMPS, S.ITEM_IDS} if not has_seq_len else {S.TIMESTAMPS}
        t = pf.read_row_groups(list(chunk.row_groups), columns=[name(c) for c in sorted(want)])
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
    return {"ids": ids, "lengths": lengths, "nulls": nulls, "tlen_mismatch": tlen_mismatch, "node": _node_id()}


def _check_lengths(src, parts: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the chunks' lengths and ids and raise the local engine's errors (same words as
    :meth:`fsdata.samples.io.SampleSource.lengths_and_ids`)."""
    from fsdata.samples.io import check_lengths_and_ids  # noqa: PLC0415

    nulls = {c: 0 for c in src.columns}
    for p in parts:
        for c, n in p["nulls"].items():
            nulls[c] = nulls.get(c, 0) + n
    lengths = np.concatenate([p["lengths"] for p in parts])
    ids = np.concatenate([p["ids"] for p in parts])
    check_lengths_and_ids(src.path, lengths, ids, nulls=nulls,
                          timestamp_mismatches=sum(p["tlen_mismatch"] for p in parts))
    return lengths, ids


# ---- windowed planning (fixed policy): the central part holds one window's worth, never N rows ----

#: Rows per duplicate-``sample_id`` bucket task (ids are routed to buckets by a hash of the id).
ID_BUCKET_ROWS = 4_000_000


def _id_bucket(ids: np.ndarray, num_buckets: int) -> np.ndarray:
    """Bucket of each ``sample_id`` (SplitMix64 of the id, modulo ``num_buckets``): equal ids meet."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(num_buckets)).astype(np.int64)


def _windowed_lengths_task(chunk: Chunk, rename: dict[str, str], has_seq_len: bool, has_timestamps: bool,
                           cost_model, layout, seed: int, num_id_buckets: int) -> list:
    """Lengths, costs and shuffled positions of one chunk, routed to plan windows (a Ray task with
    ``num_returns = 1 + num_windows + num_id_buckets``).

    Returns:
        ``[stats, *window_pieces, *id_pieces]``: ``stats`` holds the validation counts (``nulls``,
        ``num_empty``, ``tlen_mismatch``), ``node``, and the dropped rows (``dropped_rows``,
        ``dropped_ids``: positions past the last whole step); window piece ``w``:
        ``(positions int64, costs float64, rows int64)`` of the chunk's rows in plan window ``w``;
        id piece ``b``: the chunk's ``sample_id`` values in duplicate bucket ``b``.
    """
    from fsdata.balancer.order import shuffled_positions  # noqa: PLC0415

    part = _lengths_task(chunk, rename, has_seq_len, has_timestamps)
    lengths, ids = part["lengths"], part["ids"]
    rows = chunk.offset + np.arange(len(ids), dtype=np.int64)
    costs = cost_model.cost(lengths)  # the driver's CostModel (a calibrated JSON need not exist on the node)
    pos = shuffled_positions(rows, layout.num_samples, seed)
    dropped = pos >= layout.num_steps * layout.per_step
    stats = {"nulls": part["nulls"], "num_empty": int((lengths == 0).sum()), "tlen_mismatch": part["tlen_mismatch"],
             "node": part["node"], "dropped_rows": rows[dropped], "dropped_ids": ids[dropped]}
    win = layout.window_of(pos)
    order = np.argsort(win, kind="stable")
    cuts = np.searchsorted(win[order], np.arange(layout.num_windows + 1), side="left")
    windows = [(pos[o], costs[o], rows[o]) for o in (order[cuts[w]:cuts[w + 1]] for w in range(layout.num_windows))]
    bucket = _id_bucket(ids, num_id_buckets)
    border = np.argsort(bucket, kind="stable")
    bcuts = np.searchsorted(bucket[border], np.arange(num_id_buckets + 1), side="left")
    id_pieces = [ids[border[bcuts[b]:bcuts[b + 1]]] for b in range(num_id_buckets)]
    return [stats, *windows, *id_pieces]


def _duplicates_task(*pieces: np.ndarray) -> int:
    """Repeated ``sample_id`` values in one bucket (runs as a Ray task): ``n - distinct``."""
    from fsdata.samples.io import sorted_unique  # noqa: PLC0415

    ids = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
    return int(sorted_unique(ids)[1]) if len(ids) else 0


def _plan_window_task(window: int, layout, seed: int, strategy: str, partitioner: str, chunk_starts: np.ndarray,
                      *pieces: tuple) -> list:
    """Plan one window of steps from its samples (a Ray task with ``num_returns = 1 + num_chunks``):
    :func:`fsdata.balancer.plan.plan_one_window`, the function the local engine calls per window.

    Args:
        window: w.
        layout: the run's :class:`~fsdata.balancer.plan.PlanLayout`.
        seed, strategy, partitioner: the run's settings.
        chunk_starts: shape ``[C+1]``, first input row of every chunk, then N.
        pieces: ``(positions, costs, rows)`` of the window's rows from every chunk.

    Returns:
        ``[summary, *chunk_pieces]``: the :meth:`~fsdata.balancer.plan.WindowPlan.summary` and, per
        chunk, ``(rows, step, rank, position)`` of the chunk's rows in this window.
    """
    from fsdata.balancer.plan import plan_one_window  # noqa: PLC0415

    pos = np.concatenate([p[0] for p in pieces])
    costs = np.concatenate([p[1] for p in pieces])
    rows = np.concatenate([p[2] for p in pieces])
    del pieces
    order = np.argsort(pos, kind="stable")
    p0, p1 = layout.window_positions(window)
    if len(order) != p1 - p0 or not np.array_equal(pos[order], np.arange(p0, p1)):
        raise AssertionError(f"plan window {window}: positions are not exactly {p0}..{p1 - 1}")
    wp = plan_one_window(costs[order], rows[order], window, layout, seed=seed, strategy=strategy,
                         partitioner=partitioner)
    del pos, costs, rows, order
    chunk_of = np.searchsorted(chunk_starts, wp.rows, side="right") - 1
    o = np.argsort(chunk_of, kind="stable")
    cuts = np.searchsorted(chunk_of[o], np.arange(len(chunk_starts)), side="left")
    out = [(wp.rows[i], wp.step[i], wp.rank[i], wp.position[i]) for i in (o[cuts[c]:cuts[c + 1]]
                                                                       for c in range(len(chunk_starts) - 1))]
    return [wp.summary(), *out]


def _partition_windowed_task(chunk: Chunk, schema: pa.Schema, rename: dict[str, str], has_seq_len: bool,
                             group_bounds: np.ndarray, compression: str | None, *plan_pieces: tuple) -> list:
    """:func:`_partition_task` with the chunk's plan gathered from every plan window's task.

    Raises:
        AssertionError: the windows do not cover every row of the chunk exactly once.
    """
    n = chunk.num_rows
    step = np.full(n, -2, dtype=np.int32)
    rank = np.full(n, -1, dtype=np.int32)
    position = np.full(n, -1, dtype=np.int32)
    covered = 0
    for rows, st, rk, ps in plan_pieces:
        i = rows - chunk.offset
        step[i], rank[i], position[i] = st, rk, ps
        covered += len(rows)
    if covered != n or (step == -2).any():
        raise AssertionError(f"chunk at row {chunk.offset}: plan windows cover {covered} of its {n} rows")
    del plan_pieces
    return _partition_task(chunk, schema, rename, has_seq_len, None, step, rank, position, group_bounds, compression)


def plan_windowed(ray, src, settings, chunks: list[Chunk], num_cpus: int, timings: dict | None = None):
    """Stage 1 on Ray without a central copy of the rows: lengths tasks route (position, cost, row)
    to plan windows, one task per window plans it, the driver combines the window summaries.

    Args:
        ray: the joined Ray module.
        src: the validated input (its row count from the footers).
        settings: :class:`~fsdata.shards.writer.BalanceSettings` (fixed policy or shuffle strategy).
        chunks: the input's chunks.
        num_cpus: the cluster's CPUs (sizes the duplicate-id buckets).
        timings: if given, filled with ``read_lengths`` and ``plan`` seconds.

    Returns:
        ``(table, chunk_plans, nodes)``: a :class:`~fsdata.shards.writer.PlanTable` holding the
        run's counts, loads, dropped ids and figures but no per-row arrays; per chunk, the object
        refs of its plan pieces (one per window); the Ray node ids that ran tasks.

    Raises:
        InputError: the local engine's input errors, word for word. ConfigError: impossible settings.
    """
    from fsdata.balancer.cost import load_cost_model  # noqa: PLC0415
    from fsdata.balancer.plan import Plan, check_policies, combine_windows, plan_layout  # noqa: PLC0415
    from fsdata.samples.io import check_input_counts  # noqa: PLC0415
    from fsdata.shards.writer import plan_table_from_plan  # noqa: PLC0415

    t0 = time.perf_counter()
    N, R, B = src.num_rows, settings.num_ranks, settings.batch_size_per_rank
    check_policies(settings.strategy, settings.batch_policy, settings.remainder)
    layout = plan_layout(N, R, B, compose=settings.strategy == "balanced" and settings.batch_policy == "fixed",
                         compose_window=settings.compose_window, plan_window=settings.plan_window)
    nw = layout.num_windows
    nb = max(num_cpus, -(-N // ID_BUCKET_ROWS))
    lengths_fn = ray.remote(num_cpus=1, num_returns=1 + nw + nb)(_windowed_lengths_task)
    cost_model = load_cost_model(settings.cost_model)
    outs = [lengths_fn.remote(c, src.rename, src.has_seq_len, src.has_timestamps, cost_model, layout,
                              settings.seed, nb) for c in chunks]
    stats = _get(ray, [o[0] for o in outs])
    nulls = {c: 0 for c in src.columns}
    for st in stats:
        for c, k in st["nulls"].items():
            nulls[c] = nulls.get(c, 0) + k
    dup_fn = ray.remote(num_cpus=1)(_duplicates_task)
    dups = _get(ray, [dup_fn.remote(*[o[1 + nw + b] for o in outs]) for b in range(nb)])
    check_input_counts(src.path, nulls=nulls, num_empty=sum(st["num_empty"] for st in stats),
                       timestamp_mismatches=sum(st["tlen_mismatch"] for st in stats), num_duplicate_ids=sum(dups))
    dropped_rows = np.concatenate([st["dropped_rows"] for st in stats])
    dropped_ids = np.concatenate([st["dropped_ids"] for st in stats])
    nodes = {st["node"] for st in stats}
    del stats
    if len(dropped_rows) and settings.remainder == "error":
        raise ConfigError(f"{len(dropped_rows)} samples do not fill a whole step of {R}x{B}; pass "
                          f"{setting('remainder', 'drop')} to record and drop them, or change "
                          f"{setting('num_ranks')}/{setting('batch_size_per_rank')}")
    t1 = time.perf_counter()
    chunk_starts = np.array([c.offset for c in chunks] + [N], dtype=np.int64)
    plan_fn = ray.remote(num_cpus=1, num_returns=1 + len(chunks))(_plan_window_task)
    planned = [plan_fn.remote(w, layout, settings.seed, settings.strategy, settings.partitioner, chunk_starts,
                              *[o[1 + w] for o in outs]) for w in range(nw)]
    del outs
    windows = _get(ray, [p[0] for p in planned])
    chunk_plans = [[p[1 + c] for p in planned] for c in range(len(chunks))]
    del planned
    totals = combine_windows(windows, layout, settings.compose_window)
    del windows
    o = np.argsort(dropped_rows, kind="stable")
    plan = Plan(num_ranks=R, batch_size_per_rank=B, num_steps=layout.num_steps, step=np.empty(0, np.int32),
                rank=np.empty(0, np.int32), order_key=np.empty(0, np.int64), dropped=dropped_rows[o],
                loads=totals.loads, counts=totals.counts, baseline_loads=totals.baseline_loads,
                lower_bound_bubble=totals.lower_bound_bubble, partition_info=totals.partition_info,
                lower_bound_bubble_simple=totals.lower_bound_bubble_simple, compose_window=layout.compose_window,
                compose_info=totals.compose_info, plan_window=layout.plan_window)
    if plan.counts.min() == 0:
        raise AssertionError("plan left a rank without samples in a step")
    table = plan_table_from_plan(src, plan, np.empty(0, np.int64), np.empty(0), cost_model,
                                 settings, num_samples=N, dropped_sample_id=dropped_ids[o])
    if timings is not None:
        timings.update(read_lengths=t1 - t0, plan=time.perf_counter() - t1)
    return table, chunk_plans, nodes


def _pack(table: pa.Table, compression: str | None) -> pa.Table | bytes:
    """A piece as it goes into the object store: the table itself, or Arrow IPC stream bytes
    compressed with ``compression`` (``lz4``/``zstd``: less object-store memory and spill)."""
    if compression is None:
        return table
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    return sink.getvalue()


def _unpack(piece: pa.Table | bytes | pa.Buffer) -> pa.Table:
    if isinstance(piece, pa.Table):
        return piece
    return pa.ipc.open_stream(pa.py_buffer(piece) if isinstance(piece, bytes) else piece).read_all()


def _node_id() -> str:
    """The Ray node this task runs on."""
    import ray  # noqa: PLC0415

    return ray.get_runtime_context().get_node_id()


def _partition_task(chunk: Chunk, schema: pa.Schema, rename: dict[str, str], has_seq_len: bool,
                    sample_id: np.ndarray, step: np.ndarray, rank: np.ndarray, position: np.ndarray,
                    group_bounds: np.ndarray, compression: str | None = None) -> list[pa.Table | bytes]:
    """Split one chunk's rows into rank groups (runs as a Ray task with ``num_returns=G``).

    Args:
        chunk: the rows to read.
        schema: the rank-file schema (:func:`fsdata.shards.writer.output_schema`).
        rename: ``{their_name: contract_name}``.
        has_seq_len: check ``seq_len`` against ``len(item_ids)`` as the local engine does.
        sample_id, step, rank, position: the plan's entries for the chunk's rows, shape ``[n]``
            (``sample_id`` None: the plan was made from this very read, nothing to check).
        group_bounds: shape ``[G+1]``, group ``g`` holds ranks ``group_bounds[g] .. group_bounds[g+1]-1``.
        compression: None, or ``lz4``/``zstd`` to store the pieces as compressed Arrow IPC.

    Returns:
        ``G`` tables (rank-file columns plus ``position``; IPC bytes when compressed), the chunk's
        rows of each group.
    """
    from fsdata.shards.writer import _POS, _check_seq_len  # noqa: PLC0415

    G = len(group_bounds) - 1
    n_in = len(schema) - 2  # input columns (the schema ends with step, rank)
    out_schema = schema.append(pa.field(_POS, pa.int32()))
    pieces: list[list[pa.RecordBatch]] = [[] for _ in range(G)]
    start = 0
    try:
        pf = _open_chunk(chunk)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=list(chunk.row_groups)):
            n = batch.num_rows
            sl = slice(start, start + n)
            start += n
            sid = batch.column(schema.get_field_index(S.SAMPLE_ID)).to_numpy(zero_copy_only=False)
            if start > len(step) or (sample_id is not None and not np.array_equal(sid.astype(np.int64), sample_id[sl])):
                raise InputError(f"input file {chunk.path}: rows differ from the plan's sample_id order; the plan "
                                 "was made from another input: rerun 'fsdata plan' on this input")
            r = rank[sl]
            order = np.argsort(r, kind="stable")
            order = order[r[order] >= 0]
            if not len(order):
                continue
            if has_seq_len:
                _check_seq_len(batch, schema, chunk.path)
            cols = [batch.column(i).cast(schema.field(i).type) for i in range(n_in)]
            cols += [pa.array(step[sl], type=pa.int32()), pa.array(r, type=pa.int32()),
                     pa.array(position[sl], type=pa.int32())]
            table = pa.RecordBatch.from_arrays(cols, schema=out_schema).take(pa.array(order))
            cuts = np.searchsorted(r[order], group_bounds, side="left")
            for g in range(G):
                if cuts[g + 1] > cuts[g]:
                    pieces[g].append(table.slice(cuts[g], cuts[g + 1] - cuts[g]))
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"input file {chunk.path}: cannot read rows ({str(e).splitlines()[0]}); "
                         "the file is corrupt or truncated: regenerate it") from None
    if start != chunk.num_rows:
        raise InputError(f"input file {chunk.path}: read {start} rows where its footer says {chunk.num_rows}; "
                         "the file changed while balancing: rerun")
    del rename
    out = [_pack(pa.Table.from_batches(p, schema=out_schema).combine_chunks(), compression) for p in pieces]
    return out if len(out) > 1 else out[0]  # one rank group: Ray's num_returns=1 stores the value itself


def _write_group_task(output: str, schema: pa.Schema, num_steps: int, ranks: tuple[int, int], plan_digest: str,
                      *pieces: pa.Table) -> list:
    """Write the rank files of ranks ``ranks[0] .. ranks[1]-1`` (runs as a Ray task).

    Args:
        output: the (temporary) OUTPUT folder on shared storage.
        schema: the rank-file schema.
        num_steps: S.
        ranks: ``(first, end)`` of the group.
        plan_digest: recorded in every rank file (:func:`fsdata.shards.writer.plan_digest`).
        pieces: the group's rows from every chunk (resolved from the object store by Ray).

    Returns:
        ``(entries, node)``: one :class:`~fsdata.shards.manifest.FileEntry` per rank of the group, by
        rank, and the Ray node id the task ran on.
    """
    from fsdata.shards.writer import _POS, write_rank  # noqa: PLC0415

    pieces = [t for t in map(_unpack, pieces) if t.num_rows]
    table = pa.concat_tables(pieces) if pieces else schema.append(pa.field(_POS, pa.int32())).empty_table()
    del pieces
    table = table.take(pc.sort_indices(table, sort_keys=[(S.RANK, "ascending")]))
    r = table.column(S.RANK).to_numpy()
    first, end = ranks
    cuts = np.searchsorted(r, np.arange(first, end + 1), side="left")
    entries = []
    for i, rank in enumerate(range(first, end)):
        entries.append(write_rank(rank, table.slice(cuts[i], cuts[i + 1] - cuts[i]), output, schema, num_steps,
                                  plan_digest=plan_digest))
    return entries, _node_id()


def _verify_group_task(output: str, entries: list, counts: np.ndarray) -> int:
    """Check a group's written files (runs as a Ray task): rows ordered by step, the plan's count per
    step, and the bytes' SHA-256 equal to the writer's.

    Args:
        output: the (temporary) OUTPUT folder.
        entries: the writers' :class:`~fsdata.shards.manifest.FileEntry` records of the group.
        counts: shape ``[S x len(entries)]``, the plan's samples per step of each rank.

    Returns:
        Rows checked.

    Raises:
        VerifyError: a violated invariant, naming the rank.
    """
    from fsdata.shards.manifest import sha256_file  # noqa: PLC0415
    from fsdata.errors import VerifyError  # noqa: PLC0415

    total = 0
    for i, e in enumerate(entries):
        path = fsio.join(output, e.path) if fsio.is_remote(output) else Path(output) / e.path
        fs, where = fsio.filesystem_and_path(str(path))
        step = pq.read_table(where, columns=[S.STEP], filesystem=fs).column(0).to_numpy()
        if len(step) and (np.diff(step) < 0).any():
            raise VerifyError(f"rank {e.rank}: rows of {path} are not ordered by step")
        got = np.bincount(step, minlength=len(counts))
        if len(got) != len(counts) or (got != counts[:, i]).any():
            raise VerifyError(f"rank {e.rank}: samples per step of {path} differ from the plan")
        if sha256_file(path) != e.sha256 or fsio.size(path) != e.num_bytes:
            raise VerifyError(f"rank {e.rank}: {path} changed after it was written")
        total += len(step)
    return total


def _unwrap(ray, fn):
    """Run ``fn``; a task that raised an :class:`FsdataError` re-raises that error (one clean line)."""
    try:
        return fn()
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, FsdataError):
            raise cause from None
        raise


def _get(ray, refs: list) -> list:
    """``ray.get`` that cancels the other pending tasks when one fails."""
    try:
        return _unwrap(ray, lambda: ray.get(refs))
    except BaseException:
        for ref in refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise


@contextlib.contextmanager
def ray_session(address: str | None = None, **init_kwargs) -> Iterator[object]:
    """Use the Ray instance this process already joined, else join ``address`` (or
    ``RAY_ADDRESS``), else start a local one; shut down only what this call started.

    Raises:
        ConfigError: Ray is not installed, or the cluster at ``address`` cannot be reached.
    """
    ray = _ray()
    if ray.is_initialized():
        yield ray
        return
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False, configure_logging=True, **init_kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = address or os.environ.get("RAY_ADDRESS") or "a local Ray instance"
        raise ConfigError(f"cannot start or join Ray at {where} ({str(e).splitlines()[0]}); start the cluster with "
                          "'ray start --head' and pass its address with --ray-address HOST:PORT") from None
    started = _our_processes()  # the raylet, GCS, agents and workers this call started
    try:
        yield ray
    finally:
        ray.shutdown()
        _end_leftovers(started)


def _our_processes() -> list:
    """This process's descendants (``psutil.Process``; empty when psutil is unavailable)."""
    try:
        import psutil  # noqa: PLC0415 (a Ray dependency)

        out = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ray" in " ".join(p.cmdline()).lower() or "ray" in p.name().lower():
                    out.append(p)
        return out
    except Exception:  # noqa: BLE001
        return []


def _end_leftovers(procs: list, grace_s: float = 5.0) -> None:
    """After ``ray.shutdown()``: wait for the Ray processes this run started, end any still running
    (SIGTERM, then SIGKILL), and log which; nothing of ours is left running after the job."""
    if not procs:
        return
    import psutil  # noqa: PLC0415

    procs = [p for p in procs + _our_processes() if p.is_running()]
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            log.warning("ending Ray process %d (%s) left after ray.shutdown()", p.pid, p.name())
            p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def group_bounds(num_ranks: int, rows_written: int, num_cpus: int, group_rows: int | None = None) -> np.ndarray:
    """Contiguous rank groups for the write tasks: at least ``num_cpus`` groups (when there are that
    many ranks) and about ``group_rows`` rows each (default :data:`GROUP_ROWS`); shape ``[G+1]``
    int64 rank boundaries."""
    group_rows = group_rows or GROUP_ROWS
    G = max(num_cpus, -(-rows_written // group_rows))
    G = max(1, min(num_ranks, G))
    return np.linspace(0, num_ranks, G + 1).round().astype(np.int64)


def write_ranks(src, plan, output: str | os.PathLike, settings, *, chunks: list[Chunk] | None = None,
                timings: dict | None = None, nodes: set | None = None, chunk_plans: list | None = None) -> list:
    """Stage 2 on Ray: the partition, write and verify tasks for every rank file of ``plan``
    (the counterpart of :func:`fsdata.shards.writer.write_ranks`; same files, byte for byte).

    Args:
        src: the validated input (:func:`fsdata.samples.io.open_samples`).
        plan: the :class:`~fsdata.shards.writer.PlanTable` of ``src``.
        output: an existing empty folder on storage every Ray node sees (OUTPUT's temporary), or
            an object-store URI (``s3://bucket/prefix``) every node can reach.
        settings: :class:`~fsdata.shards.writer.BalanceSettings` (``bucket_compression``, ``ray_address``).
        chunks: the input's chunks (default: :func:`make_chunks`).
        timings: if given, filled with ``write_ranks`` and ``verify`` seconds.
        nodes: if given, the ids of the Ray nodes that ran tasks are added to it.
        chunk_plans: per chunk, the object refs of its plan pieces from :func:`plan_windowed`
            (then ``plan`` holds no per-row arrays and this must run in the same Ray session).

    Returns:
        One :class:`~fsdata.shards.manifest.FileEntry` per rank, by rank.

    Raises:
        InputError: the input does not match the plan, or a file fails to read midway.
        VerifyError: a written file does not read back as the plan says.
    """
    from fsdata.shards.writer import output_schema, plan_digest  # noqa: PLC0415

    t0 = time.perf_counter()
    schema = output_schema(src)
    chunks = chunks if chunks is not None else make_chunks(src.files)
    if chunk_plans is None and sum(c.num_rows for c in chunks) != len(plan.sample_id):
        raise InputError(f"input {src.path} has {sum(c.num_rows for c in chunks)} rows but the plan has "
                         f"{len(plan.sample_id)}; the plan was made from another input: rerun 'fsdata plan' on this input")
    counts, _ = plan.counts_and_loads()
    output = fsio.normalize(output)
    out = output if fsio.is_remote(output) else str(Path(output).resolve())
    with ray_session(settings.ray_address) as ray:
        num_cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        bounds = group_bounds(plan.num_ranks, int(counts.sum()), num_cpus)
        G = len(bounds) - 1
        schema_ref = ray.put(schema)
        pieces = []
        if chunk_plans is not None:
            part_fn = ray.remote(num_cpus=1, num_returns=G)(_partition_windowed_task)
            for c, refs_c in zip(chunks, chunk_plans):
                refs = part_fn.remote(c, schema_ref, src.rename, src.has_seq_len, bounds, settings.bucket_compression,
                                      *refs_c)
                pieces.append([refs] if G == 1 else refs)
        else:
            part_fn = ray.remote(num_cpus=1, num_returns=G)(_partition_task)
            for c in chunks:
                sl = slice(c.offset, c.offset + c.num_rows)
                refs = part_fn.remote(c, schema_ref, src.rename, src.has_seq_len, plan.sample_id[sl], plan.step[sl],
                                      plan.rank[sl], plan.position[sl], bounds, settings.bucket_compression)
                pieces.append([refs] if G == 1 else refs)
        write_fn = ray.remote(num_cpus=1)(_write_group_task)
        digest = plan_digest(plan)
        write_refs = [write_fn.remote(out, schema_ref, plan.num_steps, (int(bounds[g]), int(bounds[g + 1])), digest,
                                      *[p[g] for p in pieces]) for g in range(G)]
        del pieces
        written = _get(ray, write_refs)
        groups = [g for g, _ in written]
        if nodes is not None:
            nodes |= {n for _, n in written}
        t1 = time.perf_counter()
        verify_fn = ray.remote(num_cpus=1)(_verify_group_task)
        _get(ray, [verify_fn.remote(out, groups[g], counts[:, bounds[g]:bounds[g + 1]]) for g in range(G)])
    if timings is not None:
        timings.update(write_ranks=t1 - t0, verify=time.perf_counter() - t1)
    log.info("ray engine: %d chunks, %d rank groups", len(chunks), G)
    return [e for g in groups for e in g]


def run(input: str | os.PathLike, output: str | os.PathLike, settings, *, timings: dict | None = None):
    """``fsdata balance --engine ray``: see the module docstring for the stages.

    Args:
        input: a Parquet file, a folder of Parquet files, or a glob.
        output: the OUTPUT folder (on storage every Ray node sees).
        settings: :class:`fsdata.shards.writer.BalanceSettings` (``ray_address`` picks the cluster).
        timings: if given, filled with seconds per stage (``ray_connect``: starting or joining Ray;
            ``read_lengths``, ``plan``, ``write_ranks``, ``verify``, ``finalize``).

    Returns:
        The written :class:`~fsdata.shards.manifest.Manifest`, byte-identical to the local engine's.

    Raises:
        InputError: bad input. ConfigError: impossible settings, OUTPUT exists without overwrite,
        Ray missing or unreachable.
    """
    from fsdata.atomic import atomic_output, output_taken  # noqa: PLC0415
    from fsdata.shards.writer import check_reserved_columns, finalize, output_schema, plan_table_from_plan  # noqa: PLC0415
    from fsdata.balancer.cost import load_cost_model  # noqa: PLC0415
    from fsdata.samples.io import open_samples  # noqa: PLC0415
    from fsdata.shards.writer import plan_costs  # noqa: PLC0415
    from fsdata.balancer.plan import check_settings  # noqa: PLC0415

    input, output = fsio.normalize(input), fsio.normalize(output)
    if output_taken(output) and not settings.overwrite:
        raise ConfigError(f"output {output} already exists and is not empty; choose a new path or pass "
                          f"{setting('overwrite', True)} to replace it")
    if settings.num_ranks < 1 or settings.batch_size_per_rank < 1:
        check_settings(settings.num_ranks * max(settings.batch_size_per_rank, 1), settings.num_ranks,
                       settings.batch_size_per_rank)
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    src = open_samples(input, settings.columns)
    check_reserved_columns(src)
    cost_model = load_cost_model(settings.cost_model)
    output_schema(src)
    tc = time.perf_counter()
    with ray_session(settings.ray_address) as ray:
        t0 += time.perf_counter() - tc  # read_lengths excludes starting or joining Ray (ray_connect)
        t["ray_connect"] = time.perf_counter() - tc
        chunks = make_chunks(src.files)
        chunk_plans = None
        windowed = settings.batch_policy == "fixed" or settings.strategy == "shuffle"
        if windowed:
            try:
                check_settings(src.num_rows, settings.num_ranks, settings.batch_size_per_rank)
            except InputError:
                windowed = False  # the central path raises the input's own errors first, as the local engine does
        if windowed:
            num_cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
            table, chunk_plans, nodes = plan_windowed(ray, src, settings, chunks, num_cpus, timings=t)
            t1 = t0 + t["read_lengths"]  # the stage seconds plan_windowed measured, kept as they are
            t2 = t1 + t["plan"]
        else:  # cost-budget plans the run as one sequence: central, O(N) (docs/cluster.md)
            lengths_fn = ray.remote(num_cpus=1)(_lengths_task)
            parts = _get(ray, [lengths_fn.remote(c, src.rename, src.has_seq_len, src.has_timestamps) for c in chunks])
            lengths, ids = _check_lengths(src, parts)
            nodes = {p["node"] for p in parts}
            del parts
            t1 = time.perf_counter()
            costs = cost_model.cost(lengths)
            del lengths
            plan = plan_costs(costs, settings)  # the local engine's planning call
            table = plan_table_from_plan(src, plan, ids, costs, cost_model, settings)
            del plan, ids, costs
            t2 = time.perf_counter()
        with atomic_output(output, overwrite=settings.overwrite) as tmp:
            records = write_ranks(src, table, tmp, settings, chunks=chunks, timings=t, nodes=nodes,
                                  chunk_plans=chunk_plans)
            t4 = time.perf_counter()
            m = finalize(tmp, table, records)
        t5 = time.perf_counter()
    m.path = str(output)
    t.update(read_lengths=t1 - t0, plan=t2 - t1, finalize=t5 - t4)
    t = {k: t[k] for k in ("ray_connect", "read_lengths", "plan", "write_ranks", "verify", "finalize")}
    if timings is not None:
        timings.update(t)
    log.info("ray engine: tasks ran on %d Ray nodes; stage seconds %s", len(nodes), t)
    return m
