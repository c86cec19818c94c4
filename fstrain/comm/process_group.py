"""torch.distributed process groups whose all-to-all runs on a `CommBackend` transport.

torch lets a Python subclass of ``dist.ProcessGroup`` act as a backend: a creator registered with
``dist.Backend.register_backend(name, creator, devices=[...])`` returns the subclass, which then
*is* the group (``distributed_c10d._new_process_group_helper`` keeps it as the group object). The
C++ trampoline (``PyProcessGroup``) sends ``all_to_all_single`` (deprecated name
``alltoall_base``) to the Python override for every caller: ``dist.all_to_all_single``,
``torch.ops._c10d_functional.all_to_all_single`` and therefore torchrec's
``comm_ops.alltoall_pooled`` / ``alltoall_sequence`` / ``variable_batch_alltoall_pooled`` and the
KJT input dist. Every other collective runs on a gloo backend the group owns (also registered
on the object with ``_register_backend``, for the C++ paths that look it up). So one group, one
name:

    >>> register_torch_backends()
    >>> dist.init_process_group("fs_shm", ...)   # all-to-all on shared memory, rest on gloo

Limits (torch 2.13): the Python group cannot be built with the 3-argument (store, rank, size)
constructor (pybind raises "returned holder-wrapped instance is not an alias instance"), so it
keeps the store itself; the all-to-all runs synchronously inside the call and returns a completed
``Work`` (``async_op=True`` is accepted, the overlap comes from the caller's pipeline).

Why the other collectives are overridden in Python rather than inherited: for each collective
the trampoline can override (allreduce, allreduce_coalesced, allgather, broadcast, barrier,
reduce_scatter, send, recv and the coalesced all-gather / reduce-scatter), ``PyProcessGroup``
(torch 2.13, ``WORK_OVERRIDE``) takes the GIL to look for a Python override and, finding none,
calls the inherited C++ implementation *still holding the GIL*. That reaches gloo's ``enqueue``,
which waits for gloo's work-queue mutex; a gloo worker thread holds that mutex while it frees a
finished work, and freeing its tensors can need the GIL (Python-owned tensors). Lock-order
inversion: DMP/DDP set-up (``broadcast_object_list``, ``_verify_param_shape_across_processes``)
hung about one run in five on a loaded 2-core machine (both ranks inside the same gloo
collective; py-spy showed the worker in ``~AsyncAllgatherWork`` waiting for the GIL and the main
thread in ``ProcessGroupGloo::enqueue`` waiting for the mutex). Overridden here, the call enters
gloo through its Python binding, which releases the GIL first.
"""

from __future__ import annotations

import functools
import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions, _create_work_from_future
from torch.futures import Future

from fstrain.comm.base import CommBackend, even_splits
from fstrain.comm.shm import ShmBackend

logger = logging.getLogger(__name__)

__all__ = ["CUDA_CE_BACKEND_NAME", "CopyEngineProcessGroup", "SHM_BACKEND_NAME", "ShmProcessGroup", "completed_work",
           "register_cuda_ce_backend", "register_shm_backend"]

#: name to pass to ``dist.init_process_group`` / ``dist.new_group`` after registration.
SHM_BACKEND_NAME = "fs_shm"
#: the copy-engine group's name (``fstrain train --backend cuda-ce``).
CUDA_CE_BACKEND_NAME = "fs_cuda_ce"


