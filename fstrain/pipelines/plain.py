"""The reference schedule: every stage in order, nothing overlapped."""

from __future__ import annotations

from torch.autograd.profiler import record_function

from fstrain.pipelines.base import PIPELINES, TrainPipeline


@PIPELINES.register("plain")
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


__all__ = ["PlainPipeline"]
