"""Training pipelines: one interface, one verb (``progress``), four schedules selectable by name.

Every pipeline trains the same sharded model (:func:`fstrain.dist.build_sharded_model`) on the
same batches and must end with the same parameters as the plain, non-pipelined step (proved by
``tests/fstrain/test_pipeline.py``); they differ only in *when* the embedding communication runs:

============  ===========================================================================
name          schedule
============  ===========================================================================
plain         input dist, lookup, embedding all-to-all, dense forward/backward, gradient
              all-to-all, optimizer: in order, nothing overlapped (the reference).
sparse-dist   torchrec ``TrainPipelineSparseDist``: the next batch's input dist (id
              all-to-all) overlaps the current batch (a side CUDA stream on GPU; on CPU it
              only reorders the calls).
pec           torchrec >= 1.9 ``TrainPipelinePEC`` (prioritized embedding communication).
              Needs CUDA and a model whose table is a ``PECEmbeddingCollection``; see
              :class:`PECPipeline` for why it does not run on CPU/gloo.
prioritized   :class:`fstrain.prioritized.PrioritizedPipeline`, our implementation of the
              same ordering that runs on CPU/gloo: rows of batch N+1 that batch N does not
              touch (NOL) are looked up and exchanged on a background thread while batch N
              computes; the others (OL) after batch N's update.
============  ===========================================================================

Per step, :meth:`TrainPipeline.progress` returns a :class:`StepOutput`: the model output and a
:class:`StepStats` with ``compute_seconds`` (dense forward + backward + optimizer step, timed by
module hooks, the same way in every pipeline) and ``exposed_comm_seconds`` (the rest of the step's
wall time: what compute waited for, mostly communication; it also holds the local embedding
lookups and pipeline bookkeeping, which are nearly equal across pipelines).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.model_parallel import DistributedModelParallel

from fstrain.data import Batch
from fstrain.errors import ConfigError
from fstrain.metrics import StepTiming
from fstrain.pipeline_timing import ComputeTimer, TimedOptimizer

logger = logging.getLogger(__name__)

PIPELINE_NAMES = ("plain", "sparse-dist", "pec", "prioritized", "auto")


class PipelineError(ConfigError):
    """An impossible pipeline setting (unknown name, unsupported model layout)."""


class PipelineUnavailableError(PipelineError):
    """The requested pipeline cannot run on this machine (e.g. ``pec`` without CUDA)."""


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """Which training pipeline drives the steps."""

    name: str = "plain"
    """``plain``, ``sparse-dist``, ``pec``, ``prioritized`` or ``auto`` (``pec`` where it runs,
    else ``prioritized``)."""
    pec_fallback: bool = False
    """When ``name == "pec"`` cannot run here, use ``prioritized`` (with a warning) instead of
    raising :class:`PipelineUnavailableError`."""
    measure_straggler_wait: bool = True
    """Time the wait for the slowest rank apart from communication (one tiny all-reduce per
    step on a dedicated process group, after the dense backward)."""
    overlap: bool = True
    """``prioritized`` only: fetch the next batch's NOL rows on the background thread, overlapped
    with compute (``False``: inline, same results; for measuring what the overlap hides)."""

    def __post_init__(self) -> None:
        if self.name not in PIPELINE_NAMES:
            raise PipelineError(f"unknown pipeline {self.name!r}; use one of {', '.join(PIPELINE_NAMES)}")


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
            ``dense_allreduce``, and ``background_prefetch``: the background thread's time on this
            batch's NOL exchange, not main-thread time); empty otherwise.
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


@dataclass(slots=True)
class StepOutput:
    """What :meth:`TrainPipeline.progress` returns.

    Attributes:
        output: the model output, ``(loss_sum, num_samples)``: detached loss sum over this
            rank's samples (scalar tensor) and its sample count (tensor).
        stats: timings of the step.
        step: ``Batch.step`` of the batch trained in this call (pipelines read ahead, so the
            caller cannot take it from the last batch it produced).
        num_tokens: history items of that batch on this rank.
    """

    output: tuple[torch.Tensor, torch.Tensor]
    stats: StepStats
    step: int
    num_tokens: int


class TrainPipeline(abc.ABC):
    """One training step per call of :meth:`progress`; subclasses choose the schedule.

    Args:
        dmp: the sharded model from :func:`fstrain.dist.build_sharded_model`.
        optimizer: its optimizer (fused sparse + dense Adam).
        device: where the model runs.
        measure_straggler_wait: time the wait for the slowest rank apart (a one-element
            all-reduce after the dense backward, see :class:`ComputeTimer`); collective.
    """

    name: str = ""

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
        self._trained: tuple[int, int] = (-1, 0)  # (Batch.step, num_tokens) of the batch being trained
        self._batch_hook = dmp.module.register_forward_pre_hook(self._see_batch)

    def _see_batch(self, _module, args) -> None:
        """Model forward pre-hook: remember which batch the (possibly torchrec-driven) step trains."""
        if args and isinstance(args[0], Batch):
            self._mark(args[0])

    def _mark(self, batch: Batch) -> None:
        self._trained = (batch.step, int(batch.lengths.sum()))

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
            dataloader_iter: yields :class:`fstrain.data.Batch` (with
                :func:`fstrain.model.with_negatives` applied); every rank yields the same number.

        Returns:
            :class:`StepOutput` of the batch trained in this call (pipelines that read ahead
            return the output of an earlier batch than the last one read).

        Raises:
            StopIteration: no batch is left.
        """
        self.timer.take()
        t0 = time.perf_counter()
        output, ahead, after = self._progress(dataloader_iter)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step = time.perf_counter() - t0
        compute, wait = self.timer.take()
        stats = StepStats(self._index, step, compute, max(0.0, step - compute - wait), ahead, after, self._phases,
                          wait)
        self._phases = {}
        self._index += 1
        return StepOutput(output, stats, *self._trained)

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


