"""Per-step, per-rank timings and the measured bubble (``fsdata.balancer.bubble.run_bubble``).

A training step is timed in stages (:func:`fstrain.pipelines.loop.measured_step`):

* ``sparse_forward_seconds``: input dist, lookup and output dist of the item table (its
  all-to-alls start when every rank has finished the previous step, so they are nearly even).
* ``compute_seconds``: the dense forward and backward, local to the rank: everything up to the
  first collective that waits on the other ranks. The bubble is measured on this.
* ``wait_seconds``: time in that first collective (a one-element all-reduce used as a barrier):
  the straggler's lead over this rank, i.e. this rank's share of the bubble.
* ``sync_seconds``: sparse backward (gradient all-to-all, fused update), dense all-reduce, step.

Each row also carries ``loss``: this rank's mean per-sample loss in the step (its summed
per-sample loss / its ``num_samples``); the step's global loss is the ``num_samples``-weighted
mean over ranks (:func:`step_losses`). Files written before ``loss`` existed read back with NaN.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.balancer.bubble import reduction, run_bubble, step_bubbles

#: The null control's timings beside ``step_times.parquet`` (same columns; ``step`` = control index).
NULL_TIMES = "null_step_times.parquet"


@dataclass(slots=True)
class StepTiming:
    """Timings of one rank in one step (seconds, wall clock, device-synchronised)."""

    step: int
    rank: int
    num_samples: int
    num_tokens: int
    sparse_forward_seconds: float
    compute_seconds: float
    wait_seconds: float
    sync_seconds: float
    loss: float = float("nan")
    """This rank's mean per-sample loss in the step (NaN when not recorded)."""


def timing_matrix(records: list[StepTiming], field: str = "compute_seconds") -> tuple[np.ndarray, np.ndarray]:
    """Arrange one field as ``[S x R]``.

    Args:
        records: timings of every (step, rank); steps need not start at 0.
        field: a float field of :class:`StepTiming`.

    Returns:
        ``(steps [S] int64, values [S x R] float64)``; only steps seen on every rank are kept.
    """
    if not records:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0))
    steps = np.array(sorted({r.step for r in records}), dtype=np.int64)
    R = max(r.rank for r in records) + 1
    m = np.full((len(steps), R), np.nan)
    pos = {s: i for i, s in enumerate(steps.tolist())}
    for r in records:
        m[pos[r.step], r.rank] = getattr(r, field)
    ok = ~np.isnan(m).any(axis=1)
    return steps[ok], m[ok]


def step_losses(records: list[StepTiming]) -> tuple[np.ndarray, np.ndarray]:
    """Global mean per-sample loss of each step: ``sum_r loss_r * n_r / sum_r n_r``.

    Returns:
        ``(steps [S] int64, loss [S] float64)`` for the steps whose every record has a loss.
    """
    sums: dict[int, list[float]] = {}
    for r in records:
        acc = sums.setdefault(r.step, [0.0, 0.0])
        acc[0] += r.loss * r.num_samples
        acc[1] += r.num_samples
    steps = np.array(sorted(s for s, (x, n) in sums.items() if not np.isnan(x) and n > 0), dtype=np.int64)
    return steps, np.array([sums[s][0] / sums[s][1] for s in steps.tolist()], dtype=np.float64)


def summarize(records: list[StepTiming], predicted_bubble: float | None = None,
              null_records: list[StepTiming] | None = None) -> dict:
    """Measured bubble and totals of a run.

    Args:
        records: every rank's training-step timings.
        predicted_bubble: the shards' predicted bubble (fraction), recorded as given.
        null_records: every rank's control-step timings
            (:class:`fstrain.components.nullcontrol.NullControl`); ``None`` or empty: no null control.

    Returns:
        dict with ``measured_bubble`` (run bubble of ``compute_seconds``, a fraction),
        ``slowest_rank_ms_per_step`` (mean over steps of the slowest rank's ``compute_seconds``,
        ms), ``wait_fraction`` (sum of waits / sum of compute + wait), ``num_steps``,
        ``num_ranks``, ``compute_seconds_total``, ``wait_seconds_total``, ``predicted_bubble``
        when given, ``loss_first_step`` / ``loss_last_step`` (global mean loss) when the records
        carry losses, and with control records the null control
        (:func:`null_summary`) plus ``measured_bubble_minus_null``.
    """
    steps, c = timing_matrix(records)
    _, w = timing_matrix(records, "wait_seconds")
    out = {"measured_bubble": run_bubble(c) if c.size else 0.0,
           "slowest_rank_ms_per_step": float(c.max(axis=1).mean() * 1e3) if c.size else 0.0,
           "wait_fraction": float(w.sum() / max(1e-12, w.sum() + c.sum())) if c.size else 0.0,
           "num_steps": int(len(steps)), "num_ranks": int(c.shape[1]) if c.size else 0,
           "compute_seconds_total": float(c.sum()), "wait_seconds_total": float(w.sum())}
    if predicted_bubble is not None:
        out["predicted_bubble"] = float(predicted_bubble)
    if null_records:
        out.update(null_summary(null_records))
        if "null_bubble" in out:
            out["measured_bubble_minus_null"] = out["measured_bubble"] - out["null_bubble"]
    ls, lv = step_losses(records)
    if len(ls):
        out.update(loss_first_step=float(lv[0]), loss_last_step=float(lv[-1]))
    return out


