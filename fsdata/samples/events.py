"""Reading ``events`` inputs for :func:`fsdata.samples.convert.convert`, one block at a time.

Text inputs go through PyArrow's streaming CSV reader and Parquet inputs by record batches. Rows are
split by a hash of the user id into buckets: every :data:`_SPOOL_EVENTS` events are sorted by bucket
and written as one temporary Parquet file (beside the output) holding row groups of one bucket each,
so one gathered block is in memory whatever the number of buckets. Each bucket (its batches from
every spool file, in file order) is grouped on its own, and the buckets are merged back in order of
each user's first event, so memory holds one block, one bucket and one chunk of users, not the
input. Inputs estimated at fewer than ``events_per_bucket`` events are grouped in memory.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from fsdata.errors import InputError
from fsdata.guards import raise_if_environment
from fsdata.samples import ids as I
from fsdata.samples import sniff as Sn
from fsdata.samples.merge import merge_by_first as _merge_by_first
from fsdata.samples.merge import write_buckets

log = logging.getLogger("fsdata.convert")

#: A chunk of users is cut early once its events pass this count.
MAX_EVENTS_PER_CHUNK = 1 << 23
#: Default most history items (summed over samples) built and written at once.
#: Most temporary buckets (open files of the partitioned sink).
_MAX_BUCKETS = 256
#: Most events per row group of a grouped bucket file. The merge holds up to two row groups per bucket
#: file, so a group is also at most :data:`_MERGE_EVENTS_PER_STEP` / buckets events.
_MERGE_EVENTS_PER_GROUP = 1 << 14
#: Events the merge reads per step over all bucket files (about one row group each). A fixed 16,384 events
#: per group made a 256-bucket merge hold about 8M events at once: a 2 GB events CSV peaked at 995 MiB there.
_MERGE_EVENTS_PER_STEP = 1 << 21
#: Events gathered before they are split by bucket and written as one spool file. An earlier design kept
#: rows pending per bucket with one open Parquet writer each: memory grew by about 2 MiB per bucket
#: (874 MiB at 250 buckets against 401 MiB at 43, same 0.34 GB input), so with the bucket count it
#: grew with the input.
_SPOOL_EVENTS = 1 << 21
#: Bytes of an events text file parsed at once (PyArrow's streaming CSV reader). The reader reads up
#: to 32 blocks ahead of a slow consumer (Arrow's background generator queue), so this bounds about
#: 32 x this of raw input in memory: 8 MiB blocks held 256 MiB more than 2 MiB blocks.
_READ_BLOCK_BYTES = 2 << 20
#: Rows of an events Parquet file read at once.
_READ_ROWS = 1 << 18
#: Bytes per event assumed when estimating the events of a text input (``"12 345\\n"``).
_TEXT_BYTES_PER_EVENT = 8


def _check_input_file(path: Path) -> None:
    if not path.exists():
        raise InputError(f"input {path} does not exist; pass an existing file")
    if path.is_dir():
        raise InputError(f"input {path} is a directory; convert takes one file")
    if path.stat().st_size == 0:
        raise InputError(f"input {path} is empty; pass a file with interactions")


# ---------------------------------------------------------------------------------------------- sequences

_TIME_LIKE = re.compile(r"^(time|ts|date|datetime|timestamp.*|.*_?timestamp|.*_time|.*_ts|.*_at|event_?time|"
                        r"unix_?time|epoch)$", re.IGNORECASE)


def _warn_time_col(path: Path, names: list[str], used: list[str]) -> None:
    """Warn (one line) when the input has a time-like column but ``--time-col`` was not given."""
    cands = [n for n in names if n not in used and _TIME_LIKE.match(n)]
    if cands:
        log.warning("input %s has a column '%s' that looks like event time, but --time-col was not given: each "
                    "user's events keep file order; pass --time-col %s to sort them by time", path, cands[0],
                    cands[0])


@dataclass(kw_only=True, slots=True)
class _EventsInput:
    """A resolved events input: the lazy scan of its renamed columns and how to name its rows."""

    path: Path
    raw: pl.LazyFrame
    """``_row`` (u32, 0-based), ``user_id``, ``item_id`` [, ``ts``] as read (not yet cast)."""
    given: dict[str, str | None]
    """Our column name -> the input's."""
    header_lines: int
    text: bool
    num_events_estimate: int
    names: list[str]
    """The input's column names (as Polars names them: ``column_1`` ... without a header)."""
    sep: str | None
    kinds: dict[str, str] = field(default_factory=dict)
    """``user_id``/``item_id`` -> ``int``, ``float`` or ``string`` (:mod:`fsdata.samples.ids`)."""
    maps: dict = field(default_factory=dict)
    """Id column -> its vocabulary table (``id``, ``index``), for mapped ids."""
    arrow_types: dict[str, pa.DataType] = field(default_factory=dict)
    """The input's column name -> the type PyArrow's CSV reader reads it as (id columns read as text or floats)."""
    bad_lines_skipped: int = 0
    """Lines skipped by ``--bad-lines skip``."""
    features: dict[str, str] = field(default_factory=dict)
    """Event feature (output list column) -> the input's column (``--feature-cols``)."""

    def feature_types(self) -> dict[str, pa.DataType]:
        """Feature -> the Arrow type of its list elements (int64 or float64)."""
        return {f: pa.int64() if self.kinds[f] == "int" else pa.float64() for f in self.features}

    @property
    def has_time(self) -> bool:
        return self.given["ts"] is not None

    def where(self, row: int) -> str:
        return f"line {row + 1 + self.header_lines}" if self.text else f"row {row}"


