"""Per-step assignment of samples to ranks: the plain reference algorithms.

The role itself (one ``Partitioner`` base, implementations registered by name,
:func:`~fsdata.balancer.partitioners.names` the one list of them, and
:func:`~fsdata.balancer.partitioners.partition_steps`) is :mod:`fsdata.balancer.partitioners`;
the registered names below are those of the algorithms here and beside this module.

Input of one step: the costs of its ``R*B`` samples (a global batch). Output: the rank of each
sample, exactly ``B`` per rank, chosen to minimise the most loaded rank (the straggler).

* ``shuffle``: today's practice, ``rank = position // B`` of the shuffled global batch.
* ``roundrobin``: sorted round-robin in snake order (:func:`fsdata.balancer.partition_fast.snake_steps`).
* ``kk``: equal-size Karmarkar-Karp as used by verl (:mod:`fsdata.balancer.kk`).
* ``lpt``: sorted longest-processing-time first respecting the per-rank count (Graham 1969):
  samples by decreasing cost, each to the least loaded rank that still has room. Pure Python heap;
  the reference the fast kernels are tested against.
* ``lpt-swap`` (default): the same LPT in a numba kernel, then a best-swap pass that lowers the
  straggler (:mod:`fsdata.balancer.partition_fast`); parallel over steps.
* ``lpt-swap-cpsat``: ``lpt-swap`` refined by CP-SAT neighbourhoods (:mod:`fsdata.balancer.cpsat`).

Large inputs: :func:`~fsdata.balancer.partitioners.partition_steps` works through the steps in
chunks of ``steps_per_chunk``, and :func:`~fsdata.balancer.partitioners.partition_steps_chunked`
takes an iterable of step chunks, so only one chunk of costs and ranks needs to be in memory at a time.
"""

from __future__ import annotations

import heapq

import numpy as np


#: Default method of :func:`fsdata.balancer.partitioners.partition_steps`.
DEFAULT_METHOD = "lpt-swap"

#: Default samples per chunk when :func:`partition_steps` works through a large input (~4M samples:
#: 32 MiB of costs plus 16 MiB of ranks per chunk).
DEFAULT_SAMPLES_PER_CHUNK = 1 << 22


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
