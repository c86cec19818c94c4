"""Embedding all-to-all transports: gloo/NCCL reference, shared memory (CPU), copy engines (GPU).

A training loop picks a transport by name with `CommConfig.backend` and uses it in one of two
ways (see docs/comm.md):

1. As the torch.distributed backend, so torchrec's sharded modules use it without changes::

       cfg = CommConfig(backend="shm")
       dist.init_process_group(register_torch_backends(cfg), ...)   # "fs_shm" / "gloo" / "nccl"

2. Directly, as a `CommBackend`::

       comm = build_backend(cfg, store=store, rank=rank, world_size=world_size)
       out = comm.all_to_all_v(x, output_splits, input_splits)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from fstrain.distributed.backends import AUTO, resolve_backend
from fstrain.distributed.backends import BACKEND_CHOICES as _BACKEND_CHOICES
from fstrain.distributed.backends import BACKEND_NAMES as _BACKEND_NAMES
from fstrain.distributed.comm.base import (BackendUnavailableError, CommBackend, CommError, ConcurrentCollectiveError,
                                           PeerExitedError, PeerTimeoutError, SplitMismatchError)
from fstrain.distributed.comm.cuda_ce import CopyEngineBackend
from fstrain.distributed.comm.gloo import TorchDistBackend
from fstrain.distributed.comm.hierarchical import NODE_ID_ENV, HierarchicalAllToAll, NodeLayout, node_key
from fstrain.distributed.comm.process_group import (CUDA_CE_BACKEND_NAME, SHM_BACKEND_NAME, CopyEngineProcessGroup,
                                                    ShmProcessGroup, register_cuda_ce_backend, register_shm_backend)
from fstrain.distributed.comm.shm import ShmBackend

__all__ = [
    "BACKEND_NAMES",
    "CUDA_CE_BACKEND_NAME",
    "SHM_BACKEND_NAME",
    "BackendUnavailableError",
    "CommBackend",
    "CommConfig",
    "CommError",
    "ConcurrentCollectiveError",
    "CopyEngineBackend",
    "CopyEngineProcessGroup",
    "HierarchicalAllToAll",
    "NODE_ID_ENV",
    "NodeLayout",
    "PeerExitedError",
    "PeerTimeoutError",
    "ShmBackend",
    "ShmProcessGroup",
    "SplitMismatchError",
    "TorchDistBackend",
    "build_backend",
    "node_key",
    "register_torch_backends",
]

# Per group name, how many shm transports were built on it: identical on every member, so the
# store prefix is unique per transport and agreed without communication.
_shm_instances: dict[str, itertools.count] = {}

#: config names accepted by `CommConfig.backend` (the one table: :mod:`fstrain.distributed.backends`).
BACKEND_NAMES = _BACKEND_NAMES


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """Which transport carries the embedding all-to-all, and its settings."""

    backend: str = field(default="gloo", metadata={"flag": "--backend"})
    """``"auto"`` (``"nccl"`` when CUDA is available, else ``"gloo"``) or one of ``"gloo"`` (CPU reference),
    ``"nccl"`` (GPU, SM kernels, any topology), ``"shm"`` (CPU shared memory inside a node; as a process group on
    several nodes, hierarchical with gloo across), ``"cuda-ce"`` (GPU copy engines inside a node; NCCL across nodes,
    hierarchical, or as the fallback)."""
    shm: ShmBackend.Config = field(default_factory=ShmBackend.Config)
    """Settings of the ``"shm"`` transport (chunk size, ring slots, timeout)."""
    cuda_ce: CopyEngineBackend.Config = field(default_factory=CopyEngineBackend.Config)
    """Settings of the ``"cuda-ce"`` transport (chunk size, staging buffer)."""

    def __post_init__(self) -> None:
        if self.backend not in _BACKEND_CHOICES:
            raise ValueError(
                f"unknown comm backend {self.backend!r}; choose one of {', '.join(_BACKEND_CHOICES)}"
            )

    def resolved(self) -> CommConfig:
        """This config with ``backend`` concrete: ``"auto"`` decided (``"nccl"`` when CUDA is available,
        else ``"gloo"``) and a CUDA backend checked against the machine, by
        :func:`fstrain.distributed.backends.resolve_backend`; called once, at startup.

        Raises:
            ConfigError: ``"nccl"`` / ``"cuda-ce"`` where no CUDA device is visible.
        """
        from dataclasses import replace  # noqa: PLC0415

        return replace(self, backend=resolve_backend(self.backend))

    def _concrete(self) -> str:
        if self.backend == AUTO:
            raise ValueError("CommConfig(backend='auto') is decided once, at startup: pass config.resolved()")
        return self.backend


def register_torch_backends(config: CommConfig) -> str:
    """Register the custom torch.distributed backend ``config`` needs; return its name.

    Args:
        config: the selected transport, resolved (:meth:`CommConfig.resolved`).

    Returns:
        the name to pass to ``dist.init_process_group`` / ``dist.new_group``: ``"gloo"``,
        ``"nccl"``, ``"fs_shm"`` (all-to-all on shared memory, the rest on gloo) or
        ``"fs_cuda_ce"`` (all-to-all on copy engines inside a node, the rest on NCCL; see
        `CopyEngineProcessGroup`). Groups on several nodes are hierarchical
        (:mod:`fstrain.distributed.comm.hierarchical`).
    """
    backend = config._concrete()
    if backend == "shm":
        return register_shm_backend(config.shm)
    if backend == "cuda-ce":
        return register_cuda_ce_backend(config.cuda_ce)
    return backend


def build_backend(
    config: CommConfig,
    *,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> CommBackend:
    """Build the `CommBackend` named by ``config.backend`` (a collective over the group).

    Args:
        config: the selected transport, resolved (:meth:`CommConfig.resolved`).
        store: store shared by the ranks; needed by ``"shm"`` (default: the default group's).
            Transports are keyed by group name and build order, so members of a group must build
            theirs in the same order.
        rank: rank in the group (default: ``dist.get_rank(group)``).
        world_size: ranks in the group (default: ``dist.get_world_size(group)``).
        group: the torch process group for ``"gloo"``/``"nccl"`` and the NCCL group behind
            ``"cuda-ce"`` (default: the default group).

    Returns:
        a ready transport; close it with ``close()`` when done.

    Raises:
        BackendUnavailableError: the transport cannot run here (see the message for the fix).
    """
    rank = dist.get_rank(group) if rank is None else rank
    world_size = dist.get_world_size(group) if world_size is None else world_size
    backend = config._concrete()
    if backend in ("gloo", "nccl"):
        return TorchDistBackend(group, name=backend)
    if backend == "shm":
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        group_name = (group or dist.group.WORLD).group_name if dist.is_initialized() else "-"
        counter = _shm_instances.setdefault(group_name, itertools.count())
        prefix = f"fs_comm_shm/{group_name}/{next(counter)}"
        return ShmBackend(store, prefix=prefix, rank=rank,
                          world_size=world_size, config=config.shm)
    return CopyEngineBackend(group, config=config.cuda_ce)
