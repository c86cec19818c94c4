"""The Ray engine's write stage (the counterpart of :func:`fsdata.engines.local.write_ranks`).

* **partition** (a task per chunk): read the chunk's rows, check them against the plan, cast and
  route them to ``G`` *rank groups* (contiguous rank ranges;
  :mod:`fsdata.engines.routing`, the local engine's routing): ``G`` objects per task in the Ray
  object store (spilled to disk by Ray when full; ``--bucket-compression lz4|zstd`` stores them
  as compressed Arrow IPC).
* **write** (a task per rank group): gather the group's pieces from every chunk and call
  :func:`fsdata.shards.writer.write_rank` once per rank, the function the local engine calls, so
  the rank files are byte-identical.
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
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.engines.ray.chunks import Chunk, make_chunks, open_chunk
from fsdata.engines.ray.session import get, node_id, ray_session
from fsdata.engines.routing import input_columns, rows_differ, split_by_group
from fsdata.errors import InputError, VerifyError
from fsdata.samples import schema as S
from fsdata.shards import writer
from fsdata.shards.manifest import sha256_file
from fsdata.shards.plan_file import POSITION, plan_digest
from fsdata.shards.writer import output_schema

log = logging.getLogger("fsdata.engines.ray")

#: Target rows per rank group (the rows one write task holds at once).
GROUP_ROWS = 262_144
#: Rows per record batch when a partition task streams a chunk.
BATCH_ROWS = 32_768


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
    G = len(group_bounds) - 1
    out_schema = schema.append(pa.field(POSITION, pa.int32()))
    group_of_rank = np.repeat(np.arange(G, dtype=np.int64), np.diff(group_bounds))
    pieces: list[list[pa.Table]] = [[] for _ in range(G)]
    start = 0
    try:
        pf = open_chunk(chunk)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=list(chunk.row_groups)):
            n = batch.num_rows
            sl = slice(start, start + n)
            start += n
            if start > len(step):
                raise rows_differ(chunk.path)
            cols = input_columns(batch, schema, chunk.path, expected_ids=None if sample_id is None else sample_id[sl],
                                 has_seq_len=has_seq_len)
            r = rank[sl]
            group = np.where(r >= 0, group_of_rank[np.maximum(r, 0)], -1)  # a dropped row goes nowhere
            routed = split_by_group([*cols, pa.array(step[sl], type=pa.int32()), pa.array(r, type=pa.int32()),
                                     pa.array(position[sl], type=pa.int32())], out_schema, group, G)
            for g, piece in enumerate(routed):
                if piece is not None:
                    pieces[g].append(piece)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"input file {chunk.path}: cannot read rows ({str(e).splitlines()[0]}); "
                         "the file is corrupt or truncated: regenerate it") from None
    if start != chunk.num_rows:
        raise InputError(f"input file {chunk.path}: read {start} rows where its footer says {chunk.num_rows}; "
                         "the file changed while balancing: rerun")
    del rename
    out = [_pack((pa.concat_tables(p) if p else out_schema.empty_table()).combine_chunks(), compression)
           for p in pieces]
    return out if len(out) > 1 else out[0]  # one rank group: Ray's num_returns=1 stores the value itself


def _write_group_task(output: str, schema: pa.Schema, num_steps: int, ranks: tuple[int, int], plan_digest: str,
                      *pieces: pa.Table) -> list:
    """Write the rank files of ranks ``ranks[0] .. ranks[1]-1`` (runs as a Ray task).

    Args:
        output: the (temporary) OUTPUT folder on shared storage.
        schema: the rank-file schema.
        num_steps: S.
        ranks: ``(first, end)`` of the group.
        plan_digest: recorded in every rank file (:func:`fsdata.shards.plan_file.plan_digest`).
        pieces: the group's rows from every chunk (resolved from the object store by Ray).

    Returns:
        ``(entries, node)``: one :class:`~fsdata.shards.manifest.FileEntry` per rank of the group, by
        rank, and the Ray node id the task ran on.
    """
    pieces = [t for t in map(_unpack, pieces) if t.num_rows]
    table = pa.concat_tables(pieces) if pieces else schema.append(pa.field(POSITION, pa.int32())).empty_table()
    del pieces
    table = table.take(pc.sort_indices(table, sort_keys=[(S.RANK, "ascending")]))
    r = table.column(S.RANK).to_numpy()
    first, end = ranks
    cuts = np.searchsorted(r, np.arange(first, end + 1), side="left")
    entries = []
    for i, rank in enumerate(range(first, end)):
        entries.append(writer.write_rank(rank, table.slice(cuts[i], cuts[i + 1] - cuts[i]), output, schema, num_steps,
                                  plan_digest=plan_digest))
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
        written = get(ray, write_refs)
        groups = [g for g, _ in written]
        if nodes is not None:
            nodes |= {n for _, n in written}
        t1 = time.perf_counter()
        verify_fn = ray.remote(num_cpus=1)(_verify_group_task)
        get(ray, [verify_fn.remote(out, groups[g], counts[:, bounds[g]:bounds[g + 1]]) for g in range(G)])
    if timings is not None:
        timings.update(write_ranks=t1 - t0, verify=time.perf_counter() - t1)
    log.info("ray engine: %d chunks, %d rank groups", len(chunks), G)
    return [e for g in groups for e in g]

