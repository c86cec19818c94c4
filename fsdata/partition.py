"""Per-step assignment of samples to ranks (the Partitioner role).

Input of one step: the costs of its ``R*B`` samples (a global batch). Output: the rank of each
sample, exactly ``B`` per rank, chosen to minimise the most loaded rank (the straggler).

* ``shuffle``: today's practice, ``rank = position // B`` of the shuffled global batch.
* ``roundrobin``: sorted round-robin in snake order (:func:`fsdata.partition_fast.snake_steps`).
* ``kk``: equal-size Karmarkar-Karp as used by verl (:mod:`fsdata.kk`).
* ``lpt``: sorted longest-processing-time first respecting the per-rank count (Graham 1969):
  samples by decreasing cost, each to the least loaded rank that still has room. Pure Python heap;
  the reference the fast kernels are tested against.
* ``lpt-swap`` (default): the same LPT in a numba kernel, then a best-swap pass that lowers the
  straggler (:mod:`fsdata.partition_fast`); parallel over steps.
* ``lpt-swap-cpsat``: ``lpt-swap`` refined by CP-SAT neighbourhoods (:mod:`fsdata.cpsat`).

Large inputs: :func:`partition_steps` works through the steps in chunks of ``steps_per_chunk``,
and :func:`partition_steps_chunked` takes an iterable of step chunks, so only one chunk of costs
and ranks needs to be in memory at a time.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

import numpy as np

from fsdata.errors import ConfigError

METHODS = ("shuffle", "roundrobin", "kk", "lpt", "lpt-swap", "lpt-swap-cpsat")

#: Default method of :func:`partition_steps`.
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


def partition_steps(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int,
                    method: str = DEFAULT_METHOD, *, num_threads: int | None = None,
                    steps_per_chunk: int | None = None, max_swap_iters: int | None = None,
                    swap_tolerance: float | None = None, time_limit_seconds: float = 1.0,
                    num_light_ranks: int = 3) -> np.ndarray:
    """Assign the samples of many steps to ranks.

    Args:
        step_costs: shape ``[S x (R*B)]``, float64; row s holds step s's sample costs.
        num_ranks: R.
        batch_size_per_rank: B.
        method: one of :data:`METHODS` (module docstring); default ``lpt-swap``.
        num_threads: threads for ``lpt-swap`` (None: all cores).
        steps_per_chunk: steps per chunk (default: about :data:`DEFAULT_SAMPLES_PER_CHUNK`
            samples); bounds the temporaries of one call.
        max_swap_iters: ``lpt-swap`` exchange cap per step (default
            :data:`fsdata.partition_fast.DEFAULT_MAX_SWAP_ITERS`).
        swap_tolerance: ``lpt-swap`` stop distance to the step's lower bound, relative (default
            :data:`fsdata.partition_fast.DEFAULT_SWAP_TOLERANCE`).
        time_limit_seconds: ``lpt-swap-cpsat`` CP-SAT budget per step, seconds.
        num_light_ranks: ``lpt-swap-cpsat`` light ranks re-solved with the straggler.

    Returns:
        shape ``[S x (R*B)]``, int32: rank of each sample, exactly B per rank per step.

    Raises:
        ConfigError: unknown method, shape not ``[S x R*B]``, or bad settings.
    """
    c = np.asarray(step_costs, dtype=np.float64)
    if method not in METHODS:
        raise ConfigError(f"unknown partition method '{method}'; use one of {', '.join(METHODS)}")
    if c.ndim != 2 or c.shape[1] != num_ranks * batch_size_per_rank or num_ranks < 1 or batch_size_per_rank < 1:
        raise ConfigError(f"step_costs has shape {c.shape}; expected [steps x {num_ranks * batch_size_per_rank}] "
                          f"for num_ranks={num_ranks}, batch_size_per_rank={batch_size_per_rank}")
    if steps_per_chunk is None:
        steps_per_chunk = max(1, DEFAULT_SAMPLES_PER_CHUNK // max(1, c.shape[1]))
    if steps_per_chunk < 1:
        raise ConfigError(f"steps_per_chunk={steps_per_chunk} must be >= 1")
    out = np.empty(c.shape, dtype=np.int32)
    opts = dict(num_threads=num_threads, max_swap_iters=max_swap_iters, swap_tolerance=swap_tolerance,
                time_limit_seconds=time_limit_seconds, num_light_ranks=num_light_ranks)
    for start in range(0, c.shape[0], steps_per_chunk):
        stop = min(c.shape[0], start + steps_per_chunk)
        out[start:stop] = _partition_chunk(c[start:stop], num_ranks, batch_size_per_rank, method, **opts)
    return out


def _partition_chunk(c: np.ndarray, R: int, B: int, method: str, *, num_threads, max_swap_iters,
                     swap_tolerance, time_limit_seconds, num_light_ranks) -> np.ndarray:
    from fsdata import partition_fast as pf

    if method == "shuffle":
        return np.broadcast_to(partition_shuffle(c.shape[1], R, B), c.shape).copy()
    if method == "roundrobin":
        return pf.snake_steps(c, R, B)
    if method == "kk":
        from fsdata.kk import kk_steps

        return kk_steps(c, R, B)
    if method == "lpt":
        return np.stack([lpt_reference(row, R, B) for row in c]) if len(c) else np.empty(c.shape, dtype=np.int32)
    swap = {"max_swap_iters": pf.DEFAULT_MAX_SWAP_ITERS if max_swap_iters is None else max_swap_iters,
            "swap_tolerance": pf.DEFAULT_SWAP_TOLERANCE if swap_tolerance is None else swap_tolerance}
    ranks = pf.lpt_swap_steps(c, R, B, num_threads=num_threads, **swap)
    if method == "lpt-swap":
        return ranks
    from fsdata.cpsat import cpsat_refine_steps

    return cpsat_refine_steps(c, ranks, R, B, time_limit_seconds=time_limit_seconds,
                              num_light_ranks=num_light_ranks)


def partition_steps_chunked(step_cost_chunks: Iterable[np.ndarray], num_ranks: int, batch_size_per_rank: int,
                            method: str = DEFAULT_METHOD, **kwargs) -> Iterator[np.ndarray]:
    """Assign steps chunk by chunk, in bounded memory (for inputs larger than memory).

    Args:
        step_cost_chunks: iterable of arrays of shape ``[S_i x (R*B)]``, float64: consecutive chunks
            of steps (e.g. read from a costs file or generated on the fly).
        num_ranks: R.
        batch_size_per_rank: B.
        method: as in :func:`partition_steps`.
        **kwargs: as in :func:`partition_steps` (``num_threads``, ``max_swap_iters``, ...).

    Yields:
        shape ``[S_i x (R*B)]``, int32: the ranks of each chunk, in input order. Only the current
        chunk's costs and ranks are held.
    """
    for chunk in step_cost_chunks:
        yield partition_steps(chunk, num_ranks, batch_size_per_rank, method, **kwargs)


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
