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
BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKEND_NAMES)

__all__ = ["BACKEND_CHOICES", "BACKEND_DEVICES", "BACKEND_NAMES"]
