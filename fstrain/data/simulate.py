"""One process trains on each step's whole global batch: ``fstrain train --simulate-ranks``.

The loss of a step is ``sum of per-sample losses / global sample count`` and gradients are summed
over ranks (docs/fstrain.md, "The model"), so R ranks each holding their per-rank batch of step
``s`` compute the same update as one rank holding all R per-rank batches of step ``s``
concatenated (tested: ``test_two_ranks_over_shm_equal_one_rank_with_the_whole_global_batch``;
with ``--simulate-ranks``: ``tests/fstrain/test_evaluate.py``). This lets a machine with few
cores measure what an R-rank run *learns* from a balanced OUTPUT (``benchmarks/bench_quality.py``);
it says nothing about R-rank step *times* (use ``fstrain replay`` for those).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fstrain.data.batch import HISTORY_KEY, Batch, make_batch
from fstrain.data.manifest import load_manifest
from fstrain.data.reader import ShardReader


class GlobalBatchReader:
    """Yields one :class:`Batch` per step holding every rank's rows of that step (rank 0 first).

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder (any ``num_ranks``).
        start_step, max_steps, action_column: as :class:`fstrain.data.reader.ShardReader`.

    Raises:
        ShardError / ShardMismatchError: as :class:`fstrain.data.reader.ShardReader`, for any rank file.
    """

    def __init__(self, shards_dir: str, *, start_step: int = 0, max_steps: int | None = None,
                 action_column: str | None = None) -> None:
        self.manifest = load_manifest(shards_dir)
        self.readers = [ShardReader(shards_dir, r, None, start_step=start_step, max_steps=max_steps,
                                    num_prefetch_batches=0, action_column=action_column)
                        for r in range(self.manifest.num_ranks)]
        self.action_column = action_column

    def __len__(self) -> int:
        return len(self.readers[0])

    def __iter__(self) -> Iterator[Batch]:
        for parts in zip(*self.readers, strict=True):
            step = parts[0].step
            hist = [p.features[HISTORY_KEY] for p in parts]
            yield make_batch(np.concatenate([h.values().numpy() for h in hist]),
                             np.concatenate([h.lengths().numpy() for h in hist]),
                             np.concatenate([p.target_ids.numpy() for p in parts]),
                             np.concatenate([p.sample_ids.numpy() for p in parts]),
                             step, parts[0].global_num_samples,
                             sum(int(h.lengths().sum()) for h in hist),
                             np.concatenate([p.actions.numpy() for p in parts]) if self.action_column else None)
