"""torchrec's own pipelines behind our interface: ``TrainPipelineSparseDist`` and ``TrainPipelinePEC``."""

from __future__ import annotations

import torch
from torchrec.distributed.model_parallel import DistributedModelParallel

from fstrain.pipelines.base import PIPELINES, PipelineUnavailableError, TrainPipeline


@PIPELINES.register("sparse-dist")
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


@PIPELINES.register("pec")
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


__all__ = ["PECPipeline", "SparseDistPipeline", "pec_unavailable_reason"]
