"""Per-step assignment of samples to ranks (the Partitioner role).

Input of one step: the costs of its ``R*B`` samples (a global batch). Output: the rank of each
sample, exactly ``B`` per rank, chosen to minimise the most loaded rank (the straggler).

* ``shuffle``: today's practice, ``rank = position // B`` of the shuffled global batch.
* ``lpt``: sorted longest-processing-time first respecting the per-rank count (Graham 1969):
  samples by decreasing cost, each to the least loaded rank that still has room.
"""

from __future__ import annotations

import heapq

import numpy as np

from fsdata.errors import ConfigError

METHODS = ("shuffle", "lpt")


def partition_shuffle(num_samples: int, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Equal-count contiguous cut of a shuffled global batch (the DistributedSampler baseline).

    Returns:
        shape ``[R*B]``, int32: ``position // B``.
    """
    assert num_samples == num_ranks * batch_size_per_rank
    return (np.arange(num_samples) // batch_size_per_rank).astype(np.int32)


def lpt_reference(costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Plain sorted LPT with a per-rank count limit (pure Python heap; the reference).

    Args:
        costs: shape ``[R*B]``, float; one step's sample costs.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        shape ``[R*B]``, int32: rank of each sample; every rank gets exactly B samples.
        Ties are broken by the lower rank, then the earlier sample, so the result is deterministic.
    """
    c = np.asarray(costs, dtype=np.float64)
    assert c.shape == (num_ranks * batch_size_per_rank,), c.shape
    order = np.argsort(-c, kind="stable")
    heap = [(0.0, r) for r in range(num_ranks)]
    counts = [0] * num_ranks
    out = np.empty(len(c), dtype=np.int32)
    for i in order:
        load, r = heapq.heappop(heap)
        out[i] = r
        counts[r] += 1
        if counts[r] < batch_size_per_rank:
            heapq.heappush(heap, (load + c[i], r))
    return out


def partition_steps(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int,
                    method: str = "lpt") -> np.ndarray:
    """Assign the samples of many steps to ranks.

    Args:
        step_costs: shape ``[S x (R*B)]``, float64; row s holds step s's sample costs.
        num_ranks: R.
        batch_size_per_rank: B.
        method: one of :data:`METHODS`.

    Returns:
        shape ``[S x (R*B)]``, int32: rank of each sample, exactly B per rank per step.

    Raises:
        ConfigError: unknown method.
    """
    c = np.asarray(step_costs, dtype=np.float64)
    if method == "shuffle":
        return np.broadcast_to(partition_shuffle(c.shape[1], num_ranks, batch_size_per_rank), c.shape).copy()
    if method == "lpt":
        return np.stack([lpt_reference(row, num_ranks, batch_size_per_rank) for row in c]) if len(c) else \
            np.empty(c.shape, dtype=np.int32)
    raise ConfigError(f"unknown partition method '{method}'; use one of {', '.join(METHODS)}")


def per_rank_loads(step_costs: np.ndarray, ranks: np.ndarray, num_ranks: int) -> np.ndarray:
    """Per-rank total cost of each step.

    Args:
        step_costs: shape ``[S x N]``, float.
        ranks: shape ``[S x N]``, int; rank of each sample.
        num_ranks: R.

    Returns:
        shape ``[S x R]``, float64.
    """
    S = step_costs.shape[0]
    flat = (np.arange(S)[:, None] * num_ranks + ranks).ravel()
    return np.bincount(flat, weights=np.asarray(step_costs, dtype=np.float64).ravel(),
                       minlength=S * num_ranks).reshape(S, num_ranks)
