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

from fstrain.distributed.comm.base import BackendUnavailableError, CommBackend, CommError, even_splits
from fstrain.distributed.comm.hierarchical import HierarchicalAllToAll, NodeLayout, is_dense, node_key
from fstrain.distributed.comm.shm import ShmBackend

logger = logging.getLogger(__name__)

__all__ = ["CUDA_CE_BACKEND_NAME", "CopyEngineProcessGroup", "SHM_BACKEND_NAME", "ShmProcessGroup", "completed_work",
           "register_cuda_ce_backend", "register_shm_backend"]

#: name to pass to ``dist.init_process_group`` / ``dist.new_group`` after registration.
SHM_BACKEND_NAME = "fs_shm"
#: the copy-engine group's name (``fstrain train --backend cuda-ce``).
CUDA_CE_BACKEND_NAME = "fs_cuda_ce"


def _publish_layout(store: dist.Store, rank: int, world_size: int) -> NodeLayout:
    """Every rank's :func:`~fstrain.distributed.comm.hierarchical.node_key` through the group's store (an all-gather):
    the same :class:`NodeLayout` on every rank."""
    node_store = dist.PrefixStore("node/", store)
    node_store.set(str(rank), node_key())
    return NodeLayout.from_keys([node_store.get(str(r)).decode() for r in range(world_size)], rank)


