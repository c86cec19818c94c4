"""``fsdata report``: one self-contained HTML page (plus PNG files) about a balanced output.

The page shows, for an ``fsdata balance`` OUTPUT (format v1 ``manifest.json`` or v2
``_manifest.json``; rank files always from the manifest's ``files[].path``): the length histogram
(log-spaced bins, log counts) and the cost per sample under the manifest's cost model; the
predicted per-rank load of every step *before* (today's practice: the same global batches cut into
equal contiguous per-rank batches, :func:`fsdata.balancer.partition.partition_shuffle`) and *after*
(the written assignment, ``step_stats``), as heat maps of load / step mean; the bubble per step
before and after, with the lower bound of the steps as written
(:func:`fsdata.balancer.bubble.written_bound_bubbles`; never above "after"); the settings and counts.

The "before" assignment needs each input row's cost in input order (the global batches are a
seeded permutation of input rows, :func:`fsdata.balancer.plan.shuffled_steps`). It is recovered exactly
either from ``input_path`` (the balance INPUT) or, without it, when the output's ``sample_id``s are
the input's row numbers (as ``fsdata convert`` and ``fsdata synth`` write them); both are checked
against the output's step membership and the manifest's ``baseline_predicted_bubble``.

Images are embedded as base64 PNG (no network at view time); matplotlib (Agg) is used only here
and in :mod:`fstrain.measure.report` (pages written by :mod:`fsdata.common.page`). The page is never
written inside OUTPUT nor onto an input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdata.balancer import bubble
from fsdata.samples import schema as S
from fsdata.balancer.cost import load_cost_model
from fsdata.errors import InputError
from fsdata.guards import check_output_apart
from fsdata.balancer.partition import partition_shuffle, per_rank_loads
from fsdata.balancer.plan import LEGACY_SHUFFLE, shuffled_steps
from fsdata.shards.manifest import Manifest, ManifestError
from fsdata.common.page import Figure, figure_png, pyplot, write_page


@dataclass(kw_only=True, slots=True)
class OutputData:
    """What a report needs from a balance OUTPUT.

    Attributes:
        manifest: the manifest (dict).
        lengths: shape ``[N_written]`` int64, sequence lengths of the written samples.
        after_loads: shape ``[S x R]`` float64, predicted per-rank cost per step (step_stats).
        before_loads: shape ``[S' x R]`` float64, equal-count shuffled per-rank cost of the same
            global batches (S' = S for the fixed policy).
        step_lower_bound: shape ``[S]`` float64, least possible most-loaded rank of each step as written.
        before_source: how the shuffle assignment was recovered (for the page).
        bound_kind: that bound's ``fsdata.balancer.bubble.BOUND_TEXT`` key.
    """

    manifest: dict
    lengths: np.ndarray
    after_loads: np.ndarray
    before_loads: np.ndarray
    step_lower_bound: np.ndarray
    before_source: str
    bound_kind: str = "pigeonhole"


def _read_rank_files(output: Path, m: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sample_id, step, length)`` of every written row, each ``[N_written]`` int64."""
    ids, steps, lengths = [], [], []
    for f in sorted(m["files"], key=lambda f: f["rank"]):
        path = output / f["path"]
        if not path.is_file():
            raise InputError(f"rank {f['rank']}: {path} is missing; rerun 'fsdata balance'")
        names = pq.read_schema(path).names
        cols = [S.SAMPLE_ID, S.STEP, S.SEQ_LEN if S.SEQ_LEN in names else S.ITEM_IDS]
        t = pq.read_table(path, columns=cols)
        ids.append(t.column(S.SAMPLE_ID).to_numpy().astype(np.int64))
        steps.append(t.column(S.STEP).to_numpy().astype(np.int64))
        L = t.column(cols[2])
        L = L if cols[2] == S.SEQ_LEN else pc.list_value_length(L)
        lengths.append(L.to_numpy(zero_copy_only=False).astype(np.int64))
    return np.concatenate(ids), np.concatenate(steps), np.concatenate(lengths)


def load_output(output: str | os.PathLike, input_path: str | os.PathLike | None = None,
                column_map: str | None = None) -> OutputData:
    """Read an OUTPUT and recover the shuffle ("before") assignment of its global batches.

    Args:
        output: an ``fsdata balance`` OUTPUT folder (v1 or v2).
        input_path: the balance INPUT; needed only when the output's ``sample_id``s are not the
            input's row numbers.
        column_map: ``--columns`` mapping used for the input.

    Returns:
        :class:`OutputData`.

    Raises:
        InputError: unreadable output, or the shuffle assignment cannot be recovered / does not
            match the manifest (names the fix: pass ``--input``).
    """
    out = Path(output)
    try:  # the format module's one manifest and step-stats reader (v1 and v2 names)
        manifest = Manifest.read(out)
        m = manifest.to_json()
        stats = manifest.read_step_stats(columns=["step", "rank", "predicted_cost"])
    except ManifestError as e:
        raise InputError(str(e)) from None
    R, B, S_ = int(m["num_ranks"]), int(m["batch_size_per_rank"]), int(m["num_steps"])
    after = np.zeros((S_, R))
    after[stats.column("step").to_numpy(), stats.column("rank").to_numpy()] = stats.column("predicted_cost").to_numpy()
    ids, out_steps, lengths = _read_rank_files(out, m)
    N = int(m["num_samples_input"])
    cost_model = load_cost_model(m["cost_model"])
    if input_path is not None:
        from fsdata.samples.io import open_samples  # noqa: PLC0415

        in_lengths, in_ids = open_samples(input_path, column_map).lengths_and_ids()
        if len(in_ids) != N:
            raise InputError(f"--input {input_path} has {len(in_ids)} samples but the output was balanced from {N}; "
                             "pass the same INPUT as 'fsdata balance'")
        order = np.argsort(in_ids, kind="stable")
        pos = np.searchsorted(in_ids[order], ids)
        if (pos >= N).any() or (in_ids[order][np.minimum(pos, N - 1)] != ids).any():
            raise InputError(f"--input {input_path} lacks some sample_ids of {output}; pass the same INPUT as "
                             "'fsdata balance'")
        row_of = order[pos]
        row_lengths = np.asarray(in_lengths, dtype=np.int64)
        source = f"exact: global batches recomputed from --input {input_path} (seed {m.get('seed', 0)})"
    else:
        if len(ids) and (ids.min() < 0 or ids.max() >= N):
            raise InputError(f"the sample_ids of {output} are not the input's row numbers, so the shuffle assignment "
                             "('before') cannot be recovered from the output alone; "
                             "pass --input INPUT (the balance INPUT)")
        row_of = ids
        row_lengths = np.full(N, -1, dtype=np.int64)
        row_lengths[ids] = lengths
        source = (f"exact: global batches recomputed from the seed ({m.get('seed', 0)}); sample_id = input row "
                  "(as written by fsdata convert/synth)")
    from fsdata.balancer.order import epoch_seed  # noqa: PLC0415

    # E epochs (manifest ``epochs``, absent = 1): epoch e's global batches come from epoch_seed(seed, e)
    E = int(m.get("epochs", 1))
    per = m.get("epoch_num_steps") or [int(m.get("steps_per_epoch", S_ // max(E, 1)))] * E
    first = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    epoch_of = np.searchsorted(first[1:], out_steps, side="right")
    fix = "pass --input INPUT (the balance INPUT)" if input_path is None else "pass the same INPUT as 'fsdata balance'"
    fixed = m.get("batch_policy", "fixed") == "fixed"
    all_steps, all_step_lengths = [], []
    for e in range(E):
        steps, _ = shuffled_steps(N, R, B, epoch_seed(int(m.get("seed", 0)), e),
                                  shuffle=(m.get("settings") or {}).get("shuffle", LEGACY_SHUFFLE))
        step_lengths = row_lengths[steps]
        if (step_lengths < 0).any():
            raise InputError(f"some samples of the global batches of {output} were not written, so their lengths are "
                             f"unknown; {fix}")
        if fixed:
            # composition (docs/balancer.md) regroups samples only inside windows of W global batches
            W = max(1, int((m.get("settings") or {}).get("compose_window") or 1))
            plan_step = np.full(N, -1, dtype=np.int64)
            plan_step[steps.ravel()] = np.repeat(np.arange(len(steps)), R * B)
            sel = np.flatnonzero(epoch_of == e)
            bad = sel[plan_step[row_of[sel]] // W != (out_steps[sel] - first[e]) // W]
            if len(bad):
                raise InputError(f"the global batches recomputed from the seed do not match {output} (e.g. sample_id "
                                 f"{int(ids[bad[0]])} is in step {int(out_steps[bad[0]])}); {fix}")
        all_steps.append(steps)
        all_step_lengths.append(step_lengths)
    steps, step_lengths = np.concatenate(all_steps), np.concatenate(all_step_lengths)
    del all_steps, all_step_lengths
    step_costs = cost_model.cost(step_lengths)
    if fixed:  # the bound of the written (possibly composed) steps, as the manifest's lower_bound_bubble
        written = cost_model.cost(lengths[np.argsort(out_steps, kind="stable")]).reshape(S_, R * B)
        kind = "pigeonhole" if m.get("lower_bound_kind") == "pigeonhole" else "simple"
        step_bound = (bubble.step_proven_bound if kind == "pigeonhole" else bubble.step_lower_bound)(written, R, B)
    else:  # cost-budget: counts vary per rank, so the bound of any assignment of each written step's samples
        kind, step_bound = "any-count", bubble.any_count_bound(cost_model.cost(lengths), out_steps, S_, R)
    before = per_rank_loads(step_costs, np.broadcast_to(partition_shuffle(R * B, R, B), steps.shape), R)
    recorded = m.get("baseline_predicted_bubble")
    got = bubble.run_bubble(before)
    if recorded is not None and abs(got - recorded) > 1e-9 + 1e-6 * abs(recorded):
        raise InputError(f"the recomputed shuffle bubble {got:.6%} differs from the manifest's {recorded:.6%}; {fix}")
    return OutputData(manifest=m, lengths=lengths, after_loads=after, before_loads=before,
                      step_lower_bound=step_bound, before_source=source, bound_kind=kind)


# ---------------------------------------------------------------------------------------------- figures

def _fig_lengths(lengths: np.ndarray) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    L = np.maximum(lengths, 1)
    bins = np.unique(np.geomspace(1, L.max() + 1, 60).astype(np.int64))
    ax.hist(L, bins=bins, color="#4c72b0")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for q, ls in ((50, "-"), (90, "--"), (99, ":")):
        v = np.percentile(L, q)
        ax.axvline(v, color="#c44e52", ls=ls, lw=1, label=f"p{q} = {v:.0f}")
    ax.set_xlabel("sequence length L (items)")
    ax.set_ylabel("samples")
    ax.legend(loc="upper right")
    return figure_png(fig)


def _fig_cost(lengths: np.ndarray, cost_model) -> bytes:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    grid = np.unique(np.geomspace(1, max(2, lengths.max()), 200).astype(np.int64))
    a.plot(grid, cost_model.cost(grid), color="#4c72b0")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("L")
    a.set_ylabel("cost per sample")
    a.set_title(f"cost model {cost_model.name}", fontsize=10)
    c = cost_model.cost(lengths)
    order = np.sort(c)[::-1]
    share = np.cumsum(order) / order.sum()
    frac = np.arange(1, len(order) + 1) / len(order)
    b.plot(frac * 100, share * 100, color="#55a868")
    b.set_xscale("log")
    b.set_xlabel("most expensive samples (%)")
    b.set_ylabel("share of total cost (%)")
    b.grid(alpha=0.3)
    return figure_png(fig)


def _fig_heatmaps(before: np.ndarray, after: np.ndarray) -> bytes:
    from matplotlib.colors import TwoSlopeNorm  # noqa: PLC0415

    plt = pyplot()

    def rel(x):
        mean = x.mean(axis=1, keepdims=True)
        return np.divide(x, mean, out=np.ones_like(x), where=mean > 0)

    rb, ra = rel(before), rel(after)
    lo, hi = min(rb.min(), ra.min(), 0.99), max(rb.max(), ra.max(), 1.01)
    norm = TwoSlopeNorm(vmin=lo, vcenter=1.0, vmax=hi)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True, layout="constrained")
    for ax, data, title in ((axes[0], rb, "before: shuffled, equal counts"), (axes[1], ra, "after: fsdata balance")):
        im = ax.imshow(data.T, aspect="auto", origin="lower", cmap="RdBu_r", norm=norm, interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    axes[0].set_ylabel("rank")
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(im, ax=axes, label="predicted load / step mean")
    return figure_png(fig)


def _fig_bubbles(before: np.ndarray, after: np.ndarray, lower: np.ndarray, lower_run: float) -> bytes:
    plt = pyplot()
    fig, (top, zoom) = plt.subplots(2, 1, figsize=(10, 5.6), sharex=True, height_ratios=(3, 2), layout="constrained")
    sb, sa = bubble.step_bubbles(before) * 100, bubble.step_bubbles(after) * 100
    lb = lower * 100  # fsdata.balancer.bubble.written_bound_bubbles
    for ax in (top, zoom):
        if ax is top:
            ax.plot(np.arange(len(sb)), sb, color="#c44e52", lw=1,
                    label=f"before (run {bubble.run_bubble(before):.2%})")
        ax.plot(np.arange(len(sa)), sa, color="#4c72b0", lw=1, label=f"after (run {bubble.run_bubble(after):.4%})")
        ax.plot(np.arange(len(lb)), lb, color="#555555", lw=1, ls="--", label=f"lower bound (run {lower_run:.4%})")
        ax.set_ylabel("bubble (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    top.legend(loc="upper right")
    zoom.set_title("after and lower bound, own scale", fontsize=9)
    zoom.set_xlabel("step")
    return figure_png(fig)


def output_figures(d: OutputData) -> list[Figure]:
    """The figures of :func:`write_report` for one output."""
    m, lower = d.manifest, bubble.written_bound_bubbles(d.after_loads, d.step_lower_bound)
    cm = load_cost_model(m["cost_model"])
    R = int(m["num_ranks"])
    return [
        Figure(name="lengths", title="Sequence lengths",
               caption=f"{len(d.lengths):,} written samples; log-spaced bins, log counts.",
               png=_fig_lengths(d.lengths)),
        Figure(name="cost", title="Cost per sample",
               caption=f"Left: {cm.name} cost c0 + c1 L + c2 L^2 with (c0, c1, c2) = "
                       f"{tuple(float(f'{c:.4g}') for c in cm.coefficients)}. Right: share of the total cost "
                       "carried by the most expensive samples.",
               png=_fig_cost(d.lengths, cm)),
        Figure(name="load_heatmaps", title="Per-rank predicted load per step",
               caption=f"Each rank's predicted cost divided by the step's mean over {R} ranks (1 = fair share; red: "
                       f"straggler, blue: waits). Before: {d.before_source}.",
               png=_fig_heatmaps(d.before_loads, d.after_loads)),
        Figure(name="bubble_per_step", title="Bubble per step",
               caption="1 - mean / max of the per-rank predicted load. Lower bound: 1 - mean / LB per step, 1 - sum "
                       f"mean / sum LB over the run (the table's), LB {bubble.BOUND_TEXT[d.bound_kind]}; never above "
                       "'after'.", png=_fig_bubbles(d.before_loads, d.after_loads, *lower)),
    ]


def output_rows(d: OutputData) -> list[tuple[str, str]]:
    """Settings and counts table rows ``(name, value)`` for one output."""
    m, lower = d.manifest, bubble.written_bound_bubbles(d.after_loads, d.step_lower_bound)[1]
    cm, settings = m["cost_model"], m.get("settings") or {}
    L = d.lengths
    p50, p90, p99 = np.percentile(L, [50, 90, 99]) if len(L) else (0, 0, 0)
    return [
        ("format_version", str(m.get("format_version"))),
        ("ranks x steps", f"{m['num_ranks']} x {m['num_steps']}"),
        ("batch size per rank", f"{m['batch_size_per_rank']} ({m.get('batch_policy', 'fixed')} policy)"),
        ("strategy / partitioner", f"{m.get('strategy', '?')} / {settings.get('partitioner', '?')}"),
        ("cost model", f"{cm.get('name', '?')}: coefficients {cm.get('coefficients')}"),
        ("seed", str(m.get("seed"))),
        ("samples input / written / dropped",
         f"{m['num_samples_input']:,} / {m['num_samples_written']:,} / {m['num_samples_dropped']:,}"),
        ("length mean / p50 / p90 / p99 / max",
         f"{L.mean():.1f} / {p50:.0f} / {p90:.0f} / {p99:.0f} / {L.max()}" if len(L) else "-"),
        ("predicted bubble before (shuffle)", f"{bubble.run_bubble(d.before_loads):.4%}"),
        ("predicted bubble after (written)", f"{bubble.run_bubble(d.after_loads):.4%}"),
        (f"lower bound of the written steps ({d.bound_kind})", f"{lower:.4%}"),
        ("slowest rank, sum over steps: after / before",
         f"{d.after_loads.max(axis=1).sum() / max(1e-300, d.before_loads.max(axis=1).sum()):.3f}"),
    ]


# ---------------------------------------------------------------------------------------------- the page

def default_html_path(output: str | os.PathLike) -> Path:
    """``<OUTPUT>-report.html`` beside the OUTPUT folder (the output itself is never modified)."""
    out = Path(output).resolve()
    return out.with_name(f"{out.name}-report.html")


def write_report(output_dir: str | os.PathLike, html_path: str | os.PathLike | None = None, *,
                 input_path: str | os.PathLike | None = None, column_map: str | None = None,
                 label: str | None = None, overwrite: bool = False) -> dict:
    """One call: read a balance OUTPUT and write its HTML report and PNG figures.

    Args:
        output_dir: an ``fsdata balance`` OUTPUT (format v1 or v2); read only.
        html_path: the page to write (default :func:`default_html_path`); PNGs go beside it.
        input_path: the balance INPUT, when the output's ``sample_id``s are not input row numbers.
        column_map: ``--columns`` mapping of the input.
        label: how the page names the output and input (default: their paths as given; the nightly
            job passes the published names, since it writes the page before the run is renamed).
        overwrite: replace a file fsdata report did not write (:func:`write_page`).

    Returns:
        ``{"html": path, "png": [paths], "predicted_bubble_before": float,
        "predicted_bubble_after": float, "lower_bound_bubble": float}`` (the page's lower bound).

    Raises:
        InputError: see :func:`load_output` and :func:`write_page`. ConfigError: the page would lie
            inside OUTPUT or be the input (:func:`fsdata.guards.check_output_apart`), or is taken.
    """
    hp = Path(html_path) if html_path is not None else default_html_path(output_dir)
    check_output_apart(hp, [output_dir, input_path], output_name="--html", input_name="OUTPUT or --input")
    d = load_output(output_dir, input_path, column_map)
    if label is not None and input_path is not None:
        d.before_source = d.before_source.replace(str(input_path), "the run's samples")
    res = write_page(hp, f"fsdata report: {label or output_dir}",
                     [("Settings and counts", output_rows(d), []), ("Figures", [], output_figures(d))],
                     overwrite=overwrite)
    res.update(predicted_bubble_before=bubble.run_bubble(d.before_loads),
               predicted_bubble_after=bubble.run_bubble(d.after_loads),
               lower_bound_bubble=bubble.written_bound_bubbles(d.after_loads, d.step_lower_bound)[1])
    return res
