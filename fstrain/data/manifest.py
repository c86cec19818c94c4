"""An ``fsdata balance`` OUTPUT's manifest as fstrain reads it: validation, per-step counts, vocabulary.

Read through :class:`fsdata.shards.manifest.Manifest`, the one reader of the format (docs/format.md).
Every check here runs before any collective, so a bad OUTPUT fails every rank instead of hanging.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


from fsdata import fsio
from fsdata.samples import schema
from fsdata.shards.manifest import Manifest, ManifestError
from fsdata.errors import command, in_cli, setting
from fstrain.errors import ShardError, ShardMismatchError

logger = logging.getLogger(__name__)

_READ_COLUMNS = [schema.STEP, schema.SAMPLE_ID, schema.ITEM_IDS, schema.TARGET_ITEM_ID]
#: Parquet key-value metadata key of the plan digest every rank file carries (docs/format.md).
PLAN_DIGEST_KEY = b"fsdata.plan_digest"


def file_plan_digest(pf: pq.ParquetFile) -> str | None:
    """The ``fsdata.plan_digest`` of an open rank file (``None``: an output written before it was recorded)."""
    raw = (pf.schema_arrow.metadata or {}).get(PLAN_DIGEST_KEY)
    return raw.decode("utf-8", "replace") if raw is not None else None


def plan_digest(manifest: Manifest) -> str | None:
    """The plan digest of an OUTPUT: the manifest's ``plan_digest`` key, else rank 0's file's
    ``fsdata.plan_digest`` key-value metadata (one footer read); ``None`` when neither records it.

    Raises:
        ShardError: rank 0's file is missing or unreadable.
    """
    key = manifest.extra.get("plan_digest")
    if isinstance(key, str):
        return key
    path = manifest.rank_file(0)
    try:
        fs, where = fsio.filesystem_and_path(path)
        md = pq.read_schema(where, filesystem=fs).metadata or {}
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"rank 0: {path} is missing, truncated or corrupt ({e}); re-run fsdata balance") from None
    raw = md.get(PLAN_DIGEST_KEY)
    return raw.decode("utf-8", "replace") if raw is not None else None


def resharded_from(manifest: Manifest) -> dict | None:
    """The manifest's ``resharded_from`` lineage (``{"plan_digest": str, "from_step": int}``: written by
    ``fsdata balance OLD NEW --from-step S``), or ``None``.

    Raises:
        ShardError: the key is present but malformed.
    """
    raw = manifest.extra.get("resharded_from")
    if raw is None:
        return None
    if (not isinstance(raw, dict) or not isinstance(raw.get("plan_digest"), str)
            or not isinstance(raw.get("from_step"), int) or isinstance(raw.get("from_step"), bool)
            or raw["from_step"] < 0):
        raise ShardError(f"{manifest.path}: resharded_from must be {{\"plan_digest\": str, \"from_step\": int >= 0}}, "
                         f"got {raw!r}; re-run fsdata balance")
    return {"plan_digest": raw["plan_digest"], "from_step": raw["from_step"]}


def load_manifest(shards_dir: str) -> Manifest:
    """Read and validate an OUTPUT's manifest (``_manifest.json``; v1 ``manifest.json``) with
    :meth:`fsdata.shards.manifest.Manifest.read`, the one reader of the format.

    Args:
        shards_dir: an ``fsdata balance`` OUTPUT folder.

    Returns:
        The parsed :class:`fsdata.shards.manifest.Manifest` (``files[r].path`` / ``.num_rows``,
        :meth:`~fsdata.shards.manifest.Manifest.rank_file`).

    Raises:
        ShardError: missing, unreadable or malformed manifest, or a rank without a file.
        ShardMismatchError: a ``format_version`` this fstrain does not read.
    """
    try:
        m = Manifest.read(shards_dir)
    except ManifestError as e:
        if e.kind == "version":
            raise ShardMismatchError(f"{e}") from None
        raise ShardError(str(e)) from None
    if m.predicted_bubble is None:
        m.predicted_bubble = float("nan")
    return m


def _step_rank_matrix(manifest: Manifest, column: str) -> np.ndarray:
    """One ``_step_stats.parquet`` column as a ``[S x R]`` int64 matrix, every (step, rank) once.

    Raises:
        ShardError: the file is missing or unreadable, lacks ``column``, or does not cover every
            (step, rank) exactly once.
    """
    S, R = manifest.num_steps, manifest.num_ranks
    stats_path = manifest.step_stats_path()
    try:
        t = manifest.read_step_stats(columns=["step", "rank", column])
    except ManifestError as e:
        raise ShardError(str(e)) from None
    step = t.column("step").to_numpy().astype(np.int64)
    rank = t.column("rank").to_numpy().astype(np.int64)
    if len(step) != S * R or step.min(initial=0) < 0 or step.max(initial=0) >= S or rank.max(initial=0) >= R:
        raise ShardError(f"{stats_path}: {len(step)} rows but num_steps {S} x num_ranks {R} = {S * R} "
                         "(one per step and rank) expected; re-run fsdata balance")
    out = np.zeros((S, R), dtype=np.int64)
    out[step, rank] = t.column(column).to_numpy().astype(np.int64)
    return out


def load_step_counts(manifest: Manifest) -> np.ndarray:
    """Per-(step, rank) sample counts.

    Under ``fixed`` every entry is ``batch_size_per_rank``; under ``cost-budget`` they come from
    ``_step_stats.parquet``.

    Args:
        manifest: a loaded manifest.

    Returns:
        shape ``[S x R]``, int64.

    Raises:
        ShardError: ``_step_stats.parquet`` is missing, unreadable, or does not cover every
            (step, rank) exactly once with at least one sample.
    """
    S, R = manifest.num_steps, manifest.num_ranks
    stats_path = manifest.step_stats_path()
    if manifest.batch_policy == "fixed" and not fsio.exists(stats_path):
        return np.full((S, R), manifest.batch_size_per_rank, dtype=np.int64)
    counts = _step_rank_matrix(manifest, "num_samples")
    if (counts < 1).any():
        s, r = map(int, np.argwhere(counts < 1)[0])
        raise ShardError(f"{stats_path}: step {s} rank {r} has {counts[s, r]} samples (at least 1 required); "
                         "re-run fsdata balance")
    return counts


def load_step_tokens(manifest: Manifest) -> np.ndarray | None:
    """Per-(step, rank) history tokens: the ``num_tokens`` column of ``_step_stats.parquet`` (the sum
    of the samples' ``seq_len`` = ``len(item_ids)``; written since fsdata 0.3).

    Args:
        manifest: a loaded manifest (local or object-store OUTPUT).

    Returns:
        shape ``[S x R]``, int64; None when the output predates the column (or has no step stats).

    Raises:
        ShardError: the step stats are unreadable or do not cover every (step, rank) exactly once.
    """
    stats_path = manifest.step_stats_path()
    if not fsio.exists(stats_path):
        return None
    try:
        fs, where = fsio.filesystem_and_path(stats_path)
        names = pq.read_schema(where, filesystem=fs).names
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"{stats_path} is unreadable ({e}); re-run fsdata balance") from None
    if "num_tokens" not in names:
        return None
    return _step_rank_matrix(manifest, "num_tokens")


def check_world_size(manifest: Manifest, world_size: int) -> None:
    """Raise :class:`ShardMismatchError` unless the shards were written for ``world_size`` ranks."""
    if world_size != manifest.num_ranks:
        n = manifest.num_ranks
        launch = (f"launch with {setting('world_size', n)} (or nodes x procs = {n})" if in_cli() else
                  f"launch {n} processes and pass {setting('world_size', n, owner=None)}")
        raise ShardMismatchError(
            f"{manifest.path} was written for {n} ranks but this job has world size {world_size}; {launch} or "
            f"re-run {command('balance')} with {setting('num_ranks', world_size)}")


def infer_num_items(manifest: Manifest) -> int:
    """Size of the item vocabulary (``max id + 1``) from the Parquet footers of every rank file.

    Reads only footers (column statistics of ``item_ids`` elements and ``target_item_id``), so it
    is cheap and gives every rank the same answer.

    Returns:
        ``max(item id) + 1`` over all rank files.

    Raises:
        ShardError: a file has no statistics for those columns (pass ``--num-items`` instead).
    """
    hi = -1
    for r in range(manifest.num_ranks):
        path = manifest.rank_file(r)
        try:
            pf = pq.ParquetFile(path)
        except FileNotFoundError:
            raise ShardError(f"rank {r}: {path} is missing; the OUTPUT is incomplete: copy the whole OUTPUT "
                             "or re-run fsdata balance") from None
        except (OSError, pa.ArrowException) as e:
            raise ShardError(f"rank {r}: {path} is truncated or corrupt ({e}); re-run fsdata balance") from None
        md = pf.metadata
        idx = [j for j in range(md.num_columns)
               if pf.schema.column(j).path in (schema.TARGET_ITEM_ID, f"{schema.ITEM_IDS}.list.element")]
        for g in range(md.num_row_groups):
            for j in idx:
                st = md.row_group(g).column(j).statistics
                if st is None or not st.has_min_max:
                    raise ShardError(f"{path}: no min/max statistics on {pf.schema.column(j).path}; "
                                     "pass --num-items explicitly")
                hi = max(hi, int(st.max))
    return hi + 1



def steps_per_epoch(manifest: Manifest) -> int:
    """Steps of one epoch of the shards (``fsdata balance --epochs``; one epoch: every step)."""
    return int(manifest.steps_per_epoch)
