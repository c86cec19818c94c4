"""Timing of the compute inside a training step, the same way for every pipeline.

:class:`ComputeTimer` hooks the dense tower (forward, backward) and, optionally, times a barrier
after the dense backward (the wait for the slowest rank); :class:`TimedOptimizer` adds the
optimizer step. :mod:`fstrain.pipelines` subtracts both from the step's wall time to get the
exposed communication.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function


class ComputeTimer:
    """Times dense forward, dense backward and optimizer steps with hooks (host wall clock).

    Forward: module pre/post hooks; backward: full backward pre/post hooks (from the gradient
    of the loss to the gradients of the embedding inputs). CPU: host wall clock. CUDA: timing
    events recorded on the current stream at each boundary, read in :meth:`take` (no host
    synchronisation inside the step; not yet run on a GPU).

    With ``straggler_group``, the end of the dense backward also enters a one-element
    all-reduce on that (dedicated) process group and times it apart: the wait for the slowest
    rank's compute (the bubble, as :func:`fstrain.pipelines.loop.measured_step` measures it), so that it
    is not counted as communication. A dedicated group keeps its order independent of the
    collectives DDP and torchrec issue from inside the backward.

    Args:
        dense: the data-parallel tower (``dmp.module.dense``).
        device: where the tower runs.
        straggler_group: process group for the straggler barrier (``None``: no barrier).
    """

    def __init__(self, dense: nn.Module, device: torch.device, straggler_group=None) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._group = straggler_group
        #: called before the straggler all-reduce is issued (the prioritized pipeline's ordering gate)
        self.before_collective = None
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self._t0 = 0.0
        self._events: list[tuple[str, object, object]] = []  # CUDA: (kind, start, end) per interval
        self._handles = [dense.register_forward_pre_hook(self._start), dense.register_forward_hook(self._stop),
                         dense.register_full_backward_pre_hook(self._start),
                         dense.register_full_backward_hook(self._stop_backward)]

    def _stop_backward(self, *_args) -> None:
        self._stop()
        if self._group is not None:
            if self.before_collective is not None:  # before _start: not counted as waiting for stragglers
                self.before_collective()
            self._start()
            with record_function("## wait_for_stragglers ##"):
                dist.all_reduce(torch.zeros(1, device=self._device), group=self._group)
            self._end("wait")

    def _start(self, *_args) -> None:
        if self._cuda:  # an event on the current stream: no host synchronisation, streams keep overlapping
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def _stop(self, *_args) -> None:
        """Hook signature: end a compute interval."""
        self._end("compute")

    def _end(self, kind: str) -> None:
        """End the open interval as ``compute`` or ``wait``."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((kind, self._t0, end))
            return
        dt = time.perf_counter() - self._t0
        if kind == "wait":
            self.wait_seconds += dt
        else:
            self.seconds += dt

    def detach(self) -> tuple[float, float, list]:
        """Hand over everything accumulated since the last call without waiting for the device:
        ``(compute seconds, wait seconds, CUDA intervals)``; resets. Read it with :meth:`resolve`."""
        out = (self.seconds, self.wait_seconds, self._events)
        self.seconds = self.wait_seconds = 0.0
        self._events = []
        return out

    @staticmethod
    def resolve(pending: tuple[float, float, list]) -> tuple[float, float]:
        """``(compute, straggler wait)`` seconds of a :meth:`detach` result (CUDA: waits for its last event)."""
        compute, wait, events = pending
        for kind, start, end in events:
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
            if kind == "wait":
                wait += dt
            else:
                compute += dt
        return compute, wait

    def take(self) -> tuple[float, float]:
        """``(compute, straggler wait)`` seconds accumulated since the last call; resets both.

        On CUDA the intervals are read from their events (this waits for the last one).
        """
        return self.resolve(self.detach())

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()


class TimedOptimizer(torch.optim.Optimizer):
    """Delegates to an optimizer and adds the wall time of ``step`` to a :class:`ComputeTimer`.

    torchrec's pipelines call ``optimizer.zero_grad()`` and ``optimizer.step()`` themselves; this
    proxy lets them time the step like the pipelines we drive.
    """

    def __init__(self, optimizer, timer: ComputeTimer) -> None:  # noqa: D107 - no Optimizer.__init__
        self._inner = optimizer
        self._timer = timer

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def param_groups(self):  # Optimizer defines it as an attribute; forward it explicitly
        return self._inner.param_groups

    def step(self, closure=None):
        self._timer._start()
        out = self._inner.step(closure) if closure is not None else self._inner.step()
        self._timer._stop()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none)

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._inner.load_state_dict(state_dict)


__all__ = ["ComputeTimer", "TimedOptimizer"]
