"""``ShardDataset``: one rank's shard as a ``torch.utils.data.IterableDataset`` with every column.

For users who bring their own model and training loop: ``DataLoader(ShardDataset(...),
batch_size=None, num_workers=0 or 1, pin_memory=True)`` yields one :class:`ShardStep` per step,
in step order: the :class:`~fstrain.data.batch.Batch` that fstrain's own model reads (ids as a
KeyedJaggedTensor, targets, sample ids, counts) plus ``columns``, every column of the rank file
converted as follows (``B`` = samples of this rank in this step, ``T`` = total list elements):

================================  =============================================================
Arrow type of the column          value in ``ShardStep.columns[name]``
================================  =============================================================
integer, floating point, boolean  ``torch.Tensor`` of shape ``[B]``, the same dtype
list / large_list of those        :class:`JaggedColumn`: ``values`` ``[T]`` (same dtype) and
                                  ``offsets`` ``[B + 1]`` int64 (row ``i`` is
                                  ``values[offsets[i]:offsets[i + 1]]``)
anything else (strings, structs,  ``pyarrow.Array`` of length ``B``, unchanged (not pinned,
nested lists, dates, nulls)       not moved by ``to``)
================================  =============================================================

Reading, validation, resume and prefetching are :class:`~fstrain.data.reader.ShardReader`'s; this
module only converts the extra columns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from fsdata.samples import schema
from fstrain.data.batch import Batch
from fstrain.errors import ConfigError, ShardError
from fstrain.data.reader import _prefetch

logger = logging.getLogger(__name__)


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
    """One step of one rank: fstrain's :class:`~fstrain.data.batch.Batch` plus every requested column.

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
    :class:`~fstrain.errors.ConfigError` at the first step). With ``num_workers=1`` the reading and conversion run in
    one worker process, with ``num_prefetch_batches`` decoded ahead there. More than one worker is refused: each worker
    would yield the whole shard, duplicating every step. Without an accelerator
    ``pin_memory=True`` only makes torch warn and skip pinning.

    The shards are validated at construction (in the main process), and again by each iteration.
    The dataset holds only its arguments, so it pickles for ``spawn`` workers; each iteration
    opens the rank file anew (iterating twice gives two epochs of the same order).

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder.
        rank: the rank whose shard to read.
        world_size: the job's world size, checked against the manifest (``None``: no check); one
            that divides the manifest's R makes each rank read ``k = R / world_size`` rank files per
            step (:mod:`fstrain.data.merge`: ranks ``rank*k .. rank*k + k - 1``, a ``k x B`` batch).
        columns: the columns to carry in :attr:`ShardStep.columns`; ``None``: every column of
            the rank file except ``step`` (the ids too, so a model can ignore the Batch).
        start_step: first step to yield (resume after ``start_step`` completed steps).
        max_steps: yield at most this many steps (``None``: to the end).
        num_prefetch_batches: steps decoded and converted ahead on a background thread
            (0: synchronous), in the worker process when ``num_workers=1``.

    Raises:
        ShardError, ShardMismatchError: as :class:`~fstrain.data.reader.ShardReader`, and a requested
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
        from fstrain.data.merge import open_rank_reader  # a world size dividing R: k rank files per rank

        return open_rank_reader(k["shards_dir"], k["rank"], k["world_size"], start_step=k["start_step"],
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