def completed_work(result: list[torch.Tensor]) -> dist.Work:
    """A ``Work`` that is already finished, whose future holds ``result``."""
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class ShmProcessGroup(dist.ProcessGroup):
    """Process group: all-to-all on `ShmBackend`, every other collective on gloo.

    When the group spans several nodes (node keys published in the store,
    :func:`fstrain.distributed.comm.hierarchical.node_key`), the all-to-all is hierarchical
    (:class:`~fstrain.distributed.comm.hierarchical.HierarchicalAllToAll`): rows between ranks of one node on
    that node's shm transport, rows across nodes on the group's gloo, both in one call whose
    result equals gloo's all-to-all. One gloo all-reduce at construction checks that every rank
    holds the same layout and built its node-local transport (else every rank raises
    `BackendUnavailableError`).

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
        #: which node every rank is on (published in the store; identical on every rank)
        self.layout = _publish_layout(store, rank, world_size)
        #: the multi-node path (``None`` when every rank is on one node)
        self.hierarchical: HierarchicalAllToAll | None = None
        if self.layout.num_nodes == 1:
            #: the shm transport (the node-local one of a multi-node group; ``None`` for a node of one rank)
            self.transport: CommBackend | None = ShmBackend(
                dist.PrefixStore("shm/", store), rank=rank, world_size=world_size, config=config)
        else:
            self.transport, reason = None, None
            local = self.layout.local_ranks
            if len(local) > 1:
                try:
                    self.transport = ShmBackend(
                        dist.PrefixStore(f"shm/node{self.layout.node_index}/", store),
                        rank=self.layout.local_index, world_size=len(local), config=config)
                except CommError as e:  # agreed below: every rank raises, not only this one
                    reason = f"{type(e).__name__}: {e}"
            self._agree_on_layout(reason)
            self.hierarchical = HierarchicalAllToAll(self.layout, self.transport, self._gloo_all_to_all)
        #: number of all-to-all calls served by the shm transport (for tests and stats).
        self.num_shm_all_to_all = 0

    def _gloo_all_to_all(self, output, input, output_splits, input_splits) -> dist.Work:
        return self._gloo.alltoall_base(output, input, output_splits, input_splits, dist.AllToAllOptions())

    def _agree_on_layout(self, reason: str | None) -> None:
        """One gloo all-reduce (MAX of ``[digest, -digest, failed]``) before any user collective:
        every rank holds the same node layout and built its node-local transport, or every rank
        raises `BackendUnavailableError`."""
        flag = torch.tensor([self.layout.digest(), -self.layout.digest(), int(reason is not None)],
                            dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._gloo.allreduce([flag], opts).wait()
        high, neg_low, failed = flag.tolist()
        if failed or high != -neg_low:
            if self.transport is not None:
                self.transport.close()
            what = (f"rank {self._rank}: {reason}" if reason else "another rank (see its error)") if failed else \
                "the ranks disagree on the node layout (different node keys in the store)"
            raise BackendUnavailableError(f"fs_shm: the node-local shared-memory transport of the multi-node "
                                          f"group could not be set up on every rank: {what}")

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
        if self.hierarchical is not None:  # several nodes: shm inside this node, gloo across
            self.hierarchical(output, input, out_splits, in_splits)
        elif is_dense(output):  # not is_contiguous(): a one-row column slice passes that
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
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.shutdown()


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
    """Process group: all-to-all on copy engines (:class:`fstrain.distributed.comm.CopyEngineBackend`), the rest on
    NCCL.

    NOT RUN ON A GPU YET (no GPU where it was written; ``tests/fstrain/test_comm_cuda_ce.py`` is
    CUDA-marked). Built at ``dist.init_process_group("fs_cuda_ce")`` after
    :func:`register_cuda_ce_backend`:

    1. an NCCL backend over the same store (every collective but the all-to-all, and the
       all-to-all itself where copy engines cannot be used);
    2. every rank publishes its GPU's UUID and its node key in the store, decides locally whether
       it reaches every peer's GPU on its node over peer access
       (:func:`fstrain.distributed.comm.cuda_ce.copy_engine_reason`), and one NCCL all-reduce (MIN) of that
       flag decides for all ranks before any user collective;
    2b. a group on several nodes (the default group only) is hierarchical
       (:class:`~fstrain.distributed.comm.hierarchical.HierarchicalAllToAll`): at the first all-to-all every
       rank makes the node-local NCCL groups (``dist.new_subgroups_by_enumeration``), rows between
       GPUs of one node go over copy engines on that node's group, rows across nodes over this
       group's NCCL (zero splits inside the node), in one call;
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
        from fstrain.distributed.comm.cuda_ce import CopyEngineBackend, _device_uuid, copy_engine_reason

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
        #: which node every rank is on (node keys through the store; identical on every rank)
        self.layout = _publish_layout(store, rank, world_size)
        #: several nodes: copy engines inside each node, NCCL across (built at the first all-to-all)
        self.hierarchical: HierarchicalAllToAll | None = None
        multi_node = self.layout.num_nodes > 1
        visible = [_device_uuid(i) for i in range(torch.cuda.device_count())]
        reason = None if not self.config.force_nccl else "force_nccl is set"
        if multi_node and not reason and dist.is_initialized():  # identical on every rank of the group
            reason = ("the group spans several nodes and is not the default group (its node-local groups "
                      "need dist.new_subgroups_by_enumeration, which every rank of the default group calls)")
        peers = [self.peer_uuids[r] for r in self.layout.local_ranks] if multi_node else self.peer_uuids
        reason = reason or copy_engine_reason(self.device.index, peers, visible)
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
        #: multi-node all-to-all calls (copy engines inside the node, NCCL across).
        self.num_hierarchical_all_to_all = 0

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return CUDA_CE_BACKEND_NAME

    def _nccl_all_to_all(self, output, input, output_splits, input_splits) -> dist.Work:
        return self._nccl.alltoall_base(output, input, output_splits, input_splits, dist.AllToAllOptions())

    def _build_hierarchical(self) -> None:
        """Multi-node: node-local NCCL groups (every rank of the default group, in the same order), a
        copy-engine transport on this node's group, and the routing over both."""
        from fstrain.distributed.comm.cuda_ce import CopyEngineBackend

        local_group, _ = dist.new_subgroups_by_enumeration(self.layout.nodes, backend="nccl")
        local = self.layout.local_ranks
        if len(local) > 1:  # agrees inside the node; a node that falls back uses NCCL on its local group
            self._transport = CopyEngineBackend(local_group, config=self.config,
                                                peer_uuids=[self.peer_uuids[r] for r in local])
            if not self._transport.uses_copy_engines:
                self.fallback_reason = f"inside node {self.layout.node_index}: {self._transport.fallback_reason}"
        self.hierarchical = HierarchicalAllToAll(self.layout, self._transport, self._nccl_all_to_all)

    def _copy_engines(self):
        """The transport, built at the first all-to-all (collective: every rank is in that call)."""
        if self.hierarchical is None and self.copy_engines_agreed and self.layout.num_nodes > 1:
            self._build_hierarchical()
        elif self._transport is None and self.copy_engines_agreed:
            from fstrain.distributed.comm.cuda_ce import CopyEngineBackend

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
        if self.hierarchical is not None and input.is_cuda:  # several nodes: copy engines inside, NCCL across
            out_splits = list(output_split_sizes) or even_splits(output.shape[0], self._world_size)
            in_splits = list(input_split_sizes) or even_splits(input.shape[0], self._world_size)
            self.hierarchical(output, input, out_splits, in_splits)
            self.num_hierarchical_all_to_all += 1
            return completed_work([output])
        if transport is None:
            return self._nccl.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                            opts or dist.AllToAllOptions())
        out_splits = list(output_split_sizes) or even_splits(output.shape[0], self._world_size)
        in_splits = list(input_split_sizes) or even_splits(input.shape[0], self._world_size)
        if is_dense(output):
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
        config: :class:`fstrain.distributed.comm.CopyEngineBackend.Config` for every group created afterwards.

    Returns:
        the backend name, ``"fs_cuda_ce"``.
    """
    dist.Backend.register_backend(CUDA_CE_BACKEND_NAME, functools.partial(_create_cuda_ce_group, config=config),
                                  devices=["cuda"])
    return CUDA_CE_BACKEND_NAME
