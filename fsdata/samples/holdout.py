"""Leave-one-out held-out data for ``fsdata convert --holdout last`` (docs/format.md, "Evaluation file").

As in SASRec (Kang & McAuley 2018, ``data_partition``) and BERT4Rec (Sun et al. 2019), the last
interaction of each user is held out: it is removed from the user's sequence *before* training
samples are built, so no training sample has it as a target nor in a history; the evaluation file
holds, per held-out user, the history before it (the ``max_seq_len`` most recent items) and
``target_item_id`` = the held-out item. Users with fewer than :data:`MIN_ITEMS_FOR_HOLDOUT` items
are kept whole in training and not evaluated (SASRec's rule: with 2 items, holding one out would
leave no training sample for that user).

Evaluation file schema (one row per held-out user, in user order of the input):
``user_id`` int64, ``item_ids`` list<int64> (chronological history, at most ``max_seq_len``),
``target_item_id`` int64, ``seq_len`` int32 (``len(item_ids)``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.samples import schema as S
from fsdata.atomic import atomic_output
from fsdata.errors import ConfigError

HOLDOUT_MODES = ("none", "last")
#: Users with fewer items stay whole in training (SASRec's ``data_partition`` rule).
MIN_ITEMS_FOR_HOLDOUT = 3
#: Parquet key-value metadata key of the evaluation file's summary.
HOLDOUT_META_KEY = b"freescale.holdout"


@dataclass(kw_only=True, slots=True)
class HoldoutSummary:
    """What a leave-one-out split held out (stored in the evaluation file's metadata)."""

    holdout: str
    max_seq_len: int
    num_users_evaluated: int
    """Users with a held-out item (rows of the evaluation file)."""
    num_users_kept_whole: int
    """Users with fewer than ``MIN_ITEMS_FOR_HOLDOUT`` items: all their items stay in training."""
    num_items_truncated: int
    """History items cut by ``max_seq_len`` summed over evaluation rows."""


def check_holdout_args(holdout: str, holdout_output: str | os.PathLike | None) -> None:
    """Validate the ``--holdout`` / ``--holdout-output`` pair.

    Raises:
        ConfigError: unknown mode, ``last`` without an output, or an output without ``last``.
    """
    if holdout not in HOLDOUT_MODES:
        raise ConfigError(f"unknown --holdout '{holdout}'; use one of {', '.join(HOLDOUT_MODES)}")
    if holdout == "last" and not holdout_output:
        raise ConfigError("--holdout last needs --holdout-output EVAL.parquet (where the held-out items go)")
    if holdout == "none" and holdout_output:
        raise ConfigError("--holdout-output is set but --holdout is 'none'; pass --holdout last")


def split_last(users: pl.DataFrame, max_seq_len: int,
               features: dict[str, pa.DataType] | None = None) -> tuple[pl.DataFrame, pa.Table, HoldoutSummary]:
    """Hold out each user's last item.

    Args:
        users: ``user_id`` int64, ``item_ids`` list<int64> chronological, optional ``timestamps``
            list<int64> (as returned by :func:`fsdata.samples.convert.read_sequences` / ``read_events``).
        max_seq_len: keep at most this many most recent history items in the evaluation rows.
        features: list columns of ``users`` aligned with ``item_ids`` (``--feature-cols``): cut like the
            history, in training and in the evaluation rows.

    Returns:
        ``(train_users, eval_table, summary)``: ``train_users`` has the same columns with the last
        item (and timestamp) removed for every evaluated user; ``eval_table`` follows
        :func:`eval_schema`.
    """
    n = users["item_ids"].list.len()
    held = n >= MIN_ITEMS_FOR_HOLDOUT
    ev = users.filter(held).select(
        pl.col("user_id").cast(pl.Int64),
        pl.col("item_ids").list.slice(0, pl.col("item_ids").list.len() - 1).list.tail(max_seq_len).alias("item_ids"),
        pl.col("item_ids").list.last().cast(pl.Int64).alias("target_item_id"),
        (pl.col("item_ids").list.len() - 1).alias("_full"),
        *[pl.col(f).list.slice(0, pl.col(f).list.len() - 1).list.tail(max_seq_len) for f in features or {}])
    ev = ev.with_columns(pl.col("item_ids").list.len().cast(pl.Int32).alias("seq_len"))
    truncated = int((ev["_full"] - ev["seq_len"].cast(pl.Int64)).sum()) if ev.height else 0
    drop = [c for c in ("item_ids", "timestamps", *(features or {})) if c in users.columns]
    train = users.with_columns([
        pl.when(held).then(pl.col(c).list.slice(0, pl.col(c).list.len() - 1)).otherwise(pl.col(c)).alias(c)
        for c in drop])
    table = pa.table({
        S.USER_ID: pa.array(ev["user_id"].to_numpy(), pa.int64()),
        S.ITEM_IDS: ev["item_ids"].to_arrow().cast(pa.list_(pa.int64())),
        S.TARGET_ITEM_ID: pa.array(ev["target_item_id"].to_numpy(), pa.int64()),
        S.SEQ_LEN: pa.array(ev["seq_len"].to_numpy(), pa.int32()),
        **{f: ev[f].to_arrow().cast(pa.list_(t)) for f, t in (features or {}).items()},
    }, schema=eval_schema(features))
    summary = HoldoutSummary(holdout="last", max_seq_len=max_seq_len, num_users_evaluated=ev.height,
                             num_users_kept_whole=int((~held).sum()), num_items_truncated=truncated)
    return train, table, summary


def eval_schema(features: dict[str, pa.DataType] | None = None) -> pa.Schema:
    """Arrow schema of the evaluation file (module docstring), then the feature lists (``--feature-cols``)."""
    return pa.schema([(S.USER_ID, pa.int64()), (S.ITEM_IDS, pa.list_(pa.int64())),
                      (S.TARGET_ITEM_ID, pa.int64()), (S.SEQ_LEN, pa.int32()),
                      *[(f, pa.list_(t)) for f, t in (features or {}).items()]])


def write_eval_file(table: pa.Table, path: str | os.PathLike, summary: HoldoutSummary, *, overwrite: bool) -> None:
    """Write the evaluation table atomically with ``summary`` in its Parquet metadata.

    Raises:
        ConfigError: ``path`` exists and ``overwrite`` is False.
    """
    meta = {HOLDOUT_META_KEY: json.dumps(asdict(summary)).encode()}
    with atomic_output(path, overwrite=overwrite, is_dir=False, kind="eval") as tmp:
        pq.write_table(table.replace_schema_metadata(meta), str(tmp), compression="zstd")


class EvalSpool:
    """Evaluation rows gathered chunk by chunk in a temporary Parquet file, then written as the evaluation
    file in bounded pieces (the evaluation file of a large log does not fit in memory).

    Args:
        spool_path: a local temporary file (the caller removes its folder).
    """

    #: Rows per row group of the evaluation file (``pq.write_table``'s default, so small files are the bytes
    #: :func:`write_eval_file` writes).
    ROWS_PER_GROUP = 1 << 20

    def __init__(self, spool_path: str | os.PathLike, features: dict[str, pa.DataType] | None = None) -> None:
        self._path = str(spool_path)
        self._schema = eval_schema(features)
        self._writer = pq.ParquetWriter(self._path, self._schema, compression="lz4")
        self.num_rows = 0

    def add(self, table: pa.Table) -> None:
        """Append rows (:func:`eval_schema`)."""
        if table.num_rows:
            self._writer.write_table(table)
            self.num_rows += table.num_rows

    def write(self, path: str | os.PathLike, summary: HoldoutSummary, *, overwrite: bool,
              max_items: int = 1 << 24, num_items: int | None = None) -> None:
        """Write the gathered rows to ``path`` atomically, ``summary`` in the metadata; row groups of
        :attr:`ROWS_PER_GROUP` rows, fewer where they would hold more than ``max_items`` history items.

        Raises:
            ConfigError: ``path`` exists and ``overwrite`` is False.

        ``num_items`` (the embedding-table size over training and held-out data) joins the summary in the
        metadata when given.
        """
        self._writer.close()
        extra = {} if num_items is None else {"num_items": int(num_items)}
        meta = {HOLDOUT_META_KEY: json.dumps({**asdict(summary), **extra}).encode()}
        schema = self._schema.with_metadata(meta)
        lf = pl.scan_parquet(self._path)
        lengths = lf.select(pl.col(S.SEQ_LEN).cast(pl.Int64)).collect()[S.SEQ_LEN].to_numpy() \
            if self.num_rows else np.zeros(0, np.int64)
        cum = np.cumsum(lengths)
        with atomic_output(path, overwrite=overwrite, is_dir=False, kind="eval") as tmp:
            with pq.ParquetWriter(str(tmp), schema, compression="zstd") as writer:
                a = 0
                while True:
                    done = int(cum[a - 1]) if a else 0
                    b = min(len(lengths), a + self.ROWS_PER_GROUP,
                            max(a + 1, int(np.searchsorted(cum, done + max_items, side="right"))))
                    piece = lf.slice(a, b - a).collect().to_arrow() if b > a else self._schema.empty_table()
                    writer.write_table(piece.cast(schema))
                    a = b
                    if a >= len(lengths):
                        break
