"""Id columns of an ``events`` input: which kind they hold, and how they become int64 (``fsdata convert``).

Kinds (by :func:`fsdata.samples.sniff.scan_text` for text, from the schema for Parquet): ``int`` (every
value an integer: kept as is unless remapped), ``float`` (integer-valued decimals such as ``10.0``: cast
to int64; a fractional value is refused with its line) and ``string`` (anything else: always mapped to
dense indices, :mod:`fsdata.samples.vocab`). A time column is ``int``, ``float`` (floored to seconds),
``string`` (ISO 8601, to unix seconds) or ``datetime`` (Parquet).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa

from fsdata.errors import InputError
from fsdata.samples import vocab as V

ID_COLUMNS = ("user_id", "item_id")
#: Kind -> the dtype both readers (Polars, PyArrow) read the column as (None: as inferred).
READ_AS = {"int": None, "float": (pl.Float64, pa.float64()), "string": (pl.String, pa.string()), "datetime": None}


def kind_of_dtype(dtype: pl.DataType) -> str | None:
    """The id kind of a typed (Parquet) column, or None for a type ids cannot have."""
    if dtype.is_integer():
        return "int"
    if dtype.is_float():
        return "float"
    if dtype in (pl.String, pl.Categorical) or isinstance(dtype, (pl.Categorical, pl.Enum)):
        return "string"
    return None


def check_whole(raw: pl.LazyFrame, kinds: dict[str, str], where, given: dict[str, str], path) -> None:
    """Refuse a fractional value in a ``float`` id column, naming its line.

    Raises:
        InputError: ``line N, column 'c': 10.7 is not a whole number``.
    """
    for c in ID_COLUMNS:
        if kinds.get(c) != "float":
            continue
        bad = (raw.select("_row", c).filter(pl.col(c).is_not_null() & (pl.col(c) != pl.col(c).floor()))
               .head(1).collect(engine="streaming"))
        if bad.height:
            raise InputError(f"input {path} {where(int(bad['_row'][0]))}, column '{given[c]}': {bad[c][0]} is not a "
                             "whole number; ids must be integers or strings (a fractional id is not an id)")


def plain_ids(frame, kinds: dict[str, str], maps: dict[str, pl.DataFrame]):
    """The id columns cast to the dtype they are matched in: integer-valued floats to Int64, remapped
    integer columns to Int64, string columns as they are (lazy or eager ``frame``)."""
    exprs = []
    for c in ID_COLUMNS:
        if kinds.get(c) == "float" or (c in maps and maps[c].schema["id"] == pl.Int64):
            exprs.append(pl.col(c).cast(pl.Int64, strict=True))
        elif c in maps:
            exprs.append(pl.col(c).cast(pl.String))
    return frame.with_columns(exprs) if exprs else frame


def to_int(frame, kinds: dict[str, str], maps: dict[str, pl.DataFrame], cols: list[str]):
    """``cols`` of ``frame`` as Int64: id columns through :func:`plain_ids` and their vocabulary maps,
    then every column cast strictly (a non-integer value fails the cast, as before ids had kinds)."""
    if maps or any(kinds.get(c, "int") != "int" for c in ID_COLUMNS):
        frame = V.encode_frame(plain_ids(frame, kinds, maps), maps)
    ts = kinds.get("ts", "int") if "ts" in cols else "int"
    if ts == "float":
        frame = frame.with_columns(pl.col("ts").floor())
    elif ts == "string":  # ISO 8601 (a zone offset is honoured; none is UTC) -> unix seconds
        iso = pl.col("ts").str.strip_chars().str.to_datetime(time_zone="UTC", strict=True)
        frame = frame.with_columns(iso.dt.epoch("s"))
    elif ts == "datetime":
        frame = frame.with_columns(pl.col("ts").dt.epoch("s"))
    return frame.with_columns([pl.col(c).cast(pl.Int64, strict=True) for c in cols])


def needs_map(kinds: dict[str, str], remap_ids: bool, prior: V.Vocabulary | None) -> bool:
    """Whether ids are mapped: string ids, ``--remap-ids`` or an earlier vocabulary."""
    return remap_ids or prior is not None or any(k == "string" for k in kinds.values())


#: Per-batch first appearances gathered before they are merged into the running table (rows).
_MERGE_ROWS = 1 << 19


def build_maps(batches, kinds: dict[str, str], prior: V.Vocabulary | None, reread=None):
    """The vocabulary of an input: one pass for each id column's first appearance and count.

    The pass keeps each column's distinct ids as sorted 64-bit keys in NumPy arrays
    (:mod:`fsdata.samples.vocab_build`); should two distinct ids share a hash, the input is read again
    (``reread()``) and grouped with Polars instead (each batch grouped on its own, the groups merged into a
    running table every :data:`_MERGE_ROWS` rows).

    Args:
        batches: frames ``_row``, ``user_id``, ``item_id`` as read (ids not cast), in input order.
        kinds: the id kinds (:func:`classify`).
        prior: the ``--vocab`` vocabulary, or None.
        reread: ``() -> batches`` again, for the fallback (None: ``batches`` is re-iterable).

    Returns:
        The extended :class:`~fsdata.samples.vocab.Vocabulary` (not written yet); without ``prior`` and a shared
        hash, a :class:`~fsdata.samples.vocab_build.PassVocabulary` (the same tables, kept as the pass's arrays).
    """
    from fsdata.samples import vocab_build as VB

    dtypes = {c: V.id_dtype(None if prior is None else (prior.items if c == "item_id" else prior.users),
                            kinds[c] == "string") for c in ID_COLUMNS}
    shells = {c: pl.DataFrame(schema={"id": dtypes[c]}) for c in ID_COLUMNS}
    try:  # ``id``, ``count`` in order of first appearance
        seen, ordered = VB.first_seen_pass(batches, ID_COLUMNS, dtypes, lambda df: plain_ids(df, kinds, shells)), True
    except VB.HashCollision:  # ``id``, ``first`` (row), ``count``
        seen, ordered = _grouped_first_seen(batches if reread is None else reread(), kinds, shells), False
    if ordered and prior is None:  # indices in order of first appearance: the pass's arrays as they are
        return VB.PassVocabulary(seen)
    tables = {}
    for c in ID_COLUMNS:  # one column at a time
        t = seen.pop(c)
        if ordered:
            t = t.table().with_columns(pl.int_range(0, pl.len(), dtype=pl.Int64).alias("first"))
        tables[c] = V.extend(t, None if prior is None else (prior.items if c == "item_id" else prior.users),
                             dtypes[c], c.removesuffix("_id"))
        del t
    return V.Vocabulary(items=tables["item_id"], users=tables["user_id"])


def write_and_map(vocab, folder: Path, src) -> tuple[str, int]:
    """Write ``vocab`` (a :class:`~fsdata.samples.vocab.Vocabulary` or what :func:`build_maps` returns) into
    ``folder`` (created) and set ``src.maps`` (``user_id``/``item_id`` ->
    :class:`~fsdata.samples.vocab.IdMap`), freeing each of ``vocab``'s tables once hashed: the conversion then
    holds 12 bytes an id (the maps' sorted keys and indices) instead of the tables' 32 or more.

    Returns:
        ``(digest, num_items)``: :meth:`~fsdata.samples.vocab.Vocabulary.write`'s digest and the items'
        embedding-table size.
    """
    folder.mkdir()
    digest, num_items = vocab.write(folder), vocab.num_items
    if not isinstance(vocab, V.Vocabulary):  # a PassVocabulary: the lookups from the pass's sorted keys
        src.maps = vocab.id_maps()
        return digest, num_items
    src.maps = {}
    for c, attr in (("user_id", "users"), ("item_id", "items")):
        table = getattr(vocab, attr).select("id", "index")
        setattr(vocab, attr, None)
        src.maps[c] = V.IdMap(table)
        del table
    return digest, num_items


def _grouped_first_seen(batches, kinds: dict[str, str], shells: dict[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """Each id column's ``id``, ``first`` (row), ``count`` by Polars grouping (the fallback of :func:`build_maps`)."""
    acc: dict[str, list[pl.DataFrame]] = {c: [] for c in ID_COLUMNS}
    pending = dict.fromkeys(ID_COLUMNS, 0)

    def merge(parts: list[pl.DataFrame]) -> list[pl.DataFrame]:
        return [pl.concat(parts).group_by("id").agg(pl.col("first").min(), pl.col("count").sum())]

    for df in batches:
        df = plain_ids(df, kinds, shells)
        for c in ID_COLUMNS:
            part = V.first_seen(df.lazy(), c).collect()
            acc[c].append(part)
            pending[c] += part.height
            if pending[c] >= _MERGE_ROWS:
                acc[c], pending[c] = merge(acc[c]), 0
    empty = pl.DataFrame(schema={"id": pl.String, "first": pl.UInt32, "count": pl.Int64})
    return {c: merge(acc[c])[0] if acc[c] else empty for c in ID_COLUMNS}


def id_kinds(path: Path, lf: pl.LazyFrame, given: dict[str, str], rescan, force_string: dict[str, bool],
             text_kinds: dict[str, str] | None = None):
    """``(kinds, arrow_types, lf)``: each id column's kind, the PyArrow types of the columns read otherwise
    than inferred, and the scan reading them so (``rescan(overrides)`` scans a text input again, None for
    Parquet)."""
    schema = lf.collect_schema()
    text = rescan is not None
    if text:
        kinds = dict(text_kinds)
    else:
        kinds = {}
        for ours, theirs in given.items():
            kinds[ours] = kind_of_dtype(schema[theirs])
            if ours == "ts" and schema[theirs].is_temporal():
                kinds[ours] = "datetime"
            if kinds[ours] is None:
                raise InputError(f"input {path}: column '{theirs}' ({ours}) has type {schema[theirs]}; ids must be "
                                 "integers or strings")
    kinds = {c: "string" if force_string.get(c) else k for c, k in kinds.items()}
    for ours, theirs in given.items():
        if ours not in ("user_id", "item_id", "ts") and kinds[ours] == "string":
            raise InputError(f"input {path}: feature column '{theirs}' holds text; --feature-cols takes numeric "
                             "columns (map categories such as action types to integers first)")
    arrow_types, casts = {}, {}
    for ours, theirs in given.items():
        read_as = READ_AS[kinds[ours]]
        if read_as is not None:
            casts[theirs], arrow_types[theirs] = read_as
    if casts:
        lf = rescan(casts) if text else lf.with_columns([pl.col(c).cast(dt) for c, dt in casts.items()])
    return kinds, arrow_types, lf


#: Names an event feature may not take: the sample schema's, the shards' and convert's own.
_TAKEN = ("sample_id", "user_id", "item_ids", "target_item_id", "timestamps", "seq_len", "step", "rank", "item_id",
          "ts", "_row", "_first")


def resolve_features(path: Path, feature_cols, resolve, given: dict[str, str | None]) -> dict[str, str]:
    """``--feature-cols``: output column -> the input's column (a typed ``rating:float`` is named ``rating``).

    Raises:
        InputError: a missing column, one already used as user, item or time, or a name the sample
            schema takes.
    """
    out: dict[str, str] = {}
    for name in feature_cols:
        theirs = resolve(name, "--feature-cols")
        ours = theirs.split(":")[0]
        if theirs in given.values() or ours in _TAKEN or ours in out:
            raise InputError(f"input {path}: --feature-cols '{name}' is the user, item or time column or a "
                             f"name the sample schema takes ({', '.join(_TAKEN[:6])}); pass other columns")
        out[ours] = theirs
    return out


def cast_features(frame, kinds: dict[str, str], features: list[str]):
    """Feature columns as Int64 (integer columns) or Float64 (decimals), strictly."""
    return frame.with_columns([pl.col(f).cast(pl.Int64 if kinds[f] == "int" else pl.Float64, strict=True)
                               for f in features]) if features else frame
