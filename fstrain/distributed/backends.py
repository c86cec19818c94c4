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
    ``gloo``), any other name as it is. The one place ``auto`` is resolved.

    Args:
        name: a name of :data:`BACKEND_CHOICES` (checked by the caller's settings).
        cuda: whether CUDA is available (None: asks torch, imported only then).
    """
    if name != AUTO:
        return name
    if cuda is None:
        import torch  # noqa: PLC0415 (this module is imported at parse time)

        cuda = torch.cuda.is_available()
    return "nccl" if cuda else "gloo"


__all__ = ["AUTO", "BACKEND_CHOICES", "BACKEND_DEVICES", "BACKEND_NAMES", "resolve_backend"]
