"""Karmarkar-Karp (largest differencing) partitioning into R equal-size parts.

The baseline the verl library uses to balance sequence lengths across data-parallel ranks
(``get_seqlen_balanced_partitions(..., equal_size=True)``), re-implemented here from the algorithm
description (Karmarkar & Karp 1982, "The differencing method of set partitioning"; the k-way,
equal-size variant as described in verl's documentation), not copied:

1. Sort the step's ``N = R*B`` samples by cost and cut the sorted list into ``B`` consecutive
   chunks of ``R`` samples. Each chunk is a *partial partition*: R sets of one sample each.
2. Keep the partial partitions in a max-heap keyed on their *spread* (largest minus smallest set
   sum). Repeatedly pop the two with the largest spreads and merge them: with both sorted by set sum,
   the heaviest set of one joins the lightest set of the other, the second heaviest the second
   lightest, and so on. Push the merged partial partition back.
3. When one partial partition remains, its R sets are the ranks' batches; each has exactly B
   samples because every chunk contributed exactly one sample to every set.

Step 1 forces one sample from every sorted chunk of R onto every rank, which is why equal-size KK
leaves a large bubble on heavy tails where count-limited LPT does not (BACKGROUND.md).
"""

from __future__ import annotations

import heapq

import numpy as np

from fsdata.errors import ConfigError


def kk_equal_size(costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Equal-size Karmarkar-Karp assignment of one step.

    Args:
        costs: shape ``[R*B]``, float; one step's sample costs.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        shape ``[R*B]``, int32: rank of each sample; every rank gets exactly B samples. Ranks are
        numbered by decreasing load of the final partition (rank 0 is the heaviest).

    Raises:
        ConfigError: ``len(costs) != R*B``.
    """
    c = np.asarray(costs, dtype=np.float64)
    R, B = num_ranks, batch_size_per_rank
    if c.shape != (R * B,):
        raise ConfigError(f"kk_equal_size got {c.shape[0] if c.ndim == 1 else c.shape} costs; "
                          f"expected num_ranks*batch_size_per_rank = {R * B}")
    order = np.argsort(c, kind="stable")
    # A partial partition: (sums[R], members[R x m]) with sets sorted by decreasing sum.
    heap: list[tuple[float, int, np.ndarray, np.ndarray]] = []
    for k in range(B):
        idx = order[k * R:(k + 1) * R][::-1].copy()          # decreasing cost
        sums = c[idx]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), k, sums, idx[:, None]))
    tie = B
    while len(heap) > 1:
        _, _, s0, m0 = heapq.heappop(heap)
        _, _, s1, m1 = heapq.heappop(heap)
        sums = s0 + s1[::-1]                                  # heaviest with lightest
        members = np.concatenate([m0, m1[::-1]], axis=1)
        desc = np.argsort(-sums, kind="stable")
        sums, members = sums[desc], members[desc]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, members))
        tie += 1
    _, _, _, members = heap[0]
    out = np.empty(R * B, dtype=np.int32)
    out[members] = np.arange(R, dtype=np.int32)[:, None]
    return out


def kk_steps(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Equal-size Karmarkar-Karp for every step.

    Args:
        step_costs: shape ``[S x (R*B)]``, float.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        shape ``[S x (R*B)]``, int32.
    """
    c = np.asarray(step_costs, dtype=np.float64)
    out = np.empty(c.shape, dtype=np.int32)
    for s in range(c.shape[0]):
        out[s] = kk_equal_size(c[s], num_ranks, batch_size_per_rank)
    return out