def _open_events(path: Path, *, user_col: str | None, item_col: str | None, time_col: str | None, sep: str | None,
                 has_header: bool | None, force_string: dict[str, bool] | None = None, bad_lines: str = "error",
                 tmp: Path | None = None, feature_cols: tuple[str, ...] = ()) -> _EventsInput:
    """Resolve an events input: its kind by content (:mod:`fsdata.samples.sniff`), separator, header, columns
    and the kind of its ids (for text, one streaming pass; for Parquet, the schema).

    ``force_string``: ``user_id``/``item_id`` -> read as strings whatever they hold (an earlier vocabulary
    of string ids). ``tmp``: a fresh folder for a decompressed or rewritten copy of a text input (the
    returned input's ``path`` is then the copy; its lines keep their numbers)."""
    _check_input_file(path)
    kind, comp = Sn.detect(path)
    if kind == "binary":
        raise Sn.binary_error(path, "events", kind)
    prep = None
    try:
        if kind == "parquet":
            if comp:
                raise InputError(f"input {path} is a compressed Parquet file; decompress it first (Parquet "
                                 "compresses its pages itself)")
            lf = pl.scan_parquet(str(path))
            estimate = pq.read_metadata(str(path)).num_rows
            names = lf.collect_schema().names()
        else:
            wanted = tuple(c for c in (user_col, item_col, time_col) if c is not None and not c.isdigit())
            prep = Sn.prepare(path, tmp, sep=sep, has_header=has_header, comp=comp, wanted=wanted)
            lf = _scan_text(prep)
            names = lf.collect_schema().names()
            estimate = path.stat().st_size // _TEXT_BYTES_PER_EVENT * (4 if comp else 1)
    except (pl.exceptions.PolarsError, OSError) as e:
        raise_if_environment(e, path, action="read")
        raise InputError(f"input {path}: cannot read ({str(e).splitlines()[0]}); "
                         "check --format, --sep and --header") from None

    def resolve(col: str | None, flag: str) -> str | None:
        if col is None:
            return None
        if col in names:
            return col
        typed = [n for n in names if n.split(":")[0] == col]  # RecBole's user_id:token
        if typed:
            return typed[0]
        if col.isdigit() and int(col) < len(names):
            return names[int(col)]
        raise InputError(f"input {path}: no column '{col}' for {flag}; columns are {names}; "
                         f"pass {flag} NAME (or a 0-based position)")

    header = kind == "parquet" or prep.has_header
    auto = user_col is None and item_col is None and time_col is None
    for col, flag in ((user_col, "--user-col"), (item_col, "--item-col"), (time_col, "--time-col")):
        resolve(col, flag)  # a named column that is missing is refused first
    if header and (user_col is None or item_col is None):
        std = Sn.standard_columns(names)
        missing = [f for f, ours, col in (("--user-col", "user_id", user_col), ("--item-col", "item_id", item_col))
                   if col is None and ours not in std]
        if missing:
            raise InputError(f"input {path} has columns {names} and none is a standard "
                             f"{'user' if missing[0] == '--user-col' else 'item'} column; pass "
                             f"{' and '.join(f'{m} NAME' for m in missing)}")
        user_col = user_col if user_col is not None else std["user_id"]
        item_col = item_col if item_col is not None else std["item_id"]
        if auto and "ts" in std:
            time_col = std["ts"]
        log.warning("input %s: using columns user '%s', item '%s'%s (standard names; pass --user-col/--item-col/"
                    "--time-col to choose others)", path, user_col, item_col,
                    f", time '{time_col}'" if time_col else "")
    u = resolve("0" if user_col is None else user_col, "--user-col")
    i = resolve("1" if item_col is None else item_col, "--item-col")
    t = resolve(time_col, "--time-col")
    if t is None:
        _warn_time_col(path, names, [u, i])
    given = {"user_id": u, "item_id": i, "ts": t}
    features = I.resolve_features(path, feature_cols, resolve, given)
    skipped, text_kinds = 0, None
    if prep is not None:
        try:
            text_kinds, skipped, prep = Sn.scan_text(prep, names, {k: v for k, v in given.items() if v} | features,
                                                     bad_lines=bad_lines, tmp=tmp, shown=path)
        except (pa.ArrowException, OSError) as e:
            raise_if_environment(e, path, action="read")
            raise InputError(f"input {path}: cannot read ({str(e).splitlines()[0]}); "
                             "check --format, --sep and --header") from None
        lf = _scan_text(prep)
    kinds, arrow_types, lf = I.id_kinds(path, lf, {k: v for k, v in given.items() if v} | features,
                                        (lambda ov: _scan_text(prep, ov)) if prep else None, force_string or {},
                                        text_kinds)
    cols = [pl.col(u).alias("user_id"), pl.col(i).alias("item_id")]
    if t:
        cols.append(pl.col(t).alias("ts"))
    cols += [pl.col(theirs).alias(f) for f, theirs in features.items()]
    text = prep is not None
    return _EventsInput(path=prep.path if text else path, raw=lf.select(cols).with_row_index("_row"),
                        given=given, header_lines=1 if text and prep.has_header else 0, text=text,
                        num_events_estimate=estimate, names=names, sep=prep.sep if text else None, kinds=kinds,
                        arrow_types=arrow_types, bad_lines_skipped=skipped, features=features)