def completed_work(result: list[torch.Tensor]) -> dist.Work:
    """A ``Work`` that is already finished, whose future holds ``result``."""
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class ShmProcessGroup(dist.ProcessGroup):
    """Process group: all-to-all on `ShmBackend`, every other collective on gloo.

    Args:
        store: the group's store (prefixed per group by torch).
        rank: this rank in the group.
        world_size: ranks in the group.
        timeout: collective timeout; also used by the shm transport when its config keeps the
            default.
        config: shared-memory transport settings.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                 config: ShmBackend.Config | None = None):
        super().__init__(rank, world_size)
        self._rank, self._world_size = rank, world_size
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size,
                                           timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.transport: CommBackend = ShmBackend(
            dist.PrefixStore("shm/", store), rank=rank, world_size=world_size, config=config)
        #: number of all-to-all calls served by the shm transport (for tests and stats).
        self.num_shm_all_to_all = 0

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return SHM_BACKEND_NAME

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: object = None) -> dist.Work:
        """``dist.all_to_all_single`` on shared memory (CPU tensors); CUDA tensors go to gloo.

        Empty split lists mean equal splits, as in torch. Errors of the transport
        (`PeerTimeoutError`, `PeerExitedError`, `SplitMismatchError`) propagate to the caller.
        """
        if input.device.type != "cpu":
            return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                            opts or dist.AllToAllOptions())
        out_splits = list(output_split_sizes) or even_splits(output.shape[0], self._world_size)
        in_splits = list(input_split_sizes) or even_splits(input.shape[0], self._world_size)
        if output.is_contiguous():
            self.transport.all_to_all_v(input, out_splits, in_splits, out=output)
        else:
            output.copy_(self.transport.all_to_all_v(input, out_splits, in_splits))
        self.num_shm_all_to_all += 1
        return completed_work([output])

    alltoall_base = all_to_all_single

    # ---- every other collective: gloo, entered through its GIL-releasing binding (module doc)
    def allreduce(self, *args, **kwargs) -> dist.Work:
        """``dist.all_reduce`` on gloo."""
        return self._gloo.allreduce(*args, **kwargs)

    def allreduce_coalesced(self, *args, **kwargs) -> dist.Work:
        """``dist.all_reduce_coalesced`` on gloo."""
        return self._gloo.allreduce_coalesced(*args, **kwargs)

    def allgather(self, *args, **kwargs) -> dist.Work:
        """``dist.all_gather`` on gloo."""
        return self._gloo.allgather(*args, **kwargs)

    def broadcast(self, *args, **kwargs) -> dist.Work:
        """``dist.broadcast`` on gloo."""
        return self._gloo.broadcast(*args, **kwargs)

    def barrier(self, *args, **kwargs) -> dist.Work:
        """``dist.barrier`` on gloo."""
        return self._gloo.barrier(*args, **kwargs)

    def reduce_scatter(self, *args, **kwargs) -> dist.Work:
        """``dist.reduce_scatter`` on gloo."""
        return self._gloo.reduce_scatter(*args, **kwargs)

    def send(self, *args, **kwargs) -> dist.Work:
        """``dist.send`` on gloo."""
        return self._gloo.send(*args, **kwargs)

    def recv(self, *args, **kwargs) -> dist.Work:
        """``dist.recv`` on gloo."""
        return self._gloo.recv(*args, **kwargs)

    def all_gather_single_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                    opts: object = None) -> dist.Work:
        """Coalesced ``dist.all_gather_into_tensor``: one gloo ``_allgather_base`` per pair, waited."""
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            self._gloo._allgather_base(out, inp, opts or AllgatherOptions()).wait()
        return completed_work(list(output_tensors))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Coalesced ``dist.reduce_scatter_tensor``: one gloo ``_reduce_scatter_base`` per pair, waited."""
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            self._gloo._reduce_scatter_base(out, inp, opts or ReduceScatterOptions()).wait()
        return completed_work(list(output_tensors))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def shutdown(self) -> None:
        self.transport.close()

    def abort(self) -> None:
        self.transport.close()


def _create_shm_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                      config: ShmBackend.Config | None = None) -> ShmProcessGroup:
    return ShmProcessGroup(store, rank, world_size, timeout, config)


def register_shm_backend(config: ShmBackend.Config | None = None) -> str:
    """Register `ShmProcessGroup` with torch.distributed as backend ``"fs_shm"`` (CPU).

    Call in every process before ``dist.init_process_group("fs_shm", ...)`` or
    ``dist.new_group(..., backend="fs_shm")``. Registering again replaces the config.

    Args:
        config: transport settings used for every group created afterwards.

    Returns:
        the backend name, ``"fs_shm"``.
    """
    dist.Backend.register_backend(SHM_BACKEND_NAME, functools.partial(_create_shm_group,
                                                                        config=config),
                                  devices=["cpu"])
    return SHM_BACKEND_NAME


