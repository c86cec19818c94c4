"""Training an OUTPUT planned for R ranks on R' = R / k ranks, without re-planning (docs/fstrain.md,
"Changing the world size").

Rank ``r'`` of the smaller job reads the k rank files ``r'*k .. r'*k + k - 1`` and, at every step,
trains on their rows together: its batch is the concatenation of the k per-rank batches (``k x B``
samples under the fixed policy), in rank order. Each step's load stays balanced (a sum of k
balanced loads) and every sample is still trained once per epoch at the same step. A world size
that does not divide R is refused with the ``fsdata balance ... --from-step`` command that
re-plans the samples for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing

import numpy as np
import pyarrow as pa

from fsdata.errors import in_cli, setting
from fsdata.samples import schema
from fsdata.shards.manifest import Manifest
from fstrain.data.batch import Batch, make_batch
from fstrain.data.reader import ShardReader, _prefetch
from fstrain.errors import ShardMismatchError

#: Columns every merged step reads to build its :class:`~fstrain.data.batch.Batch`.
_BATCH_COLUMNS = [schema.SAMPLE_ID, schema.ITEM_IDS, schema.TARGET_ITEM_ID]


def merge_factor(manifest: Manifest, world_size: int) -> int:
    """k, the rank files each rank of a ``world_size`` job reads: ``num_ranks / world_size``.

    Raises:
        ShardMismatchError: ``world_size`` neither equals nor divides ``num_ranks`` (one line naming
            the ``fsdata balance OUTPUT NEW --ranks R' --from-step S`` command).
    """
    R = manifest.num_ranks
    if world_size >= 1 and R % world_size == 0:
        return R // world_size
    if in_cli():
        launch = f"launch with {setting('world_size', R)} or a divisor of {R}"
        reshard = f"fsdata balance {manifest.path} NEW --ranks {world_size} --from-step S"
    else:
        launch = f"launch {R} processes (or a divisor of {R}) and pass {setting('world_size', R, owner=None)}"
        reshard = (f"fsdata.balance('{manifest.path}', 'NEW', BalanceSettings(num_ranks={world_size}, from_step=S, "
                   "...)) (the command line: fsdata balance OUTPUT NEW --ranks R' --from-step S)")
    raise ShardMismatchError(
        f"{manifest.path} was written for {R} ranks but this job has world size {world_size}, which does not "
        f"divide {R}; {launch}, or re-plan the samples for it: {reshard} (S: the steps already trained, 0 for a "
        "fresh start) and train on NEW")


class MergedShardReader:
    """Rank ``rank`` of a ``world_size`` job reading k = R / world_size rank files per step.

    Iterates like :class:`~fstrain.data.reader.ShardReader` (one :class:`Batch` per step;
    :meth:`iter_steps` with extra columns); every sub-reader is a ``ShardReader`` of one of the
    rank files, which validates it.

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder planned for R ranks.
        rank: this process's rank ``r'`` in ``0 .. world_size - 1``.
        world_size: R', dividing R.
        start_step, max_steps, num_prefetch_batches, action_column: as
            :class:`~fstrain.data.reader.ShardReader`.

    Raises:
        ShardMismatchError: ``world_size`` does not divide R, ``rank`` outside the job, or the
            sub-readers' errors.
        ShardError: the sub-readers' errors.
    """

    def __init__(self, shards_dir: str, rank: int, world_size: int, *, start_step: int = 0,
                 max_steps: int | None = None, num_prefetch_batches: int = 2, action_column: str | None = None) -> None:
        first = ShardReader(shards_dir, 0, None, start_step=start_step, max_steps=max_steps, num_prefetch_batches=0,
                            action_column=action_column)
        self.manifest = first.manifest
        self.k = merge_factor(self.manifest, world_size)
        if not 0 <= rank < world_size:
            raise ShardMismatchError(f"rank {rank} is outside 0..{world_size - 1} of this job")
        self.rank, self.world_size = rank, world_size
        self.ranks = list(range(rank * self.k, (rank + 1) * self.k))
        self.readers = [first if r == 0 else ShardReader(shards_dir, r, None, start_step=start_step,
                                                         max_steps=max_steps, num_prefetch_batches=0,
                                                         action_column=action_column)
                        for r in self.ranks]
        self.action_column = action_column
        self.num_prefetch_batches = num_prefetch_batches
        self.start_step, self.end_step = first.start_step, first.end_step
        self.local_counts = sum(r.local_counts for r in self.readers)
        self.global_counts = first.global_counts
        self.path = self.readers[0].path
        self._file = self.readers[0]._file

    has_token_counts = property(lambda self: self.readers[0].has_token_counts)
    global_token_counts = property(lambda self: self.readers[0].global_token_counts)
    epochs = property(lambda self: self.manifest.epochs)
    steps_per_epoch = property(lambda self: self.manifest.steps_per_epoch)
    epoch_num_steps = property(lambda self: self.manifest.epoch_num_steps)

    def __len__(self) -> int:
        return self.end_step - self.start_step

    def _merged(self, columns: Sequence[str]) -> Iterator[tuple[Batch, pa.Table | None]]:
        act = self.action_column
        read = list(dict.fromkeys(_BATCH_COLUMNS + [c for c in [*columns, *([act] if act else [])]]))
        with ExitStack() as stack:
            its = [stack.enter_context(closing(r.iter_steps(read))) for r in self.readers]
            for parts in zip(*its, strict=True):
                first = parts[0][0]
                t = pa.concat_tables([p[1] for p in parts])
                hist = t.column(schema.ITEM_IDS).combine_chunks()
                lengths = hist.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
                batch = make_batch(hist.flatten().to_numpy(zero_copy_only=False), lengths,
                                   t.column(schema.TARGET_ITEM_ID).to_numpy(), t.column(schema.SAMPLE_ID).to_numpy(),
                                   first.step, first.global_num_samples, first.global_num_tokens,
                                   t.column(act).combine_chunks().flatten().to_numpy(zero_copy_only=False)
                                   if act else None)
                yield batch, (t.select(list(columns)) if columns else None)

    def __iter__(self) -> Iterator[Batch]:
        with closing(self.iter_steps()) as steps:
            for batch, _ in steps:
                yield batch

    def iter_steps(self, columns: Sequence[str] = ()) -> Iterator[tuple[Batch, pa.Table | None]]:
        """As :meth:`fstrain.data.reader.ShardReader.iter_steps`: each step's merged
        :class:`Batch` (the k rank files' rows, in rank order) and its rows of ``columns``."""
        if self.num_prefetch_batches <= 0:
            yield from self._merged(list(columns))
            return
        yield from _prefetch(self._merged(list(columns)), self.num_prefetch_batches)


def open_rank_reader(shards_dir: str, rank: int, world_size: int | None, **kw) -> ShardReader | MergedShardReader:
    """The reader of ``rank`` in a ``world_size`` job: a :class:`~fstrain.data.reader.ShardReader`
    when the OUTPUT was planned for ``world_size`` ranks (or ``world_size`` is None), else a
    :class:`MergedShardReader` (``world_size`` dividing R).

    Raises:
        ShardMismatchError: ``world_size`` does not divide R (:func:`merge_factor`).
    """
    if world_size is None:
        return ShardReader(shards_dir, rank, world_size, **kw)
    from fstrain.data.manifest import load_manifest  # noqa: PLC0415

    if load_manifest(shards_dir).num_ranks == world_size:
        return ShardReader(shards_dir, rank, world_size, **kw)
    return MergedShardReader(shards_dir, rank, world_size, **kw)