def _scan_text(prep, overrides=None) -> pl.LazyFrame:
    return pl.scan_csv(str(prep.path), separator=prep.sep, has_header=prep.has_header, infer_schema_length=10000,
                       schema_overrides=overrides)


def _event_columns(src: _EventsInput) -> list[str]:
    return ["user_id", "item_id", "ts"] if src.has_time else ["user_id", "item_id"]


def _cast_events(src: _EventsInput) -> pl.LazyFrame:
    return I.cast_features(I.to_int(src.raw, src.kinds, src.maps, _event_columns(src)), src.kinds,
                           list(src.features))


def _parse_error(src: _EventsInput, e: BaseException, *, check_nulls: bool = False) -> InputError:
    """The error for a failed read of the events input: the first value that is not an integer (by column, in
    user, item, time order), then (``check_nulls``) a null or negative id, else the reader's own message."""
    raise_if_environment(e, src.path, action="read")
    try:
        where = _locate_bad_value(src)
    except (pl.exceptions.PolarsError, OSError) as e2:
        raise_if_environment(e2, src.path, action="read")
        return InputError(f"input {src.path}: cannot parse ({str(e2).splitlines()[0]}); "
                          "check --format, --sep and header settings")
    if not where and check_nulls:
        _check_events(src, _cast_events(src))  # raises for a null (e.g. a blank line) or a negative id
    if not where:
        return InputError(f"input {src.path}: cannot parse ({str(e).splitlines()[0]}); "
                          "check --format, --sep and header settings")
    return InputError(f"input {src.path} {where}: ids must be integers or strings and times integers, decimals "
                      "or ISO 8601 date-times: fix that value")


