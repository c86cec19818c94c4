"""Reading one rank's shard of an ``fsdata balance`` output (docs/format.md, format_version 2 and 1).

:class:`ShardReader` opens the rank's file listed in the manifest (v2: ``rank-XXXXX/part-00000.parquet``),
checks it against ``_manifest.json`` and ``_step_stats.parquet`` (v1: ``manifest.json``,
``_step_stats.parquet``, read through :class:`fsdata.manifest.Manifest`) *before* any collective can run, streams its row
groups (a row group holds whole steps, so memory is bounded by one row group) and yields one
:class:`Batch` per step: the item histories as a jagged :class:`KeyedJaggedTensor` (no padding),
the targets, this rank's sample count and the step's global sample count (for loss
normalisation under the ``cost-budget`` policy, where counts vary per rank).

Notation: ``B`` = samples of this rank in this step (varies under ``cost-budget``),
``T`` = total history items of the batch (``sum of lengths``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.autograd.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from fsdata import schema
from fsdata import manifest as _M
from fsdata.manifest import Manifest, ManifestError
from fstrain.errors import ShardError, ShardMismatchError

logger = logging.getLogger(__name__)

#: KJT keys of a batch: the history and the label (one id per sample), looked up in one table.
HISTORY_KEY = schema.ITEM_IDS
TARGET_KEY = schema.TARGET_ITEM_ID
_READ_COLUMNS = [schema.STEP, schema.SAMPLE_ID, schema.ITEM_IDS, schema.TARGET_ITEM_ID]


def load_manifest(shards_dir: str) -> Manifest:
    """Read and validate an OUTPUT's manifest (``_manifest.json``; v1 ``manifest.json``) with
    :meth:`fsdata.manifest.Manifest.read`, the one reader of the format.

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder.

    Returns:
        The parsed :class:`fsdata.manifest.Manifest` (``files[r].path`` / ``.num_rows``,
        :meth:`~fsdata.manifest.Manifest.rank_file`).

    Raises:
        ShardError: missing, unreadable or malformed manifest, or a rank without a file.
        ShardMismatchError: a ``format_version`` this fstrain does not read.
    """
    try:
        m = Manifest.read(shards_dir)
    except ManifestError as e:
        if e.kind == "version":
            raise ShardMismatchError(f"{e}") from None
        raise ShardError(str(e)) from None
    if m.predicted_bubble is None:
        m.predicted_bubble = float("nan")
    return m


def load_step_counts(manifest: Manifest) -> np.ndarray:
    """Per-(step, rank) sample counts.

    Under ``fixed`` every entry is ``batch_size_per_rank``; under ``cost-budget`` they come from
    ``_step_stats.parquet``.

    Args:
        manifest: a loaded manifest.

    Returns:
        shape ``[S x R]``, int64.

    Raises:
        ShardError: ``_step_stats.parquet`` is missing, unreadable, or does not cover every
            (step, rank) exactly once with at least one sample.
    """
    S, R = manifest.num_steps, manifest.num_ranks
    stats_path = os.path.join(manifest.path, manifest.step_stats_file
                              or _M.STEP_STATS_NAMES[manifest.format_version])
    if manifest.batch_policy == "fixed" and not os.path.exists(stats_path):
        return np.full((S, R), manifest.batch_size_per_rank, dtype=np.int64)
    try:
        t = pq.read_table(stats_path, columns=["step", "rank", "num_samples"])
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"{stats_path}: cannot read ({e}); re-run fsdata balance") from None
    step = t.column("step").to_numpy().astype(np.int64)
    rank = t.column("rank").to_numpy().astype(np.int64)
    n = t.column("num_samples").to_numpy().astype(np.int64)
    if len(step) != S * R or step.min(initial=0) < 0 or step.max(initial=0) >= S or rank.max(initial=0) >= R:
        raise ShardError(f"{stats_path}: {len(step)} rows but num_steps {S} x num_ranks {R} = {S * R} "
                         "(one per step and rank) expected; re-run fsdata balance")
    counts = np.zeros((S, R), dtype=np.int64)
    counts[step, rank] = n
    if (counts < 1).any():
        s, r = map(int, np.argwhere(counts < 1)[0])
        raise ShardError(f"{stats_path}: step {s} rank {r} has {counts[s, r]} samples (at least 1 required); "
                         "re-run fsdata balance")
    return counts


def check_world_size(manifest: Manifest, world_size: int) -> None:
    """Raise :class:`ShardMismatchError` unless the shards were written for ``world_size`` ranks."""
    if world_size != manifest.num_ranks:
        raise ShardMismatchError(
            f"{manifest.path} was written for {manifest.num_ranks} ranks but this job has world size {world_size}; "
            f"launch with --nproc-per-node {manifest.num_ranks} (or nodes x procs = {manifest.num_ranks}) or "
            f"re-run fsdata balance with --ranks {world_size}")


@dataclass(slots=True)
class Batch(Pipelineable):
    """One rank's per-step batch; a torchrec ``Pipelineable`` (``to``, ``record_stream``, ``pin_memory``).

    Attributes:
        features: KJT with keys ``item_ids`` (the histories, lengths ``[B]``, ``T`` values) and
            ``target_item_id`` (one id per sample), int64 ids; model code may append keys
            (e.g. shared negatives, see :func:`fstrain.model.with_negatives`).
        target_ids: shape ``[B]``, int64: the next item of each sample (the label).
        sample_ids: shape ``[B]``, int64.
        step: the step number (0-based, same on every rank).
        num_samples: B, this rank's count in this step.
        global_num_samples: the step's count over all ranks (loss normaliser).
    """

    features: KeyedJaggedTensor
    target_ids: torch.Tensor
    sample_ids: torch.Tensor
    step: int
    num_samples: int
    global_num_samples: int

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        """Copy to ``device`` (a new :class:`Batch`; ints stay on the host)."""
        return Batch(self.features.to(device=device, non_blocking=non_blocking),
                     self.target_ids.to(device=device, non_blocking=non_blocking),
                     self.sample_ids.to(device=device, non_blocking=non_blocking),
                     self.step, self.num_samples, self.global_num_samples)

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as used by ``stream`` (CUDA only)."""
        self.features.record_stream(stream)
        self.target_ids.record_stream(stream)
        self.sample_ids.record_stream(stream)

    def pin_memory(self) -> "Batch":
        """Page-locked copy for asynchronous host-to-device transfer."""
        return Batch(self.features.pin_memory(), self.target_ids.pin_memory(), self.sample_ids.pin_memory(),
                     self.step, self.num_samples, self.global_num_samples)

    @property
    def lengths(self) -> torch.Tensor:
        """History lengths, shape ``[B]``, int64 (a view into the KJT)."""
        return self.features[HISTORY_KEY].lengths()


