"""Keep a long CPU training run's resident memory bounded under glibc's allocator, without paying for
it in page faults.

A training step allocates and frees many tensors of a few MiB whose sizes change with every jagged
batch. glibc serves a block of at least its mmap threshold with ``mmap`` and returns it with
``munmap`` when freed; below the threshold it comes from the heap (``mallopt(3)``). Two ways to
lose, both measured on ml-1m SASRec (``--simulate-ranks``, 1 thread; docs/fstrain.md, "Memory"):

* glibc's dynamic threshold (the default) rises to 32 MiB after large frees, so the step's tensors
  move onto a heap that fragments and is never given back: at R=8 B=32, resident memory grew from
  1.4 to 3.5 GB over 250 steps and reached 15 GB by epoch 50, where the OOM killer ended the run.
* A small fixed threshold (64 KiB, fstrain 0.2) keeps memory flat, but every block of the step is
  then a fresh ``mmap``: the kernel faults in and zeroes its pages and unmaps them again, each step.
  At R=16 B=8, 300 steps took 171 s with 94 s of system time, against 77 s (2 s) on the heap.

:func:`configure_heap` serves the step's tensors from the heap (a fixed 32 MiB mmap threshold, which
turns the dynamic adjustment off, and a 512 MiB trim threshold), and :class:`HeapTrimmer` calls
``malloc_trim(0)`` every :data:`TRIM_EVERY_STEPS` steps, which hands the heap's free pages back to
the system (``madvise``) however fragmented it is, so the heap's growth between two trims is all
that stays resident. R=8 B=32, 300 steps: 1.1-2.7 GB resident, 172 s with 21 s of system time,
against 1.2 GB and 362 s with 202 s of system time at the 64 KiB threshold (same numbers: the
allocator does not change the arithmetic). A
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` you set at process start wins (nothing is
changed then), as does a C library without ``mallopt`` (musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: ``M_TRIM_THRESHOLD`` and ``M_MMAP_THRESHOLD`` of glibc's ``<malloc.h>``.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Bytes from which a block is served by ``mmap`` (glibc's largest dynamic threshold on 64-bit).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free bytes at the heap's top above which ``free`` gives them back at once.
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024
#: Steps between two ``malloc_trim(0)`` calls of :class:`HeapTrimmer`.
TRIM_EVERY_STEPS = 10
#: Environment variables by which a user sets glibc's thresholds at process start.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_configured = False  # configure_heap took effect in this process


def _libc():
    """glibc's ``mallopt`` and ``malloc_trim`` (ctypes), or None off Linux or without them."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return mallopt, malloc_trim


def configure_heap(mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (module docstring).

    Args:
        mmap_threshold: bytes, > 0: blocks this large or larger are served by ``mmap``.
        trim_threshold: bytes, > 0: free bytes at the heap's top above which ``free`` returns them.

    Returns:
        True when both were set; False (nothing changed) when the user set either variable of
        :data:`USER_SETTINGS`, off Linux, or without glibc's ``mallopt``.
    """
    if any(v in os.environ for v in USER_SETTINGS):
        return False
    fns = _libc()
    if fns is None:
        return False
    global _configured
    mallopt, _ = fns
    _configured = (mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
                   and mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1)
    return _configured


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` every ``every_steps`` steps (:meth:`step`), when
    :func:`configure_heap` took effect in this process (``fstrain train`` calls it at start);
    otherwise does nothing.

    Args:
        every_steps: steps between two trims, >= 1.
        active: whether to trim; None: whether :func:`configure_heap` took effect.
    """

    def __init__(self, every_steps: int = TRIM_EVERY_STEPS, active: bool | None = None):
        fns = _libc() if (_configured if active is None else active) else None
        self._trim = fns[1] if fns else None
        self.every_steps = max(1, int(every_steps))
        self.trims = 0

    def step(self, step: int) -> None:
        """After training step ``step`` (1-based count of steps done): trim when it is a multiple of ``every_steps``."""
        if self._trim is not None and step % self.every_steps == 0:
            self._trim(0)
            self.trims += 1
