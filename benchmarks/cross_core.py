"""The floor of a two-rank exchange between two cores, without Python in the loop (numba, two threads).

Two threads pinned to two CPUs exchange B bytes each way per iteration through 4-slot rings, as the
shared-memory all-to-all does (copy in, release-store the counter, wait for the peer's, copy out,
acknowledge), with the same compiled primitives (:mod:`fstrain.distributed.comm.shm_fast`). The time per
iteration is what copying the peer's bytes across the two cores and signalling cost on this machine at
this moment; ``bench_alltoall --steady`` measures it in the same run as the shm calls (2 ranks, messages up
to 64 KB per rank), because on a VM it moves with the hypervisor's placement of the vCPUs
(``benchmarks/cross_core.c`` is the same in C).

    python -m benchmarks.cross_core 512 8192 32768
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
from numba import njit

from fstrain.distributed.comm.shm_fast import _load_acquire, _memcpy, _store_release

SLOTS = 4
_WARMUP = 200


@njit(cache=True, nogil=True)
def _exchange(me, rings, counters, src, dst, nbytes, iters):  # pragma: no cover - compiled
    """Thread ``me`` (0 or 1): ``iters`` exchanges of ``nbytes`` with the other thread. ``rings``: ``[2]``
    addresses of each thread's outgoing ring; ``counters``: ``[2 x 16]`` int64 (write_seq at [t, 0], the
    reader's read_seq at [t, 8]: separate cache lines)."""
    peer = 1 - me
    base = counters.ctypes.data
    for i in range(iters):
        while i - _load_acquire(base + (me * 16 + 8) * 8) >= SLOTS:  # a free slot in my ring
            pass
        _memcpy(rings[me] + (i % SLOTS) * nbytes, src, nbytes)
        _store_release(base + (me * 16) * 8, i + 1)
        while _load_acquire(base + (peer * 16) * 8) < i + 1:
            pass
        _memcpy(dst, rings[peer] + (i % SLOTS) * nbytes, nbytes)
        _store_release(base + (peer * 16 + 8) * 8, i + 1)


def exchange_floor_us(nbytes: int, iters: int = 2000, cpus: tuple[int, int] | None = None) -> float:
    """Microseconds per exchange of ``nbytes`` each way between two threads pinned to ``cpus`` (default: the
    first two CPUs this process may use), after a warm-up; the slower thread's time.

    Raises:
        ValueError: fewer than two CPUs available, or ``nbytes`` < 1.
    """
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    allowed = sorted(os.sched_getaffinity(0))
    if cpus is None:
        if len(allowed) < 2:
            raise ValueError(f"the two-core exchange needs two CPUs; this process may use {allowed}")
        cpus = (allowed[0], allowed[1])
    bufs = [np.zeros(SLOTS * nbytes, np.uint8) for _ in range(2)]
    rings = np.array([b.ctypes.data for b in bufs], np.int64)
    srcs = [np.full(nbytes, t + 1, np.uint8) for t in range(2)]
    dsts = [np.zeros(nbytes, np.uint8) for _ in range(2)]
    seconds = [0.0, 0.0]
    start = threading.Barrier(2)
    phases = [(_WARMUP, np.zeros((2, 16), np.int64)), (iters, np.zeros((2, 16), np.int64))]

    def run(t: int) -> None:
        os.sched_setaffinity(threading.get_native_id(), {cpus[t]})
        for n, counters in phases:
            start.wait()
            t0 = time.perf_counter()
            _exchange(t, rings, counters, srcs[t].ctypes.data, dsts[t].ctypes.data, nbytes, n)
            seconds[t] = time.perf_counter() - t0  # the last phase's stays

    _exchange(0, rings, np.zeros((2, 16), np.int64), 0, 0, 0, 0)  # compile (or load) before the threads start
    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if not all(np.all(dsts[t] == 2 - t) for t in range(2)):
        raise RuntimeError("the two-core exchange delivered wrong bytes")
    return max(seconds) / iters * 1e6


def main(argv: list[str] | None = None) -> int:
    sizes = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or [512, 2048, 8192, 32768]
    for n in sizes:
        print(f"{n:>8} B each way: {exchange_floor_us(n):8.2f} us per exchange between two cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
