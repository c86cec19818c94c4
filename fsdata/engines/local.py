"""The ``local`` engine: every stage of ``fsdata balance`` in this process (the default).

1. **plan** (:func:`fsdata.engines.planning.plan_table`): read ``item_ids`` lengths and
   ``sample_id`` (validating the input), cost per sample, global batches and the per-step
   assignment; held as a :class:`~fsdata.shards.plan_file.PlanTable`.
2. **write** (:func:`write_ranks`): read the input once, in record batches (``--num-threads``
   threads, each reading its units of row groups), and gather every row (once per epoch) to its
   rank group: ranks are cut into contiguous groups whose rows take at most :data:`GATHER_BYTES`
   as held (64-bit integer columns whose values fit held as 32-bit ones, :func:`narrow_types`;
   each batch's rows of a group in destination order); the first and the last group stay in
   memory (:func:`_resident_groups`), the others are spilled to temporary Arrow IPC files, one per
   group and thread (``--bucket-compression`` is their codec, zstd by default; nothing is
   spilled when the input fits one and a half groups: the last group takes at most half the
   budget). Then per group (the first, the last, then the spilled ones in
   rank order): one permutation into (rank, step, position) order from the plan
   (no sort), one gather per block of ranks cast back to the rank-file types, ``step`` and
   ``rank`` from the plan, and each rank file written (threads) by
   :func:`fsdata.shards.writer.write_rank`.
3. **finalize** (:func:`fsdata.shards.finalize.finalize`), run by :meth:`fsdata.engines.base.Engine.run`.

INPUT and OUTPUT may be :mod:`pyarrow.fs` URIs (``s3://bucket/prefix``; :mod:`fsdata.fsio`): the
spilled rank groups then go to a local temporary folder (``TMPDIR``).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from fsdata import fsio
from fsdata.balancer.cost import CostModel
from fsdata.balancer.settings import BalanceSettings
from fsdata.engines.base import Engine, register
from fsdata.engines.planning import plan_table
from fsdata.engines.routing import (Chunk, chunk_batches, destinations, footers, group_writer, held_row_bytes,
                                    held_schema, input_columns, narrow_types, rank_blocks, rank_starts,
                                    rank_step_starts, route_by_destination, source_chunks)
from fsdata.errors import InputError
from fsdata.guards import raise_if_environment
from fsdata.samples.io import SampleSource
from fsdata.shards.manifest import FileEntry
from fsdata.shards.plan_file import PlanTable, plan_digest
from fsdata.shards.writer import output_schema

log = logging.getLogger(__name__)

#: Bytes of input rows as held in memory (Arrow, integer columns narrowed where they fit) gathered
#: at a time by the local engine's write stage (:func:`write_ranks`): ranks are written in groups
#: whose rows fit it; the first and the last group stay in memory, the others are spilled to
#: temporary Arrow IPC files during the single read of the input (:func:`_resident_groups`). Peak
#: memory grows with it and with the plan (28 bytes per input row per epoch): 3.40 GiB peak RSS at
#: 20M samples (docs/results/bench_offline_stage.md).
GATHER_BYTES = 1024**3
#: Fraction of :data:`GATHER_BYTES` the last rank group (held in memory with the first while the
#: input is read, :func:`_resident_groups`) may take: a whole budget raised the peak RSS at 10M
#: samples from 3.44 to 4.16 GiB (docs/results/bench_offline_stage.md).
LAST_GROUP_FRACTION = 0.5
#: Rows the write stage gathers into rank order at once (:func:`_write_group`): one gather per block
#: of consecutive whole ranks, each rank's rows a zero-copy slice of it (at 1M samples, R=256:
#: 0.5 CPU s against 0.8 for one gather per rank, docs/results/bench_offline_stage.md).
GATHER_BLOCK_ROWS = 1 << 16
#: Input rows a gather thread of the write stage reads as one unit (whole row groups of one file;
#: :func:`_read_units`).
GATHER_UNIT_ROWS = 1 << 18


def _destinations(plan: PlanTable) -> tuple[np.ndarray, np.ndarray]:
    """Each plan entry's row index in the concatenation of the rank files (rank 0's rows, then rank
    1's, ...; inside a rank ordered by step, then position) and the first index of every rank.

    Returns:
        ``(dest [E*N] int64, -1 for a dropped entry; rank_start [R + 1] int64)``.
    """
    S_, R = plan.num_steps, plan.num_ranks
    counts, _ = plan.counts_and_loads()
    starts = rank_step_starts(counts)
    dest = destinations(starts, S_, plan.step, plan.rank, plan.position)
    return dest, rank_starts(starts, S_, R)


def _rank_groups(rank_start: np.ndarray, row_bytes: float, budget: float) -> list[tuple[int, int]]:
    """Contiguous rank ranges ``[a, b)`` whose rows take at most ``budget`` bytes (one rank at least):
    the last group as many of the last ranks as fit :data:`LAST_GROUP_FRACTION` of it, then the
    others cut from the first rank on, so the two groups the write stage holds in memory
    (:func:`_resident_groups`) are full and the spilled remainder lies between them (at 20M samples
    2.95 GiB spilled, not 3.45)."""
    groups, a = [], 0
    R = len(rank_start) - 1
    if R == 0 or (rank_start[R] - rank_start[0]) * row_bytes <= budget:
        return [(0, R)] if R else []
    c = R - 1  # the last group: ranks c .. R-1
    while c > 1 and (rank_start[R] - rank_start[c - 1]) * row_bytes <= budget * LAST_GROUP_FRACTION:
        c -= 1
    while a < c:
        b = a + 1
        while b < c and (rank_start[b + 1] - rank_start[a]) * row_bytes <= budget:
            b += 1
        groups.append((a, b))
        a = b
    return [*groups, (c, R)]


def _resident_groups(num_groups: int) -> list[int]:
    """The order the write stage writes its rank groups in, the groups held in memory first: the
    first group and the last (sized by :func:`_rank_groups`), then the spilled ones in rank order.

    At most two groups are held at any time, as when only the first stayed in memory (a group
    being written and the next one's spill files read ahead): while the input is read, the two
    resident groups; while they are written, each with the other (or the next spilled group read
    ahead). So the last group's spill (write, compress, read back) is saved for the same peak
    memory (:func:`_rank_groups` sizes it): at 20M samples 2.95 GiB of the 4.45 GiB held are
    spilled instead of 3.45, at 10M 0.7 instead of 1.2, at 5M nothing
    (docs/results/bench_offline_stage.md).

    Returns:
        Group indices ``0, G-1, 1, 2, ..., G-2`` (``[0]`` for one group); the first
        ``min(2, G)`` are the resident ones.
    """
    if num_groups <= 2:
        return list(range(num_groups))
    return [0, num_groups - 1, *range(1, num_groups - 1)]


def _read_units(src: SampleSource) -> tuple[list[Chunk], int]:
    """The input cut into units a gather thread reads alone: runs of whole row groups of one file of
    about :data:`GATHER_UNIT_ROWS` rows (:func:`fsdata.engines.routing.source_chunks`, the Ray
    engine's chunks); and the input's rows."""
    chunks = source_chunks(src, GATHER_UNIT_ROWS)
    return chunks, sum(c.num_rows for c in chunks)


def _gather(src: SampleSource, plan: PlanTable, schema: pa.Schema, held_schema: pa.Schema, dest: np.ndarray,
            group_start: np.ndarray, spill_dir: Path | None, progress: bool, compression: str | None,
            num_threads: int = 1, keep: tuple[int, ...] = (0,)) -> dict[int, list[pa.Table]]:
    """Read the input once: every kept row (once per epoch) with its destination
    (:func:`_destinations`), in ``held_schema`` (the input columns, 64-bit integer columns that fit
    narrowed to 32 bits, :func:`narrow_types`); the rows of the groups in ``keep`` are returned (by
    group), the others' appended to ``spill_dir/group-XXXXX-T.arrow`` (one file per group and
    gather thread). ``step`` and
    ``rank`` are not carried: the plan gives them again from the destination.

    ``num_threads`` threads read units of row groups (:func:`_read_units`) side by side (Arrow's
    decoding, ``take`` and IPC writes release the GIL); the rows of a group arrive in any order,
    which :func:`group_writer` undoes from their destinations, so the output does not change.

    Raises:
        InputError: a file fails to read, or its rows are not the plan's.
    """
    E = plan.epochs
    N = len(plan.sample_id) // E  # input rows; entry e*N + i is row i in epoch e
    options = pa.ipc.IpcWriteOptions(compression=compression)
    units, total = _read_units(src)
    if total < N:
        raise InputError(f"input {src.path} has {total} rows but the plan has {N}; the plan was "
                         "made from another input: rerun 'fsdata plan' on this input")
    T = max(1, min(num_threads, len(units)))
    writers: list[dict[int, pa.ipc.RecordBatchFileWriter]] = [{} for _ in range(T)]
    resident: dict[int, list[pa.Table]] = {k: [] for k in keep}
    stop = threading.Event()
    bar = tqdm(total=src.num_rows, unit="row", desc="gather rows by rank", disable=not progress)
    input_types = [held_schema.field(i).type for i in range(len(held_schema) - 1)]

    # threads take the next unit when they finish one (largest first), so a thread never idles
    # while the other reads many units: an OUTPUT read as INPUT has a long and a short unit per
    # rank file, which a fixed ``units[t::T]`` split handed all long ones to one thread
    todo: queue.SimpleQueue[Chunk] = queue.SimpleQueue()
    for unit in sorted(units, key=lambda u: -u.num_rows):
        todo.put(unit)

    def read(t: int) -> None:
        while not stop.is_set():
            try:
                unit = todo.get_nowait()
            except queue.Empty:
                return
            path, offset = unit.path, unit.offset
            try:
                for batch in chunk_batches(unit, 65536):
                    n = batch.num_rows
                    idx = np.arange(offset, min(offset + n, N))
                    offset += n
                    cols = input_columns(batch, schema, path, expected_ids=plan.sample_id[idx],
                                         has_seq_len=src.has_seq_len)
                    cols = [c if c.type == ty else c.cast(ty) for c, ty in zip(cols, input_types, strict=True)]
                    for e in range(E):  # each input row once per epoch, with that epoch's place
                        pieces = route_by_destination(cols, held_schema, dest[idx + e * N], group_start)
                        for k, piece in enumerate(pieces):
                            if piece is None:
                                continue
                            if k in resident:
                                resident[k].append(piece)  # list.append is atomic
                                continue
                            w = writers[t].get(k)
                            if w is None:
                                w = writers[t][k] = pa.ipc.new_file(str(spill_dir / _spill_name(k, t)), held_schema,
                                                                    options=options)
                            w.write_table(piece)
                    bar.update(n)
            except (pa.ArrowException, OSError) as e:
                # a full disk or read-only spill folder is the machine's fault, not the input's
                raise_if_environment(e, spill_dir if spill_dir is not None else path)
                raise InputError(f"input file {path}: cannot read rows ({str(e).splitlines()[0]}); "
                                 "the file is corrupt or truncated: regenerate it") from None

    def guarded(t: int) -> None:
        try:
            read(t)
        except BaseException:
            stop.set()
            raise

    try:
        with ThreadPoolExecutor(max_workers=T) as ex:
            futures = [ex.submit(guarded, t) for t in range(T)]
            for f in futures:
                f.exception()  # wait for every thread before closing its writers
            for f in futures:
                f.result()  # the first thread's error, in thread order
    except BaseException:
        for w in (w for ws in writers for w in ws.values()):
            try:
                w.close()  # may fail again (disk full); the first error is the one to report
            except (pa.ArrowException, OSError):
                pass
        raise
    else:
        for w in (w for ws in writers for w in ws.values()):
            w.close()
    finally:
        bar.close()
    if total != N:
        raise InputError(f"input {src.path} has {total} rows but the plan has {N}; the plan was "
                         "made from another input: rerun 'fsdata plan' on this input")
    return resident


def _read_spill(path: Path) -> pa.Table:
    """One spill file's rows, read into memory and the file removed (not memory-mapped: mapped
    pages count in RSS, +1 GB at 5M, measured)."""
    with pa.OSFile(str(path), "rb") as f:
        table = pa.ipc.open_file(f).read_all()
    path.unlink()
    return table


def _spill_name(group: int, thread: int | str) -> str:
    return f"group-{group:05d}-{thread}.arrow"


def _collect(futures: list, bar) -> list[FileEntry]:
    """The records of the submitted blocks, in submission (rank) order."""
    files = []
    for f in futures:
        infos = f.result()
        files += infos
        bar.update(len(infos))
    return files


_BUCKETS_PREFIX = "fsdata-buckets-"


def _clean_stale_bucket_dirs() -> list[str]:
    """Remove ``TMPDIR/fsdata-buckets-<pid>-*`` left by runs that were killed (their pid is gone)."""
    from fsdata.guards import process_alive as _pid_alive  # noqa: PLC0415

    removed = []
    for p in Path(tempfile.gettempdir()).glob(f"{_BUCKETS_PREFIX}*-*"):
        try:
            pid = int(p.name[len(_BUCKETS_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            log.warning("removed %s left by a killed run (process %d)", p, pid)
            removed.append(str(p))
    return removed


def write_ranks(src: SampleSource, plan: PlanTable, output: str | os.PathLike,
                settings: BalanceSettings) -> list[FileEntry]:
    """Stage 2 in this process: write every rank file of ``plan`` into the existing folder ``output`` (for a URI:
    under that prefix; spilled rank groups then go to a local temporary folder). One read of the
    input; memory about :data:`GATHER_BYTES` plus the plan (module docstring).

    Returns:
        One :class:`~fsdata.shards.manifest.FileEntry` per rank, sorted by rank.

    Raises:
        InputError: an input file fails to read midway, or the input does not match the plan.
    """
    schema = output_schema(src)
    output = fsio.normalize(output)
    remote = fsio.is_remote(output)
    out = output if remote else Path(output)
    dest, rank_start = _destinations(plan)
    meta = footers(src)
    narrow = narrow_types(meta, schema)
    held = held_schema(schema, narrow, len(dest))
    groups = _rank_groups(rank_start, held_row_bytes(meta, src.num_rows, schema, narrow), GATHER_BYTES)
    group_start = np.array([rank_start[a] for a, _ in groups] + [rank_start[-1]], dtype=np.int64)
    spill_dir: Path | None = None
    _clean_stale_bucket_dirs()  # a killed run's scratch in TMPDIR, whether or not this run spills
    order = _resident_groups(len(groups))
    keep = tuple(order[:2])
    if len(groups) > len(keep):
        if remote:  # object stores have no place for scratch files: the spill goes to local TMPDIR
            spill_dir = Path(tempfile.mkdtemp(prefix=f"{_BUCKETS_PREFIX}{os.getpid()}-"))
        else:
            spill_dir = out / ".buckets"
            spill_dir.mkdir()
    try:
        resident = _gather(src, plan, schema, held, dest, group_start, spill_dir, settings.progress,
                           settings.bucket_compression, settings.num_threads, keep)
        del dest
        digest = plan_digest(plan)
        counts, _ = plan.counts_and_loads()
        files: list[FileEntry] = []
        bar = tqdm(total=plan.num_ranks, unit="rank", desc="write rank files", disable=not settings.progress)
        with ThreadPoolExecutor(max_workers=max(1, settings.num_threads)) as ex:
            pending: list = []  # the previous group's block futures
            reads: list = []
            for m, k in enumerate(order):
                # a spilled group's files were queued behind the previous group's blocks: they are
                # read while its last blocks finish, and its permutation is built before they are collected
                batches = resident.pop(k) if k in resident else [f.result() for f in reads]
                block = group_writer(batches, groups[k], rank_start, counts, plan.num_steps, out, schema, digest)
                del batches
                files += _collect(pending, bar)
                pending = [ex.submit(block, br) for br in rank_blocks(rank_start, *groups[k], GATHER_BLOCK_ROWS)]
                del block
                # each gather thread's file of the next group read (and decompressed) on its own thread
                nxt = order[m + 1] if m + 1 < len(order) else None
                reads = ([ex.submit(_read_spill, path) for path in sorted(spill_dir.glob(_spill_name(nxt, "*")))]
                         if nxt is not None and nxt not in keep else [])
            files += _collect(pending, bar)
        files.sort(key=lambda f: f.rank)
        bar.close()
    finally:
        if spill_dir is not None:
            shutil.rmtree(spill_dir, ignore_errors=True)
    return files



@register("local")
class LocalEngine(Engine):
    """Every stage in this process, threads for the rank files (``--num-threads``); the default."""

    def plan(self, src: SampleSource, cost_model: CostModel, *, timings: dict[str, float]) -> PlanTable:
        return plan_table(src, self.settings, cost_model, timings=timings, first_epoch_mask=self.first_epoch_mask)

    def write_ranks(self, src: SampleSource, plan: PlanTable, output: str | os.PathLike, *,
                    timings: dict[str, float] | None = None) -> list[FileEntry]:
        return write_ranks(src, plan, output, self.settings)
