"""The reference schedule: every stage in order, nothing overlapped."""

from __future__ import annotations

from fstrain.pipelines.base import PIPELINES, TrainPipeline
from fstrain.pipelines.loop import plain_step


@PIPELINES.register("plain")
class PlainPipeline(TrainPipeline):
    """The reference: every stage in order on the main thread (the default CUDA stream on GPU).

    Its step is :func:`fstrain.pipelines.loop.plain_step` (``--pipeline none --step-mode plain``),
    with the compute timed. Stages: ``## forward ##`` (input dist, lookup, embedding all-to-all, dense forward through
    DMP/DDP), ``## backward ##`` (dense backward with the DDP SUM all-reduce, gradient
    all-to-all, fused sparse update), ``## optimizer ##`` (dense Adam).
    """

    name = "plain"

    def _progress(self, dataloader_iter):
        batch = next(dataloader_iter).to(self.device)
        return plain_step(self.dmp, self.timed_optimizer, batch), 0, 0  # the loop's reference step, timed


__all__ = ["PlainPipeline"]
