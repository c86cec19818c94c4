"""The Partitioner role: one abstract base, one verb, implementations registered by name.

A partitioner takes the sample costs of many steps (each row one global batch of ``R*B`` samples)
and returns the rank of every sample, exactly ``B`` per rank per step, chosen to keep the most
loaded rank (the straggler) low. Planning (:func:`fsdata.balancer.plan.make_plan`) looks one up by
name (``--partitioner``) or takes an instance, as torchrec's ``EmbeddingShardingPlanner`` takes a
``Partitioner`` (``torchrec/distributed/planner/types.py``, ``planners.py``).

Registered names (:func:`get_partitioner`; the algorithms are in :mod:`fsdata.balancer.partition`,
:mod:`~fsdata.balancer.partition_fast`, :mod:`~fsdata.balancer.kk`, :mod:`~fsdata.balancer.cpsat`):

* ``shuffle``: ``rank = position // B`` of the shuffled global batch (today's practice);
* ``roundrobin``: sorted round-robin in snake order;
* ``kk``: equal-size Karmarkar-Karp (as used by verl);
* ``lpt``: sorted LPT with a per-rank count limit, pure Python (the reference);
* ``lpt-swap``: the same LPT in a numba kernel plus a best-swap pass (the fast one);
* ``lpt-swap-cpsat``: ``lpt-swap`` refined by CP-SAT neighbourhoods on every step;
* ``auto``: ``lpt-swap``, then CP-SAT only on the steps whose gap to the proven bound matters.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fsdata.balancer import bubble
from fsdata.balancer import partition_fast as pf
from fsdata.balancer.partition import (DEFAULT_METHOD, DEFAULT_SAMPLES_PER_CHUNK, lpt_reference, partition_shuffle,
                                       per_rank_loads)
from fsdata.errors import ConfigError
from fsdata.common.registry import Registry

#: ``auto`` refines a step with CP-SAT only when lpt-swap's straggler is above the step's proven
#: lower bound (:func:`fsdata.balancer.bubble.step_proven_bound`) by more than this fraction of the
#: run's total straggler cost ``sum_s max_s``: closing that gap would lower the run bubble by more
#: than 0.01 points. Below it CP-SAT cannot gain anything that matters.
CPSAT_GAP_THRESHOLD = 1e-4
#: ``auto`` refines at most this many steps (those furthest above their bound, absolute cost) ...
CPSAT_MAX_STEPS = 32
#: ... each with this CP-SAT budget in deterministic time (about seconds), so output is reproducible.
CPSAT_STEP_BUDGET_SECONDS = 0.5


@dataclass(kw_only=True, slots=True)
class PartitionerConfig:
    """Settings of a partitioner (what ``fsdata balance`` flags map to); each implementation reads
    the fields it needs and ignores the others."""

    method: str = DEFAULT_METHOD
    """A registered name (:func:`names`); used by :func:`from_config`."""
    num_threads: int | None = None
    """Threads for ``lpt-swap`` (None: all cores)."""
    steps_per_chunk: int | None = None
    """Steps per chunk (None: about :data:`~fsdata.balancer.partition.DEFAULT_SAMPLES_PER_CHUNK` samples)."""
    max_swap_iters: int | None = None
    """``lpt-swap`` exchange cap per step (None: the kernel default)."""
    swap_tolerance: float | None = None
    """``lpt-swap`` stop distance to the step's lower bound, relative (None: the kernel default)."""
    time_limit_seconds: float = 1.0
    """``lpt-swap-cpsat`` CP-SAT budget per step, seconds."""
    num_light_ranks: int = 3
    """``lpt-swap-cpsat`` light ranks re-solved with the straggler."""


