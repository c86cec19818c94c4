"""Reading one rank's shard of an ``fsdata balance`` output (docs/format.md, format_version 4, 3, 2 and 1).

:class:`ShardReader` opens the rank's file listed in the manifest (v2: ``rank-XXXXX/part-00000.parquet``),
checks it against ``_manifest.json`` and ``_step_stats.parquet`` (v1: ``manifest.json``,
``_step_stats.parquet``, read through :class:`fsdata.shards.manifest.Manifest`) *before* any collective can run, streams
its row groups (a row group holds whole steps, so memory is bounded by one row group) and yields one
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.autograd.profiler import record_function


from fsdata.samples import schema
from fstrain.data.batch import Batch, make_batch
from fstrain.errors import ShardError, ShardMismatchError
from fstrain.data.manifest import (check_feature_column, check_world_size, file_plan_digest, load_manifest,
                                   load_step_counts, load_step_tokens, plan_digest)

logger = logging.getLogger(__name__)

_READ_COLUMNS = [schema.STEP, schema.SAMPLE_ID, schema.ITEM_IDS, schema.TARGET_ITEM_ID]


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
        action_column: a list column of integers aligned with ``item_ids`` (a feature column,
            manifest ``feature_columns``) carried as :attr:`Batch.actions`; None: none.

    Raises:
        ShardMismatchError: version or world-size mismatch, or ``start_step`` out of range.
        ShardError: missing, truncated or corrupt files, or counts that disagree; an action column
            that is missing, not a list of integers, or not aligned with ``item_ids``.
    """

    def __init__(self, shards_dir: str, rank: int, world_size: int | None, *, start_step: int = 0,
                 max_steps: int | None = None, num_prefetch_batches: int = 2,
                 action_column: str | None = None) -> None:
        self.action_column = action_column
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
            raise ShardError(f"rank {self.rank}: {path} not found; "
                             "re-run fsdata balance or copy the whole OUTPUT") from None
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
        self._check_identity(pf)
        if self.action_column is not None:
            check_feature_column(pf.schema_arrow, self.action_column, f"rank {self.rank}: {path}")
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

    def _check_identity(self, pf: pq.ParquetFile) -> None:
        """This rank's file is of this output and this rank: its ``fsdata.plan_digest`` equals the
        output's (:func:`~fstrain.data.manifest.plan_digest`) and its ``rank`` column statistics say
        this rank (the values are checked again while reading, :meth:`_decode`).

        Raises:
            ShardError: a rank file of another output or of another rank (e.g. copied over this one).
        """
        m, path = self.manifest, self.path
        got = file_plan_digest(pf)
        want = plan_digest(m) if got is not None or isinstance(m.extra.get("plan_digest"), str) else None
        if want is not None and got != want:
            raise ShardError(f"rank {self.rank}: {path} was written from plan {got} but {m.path} is plan {want}: "
                             "a rank file of another output; copy the whole OUTPUT again or re-run fsdata balance")
        self._rank_col = schema.RANK if schema.RANK in pf.schema_arrow.names else None
        if self._rank_col is None:
            return  # format version 1: the rank is the folder name only
        col = _leaf_index(pf, schema.RANK)
        for i in range(pf.metadata.num_row_groups):
            st = pf.metadata.row_group(i).column(col).statistics
            if st is not None and st.has_min_max and not int(st.min) == int(st.max) == self.rank:
                raise ShardError(f"rank {self.rank}: {path} holds rows of rank {int(st.min)}..{int(st.max)} (its "
                                 f"`rank` column): a rank file copied over another; copy the whole OUTPUT again "
                                 "or re-run fsdata balance")

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
        act = self.action_column
        read = _READ_COLUMNS + [c for c in [*columns, *([act] if act else [])] if c not in _READ_COLUMNS]
        if self._rank_col and self._rank_col not in read:
            read.append(self._rank_col)
        read = list(dict.fromkeys(read))
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
            actions = None
            if act:
                acol = t.column(act).combine_chunks()
                if not np.array_equal(acol.value_lengths().to_numpy(zero_copy_only=False), lengths):
                    raise ShardError(f"rank {self.rank}: {self.path} row group {i}: {act} is not aligned with "
                                     f"item_ids (list lengths differ); re-run fsdata convert --feature-cols")
                actions = acol.flatten().to_numpy(zero_copy_only=False)
            targets = t.column(schema.TARGET_ITEM_ID).to_numpy()
            sids = t.column(schema.SAMPLE_ID).to_numpy()
            if self._rank_col and (t.column(self._rank_col).to_numpy() != self.rank).any():
                raise ShardError(f"rank {self.rank}: {self.path} row group {i} holds rows of another rank (its "
                                 "`rank` column): a rank file copied over another; copy the whole OUTPUT again "
                                 "or re-run fsdata balance")
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
                                       -1 if self._global_tokens is None else int(self._global_tokens[s]),
                                       None if actions is None else actions[offsets[a]:offsets[b]])
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
