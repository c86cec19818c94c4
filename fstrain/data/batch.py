"""One rank's per-step batch (:class:`Batch`) and its KJT keys.

Kept apart from :mod:`fstrain.data` (the shard reader) so that the model and the pipelines depend
on the batch type only, not on Parquet reading. ``from fstrain.data import Batch`` still works.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from fsdata.samples import schema

#: KJT keys of a batch: the history and the label (one id per sample), looked up in one table.
HISTORY_KEY = schema.ITEM_IDS
TARGET_KEY = schema.TARGET_ITEM_ID


@dataclass(slots=True)
class Batch(Pipelineable):
    """One rank's per-step batch; a torchrec ``Pipelineable`` (``to``, ``record_stream``, ``pin_memory``).

    Attributes:
        features: KJT with keys ``item_ids`` (the histories, lengths ``[B]``, ``T`` values) and
            ``target_item_id`` (one id per sample), int64 ids; model code may append keys
            (e.g. shared negatives, see :func:`fstrain.models.negatives.with_negatives`).
        target_ids: shape ``[B]``, int64: the next item of each sample (the label).
        sample_ids: shape ``[B]``, int64.
        step: the step number (0-based, same on every rank).
        num_samples: B, this rank's count in this step.
        global_num_samples: the step's count over all ranks (loss normaliser of the last-position
            objective).
        global_num_tokens: the step's history items over all ranks: the supervised positions of
            the all-position objective (its loss normaliser); -1 when the shards do not record it
            (outputs of fsdata < 0.3), then a world-size-1 run uses its own count.
        actions: ``[T]`` int64, the action feature column's value at every history position
            (aligned with ``features["item_ids"].values()``, the model's action input,
            ``Config.action_column``); None without one.
    """

    features: KeyedJaggedTensor
    target_ids: torch.Tensor
    sample_ids: torch.Tensor
    step: int
    num_samples: int
    global_num_samples: int
    global_num_tokens: int = -1
    actions: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        """Copy to ``device`` (a new :class:`Batch`; ints stay on the host)."""
        return Batch(self.features.to(device=device, non_blocking=non_blocking),
                     self.target_ids.to(device=device, non_blocking=non_blocking),
                     self.sample_ids.to(device=device, non_blocking=non_blocking),
                     self.step, self.num_samples, self.global_num_samples, self.global_num_tokens,
                     None if self.actions is None else self.actions.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as used by ``stream`` (CUDA only)."""
        self.features.record_stream(stream)
        self.target_ids.record_stream(stream)
        self.sample_ids.record_stream(stream)
        if self.actions is not None:
            self.actions.record_stream(stream)

    def pin_memory(self) -> "Batch":
        """Page-locked copy for asynchronous host-to-device transfer."""
        return Batch(self.features.pin_memory(), self.target_ids.pin_memory(), self.sample_ids.pin_memory(),
                     self.step, self.num_samples, self.global_num_samples, self.global_num_tokens,
                     None if self.actions is None else self.actions.pin_memory())

    @property
    def lengths(self) -> torch.Tensor:
        """History lengths, shape ``[B]``, int64 (a view into the KJT)."""
        return self.features[HISTORY_KEY].lengths()


def make_batch(item_values: np.ndarray, lengths: np.ndarray, targets: np.ndarray, sample_ids: np.ndarray,
               step: int, global_num_samples: int, global_num_tokens: int = -1,
               actions: np.ndarray | None = None) -> Batch:
    """Build a :class:`Batch` from flat numpy arrays.

    Args:
        item_values: shape ``[T]``, int64: histories concatenated.
        lengths: shape ``[B]``, int64: history lengths (sum = T).
        targets: shape ``[B]``, int64.
        sample_ids: shape ``[B]``, int64.
        step: the step number.
        global_num_samples: the step's count over all ranks.
        global_num_tokens: the step's history items over all ranks (-1: unknown).
        actions: shape ``[T]``, integer: the action column aligned with ``item_values`` (or None).

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
                 int(step), B, int(global_num_samples), int(global_num_tokens),
                 None if actions is None else torch.from_numpy(np.array(actions, dtype=np.int64)))


__all__ = ["HISTORY_KEY", "TARGET_KEY", "Batch", "make_batch"]