class Partitioner(ABC):
    """Assigns the samples of many steps to ranks; one verb, :meth:`partition`.

    Args:
        config: settings (None: the defaults).

    Attributes:
        name: the registered name.
        info: what the last :meth:`partition` call did (``method`` and, for ``auto``, the CP-SAT
            counters); planning records it in the manifest as ``partition_info``.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: PartitionerConfig | None = None):
        self.config = config or PartitionerConfig(method=self.name)
        self.info: dict = {"method": self.name}

    @abstractmethod
    def partition(self, step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, *,
                  step_bound: np.ndarray | None = None) -> np.ndarray:
        """Ranks of every sample.

        Args:
            step_costs: shape ``[S x (R*B)]``, float64; row s holds step s's sample costs.
            num_ranks: R.
            batch_size_per_rank: B.
            step_bound: shape ``[S]``, float64, the proven lower bound of each step's straggler if
                the caller already has it (a hint; most partitioners ignore it).

        Returns:
            shape ``[S x (R*B)]``, int32: rank of each sample, exactly B per rank per step.

        Raises:
            ConfigError: shape not ``[S x R*B]``, or bad settings.
        """

    def partition_chunks(self, step_cost_chunks: Iterable[np.ndarray], num_ranks: int,
                         batch_size_per_rank: int) -> Iterator[np.ndarray]:
        """:meth:`partition` chunk by chunk, in bounded memory (only the current chunk is held)."""
        for chunk in step_cost_chunks:
            yield self.partition(chunk, num_ranks, batch_size_per_rank)


#: The partitioners by name (``--partitioner NAME``): the one list of partitioner names.
PARTITIONERS: Registry[Partitioner] = Registry("partitioner", "partition method")


def register(name: str):
    """Class decorator: register a :class:`Partitioner` under ``name``.

    The registry is the one list of partitioner names: :func:`partition_steps`, planning
    (``make_plan(partitioner=name)``), ``fsdata verify`` and the ``--partitioner`` choices all read
    :func:`names`, so a partitioner registered before they run is accepted everywhere.

    Raises:
        ValueError: ``name`` is registered already.
    """
    return PARTITIONERS.register(name)


def names() -> tuple[str, ...]:
    """The registered partitioner names, in registration order."""
    return PARTITIONERS.names()


def get_partitioner(name: str, config: PartitionerConfig | None = None) -> Partitioner:
    """The partitioner registered as ``name``.

    Raises:
        ConfigError: no partitioner of that name.
    """
    return PARTITIONERS.get(name)(config)


def from_config(config: PartitionerConfig | None = None) -> Partitioner:
    """The partitioner named by ``config.method``, built with ``config`` (validated before any data is read).

    Raises:
        ConfigError: unknown method.
    """
    config = config or PartitionerConfig()
    return get_partitioner(config.method, config)


class StepPartitioner(Partitioner):
    """A partitioner that treats steps independently: checks the shape, then works through the
    steps in chunks of ``config.steps_per_chunk`` so one call's temporaries stay bounded."""

    def partition(self, step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, *,
                  step_bound: np.ndarray | None = None) -> np.ndarray:
        c = np.asarray(step_costs, dtype=np.float64)
        if c.ndim != 2 or c.shape[1] != num_ranks * batch_size_per_rank or num_ranks < 1 or batch_size_per_rank < 1:
            raise ConfigError(f"step_costs has shape {c.shape}; expected [steps x {num_ranks * batch_size_per_rank}] "
                              f"for num_ranks={num_ranks}, batch_size_per_rank={batch_size_per_rank}")
        steps_per_chunk = self.config.steps_per_chunk
        if steps_per_chunk is None:
            steps_per_chunk = max(1, DEFAULT_SAMPLES_PER_CHUNK // max(1, c.shape[1]))
        if steps_per_chunk < 1:
            raise ConfigError(f"steps_per_chunk={steps_per_chunk} must be >= 1")
        out = np.empty(c.shape, dtype=np.int32)
        for start in range(0, c.shape[0], steps_per_chunk):
            stop = min(c.shape[0], start + steps_per_chunk)
            out[start:stop] = self.partition_steps(c[start:stop], num_ranks, batch_size_per_rank)
        return out

    @abstractmethod
    def partition_steps(self, c: np.ndarray, R: int, B: int) -> np.ndarray:
        """Ranks ``[S x R*B]`` int32 of one chunk ``c [S x R*B]`` float64 (already checked)."""


@register("shuffle")
class ShufflePartitioner(StepPartitioner):
    """``rank = position // B``: the equal-count contiguous cut of the shuffled global batch."""

    def partition_steps(self, c, R, B):
        return np.broadcast_to(partition_shuffle(c.shape[1], R, B), c.shape).copy()


@register("roundrobin")
class RoundRobinPartitioner(StepPartitioner):
    """Sorted round-robin in snake order (:func:`fsdata.balancer.partition_fast.snake_steps`)."""

    def partition_steps(self, c, R, B):
        return pf.snake_steps(c, R, B)


@register("kk")
class KarmarkarKarpPartitioner(StepPartitioner):
    """Equal-size Karmarkar-Karp (:func:`fsdata.balancer.kk.kk_steps`)."""

    def partition_steps(self, c, R, B):
        from fsdata.balancer.kk import kk_steps  # noqa: PLC0415

        return kk_steps(c, R, B)


@register("lpt")
class LptReferencePartitioner(StepPartitioner):
    """Sorted LPT, pure Python (:func:`fsdata.balancer.partition.lpt_reference`; Graham 1969)."""

    def partition_steps(self, c, R, B):
        return np.stack([lpt_reference(row, R, B) for row in c]) if len(c) else np.empty(c.shape, dtype=np.int32)


@register("lpt-swap")
class LptSwapPartitioner(StepPartitioner):
    """LPT in a numba kernel plus a best-swap pass, parallel over steps
    (:func:`fsdata.balancer.partition_fast.lpt_swap_steps`); never worse than ``lpt``."""

    def partition_steps(self, c, R, B):
        cfg = self.config
        swap = {"max_swap_iters": pf.DEFAULT_MAX_SWAP_ITERS if cfg.max_swap_iters is None else cfg.max_swap_iters,
                "swap_tolerance": pf.DEFAULT_SWAP_TOLERANCE if cfg.swap_tolerance is None else cfg.swap_tolerance}
        return pf.lpt_swap_steps(c, R, B, num_threads=cfg.num_threads, **swap)


@register("lpt-swap-cpsat")
class LptSwapCpsatPartitioner(LptSwapPartitioner):
    """``lpt-swap`` refined by CP-SAT neighbourhoods on every step
    (:func:`fsdata.balancer.cpsat.cpsat_refine_steps`)."""

    def partition_steps(self, c, R, B):
        from fsdata.balancer.cpsat import cpsat_refine_steps  # noqa: PLC0415 (OR-Tools import is slow)

        ranks = super().partition_steps(c, R, B)
        return cpsat_refine_steps(c, ranks, R, B, time_limit_seconds=self.config.time_limit_seconds,
                                  num_light_ranks=self.config.num_light_ranks)


@register("auto")
class AutoPartitioner(Partitioner):
    """``lpt-swap`` for every step, then CP-SAT on the steps whose gap to the proven bound is worth it.

    A step is refined only if its straggler is above the step's proven lower bound by more than
    ``gap_threshold`` times ``sum_s max_s`` (its possible gain in run-bubble points); of those, the
    ``cpsat_max_steps`` with the largest absolute gap (they dominate the run bubble
    ``sum(max - mean) / sum(max)``), each for :data:`CPSAT_STEP_BUDGET_SECONDS` of CP-SAT
    deterministic time. The refinement only accepts strictly better assignments, so the result is
    never worse than ``lpt-swap``. ``info`` holds ``method``, ``cpsat_gap_threshold``,
    ``steps_above_threshold``, ``cpsat_steps``, ``cpsat_improved_steps``,
    ``cpsat_budget_seconds_per_step``.

    Args:
        config: settings (the ``lpt-swap`` pass uses the defaults, as ``fsdata balance`` does).
        cpsat_max_steps: most steps CP-SAT refines (0 disables it).
        gap_threshold: gap to the proven bound, as a fraction of the run's total straggler cost,
            below which a step is left alone.
    """

    def __init__(self, config: PartitionerConfig | None = None, *, cpsat_max_steps: int = CPSAT_MAX_STEPS,
                 gap_threshold: float = CPSAT_GAP_THRESHOLD):
        super().__init__(config)
        self.cpsat_max_steps = cpsat_max_steps
        self.gap_threshold = gap_threshold

    def partition(self, step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, *,
                  step_bound: np.ndarray | None = None) -> np.ndarray:
        ranks = LptSwapPartitioner().partition(step_costs, num_ranks, batch_size_per_rank)
        info = self.info = {"method": "lpt-swap", "cpsat_gap_threshold": self.gap_threshold,
                            "steps_above_threshold": 0, "cpsat_steps": 0, "cpsat_improved_steps": 0,
                            "cpsat_budget_seconds_per_step": CPSAT_STEP_BUDGET_SECONDS}
        if self.cpsat_max_steps <= 0 or num_ranks < 2 or len(step_costs) == 0:
            return ranks
        if step_bound is None:
            step_bound = bubble.step_proven_bound(step_costs, num_ranks, batch_size_per_rank)
        loads = per_rank_loads(step_costs, ranks, num_ranks)
        mx = loads.max(axis=1)
        gap = mx - step_bound
        above = np.flatnonzero(gap > self.gap_threshold * mx.sum())
        info["steps_above_threshold"] = int(len(above))
        if not len(above):
            return ranks
        from fsdata.balancer.cpsat import cpsat_refine_step  # noqa: PLC0415 (OR-Tools import is slow; only when used)

        worst = [int(s) for s in above[np.argsort(-gap[above], kind="stable")][:self.cpsat_max_steps]]
        info["method"] = "lpt-swap+cpsat"

        def refine(s: int) -> np.ndarray:
            return cpsat_refine_step(step_costs[s], ranks[s], num_ranks, batch_size_per_rank,
                                     time_limit_seconds=CPSAT_STEP_BUDGET_SECONDS, solve_time_limit_seconds=0.1)[0]

        # Steps are independent and CP-SAT's limit is deterministic time, and its solve releases
        # the GIL: the steps run on threads, with the same result as one after another.
        threads = min(len(worst), self.config.num_threads or os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=max(threads, 1)) as pool:
            refined = list(pool.map(refine, worst))
        for s, r in zip(worst, refined):
            ranks[s] = r
            after = np.bincount(r, weights=step_costs[s], minlength=num_ranks).max()
            info["cpsat_steps"] += 1
            info["cpsat_improved_steps"] += int(after < mx[s])
        return ranks



def partition_steps(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int,
                    method: str = DEFAULT_METHOD, *, num_threads: int | None = None,
                    steps_per_chunk: int | None = None, max_swap_iters: int | None = None,
                    swap_tolerance: float | None = None, time_limit_seconds: float = 1.0,
                    num_light_ranks: int = 3) -> np.ndarray:
    """Assign the samples of many steps to ranks with the partitioner registered as ``method``.

    Args:
        step_costs: shape ``[S x (R*B)]``, float64; row s holds step s's sample costs.
        num_ranks: R.
        batch_size_per_rank: B.
        method: a registered name (:func:`names`: those of the module docstring and any registered
            since); default ``lpt-swap``.
        num_threads: threads for ``lpt-swap`` (None: all cores).
        steps_per_chunk: steps per chunk (default: about
            :data:`~fsdata.balancer.partition.DEFAULT_SAMPLES_PER_CHUNK` samples); bounds the
            temporaries of one call.
        max_swap_iters: ``lpt-swap`` exchange cap per step (default
            :data:`fsdata.balancer.partition_fast.DEFAULT_MAX_SWAP_ITERS`).
        swap_tolerance: ``lpt-swap`` stop distance to the step's lower bound, relative (default
            :data:`fsdata.balancer.partition_fast.DEFAULT_SWAP_TOLERANCE`).
        time_limit_seconds: ``lpt-swap-cpsat`` CP-SAT budget per step, seconds.
        num_light_ranks: ``lpt-swap-cpsat`` light ranks re-solved with the straggler.

    Returns:
        shape ``[S x (R*B)]``, int32: rank of each sample, exactly B per rank per step.

    Raises:
        ConfigError: unknown method, shape not ``[S x R*B]``, or bad settings.
    """
    config = PartitionerConfig(method=method, num_threads=num_threads, steps_per_chunk=steps_per_chunk,
                               max_swap_iters=max_swap_iters, swap_tolerance=swap_tolerance,
                               time_limit_seconds=time_limit_seconds, num_light_ranks=num_light_ranks)
    return get_partitioner(method, config).partition(step_costs, num_ranks, batch_size_per_rank)


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