class PlainPipeline(TrainPipeline):
    """The reference: every stage in order on the main thread (the default CUDA stream on GPU).

    Stages: ``## forward ##`` (input dist, lookup, embedding all-to-all, dense forward through
    DMP/DDP), ``## backward ##`` (dense backward with the DDP SUM all-reduce, gradient
    all-to-all, fused sparse update), ``## optimizer ##`` (dense Adam).
    """

    name = "plain"

    def _progress(self, dataloader_iter):
        batch = next(dataloader_iter).to(self.device)
        with record_function("## forward ##"):
            loss, output = self.dmp(batch)
        with record_function("## backward ##"):
            loss.backward()
        with record_function("## optimizer ##"):
            self.timed_optimizer.step()
            self.optimizer.zero_grad()
        return output, 0, 0


class SparseDistPipeline(TrainPipeline):
    """torchrec ``TrainPipelineSparseDist``: batch N+1's input dist overlaps batch N.

    Streams (CUDA): host-to-device copy on a memcpy stream, input dist of N+1 on the data-dist
    stream, lookup, embedding all-to-all and dense compute of N on the default stream. On CPU
    there are no streams: the same stages run in the same order on the main thread, with the
    id all-to-all of N+1 issued before the compute of N.
    """

    name = "sparse-dist"

    def __init__(self, dmp, optimizer, device, **kwargs) -> None:
        super().__init__(dmp, optimizer, device, **kwargs)
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self._pipe = TrainPipelineSparseDist(dmp, self.timed_optimizer, device, execute_all_batches=True)

    def _progress(self, dataloader_iter):
        return self._pipe.progress(dataloader_iter), 0, 0


def pec_unavailable_reason(dmp: DistributedModelParallel, device: torch.device) -> str | None:
    """Why torchrec's ``TrainPipelinePEC`` cannot drive ``dmp`` on ``device`` (``None``: it can).

    Found by running it on CPU/gloo with torchrec 1.9.2 (``tests/fstrain/test_pipeline.py``):

    1. ``TrainPipelinePEC.__init__`` creates ``torch.cuda.Event()`` twice; without CUDA it raises
       ``RuntimeError: Tried to instantiate dummy base class Event``.
    2. With the events stubbed, the first ``progress`` calls ``KeyedJaggedTensor.record_stream``
       on CPU tensors (``_record_stream_forward_ctx``), which raises
       ``RuntimeError: unknown parameter type``; the pipeline orders its data-dist stream
       against the default stream with CUDA events and ``wait_event`` throughout.
    3. It only pipelines ``ShardedPECEmbeddingCollection`` modules: the item table must be
       wrapped in ``torchrec.modules.pec_embedding_modules.PECEmbeddingCollection`` and sharded
       with ``PECEmbeddingCollectionSharder`` (row-wise only). Sharding itself works on CPU.
    """
    from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection

    if device.type != "cuda" or not torch.cuda.is_available():
        return (f"TrainPipelinePEC needs CUDA (device is {device}): it creates torch.cuda.Event() and "
                "calls record_stream on the batch tensors; use --pipeline prioritized on CPU")
    if not isinstance(dmp.module.ec, ShardedPECEmbeddingCollection):
        return ("TrainPipelinePEC needs the item table wrapped in PECEmbeddingCollection and sharded with "
                "PECEmbeddingCollectionSharder (see docs/pipeline.md); this model has "
                f"{type(dmp.module.ec).__name__}")
    return None


