"""``fstrain report``: the ``fsdata report`` page of a shard output plus what training measured on it.

Adds, from ``fstrain train --metrics-dir RUN`` on the same shards (``RUN/step_times.parquet``):

* measured per-rank compute per step (divided by the step's mean, the same scale as the predicted
  heat maps) and the straggler wait per step and rank (ms) as heat maps;
* the measured bubble per step (``1 - mean / max`` of ``compute_seconds``) beside the predicted
  one of the same steps, over the noise floor of the run's null control (``null_step_times.parquet``,
  :mod:`fstrain.components.nullcontrol`) where the run recorded one;
* the loss curve: the global mean per-sample loss per step (:func:`fstrain.components.metrics.step_losses`).

The metrics must come from the same shards: same world size, steps within the shards' steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fsdata.balancer import bubble
from fsdata.common.page import Figure, figure_png, pyplot, write_page
from fsdata.report import load_output, output_figures, output_rows
from fstrain.errors import ConfigError
from fstrain.components.metrics import NULL_TIMES, read_step_times, step_losses, timing_matrix
from fstrain.components.outputs import check_output_file


def _fig_measured(steps: np.ndarray, compute: np.ndarray, wait: np.ndarray) -> bytes:
    from matplotlib.colors import TwoSlopeNorm  # noqa: PLC0415

    plt = pyplot()
    mean = compute.mean(axis=1, keepdims=True)
    rel = np.divide(compute, mean, out=np.ones_like(compute), where=mean > 0)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True, layout="constrained")
    extent = (steps[0] - 0.5, steps[-1] + 0.5, -0.5, compute.shape[1] - 0.5)
    norm = TwoSlopeNorm(vmin=min(rel.min(), 0.99), vcenter=1.0, vmax=max(rel.max(), 1.01))
    im = a.imshow(rel.T, aspect="auto", origin="lower", cmap="RdBu_r", norm=norm, interpolation="nearest",
                  extent=extent)
    a.set_title("measured compute / step mean", fontsize=10)
    a.set_xlabel("step")
    a.set_ylabel("rank")
    fig.colorbar(im, ax=a)
    im2 = b.imshow(wait.T * 1e3, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest", extent=extent)
    b.set_title("straggler wait (ms)", fontsize=10)
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    b.set_xlabel("step")
    fig.colorbar(im2, ax=b)
    return figure_png(fig)


def _fig_bubble_measured(steps: np.ndarray, compute: np.ndarray, predicted: np.ndarray,
                         null: np.ndarray | None = None) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    if null is not None and null.size:
        p90 = float(np.percentile(bubble.step_bubbles(null), 90)) * 100
        ax.axhspan(0, p90, color="0.85", zorder=0,
                   label=f"noise floor: 90% of {null.shape[0]} null-control steps below {p90:.2f}%")
        ax.axhline(bubble.run_bubble(null) * 100, color="0.4", lw=1, ls="--",
                   label=f"null control (run {bubble.run_bubble(null):.2%})")
    ax.plot(steps, bubble.step_bubbles(compute) * 100, color="#c44e52", lw=1,
            label=f"measured (run {bubble.run_bubble(compute):.2%})")
    ax.plot(steps, bubble.step_bubbles(predicted) * 100, color="#4c72b0", lw=1,
            label=f"predicted (run {bubble.run_bubble(predicted):.4%})")
    ax.set_xlabel("step")
    ax.set_ylabel("bubble (%)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return figure_png(fig)


def _fig_loss(steps: np.ndarray, loss: np.ndarray) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.plot(steps, loss, color="#4c72b0", lw=1, marker="." if len(steps) < 60 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean per sample)")
    ax.grid(alpha=0.3)
    return figure_png(fig)


def write_train_report(shards: str | os.PathLike, metrics_dir: str | os.PathLike,
                       html_path: str | os.PathLike | None = None, *,
                       input_path: str | os.PathLike | None = None) -> dict:
    """Write the shard report plus the training measurements of ``metrics_dir``.

    Args:
        shards: the ``fsdata balance`` OUTPUT that was trained on (read only).
        metrics_dir: ``fstrain train --metrics-dir`` folder with ``step_times.parquet``.
        html_path: the page (default ``<metrics_dir>/report.html``); PNGs beside it.
        input_path: the balance INPUT (see :func:`fsdata.report.load_output`).

    Returns:
        ``{"html", "png", "measured_bubble", "predicted_bubble", "num_steps", "loss_last_step"}``, plus
        ``null_bubble`` (fraction) when the run recorded a null control.

    Raises:
        ConfigError: no ``step_times.parquet``, metrics from other shards (world size, steps), or
            the page or a PNG beside it exists and is not one a report wrote
            (:func:`fstrain.components.outputs.check_output_file`); nothing was written then.
        fsdata.errors.InputError: see :func:`fsdata.report.load_output`.
    """
    times_path = Path(metrics_dir) / "step_times.parquet"
    if not times_path.is_file():
        raise ConfigError(f"{times_path} does not exist; train with `fstrain train SHARDS --metrics-dir "
                          f"{metrics_dir}` first")
    d = load_output(shards, input_path)
    R, S_ = int(d.manifest["num_ranks"]), int(d.manifest["num_steps"])
    records = read_step_times(str(times_path))
    steps, compute = timing_matrix(records, "compute_seconds")
    _, wait = timing_matrix(records, "wait_seconds")
    if not len(steps):
        raise ConfigError(f"{times_path} holds no step timed on every rank; train at least one step")
    if compute.shape[1] != R or steps.max() >= S_:
        raise ConfigError(f"{times_path} is from {compute.shape[1]} ranks and steps up to {int(steps.max())}, but "
                          f"{shards} has {R} ranks and {S_} steps: pass the shards that run trained on")
    predicted = d.after_loads[steps]
    null_path = Path(metrics_dir) / NULL_TIMES
    null = timing_matrix(read_step_times(str(null_path)))[1] if null_path.is_file() else None
    loss_steps, loss = step_losses(records)
    summary_path = Path(metrics_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    rows = [("metrics", str(metrics_dir)), ("steps timed", f"{len(steps)} ({int(steps[0])}..{int(steps[-1])})"),
            ("measured bubble (compute)", f"{bubble.run_bubble(compute):.2%}"),
            ("null control: bubble of identical work (timing noise)",
             f"{bubble.run_bubble(null):.2%} over {null.shape[0]} control steps" if null is not None and null.size
             else "not recorded (fstrain train --null-control-steps)"),
            ("predicted bubble, same steps", f"{bubble.run_bubble(predicted):.4%}"),
            ("slowest rank compute, mean ms/step", f"{compute.max(axis=1).mean() * 1e3:.2f}"),
            ("straggler wait, share of compute + wait", f"{wait.sum() / max(1e-12, wait.sum() + compute.sum()):.2%}")]
    if len(loss):
        rows.append(("loss first / last step", f"{loss[0]:.4f} / {loss[-1]:.4f}"))
    if "pipeline" in summary:
        rows.append(("pipeline", str(summary["pipeline"])))
    figs = [Figure(name="measured_load", title="Measured per-rank compute and straggler wait per step",
                   caption="Left: each rank's measured compute_seconds divided by the step's mean (same scale idea as "
                           "the predicted heat maps). Right: time each rank waited for the slowest one.",
                   png=_fig_measured(steps, compute, wait)),
            Figure(name="measured_bubble", title="Measured vs predicted bubble per step",
                   caption="Measured: 1 - mean / max of compute_seconds over ranks; predicted: the same formula on "
                           "step_stats' predicted_cost of the same steps. Grey: the noise floor, from the null "
                           "control (control steps in which every rank timed the same batch): a measured step inside "
                           "the band is as even as this machine can tell; the dashed line is the null control's run "
                           "bubble. Measured sits above predicted by that noise, and by the cost model's error where "
                           "it was fitted for another model or machine (fstrain calibrate; docs/fstrain.md).",
                   png=_fig_bubble_measured(steps, compute, predicted, null))]
    if len(loss):
        figs.append(Figure(name="loss", title="Training loss", caption="Global mean per-sample loss of each step "
                           "(the num_samples-weighted mean of the ranks' losses in step_times.parquet).",
                           png=_fig_loss(loss_steps, loss)))
    hp = Path(html_path) if html_path is not None else Path(metrics_dir) / "report.html"
    shard_figs = output_figures(d)
    check_output_file(str(hp), "report", "--html")
    for f in [*figs, *shard_figs]:  # write_page's names; a PNG is replaced only when it carries the report marker
        check_output_file(str(hp.with_name(f"{hp.stem}-{f.name}.png")), "report-figure", "figure")
    res = write_page(hp, f"fstrain report: {shards} trained -> {metrics_dir}",
                     [("Shards: settings and counts", output_rows(d), []), ("Training", rows, figs),
                      ("Shards: predicted", [], shard_figs)])
    if null is not None and null.size:
        res["null_bubble"] = bubble.run_bubble(null)
    res.update(measured_bubble=bubble.run_bubble(compute), predicted_bubble=bubble.run_bubble(predicted),
               num_steps=int(len(steps)), loss_last_step=float(loss[-1]) if len(loss) else None)
    return res