def _locate_bad_value(src: _EventsInput) -> str:
    """``line N, column 'c': 'x'`` for the first row whose value is not an integer, one column at a time
    (streamed, so a large input is not held whole)."""
    schema = src.raw.collect_schema()
    for c in _event_columns(src):
        kind = src.kinds.get(c, "int")
        if kind in ("float", "datetime") or (kind == "string" and c != "ts"):
            continue  # read as decimals, date-times or mapped strings: not the failing column
        iso = pl.col(c).str.strip_chars().str.to_datetime(time_zone="UTC", strict=False)
        ok = iso.is_not_null() if kind == "string" else pl.col(c).cast(pl.Int64, strict=False).is_not_null()
        bad = src.raw.select("_row", c).filter(pl.col(c).is_not_null() & ~ok).head(1).collect()
        if bad.height:
            value = bad[c][0]
            shown = f"'{value}'"
            if schema[c].is_integer():
                shown += " (does not fit int64: ids must be below 2^63)"
            return f"{src.where(int(bad['_row'][0]))}, column '{src.given[c]}': {shown}"
    return ""


def _check_events(src: _EventsInput, ev: pl.LazyFrame) -> int:
    """Check the cast events (streamed): at least one, no nulls, no negative ids.

    Returns:
        The number of events.

    Raises:
        InputError: no events; a null (the first, by column); a negative user or item id.
    """
    cols = _event_columns(src) + list(src.features)
    aggs = [pl.len().alias("n")]
    for c in cols:
        aggs += [pl.col(c).null_count().alias(f"nulls_{c}"),
                 pl.col("_row").filter(pl.col(c).is_null()).min().alias(f"null_row_{c}")]
    for c in ("user_id", "item_id"):
        aggs.append(pl.col("_row").filter(pl.col(c) < 0).min().alias(f"neg_row_{c}"))
    try:
        st = ev.select(aggs).collect(engine="streaming").row(0, named=True)
    except (pl.exceptions.PolarsError, OSError) as e:
        raise _parse_error(src, e) from None
    if st["n"] == 0:
        raise InputError(f"input {src.path} has no events")
    nulls = {c: st[f"nulls_{c}"] for c in cols if st[f"nulls_{c}"]}
    if nulls:
        c = next(iter(nulls))
        where = f"{src.where(st[f'null_row_{c}'])}, column '{src.given[c]}': empty (blank line or missing field)"
        raise InputError(f"input {src.path}: null values in {nulls}, first at {where}; drop or fill those rows first")
    for c in ("user_id", "item_id"):
        row = st[f"neg_row_{c}"]
        if row is not None:
            value = ev.filter(pl.col("_row") == row).select(c).collect(engine="streaming")[c][0]
            raise InputError(f"input {src.path} {src.where(row)}, column '{src.given[c]}': id {value} is negative; "
                             "user and item ids must be >= 0: map them to non-negative integers first")
    return int(st["n"])