class PECPipeline(TrainPipeline):
    """torchrec ``TrainPipelinePEC`` (CUDA only, PEC-wrapped table; :func:`pec_unavailable_reason`).

    Streams (from torchrec): OL lookup of N and the dense forward/backward on the default
    stream; input dist of N+2 and the overlap split (OL/NOL masks) of N+1 on the data-dist
    stream; NOL lookup of N+1 after N's forward; OL gradient all-to-all of N before the
    optimizer, NOL gradient of N deferred to step N+1 (so between calls the table lacks it, and
    :meth:`flush` cannot force it: checkpoint a ``pec`` run at its end).

    Raises:
        PipelineUnavailableError: with the reason, where it cannot run.
    """

    name = "pec"

    def __init__(self, dmp, optimizer, device, **kwargs) -> None:
        reason = pec_unavailable_reason(dmp, device)
        if reason:
            raise PipelineUnavailableError(reason)
        super().__init__(dmp, optimizer, device, **kwargs)
        from torchrec.distributed.train_pipeline.pec_train_pipeline import TrainPipelinePEC

        self._pipe = TrainPipelinePEC(dmp, self.timed_optimizer, device)

    def _progress(self, dataloader_iter):
        return self._pipe.progress(dataloader_iter), 0, 0


def make_pipeline(config: PipelineConfig | str, dmp: DistributedModelParallel, optimizer,
                  device: torch.device) -> TrainPipeline:
    """Build the pipeline named by ``config`` (collective: call it on every rank).

    Args:
        config: a :class:`PipelineConfig` or just its ``name``.
        dmp: the sharded model.
        optimizer: its optimizer.
        device: where the model runs.

    Returns:
        The pipeline; drive it with ``pipeline.progress(iterator)`` until ``StopIteration``.

    Raises:
        PipelineError: unknown name.
        PipelineUnavailableError: ``pec`` where it cannot run and ``pec_fallback`` is off.
    """
    if isinstance(config, str):
        config = PipelineConfig(name=config)
    name = config.name
    kw = {"measure_straggler_wait": config.measure_straggler_wait}
    if name in ("pec", "auto"):
        reason = pec_unavailable_reason(dmp, device)
        if reason is None:
            return PECPipeline(dmp, optimizer, device, **kw)
        if name == "pec" and not config.pec_fallback:
            raise PipelineUnavailableError(reason)
        logger.warning("pipeline %s: %s; using the prioritized pipeline instead", name, reason)
        name = "prioritized"
    if not config.overlap and name != "prioritized":
        logger.warning("pipeline %s: overlap=False only applies to the prioritized pipeline; ignored", name)
    if name == "plain":
        return PlainPipeline(dmp, optimizer, device, **kw)
    if name == "sparse-dist":
        return SparseDistPipeline(dmp, optimizer, device, **kw)
    from fstrain.prioritized import PrioritizedPipeline

    return PrioritizedPipeline(dmp, optimizer, device, overlap=config.overlap, **kw)


def pipeline_steps(pipeline: TrainPipeline, batches: Iterator[Batch], rank: int
                   ) -> Iterator[tuple[int, torch.Tensor, int, int, StepTiming]]:
    """Drive ``pipeline`` to the end of ``batches``, one item per trained batch (for ``fstrain.train``).

    Args:
        pipeline: from :func:`make_pipeline`.
        batches: host batches with negatives (the pipeline moves them to its device).
        rank: this rank (recorded in the timings).

    Yields:
        ``(step, loss_sum, num_samples, num_tokens, timing)``: ``Batch.step`` of the trained batch,
        its detached loss sum (tensor), sample and history-item counts, and a
        :class:`fstrain.metrics.StepTiming` with ``compute_seconds`` (dense forward + backward
        + optimizer), ``wait_seconds`` (straggler wait), ``sync_seconds`` (exposed
        communication) and ``sparse_forward_seconds`` 0 (inside the exposed communication).
    """
    while True:
        try:
            out = pipeline.progress(batches)
        except StopIteration:
            return
        loss_sum, n = out.output
        st = out.stats
        timing = StepTiming(step=out.step, rank=rank, num_samples=int(n), num_tokens=out.num_tokens,
                            sparse_forward_seconds=0.0, compute_seconds=st.compute_seconds,
                            wait_seconds=st.straggler_wait_seconds, sync_seconds=st.exposed_comm_seconds)
        yield out.step, loss_sum, int(n), out.num_tokens, timing


def run_steps(pipeline: TrainPipeline, batches: Iterator[Batch], max_steps: int | None = None) -> list[StepOutput]:
    """Drive ``pipeline`` until the iterator is exhausted (or ``max_steps`` calls); returns every output."""
    outs: list[StepOutput] = []
    while max_steps is None or len(outs) < max_steps:
        try:
            outs.append(pipeline.progress(batches))
        except StopIteration:
            break
    return outs


__all__ = ["PIPELINE_NAMES", "PipelineConfig", "PipelineError", "PipelineUnavailableError", "StepStats",
           "StepOutput", "TrainPipeline", "PlainPipeline", "SparseDistPipeline", "PECPipeline", "make_pipeline",
           "pec_unavailable_reason", "pipeline_steps", "run_steps"]