def null_summary(records: list[StepTiming]) -> dict:
    """The null control's figures from every rank's control records.

    Returns:
        ``{}`` without records; else ``null_bubble`` (run bubble of the ``[K x R]`` control
        timings, a fraction), ``null_step_bubble_p90`` (90th percentile of the per-control
        bubbles: how high one step's bubble reads from noise alone), ``null_control_steps`` (K),
        ``null_slowest_rank_ms_per_step`` (mean over controls of the slowest rank, ms).
    """
    _, n = timing_matrix(records)
    if not n.size:
        return {}
    return {"null_bubble": run_bubble(n), "null_step_bubble_p90": float(np.percentile(step_bubbles(n), 90)),
            "null_control_steps": int(n.shape[0]), "null_slowest_rank_ms_per_step": float(n.max(axis=1).mean() * 1e3)}


def describe_bubble(summary: dict) -> str:
    """One line for users: the measured bubble beside its null control and the predicted one, all
    in %, and the slowest rank's ms per step (from :func:`summarize`'s keys)."""
    text = f"measured bubble {summary.get('measured_bubble', 0.0):.2%}"
    if "null_bubble" in summary:
        excess = summary["measured_bubble_minus_null"]
        text += (f" (null control {summary['null_bubble']:.2%} over {summary['null_control_steps']} control "
                 "steps: what timing noise alone reads; "
                 + (f"above it {excess:.2%})" if excess > 0 else "the measured bubble is within the noise)"))
    if summary.get("predicted_bubble") is not None:
        text += f", predicted {summary['predicted_bubble']:.2%}"
    text += f"; slowest rank {summary.get('slowest_rank_ms_per_step', 0.0):.2f} ms/step of compute"
    return text


def _atomic_write(path: str, write) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_step_times(records: list[StepTiming], path: str) -> None:
    """Write timings as Parquet (one row per step and rank, sorted), atomically."""
    recs = sorted(records, key=lambda r: (r.step, r.rank))
    cols = {f.name: [getattr(r, f.name) for r in recs] for f in fields(StepTiming)}
    types = {"step": pa.int32(), "rank": pa.int32(), "num_samples": pa.int32(), "num_tokens": pa.int64()}
    table = pa.table({k: pa.array(v, types.get(k, pa.float64())) for k, v in cols.items()})
    _atomic_write(path, lambda p: pq.write_table(table, p, compression="zstd"))


def read_step_times(path: str) -> list[StepTiming]:
    """Read timings written by :func:`write_step_times` (files without ``loss`` read as NaN)."""
    names = {f.name for f in fields(StepTiming)}
    t = pq.read_table(path).to_pylist()
    return [StepTiming(**{k: v for k, v in row.items() if k in names}) for row in t]


def write_json(obj: dict, path: str) -> None:
    """Write a JSON object atomically (indent 1, sorted keys)."""
    text = json.dumps(obj, indent=1, sort_keys=True) + "\n"

    def write(p: str) -> None:
        with open(p, "w") as f:
            f.write(text)

    _atomic_write(path, write)


def compare(ours: dict, baseline: dict) -> dict:
    """Bubble reduction of ``ours`` over ``baseline`` (both from :func:`summarize` or replay)."""
    return {"measured_bubble": ours["measured_bubble"], "baseline_measured_bubble": baseline["measured_bubble"],
            "measured_reduction": reduction(ours["measured_bubble"], baseline["measured_bubble"])}


__all__ = ["StepTiming", "timing_matrix", "step_losses", "summarize", "write_step_times", "read_step_times",
           "write_json", "compare", "null_summary", "describe_bubble", "NULL_TIMES"]
