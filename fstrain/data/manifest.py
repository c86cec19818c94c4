"""An ``fsdata balance`` OUTPUT's manifest as fstrain reads it: validation, per-step counts, vocabulary.

Read through :class:`fsdata.shards.manifest.Manifest`, the one reader of the format (docs/format.md).
Every check here runs before any collective, so a bad OUTPUT fails every rank instead of hanging.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


from fsdata import fsio
from fsdata.samples import schema
from fsdata.shards.manifest import Manifest, ManifestError
from fsdata.errors import command, in_cli, setting
from fstrain.errors import ConfigError, ShardError, ShardMismatchError

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


def check_counts(manifest: Manifest) -> None:
    """Check a manifest's step and row counts against its files before anything is sized by them.

    With ``_step_stats.parquet``, :func:`load_step_counts` checks that file's row count
    (``num_steps x num_ranks``) before it allocates; nothing to do here. Under ``fixed`` without
    it, every rank file holds ``num_steps x batch_size_per_rank`` rows; the manifest's
    ``num_rows`` of every rank must say so, and rank 0's file's Parquet footer must hold that many
    rows (one footer read). ``num_ranks`` is already bounded by the manifest's file entries
    (:meth:`fsdata.shards.manifest.Manifest.from_json`), so an ``[S x R]`` array sized by these
    counts is no larger than ``R / batch_size_per_rank`` times rank 0's real row count.

    Raises:
        ShardError: under ``fixed`` without step stats, a ``num_rows`` that is not ``num_steps x
            batch_size_per_rank``, or rank 0's file missing, unreadable or holding another row count.
    """
    if manifest.batch_policy != "fixed" or fsio.exists(manifest.step_stats_path()):
        return
    S, B = manifest.num_steps, manifest.batch_size_per_rank
    for f in manifest.files:
        if f.num_rows != S * B:
            raise ShardError(f"{manifest.path}: rank {f.rank} has num_rows {f.num_rows} but batch_policy fixed needs "
                             f"num_steps {S} x batch_size_per_rank {B} = {S * B}; the manifest does not describe "
                             "its files: re-run fsdata balance")
    path = manifest.rank_file(0)
    try:
        fs, where = fsio.filesystem_and_path(path)
        rows = pq.read_metadata(where, filesystem=fs).num_rows
    except FileNotFoundError:
        raise ShardError(f"rank 0: {path} not found; re-run fsdata balance or copy the whole OUTPUT") from None
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"rank 0: {path} is truncated or corrupt ({str(e).splitlines()[0]}); "
                         "re-run fsdata balance") from None
    if rows != S * B:
        raise ShardError(f"rank 0: {path} has {rows} rows but the manifest of {manifest.path} says num_steps {S} x "
                         f"batch_size_per_rank {B} = {S * B}; the manifest does not describe its files: "
                         "re-run fsdata balance")


def load_step_counts(manifest: Manifest) -> np.ndarray:
    """Per-(step, rank) sample counts.

    Under ``fixed`` every entry is ``batch_size_per_rank``; under ``cost-budget`` they come from
    ``_step_stats.parquet``.

    Args:
        manifest: a loaded manifest.

    Returns:
        shape ``[S x R]``, int64.

    Every count is checked against the files before the array is allocated: the step stats' row
    count (``num_steps x num_ranks`` rows), or under ``fixed`` without step stats the rank files'
    row counts (:func:`check_counts`).

    Raises:
        ShardError: ``_step_stats.parquet`` is missing, unreadable, or does not cover every
            (step, rank) exactly once with at least one sample; under ``fixed`` without step stats,
            counts that disagree with the rank files.
    """
    S, R = manifest.num_steps, manifest.num_ranks
    stats_path = manifest.step_stats_path()
    if manifest.batch_policy == "fixed" and not fsio.exists(stats_path):
        check_counts(manifest)  # S and R are untrusted: checked against the files before allocating
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



#: Parquet key-value metadata keys (JSON) of ``fsdata convert``'s outputs that may record ``num_items``,
#: in the order they are read from an evaluation file (docs/format.md).
EVAL_META_KEYS = (b"freescale.holdout", b"freescale.convert")


def recorded_num_items(manifest: Manifest) -> int | None:
    """The ``num_items`` the manifest records (``fsdata convert`` -> ``fsdata balance``), or None."""
    v = manifest.extra.get("num_items")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise ShardError(f"{manifest.path}: num_items must be an integer >= 2, got {v!r}; re-run fsdata balance, "
                         "or pass --num-items")
    return v


def recorded_num_items_of(shards: str | None, eval_path: str) -> int | None:
    """``num_items`` recorded by the manifest of ``shards`` (e.g. a checkpoint's recorded shards),
    else by the evaluation file's metadata (:func:`eval_file_num_items`); None if neither records it
    (shards that moved or are gone are skipped)."""
    if shards:
        try:
            n = recorded_num_items(load_manifest(shards))
        except ShardError:
            n = None
        if n is not None:
            return n
    return eval_file_num_items(eval_path) if os.path.isfile(eval_path) else None


def eval_file_num_items(path: str) -> int | None:
    """The ``num_items`` an evaluation file's Parquet metadata records: ``freescale.holdout``'s, else
    ``freescale.convert``'s ``num_items`` (``fsdata convert`` writes them); None when neither does.

    Raises:
        ShardError: the file is missing or not Parquet, or a recorded value is not an integer >= 2.
    """
    try:
        meta = pq.read_schema(path).metadata or {}
    except FileNotFoundError:
        raise ShardError(f"evaluation file {path} not found; write one with "
                         "`fsdata convert ... --holdout last --holdout-output EVAL.parquet`") from None
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"evaluation file {path} is not readable Parquet ({str(e).splitlines()[0]}); "
                         "re-create it with fsdata convert --holdout last") from None
    for key in EVAL_META_KEYS:
        try:
            v = json.loads(meta[key]).get("num_items") if key in meta else None
        except (ValueError, AttributeError):
            v = None
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise ShardError(f"evaluation file {path}: {key.decode()} num_items must be an integer >= 2, "
                                 f"got {v!r}; re-create it with fsdata convert, or pass --num-items")
            return v
    return None


def eval_file_max_item_id(path: str) -> int:
    """Largest item id in an evaluation file's histories and targets (-1 when it has no rows).

    Raises:
        ShardError: unreadable file or missing ``item_ids`` / ``target_item_id`` columns.
    """
    try:
        t = pq.read_table(path, columns=[schema.ITEM_IDS, schema.TARGET_ITEM_ID])
    except (OSError, pa.ArrowException, KeyError) as e:
        raise ShardError(f"evaluation file {path} is unreadable or lacks item_ids / target_item_id "
                         f"({str(e).splitlines()[0]}); re-create it with fsdata convert --holdout last") from None
    import pyarrow.compute as pc  # noqa: PLC0415

    hist = pc.max(t.column(schema.ITEM_IDS).combine_chunks().flatten()).as_py()
    tgt = pc.max(t.column(schema.TARGET_ITEM_ID)).as_py()
    return int(max(-1 if hist is None else hist, -1 if tgt is None else tgt))


def resolve_num_items(manifest: Manifest, eval_path: str | None = None) -> tuple[int, str]:
    """The item table size a model trained on these shards needs, and where it came from.

    In order: the manifest's ``num_items`` (recorded by ``fsdata convert``, carried by ``fsdata
    balance``); the evaluation file's metadata (:func:`eval_file_num_items`); else inferred as
    ``max id + 1`` over the shards (:func:`infer_num_items`) *and* the evaluation file's histories
    and targets, so an item seen only as a held-out target still has a row. ``--num-items`` is
    applied by the caller, before this.

    Args:
        manifest: the shards' manifest.
        eval_path: the evaluation file (``--eval-data``), or None.

    Returns:
        ``(num_items, source)``; ``source`` is ``"manifest"``, ``"evaluation file metadata"`` or
        ``"inferred"``.

    Raises:
        ShardError: a recorded value is malformed, or the statistics needed to infer it are missing.
    """
    n = recorded_num_items(manifest)
    if n is not None:
        return n, "manifest"
    if eval_path:
        n = eval_file_num_items(eval_path)
        if n is not None:
            return n, "evaluation file metadata"
    n = infer_num_items(manifest)
    if eval_path:
        n = max(n, eval_file_max_item_id(eval_path) + 1)
    return n, "inferred"


def check_eval_ids(eval_path: str, num_items: int, source: str) -> None:
    """Refuse an evaluation file whose item ids do not fit a model of ``num_items`` rows.

    Raises:
        ConfigError: an item id in the evaluation file is ``>= num_items`` (the line names both,
            where ``num_items`` came from, and the fix).
    """
    hi = eval_file_max_item_id(eval_path)
    if hi >= num_items:
        raise ConfigError(f"evaluation file {eval_path} has item id {hi} but the model has num_items {num_items} "
                          f"({source}); the evaluation data and the shards come from different conversions: "
                          f"convert both with the same fsdata convert run, or pass --num-items {hi + 1}")


def check_feature_column(arrow_schema: pa.Schema, name: str, where: str) -> None:
    """Refuse a feature column that cannot be an action input: missing, or not a list of integers.

    Raises:
        ShardError: naming the column, what ``where`` has, and the fix.
    """
    if name not in arrow_schema.names:
        raise ShardError(f"{where} has no feature column {name!r} (it has {arrow_schema.names}); convert with "
                         f"fsdata convert --feature-cols {name}, or pass --action-column none")
    t = arrow_schema.field(name).type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)):
        raise ShardError(f"{where}: feature column {name!r} is {t}, but an action input needs a list of integer "
                         "codes aligned with item_ids; pass --action-column none or another column")


def feature_columns(manifest: Manifest) -> list[str]:
    """The manifest's ``feature_columns`` (``fsdata convert --feature-cols``): list columns of the
    rank files aligned with ``item_ids``; ``[]`` when it lists none."""
    v = manifest.extra.get("feature_columns") or []
    return [str(c) for c in v] if isinstance(v, list) else []


def resolve_action_column(manifest: Manifest, by_default: bool, requested: str | None) -> str | None:
    """The feature column a model reads as its action input (``Config.action_column``).

    ``"none"``: None. A named column: checked in rank 0's file (:func:`check_feature_column`).
    ``None``: for a model family that reads actions ``by_default`` (its block class's
    ``actions_by_default``: ``hstu``), the manifest's feature column ``action`` if listed, else its
    first feature column holding integer lists; None for the others (``sasrec``) or when there is none.

    Raises:
        ShardError: a named column is missing or not a list of integers.
    """
    if requested == "none" or (requested is None and not by_default):
        return None
    path = manifest.rank_file(0)
    try:
        arrow_schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"rank 0: {path} is unreadable ({str(e).splitlines()[0]}); re-run fsdata balance") from None
    if requested is not None:
        check_feature_column(arrow_schema, requested, f"rank 0: {path}")
        return requested
    listed = feature_columns(manifest)
    for name in (["action"] if "action" in listed else []) + listed:
        t = arrow_schema.field(name).type if name in arrow_schema.names else None
        if t is not None and (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
            return name
    return None


def infer_num_codes(manifest: Manifest, column: str) -> int:
    """Rows an embedding table of list column ``column`` needs: ``max code + 1`` over every rank
    file, from the Parquet footers' statistics (no data read; every rank gets the same answer).

    Raises:
        ShardError: a file is unreadable, or has no statistics or a negative code in ``column``.
    """
    hi, leaf = -1, f"{column}.list.element"
    for r in range(manifest.num_ranks):
        path = manifest.rank_file(r)
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise ShardError(f"rank {r}: {path} is unreadable ({str(e).splitlines()[0]}); "
                             "re-run fsdata balance") from None
        md = pf.metadata
        idx = [j for j in range(md.num_columns) if pf.schema.column(j).path == leaf]
        for g in range(md.num_row_groups):
            for j in idx:
                st = md.row_group(g).column(j).statistics
                if md.row_group(g).column(j).num_values == 0:
                    continue
                if st is None or not st.has_min_max:
                    raise ShardError(f"{path}: no min/max statistics on {leaf}; pass --num-actions explicitly")
                if int(st.min) < 0:
                    raise ShardError(f"{path}: {column} has negative code {int(st.min)}; action codes must be >= 0")
                hi = max(hi, int(st.max))
    return max(hi + 1, 1)


def max_history_length(manifest: Manifest) -> int | None:
    """The longest history over every rank file, from the footer statistics of ``seq_len``
    (``fsdata convert`` writes it); None when a file has no such column or statistics."""
    hi = 0
    for r in range(manifest.num_ranks):
        try:
            pf = pq.ParquetFile(manifest.rank_file(r))
        except (OSError, pa.ArrowException):
            return None  # the reader names the broken file
        md = pf.metadata
        idx = [j for j in range(md.num_columns) if pf.schema.column(j).path == schema.SEQ_LEN]
        if not idx:
            return None
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(idx[0]).statistics
            if md.row_group(g).num_rows and (st is None or not st.has_min_max):
                return None
            hi = max(hi, int(st.max)) if md.row_group(g).num_rows else hi
    return hi


def steps_per_epoch(manifest: Manifest) -> int:
    """Steps of one epoch of the shards (``fsdata balance --epochs``; one epoch: every step)."""
    return int(manifest.steps_per_epoch)
