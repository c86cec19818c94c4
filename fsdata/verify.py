"""``fsdata verify``: recompute the shard-format invariants from the files (docs/format.md).

Checks: manifest readable and of a known version; every rank file present with the recorded row
count and SHA-256; rows ordered by step; every rank has ``num_steps`` steps with the per-(step,
rank) counts of ``step_stats.parquet`` (``batch_size_per_rank`` each for the fixed policy);
``sample_id`` unique across ranks and equal in number to ``num_samples_written``; with
``--input``, written plus recorded drops equals the input set exactly; the predicted bubble
recomputed from the written lengths under the manifest's cost model matches the manifest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from fsdata import bubble
from fsdata import schema as S
from fsdata.balance import sha256_file
from fsdata.cost import load_cost_model
from fsdata.errors import VerifyError
from fsdata.io import open_samples, sorted_unique


def read_manifest(output: str | os.PathLike) -> dict:
    """Load and sanity-check ``OUTPUT/manifest.json``.

    Raises:
        VerifyError: missing, unparsable, wrong ``format_version``, or missing keys.
    """
    path = Path(output) / S.MANIFEST_NAME
    if not path.is_file():
        raise VerifyError(f"{path} does not exist; is {output} an 'fsdata balance' OUTPUT?")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VerifyError(f"{path} is not valid JSON ({e}); rerun 'fsdata balance'") from None
    if manifest.get("format_version") != S.FORMAT_VERSION:
        raise VerifyError(f"{path}: format_version {manifest.get('format_version')} is not supported "
                          f"(this fsdata reads {S.FORMAT_VERSION}); rerun 'fsdata balance' with this version")
    needed = ["num_ranks", "num_steps", "batch_size_per_rank", "batch_policy", "num_samples_input",
              "num_samples_written", "num_samples_dropped", "cost_model", "files", "step_stats_file"]
    missing = [k for k in needed if k not in manifest]
    if missing:
        raise VerifyError(f"{path} lacks keys {missing}; rerun 'fsdata balance'")
    return manifest


def verify(output: str | os.PathLike, input_path: str | os.PathLike | None = None, *,
           column_map: str | None = None, check_checksums: bool = True, progress: bool = False) -> dict:
    """Verify an OUTPUT; raise on the first violated invariant.

    Args:
        output: the OUTPUT folder of ``fsdata balance``.
        input_path: the balance INPUT, to check that no sample was lost or duplicated.
        column_map: ``--columns`` mapping used for the input.
        check_checksums: recompute SHA-256 of every rank file.
        progress: show a progress bar over rank files.

    Returns:
        Summary dict: ``num_ranks``, ``num_steps``, ``num_samples_written``, ``num_samples_dropped``,
        ``predicted_bubble`` (recomputed), ``baseline_predicted_bubble``, ``checked_input``.

    Raises:
        VerifyError: any violation, with the rank/step and numbers involved.
    """
    out = Path(output)
    m = read_manifest(out)
    R, steps, B = m["num_ranks"], m["num_steps"], m["batch_size_per_rank"]
    if len(m["files"]) != R or sorted(f["rank"] for f in m["files"]) != list(range(R)):
        raise VerifyError(f"manifest lists {len(m['files'])} rank files for num_ranks={R}; rerun 'fsdata balance'")
    try:
        stats = pl.read_parquet(out / m["step_stats_file"]).sort(["step", "rank"])
    except (pl.exceptions.PolarsError, OSError) as e:
        raise VerifyError(f"{out / m['step_stats_file']} is unreadable ({str(e).splitlines()[0]})") from None
    if stats.height != steps * R:
        raise VerifyError(f"step_stats has {stats.height} rows, expected num_steps*num_ranks = {steps * R}")
    expected_counts = stats["num_samples"].to_numpy().reshape(steps, R)
    if m["batch_policy"] == "fixed" and not (expected_counts == B).all():
        raise VerifyError(f"step_stats counts differ from batch_size_per_rank={B} under the fixed policy")
    cost_model = load_cost_model(m["cost_model"])
    loads = np.zeros((steps, R))
    all_ids: list[np.ndarray] = []
    for f in tqdm(sorted(m["files"], key=lambda f: f["rank"]), unit="rank", desc="verify", disable=not progress):
        r, path = f["rank"], out / f["path"]
        if not path.is_file():
            raise VerifyError(f"rank {r}: file {path} is missing")
        if check_checksums and sha256_file(path) != f["sha256"]:
            raise VerifyError(f"rank {r}: checksum of {path} differs from the manifest (file changed or corrupt)")
        try:
            t = pq.read_table(path, columns=[S.SAMPLE_ID, S.STEP, S.ITEM_IDS])
        except (pa.ArrowException, OSError) as e:
            raise VerifyError(f"rank {r}: {path} is unreadable ({str(e).splitlines()[0]})") from None
        if t.num_rows != f["num_rows"]:
            raise VerifyError(f"rank {r}: {t.num_rows} rows, manifest says {f['num_rows']}")
        step = t.column(S.STEP).to_numpy()
        if len(step) and (np.diff(step) < 0).any():
            raise VerifyError(f"rank {r}: rows are not ordered by step")
        got = np.bincount(step, minlength=steps) if len(step) else np.zeros(steps, dtype=np.int64)
        if len(got) != steps or (len(step) and (step.min() < 0 or step.max() >= steps)):
            raise VerifyError(f"rank {r}: steps outside 0..{steps - 1}")
        bad = np.flatnonzero(got != expected_counts[:, r])
        if len(bad):
            s = int(bad[0])
            raise VerifyError(f"rank {r}, step {s}: {int(got[s])} rows, expected {int(expected_counts[s, r])}; "
                              "ranks would disagree on the step count")
        lengths = pa.compute.list_value_length(t.column(S.ITEM_IDS)).to_numpy(zero_copy_only=False)
        loads[:, r] = np.bincount(step, weights=cost_model.cost(lengths), minlength=steps)
        all_ids.append(t.column(S.SAMPLE_ID).to_numpy())
    ids = np.concatenate(all_ids) if all_ids else np.empty(0, np.int64)
    if len(ids) != m["num_samples_written"]:
        raise VerifyError(f"{len(ids)} rows written, manifest says num_samples_written={m['num_samples_written']}")
    uniq, duplicates = sorted_unique(ids)
    if duplicates:
        raise VerifyError(f"{duplicates} samples appear more than once across ranks")
    dropped = np.empty(0, np.int64)
    if m.get("dropped_file"):
        dropped = pq.read_table(out / m["dropped_file"], columns=[S.SAMPLE_ID]).column(0).to_numpy()
    if len(dropped) != m["num_samples_dropped"]:
        raise VerifyError(f"{len(dropped)} dropped ids recorded, manifest says num_samples_dropped={m['num_samples_dropped']}")
    if m["num_samples_written"] + m["num_samples_dropped"] != m["num_samples_input"]:
        raise VerifyError("num_samples_written + num_samples_dropped != num_samples_input in the manifest")
    if len(dropped) and np.isin(dropped, uniq).any():
        raise VerifyError("some samples are both written and recorded as dropped")
    checked_input = False
    if input_path is not None:
        src = open_samples(input_path, column_map)
        in_ids = src.scan().select(pl.col(S.SAMPLE_ID).cast(pl.Int64)).collect(engine="streaming")[S.SAMPLE_ID].to_numpy()
        accounted = np.concatenate([uniq, dropped])
        if len(in_ids) != len(accounted) or not np.array_equal(np.sort(in_ids), np.sort(accounted)):
            lost = np.setdiff1d(in_ids, accounted)
            extra = np.setdiff1d(accounted, in_ids)
            raise VerifyError(f"written + dropped does not equal the input: {len(lost)} input samples missing "
                              f"(e.g. {lost[:5].tolist()}), {len(extra)} not in the input (e.g. {extra[:5].tolist()})")
        checked_input = True
    achieved = bubble.run_bubble(loads)
    recorded = m.get("predicted_bubble")
    if recorded is not None and abs(achieved - recorded) > 1e-9 + 1e-6 * abs(recorded):
        raise VerifyError(f"recomputed predicted bubble {achieved:.6%} differs from the manifest's {recorded:.6%}")
    return {"num_ranks": R, "num_steps": steps, "num_samples_written": int(len(ids)),
            "num_samples_dropped": int(len(dropped)), "predicted_bubble": achieved,
            "baseline_predicted_bubble": m.get("baseline_predicted_bubble"), "checked_input": checked_input}
