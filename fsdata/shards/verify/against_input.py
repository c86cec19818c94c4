"""``fsdata verify --input``: the output against its input: the sample set per epoch, every row's
content, the seeded global batches, the input-side bubbles, the input digest, and (same fsdata
version) the whole plan recomputed from the input and the recorded settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.balancer import bubble
from fsdata.balancer.cost import CostModel
from fsdata.balancer.order import LEGACY_SHUFFLE, shuffled_steps
from fsdata.errors import FsdataError, VerifyError
from fsdata.samples import schema as S
from fsdata.samples.io import open_samples
from fsdata.shards.manifest import Manifest
from fsdata.shards.verify.output import row_hashes
from fsdata.shards.verify.recorded import is_close, out_path, recorded_compose_window


def check_against_input(m: Manifest, input_path, column_map, cost_model: CostModel, ids: np.ndarray,
                         steps_written: np.ndarray, hashes: np.ndarray, dropped: np.ndarray, out: Path | str,
                         dropped_epoch: np.ndarray | None = None, ranks_written: np.ndarray | None = None,
                         skipped: list[str] | None = None, view=None):
    """Sample set, per-sample content, seed, strategy and input-side bubbles against the input
    (per epoch with E > 1); the input digest; and (same fsdata version, one epoch) the whole plan
    recomputed from the input and the recorded settings (:func:`_check_recomputed_plan`); when that
    is not possible, a sentence saying why is appended to ``skipped``.

    ``view``: the :class:`fsdata.shards.as_input.OutputInput` of ``input_path``, when the input is
    an OUTPUT (its ``source`` is read; its ``first_epoch_mask`` gives a partial first epoch's samples)."""
    from fsdata.balancer.order import epoch_seed

    if column_map is None:
        column_map = m.settings.get("input_columns_renamed") or None
    src = open_samples(input_path, column_map) if view is None else view.source
    lengths, in_ids = src.lengths_and_ids()
    E, first_steps = m.epochs, m.epoch_first_steps()
    epoch_written = m.epoch_of_step(steps_written) if E > 1 else np.zeros(len(ids), np.int64)
    if dropped_epoch is None:
        dropped_epoch = np.zeros(len(dropped), np.int64)
    mask = None if view is None else view.first_epoch_mask
    N = len(in_ids)

    def epoch_rows(e: int) -> np.ndarray:  # the input rows epoch e holds (a partial first epoch: some)
        return np.flatnonzero(mask) if e == 0 and mask is not None else np.arange(N)

    for e in range(E):
        accounted = np.concatenate([ids[epoch_written == e], dropped[dropped_epoch == e]])
        in_e = in_ids[epoch_rows(e)]
        if len(in_e) != len(accounted) or not np.array_equal(np.sort(in_e), np.sort(accounted)):
            lost = np.setdiff1d(in_e, accounted)
            extra = np.setdiff1d(accounted, in_e)
            raise VerifyError(f"written + dropped{f' in epoch {e}' if E > 1 else ''} does not equal the input: "
                              f"{len(lost)} input samples missing (e.g. {lost[:5].tolist()}), {len(extra)} not in "
                              f"the input (e.g. {extra[:5].tolist()})")
    if len(in_ids) != m.num_samples_input:
        raise VerifyError(f"the input has {len(in_ids)} samples, "
                          f"the manifest says num_samples_input={m.num_samples_input}")
    # content: hash every input row (cast to the rank files' column types) and compare by sample_id
    from fsdata.shards.writer import output_schema

    schema = output_schema(src)
    in_schema = pa.schema([schema.field(i) for i in range(len(schema) - 2)])
    in_hash = np.empty(len(in_ids), dtype=np.uint64)
    pos = 0
    for batch in src.iter_batches(16384):
        t = pa.Table.from_batches([batch]).rename_columns(in_schema.names).cast(in_schema)
        in_hash[pos:pos + t.num_rows] = row_hashes(t)
        pos += t.num_rows
    where = np.searchsorted(np.sort(in_ids), ids)
    order = np.argsort(in_ids, kind="stable")
    differ = np.flatnonzero(in_hash[order][where] != hashes)
    if len(differ):
        raise VerifyError(f"{len(differ)} written rows differ in content from the input row of the same sample_id "
                          f"(e.g. sample_id {int(ids[differ[0]])}); rerun 'fsdata balance'")
    # seeded global batches, input-side bubbles, strategy
    R, B = m.num_ranks, m.batch_size_per_rank
    if N < R * B:
        raise VerifyError(f"the input has {N} samples, fewer than one step of {R}x{B}")
    shuffle = (m.settings or {}).get("shuffle", LEGACY_SHUFFLE)
    costs = cost_model.cost(lengths)
    from fsdata.balancer.partition import per_rank_loads

    W = recorded_compose_window(m)
    idx_of = np.argsort(in_ids, kind="stable")
    all_gsteps = []
    baseline_loads = []
    for e in range(E):
        rows_e = epoch_rows(e)
        gsteps = rows_e[shuffled_steps(len(rows_e), R, B, epoch_seed(m.seed, e), shuffle=shuffle)[0]]
        step_costs = costs[gsteps]
        baseline_ranks = np.broadcast_to(np.arange(R * B, dtype=np.int32) // B, gsteps.shape)
        baseline_loads.append(per_rank_loads(step_costs, baseline_ranks, R))
        del step_costs, gsteps
    baseline = bubble.run_bubble(np.concatenate(baseline_loads))
    if m.baseline_predicted_bubble is not None and not is_close(baseline, m.baseline_predicted_bubble):
        raise VerifyError(f"recomputed baseline_predicted_bubble {baseline:.9%} (seed {m.seed}) differs from the "
                          f"manifest's {m.baseline_predicted_bubble:.9%}")
    for e in range(E):
        seed_e = epoch_seed(m.seed, e)
        rows_e = epoch_rows(e)
        gsteps = rows_e[shuffled_steps(len(rows_e), R, B, seed_e, shuffle=shuffle)[0]]
        if m.batch_policy == "fixed":
            # every written step holds samples of the seeded global batches of its composition window
            # (W = 1: exactly the seeded global batch of that step; docs/balancer.md, "Composition")
            sel = epoch_written == e
            step_of_id = np.full(N, -1, dtype=np.int64)
            row = idx_of[np.searchsorted(in_ids[idx_of], ids[sel])]
            e0 = int(first_steps[e])
            step_of_id[row] = steps_written[sel] - e0
            expect = np.repeat(np.arange(len(gsteps)), R * B)
            bad = np.flatnonzero(step_of_id[gsteps.ravel()] // W != expect // W)
            if len(bad):
                s = int(expect[bad[0]]) + e0
                where = "step" if W == 1 else f"window of {W} steps starting at step"
                first = s - (s - e0) % W
                raise VerifyError(f"{where} {first} does not hold the seeded global batch{'es' if W > 1 else ''} of "
                                  f"seed {m.seed}{f' (epoch {e}, epoch seed {seed_e})' if E > 1 else ''}; the output "
                                  "was made with another seed or edited: rerun 'fsdata balance'")
            if m.strategy == "shuffle":
                all_gsteps.append(gsteps)
    if m.batch_policy == "fixed":
        if m.strategy == "shuffle":
            gsteps = np.concatenate(all_gsteps)
            for f in m.files:
                fs, inner = fsio.filesystem_and_path(str(out_path(out, f.path)))
                t = pq.read_table(inner, columns=[S.SAMPLE_ID], filesystem=fs)
                got = t.column(0).to_numpy().reshape(len(gsteps), B)
                want = in_ids[gsteps[:, f.rank * B:(f.rank + 1) * B]]
                if not np.array_equal(got, want):
                    raise VerifyError(f"rank {f.rank}: strategy is 'shuffle' but its per-rank batches are not the "
                                      f"seeded contiguous slices (seed {m.seed}); rerun 'fsdata balance'")
    if m.input_digest is not None:  # after the row checks, which name a lost or changed sample
        from fsdata.shards.plan_file import input_digest  # noqa: PLC0415

        got = input_digest(src)
        if got != m.input_digest:
            raise VerifyError(f"the manifest's input_digest {m.input_digest[:30]}... is not the digest of --input "
                              f"{input_path} ({got[:30]}...): the output was made from another input (or a rewritten "
                              "copy of it), or the manifest was edited: rerun 'fsdata balance' on this input")
    why = None
    if ranks_written is None:
        why = f"format_version {m.format_version} rank files carry no rank column"
    elif E > 1:
        why = f"an output of {E} epochs (the per-epoch batch checks above ran)"
    else:  # several epochs: the per-epoch checks above
        why = _check_recomputed_plan(m, src, cost_model, costs, in_ids, ids, steps_written, ranks_written, out,
                                     view)
    if why is not None and skipped is not None:
        skipped.append(f"the plan recomputed from --input (which step and rank each sample of a global batch "
                       f"takes; rows swapped between ranks of one step pass): {why}")
    return baseline


def _canon(x):
    import json  # noqa: PLC0415

    return json.loads(json.dumps(x, sort_keys=True, default=float))


def _check_recomputed_plan(m: Manifest, src, cost_model: CostModel, costs: np.ndarray, in_ids: np.ndarray,
                           ids: np.ndarray, steps_written: np.ndarray, ranks_written: np.ndarray,
                           out: Path | str, view=None) -> str | None:
    """Recompute the plan from the input and the manifest's settings (as ``fsdata balance`` made
    it) and require the output to be exactly it: every sample at its step, rank and position, and
    every recorded setting and figure (``settings`` incl. ``partition_info``, ``compose``,
    ``plan_window``, ``budget_used``; the extra figures; ``predicted_bubble``...) equal.

    Skipped for outputs of another fsdata version or shuffle, whose plans this version does not
    reproduce: then the reason is returned (verify reports it as a check it skipped), else None.

    Raises:
        VerifyError: the first difference, one line.
    """
    import logging  # noqa: PLC0415

    from fsdata._version import __version__  # noqa: PLC0415
    from fsdata.balancer.order import SHUFFLE  # noqa: PLC0415
    from fsdata.balancer.plan import plan_costs  # noqa: PLC0415
    from fsdata.shards.plan_file import plan_table_from_plan  # noqa: PLC0415
    from fsdata.shards.plan_meta import PlanMeta  # noqa: PLC0415

    st = m.settings or {}
    if m.fsdata_version != __version__ or st.get("shuffle") != SHUFFLE:
        logging.getLogger(__name__).info("plan not recomputed: %s was written by fsdata %s (this is %s)", out,
                                         m.fsdata_version, __version__)
        return (f"the manifest says fsdata {m.fsdata_version} (this is {__version__}) or shuffle "
                f"{st.get('shuffle')!r}, whose plans this version does not reproduce")
    try:
        settings = PlanMeta.from_manifest(m).plan_settings()  # the settings the plan recorded
        plan = plan_costs(costs, settings)
        table = plan_table_from_plan(src, plan, in_ids, costs, cost_model, settings)
        if view is not None:  # what a resharded output carries over (fsdata.shards.as_input)
            from fsdata.shards.as_input import record_lineage  # noqa: PLC0415

            record_lineage(table, view, out)
    except FsdataError as e:
        raise VerifyError(f"the manifest's settings do not reproduce a plan ({e}); the manifest was edited: rerun "
                          "'fsdata balance'") from None
    fix = "the output was edited or made with other settings: rerun 'fsdata balance'"
    meta = table.meta
    for key in sorted(set(meta.settings) | set(st)):
        want, got = _canon(meta.settings.get(key)), _canon(st.get(key))
        if want != got:
            raise VerifyError(f"manifest settings.{key} is {str(got)[:120]}, recomputing the plan from --input gives "
                              f"{str(want)[:120]}; {fix}")
    for key, want in meta.manifest_extra.items():
        if _canon((m.extra or {}).get(key)) != _canon(want):
            raise VerifyError(f"manifest {key} is {str((m.extra or {}).get(key))[:120]}, recomputing the plan "
                              f"gives {str(want)[:120]}; {fix}")
    for key in ("num_steps", "batch_policy", "strategy", "remainder_policy"):
        if getattr(m, key) != getattr(meta, key):
            raise VerifyError(f"manifest {key} is {getattr(m, key)!r}, recomputing the plan gives "
                              f"{getattr(meta, key)!r}; {fix}")
    for key in ("predicted_bubble", "baseline_predicted_bubble", "lower_bound_bubble"):
        got, want = getattr(m, key), getattr(meta, key)
        if (got is None) != (want is None) or (got is not None and float(got) != float(want)):  # bit for bit
            shown = [None if x is None else float(x) for x in (got, want)]
            raise VerifyError(f"manifest {key} is {shown[0]!r}, recomputing the plan gives {shown[1]!r}; {fix}")
    # every sample at the plan's step and rank, in the plan's order inside each rank file
    order = np.argsort(in_ids, kind="stable")
    row = order[np.searchsorted(in_ids[order], ids)]
    bad = np.flatnonzero((table.step[row] != steps_written) | (table.rank[row] != ranks_written))
    if len(bad):
        i = int(bad[0])
        raise VerifyError(f"sample_id {int(ids[i])} is at step {int(steps_written[i])} rank {int(ranks_written[i])}, "
                          f"the plan recomputed from --input puts it at step {int(table.step[row[i]])} rank "
                          f"{int(table.rank[row[i]])}; {fix}")
    want_key = (table.step[row].astype(np.int64) * m.num_ranks + table.rank[row]) * (len(ids) + 1) + \
        table.position[row]
    for r in range(m.num_ranks):
        sel = ranks_written == r
        k = want_key[sel]
        if len(k) > 1 and (np.diff(k) < 0).any():
            j = int(np.flatnonzero(np.diff(k) < 0)[0])
            raise VerifyError(f"rank {r}: rows {j} and {j + 1} are not in the plan's order inside their step (or "
                              f"steps); {fix}")

