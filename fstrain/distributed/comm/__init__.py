"""Embedding all-to-all transports: gloo/NCCL reference, shared memory (CPU), copy engines (GPU).

A training loop picks a transport by name with `CommConfig.backend` (the names: the registry
:data:`COMM_BACKENDS`, :mod:`fstrain.distributed.comm.transports`) and uses it in one of two ways
(see docs/comm.md):

1. As the torch.distributed backend, so torchrec's sharded modules use it without changes::

       cfg = CommConfig(backend="shm")
       dist.init_process_group(register_torch_backends(cfg), ...)   # "fs_shm" / "gloo" / "nccl"

2. Directly, as a `CommBackend`::

       comm = build_backend(cfg, store=store, rank=rank, world_size=world_size)
       out = comm.all_to_all_v(x, output_splits, input_splits)
"""

from __future__ import annotations

from fstrain.distributed.comm.base import (BackendUnavailableError, CommBackend, CommError, ConcurrentCollectiveError,
                                           PeerExitedError, PeerTimeoutError, SplitMismatchError)
from fstrain.distributed.comm.cuda_ce import CopyEngineBackend
from fstrain.distributed.comm.gloo import TorchDistBackend
from fstrain.distributed.comm.hierarchical import NODE_ID_ENV, HierarchicalAllToAll, NodeLayout, node_key
from fstrain.distributed.comm.process_group import (CUDA_CE_BACKEND_NAME, SHM_BACKEND_NAME, CopyEngineProcessGroup,
                                                    ShmProcessGroup)
from fstrain.distributed.comm.shm import ShmBackend
from fstrain.distributed.comm.transports import (AUTO, BACKEND_CHOICES, BACKEND_DEVICES, BACKEND_NAMES, COMM_BACKENDS,
                                                 CommConfig, Transport, build_backend, register_torch_backends,
                                                 resolve_backend)

__all__ = [
    "AUTO",
    "BACKEND_CHOICES",
    "BACKEND_DEVICES",
    "BACKEND_NAMES",
    "COMM_BACKENDS",
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
    "Transport",
    "build_backend",
    "node_key",
    "register_torch_backends",
    "resolve_backend",
]
