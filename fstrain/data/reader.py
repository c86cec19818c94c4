"""Reading one rank's shard of an ``fsdata balance`` output (docs/format.md, format_version 2 and 1).

:class:`ShardReader` opens the rank's file listed in the manifest (v2: ``rank-XXXXX/part-00000.parquet``),
checks it against ``_manifest.json`` and ``_step_stats.parquet`` (v1: ``manifest.json``,
``_step_stats.parquet``, read through :class:`fsdata.shards.manifest.Manifest`) *before* any collective can run, streams its row
groups (a row group holds whole steps, so memory is bounded by one row group) and yields one
:class:`Batch` per step: the item histories as a jagged :class:`KeyedJaggedTensor` (no padding),
the targets, this rank's sample count and the step's global sample count (for loss
normalisation under the ``cost-budget`` policy, where counts vary per rank).

Notation: ``B`` = samples of this rank in this step (varies under ``cost-budget``),
``T`` = total history items of the batch (``sum of lengths``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.autograd.profiler import record_function

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from fsdata import fsio
from fsdata.samples import schema
from fsdata.shards.manifest import Manifest, ManifestError
from fstrain.batch import HISTORY_KEY, TARGET_KEY, Batch, make_batch  # re-exported: fstrain.data.Batch keeps working
from fsdata.errors import command, in_cli, setting
from fstrain.errors import ConfigError, ShardError, ShardMismatchError

logger = logging.getLogger(__name__)

_READ_COLUMNS = [schema.STEP, schema.SAMPLE_ID, schema.ITEM_IDS, schema.TARGET_ITEM_ID]


def load_manifest(shards_dir: str) -> Manifest:
    """Read and validate an OUTPUT's manifest (``_manifest.json``; v1 ``manifest.json``) with
    :meth:`fsdata.shards.manifest.Manifest.read`, the one reader of the format.

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder.

    Returns:
        The parsed :class:`fsdata.shards.manifest.Manifest` (``files[r].path`` / ``.num_rows``,
        :meth:`~fsdata.shards.manifest.Manifest.rank_file`).

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


def _step_rank_matrix(manifest: Manifest, column: str) -> np.ndarray:
    """One ``_step_stats.parquet`` column as a ``[S x R]`` int64 matrix, every (step, rank) once.

    Raises:
        ShardError: the file is missing or unreadable, lacks ``column``, or does not cover every
            (step, rank) exactly once.
    """
    S, R = manifest.num_steps, manifest.num_ranks
    stats_path = manifest.step_stats_path()
    try:
        t = manifest.read_step_stats(columns=["step", "rank", column])
    except ManifestError as e:
        raise ShardError(str(e)) from None
    step = t.column("step").to_numpy().astype(np.int64)
    rank = t.column("rank").to_numpy().astype(np.int64)
    if len(step) != S * R or step.min(initial=0) < 0 or step.max(initial=0) >= S or rank.max(initial=0) >= R:
        raise ShardError(f"{stats_path}: {len(step)} rows but num_steps {S} x num_ranks {R} = {S * R} "
                         "(one per step and rank) expected; re-run fsdata balance")
    out = np.zeros((S, R), dtype=np.int64)
    out[step, rank] = t.column(column).to_numpy().astype(np.int64)
    return out


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
    stats_path = manifest.step_stats_path()
    if manifest.batch_policy == "fixed" and not fsio.exists(stats_path):
        return np.full((S, R), manifest.batch_size_per_rank, dtype=np.int64)
    counts = _step_rank_matrix(manifest, "num_samples")
    if (counts < 1).any():
        s, r = map(int, np.argwhere(counts < 1)[0])
        raise ShardError(f"{stats_path}: step {s} rank {r} has {counts[s, r]} samples (at least 1 required); "
                         "re-run fsdata balance")
    return counts


