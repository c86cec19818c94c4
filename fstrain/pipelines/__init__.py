"""Training pipelines: one interface, one verb (``progress``), four schedules selectable by name.

Every pipeline trains the same sharded model (:func:`fstrain.distributed.sharding.build_sharded_model`) on the
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
prioritized   :class:`fstrain.pipelines.prioritized.PrioritizedPipeline`, our implementation of the
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

import logging
from collections.abc import Callable

import torch
from torchrec.distributed.model_parallel import DistributedModelParallel

from fstrain.pipelines.base import (
    AUTO,
    NO_PIPELINE,
    PIPELINES,
    STEP_MODES,
    PipelineConfig,
    PipelineError,
    PipelineUnavailableError,
    StepOutput,
    StepStats,
    TrainPipeline,
    pipeline_names,
    pipeline_steps,
    prefetch_core_check,
    run_steps,
)

from fstrain.pipelines.loop import LoopPipeline

# imported in the order of the --pipeline choices: each registers itself in PIPELINES
from fstrain.pipelines.plain import PlainPipeline
from fstrain.pipelines.torchrec_wrappers import PECPipeline, SparseDistPipeline, pec_unavailable_reason
from fstrain.pipelines.prioritized import PrioritizedPipeline

#: The ``--pipeline`` choices (``none`` aside): the registered pipelines, then ``auto``.
PIPELINE_NAMES = pipeline_names()

logger = logging.getLogger(__name__)


def pec_runs_on(device: torch.device) -> bool:
    """Whether torchrec's ``TrainPipelinePEC`` can run on ``device`` (CUDA only; see
    :func:`pec_unavailable_reason` for what fails on CPU)."""
    return device.type == "cuda" and torch.cuda.is_available()


def resolve_pipeline_name(name: str, device: torch.device, *, pec_fallback: bool = False) -> str:
    """The pipeline that will run for ``name`` on ``device``, decided before the model is built.

    ``auto`` is ``pec`` where torchrec's PEC pipeline runs (CUDA), else ``prioritized``; ``pec``
    where it cannot run is ``prioritized`` with ``pec_fallback`` (a warning), else an error. Every
    other name (``none`` too: the loop's own step) is itself.

    Args:
        name: one of :data:`PIPELINE_NAMES` or ``none``.
        device: where the model will run.
        pec_fallback: allow ``pec`` to become ``prioritized``.

    Returns:
        A concrete name: ``plain``, ``sparse-dist``, ``pec``, ``prioritized`` or ``none``.

    Raises:
        PipelineError: unknown name.
        PipelineUnavailableError: ``pec`` without CUDA and without ``pec_fallback``.
    """
    if name not in (*PIPELINE_NAMES, NO_PIPELINE):
        raise PipelineError(f"unknown pipeline {name!r}; use one of {', '.join(PIPELINE_NAMES)} or {NO_PIPELINE}")
    if name == AUTO:
        return "pec" if pec_runs_on(device) else "prioritized"
    if name == "pec" and not pec_runs_on(device):
        reason = (f"--pipeline pec runs torchrec's TrainPipelinePEC, which needs a CUDA device (this rank has "
                  f"{device}); use --pipeline prioritized (the same schedule on any backend) or --pipeline auto")
        if not pec_fallback:
            raise PipelineUnavailableError(reason)
        logger.warning("%s; using the prioritized pipeline instead", reason)
        return "prioritized"
    return name


def model_builder(name: str) -> Callable:
    """The sharded-model builder pipeline ``name`` needs (a name from :func:`resolve_pipeline_name`).

    Returns:
        :func:`fstrain.distributed.pec.build_pec_sharded_model` for ``pec`` (the item table wrapped in
        ``PECEmbeddingCollection``, which ``TrainPipelinePEC`` requires), else
        :func:`fstrain.distributed.sharding.build_sharded_model`; both take ``(config, optim, env)``.
    """
    if name == "pec":
        from fstrain.distributed.pec import build_pec_sharded_model

        return build_pec_sharded_model
    from fstrain.distributed.sharding import build_sharded_model

    return build_sharded_model


def pipeline_for_run(config: PipelineConfig, dmp: DistributedModelParallel, optimizer,
                     device: torch.device) -> TrainPipeline | LoopPipeline:
    """What :func:`fstrain.train.train` drives (collective): :func:`make_pipeline`'s pipeline, or for
    ``none`` the :class:`LoopPipeline` of ``config.step_mode`` (the loop's own step). Every one is
    driven the same way: ``pipe.steps(batches, rank)``, ``pipe.flush()``, ``pipe.close()``."""
    if config.name == NO_PIPELINE:
        return LoopPipeline.from_config(config, dmp, optimizer, device)
    return make_pipeline(config, dmp, optimizer, device)


def make_pipeline(config: PipelineConfig | str, dmp: DistributedModelParallel, optimizer,
                  device: torch.device) -> TrainPipeline:
    """Build the pipeline named by ``config`` (collective: call it on every rank).

    ``auto`` and the ``pec``-or-``prioritized`` fallback are decided by :func:`resolve_pipeline_name`
    alone (a name it returned passes through it unchanged); the model must be built by
    :func:`model_builder` of that name.

    Args:
        config: a :class:`PipelineConfig` or just its ``name``.
        dmp: the sharded model.
        optimizer: its optimizer.
        device: where the model runs.

    Returns:
        The pipeline; drive it with ``pipeline.progress(iterator)`` until ``StopIteration``, or
        ``pipeline.steps(batches, rank)``.

    Raises:
        PipelineError: unknown name.
        PipelineUnavailableError: ``pec`` where it cannot run (no CUDA and ``pec_fallback`` off, or a
            model whose table is not PEC-wrapped).
    """
    if isinstance(config, str):
        config = PipelineConfig(name=config)
    if config.name == NO_PIPELINE:
        raise PipelineError(f"pipeline {NO_PIPELINE!r} is the training loop's own step: pipeline_for_run builds it")
    # the one decision of auto / pec-or-prioritized (fstrain.train made it already, before the model was built)
    name = resolve_pipeline_name(config.name, device, pec_fallback=config.pec_fallback)
    if not config.overlap and name != "prioritized":
        logger.warning("pipeline %s: overlap=False only applies to the prioritized pipeline; ignored", name)
    if name == "prioritized" and config.overlap:
        has_core, why = prefetch_core_check(device)
        if not has_core and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            logger.warning("pipeline prioritized: no spare CPU core for its prefetch thread (%s); the inline schedule "
                           "is faster on such a host, same results: --no-pipeline-overlap (docs/pipeline.md)", why)
    return PIPELINES.get(name).from_config(config, dmp, optimizer, device)


__all__ = ["AUTO", "NO_PIPELINE", "PIPELINES", "PIPELINE_NAMES", "pipeline_names", "STEP_MODES", "PipelineConfig",
           "PipelineError", "PipelineUnavailableError", "StepStats", "StepOutput", "TrainPipeline", "LoopPipeline",
           "PlainPipeline", "SparseDistPipeline", "PECPipeline", "PrioritizedPipeline", "make_pipeline",
           "model_builder", "pipeline_for_run", "pec_runs_on", "pec_unavailable_reason", "pipeline_steps",
           "resolve_pipeline_name", "run_steps", "prefetch_core_check"]