class CopyEngineProcessGroup(dist.ProcessGroup):
    """Process group: all-to-all on copy engines (:class:`fstrain.comm.CopyEngineBackend`), the rest on NCCL.

    NOT RUN ON A GPU YET (no GPU where it was written; ``tests/fstrain/test_comm_cuda_ce.py`` is
    CUDA-marked). Built at ``dist.init_process_group("fs_cuda_ce")`` after
    :func:`register_cuda_ce_backend`:

    1. an NCCL backend over the same store (every collective but the all-to-all, and the
       all-to-all itself where copy engines cannot be used);
    2. every rank publishes its GPU's UUID in the store, decides locally whether it reaches every
       peer's GPU over peer access (:func:`fstrain.comm.cuda_ce.copy_engine_reason`), and one NCCL
       all-reduce (MIN) of that flag decides for all ranks before any user collective;
    3. at the first all-to-all (the group is registered by then, which the symmetric-memory
       rendezvous needs) the transport allocates its symmetric buffer and rendezvous, agreeing
       again on the outcome; from then on every CUDA ``all_to_all_single`` (torchrec's input
       dist, embedding and gradient all-to-alls) runs on copy engines.

    Args:
        store: the group's store.
        rank: this rank in the group.
        world_size: ranks in the group.
        timeout: collective timeout (NCCL's).
        config: copy-engine transport settings.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                 config=None):
        from fstrain.comm.cuda_ce import CopyEngineBackend, _device_uuid, copy_engine_reason

        super().__init__(rank, world_size)
        self._rank, self._world_size = rank, world_size
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, opts)
        self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self._nccl)
        self._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        self.config = config or CopyEngineBackend.Config()
        self.device = torch.device("cuda", torch.cuda.current_device())
        ce_store = dist.PrefixStore("cuda_ce/", store)
        ce_store.set(f"uuid/{rank}", _device_uuid(self.device.index))
        self.peer_uuids = [ce_store.get(f"uuid/{r}").decode() for r in range(world_size)]
        visible = [_device_uuid(i) for i in range(torch.cuda.device_count())]
        reason = None if not self.config.force_nccl else "force_nccl is set"
        reason = reason or copy_engine_reason(self.device.index, self.peer_uuids, visible)
        flag = torch.tensor([0 if reason else 1], dtype=torch.int32, device=self.device)
        ar = dist.AllreduceOptions()
        ar.reduceOp = dist.ReduceOp.MIN
        self._nccl.allreduce([flag], ar).wait()
        #: whether all ranks agreed to try copy engines (the transport may still fall back, agreed)
        self.copy_engines_agreed = bool(int(flag.item()))
        self.fallback_reason = reason or (None if self.copy_engines_agreed else
                                          "another rank cannot reach every peer GPU (see its warning)")
        if self.fallback_reason:
            logger.warning("cuda-ce: all-to-all on NCCL kernels: %s", self.fallback_reason)
        self._transport = None
        #: all-to-all calls served by copy engines (for tests and stats).
        self.num_copy_engine_all_to_all = 0

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return CUDA_CE_BACKEND_NAME

    def _copy_engines(self):
        """The transport, built at the first all-to-all (collective: every rank is in that call)."""
        if self._transport is None and self.copy_engines_agreed:
            from fstrain.comm.cuda_ce import CopyEngineBackend

            self._transport = CopyEngineBackend(self, config=self.config, peer_uuids=self.peer_uuids)
            if not self._transport.uses_copy_engines:
                self.fallback_reason = self._transport.fallback_reason
                self.copy_engines_agreed = False
        return self._transport if self.copy_engines_agreed else None

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: object = None) -> dist.Work:
        """``dist.all_to_all_single`` on copy engines (CUDA tensors, agreed path), else NCCL.

        Errors of the transport (`SplitMismatchError`, raised on every rank) propagate.
        """
        transport = self._copy_engines() if input.is_cuda else None
        if transport is None:
            return self._nccl.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                            opts or dist.AllToAllOptions())
        out_splits = list(output_split_sizes) or even_splits(output.shape[0], self._world_size)
        in_splits = list(input_split_sizes) or even_splits(input.shape[0], self._world_size)
        if output.is_contiguous():
            transport.all_to_all_v(input, out_splits, in_splits, out=output)
        else:
            output.copy_(transport.all_to_all_v(input, out_splits, in_splits))
        self.num_copy_engine_all_to_all += 1
        return completed_work([output])

    alltoall_base = all_to_all_single

    def shutdown(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        self.shutdown()


def _delegate_to_nccl(name: str):
    def method(self, *args, **kwargs) -> dist.Work:
        return getattr(self._nccl, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{name}`` on NCCL."
    return method


for _name in ("allreduce", "allreduce_coalesced", "allgather", "broadcast", "barrier", "reduce_scatter", "send",
              "recv", "reduce", "_allgather_base", "_reduce_scatter_base", "allgather_into_tensor_coalesced",
              "reduce_scatter_tensor_coalesced"):
    setattr(CopyEngineProcessGroup, _name, _delegate_to_nccl(_name))


def _create_cuda_ce_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                          config=None) -> CopyEngineProcessGroup:
    return CopyEngineProcessGroup(store, rank, world_size, timeout, config)


def register_cuda_ce_backend(config=None) -> str:
    """Register `CopyEngineProcessGroup` with torch.distributed as backend ``"fs_cuda_ce"`` (CUDA).

    Registering needs no GPU; creating a group does. Registering again replaces the config.

    Args:
        config: :class:`fstrain.comm.CopyEngineBackend.Config` for every group created afterwards.

    Returns:
        the backend name, ``"fs_cuda_ce"``.
    """
    dist.Backend.register_backend(CUDA_CE_BACKEND_NAME, functools.partial(_create_cuda_ce_group, config=config),
                                  devices=["cuda"])
    return CUDA_CE_BACKEND_NAME
