"""Per-step training metrics: the loss next to the step timings, and TensorBoard event files.

:class:`StepLog` collects this rank's per-step loss (a device scalar) and timing. Once per log
window (``--log-every-steps``) and at the end it turns the window's losses into floats with one
device-to-host copy (no synchronisation inside a step) and stores each rank's mean per-sample
loss in its :class:`fstrain.components.metrics.StepTiming` (``loss``), so ``step_times.parquet`` carries it.

With a TensorBoard folder, the window's records of every rank are gathered on rank 0
(``all_gather_object``, one collective per window, only when TensorBoard is on) and written with
``torch.utils.tensorboard.SummaryWriter``. Tags (``x`` = the step):

* ``train/loss``: the step's global mean per-sample loss (``sum_r loss_sum_r / sum_r n_r``);
* ``train/samples_per_second``, ``train/tokens_per_second``: over each log window;
* ``step/compute_seconds_max`` / ``_mean``, ``step/straggler_wait_seconds_max`` / ``_mean``,
  ``step/exposed_comm_seconds_max`` / ``_mean``, ``step/measured_bubble`` (``1 - mean / max`` of
  the per-rank compute), when the loop times its steps;
* ``rank_compute_seconds/rank_XXXXX``, ``rank_straggler_wait_seconds/rank_XXXXX``,
  ``rank_exposed_comm_seconds/rank_XXXXX``: one curve per rank (world size up to
  :data:`MAX_PER_RANK_CURVES`), and histograms over ranks ``compute_seconds_over_ranks`` etc. at any
  world size;
* ``eval/<name>``: evaluation metrics passed to :meth:`StepLog.log_eval`.
* ``eval_best/<name>``: the best evaluation of the run (highest NDCG@10), at its step (:meth:`StepLog.log_best`).

On a run resumed on a resharded output every ``x`` is the global step (``step_offset`` + the
shards' step), so the curves continue the old run's; ``step_times.parquet`` keeps the shards' step.

Exposed communication is ``sparse_forward_seconds + sync_seconds`` (see :mod:`fstrain.components.metrics`;
the pipelines report it in ``sync_seconds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from fstrain.errors import ConfigError
from fstrain.components.metrics import StepTiming

#: Per-rank curves are written up to this world size (histograms over ranks always).
MAX_PER_RANK_CURVES = 64
#: Pending device losses are copied to the host at least every this many steps (bounds memory
#: when log windows are long or off).
MAX_PENDING_STEPS = 1024


@dataclass(slots=True)
class _Pending:
    step: int
    loss_sum: torch.Tensor
    num_samples: int
    timing: StepTiming | None


class StepLog:
    """Per-step loss and timings of one rank; TensorBoard on rank 0 (see the module docstring).

    Every rank must call :meth:`window` at the same steps and :meth:`finish` once (they hold a
    collective when TensorBoard is on).

    Args:
        rank: this rank.
        world_size: R.
        tensorboard_dir: folder for the event files (rank 0 writes; ``None``: no TensorBoard).
        step_offset: added to every step written to TensorBoard: the global step of the shards'
            step 0 on a run resumed on a resharded output (its curves continue the old run's), else 0.

    Raises:
        ConfigError: ``tensorboard_dir`` given but the ``tensorboard`` package is not installed.
    """

    def __init__(self, rank: int, world_size: int, tensorboard_dir: str | None = None, step_offset: int = 0) -> None:
        self.rank, self.world_size, self.step_offset = rank, world_size, int(step_offset)
        self._tb = tensorboard_dir is not None
        self._pending: list[_Pending] = []
        self._rows: list[tuple] = []  # materialized, not yet written to TensorBoard
        self._writer = None
        if self._tb:  # every rank checks, so a missing package fails all ranks alike (no hang)
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (needs the tensorboard package)
            except ImportError:
                raise ConfigError("--tensorboard-dir needs the tensorboard package: pip install tensorboard==2.21.0 "
                                  "(pinned in pyproject.toml), or drop --tensorboard-dir") from None
            if rank == 0:
                self._writer = SummaryWriter(log_dir=tensorboard_dir)

    def add(self, step: int, loss_sum: torch.Tensor, num_samples: int, timing: StepTiming | None) -> None:
        """Record one trained step (``loss_sum``: this rank's summed per-sample loss, any device)."""
        self._pending.append(_Pending(step, loss_sum.detach().reshape(()), int(num_samples), timing))
        if len(self._pending) >= MAX_PENDING_STEPS:
            self._rows += self._take()

    def _take(self) -> list[tuple]:
        """Materialize the pending losses (one host copy); ``(step, rank, loss_sum, n, c, w, x)`` rows."""
        if not self._pending:
            return []
        sums = torch.stack([p.loss_sum.to(torch.float64) for p in self._pending]).cpu().tolist()
        rows = []
        for p, s in zip(self._pending, sums):
            t = p.timing
            if t is not None:
                t.loss = s / p.num_samples if p.num_samples else math.nan
            rows.append((p.step, self.rank, s, p.num_samples,
                         *((t.compute_seconds, t.wait_seconds, t.sparse_forward_seconds + t.sync_seconds)
                           if t is not None else (math.nan,) * 3)))
        self._pending = []
        return rows

    def _gather_and_write(self, rows: list[tuple]) -> None:
        rows, self._rows = self._rows + rows, []
        if not self._tb:
            return
        parts: list = [None] * self.world_size
        if dist.is_initialized() and self.world_size > 1:
            dist.all_gather_object(parts, rows)
        else:
            parts = [rows]
        if self._writer is None:
            return
        allrows = np.array([r for part in parts for r in part], dtype=np.float64).reshape(-1, 7)
        if not len(allrows):
            return
        w, R = self._writer, self.world_size
        for shards_step in np.unique(allrows[:, 0]).astype(int):
            g = allrows[allrows[:, 0] == shards_step]
            step = int(shards_step) + self.step_offset
            n = g[:, 3].sum()
            if n > 0:
                w.add_scalar("train/loss", g[:, 2].sum() / n, step)
            if np.isnan(g[:, 4]).any() or len(g) != R:
                continue
            order = np.argsort(g[:, 1])
            for col, name in ((4, "compute_seconds"), (5, "straggler_wait_seconds"), (6, "exposed_comm_seconds")):
                v = g[order, col]
                w.add_scalar(f"step/{name}_max", v.max(), step)
                w.add_scalar(f"step/{name}_mean", v.mean(), step)
                w.add_histogram(f"{name}_over_ranks", v, step)
                if R <= MAX_PER_RANK_CURVES:
                    for r, x in enumerate(v):
                        w.add_scalar(f"rank_{name}/rank_{r:05d}", x, step)
            c = g[order, 4]
            w.add_scalar("step/measured_bubble", 1.0 - c.mean() / c.max() if c.max() > 0 else 0.0, step)

    def window(self, step: int, *, samples_per_second: float, tokens_per_second: float) -> None:
        """End of a log window at ``step`` (steps done): losses to floats, TensorBoard write."""
        self._gather_and_write(self._take())
        if self._writer is not None:
            self._writer.add_scalar("train/samples_per_second", samples_per_second, step + self.step_offset)
            self._writer.add_scalar("train/tokens_per_second", tokens_per_second, step + self.step_offset)
            self._writer.flush()

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Hook for evaluation: write ``eval/<name>`` scalars (rank 0; other ranks: no-op).

        Args:
            step: steps trained when the evaluation ran.
            metrics: e.g. ``{"hr@10": 0.31, "ndcg@10": 0.17}``; non-numeric values are skipped.
        """
        if self._writer is None:
            return
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in ("step", "global_step"):
                self._writer.add_scalar(f"eval/{name}", float(value), step + self.step_offset)
        self._writer.flush()

    def log_best(self, record: dict) -> None:
        """Write the best evaluation (``record`` from :meth:`fstrain.components.evaluator.Evaluator.best`) as
        ``eval_best/<name>`` scalars at its step, ``eval_best/epoch`` included (rank 0)."""
        if self._writer is None or not record:
            return
        for name, value in record.items():
            if name not in ("step", "global_step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"eval_best/{name}", float(value), int(record["step"]) + self.step_offset)
        self._writer.flush()

    def finish(self) -> None:
        """Materialize the remaining steps, write them, close the writer (every rank calls it)."""
        self._gather_and_write(self._take())
        if self._writer is not None:
            self._writer.close()
            self._writer = None
