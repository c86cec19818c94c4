"""``fsdata verify``: recompute everything a reader of an OUTPUT relies on (docs/format.md).

Checks, each failure one :class:`VerifyError` line (the CLI exits 2, never a traceback):

* the manifest (format_version 1, 2 or 3) parses and is well typed (:class:`fsdata.shards.manifest.Manifest`),
  with a SHA-256 and byte size for every rank file, the rank files at their format's paths, a
  3-coefficient cost model, known policy names and settings that agree with the top-level keys;
* nothing under OUTPUT that the manifest does not list (an extra ``part-00001.parquet`` or
  ``rank-00064/`` would be read by every folder-level reader);
* every rank file: present, of the recorded size and SHA-256 and row count, the manifest's
  ``columns`` with ``step`` int32 (and ``rank`` int32 equal to the file's rank in v2), rows ordered
  by step, steps ``0..num_steps-1``, row groups that hold whole steps with ``step`` statistics;
* ``_step_stats.parquet`` recomputed from the rank files (counts exactly, predicted costs to
  1e-9 relative: float sums in another order), ``batch_size_per_rank`` per rank per step under
  the fixed policy, ``sample_id`` unique, the counts and ``_dropped.parquet`` consistent;
* ``predicted_bubble`` recomputed from the rank files; ``lower_bound_bubble`` recomputed from
  the written steps (fixed policy);
* ``num_tokens`` of the step stats (fsdata >= 0.3; older outputs lack it) equals the sum of the
  rows' ``len(item_ids)`` per (step, rank), exactly;
* with E epochs (``epochs``, ``steps_per_epoch`` or under cost-budget ``epoch_num_steps``;
  absent = 1): epoch e is steps ``e*steps_per_epoch .. (e+1)*steps_per_epoch - 1`` (cost-budget:
  the epochs' step counts in order), and every epoch holds every sample exactly
  once, written in that epoch or recorded as dropped in that epoch (``_dropped.parquet``'s
  ``epoch`` column); no sample twice in one epoch, none missing;
* with ``--input``: written plus dropped equals the input set (in every epoch); every written row's content equals
  the input row of the same ``sample_id`` (a per-sample hash of all input columns); the written
  steps hold the seeded global batches (``seed``; epoch e: :func:`fsdata.balancer.order.epoch_seed`), window by window
  under composition (``settings.compose_window``); ``baseline_predicted_bubble`` recomputed from the input; under
  ``strategy = shuffle`` every per-rank batch is the seeded contiguous slice;
* every rank file carries the manifest's ``plan_digest`` (where recorded); counts read from the
  manifest are checked against the files before anything is allocated for them.

What could not be checked is returned as sentences in the summary's ``not_checked`` (no
``--input``; a plan not recomputed for another fsdata version, several epochs or format 1; no
``plan_digest``), which the CLI prints after ``OK``.

OUTPUT (and ``--input``) may be a :mod:`pyarrow.fs` URI (``s3://bucket/shards``; :mod:`fsdata.fsio`):
every listing and read then goes through its ``FileSystem``; a prefix without ``_manifest.json`` is
reported as an incomplete OUTPUT (on object stores the manifest is the commit marker, written last).

The checks by role: :mod:`~fsdata.shards.verify.recorded` (what the manifest records, and the
listing), :mod:`~fsdata.shards.verify.output` (the rank files, step stats and dropped samples),
:mod:`~fsdata.shards.verify.epochs` (every epoch holds every sample once) and
:mod:`~fsdata.shards.verify.against_input` (``--input``); :func:`verify` runs them in that order.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fsdata import fsio
from fsdata.balancer import bubble
from fsdata.errors import FsdataError, InputError, VerifyError
from fsdata.samples.io import sorted_unique
from fsdata.shards.as_input import is_output, open_output
from fsdata.shards.manifest import MANIFEST_NAMES, Manifest, ManifestError
from fsdata.shards.verify.against_input import check_against_input
from fsdata.shards.verify.epochs import check_epochs, first_epoch_num_samples, read_dropped_epochs
from fsdata.shards.verify.output import check_rank_file, read_dropped, read_step_stats
from fsdata.shards.verify.recorded import (bound_kind, check_listing, check_manifest_fields, is_close, out_path,
                                           recorded_cost_model)


#: What ``fsdata verify`` cannot check without ``--input`` (its summary's ``not_checked`` says so).
NOT_CHECKED_WITHOUT_INPUT = ("the samples against the input (pass --input INPUT): without it a lost, duplicated or "
                             "edited sample, or rows swapped or ids edited with updated checksums, pass")


def read_manifest(output: str | os.PathLike) -> Manifest:
    """Read an OUTPUT's manifest (thin wrapper of :meth:`Manifest.read`).

    Raises:
        VerifyError: missing, unparsable, unknown ``format_version``, or malformed.
    """
    try:
        return Manifest.read(output)
    except ManifestError as e:
        raise VerifyError(str(e)) from None


def verify(output: str | os.PathLike, input_path: str | os.PathLike | None = None, *,
           column_map: str | None = None, check_checksums: bool = True, progress: bool = False,
           from_step: int | None = None) -> dict:
    """Verify an OUTPUT; raise on the first violated invariant (see the module docstring).

    Args:
        output: the OUTPUT folder of ``fsdata balance`` (format_version 1, 2 or 3).
        input_path: the balance INPUT, to check samples, content, seed and the input-side bubbles.
        column_map: ``--columns`` mapping used for the input.
        check_checksums: recompute SHA-256 of every rank file.
        progress: show a progress bar over rank files.
        from_step: with an OUTPUT as ``input_path``: the step the output was resharded from (its
            samples of steps ``>= from_step`` are the input, :mod:`fsdata.shards.as_input`).

    Returns:
        Summary dict: ``format_version``, ``num_ranks``, ``num_steps``, ``num_samples_written``,
        ``num_samples_dropped``, ``predicted_bubble`` (recomputed), ``baseline_predicted_bubble``,
        ``lower_bound_bubble``, ``checked_input``, ``not_checked`` (sentences naming each check
        that could not run and why: without ``input_path`` the input-side checks; a plan not
        recomputed for an output of another fsdata version; no ``plan_digest``).

    Raises:
        VerifyError: any violation or malformed file, one line with the rank/step and numbers.
        InputError: ``input_path`` is not a readable sample input.
    """
    output = fsio.resolve_pointer(output)  # normalised; an object store's pointer object followed
    if input_path is not None:
        input_path = fsio.normalize(input_path)
    try:
        return _verify(output if fsio.is_remote(output) else Path(output), input_path, column_map, check_checksums,
                       progress, from_step)
    except FsdataError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed output must give one line, never a traceback
        from fsdata.guards import environment_error  # noqa: PLC0415

        env = environment_error(e, output, action="read")
        if env is not None:  # the store or the machine failed, not the output
            raise env from None
        msg = str(e).splitlines()[0] if str(e) else ""
        raise VerifyError(f"{output} is malformed ({type(e).__name__}: {msg}); rerun 'fsdata balance'") from None


def _verify(out: Path | str, input_path, column_map, check_checksums: bool, progress: bool,
            from_step: int | None = None) -> dict:
    if not fsio.is_dir(out):
        what = "prefix holding objects" if isinstance(out, str) else "folder"
        raise VerifyError(f"{out} is not a {what}; pass an 'fsdata balance' OUTPUT")
    m = read_manifest(out)
    where = str(out_path(out, MANIFEST_NAMES[m.format_version]))
    check_manifest_fields(m, where)
    check_listing(out, m)
    cost_model = recorded_cost_model(m)
    R, steps, B = m.num_ranks, m.num_steps, m.batch_size_per_rank
    stats = read_step_stats(out, m, check_checksums)
    expected_counts = stats.column("num_samples").to_numpy().astype(np.int64).reshape(steps, R)
    if m.batch_policy == "fixed" and not (expected_counts == B).all():
        raise VerifyError(f"step_stats counts differ from batch_size_per_rank={B} under the fixed policy")
    recorded = (m.extra or {}).get("per_rank_count")
    if recorded is not None:
        c = expected_counts
        want = {"min": int(c.min()), "median": float(np.median(c)), "max": int(c.max()), "mean": float(c.mean())}
        if not isinstance(recorded, dict) or any(not isinstance(recorded.get(k), (int, float))
                                                 or not is_close(float(recorded[k]), v) for k, v in want.items()):
            raise VerifyError(f"manifest per_rank_count {recorded!r} differs from the step stats' {want}; "
                              "rerun 'fsdata balance'")
    loads = np.zeros((steps, R))
    tokens = np.zeros((steps, R), dtype=np.int64)
    all_ids: list[np.ndarray] = []
    all_hashes: list[np.ndarray] = []
    step_of: list[np.ndarray] = []
    rank_of: list[np.ndarray] = []
    cost_of: list[np.ndarray] = []
    for f in tqdm(m.files, unit="rank", desc="verify", disable=not progress):
        r = f.rank
        step, lengths, ids, hashes = check_rank_file(out, m, f, check_checksums, input_path is not None)
        got = np.bincount(step, minlength=steps)
        bad = np.flatnonzero(got != expected_counts[:, r])
        if len(bad):
            s = int(bad[0])
            raise VerifyError(f"rank {r}, step {s}: {int(got[s])} rows, step_stats says {int(expected_counts[s, r])}; "
                              "ranks would disagree on the step count")
        costs = cost_model.cost(lengths)
        loads[:, r] = np.bincount(step, weights=costs, minlength=steps)
        tokens[:, r] = np.bincount(step, weights=lengths.astype(np.float64), minlength=steps).astype(np.int64)
        all_ids.append(ids)
        rank_of.append(np.full(len(ids), r, dtype=np.int64))
        step_of.append(step)
        cost_of.append(costs)
        if hashes is not None:
            all_hashes.append(hashes)
    recorded_costs = stats.column("predicted_cost").to_numpy().reshape(steps, R)
    off = np.argwhere(np.abs(recorded_costs - loads) > 1e-9 * np.maximum(np.abs(loads), 1.0))
    if len(off):
        s, r = map(int, off[0])
        raise VerifyError(f"step_stats predicted_cost of step {s} rank {r} is {float(recorded_costs[s, r])!r}, "
                          "recomputed "
                          f"{float(loads[s, r])!r} under the manifest's cost model; rerun 'fsdata balance'")
    if "num_tokens" in stats.schema.names:
        recorded_tokens = stats.column("num_tokens").to_numpy().reshape(steps, R)
        off = np.argwhere(recorded_tokens != tokens)
        if len(off):
            s, r = map(int, off[0])
            raise VerifyError(f"step_stats num_tokens of step {s} rank {r} is {int(recorded_tokens[s, r])}, the rank "
                              f"file's rows hold {int(tokens[s, r])} history items; rerun 'fsdata balance'")
    ids = np.concatenate(all_ids) if all_ids else np.empty(0, np.int64)
    if len(ids) != m.num_samples_written:
        raise VerifyError(f"{len(ids)} rows written, manifest says num_samples_written={m.num_samples_written}")
    E = m.epochs
    if E == 1:
        uniq, duplicates = sorted_unique(ids)
        if duplicates:
            raise VerifyError(f"{duplicates} samples appear more than once across ranks")
    dropped = read_dropped(out, m, check_checksums)
    if len(dropped) != m.num_samples_dropped:
        raise VerifyError(f"{len(dropped)} dropped ids recorded, "
                          f"manifest says num_samples_dropped={m.num_samples_dropped}")
    F = first_epoch_num_samples(m)
    if m.num_samples_written + m.num_samples_dropped != E * m.num_samples_input - (0 if F is None else
                                                                                   m.num_samples_input - F):
        raise VerifyError("num_samples_written + num_samples_dropped != num_samples_input"
                          f"{f' x epochs ({E})' if E > 1 else ''}"
                          f"{'' if F is None else ' less the samples left out of the partial first epoch'} "
                          "in the manifest")
    dropped_epoch = read_dropped_epochs(out, m, len(dropped))
    if E > 1:
        check_epochs(m, ids, np.concatenate(step_of) if step_of else np.empty(0, np.int64), dropped, dropped_epoch)
    elif len(dropped) and (sorted_unique(dropped)[1] or np.isin(dropped, uniq).any()):
        raise VerifyError("some samples are recorded as dropped twice, or both written and dropped")
    achieved = bubble.run_bubble(loads)
    if not is_close(achieved, m.predicted_bubble):
        raise VerifyError(f"recomputed predicted bubble {achieved:.9%} differs from the manifest's "
                          f"{m.predicted_bubble:.9%}")
    lower = m.lower_bound_bubble
    if m.batch_policy == "fixed" and lower is not None:
        # the bound depends only on each written step's cost multiset (composed or not)
        step_all, cost_all = np.concatenate(step_of), np.concatenate(cost_of)
        order = np.argsort(step_all, kind="stable")
        lb = bubble.lower_bound_bubble(cost_all[order].reshape(steps, R * B), R, B, kind=bound_kind(m))
        if not is_close(lb, lower):
            raise VerifyError(f"recomputed lower_bound_bubble {lb:.9%} differs from the manifest's {lower:.9%}")
    checked_input = False
    baseline = m.baseline_predicted_bubble
    not_checked: list[str] = []
    if from_step is not None and input_path is None:
        raise VerifyError("--from-step needs --input OLD, the OUTPUT this one was resharded from")
    if input_path is not None and is_output(input_path):  # OLD of a resharded output (fsdata.shards.as_input)
        with open_output(input_path, from_step) as view:
            baseline = check_against_input(m, input_path, None, cost_model, ids, np.concatenate(step_of),
                                           np.concatenate(all_hashes), dropped, out, dropped_epoch,
                                           np.concatenate(rank_of), skipped=not_checked, view=view)
        checked_input = True
    elif input_path is not None:
        if from_step is not None:
            raise VerifyError(f"--from-step needs an 'fsdata balance' OUTPUT as --input; {input_path} is not one")
        baseline = check_against_input(m, input_path, column_map, cost_model, ids, np.concatenate(step_of),
                                        np.concatenate(all_hashes), dropped, out, dropped_epoch,
                                        np.concatenate(rank_of), skipped=not_checked)
        checked_input = True
    else:
        not_checked.append(NOT_CHECKED_WITHOUT_INPUT)
    if m.plan_digest is None:
        not_checked.append("that every rank file comes from the same plan (the manifest records no plan_digest: "
                           "written by an earlier fsdata)")
    return {"format_version": m.format_version, "num_ranks": R, "num_steps": steps,
            "num_samples_written": int(len(ids)), "num_samples_dropped": int(len(dropped)),
            "predicted_bubble": achieved, "baseline_predicted_bubble": baseline, "lower_bound_bubble": lower,
            "checked_input": checked_input, "not_checked": not_checked,
            **({"epochs": E, "steps_per_epoch": m.steps_per_epoch, "epoch_num_steps": m.epoch_num_steps}
               if E > 1 else {})}


__all__ = ["InputError", "VerifyError", "read_manifest", "verify"]
