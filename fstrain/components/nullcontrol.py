"""The null control of ``fstrain train``: the bubble that timing noise alone reads on this machine.

A few *control steps* are spread over the run (after evenly spaced training steps). In each, every
rank times the dense forward + backward of the **same** batch (rank 0's batch of a typical step of
the run: the one whose predicted cost is nearest the run's mean per-rank cost, so the control's
work is the size of a training step's; read from its shard file) exactly as a training step's
``compute_seconds`` is timed
(device-synchronised wall clock). ``R`` identical pieces of work timed on ``R`` ranks at the same
moment: any "bubble" between them (:func:`fsdata.balancer.bubble.run_bubble` of the
``[K x R]`` control timings) is noise, the floor under the measured bubble (the same idea as
``fstrain replay``'s null control).

A control step changes nothing the training steps see: it reads no batch from the training
reader (its batch comes from a separate read of the shard file), uses fixed embeddings drawn from
its own generator (no table lookup, no collective), computes gradients with
:func:`torch.autograd.grad` (nothing accumulated into ``.grad``, no optimizer step) under
:func:`torch.random.fork_rng` (the global random state is restored), and bypasses the module
hooks that time training steps. Training with or without control steps gives the same losses
and parameters (tested).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from fstrain.components.metrics import StepTiming
from fstrain.data.batch import HISTORY_KEY
from fstrain.models.config import NEGATIVE_KEY


def control_schedule(total_steps: int, num_controls: int) -> dict[int, int]:
    """When the control steps run: ``{training item index (0-based): controls after it}``.

    Args:
        total_steps: training steps this run will take (``>= 0``).
        num_controls: control steps wanted (``<= 0``: none).

    Returns:
        Controls placed after evenly spaced items, the first after item 1 where the run has two or
        more steps (item 0 warms up); several after one item when ``num_controls > total_steps``;
        empty when either count is 0.
    """
    if total_steps <= 0 or num_controls <= 0:
        return {}
    first = 1 if total_steps > 1 else 0
    span = total_steps - first
    out: dict[int, int] = {}
    for k in range(num_controls):
        j = first + (k * span) // num_controls
        out[j] = out.get(j, 0) + 1
    return out


class NullControl:
    """Runs this rank's control steps (see the module docstring) and keeps their timings.

    Args:
        shards: the training OUTPUT (rank 0's batch of a typical step is read from it once, lazily).
        start_step: the run's first step.
        total_steps: training steps of the run (for :func:`control_schedule`).
        num_controls: control steps (0: none).
        dense: the data-parallel tower (``dmp.module.dense``; called through ``forward`` so the
            training step's timing hooks do not fire).
        model_config: the model's :class:`fstrain.models.config.Config` (negatives).
        seed: the run seed (the control batch's negatives, as training draws them).
        rank: this rank.
        device: where the tower runs.

    Attributes:
        records: one :class:`StepTiming` per control step: ``step`` is the control's index ``k``,
            ``compute_seconds`` the timed forward + backward; the other times are 0.
        after_steps: ``Batch.step`` of the training step each control followed.
        control_step: the step whose rank-0 batch the controls time (set at the first control).
        seconds: wall time spent in control steps (left out of throughput).
    """

    def __init__(self, shards: str, *, start_step: int, total_steps: int, num_controls: int, dense: nn.Module,
                 model_config, seed: int, rank: int, device: torch.device) -> None:
        self._shards, self._start = shards, start_step
        self._schedule = control_schedule(total_steps, num_controls)
        self._total = total_steps
        self.control_step = start_step
        self._dense, self._mcfg, self._seed = dense, model_config, seed
        self._rank, self._device = rank, device
        self._inputs = None
        self.records: list[StepTiming] = []
        self.after_steps: list[int] = []
        self.seconds = 0.0

    def _typical_step(self) -> int:
        """The run's step whose rank-0 batch has the predicted cost nearest the mean per-rank cost
        of the run's steps (step stats; the same on every rank), so the control's work is a typical
        step's; the first step where the stats cannot be read."""
        import numpy as np  # noqa: PLC0415

        from fstrain.data.manifest import load_manifest  # noqa: PLC0415

        try:
            t = load_manifest(self._shards).read_step_stats(
                columns=["step", "rank", "predicted_cost"],
                filters=[("step", ">=", self._start), ("step", "<", self._start + self._total)])
        except Exception:  # noqa: BLE001 - the control falls back to the first step; training goes on
            return self._start
        step, rank, cost = (t.column(c).to_numpy() for c in ("step", "rank", "predicted_cost"))
        if not len(step) or not (rank == 0).any():
            return self._start
        own = rank == 0
        return int(step[own][np.argmin(np.abs(cost[own] - cost.mean()))])

    def _prepare(self):
        from fstrain.data.reader import ShardReader  # noqa: PLC0415
        from fstrain.models.negatives import attach_negatives  # noqa: PLC0415

        self.control_step = self._typical_step()
        reader = ShardReader(self._shards, 0, None, start_step=self.control_step, max_steps=1, num_prefetch_batches=0)
        batch = attach_negatives(next(iter(reader)), self._mcfg, self._seed).to(self._device)
        f = batch.features
        g = torch.Generator().manual_seed(self._seed * 1_000_003 + 7)  # own generator: no global draw
        d = self._mcfg.embedding_dim
        shapes = (f[HISTORY_KEY].values().numel(), batch.target_ids.numel(), f[NEGATIVE_KEY].values().numel())
        leaves = [(torch.randn(n, d, generator=g) * 0.1).to(self._device).requires_grad_() for n in shapes]
        self._inputs = batch, leaves

    def after(self, index: int, step: int) -> None:
        """Run the control steps scheduled after training item ``index`` (whose ``Batch.step`` is ``step``)."""
        count = self._schedule.get(index, 0)
        if not count:
            return
        t0 = time.perf_counter()
        if self._inputs is None:
            self._prepare()
        for _ in range(count):
            self.records.append(StepTiming(step=len(self.records), rank=self._rank, num_samples=0, num_tokens=0,
                                           sparse_forward_seconds=0.0, compute_seconds=self._time_once(),
                                           wait_seconds=0.0, sync_seconds=0.0))
            self.after_steps.append(int(step))
        self.seconds += time.perf_counter() - t0

    def _time_once(self) -> float:
        from fstrain.models.recommender import objective_inputs  # noqa: PLC0415

        batch, leaves = self._inputs
        f = batch.features
        params = [p for p in self._dense.parameters() if p.requires_grad]
        cuda = self._device.type == "cuda"
        with torch.random.fork_rng(devices=[self._device] if cuda else []):
            if cuda:
                torch.cuda.synchronize(self._device)
            t0 = time.perf_counter()
            loss, _ = self._dense.forward(leaves[0], f[HISTORY_KEY].lengths(), leaves[1], leaves[2],
                                          batch.target_ids, f[NEGATIVE_KEY].values(), batch.global_num_samples,
                                          **objective_inputs(batch))
            torch.autograd.grad(loss, params + leaves, allow_unused=True)
            if cuda:
                torch.cuda.synchronize(self._device)
            return time.perf_counter() - t0


__all__ = ["NullControl", "control_schedule"]
