"""One issue order for the collectives of two threads on two communicators, the same on every rank.

The prioritized pipeline drives the default process group from the main thread and a second
group (``dist.new_group``) from a background thread. On NCCL that is unsafe unless every rank
issues the operations of the two communicators in the same order: NCCL User Guide, "Creating a
Communicator" -> "Using multiple NCCL communicators concurrently"
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/communicators.html#using-multiple-nccl-communicators-concurrently):
operations on different communicators should be used at different epochs with a locking
mechanism, and applications should ensure that operations are submitted in the same order
across ranks; otherwise the kernels of two communicators can wait on each other across GPUs and
deadlock. The "Thread Safety" page of the same guide
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/threadsafety.html) adds that
issuing NCCL operations in parallel to independent communicators on the same device from several
threads is not safe.

:class:`CollectiveOrderGate` fixes the order. A background job (a function run on the
pipeline's one-worker pool) issues all of its collectives between its submission and the main
thread's next collective: the main thread, before issuing any collective, waits until every job
submitted so far has returned. Jobs run one at a time in submission order, so the issue sequence
on each rank is the main thread's program order with each job's collectives inserted, as one
block, where it was submitted, and that program order is the same on every rank. What the main
thread gives up is starting its next collective while a job is still issuing; compute (the dense
forward and backward) still overlaps the job. gloo and the shm transport serve each group on its
own connections / segments, so the gate is off for them unless asked (the pipeline's results do
not depend on it: the same collectives move the same rows either way).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

__all__ = ["ORDERED_BACKENDS", "CollectiveOrderGate", "needs_ordered_collectives"]

#: torch.distributed backend names whose communicators need one issue order across threads.
ORDERED_BACKENDS = ("nccl", "fs_cuda_ce")


def needs_ordered_collectives(backend: str) -> bool:
    """Whether the process-group backend ``backend`` (``dist.get_backend()``) needs the gate."""
    return str(backend).lower() in ORDERED_BACKENDS


class CollectiveOrderGate:
    """Orders collective issue between the main thread and one background worker (module doc).

    Args:
        enabled: ``False``: :meth:`submit` just submits and :meth:`before_collective` returns at once.

    Use from the main thread only: :meth:`submit` for every background job that issues
    collectives, :meth:`before_collective` right before every collective the main thread issues
    (on any group), and once at the end of a step so that collectives issued between steps
    (logging, checkpoints) also come after the step's jobs.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._jobs: list[concurrent.futures.Future] = []
        #: times the main thread had to wait for a job still issuing (diagnostics).
        self.num_waits = 0

    def submit(self, pool: concurrent.futures.Executor, fn: Callable, *args) -> concurrent.futures.Future:
        """``pool.submit(fn, *args)``, remembered until :meth:`before_collective` has waited for it."""
        future = pool.submit(fn, *args)
        if self.enabled:
            self._jobs.append(future)
        return future

    def before_collective(self) -> None:
        """Main thread, right before it issues a collective: wait until every submitted job has
        returned (it has issued all its collectives). A job's error stays in its future."""
        if not self.enabled or not self._jobs:
            return
        if not all(f.done() for f in self._jobs):
            self.num_waits += 1
            concurrent.futures.wait(self._jobs)
        self._jobs.clear()