def make_batch(item_values: np.ndarray, lengths: np.ndarray, targets: np.ndarray, sample_ids: np.ndarray,
               step: int, global_num_samples: int) -> Batch:
    """Build a :class:`Batch` from flat numpy arrays.

    Args:
        item_values: shape ``[T]``, int64: histories concatenated.
        lengths: shape ``[B]``, int64: history lengths (sum = T).
        targets: shape ``[B]``, int64.
        sample_ids: shape ``[B]``, int64.
        step: the step number.
        global_num_samples: the step's count over all ranks.

    Returns:
        The batch (CPU tensors).
    """
    B = len(lengths)
    values = torch.from_numpy(np.concatenate([item_values, targets]).astype(np.int64, copy=False))
    kjt_lengths = torch.from_numpy(np.concatenate([lengths, np.ones(B, dtype=np.int64)]).astype(np.int64, copy=False))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[HISTORY_KEY, TARGET_KEY], values=values,
                                              lengths=kjt_lengths, stride=B)
    return Batch(kjt, torch.from_numpy(np.array(targets, dtype=np.int64)),
                 torch.from_numpy(np.array(sample_ids, dtype=np.int64)),
                 int(step), B, int(global_num_samples))


class ShardReader:
    """Streams one rank's steps as :class:`Batch` objects.

    Validation (all before the first batch, so no rank enters a collective with bad data): the
    manifest's ``format_version``, ``num_ranks == world_size``, this rank's file readable with
    the row count of the manifest and of ``_step_stats.parquet``, and its ``step`` statistics
    covering ``0 .. num_steps-1``. While streaming, every step is checked to hold exactly the
    count ``_step_stats.parquet`` gives.

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder.
        rank: this process's rank.
        world_size: the job's world size; must equal the manifest's ``num_ranks``
            (``None`` skips the check, e.g. for single-device replay of all ranks).
        start_step: first step to yield (resume); row groups wholly before it are skipped using
            their ``step`` statistics.
        max_steps: yield at most this many steps (``None``: to the end).
        num_prefetch_batches: batches decoded ahead on a background thread (0: synchronous).

    Raises:
        ShardMismatchError: version or world-size mismatch, or ``start_step`` out of range.
        ShardError: missing, truncated or corrupt files, or counts that disagree.
    """

    def __init__(self, shards_dir: str, rank: int, world_size: int | None, *, start_step: int = 0,
                 max_steps: int | None = None, num_prefetch_batches: int = 2) -> None:
        self.manifest = load_manifest(shards_dir)
        m = self.manifest
        if world_size is not None:
            check_world_size(m, world_size)
        if not 0 <= rank < m.num_ranks:
            raise ShardMismatchError(f"rank {rank} is outside 0..{m.num_ranks - 1} of {shards_dir}")
        if not 0 <= start_step <= m.num_steps:
            raise ShardMismatchError(f"cannot start at step {start_step}: {shards_dir} has {m.num_steps} steps "
                                     f"(0..{m.num_steps - 1})")
        if max_steps is not None and max_steps < 0:
            raise ShardMismatchError(f"max_steps must be >= 0, got {max_steps}")
        self.rank = rank
        self.start_step = start_step
        self.end_step = m.num_steps if max_steps is None else min(m.num_steps, start_step + max_steps)
        self.num_prefetch_batches = num_prefetch_batches
        counts = load_step_counts(m)
        self.local_counts = counts[:, rank]
        self.global_counts = counts.sum(axis=1)
        self.path = m.rank_file(rank)
        self._file, self._row_groups = self._open_and_check()

    def _open_and_check(self) -> tuple[pq.ParquetFile, list[int]]:
        m, path = self.manifest, self.path
        try:
            pf = pq.ParquetFile(path)
            md = pf.metadata
        except FileNotFoundError:
            raise ShardError(f"rank {self.rank}: {path} not found; re-run fsdata balance or copy the whole OUTPUT") from None
        except (OSError, pa.ArrowException) as e:
            raise ShardError(f"rank {self.rank}: {path} is truncated or corrupt ({e}); "
                             "check it with `python -m fsdata verify` and re-run fsdata balance") from None
        expected = m.files[self.rank].num_rows
        if md.num_rows != expected or md.num_rows != int(self.local_counts.sum()):
            raise ShardError(f"rank {self.rank}: {path} has {md.num_rows} rows but the manifest says {expected} "
                             f"and step_stats {int(self.local_counts.sum())}; re-run fsdata balance")
        names = pf.schema_arrow.names
        missing = [c for c in _READ_COLUMNS if c not in names]
        if missing:
            raise ShardError(f"rank {self.rank}: {path} lacks columns {missing}; re-run fsdata balance")
        step_col = _leaf_index(pf, schema.STEP)
        lo_all, hi_all, keep = None, None, []
        for i in range(md.num_row_groups):
            st = md.row_group(i).column(step_col).statistics
            if st is None or not st.has_min_max:
                raise ShardError(f"rank {self.rank}: {path} row group {i} has no `step` statistics; "
                                 "re-run fsdata balance (it writes them)")
            lo, hi = int(st.min), int(st.max)
            lo_all = lo if lo_all is None else min(lo_all, lo)
            hi_all = hi if hi_all is None else max(hi_all, hi)
            if hi >= self.start_step and lo < self.end_step:
                keep.append(i)
        if m.num_steps and (lo_all != 0 or hi_all != m.num_steps - 1):
            raise ShardMismatchError(f"rank {self.rank}: {path} holds steps {lo_all}..{hi_all} but the manifest "
                                     f"says 0..{m.num_steps - 1} on every rank; re-run fsdata balance")
        return pf, keep

    def __len__(self) -> int:
        return self.end_step - self.start_step

    def _decode(self) -> Iterator[Batch]:
        expect = self.start_step
        for i in self._row_groups:
            with record_function("## read_row_group ##"):
                try:
                    t = self._file.read_row_group(i, columns=_READ_COLUMNS)
                except (OSError, pa.ArrowException) as e:
                    raise ShardError(f"rank {self.rank}: {self.path} row group {i} is corrupt ({e}); "
                                     "re-run fsdata balance") from None
            steps = t.column(schema.STEP).to_numpy()
            hist = t.column(schema.ITEM_IDS).combine_chunks()
            lengths = hist.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
            values = hist.flatten().to_numpy(zero_copy_only=False)
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            targets = t.column(schema.TARGET_ITEM_ID).to_numpy()
            sids = t.column(schema.SAMPLE_ID).to_numpy()
            if len(steps) and (np.diff(steps) < 0).any():
                raise ShardError(f"rank {self.rank}: {self.path} row group {i} is not sorted by step; "
                                 "re-run fsdata balance")
            uniq, starts = np.unique(steps, return_index=True)
            ends = np.append(starts[1:], len(steps))
            for s, a, b in zip(uniq.tolist(), starts.tolist(), ends.tolist()):
                if s < self.start_step:
                    continue
                if s >= self.end_step:
                    return
                if s != expect:
                    raise ShardError(f"rank {self.rank}: {self.path} jumps from step {expect - 1} to {s}; "
                                     "re-run fsdata balance")
                if b - a != self.local_counts[s]:
                    raise ShardError(f"rank {self.rank}: step {s} has {b - a} rows but step_stats says "
                                     f"{int(self.local_counts[s])}; re-run fsdata balance")
                with record_function("## make_batch ##"):
                    yield make_batch(values[offsets[a]:offsets[b]], lengths[a:b], targets[a:b], sids[a:b],
                                     s, int(self.global_counts[s]))
                expect = s + 1
        if expect != self.end_step:
            raise ShardError(f"rank {self.rank}: {self.path} ends at step {expect - 1}, expected "
                             f"{self.end_step - 1}; re-run fsdata balance")

    def __iter__(self) -> Iterator[Batch]:
        if self.num_prefetch_batches <= 0:
            yield from self._decode()
            return
        yield from _prefetch(self._decode(), self.num_prefetch_batches)


