"""The one table of process-group backend names (``fstrain train --backend``,
:class:`fstrain.distributed.comm.CommConfig`).

Imported by the CLI at parse time, so it imports nothing heavy.

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
"""

from __future__ import annotations

#: backend name -> device type it runs on.
BACKEND_DEVICES: dict[str, str] = {"gloo": "cpu", "nccl": "cuda", "shm": "cpu", "cuda-ce": "cuda"}

#: every transport name (the keys of :data:`BACKEND_DEVICES`).
BACKEND_NAMES: tuple[str, ...] = tuple(BACKEND_DEVICES)

#: what ``fstrain train --backend`` accepts: ``auto`` (nccl with CUDA, else gloo) and every name.
BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKEND_NAMES)  # AUTO first

#: The choice decided where the job runs (:func:`resolve_backend`).
AUTO = "auto"


def resolve_backend(name: str, *, cuda: bool | None = None) -> str:
    """The transport ``name`` runs: ``auto`` decided (``nccl`` when CUDA is available, else
    ``gloo``), any other name as it is. The one place ``auto`` is resolved and a backend's device
    checked: :meth:`fstrain.distributed.comm.CommConfig.resolved` calls it once, at startup
    (:func:`fstrain.train.train`, :func:`fstrain.distributed.env.init_distributed`), and later code
    takes the concrete name.

    Args:
        name: a name of :data:`BACKEND_CHOICES` (checked by the caller's settings).
        cuda: whether CUDA is available (None: asks torch, imported only then).

    Raises:
        ConfigError: a CUDA backend (``nccl``, ``cuda-ce``) where no CUDA device is visible.
    """
    if cuda is None:
        import torch  # noqa: PLC0415 (this module is imported at parse time)

        cuda = torch.cuda.is_available()
    if name == AUTO:
        return "nccl" if cuda else "gloo"
    if BACKEND_DEVICES.get(name) == "cuda" and not cuda:
        from fstrain.errors import ConfigError  # noqa: PLC0415

        raise ConfigError(f"--backend {name} needs a CUDA device and none is visible; use --backend gloo or shm")
    return name


__all__ = ["AUTO", "BACKEND_CHOICES", "BACKEND_DEVICES", "BACKEND_NAMES", "resolve_backend"]
