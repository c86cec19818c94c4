"""Reading an ``fsdata balance`` OUTPUT: the manifest, one rank's steps as batches, ``ShardDataset``.

=================  =====================================================================
module             what it holds
=================  =====================================================================
``batch``          :class:`Batch` (a step's ids as a KeyedJaggedTensor, counts) and ``make_batch``
``manifest``       ``load_manifest``, world-size check, per-step counts, vocabulary size
``reader``         :class:`ShardReader`: one rank's steps, validated before any collective
``dataset``        :class:`ShardDataset`: the same as a ``torch.utils.data.IterableDataset``
                   with every column (for your own model)
``simulate``       :class:`GlobalBatchReader`: one process reads every rank's file of a step
=================  =====================================================================
"""

from fstrain.data.batch import HISTORY_KEY, TARGET_KEY, Batch, make_batch
from fstrain.data.dataset import JaggedColumn, ShardDataset, ShardStep, column_value
from fstrain.data.manifest import (check_world_size, infer_num_items, load_manifest, load_step_counts,
                                   load_step_tokens, steps_per_epoch)
from fstrain.data.reader import ShardReader
from fstrain.data.simulate import GlobalBatchReader

__all__ = ["HISTORY_KEY", "TARGET_KEY", "Batch", "GlobalBatchReader", "JaggedColumn", "ShardDataset", "ShardReader",
           "ShardStep", "check_world_size", "column_value", "infer_num_items", "load_manifest", "load_step_counts",
           "load_step_tokens", "make_batch", "steps_per_epoch"]