def load_step_tokens(manifest: Manifest) -> np.ndarray | None:
    """Per-(step, rank) history tokens: the ``num_tokens`` column of ``_step_stats.parquet`` (the sum
    of the samples' ``seq_len`` = ``len(item_ids)``; written since fsdata 0.3).

    Args:
        manifest: a loaded manifest (local or object-store OUTPUT).

    Returns:
        shape ``[S x R]``, int64; None when the output predates the column (or has no step stats).

    Raises:
        ShardError: the step stats are unreadable or do not cover every (step, rank) exactly once.
    """
    stats_path = manifest.step_stats_path()
    if not fsio.exists(stats_path):
        return None
    try:
        fs, where = fsio.filesystem_and_path(stats_path)
        names = pq.read_schema(where, filesystem=fs).names
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"{stats_path} is unreadable ({e}); re-run fsdata balance") from None
    if "num_tokens" not in names:
        return None
    return _step_rank_matrix(manifest, "num_tokens")


def check_world_size(manifest: Manifest, world_size: int) -> None:
    """Raise :class:`ShardMismatchError` unless the shards were written for ``world_size`` ranks."""
    if world_size != manifest.num_ranks:
        n = manifest.num_ranks
        launch = (f"launch with {setting('world_size', n)} (or nodes x procs = {n})" if in_cli() else
                  f"launch {n} processes and pass {setting('world_size', n, owner=None)}")
        raise ShardMismatchError(
            f"{manifest.path} was written for {n} ranks but this job has world size {world_size}; {launch} or "
            f"re-run {command('balance')} with {setting('num_ranks', world_size)}")


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
        tokens = load_step_tokens(m)
        self._global_tokens = None if tokens is None else tokens.sum(axis=1)
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

    @property
    def has_token_counts(self) -> bool:
        """Whether the step stats carry ``num_tokens`` (outputs of fsdata >= 0.3)."""
        return self._global_tokens is not None

    @property
    def global_token_counts(self) -> np.ndarray:
        """Per-step GLOBAL history tokens: shape ``[S]`` int64, the sum over all ranks of the step's
        samples' ``seq_len`` (``len(item_ids)``) from ``_step_stats.parquet``'s ``num_tokens``; the
        all-position loss's normaliser (supervised positions of the whole global batch).

        Raises:
            ShardError: the output predates the ``num_tokens`` column (fsdata < 0.3).
        """
        if self._global_tokens is None:
            raise ShardError(f"{self.manifest.step_stats_path()} has no num_tokens column (written by fsdata < 0.3); "
                             "the all-position loss needs each step's global token count: re-run fsdata balance "
                             "with fsdata >= 0.3")
        return self._global_tokens

    @property
    def epochs(self) -> int:
        """E, the epochs the shards hold (manifest ``epochs``; 1 when absent)."""
        return self.manifest.epochs

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch (manifest ``steps_per_epoch``; ``num_steps`` when absent; the nominal
        ``round(num_steps / epochs)`` under cost-budget with unequal epochs)."""
        return self.manifest.steps_per_epoch

    @property
    def epoch_num_steps(self) -> list[int]:
        """Steps of each epoch (E ints summing to ``num_steps``; exact under cost-budget too)."""
        return self.manifest.epoch_num_steps

    def __len__(self) -> int:
        return self.end_step - self.start_step

    def _decode(self, columns: Sequence[str] = ()) -> Iterator[tuple[Batch, pa.Table | None]]:
        expect = self.start_step
        read = _READ_COLUMNS + [c for c in columns if c not in _READ_COLUMNS]
        for i in self._row_groups:
            with record_function("## read_row_group ##"):
                try:
                    t = self._file.read_row_group(i, columns=read)
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
                    batch = make_batch(values[offsets[a]:offsets[b]], lengths[a:b], targets[a:b], sids[a:b],
                                       s, int(self.global_counts[s]),
                                       -1 if self._global_tokens is None else int(self._global_tokens[s]))
                yield batch, (t.slice(a, b - a).select(list(columns)) if columns else None)
                expect = s + 1
        if expect != self.end_step:
            raise ShardError(f"rank {self.rank}: {self.path} ends at step {expect - 1}, expected "
                             f"{self.end_step - 1}; re-run fsdata balance")

    def __iter__(self) -> Iterator[Batch]:
        with closing(self.iter_steps()) as steps:  # closing joins the prefetch thread on `break`
            for batch, _ in steps:
                yield batch

    def iter_steps(self, columns: Sequence[str] = ()) -> Iterator[tuple[Batch, pa.Table | None]]:
        """Like iterating the reader, but also yields each step's rows of ``columns``.

        Args:
            columns: names of columns of the rank file to carry (any column, e.g. ``user_id``,
                ``timestamps`` or a user's own feature columns); empty: none.

        Yields:
            ``(batch, table)``: the step's :class:`Batch` and a ``pyarrow.Table`` with ``B`` rows,
            the requested columns in the given order, rows in the batch's order (``None`` when
            ``columns`` is empty). Zero-copy slices of the row group.

        Raises:
            ShardError: a requested column is not in the rank file, or the errors of iteration.
        """
        columns = list(columns)
        names = self._file.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ShardError(f"rank {self.rank}: {self.path} has no columns {missing}; it has {names}")
        if self.num_prefetch_batches <= 0:
            yield from self._decode(columns)
            return
        yield from _prefetch(self._decode(columns), self.num_prefetch_batches)


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
        except FileNotFoundError:
            raise ShardError(f"rank {r}: {path} is missing; the OUTPUT is incomplete: copy the whole OUTPUT "
                             "or re-run fsdata balance") from None
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


# ---- ShardDataset --------------------------------------------------------------------------------
# ``ShardDataset``: one rank's shard as a ``torch.utils.data.IterableDataset`` with every column.
#
# For users who bring their own model and training loop: ``DataLoader(ShardDataset(...),
# batch_size=None, num_workers=0 or 1, pin_memory=True)`` yields one :class:`ShardStep` per step,
# in step order: the :class:`~fstrain.data.Batch` that fstrain's own model reads (ids as a
# KeyedJaggedTensor, targets, sample ids, counts) plus ``columns``, every column of the rank file
# converted as follows (``B`` = samples of this rank in this step, ``T`` = total list elements):
#
# ================================  =============================================================
# Arrow type of the column          value in ``ShardStep.columns[name]``
# ================================  =============================================================
# integer, floating point, boolean  ``torch.Tensor`` of shape ``[B]``, the same dtype
# list / large_list of those        :class:`JaggedColumn`: ``values`` ``[T]`` (same dtype) and
#                                   ``offsets`` ``[B + 1]`` int64 (row ``i`` is
#                                   ``values[offsets[i]:offsets[i + 1]]``)
# anything else (strings, structs,  ``pyarrow.Array`` of length ``B``, unchanged (not pinned,
# nested lists, dates, nulls)       not moved by ``to``)
# ================================  =============================================================
#
# Reading, validation, resume and prefetching are :class:`~fstrain.data.ShardReader`'s; this
# module only converts the extra columns.

@dataclass(slots=True)
class JaggedColumn:
    """A list column of one step: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    Attributes:
        values: shape ``[T]``, the element dtype of the column (e.g. int64 for ``list<int64>``).
        offsets: shape ``[B + 1]``, int64, ``offsets[0] == 0``, ``offsets[B] == T``.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """Row lengths, shape ``[B]``, int64."""
        return self.offsets[1:] - self.offsets[:-1]

    def to_padded(self, pad_value: int | float | bool = 0) -> torch.Tensor:
        """The rows as one dense tensor, each padded on the right with ``pad_value``.

        For models that take ``[B x L]`` input (attention with a mask, ``nn.Embedding`` with a
        ``padding_idx``); ``nn.EmbeddingBag`` reads ``values`` / ``offsets`` directly, unpadded.

        Args:
            pad_value: fills the positions after each row's end (cast to ``values.dtype``; pick
                one that cannot be a real value, e.g. an id outside the vocabulary).

        Returns:
            Shape ``[B x L]``, ``values.dtype``, on ``values.device``; ``L`` = the longest row of
            this step (0 when every row is empty); ``out[i, :lengths[i]]`` is row ``i``. The
            padding mask is ``torch.arange(L) < lengths[:, None]``.
        """
        lengths = self.lengths
        num_rows = lengths.numel()
        width = int(lengths.max()) if num_rows else 0
        out = torch.full((num_rows, width), pad_value, dtype=self.values.dtype, device=self.values.device)
        if self.values.numel():
            row = torch.repeat_interleave(torch.arange(num_rows, device=lengths.device), lengths)
            col = torch.arange(self.values.numel(), device=lengths.device) - self.offsets[:-1][row]
            out[row, col] = self.values
        return out

    def to(self, device: torch.device, non_blocking: bool = False) -> JaggedColumn:
        """Copy to ``device`` (a new :class:`JaggedColumn`)."""
        return JaggedColumn(self.values.to(device=device, non_blocking=non_blocking),
                            self.offsets.to(device=device, non_blocking=non_blocking))

    def pin_memory(self) -> JaggedColumn:
        """Page-locked copy (needs an accelerator, as ``torch.Tensor.pin_memory`` does)."""
        return JaggedColumn(self.values.pin_memory(), self.offsets.pin_memory())