def _group_users(ev: pl.DataFrame, has_time: bool) -> tuple[pl.DataFrame, int]:
    """Group events into per-user chronological sequences.

    Returns:
        ``(users, num_duplicates)``: ``users`` has ``_first`` (the user's first row, u32, ascending),
        ``user_id``, ``item_ids`` and with a time column ``timestamps``; ``num_duplicates`` counts
        events equal to an earlier one (same user, item and time).
    """
    dup = ev.height - ev.select([c for c in ("user_id", "item_id", "ts") if c in ev.columns]).n_unique()
    features = [c for c in ev.columns if c not in ("_row", "user_id", "item_id", "ts")]
    order = ["user_id", "ts", "_row"] if has_time else ["user_id", "_row"]
    first_seen = ev.group_by("user_id").agg(pl.col("_row").min().alias("_first"))
    ev = ev.join(first_seen, on="user_id").sort(["_first"] + order[1:])
    aggs = [pl.col("item_id").alias("item_ids")]
    if has_time:
        aggs.append(pl.col("ts").alias("timestamps"))
    aggs += [pl.col(f) for f in features]  # event features, aligned with item_ids
    return ev.group_by("_first", maintain_order=True).agg(pl.col("user_id").first(), *aggs), dup


def iter_events(src: _EventsInput, spool: Path, *, events_per_bucket: int,
                stats: dict | None = None) -> Iterator[pl.DataFrame]:
    """Group an events input into per-user sequences with bounded memory (module docstring).

    Args:
        src: from :func:`_open_events`.
        spool: an empty local folder for the temporary buckets (removed by the caller).
        events_per_bucket: events per temporary bucket; an input estimated at no more is grouped
            in memory.
        stats: filled with ``num_duplicates`` once the input is read.

    Yields:
        DataFrames ``user_id`` int64, ``item_ids`` list<int64> and, with a time column,
        ``timestamps`` list<int64>; users in order of first appearance, each user once.

    Raises:
        InputError: unreadable file, non-integer values, nulls, negative ids, no events.
    """
    stats = {} if stats is None else stats
    num_buckets = min(_MAX_BUCKETS, math.ceil(src.num_events_estimate / max(1, events_per_bucket)))
    cast = _cast_events(src)
    if num_buckets <= 1:
        try:
            ev = cast.collect()
        except (pl.exceptions.PolarsError, OSError) as e:
            raise _parse_error(src, e) from None
        _check_events(src, ev.lazy())
        users, stats["num_duplicates"] = _group_users(ev, src.has_time)
        del ev
        yield users.drop("_first")
        return
    spooled = write_buckets(_read_batches(src), spool / "buckets", num_buckets, _SPOOL_EVENTS,
                            lambda e: _parse_error(src, e, check_nulls=True))
    _check_events(src, pl.scan_parquet([p for p, _ in spooled]))
    grouped, dups = [], 0
    group_events = max(64, min(_MERGE_EVENTS_PER_GROUP, _MERGE_EVENTS_PER_STEP // num_buckets))
    files = [(pq.ParquetFile(p), index) for p, index in spooled]
    for b in range(num_buckets):
        parts = [f.read_row_groups(index[b]) for f, index in files if b in index]
        if not parts:
            continue
        users, dup = _group_users(pl.from_arrow(pa.concat_tables(parts)), src.has_time)
        del parts
        dups += dup
        events = int(users["item_ids"].list.len().sum())
        rows = max(1, group_events * users.height // max(1, events))
        grouped.append(spool / f"grouped-{len(grouped):05d}.parquet")
        users.write_parquet(grouped[-1], row_group_size=rows, compression="lz4")
        del users
    del files
    for p, _ in spooled:
        p.unlink()
    stats["num_duplicates"] = dups
    for users in _merge_by_first([pq.ParquetFile(p) for p in grouped]):
        yield users.drop("_first")


def _read_batches(src: _EventsInput, raw: bool = False) -> Iterator[pl.DataFrame]:
    """The cast events (``_row``, ``user_id``, ``item_id`` [, ``ts``]) a block at a time: PyArrow's streaming
    CSV reader for text, Parquet batches for Parquet (Polars' streaming engine reads ahead without bound when
    its batches are consumed slowly, so it is not used here)."""
    ours = _event_columns(src)
    cols = list(dict.fromkeys([src.given[c] for c in ours] + list(src.features.values())))
    # raw: ``_row``, ``user_id``, ``item_id`` as read, not cast (the vocabulary pass)
    if src.text:
        reader = pacsv.open_csv(
            src.path, read_options=pacsv.ReadOptions(block_size=_READ_BLOCK_BYTES, column_names=src.names,
                                                     skip_rows=src.header_lines),
            parse_options=pacsv.ParseOptions(delimiter=src.sep, ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(include_columns=cols, column_types=src.arrow_types,
                                                 strings_can_be_null=True))
    else:
        # pre_buffer off: with it, PyArrow caches every row group's bytes read ahead until the file is closed
        # (apache/arrow#39808), so memory grew with the input (a 0.71 GB events Parquet: 1.1 GiB at the end of
        # the spool stage against 0.58 GiB with it off)
        reader = pq.ParquetFile(src.path, pre_buffer=False).iter_batches(batch_size=_READ_ROWS, columns=cols)
    row = 0
    for batch in reader:
        df = pl.from_arrow(batch)
        if raw:
            yield df.select(pl.int_range(row, row + df.height, dtype=pl.UInt32).alias("_row"),
                            *[pl.col(src.given[c]).alias(c) for c in I.ID_COLUMNS])
            row += df.height
            continue
        df = I.to_int(df.select(pl.int_range(row, row + df.height, dtype=pl.UInt32).alias("_row"),
                                *[pl.col(src.given[c]).alias(c) for c in ours],
                                *[pl.col(t).alias(f) for f, t in src.features.items()]), src.kinds, src.maps, ours)
        df = I.cast_features(df, src.kinds, list(src.features))
        row += df.height
        yield df


def read_raw(src: _EventsInput) -> Iterator[pl.DataFrame]:
    """``_row``, ``user_id``, ``item_id`` as read (ids not cast), a block at a time (the vocabulary pass).

    Raises:
        InputError: the file does not read (as :func:`iter_events`).
    """
    try:
        yield from _read_batches(src, raw=True)
    except (pa.ArrowException, pl.exceptions.PolarsError, OSError) as e:
        raise _parse_error(src, e, check_nulls=True) from None


# ---------------------------------------------------------------------------------------------- samples

def _chunks(frames: Iterator[pl.DataFrame], users_per_chunk: int,
            max_events: int = MAX_EVENTS_PER_CHUNK) -> Iterator[pl.DataFrame]:
    """Re-cut user frames into chunks of ``users_per_chunk`` users (fewer once their events pass
    ``max_events``; at least one user), so the chunks do not depend on how the input was read."""
    pending: pl.DataFrame | None = None
    for df in frames:
        pending = df if pending is None else pl.concat([pending, df], how="vertical_relaxed")
        while pending.height:
            n, full = _cut(pending, users_per_chunk, max_events)
            if not full:
                break
            yield pending.slice(0, n)
            pending = pending.slice(n)
    while pending is not None and pending.height:
        n, _ = _cut(pending, users_per_chunk, max_events)
        yield pending.slice(0, n)
        pending = pending.slice(n)


def _events(users: pl.DataFrame) -> int:
    return int(users["item_ids"].list.len().cast(pl.Int64).sum())


def _cut(users: pl.DataFrame, users_per_chunk: int, max_events: int) -> tuple[int, bool]:
    """``(n, full)``: the next chunk is the first ``n`` users; ``full`` when it is complete (more users
    could not join it)."""
    head = users.slice(0, users_per_chunk)
    cum = head["item_ids"].list.len().cast(pl.Int64).cum_sum()
    fits = int(cum.search_sorted(max_events, side="right"))
    if fits < head.height:
        return max(1, fits), True
    return head.height, head.height == users_per_chunk
