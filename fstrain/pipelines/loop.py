"""``--pipeline none``: the training loop's own step, driven like the other pipelines.

Two step functions compute the same update:

* :func:`plain_step` (reference, ``--step-mode plain``; also :class:`fstrain.pipelines.plain.PlainPipeline`'s
  step): ``loss = dmp(batch); loss.backward(); opt.step()``; the dense all-reduce runs inside the
  backward (DDP, SUM hook). This is the shape torchrec's ``TrainPipelineSparseDist`` /
  ``TrainPipelinePEC`` drive.
* :func:`measured_step` (default, ``--step-mode measured``): the backward is split at the embedding
  output so the rank's local compute (dense forward + backward) is timed apart from the first
  collective that waits on the other ranks (a one-element all-reduce), then the sparse backward
  (gradient all-to-all, fused update) and the dense SUM all-reduce run. Its timings give the bubble.

:class:`LoopPipeline` drives either over the batches with the interface :func:`fstrain.train.train`
uses for every pipeline (``steps``, ``flush``, ``close``), so the training loop has one shape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.model_parallel import DistributedModelParallel

from fstrain.components.metrics import StepTiming
from fstrain.data.batch import HISTORY_KEY, Batch
from fstrain.distributed.sharding import allreduce_dense_grads
from fstrain.models.config import NEGATIVE_KEY
from fstrain.models.recommender import objective_inputs
from fstrain.pipelines.base import NO_PIPELINE, PipelineConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step(dmp: DistributedModelParallel, optimizer, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference step: forward through DMP/DDP, ``loss.backward()``, optimizer step, on ``batch`` (on
    the model's device, with negatives).

    Returns:
        ``(loss_sum, num_supervised)`` of this rank: the detached loss sum over its samples and the
        loss's supervised count (tensors).
    """
    with record_function("## forward ##"):
        loss, output = dmp(batch)
    with record_function("## backward ##"):
        loss.backward()
    with record_function("## optimizer ##"):
        optimizer.step()
        optimizer.zero_grad()
    return output


def measured_step(dmp: DistributedModelParallel, opt, batch: Batch, rank: int, device: torch.device,
                  num_tokens: int = -1) -> tuple[torch.Tensor, int, StepTiming]:
    """Timed step with the same update as :func:`plain_step` (see the module docstring).

    Args:
        num_tokens: history items of the batch (recorded; pass it from the host copy).

    Returns:
        ``(loss_sum, num_samples, timing)``.
    """
    model = dmp.module
    f = batch.features
    t0 = time.perf_counter()
    hist, tgt, neg = model.sparse_forward(f)
    _sync(device)
    t1 = time.perf_counter()
    with record_function("## dense_forward_backward ##"):
        leaves = [x.detach().requires_grad_() for x in (hist, tgt, neg)]
        loss, (loss_sum, n) = model.dense(leaves[0], f[HISTORY_KEY].lengths(), leaves[1], leaves[2],
                                          batch.target_ids, f[NEGATIVE_KEY].values(), batch.global_num_samples,
                                          **objective_inputs(batch))
        loss.backward()
        _sync(device)
    t2 = time.perf_counter()
    with record_function("## wait_for_stragglers ##"):
        if dist.get_world_size() > 1:
            dist.all_reduce(torch.zeros(1, device=device))
        _sync(device)
    t3 = time.perf_counter()
    with record_function("## sparse_backward ##"):
        torch.autograd.backward([hist, tgt, neg], [x.grad for x in leaves])
    with record_function("## dense_allreduce ##"):
        allreduce_dense_grads(dmp)
    with record_function("## optimizer ##"):
        opt.step()
        opt.zero_grad()
    _sync(device)
    t4 = time.perf_counter()
    timing = StepTiming(step=batch.step, rank=rank, num_samples=batch.num_samples,
                        num_tokens=num_tokens if num_tokens >= 0 else int(f[HISTORY_KEY].lengths().sum()),
                        sparse_forward_seconds=t1 - t0,
                        compute_seconds=t2 - t1, wait_seconds=t3 - t2, sync_seconds=t4 - t3)
    return loss_sum, int(n), timing


class LoopPipeline:
    """``--pipeline none``: one :func:`measured_step` (or, ``step_mode="plain"``, :func:`plain_step`)
    per batch, in order, nothing read ahead; not a :class:`fstrain.pipelines.TrainPipeline` (no
    compute hooks, no straggler group: the measured step times itself, the plain step not at all).

    Args:
        dmp: the sharded model.
        optimizer: its optimizer.
        device: where the model runs.
        step_mode: ``measured`` or ``plain`` (:data:`fstrain.pipelines.STEP_MODES`).

    Attributes:
        records_timings: whether the steps' timings are measurements (``False`` for ``plain``: its
            items carry zero times, which the training loop neither records nor summarises).
    """

    name = NO_PIPELINE

    def __init__(self, dmp: DistributedModelParallel, optimizer, device: torch.device, *,
                 step_mode: str = "measured") -> None:
        self.dmp, self.optimizer, self.device, self.step_mode = dmp, optimizer, device, step_mode
        self.records_timings = step_mode != "plain"

    @classmethod
    def from_config(cls, config: PipelineConfig, dmp: DistributedModelParallel, optimizer,
                    device: torch.device) -> LoopPipeline:
        """Build it with the :class:`PipelineConfig` field it takes (``step_mode``)."""
        return cls(dmp, optimizer, device, step_mode=config.step_mode)

    def steps(self, batches: Iterator[Batch], rank: int, *, lag: bool = False
              ) -> Iterator[tuple[int, torch.Tensor, int, int, StepTiming]]:
        """Train on every batch of ``batches`` (host batches with negatives), yielding what
        :func:`fstrain.pipelines.pipeline_steps` yields (``lag`` has no effect: each step ends synchronised)."""
        for batch in batches:
            num_tokens = int(batch.lengths.sum())  # on the host, before the copy
            if self.device.type == "cuda":
                batch = batch.pin_memory()  # so the copy below is asynchronous
            batch = batch.to(self.device, non_blocking=True)
            if self.step_mode == "plain":
                loss_sum, supervised = plain_step(self.dmp, self.optimizer, batch)
                n = int(supervised)
                timing = StepTiming(step=batch.step, rank=rank, num_samples=batch.num_samples, num_tokens=num_tokens,
                                    sparse_forward_seconds=0.0, compute_seconds=0.0, wait_seconds=0.0,
                                    sync_seconds=0.0)
            else:
                loss_sum, n, timing = measured_step(self.dmp, self.optimizer, batch, rank, self.device, num_tokens)
            yield batch.step, loss_sum, n, num_tokens, timing

    def flush(self) -> None:
        """Nothing in flight after a step."""

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["LoopPipeline", "measured_step", "plain_step"]
