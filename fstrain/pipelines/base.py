"""The pipeline interface: :class:`TrainPipeline` (one verb, ``progress``), its settings and step stats.

Subclasses live beside this module (:mod:`fstrain.pipelines.plain`,
:mod:`fstrain.pipelines.torchrec_wrappers`, :mod:`fstrain.pipelines.prioritized`); none of them is
imported here, so the package has no import cycle.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.model_parallel import DistributedModelParallel

from fstrain.data.batch import Batch
from fsdata.common.registry import Registry
from fstrain.errors import ConfigError
from fstrain.components.metrics import StepTiming
from fstrain.pipelines.timing import ComputeTimer, TimedOptimizer

logger = logging.getLogger(__name__)

#: The pipelines by name (``--pipeline NAME``): the one list of pipeline choices; each implementation
#: registers itself (:mod:`fstrain.pipelines` imports them in this order: plain, sparse-dist, pec, prioritized).
PIPELINES: Registry[TrainPipeline] = Registry("pipeline", "pipeline")
#: ``PipelineConfig.name`` resolved where the model runs: ``pec`` where it runs, else ``prioritized``.
AUTO = "auto"
#: ``PipelineConfig.name`` of no pipeline: ``fstrain train`` drives the steps with its own loop (``step_mode``).
NO_PIPELINE = "none"
#: ``PipelineConfig.step_mode``: the loop used without a pipeline.
STEP_MODES = ("measured", "plain")


def pipeline_names() -> tuple[str, ...]:
    """The ``--pipeline`` choices: every registered pipeline, then ``auto`` (``none`` aside)."""
    return (*PIPELINES.names(), AUTO)


class PipelineError(ConfigError):
    """An impossible pipeline setting (unknown name, unsupported model layout)."""


class PipelineUnavailableError(PipelineError):
    """The requested pipeline cannot run on this machine (e.g. ``pec`` without CUDA)."""


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """Which training pipeline drives the steps."""

    name: str = field(default="plain", metadata={"flag": "--pipeline"})
    """``plain``, ``sparse-dist``, ``pec``, ``prioritized`` or ``auto`` (``pec`` where it runs,
    else ``prioritized``; docs/pipeline.md); ``none``: no pipeline, the training loop's own
    step (``step_mode``)."""
    step_mode: str = field(default="measured", metadata={"flag": "--step-mode"})
    """With ``name="none"``: ``measured`` (the backward split at the embedding output, so local
    compute is timed apart from the wait for the other ranks) or ``plain`` (``loss.backward()``
    through DDP)."""
    pec_fallback: bool = False
    """When ``name == "pec"`` cannot run here, use ``prioritized`` (with a warning) instead of
    raising :class:`PipelineUnavailableError`."""
    measure_straggler_wait: bool = True
    """Time the wait for the slowest rank apart from communication (one tiny all-reduce per
    step on a dedicated process group, after the dense backward)."""
    overlap: bool = True
    """``prioritized`` only: fetch the next batch's NOL rows on the background thread, overlapped
    with compute (``False``: inline on the main thread, two all-to-alls per step, same results;
    faster where each rank has no spare core for that thread: docs/pipeline.md)."""
    ordered_collectives: bool | None = None
    """``prioritized`` only: one issue order for the main and background threads' collectives,
    the same on every rank (:mod:`fstrain.pipelines.ordering`); ``None``: on for NCCL /
    ``fs_cuda_ce``, off for gloo / ``fs_shm``. Same results either way."""

    def __post_init__(self) -> None:
        if self.name not in (*pipeline_names(), NO_PIPELINE):
            raise PipelineError(f"unknown pipeline {self.name!r}; use one of {', '.join(pipeline_names())} or "
                                f"{NO_PIPELINE}")
        if self.step_mode not in STEP_MODES:
            raise PipelineError(f"step_mode must be one of {', '.join(STEP_MODES)}, got {self.step_mode!r}")


def prefetch_core_check(device: torch.device) -> tuple[bool, str]:
    """Whether each rank of this node can give ``prioritized``'s prefetch thread a CPU core of its own.

    Overlap hides waiting, not CPU time: where the thread shares a core with the dense compute,
    the inline schedule (``PipelineConfig(overlap=False)``) is faster with the same results (a quiet
    2-core machine, 2 ranks x 1 torch thread: inline 0.91-0.99x the overlapped step in 12 of 12 runs,
    docs/results/bench_pipeline.md). Cores: this process's CPU affinity; ranks on the node:
    ``$LOCAL_WORLD_SIZE`` (torchrun), else the world size; threads: ``torch.get_num_threads()``.

    Args:
        device: where the model runs; on CUDA the dense compute leaves the CPU (always ``True``).

    Returns:
        ``(has_core, why)``: ``has_core`` iff cores >= ranks on the node x (torch threads + 1);
        ``why`` the numbers, for a log line. Raises nothing.
    """
    if device.type == "cuda":
        return True, "the dense compute runs on the GPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except ValueError:
        local = world
    threads = torch.get_num_threads()
    need = local * (threads + 1)
    return cores >= need, (f"{cores} CPU cores for {local} ranks x ({threads} torch threads + 1 prefetch thread)"
                           f" = {need}")


@dataclass(slots=True)
class StepStats:
    """Timings of one ``progress`` call on this rank (wall clock, seconds).

    Attributes:
        index: 0-based count of ``progress`` calls of this pipeline.
        step_seconds: wall time of the call.
        compute_seconds: dense forward + dense backward + optimizer step.
        exposed_comm_seconds: ``step_seconds - compute_seconds - straggler_wait_seconds``: time
            the step spent outside compute and outside the wait for the slowest rank, i.e.
            waiting on communication (plus the local lookups and bookkeeping).
        num_rows_ahead: embedding rows of this batch fetched ahead, overlapped with the previous
            batch (``prioritized`` only; 0 otherwise).
        num_rows_after_update: rows fetched after the previous batch's update (``prioritized``:
            the rows both batches touch; other pipelines: 0).
        phase_seconds: main-thread time per communication phase where the pipeline measures it
            directly (``prioritized``: ``wait_prefetch``, ``fetch_ol``, ``sparse_update``,
            ``dense_allreduce``, ``flush_deferred_update``, and ``background_prefetch``: the
            background thread's time on this batch's exchange, not main-thread time, split into
            ``background_prefetch.ids`` / ``.held_update`` / ``.lookup`` / ``.replies``); empty otherwise.
        straggler_wait_seconds: wait for the slowest rank after the dense backward (this rank's
            share of the bubble; 0 when not measured).
    """

    index: int
    step_seconds: float
    compute_seconds: float
    exposed_comm_seconds: float
    num_rows_ahead: int = 0
    num_rows_after_update: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    straggler_wait_seconds: float = 0.0


class StepOutput:
    """What :meth:`TrainPipeline.progress` returns.

    Attributes:
        output: the model output, ``(loss_sum, num_samples)``: detached loss sum over this
            rank's samples (scalar tensor) and its sample count (tensor).
        stats: timings of the step. On CUDA they come from CUDA events and are read on first
            access (which waits for the step's last kernel); ``progress`` itself never blocks the
            host on the device, so read them one step late to keep the GPU queue full (as
            :func:`pipeline_steps` does).
        step: ``Batch.step`` of the batch trained in this call (pipelines read ahead, so the
            caller cannot take it from the last batch it produced).
        num_tokens: history items of that batch on this rank.
        num_samples: samples (histories) of that batch on this rank (``Batch.num_samples``; the
            loss's supervised count, ``output[1]``, is larger for the all-positions objective).
    """

    __slots__ = ("output", "_stats", "step", "num_tokens", "num_samples")

    def __init__(self, output: tuple[torch.Tensor, torch.Tensor], stats: StepStats | Callable[[], StepStats],
                 step: int, num_tokens: int, num_samples: int = -1) -> None:
        self.output = output
        self._stats = stats
        self.step = step
        self.num_tokens = num_tokens
        self.num_samples = num_samples

    @property
    def stats(self) -> StepStats:
        if not isinstance(self._stats, StepStats):
            self._stats = self._stats()
        return self._stats


class TrainPipeline(abc.ABC):
    """One training step per call of :meth:`progress`; subclasses choose the schedule.

    Args:
        dmp: the sharded model from :func:`fstrain.distributed.sharding.build_sharded_model`.
        optimizer: its optimizer (fused sparse + dense Adam).
        device: where the model runs.
        measure_straggler_wait: time the wait for the slowest rank apart (a one-element
            all-reduce after the dense backward, see :class:`ComputeTimer`); collective.
    """

    name: str = ""
    #: its steps' timings are measurements (recorded and summarised by the training loop)
    records_timings: bool = True

    def __init__(self, dmp: DistributedModelParallel, optimizer, device: torch.device, *,
                 measure_straggler_wait: bool = True) -> None:
        self.dmp = dmp
        self.optimizer = optimizer
        self.device = device
        self._straggler_group = dist.new_group(backend=dist.get_backend()) if measure_straggler_wait else None
        self.timer = ComputeTimer(dmp.module.dense, device, self._straggler_group)
        self.timed_optimizer = TimedOptimizer(optimizer, self.timer)
        self._index = 0
        self._phases: dict[str, float] = {}
        self._trained: tuple[int, int, int] = (-1, 0, 0)  # (Batch.step, num_tokens, num_samples) being trained
        self._batch_hook = dmp.module.register_forward_pre_hook(self._see_batch)

    @classmethod
    def from_config(cls, config: PipelineConfig, dmp: DistributedModelParallel, optimizer,
                    device: torch.device) -> TrainPipeline:
        """Build this pipeline with the :class:`PipelineConfig` fields it takes (collective)."""
        return cls(dmp, optimizer, device, measure_straggler_wait=config.measure_straggler_wait)

    def _see_batch(self, _module, args) -> None:
        """Model forward pre-hook: remember which batch the (possibly torchrec-driven) step trains."""
        if args and isinstance(args[0], Batch):
            self._mark(args[0])

    def _mark(self, batch: Batch) -> None:
        self._trained = (batch.step, int(batch.lengths.sum()), int(batch.num_samples))

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time a main-thread stage into :attr:`StepStats.phase_seconds` and mark it for the profiler."""
        t0 = time.perf_counter()
        with record_function(f"## {name} ##"):
            yield
        self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0

    @abc.abstractmethod
    def _progress(self, dataloader_iter: Iterator[Batch]) -> tuple[tuple[torch.Tensor, torch.Tensor], int, int]:
        """Run one step; returns ``(output, num_rows_ahead, num_rows_after_update)``."""

    def progress(self, dataloader_iter: Iterator[Batch]) -> StepOutput:
        """Train on the next batch of ``dataloader_iter`` (batches carry negatives and live on ``device``
        or are moved there by the pipeline).

        Args:
            dataloader_iter: yields :class:`fstrain.data.batch.Batch` (with
                :func:`fstrain.models.negatives.with_negatives` applied); every rank yields the same number.

        Returns:
            :class:`StepOutput` of the batch trained in this call (pipelines that read ahead
            return the output of an earlier batch than the last one read).

        Raises:
            StopIteration: no batch is left.
        """
        self.timer.take()
        t0 = time.perf_counter()
        start = self._cuda_event()
        output, ahead, after = self._progress(dataloader_iter)
        end = self._cuda_event()
        host_seconds = time.perf_counter() - t0
        pending = self.timer.detach()  # this step's intervals (CUDA: events, read later)
        index, phases, trained = self._index, self._phases, self._trained
        self._phases = {}
        self._index += 1

        def resolve() -> StepStats:
            # CUDA: step time from events on the current stream (no torch.cuda.synchronize in the
            # step; reading waits for this step's last event only). CPU: host wall clock.
            step = host_seconds if start is None else _elapsed(start, end)
            compute, wait = self.timer.resolve(pending)
            return StepStats(index, step, compute, max(0.0, step - compute - wait), ahead, after, phases, wait)

        return StepOutput(output, resolve() if start is None else resolve, *trained)

    def steps(self, batches: Iterator[Batch], rank: int, *, lag: bool = False
              ) -> Iterator[tuple[int, torch.Tensor, int, int, StepTiming]]:
        """:func:`pipeline_steps` of this pipeline: what the training loop iterates, for every pipeline."""
        return pipeline_steps(self, batches, rank, lag=lag)

    def _cuda_event(self):
        """CUDA: a timing event recorded on the current stream; CPU: ``None``."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def flush(self) -> None:
        """Finish work of past steps still in flight, so the model state is complete (call it
        before saving a checkpoint; ``prioritized`` defers part of each step's sparse update)."""

    def close(self) -> None:
        """Release hooks and background resources (the model stays usable)."""
        self.timer.remove()
        self._batch_hook.remove()
        if self._straggler_group is not None:
            dist.destroy_process_group(self._straggler_group)
            self._straggler_group = None


def pipeline_steps(pipeline: TrainPipeline, batches: Iterator[Batch], rank: int, *, lag: bool = False
                   ) -> Iterator[tuple[int, torch.Tensor, int, int, StepTiming]]:
    """Drive ``pipeline`` to the end of ``batches``, one item per trained batch (for ``fstrain.train``).

    Args:
        pipeline: from :func:`make_pipeline`.
        batches: host batches with negatives (the pipeline moves them to its device).
        rank: this rank (recorded in the timings).
        lag: yield step N after step N+1 has been queued (CUDA: its timing events are read while
            the device runs the next step, so the host never waits for an idle GPU). The model
            state is then one step ahead of the item: do not checkpoint between items.

    Yields:
        ``(step, loss_sum, num_supervised, num_tokens, timing)``: ``Batch.step`` of the trained batch,
        its detached loss sum (tensor), the loss's supervised positions (``B`` for the last-position
        objective, the history items for all-positions), the history items, and a
        :class:`fstrain.components.metrics.StepTiming` (``num_samples``: the batch's samples, i.e.
        histories) with ``compute_seconds`` (dense forward + backward
        + optimizer), ``wait_seconds`` (straggler wait), ``sync_seconds`` (exposed
        communication) and ``sparse_forward_seconds`` 0 (inside the exposed communication).
    """

    def item(out: StepOutput):
        loss_sum, n = out.output
        st = out.stats
        samples = out.num_samples if out.num_samples >= 0 else int(n)
        timing = StepTiming(step=out.step, rank=rank, num_samples=samples, num_tokens=out.num_tokens,
                            sparse_forward_seconds=0.0, compute_seconds=st.compute_seconds,
                            wait_seconds=st.straggler_wait_seconds, sync_seconds=st.exposed_comm_seconds)
        return out.step, loss_sum, int(n), out.num_tokens, timing

    prev: StepOutput | None = None
    while True:  # lag: step N's stats (CUDA events) are read after step N+1 is queued
        try:
            out = pipeline.progress(batches)
        except StopIteration:
            if prev is not None:
                yield item(prev)
            return
        if not lag:
            yield item(out)
            continue
        if prev is not None:
            yield item(prev)
        prev = out


def run_steps(pipeline: TrainPipeline, batches: Iterator[Batch], max_steps: int | None = None) -> list[StepOutput]:
    """Drive ``pipeline`` until the iterator is exhausted (or ``max_steps`` calls); returns every output."""
    outs: list[StepOutput] = []
    while max_steps is None or len(outs) < max_steps:
        try:
            outs.append(pipeline.progress(batches))
        except StopIteration:
            break
    return outs


def _elapsed(start, end) -> float:
    """Seconds between two recorded CUDA events (waits for ``end``)."""
    end.synchronize()
    return start.elapsed_time(end) / 1e3


__all__ = ["AUTO", "PIPELINES", "pipeline_names", "PipelineConfig", "PipelineError", "PipelineUnavailableError",
           "StepOutput", "StepStats", "TrainPipeline", "pipeline_steps", "run_steps"]
