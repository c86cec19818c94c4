"""The ``--backend`` registry: one class per process-group backend name, registered in
:data:`COMM_BACKENDS` (the one list of names: ``--backend``'s choices, :class:`CommConfig`'s check and
the unknown-name error come from it), with the device it runs on, the torch.distributed backend it
registers and the :class:`fstrain.distributed.comm.CommBackend` it builds.

==========  ======  ==========================================================================
name        device  what carries the collectives
==========  ======  ==========================================================================
gloo        cpu     torch's gloo, everything
nccl        cuda    torch's NCCL (SM kernels), everything
shm         cpu     ``fs_shm`` group: all-to-all on :class:`fstrain.distributed.comm.ShmBackend` (shared
                    memory, one node), every other collective on gloo
cuda-ce     cuda    ``fs_cuda_ce`` group: all-to-all on :class:`fstrain.distributed.comm.CopyEngineBackend`
                    (copy engines between the GPUs of one node), every other collective on NCCL;
                    NCCL kernels across nodes
==========  ======  ==========================================================================

``auto`` (NCCL with CUDA, else gloo) is decided by :func:`resolve_backend` alone, once, at startup
(:meth:`CommConfig.resolved`); everything after it takes the concrete name.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from fsdata.common.registry import Registry
from fstrain.distributed.comm.base import CommBackend
from fstrain.distributed.comm.cuda_ce import CopyEngineBackend
from fstrain.distributed.comm.gloo import TorchDistBackend
from fstrain.distributed.comm.process_group import register_cuda_ce_backend, register_shm_backend
from fstrain.distributed.comm.shm import ShmBackend
from fstrain.errors import ConfigError

#: The choice decided where the job runs (:func:`resolve_backend`).
AUTO = "auto"


class Transport:
    """A ``--backend`` name (registered in :data:`COMM_BACKENDS`): where it runs, what it builds."""

    name: str = ""
    #: device type its tensors live on: ``"cpu"`` or ``"cuda"``.
    device: str = "cpu"

    @classmethod
    def process_group_backend(cls, config: CommConfig) -> str:
        """Register the torch.distributed backend this transport needs; return the name for
        ``dist.init_process_group`` / ``dist.new_group`` (default: its own name)."""
        return cls.name

    @classmethod
    def build(cls, config: CommConfig, *, store: dist.Store | None, rank: int, world_size: int,
              group: dist.ProcessGroup | None) -> CommBackend:
        """The :class:`CommBackend` of this transport (a collective over ``group``)."""
        raise NotImplementedError


COMM_BACKENDS: Registry[Transport] = Registry("comm backend", "--backend")


@COMM_BACKENDS.register("gloo")
class Gloo(Transport):
    """torch's gloo, every collective (CPU reference)."""

    device = "cpu"

    @classmethod
    def build(cls, config, *, store, rank, world_size, group):
        return TorchDistBackend(group, name=cls.name)


@COMM_BACKENDS.register("nccl")
class Nccl(Gloo):
    """torch's NCCL (SM kernels), every collective (GPU, any topology)."""

    device = "cuda"


# Per group name, how many shm transports were built on it: identical on every member, so the
# store prefix is unique per transport and agreed without communication.
_shm_instances: dict[str, itertools.count] = {}


@COMM_BACKENDS.register("shm")
class Shm(Transport):
    """The all-to-all on shared memory inside a node (``fs_shm``: every other collective on gloo)."""

    device = "cpu"

    @classmethod
    def process_group_backend(cls, config):
        return register_shm_backend(config.shm)

    @classmethod
    def build(cls, config, *, store, rank, world_size, group):
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        group_name = (group or dist.group.WORLD).group_name if dist.is_initialized() else "-"
        counter = _shm_instances.setdefault(group_name, itertools.count())
        prefix = f"fs_comm_shm/{group_name}/{next(counter)}"
        return ShmBackend(store, prefix=prefix, rank=rank, world_size=world_size, config=config.shm)


@COMM_BACKENDS.register("cuda-ce")
class CudaCe(Transport):
    """The all-to-all on copy engines between the GPUs of a node (``fs_cuda_ce``: the rest on NCCL)."""

    device = "cuda"

    @classmethod
    def process_group_backend(cls, config):
        return register_cuda_ce_backend(config.cuda_ce)

    @classmethod
    def build(cls, config, *, store, rank, world_size, group):
        return CopyEngineBackend(group, config=config.cuda_ce)


#: Every transport name, in registration order.
BACKEND_NAMES: tuple[str, ...] = COMM_BACKENDS.names()
#: backend name -> device type it runs on.
BACKEND_DEVICES: dict[str, str] = {n: COMM_BACKENDS.get(n).device for n in BACKEND_NAMES}
#: What ``--backend`` accepts: ``auto`` first, then every name.
BACKEND_CHOICES: tuple[str, ...] = (AUTO, *BACKEND_NAMES)


def resolve_backend(name: str, *, cuda: bool | None = None) -> str:
    """The transport ``name`` runs: ``auto`` decided (``nccl`` when CUDA is available, else
    ``gloo``), any other name as it is. The one place ``auto`` is resolved and a backend's device
    checked: :meth:`CommConfig.resolved` calls it once, at startup (:func:`fstrain.train.train`,
    :func:`fstrain.distributed.env.init_distributed`), and later code takes the concrete name.

    Args:
        name: a name of :data:`BACKEND_CHOICES`.
        cuda: whether CUDA is available (None: asks torch).

    Raises:
        ConfigError: a CUDA backend (``nccl``, ``cuda-ce``) where no CUDA device is visible, or an
            unknown name.
    """
    if cuda is None:
        import torch  # noqa: PLC0415

        cuda = torch.cuda.is_available()
    if name == AUTO:
        return "nccl" if cuda else "gloo"
    if COMM_BACKENDS.get(name).device == "cuda" and not cuda:
        raise ConfigError(f"--backend {name} needs a CUDA device and none is visible; use --backend gloo or shm")
    return name


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
        if self.backend != AUTO and self.backend not in COMM_BACKENDS:
            raise ValueError(
                f"unknown comm backend {self.backend!r}; choose one of {', '.join(BACKEND_CHOICES)}"
            )

    def resolved(self) -> CommConfig:
        """This config with ``backend`` concrete (:func:`resolve_backend`); called once, at startup.

        Raises:
            ConfigError: ``"nccl"`` / ``"cuda-ce"`` where no CUDA device is visible.
        """
        return replace(self, backend=resolve_backend(self.backend))

    @property
    def transport(self) -> type[Transport]:
        """The registered :class:`Transport` of ``backend`` (which must be resolved already).

        Raises:
            ValueError: ``backend`` is still ``"auto"``.
        """
        if self.backend == AUTO:
            raise ValueError("CommConfig(backend='auto') is decided once, at startup: pass config.resolved()")
        return COMM_BACKENDS.get(self.backend)


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
    return config.transport.process_group_backend(config)


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
    transport = config.transport
    rank = dist.get_rank(group) if rank is None else rank
    world_size = dist.get_world_size(group) if world_size is None else world_size
    return transport.build(config, store=store, rank=rank, world_size=world_size, group=group)


__all__ = ["AUTO", "BACKEND_CHOICES", "BACKEND_DEVICES", "BACKEND_NAMES", "COMM_BACKENDS", "CommConfig", "Transport",
           "build_backend", "register_torch_backends", "resolve_backend"]
