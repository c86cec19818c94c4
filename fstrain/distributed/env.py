"""This process's place in the job: the process group from torchrun's environment, its device.

Backend names come from the one table, :mod:`fstrain.distributed.backends`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fstrain.distributed.backends import BACKEND_CHOICES, BACKEND_DEVICES
from fstrain.errors import ConfigError


BACKENDS = BACKEND_CHOICES  # the one table: fstrain.distributed.backends


def planned_device(backend: str) -> torch.device:
    """The device :func:`init_distributed` will pick for ``backend`` (without initialising anything).

    Args:
        backend: a concrete name (``auto`` resolved at startup: :meth:`fstrain.distributed.comm.CommConfig.resolved`).

    Raises:
        ConfigError: ``auto`` or an unknown backend.
    """
    if backend not in BACKEND_DEVICES:
        raise ConfigError(f"backend {backend!r} is not a resolved backend name; use one of "
                          f"{', '.join(BACKEND_DEVICES)}")
    return torch.device(BACKEND_DEVICES[backend])


@dataclass(frozen=True, slots=True)
class DistEnv:
    """This process's place in the job.

    Attributes:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank inside the node (selects the CUDA device).
        device: ``cuda:<local_rank>`` with ``nccl`` / ``cuda-ce``, else ``cpu``.
        backend: ``nccl``, ``gloo``, ``shm`` or ``cuda-ce``.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_distributed(backend: str = "auto", timeout_seconds: float = 600, comm=None) -> DistEnv:
    """Initialise ``torch.distributed`` from torchrun's environment (single process without it).

    Args:
        backend: a name of :data:`fstrain.distributed.backends.BACKEND_CHOICES`: ``auto`` (NCCL when CUDA is
            available, else gloo), ``nccl``, ``gloo``, ``shm`` (CPU: the shared-memory
            all-to-all of :mod:`fstrain.distributed.comm`, registered as a torch.distributed backend, so
            torchrec's all-to-alls use it unchanged) or ``cuda-ce`` (GPU: the all-to-all on copy
            engines, every other collective on NCCL; :class:`fstrain.distributed.comm.CopyEngineProcessGroup`).
            On several nodes ``shm`` / ``cuda-ce`` are hierarchical by themselves (shm / copy
            engines inside a node, gloo / NCCL across; :mod:`fstrain.distributed.comm.hierarchical`).
        timeout_seconds: collective timeout (process group, and the shm transport's own).
        comm: a :class:`fstrain.distributed.comm.CommConfig` whose transport settings (``shm``,
            ``cuda_ce``) are used; its ``backend`` replaces ``backend``. ``None``: the defaults.
            ``auto`` is resolved here unless the caller did already, once, at startup
            (:meth:`fstrain.distributed.comm.CommConfig.resolved`, as :func:`fstrain.train.train` does).

    Returns:
        The :class:`DistEnv`.

    Raises:
        ConfigError: ``nccl`` / ``cuda-ce`` requested without CUDA, or an unknown backend.
    """
    from dataclasses import replace

    from fstrain.distributed.comm import CommConfig, register_torch_backends

    try:
        comm = (comm if comm is not None else CommConfig(backend=backend)).resolved()
    except ValueError as e:  # CommConfig's own check: an unknown name
        raise ConfigError(str(e)) from None
    backend = comm.backend
    if backend == "shm":  # the transport times out with the process group
        comm = replace(comm, shm=replace(comm.shm, timeout_seconds=timeout_seconds))
    pg_backend = register_torch_backends(comm)  # "gloo", "nccl", "fs_shm" or "fs_cuda_ce"
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if BACKEND_DEVICES[backend] == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = None
        if "MASTER_ADDR" not in os.environ and world == 1:  # plain `fstrain train` without torchrun
            # bind the store to a port the OS picks (port 0) instead of probing a free port and
            # binding it later: another process could take it in between (EADDRINUSE)
            # (one process: no peer, so no watchdog connects to it and nothing goes into the environment)
            store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
        dist.init_process_group(backend=pg_backend, rank=rank, world_size=world, timeout=timeout, store=store,
                                device_id=device if backend == "nccl" else None)
    return DistEnv(rank, world, local, device, backend)