@dataclass(slots=True)
class ShardStep:
    """One step of one rank: fstrain's :class:`~fstrain.data.Batch` plus every requested column.

    Attributes:
        batch: ids as a KeyedJaggedTensor, ``target_ids`` ``[B]``, ``sample_ids`` ``[B]``,
            ``step``, ``num_samples`` (B) and ``global_num_samples`` (the step's count over all
            ranks, the loss normaliser).
        columns: column name -> ``torch.Tensor`` ``[B]`` | :class:`JaggedColumn` |
            ``pyarrow.Array`` (module docstring), rows in the same order as ``batch``.
    """

    batch: Batch
    columns: dict[str, torch.Tensor | JaggedColumn | pa.Array]

    @property
    def step(self) -> int:
        """The step number (0-based, the same on every rank)."""
        return self.batch.step

    def to(self, device: torch.device, non_blocking: bool = False) -> ShardStep:
        """Copy tensors to ``device``; Arrow arrays stay where they are."""
        return ShardStep(self.batch.to(device, non_blocking),
                         {k: v if isinstance(v, pa.Array) else v.to(device=device, non_blocking=non_blocking)
                          for k, v in self.columns.items()})

    def pin_memory(self) -> ShardStep:
        """Page-locked copy, called by ``DataLoader(pin_memory=True)`` when an accelerator exists."""
        return ShardStep(self.batch.pin_memory(),
                         {k: v if isinstance(v, pa.Array) else v.pin_memory() for k, v in self.columns.items()})


