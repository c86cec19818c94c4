"""Keep a long CPU training run's resident memory flat under glibc's allocator.

glibc raises its mmap threshold each time a large block served by ``mmap`` is freed (the
"dynamic mmap threshold", up to 32 MiB on 64-bit; ``mallopt(3)``). A training step allocates and
frees many tensors of a few MiB whose sizes change with every jagged batch; once the threshold has
risen, they come from the heap, which fragments and is not given back. Measured on ml-1m SASRec
(R=8 B=32 global batches, ``--simulate-ranks``, 1 thread): resident memory grew from 1.4 to 3.5 GB
over 250 steps and reached 15 GB by epoch 50, where the kernel's OOM killer ended the run; with a
fixed 64 KiB threshold it stayed at 0.9-1.3 GB over the same 250 steps, in the same time
(docs/fstrain.md, "Memory").

:func:`fix_mmap_threshold` sets that fixed threshold (``mallopt(M_MMAP_THRESHOLD, 65536)``, which
also turns the dynamic adjustment off), as ``MALLOC_MMAP_THRESHOLD_=65536`` would at process start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: ``M_MMAP_THRESHOLD`` of glibc's ``<malloc.h>``.
M_MMAP_THRESHOLD = -3
#: Bytes from which a block is served by ``mmap`` (and returned to the system when freed).
MMAP_THRESHOLD_BYTES = 64 * 1024


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (module docstring).

    Does nothing when ``MALLOC_MMAP_THRESHOLD_`` is set (the user chose), off Linux, or on a C
    library without ``mallopt`` (musl).

    Args:
        threshold: bytes, > 0.

    Returns:
        True when the threshold was set.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
