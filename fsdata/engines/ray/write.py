"""The Ray engine's write stage (the counterpart of :func:`fsdata.engines.local.write_ranks`).

* **partition** (a task per chunk): read the chunk's rows, check them against the plan, hold them
  as the local engine does (64-bit integer columns that fit narrowed to 32 bits, with each row's
  destination in the concatenation of the rank files instead of its step, rank and position) and
  route them to ``G`` *rank groups* (contiguous rank ranges) in destination order
  (:mod:`fsdata.engines.routing`, the local engine's routing): ``G`` objects per task in the Ray
  object store (spilled to disk by Ray when full; ``--bucket-compression lz4|zstd`` stores them
  as compressed Arrow IPC).
* **write** (a task per rank group): gather the group's pieces from every chunk into rank order
  with one permutation from the plan (:func:`fsdata.engines.routing.group_writer`, the local
  engine's function, which calls :func:`fsdata.shards.writer.write_rank` once per rank), so the
  rank files are byte-identical.
* **verify** (a task per rank group): re-read each written file's ``step`` column and bytes: rows
  ordered by step, the plan's count per step, the SHA-256 returned by the writer.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.engines.ray.chunks import Chunk, make_chunks
from fsdata.engines.ray.session import get, node_id, ray_session
from fsdata.engines.local import GATHER_BLOCK_ROWS
from fsdata.engines.routing import (chunk_batches, destinations, footers, group_writer, held_row_bytes, held_schema,
                                    input_columns, narrow_types, rank_blocks, rank_starts, rank_step_starts,
                                    route_by_destination, rows_differ)
from fsdata.errors import InputError, VerifyError
from fsdata.samples import schema as S
from fsdata.shards.manifest import sha256_file
from fsdata.shards.plan_file import plan_digest
from fsdata.shards.writer import output_schema

log = logging.getLogger("fsdata.engines.ray")

#: Target rows per rank group (the rows one write task holds at once).
GROUP_ROWS = 1 << 20
#: Fraction of the cluster's object store the pieces may take uncompressed (:func:`piece_compression`).
STORE_FRACTION = 0.75
#: Rows per record batch when a partition task streams a chunk.
BATCH_ROWS = 65_536


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


def _partition_windowed_task(chunk: Chunk, schema: pa.Schema, held_schema: pa.Schema, has_seq_len: bool,
                             starts: np.ndarray, num_steps: int, group_start: np.ndarray, compression: str | None,
                             *plan_pieces: tuple) -> list:
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
    return _partition_task(chunk, schema, held_schema, has_seq_len, None, destinations(starts, num_steps, step, rank,
                                                                                       position),
                           group_start, compression)


def _partition_task(chunk: Chunk, schema: pa.Schema, held_schema: pa.Schema, has_seq_len: bool,
                    sample_id: np.ndarray | None, dest: np.ndarray, group_start: np.ndarray,
                    compression: str | None = None) -> list[pa.Table | bytes]:
    """Split one chunk's rows into rank groups (runs as a Ray task with ``num_returns=G``): the
    local engine's routing (:func:`fsdata.engines.routing.route_by_destination`).

    Args:
        chunk: the rows to read.
        schema: the rank-file schema (:func:`fsdata.shards.writer.output_schema`).
        held_schema: the input columns as held (:func:`fsdata.engines.routing.narrow_types`), then
            the destination column.
        has_seq_len: check ``seq_len`` against ``len(item_ids)`` as the local engine does.
        sample_id: shape ``[n]`` int64, the plan's ``sample_id`` of the chunk's rows (None: the plan
            was made from this very read, nothing to check).
        dest: shape ``[n]`` int64, each row's destination (:func:`fsdata.engines.routing.destinations`; -1: dropped).
        group_start: shape ``[G+1]`` int64, the first destination of each rank group, then the total.
        compression: None, or ``lz4``/``zstd`` to store the pieces as compressed Arrow IPC.

    Returns:
        ``G`` tables in ``held_schema`` (IPC bytes when compressed), the chunk's rows of each group
        in destination order.
    """
    G = len(group_start) - 1
    input_types = [held_schema.field(i).type for i in range(len(held_schema) - 1)]
    pieces: list[list[pa.Table]] = [[] for _ in range(G)]
    start = 0
    try:
        for batch in chunk_batches(chunk, BATCH_ROWS):
            n = batch.num_rows
            sl = slice(start, start + n)
            start += n
            if start > len(dest):
                raise rows_differ(chunk.path)
            cols = input_columns(batch, schema, chunk.path, expected_ids=None if sample_id is None else sample_id[sl],
                                 has_seq_len=has_seq_len)
            cols = [c if c.type == ty else c.cast(ty) for c, ty in zip(cols, input_types, strict=True)]
            for g, piece in enumerate(route_by_destination(cols, held_schema, dest[sl], group_start)):
                if piece is not None:
                    pieces[g].append(piece)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"input file {chunk.path}: cannot read rows ({str(e).splitlines()[0]}); "
                         "the file is corrupt or truncated: regenerate it") from None
    if start != chunk.num_rows:
        raise InputError(f"input file {chunk.path}: read {start} rows where its footer says {chunk.num_rows}; "
                         "the file changed while balancing: rerun")
    out = [_pack(pa.concat_tables(p) if p else held_schema.empty_table(), compression) for p in pieces]
    return out if len(out) > 1 else out[0]  # one rank group: Ray's num_returns=1 stores the value itself


def _write_group_task(output: str, schema: pa.Schema, held_schema: pa.Schema, num_steps: int, ranks: tuple[int, int],
                      rank_start: np.ndarray, counts: np.ndarray, plan_digest: str, *pieces: pa.Table) -> list:
    """Write the rank files of ranks ``ranks[0] .. ranks[1]-1`` (runs as a Ray task): the local
    engine's :func:`fsdata.engines.routing.group_writer`, one block of ranks at a time.

    Args:
        output: the (temporary) OUTPUT folder on shared storage.
        schema: the rank-file schema.
        held_schema: the pieces' schema (:func:`_partition_task`).
        num_steps: S.
        ranks: ``(first, end)`` of the group.
        rank_start: shape ``[R+1]`` int64, the first destination of every rank, then the total.
        counts: shape ``[S x R]``, the plan's samples per (step, rank).
        plan_digest: recorded in every rank file (:func:`fsdata.shards.plan_file.plan_digest`).
        pieces: the group's rows from every chunk (resolved from the object store by Ray).

    Returns:
        ``(entries, node)``: one :class:`~fsdata.shards.manifest.FileEntry` per rank of the group, by
        rank, and the Ray node id the task ran on.
    """
    tables = [t for t in map(_unpack, pieces) if t.num_rows] or [held_schema.empty_table()]
    del pieces
    block = group_writer(tables, ranks, rank_start, counts, num_steps, output, schema, plan_digest)
    del tables
    entries = []
    for br in rank_blocks(rank_start, *ranks, GATHER_BLOCK_ROWS):
        entries += block(br)
    return entries, node_id()


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


def piece_compression(codec: str | None, held_bytes: float, object_store_bytes: float | None) -> str | None:
    """The codec of the partition tasks' object-store pieces: ``codec`` (``--bucket-compression``)
    only when the rows as held would not fit :data:`STORE_FRACTION` of the cluster's object store,
    else None. Ray spills objects to disk once its store is about 80% full; while the pieces fit,
    compressing them only costs CPU (zstd: 134 s against 118 s at 20M on 2 cores,
    docs/results/bench_offline_stage.md). The output is the same either way.

    Args:
        codec: ``lz4``, ``zstd`` or None.
        held_bytes: bytes of the rows as held (:func:`fsdata.engines.routing.held_row_bytes` x rows).
        object_store_bytes: the cluster's object store (``ray.cluster_resources()["object_store_memory"]``;
            None: unknown, then ``codec``).
    """
    if codec is None or (object_store_bytes and held_bytes <= STORE_FRACTION * object_store_bytes):
        return None
    return codec


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
    (the counterpart of :func:`fsdata.engines.local.write_ranks`; same files, byte for byte).

    Args:
        src: the validated input (:func:`fsdata.samples.io.open_samples`).
        plan: the :class:`~fsdata.shards.plan_file.PlanTable` of ``src``.
        output: an existing empty folder on storage every Ray node sees (OUTPUT's temporary), or
            an object-store URI (``s3://bucket/prefix``) every node can reach.
        settings: :class:`~fsdata.balancer.settings.BalanceSettings` (``bucket_compression``, ``ray_address``).
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
    t0 = time.perf_counter()
    schema = output_schema(src)
    chunks = chunks if chunks is not None else make_chunks(src)
    if chunk_plans is None and sum(c.num_rows for c in chunks) != len(plan.sample_id):
        raise InputError(f"input {src.path} has {sum(c.num_rows for c in chunks)} rows but the plan has "
                         f"{len(plan.sample_id)}; the plan was made from another input: "
                         "rerun 'fsdata plan' on this input")
    counts, _ = plan.counts_and_loads()
    output = fsio.normalize(output)
    out = output if fsio.is_remote(output) else str(Path(output).resolve())
    starts = rank_step_starts(counts)
    rank_start = rank_starts(starts, plan.num_steps, plan.num_ranks)
    meta = footers(src)
    narrow = narrow_types(meta, schema)
    held = held_schema(schema, narrow, int(rank_start[-1]))
    held_bytes = held_row_bytes(meta, src.num_rows, schema, narrow) * int(rank_start[-1])
    with ray_session(settings.ray_address) as ray:
        resources = ray.cluster_resources()
        num_cpus = max(1, int(resources.get("CPU", 1)))
        compression = piece_compression(settings.bucket_compression, held_bytes, resources.get("object_store_memory"))
        bounds = group_bounds(plan.num_ranks, int(counts.sum()), num_cpus)
        group_start = rank_start[bounds]
        G = len(bounds) - 1
        schema_ref, held_ref = ray.put(schema), ray.put(held)
        starts_ref, rank_start_ref, counts_ref = ray.put(starts), ray.put(rank_start), ray.put(counts)
        pieces = []
        if chunk_plans is not None:
            part_fn = ray.remote(num_cpus=1, num_returns=G)(_partition_windowed_task)
            for c, refs_c in zip(chunks, chunk_plans):
                refs = part_fn.remote(c, schema_ref, held_ref, src.has_seq_len, starts_ref, plan.num_steps, group_start,
                                      compression, *refs_c)
                pieces.append([refs] if G == 1 else refs)
        else:
            part_fn = ray.remote(num_cpus=1, num_returns=G)(_partition_task)
            for c in chunks:
                sl = slice(c.offset, c.offset + c.num_rows)
                dest = destinations(starts, plan.num_steps, plan.step[sl], plan.rank[sl], plan.position[sl])
                refs = part_fn.remote(c, schema_ref, held_ref, src.has_seq_len, plan.sample_id[sl], dest, group_start,
                                      compression)
                pieces.append([refs] if G == 1 else refs)
        write_fn = ray.remote(num_cpus=1)(_write_group_task)
        digest = plan_digest(plan)
        write_refs = [write_fn.remote(out, schema_ref, held_ref, plan.num_steps, (int(bounds[g]), int(bounds[g + 1])),
                                      rank_start_ref, counts_ref, digest, *[p[g] for p in pieces])
                      for g in range(G)]
        del pieces
        written = get(ray, write_refs)
        groups = [g for g, _ in written]
        if nodes is not None:
            nodes |= {n for _, n in written}
        t1 = time.perf_counter()
        verify_fn = ray.remote(num_cpus=1)(_verify_group_task)
        get(ray, [verify_fn.remote(out, groups[g], counts[:, bounds[g]:bounds[g + 1]]) for g in range(G)])
    if timings is not None:
        timings.update(write_ranks=t1 - t0, verify=time.perf_counter() - t1)
    log.info("ray engine: %d chunks, %d rank groups, object-store pieces %s", len(chunks), G,
             compression or "uncompressed")
    return [e for g in groups for e in g]

