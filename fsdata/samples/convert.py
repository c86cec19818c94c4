"""``fsdata convert``: turn a raw interaction log into training samples (the sample schema).

Input formats (docs/fsdata.md):

* ``sequences``: one user per line, ``user item1 item2 ...`` in chronological order.
* ``events``: one interaction per row: whitespace-separated ``user item`` lines, or CSV/Parquet
  with user, item and optional timestamp columns (``--user-col/--item-col/--time-col``).
  Without a timestamp column, rows are taken in file order (assumed chronological per user);
  with one, each user's events are stably sorted by time.

Sample modes:

* ``per-user``: one sample per user with at least 2 items: history = all but the last item
  (at most ``max_seq_len`` most recent), target = the last item.
* ``per-event``: one sample per interaction ``t >= 1`` of each user: history = up to
  ``max_seq_len`` items before ``t``, target = item ``t`` (how industrial training data is built).

The output also holds ``seq_len`` (int32, ``len(item_ids)``), so later passes (profile, balance)
read lengths without decoding the lists. ``sample_id`` is the 0-based row number of the output, in user order then time order. Users with
fewer than 2 items yield no sample; they are counted in the summary and in the file's metadata.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from fsdata.samples import schema as S
from fsdata.atomic import atomic_output
from fsdata.errors import ConfigError, InputError, setting
from fsdata.guards import check_output_apart, raise_if_environment
from fsdata.samples.holdout import check_holdout_args, split_last, write_eval_file

log = logging.getLogger("fsdata.convert")

FORMATS = ("sequences", "events")
SAMPLE_MODES = ("per-user", "per-event")
#: Parquet key-value metadata key holding the JSON conversion summary.
CONVERT_META_KEY = b"freescale.convert"


@dataclass(kw_only=True, slots=True)
class ConvertSummary:
    """What a conversion read and wrote (also stored in the output's Parquet metadata)."""

    input: str
    format: str
    samples: str
    max_seq_len: int
    num_users: int
    num_events: int
    num_samples: int
    num_users_skipped: int
    """Users with fewer than 2 items: no (history, target) pair exists."""
    num_items_truncated: int
    """History items cut by ``max_seq_len`` summed over samples."""
    holdout: dict | None = None
    """With ``--holdout last``: :class:`fsdata.samples.holdout.HoldoutSummary` as a dict."""


def _check_input_file(path: Path) -> None:
    if not path.exists():
        raise InputError(f"input {path} does not exist; pass an existing file")
    if path.is_dir():
        raise InputError(f"input {path} is a directory; convert takes one file")
    if path.stat().st_size == 0:
        raise InputError(f"input {path} is empty; pass a file with interactions")


def read_sequences(path: Path) -> pl.DataFrame:
    """Read ``user item1 item2 ...`` lines.

    Returns:
        DataFrame ``user_id`` int64, ``item_ids`` list<int64> (chronological).

    Raises:
        InputError: empty file, a line without items, or a token that is not an integer.
    """
    _check_input_file(path)
    tokens = (pl.scan_lines(str(path)).select(line=pl.col("line").str.strip_chars_start("\ufeff").str.strip_chars())
              .filter(pl.col("line") != ""))  # a UTF-8 byte order mark before the first line is not a token
    try:
        df = (tokens.select(parts=pl.col("line").str.split(" ").list.eval(
            pl.element().filter(pl.element() != "").cast(pl.Int64, strict=True))).collect())
    except pl.exceptions.PolarsError as e:
        raise_if_environment(e, path, action="read")
        where = _first_bad_token(path)
        raise InputError(f"input {path}{where} every token of a sequences line must be an integer "
                         f"('user item1 item2 ...'); check --format, or map ids to integers first") from None
    if df.height == 0:
        raise InputError(f"input {path} has no non-blank lines; expected 'user item1 item2 ...' per line")
    df = df.select(user_id=pl.col("parts").list.first(), item_ids=pl.col("parts").list.slice(1))
    neg = df.with_row_index("_line", offset=1).filter(
        (pl.col("user_id") < 0) | (pl.col("item_ids").list.min() < 0)).head(1)
    if neg.height:
        raise InputError(f"input {path}: non-blank line {neg['_line'][0]} has a negative id; user and item ids "
                         "must be >= 0: map them to non-negative integers first")
    return df


def _first_bad_token(path: Path) -> str:
    """`` line N: token 'x' is not an integer;`` for the first such token of a sequences file, else ``:``."""
    try:
        rows = (pl.scan_lines(str(path)).with_row_index("_line", offset=1)
                .select("_line", tok=pl.col("line").str.strip_chars_start("\ufeff").str.strip_chars().str.split(" "))
                .explode("tok").filter(pl.col("tok") != "")
                .filter(pl.col("tok").cast(pl.Int64, strict=False).is_null())
                .head(1).collect())
    except pl.exceptions.PolarsError:
        return ":"
    if rows.height == 0:
        return ":"
    tok = rows["tok"][0]
    tok = tok if len(tok) <= 40 else tok[:37] + "..."
    return f" line {rows['_line'][0]}: token '{tok}' is not an integer;"



#: Column names that look like an event time (case-insensitive), for the missing --time-col warning.
_TIME_LIKE = re.compile(r"^(time|ts|date|datetime|timestamp.*|.*_?timestamp|.*_time|.*_ts|.*_at|event_?time|"
                        r"unix_?time|epoch)$", re.IGNORECASE)


def _warn_time_col(path: Path, names: list[str], used: list[str]) -> None:
    """Warn (one line) when the input has a time-like column but ``--time-col`` was not given."""
    cands = [n for n in names if n not in used and _TIME_LIKE.match(n)]
    if cands:
        log.warning("input %s has a column '%s' that looks like event time, but --time-col was not given: each "
                    "user's events keep file order; pass --time-col %s to sort them by time", path, cands[0],
                    cands[0])


def _locate_bad_rows(ev: pl.DataFrame, names: dict[str, str], header_lines: int, text: bool) -> str:
    """Name the first row whose value is null or not an integer: ``line N, column 'c': 'x'``."""
    for c in [c for c in ev.columns if c != "_row"]:
        col = ev[c]
        bad = col.is_null()
        bad = bad | (col.cast(pl.Int64, strict=False).is_null())  # text, floats, and ids >= 2^63
        idx = bad.arg_true()
        if len(idx):
            i = int(idx[0])
            row = int(ev["_row"][i])
            where = f"line {row + 1 + header_lines}" if text else f"row {row}"
            value = col[i]
            shown = "empty (blank line or missing field)" if value is None else f"'{value}'"
            if value is not None and col.dtype.is_integer():
                shown += " (does not fit int64: ids must be below 2^63)"
            return f"{where}, column '{names.get(c, c)}': {shown}"
    return ""


def _check_non_negative(ev: pl.DataFrame, path: Path, names: dict[str, str], header_lines: int, text: bool) -> None:
    """User and item ids must be >= 0 (fstrain's embedding tables index them).

    Raises:
        InputError: the first negative id, with its line (text) or row (Parquet).
    """
    for c in ("user_id", "item_id"):
        idx = (ev[c] < 0).arg_true()
        if len(idx):
            i = int(idx[0])
            row = int(ev["_row"][i])
            where = f"line {row + 1 + header_lines}" if text else f"row {row}"
            raise InputError(f"input {path} {where}, column '{names.get(c, c)}': id {int(ev[c][i])} is negative; "
                             "user and item ids must be >= 0: map them to non-negative integers first")


def read_events(path: Path, *, user_col: str, item_col: str, time_col: str | None,
                sep: str | None, has_header: bool | None) -> pl.DataFrame:
    """Read an events file and group it into per-user chronological sequences.

    Args:
        path: ``.parquet``, ``.csv``/``.tsv``, or whitespace-separated ``user item [time]`` text.
        user_col, item_col, time_col: column names (for header-less text: ``column_1`` ... or
            0-based positions given as ``0``, ``1``, ``2``).
        sep: field separator for text input (default: ``,`` for .csv, tab for .tsv, else space).
        has_header: whether the text has a header line (default: True for .csv/.tsv, else False).

    Returns:
        DataFrame ``user_id`` int64, ``item_ids`` list<int64> and, with ``time_col``,
        ``timestamps`` list<int64>; users in order of first appearance.

    Raises:
        InputError: unreadable file, missing columns, non-integer values or nulls.
    """
    _check_input_file(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            lf = pl.scan_parquet(str(path))
        else:
            if sep is None:
                sep = "," if suffix == ".csv" else "\t" if suffix == ".tsv" else " "
            if has_header is None:
                has_header = suffix in (".csv", ".tsv")
            lf = pl.scan_csv(str(path), separator=sep, has_header=has_header, infer_schema_length=10000)
        names = lf.collect_schema().names()
    except (pl.exceptions.PolarsError, OSError) as e:
        raise_if_environment(e, path, action="read")
        raise InputError(f"input {path}: cannot read ({str(e).splitlines()[0]}); "
                         "check --format, --sep and header settings") from None

    def resolve(col: str | None, flag: str) -> str | None:
        if col is None:
            return None
        if col in names:
            return col
        if col.isdigit() and int(col) < len(names):
            return names[int(col)]
        raise InputError(f"input {path}: no column '{col}' for {flag}; columns are {names}; "
                         f"pass {flag} NAME (or a 0-based position)")

    u, i, t = resolve(user_col, "--user-col"), resolve(item_col, "--item-col"), resolve(time_col, "--time-col")
    if t is None:
        _warn_time_col(path, names, [u, i])
    cols = [pl.col(u).alias("user_id"), pl.col(i).alias("item_id")]
    if t:
        cols.append(pl.col(t).alias("ts"))
    text = suffix != ".parquet"
    given = {"user_id": u, "item_id": i, "ts": t}
    header_lines = 1 if text and has_header else 0
    try:
        raw = lf.select(cols).with_row_index("_row").collect()
    except (pl.exceptions.PolarsError, OSError) as e:
        raise_if_environment(e, path, action="read")
        raise InputError(f"input {path}: cannot parse ({str(e).splitlines()[0]}); "
                         "check --format, --sep and header settings") from None
    try:
        ev = raw.with_columns([pl.col(c).cast(pl.Int64, strict=True) for c in raw.columns if c != "_row"])
    except pl.exceptions.PolarsError:
        where = _locate_bad_rows(raw, given, header_lines, text)
        raise InputError(f"input {path} {where}: user, item and time columns must be integers; "
                         "map ids to integers first") from None
    if ev.height == 0:
        raise InputError(f"input {path} has no events")
    nulls = {c: n for c, n in zip(ev.columns, ev.null_count().row(0)) if n}
    if nulls:
        where = _locate_bad_rows(raw, given, header_lines, text)
        raise InputError(f"input {path}: null values in {nulls}, first at {where}; drop or fill those rows first")
    _check_non_negative(ev, path, given, header_lines, text)
    dup = ev.height - ev.select([c for c in ev.columns if c != "_row"]).n_unique()
    if dup:
        log.warning("input %s has %d exact duplicate events (same user, item%s); they are kept as separate "
                    "interactions: deduplicate the log first if they are logging repeats", path, dup,
                    " and time" if t else "")
    order = ["user_id", "ts", "_row"] if t else ["user_id", "_row"]
    first_seen = ev.group_by("user_id").agg(pl.col("_row").min().alias("_first"))
    ev = ev.join(first_seen, on="user_id").sort(["_first"] + order[1:])
    aggs = [pl.col("item_id").alias("item_ids")]
    if t:
        aggs.append(pl.col("ts").alias("timestamps"))
    return ev.group_by("_first", maintain_order=True).agg(pl.col("user_id").first(), *aggs).drop("_first")


def _window_samples(users: pl.DataFrame, mode: str, max_seq_len: int, first_sample_id: int) -> tuple[pa.Table, int]:
    """Build samples for a chunk of users with vectorised offset arithmetic (no per-sample loop)."""
    items = users["item_ids"]
    n = items.list.len().cast(pl.Int64).to_numpy()
    flat = items.explode().to_numpy().astype(np.int64, copy=False)
    base = np.concatenate([[0], np.cumsum(n)[:-1]])
    has_ts = "timestamps" in users.columns
    flat_ts = users["timestamps"].explode().to_numpy().astype(np.int64, copy=False) if has_ts else None
    if mode == "per-user":
        per_user = (n >= 2).astype(np.int64)
        t = n - 1
        sample_user = np.flatnonzero(per_user)
        t = t[sample_user]
    else:
        per_user = np.maximum(n - 1, 0)
        sample_user = np.repeat(np.arange(len(n)), per_user)
        starts = np.concatenate([[0], np.cumsum(per_user)[:-1]])
        t = np.arange(len(sample_user)) - np.repeat(starts, per_user) + 1
    hist_start = np.maximum(t - max_seq_len, 0)
    hist_len = t - hist_start
    truncated = int((t - hist_len).sum())
    abs_start = base[sample_user] + hist_start
    offsets = np.concatenate([[0], np.cumsum(hist_len)]).astype(np.int64)
    gather = np.repeat(abs_start - offsets[:-1], hist_len) + np.arange(offsets[-1])
    target_pos = base[sample_user] + t
    uid = users["user_id"].to_numpy().astype(np.int64, copy=False)
    cols = {
        S.SAMPLE_ID: pa.array(np.arange(first_sample_id, first_sample_id + len(t), dtype=np.int64)),
        S.USER_ID: pa.array(uid[sample_user]),
        S.ITEM_IDS: pa.LargeListArray.from_arrays(offsets, flat[gather]).cast(pa.list_(pa.int64())),
        S.TARGET_ITEM_ID: pa.array(flat[target_pos]),
    }
    if has_ts:
        cols[S.TIMESTAMPS] = pa.LargeListArray.from_arrays(offsets, flat_ts[gather]).cast(pa.list_(pa.int64()))
    cols[S.SEQ_LEN] = pa.array(hist_len.astype(np.int32))
    return pa.table(cols, schema=S.sample_schema(has_ts, with_seq_len=True)), truncated


def convert(input_path: str | os.PathLike, output_path: str | os.PathLike, *, fmt: str, samples: str = "per-event",
            max_seq_len: int = 512, user_col: str = "0", item_col: str = "1", time_col: str | None = None,
            sep: str | None = None, has_header: bool | None = None, overwrite: bool = False,
            users_per_chunk: int = 2000, progress: bool = True, holdout: str = "none",
            holdout_output: str | os.PathLike | None = None) -> ConvertSummary:
    """Convert an interaction log into one Parquet file of samples (atomically).

    Args:
        input_path: the log (see module docstring for formats).
        output_path: the Parquet file to write.
        fmt: ``sequences`` or ``events``.
        samples: ``per-user`` or ``per-event``.
        max_seq_len: keep at most this many most recent history items (>= 1).
        user_col, item_col, time_col, sep, has_header: events input layout (see :func:`read_events`).
        overwrite: replace an existing output.
        users_per_chunk: users per written row group batch (bounds memory for per-event).
        progress: show a progress bar.
        holdout: ``none`` or ``last``: hold out each user's last item (:mod:`fsdata.samples.holdout`).
        holdout_output: with ``last``, the evaluation Parquet file to write (atomically, after
            the samples).

    Returns:
        :class:`ConvertSummary`.

    Raises:
        ConfigError: unknown format/mode, ``max_seq_len < 1``, or an output that is (or lies in)
            the input.
        InputError: unreadable or invalid input (the message names the line), or no user with at
            least 2 items.
        EnvironmentFailure: disk full, read-only or permission denied (:mod:`fsdata.guards`).
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format '{fmt}'; use one of {', '.join(FORMATS)}")
    if samples not in SAMPLE_MODES:
        raise ConfigError(f"unknown --samples '{samples}'; use one of {', '.join(SAMPLE_MODES)}")
    if max_seq_len < 1:
        raise ConfigError(f"--max-seq-len must be >= 1, got {max_seq_len}")
    check_output_apart(output_path, [input_path], output_name="output", input_name="input")
    check_holdout_args(holdout, holdout_output)
    if holdout_output:
        check_output_apart(holdout_output, [input_path], output_name="--holdout-output", input_name="input")
        if Path(holdout_output).resolve() == Path(output_path).resolve():
            raise ConfigError(f"--holdout-output {holdout_output} is the training output too; give it its own path")
    if holdout_output and Path(holdout_output).exists() and not overwrite:
        raise ConfigError(f"output {holdout_output} already exists; choose a new path or pass "
                          f"{setting('overwrite_arg', True)} to replace it")
    src = Path(input_path)
    users = read_sequences(src) if fmt == "sequences" else read_events(
        src, user_col=user_col, item_col=item_col, time_col=time_col, sep=sep, has_header=has_header)
    held = None
    if holdout == "last":
        num_events_all = int(users["item_ids"].list.len().cast(pl.Int64).sum())
        users, eval_table, held = split_last(users, max_seq_len)
    n = users["item_ids"].list.len()
    num_events = int(n.cast(pl.Int64).sum())
    skipped = int((n < 2).sum())
    if skipped == users.height:
        raise InputError(f"input {src}: no user has 2 or more items, so no (history, target) sample exists")
    has_ts = "timestamps" in users.columns
    written = truncated = 0
    with atomic_output(output_path, overwrite=overwrite, is_dir=False) as tmp:
        with pq.ParquetWriter(str(tmp), S.sample_schema(has_ts, with_seq_len=True), compression="zstd",
                              write_page_index=False) as writer:
            bar = tqdm(total=users.height, unit="user", desc="convert", disable=not progress)
            for start in range(0, users.height, users_per_chunk):
                chunk = users.slice(start, users_per_chunk)
                table, cut = _window_samples(chunk, samples, max_seq_len, written)
                if table.num_rows:
                    writer.write_table(table, row_group_size=1 << 20)
                written += table.num_rows
                truncated += cut
                bar.update(chunk.height)
            bar.close()
            summary = ConvertSummary(input=str(src), format=fmt, samples=samples, max_seq_len=max_seq_len,
                                     num_users=users.height, num_events=num_events, num_samples=written,
                                     num_users_skipped=skipped, num_items_truncated=truncated)
            if held is not None:
                summary.num_events = num_events_all
                summary.holdout = asdict(held)
            # the file name only: the same log under another path gives the same bytes (and input digest)
            writer.add_key_value_metadata({CONVERT_META_KEY: json.dumps({**asdict(summary),
                                                                          "input": src.name}).encode()})
        if held is not None:
            write_eval_file(eval_table, holdout_output, held, overwrite=overwrite)
    return summary
