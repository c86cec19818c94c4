"""One vocabulary of user and item ids: original ids <-> dense int64 indices (docs/fsdata.md, "Bringing your data").

``fsdata convert`` maps string ids (always) and integer ids (with ``--remap-ids``, or ``--vocab``) to
indices from 1; index 0 stays free for padding (SASRec, HSTU). The mapping is written beside the
output as the folder ``OUTPUT.vocab/``:

* ``items.parquet`` and ``users.parquet``: ``id`` (the original id: string or int64), ``index``
  (int64, from 1, dense, rows in index order), ``count`` (int64, events of this id in the converted
  input, training and held-out; 0 for an id known only from ``--vocab``).

With ``--vocab DIR`` (an earlier vocabulary, read and never modified) every id it knows keeps its
index, ids new to it are appended in order of first appearance in the input, nothing is renumbered,
and the same inputs give the same bytes.

The mapping is built with Polars (a streaming group-by for first appearance and counts, joins to
encode), never a per-row Python loop.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from fsdata.atomic import register_output_kind
from fsdata.errors import InputError

#: Suffix of the vocabulary folder written beside a convert output (``train.parquet.vocab/``).
VOCAB_SUFFIX = ".vocab"
ITEMS_FILE = "items.parquet"
USERS_FILE = "users.parquet"
#: ``kind`` -> file name.
FILES = {"item": ITEMS_FILE, "user": USERS_FILE}


def _is_vocab_folder(path: str) -> bool:
    """Whether the existing folder ``path`` is a vocabulary ``fsdata convert`` wrote: it holds only
    ``items.parquet`` / ``users.parquet``, each a Parquet file with the columns ``id``, ``index``,
    ``count`` (the ownership rule of ``--overwrite``, :func:`fsdata.atomic.check_replaceable`)."""
    from fsdata import fsio  # noqa: PLC0415

    try:
        names = fsio.list_dir(path)
    except OSError:
        return False
    if not names or any(is_dir or n not in FILES.values() for n, is_dir in names):
        return False
    for n, _ in names:
        try:
            cols = set(fsio.read_parquet_metadata(fsio.join(path, n)).schema.to_arrow_schema().names)
        except Exception:  # noqa: BLE001 - not Parquet, unreadable: not ours
            return False
        if not {"id", "index", "count"} <= cols:
            return False
    return True


register_output_kind("vocab", "a vocabulary fsdata convert wrote (items.parquet / users.parquet only)",
                     _is_vocab_folder, folder=True)


def vocab_dir_for(output: str | os.PathLike) -> Path:
    """The vocabulary folder of a convert output: ``OUTPUT.vocab``."""
    return Path(f"{os.fspath(output)}{VOCAB_SUFFIX}")


def _empty(dtype: pl.DataType) -> pl.DataFrame:
    return pl.DataFrame(schema={"id": dtype, "index": pl.Int64, "count": pl.Int64})


@dataclass(slots=True)
class Vocabulary:
    """Users' and items' original ids and their dense indices.

    Attributes:
        items: ``id`` (String or Int64), ``index`` Int64 (from 1), ``count`` Int64; rows in index order.
        users: the same for users.
        path: the folder it was read from, if any.
    """

    items: pl.DataFrame
    users: pl.DataFrame
    path: Path | None = None

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Vocabulary":
        """Read a vocabulary folder (``items.parquet``, ``users.parquet``).

        Raises:
            InputError: the folder or a file is missing or not a vocabulary.
        """
        p = Path(path)
        frames = {}
        for kind, name in FILES.items():
            f = p / name
            if not f.is_file():
                raise InputError(f"vocabulary {p} has no {name}; pass the OUTPUT.vocab folder an earlier "
                                 "'fsdata convert' wrote")
            try:
                df = pl.read_parquet(f)
            except (pl.exceptions.PolarsError, OSError) as e:
                raise InputError(f"vocabulary file {f} is not readable Parquet ({str(e).splitlines()[0]}); "
                                 "regenerate it with 'fsdata convert'") from None
            if df.columns != ["id", "index", "count"] or df.schema["index"] != pl.Int64:
                raise InputError(f"vocabulary file {f} has columns {df.columns}; expected id, index, count")
            frames[kind] = df
        return cls(items=frames["item"], users=frames["user"], path=p)

    def _table(self, kind: str) -> pl.DataFrame:
        if kind not in FILES:
            raise ValueError(f"kind must be 'item' or 'user', got {kind!r}")
        return self.items if kind == "item" else self.users

    @property
    def num_items(self) -> int:
        """Embedding-table size of the items: largest index + 1 (0 is padding)."""
        return int(self.items["index"].max() or 0) + 1

    def encode(self, ids, kind: str = "item", *, strict: bool = True) -> np.ndarray:
        """Original ids -> indices.

        Args:
            ids: a sequence / array / Series of original ids (strings or integers, as the vocabulary holds).
            kind: ``"item"`` or ``"user"``.
            strict: raise on an unknown id; when False an unknown id gets index 0 (padding).

        Returns:
            int64 array of shape ``[len(ids)]``.

        Raises:
            InputError: (``strict``) an id the vocabulary does not know; the message names the first.
        """
        t = self._table(kind)
        s = pl.Series("id", ids).cast(t.schema["id"], strict=False)
        out = pl.DataFrame({"id": s}).join(t.select("id", "index"), on="id", how="left", maintain_order="left")
        if strict and out["index"].null_count():
            first = out.filter(pl.col("index").is_null())["id"][0]
            raise InputError(f"{kind} id {first!r} is not in the vocabulary; pass strict=False to map unknown ids to 0")
        return out["index"].fill_null(0).to_numpy().astype(np.int64, copy=False)

    def decode(self, indices, kind: str = "item") -> list:
        """Indices -> original ids (index 0 and unknown indices give None).

        Args:
            indices: a sequence / array of int indices, any shape flattened to ``[N]``.
            kind: ``"item"`` or ``"user"``.

        Returns:
            A list of ``N`` original ids (str or int).
        """
        t = self._table(kind)
        s = pl.Series("index", np.asarray(indices, dtype=np.int64).ravel())
        return pl.DataFrame({"index": s}).join(t.select("id", "index"), on="index", how="left",
                                               maintain_order="left")["id"].to_list()

    def write(self, folder: str | os.PathLike) -> str:
        """Write ``items.parquet`` and ``users.parquet`` into ``folder`` (deterministic bytes).

        Returns:
            The content digest ``sha256:<hex>`` (of both files' bytes, items first).
        """
        h = hashlib.sha256()
        for kind, name in FILES.items():
            f = Path(folder) / name
            pq.write_table(self._table(kind).to_arrow(), f, compression="zstd")
            h.update(hashlib.sha256(f.read_bytes()).digest())
        return f"sha256:{h.hexdigest()}"


def carried_keys(files: list[str], read_metadata) -> dict:
    """What ``fsdata balance`` carries from ``fsdata convert`` outputs into the manifest (docs/format.md).

    Args:
        files: the sample files (local paths or URIs), in input order.
        read_metadata: ``path -> pyarrow.parquet.FileMetaData`` (:func:`fsdata.fsio.read_parquet_metadata`).

    Returns:
        ``num_items`` (the largest over the files), ``feature_columns`` (when every file has the same) and
        ``vocab_source`` (``{"digest", "dir"}``, the vocabulary folder's absolute local path or None, when
        every file names the same vocabulary); only the keys every file supports. Empty when any file
        lacks ``freescale.convert`` metadata.
    """
    import json

    metas = []
    for f in files:
        kv = read_metadata(f).metadata or {}
        raw = kv.get(b"freescale.convert")
        if raw is None:
            return {}
        metas.append(json.loads(raw))
    out: dict = {}
    if metas and all(m.get("num_items") is not None for m in metas):
        out["num_items"] = max(int(m["num_items"]) for m in metas)
    cols = {tuple(m.get("feature_columns") or ()) for m in metas}
    if len(cols) == 1 and next(iter(cols)):
        out["feature_columns"] = list(next(iter(cols)))
    vocabs = {json.dumps(m.get("vocab"), sort_keys=True) for m in metas}
    if len(vocabs) == 1 and metas[0].get("vocab"):
        v = metas[0]["vocab"]
        where = None
        if v.get("path") and "://" not in files[0]:
            where = str((Path(files[0]).absolute().parent / v["path"]).resolve())
        out["vocab_source"] = {"digest": v["digest"], "dir": where}
    return out


def vocab_digest(folder: str | os.PathLike) -> str:
    """The content digest of a vocabulary folder (``sha256:<hex>``, as :meth:`Vocabulary.write` returns)."""
    h = hashlib.sha256()
    for name in FILES.values():
        h.update(hashlib.sha256((Path(folder) / name).read_bytes()).digest())
    return f"sha256:{h.hexdigest()}"


def id_dtype(prior: pl.DataFrame | None, is_string: bool) -> pl.DataType:
    """The dtype a column's ids are matched as: String when the input or the earlier vocabulary has strings."""
    if prior is not None and prior.schema["id"] == pl.String:
        return pl.String
    return pl.String if is_string else pl.Int64


def extend(seen: pl.DataFrame, prior: pl.DataFrame | None, dtype: pl.DataType, what: str) -> pl.DataFrame:
    """One column's vocabulary: ``prior``'s indices kept, ids new to it appended in order of first appearance.

    Args:
        seen: ``id``, ``first`` (row of first appearance), ``count`` over this input (any row order).
        prior: the earlier vocabulary's table, or None.
        dtype: the id dtype (:func:`id_dtype`).
        what: ``"item"`` or ``"user"``, for the error message.

    Returns:
        ``id``, ``index``, ``count``; rows in index order.

    Raises:
        InputError: the earlier vocabulary holds string ids and the input integers, or the reverse.
    """
    prior = _empty(dtype) if prior is None else prior
    if prior.schema["id"] != dtype:
        raise InputError(f"the --vocab vocabulary has {prior.schema['id']} {what} ids but the input has "
                         f"{dtype} ones; give the vocabulary of the same kind of ids")
    seen = seen.with_columns(pl.col("id").cast(dtype)).sort("first")
    if prior.height == 0:  # no earlier vocabulary: indices in order of first appearance (no join)
        return seen.select("id", pl.int_range(1, pl.len() + 1, dtype=pl.Int64).alias("index"),
                           pl.col("count").cast(pl.Int64))
    counts = seen.select("id", "count")
    known = prior.select("id", "index").join(counts, on="id", how="left", maintain_order="left").with_columns(
        pl.col("count").fill_null(0))
    start = int(prior["index"].max() or 0) + 1
    new = seen.join(prior.select("id"), on="id", how="anti", maintain_order="left").select(
        "id", pl.int_range(start, start + pl.len(), dtype=pl.Int64).alias("index"), "count")
    return pl.concat([known, new]).select("id", pl.col("index").cast(pl.Int64), pl.col("count").cast(pl.Int64))


def first_seen(lf: pl.LazyFrame, col: str) -> pl.LazyFrame:
    """The distinct non-null values of ``col`` with their first row (``_row``) and count (streamable)."""
    return (lf.select("_row", col).filter(pl.col(col).is_not_null()).group_by(col)
            .agg(pl.col("_row").min().alias("first"), pl.len().cast(pl.Int64).alias("count")).rename({col: "id"}))


class IdMap:
    """One column's ``id -> index`` lookup for the conversion's batches.

    A join against a vocabulary of millions of ids hashes the whole vocabulary for every batch (5 s per
    80,000-row batch against 12.5M ids here); instead the ids' 64-bit hashes (Polars' ``hash``, seed 0;
    integer ids as they are) are sorted once and each batch is looked up with ``np.searchsorted``. Two ids
    of one hash (about n^2 / 2^65: 4e-6 for 12.5M ids) make the lookup fall back to joins.

    Args:
        table: ``id``, ``index`` (a :class:`Vocabulary` table).
    """

    def __init__(self, table: pl.DataFrame) -> None:
        table = table.select("id", "index")
        self.schema = table.schema
        keys = self._keys(table["id"])
        order = np.argsort(keys, kind="stable")
        self._keys_sorted = keys[order]
        del keys
        index = table["index"].to_numpy()
        small = len(index) == 0 or (index.min() >= 0 and index.max() < np.iinfo(np.int32).max)
        self._index = index[order].astype(np.int32 if small else np.int64)
        del order, index
        self._exact = not bool(np.any(self._keys_sorted[1:] == self._keys_sorted[:-1]))
        # the table itself is kept only for the join fallback (two ids of one hash): the sorted keys and
        # indices take 12 bytes an id, the table 32 or more
        self.table = None if self._exact else table

    @classmethod
    def from_sorted(cls, dtype: pl.DataType, keys: np.ndarray, index: np.ndarray) -> IdMap:
        """A lookup from keys already sorted and distinct (the vocabulary pass's, without hashing the ids again).

        Args:
            dtype: the id dtype (``pl.String`` or ``pl.Int64``).
            keys: uint64 ``[n]``, sorted, distinct (:meth:`_keys` of the ids).
            index: int32 or int64 ``[n]``, each key's index.
        """
        m = cls.__new__(cls)
        m.schema = pl.Schema({"id": dtype, "index": pl.Int64})
        m._keys_sorted, m._index, m._exact, m.table = keys, index, True, None
        return m

    def _keys(self, s: pl.Series) -> np.ndarray:
        if s.dtype == pl.String:
            return s.hash(seed=0).to_numpy()
        return s.cast(pl.Int64).to_numpy().view(np.uint64)

    def encode(self, s: pl.Series) -> pl.Series:
        """Indices (Int64) of the ids of ``s``; null for a null id or one the vocabulary lacks."""
        if not self._exact:
            return pl.DataFrame({"id": s}).join(self.table, on="id", how="left", maintain_order="left")["index"]
        keys = self._keys(s.fill_null("" if s.dtype == pl.String else 0))
        pos = np.minimum(np.searchsorted(self._keys_sorted, keys), max(0, len(self._keys_sorted) - 1))
        found = (self._keys_sorted[pos] == keys) if len(self._keys_sorted) else np.zeros(len(keys), bool)
        index = self._index[pos].astype(np.int64) if len(self._index) else np.zeros(len(keys), np.int64)
        out = pl.Series(s.name, index)
        return out.scatter(np.flatnonzero(~found | s.is_null().to_numpy()), None) if (~found).any() or \
            s.null_count() else out


def encode_frame(frame, maps: dict):
    """Replace the id columns named by ``maps`` with their indices (lazy or eager frame).

    Args:
        frame: holds the columns of ``maps`` in the maps' id dtype.
        maps: column -> :class:`IdMap` (eager frames are looked up by hash; lazy ones joined).
    """
    if isinstance(frame, pl.DataFrame):
        return frame.with_columns([maps[c].encode(frame[c]).alias(c) for c in maps])
    for c, m in maps.items():
        if isinstance(m, IdMap) and m.table is None:
            frame = frame.with_columns(pl.col(c).map_batches(m.encode, return_dtype=pl.Int64))
            continue
        tmp = f"_{c}_index"
        table = m.table if isinstance(m, IdMap) else m
        frame = frame.join(table.select(pl.col("id").alias(c), pl.col("index").alias(tmp)).lazy(),
                           on=c, how="left", maintain_order="left")
        frame = frame.with_columns(pl.col(tmp).alias(c)).drop(tmp)
    return frame