def _refuse_automatic_batching(batch, *, collate_fn_map=None):
    raise ConfigError("ShardDataset yields whole per-rank batches (one ShardStep per step); create the "
                      "DataLoader with batch_size=None: DataLoader(ds, batch_size=None, num_workers=0 or 1)")


# A DataLoader's automatic batching (its default batch_size=1) hands ShardSteps to default_collate,
# which would fail with torch's own message; this entry makes that one clear ConfigError instead.
default_collate_fn_map[ShardStep] = _refuse_automatic_batching


def _is_plain(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _to_numpy(arr: pa.Array) -> np.ndarray:
    return arr.to_numpy(zero_copy_only=False, writable=True)  # writable: torch.from_numpy warns otherwise


def column_value(arr: pa.Array | pa.ChunkedArray) -> torch.Tensor | JaggedColumn | pa.Array:
    """Convert one step's column (module docstring's table).

    Args:
        arr: ``B`` rows of one column.

    Returns:
        A tensor ``[B]`` for integer/float/bool columns, a :class:`JaggedColumn` for lists of
        those, else the ``pyarrow.Array`` itself; columns holding nulls stay Arrow.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if arr.null_count == 0 and _is_plain(t):
        return torch.from_numpy(_to_numpy(arr))
    if (arr.null_count == 0 and (pa.types.is_list(t) or pa.types.is_large_list(t))
            and _is_plain(t.value_type)):
        flat = arr.flatten()  # respects the slice: only this step's elements
        if flat.null_count == 0:
            offsets = np.zeros(len(arr) + 1, dtype=np.int64)
            np.cumsum(_to_numpy(arr.value_lengths()), out=offsets[1:])
            return JaggedColumn(torch.from_numpy(_to_numpy(flat)), torch.from_numpy(offsets))
    return arr


class ShardDataset(IterableDataset):
    """One rank's shard as an ``IterableDataset``: one :class:`ShardStep` per step, in step order.

    Use with ``DataLoader(ds, batch_size=None, num_workers=0 or 1, pin_memory=True)`` (the dataset
    already yields whole per-rank batches; ``batch_size=None`` turns off the DataLoader's own
    batching, and a DataLoader left to batch, e.g. with its default ``batch_size=1``, raises
    :class:`~fstrain.errors.ConfigError` at the first step). With ``num_workers=1`` the reading and conversion run in one worker process, with
    ``num_prefetch_batches`` decoded ahead there. More than one worker is refused: each worker
    would yield the whole shard, duplicating every step. Without an accelerator
    ``pin_memory=True`` only makes torch warn and skip pinning.

    The shards are validated at construction (in the main process), and again by each iteration.
    The dataset holds only its arguments, so it pickles for ``spawn`` workers; each iteration
    opens the rank file anew (iterating twice gives two epochs of the same order).

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder.
        rank: the rank whose shard to read.
        world_size: the job's world size, checked against the manifest (``None``: no check).
        columns: the columns to carry in :attr:`ShardStep.columns`; ``None``: every column of
            the rank file except ``step`` (the ids too, so a model can ignore the Batch).
        start_step: first step to yield (resume after ``start_step`` completed steps).
        max_steps: yield at most this many steps (``None``: to the end).
        num_prefetch_batches: steps decoded and converted ahead on a background thread
            (0: synchronous), in the worker process when ``num_workers=1``.

    Raises:
        ShardError, ShardMismatchError: as :class:`~fstrain.data.ShardReader`, and a requested
            column that the rank file lacks.
        ConfigError: (when iterated) in a DataLoader with more than one worker, or with automatic
            batching (``batch_size`` not None).
    """

    def __init__(self, shards_dir: str, rank: int, world_size: int | None, *,
                 columns: Sequence[str] | None = None, start_step: int = 0, max_steps: int | None = None,
                 num_prefetch_batches: int = 2) -> None:
        super().__init__()
        self._kwargs = dict(shards_dir=shards_dir, rank=rank, world_size=world_size, start_step=start_step,
                            max_steps=max_steps, num_prefetch_batches=num_prefetch_batches)
        reader = self._reader()  # validate now, in the main process
        names = reader._file.schema_arrow.names
        if columns is None:
            columns = [c for c in names if c != schema.STEP]
        missing = [c for c in columns if c not in names]
        if missing:
            raise ShardError(f"rank {rank}: {reader.path} has no columns {missing}; it has {names}")
        self.columns: list[str] = list(columns)
        self._len = len(reader)

    def _reader(self, num_prefetch_batches: int | None = None):
        k = self._kwargs
        depth = k["num_prefetch_batches"] if num_prefetch_batches is None else num_prefetch_batches
        return ShardReader(k["shards_dir"], k["rank"], k["world_size"], start_step=k["start_step"],
                           max_steps=k["max_steps"], num_prefetch_batches=depth)

    def __len__(self) -> int:
        """Number of steps this dataset yields."""
        return self._len

    def _steps(self) -> Iterator[ShardStep]:
        with closing(self._reader(num_prefetch_batches=0).iter_steps(self.columns)) as steps:
            for batch, table in steps:
                yield ShardStep(batch, {name: column_value(table.column(name)) for name in self.columns})

    def __iter__(self) -> Iterator[ShardStep]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ConfigError(f"ShardDataset runs in one DataLoader worker, got num_workers={info.num_workers}; "
                              "use num_workers=0 or 1 (each worker would yield the whole shard)")
        depth = self._kwargs["num_prefetch_batches"]
        if depth <= 0:
            yield from self._steps()
            return
        yield from _prefetch(self._steps(), depth)