def _leaf_index(pf: pq.ParquetFile, name: str) -> int:
    for j in range(pf.metadata.num_columns):
        if pf.schema.column(j).path == name:
            return j
    raise ShardError(f"{name} column not found in {pf.schema_arrow.names}")


_DONE = object()


def _prefetch(it: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """Run ``it`` on a background thread, ``depth`` items ahead; re-raises its errors in the caller.

    The thread never outlives the generator: closing it (end of data, ``break``, an error, or
    garbage collection) stops the thread and joins it. A reader thread left running inside
    Arrow's C++ code at interpreter exit aborts the process ("terminate called without an active
    exception") when it takes the GIL back during finalization.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for x in it:
                if not put(x):
                    return
            put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(e)

    th = threading.Thread(target=work, name="fstrain-shard-reader", daemon=True)
    th.start()
    try:
        while True:
            x = q.get()
            if x is _DONE:
                return
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:
        stop.set()
        th.join()  # returns after at most one more item: every put gives up once stop is set


def infer_num_items(manifest: Manifest) -> int:
    """Size of the item vocabulary (``max id + 1``) from the Parquet footers of every rank file.

    Reads only footers (column statistics of ``item_ids`` elements and ``target_item_id``), so it
    is cheap and gives every rank the same answer.

    Returns:
        ``max(item id) + 1`` over all rank files.

    Raises:
        ShardError: a file has no statistics for those columns (pass ``--num-items`` instead).
    """
    hi = -1
    for r in range(manifest.num_ranks):
        path = manifest.rank_file(r)
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise ShardError(f"rank {r}: {path} is truncated or corrupt ({e}); re-run fsdata balance") from None
        md = pf.metadata
        idx = [j for j in range(md.num_columns)
               if pf.schema.column(j).path in (schema.TARGET_ITEM_ID, f"{schema.ITEM_IDS}.list.element")]
        for g in range(md.num_row_groups):
            for j in idx:
                st = md.row_group(g).column(j).statistics
                if st is None or not st.has_min_max:
                    raise ShardError(f"{path}: no min/max statistics on {pf.schema.column(j).path}; "
                                     "pass --num-items explicitly")
                hi = max(hi, int(st.max))
    return hi + 1
