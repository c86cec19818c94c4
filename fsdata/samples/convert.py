"""``fsdata convert``: turn a raw interaction log into training samples (the sample schema).

Input formats (docs/fsdata.md):

* ``sequences``: one user per line, ``user item1 item2 ...`` in chronological order.
* ``events``: one interaction per row: whitespace-separated ``user item`` lines, or CSV/Parquet
  with user, item and optional timestamp columns (``--user-col/--item-col/--time-col``).
  Without a timestamp column, rows are taken in file order (assumed chronological per user); with
  one, each user's events are stably sorted by time.

Sample modes:
* ``per-user``: one sample per user with 2 or more items: history = all but the last (at most
  ``max_seq_len`` most recent), target = the last item.
* ``per-event``: one sample per interaction ``t >= 1`` of each user: history = up to ``max_seq_len`` items
  before ``t``, target = item ``t`` (how industrial training data is built).

The output also holds ``seq_len`` (int32, ``len(item_ids)``), so later passes (profile, balance)
read lengths without decoding the lists. ``sample_id`` is the 0-based row number of the output, in user order then time
order. Users with fewer than 2 items yield no sample; they are counted in the summary and in the file's metadata.

Memory is bounded, whatever the input size (the input is streamed, never held whole):

* ``sequences`` files are parsed in blocks of :data:`BLOCK_BYTES`; a line longer than
  :data:`MAX_LINE_BYTES` is refused with its line number.
* ``events`` inputs estimated above ``events_per_bucket`` events are read a block at a time
  (PyArrow's streaming CSV reader, Parquet record batches) and split by a hash of the user id
  into buckets (every :data:`fsdata.samples.events._SPOOL_EVENTS` events sorted by bucket and written as one
  temporary Parquet file, one row group per bucket), each bucket is grouped into per-user sequences on its
  own, and the buckets are merged back in order of each user's first event, so the output is the one an in-memory
  grouping gives. Smaller inputs are grouped in memory. The temporaries (about the size of the
  decoded input, lz4-compressed) live in a hidden ``.OUTPUT.tmp-PID-spool`` folder beside the
  output and are removed when convert ends (or by the next run, if it was killed).
* Users are turned into samples ``users_per_chunk`` at a time (fewer when their events pass
  :data:`fsdata.samples.events.MAX_EVENTS_PER_CHUNK`), and one chunk's samples are written in pieces of at most
  ``max_items_per_piece`` history items (each piece is one or more Parquet row groups).

Limits: one ``events`` user's whole history, one block of spooled events, one temporary bucket (about
``events_per_bucket`` events, more when one user dominates it) and one piece are held in memory at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from fsdata import fsio
from fsdata.samples import schema as S
from fsdata.atomic import atomic_output, check_replaceable
from fsdata.errors import ConfigError, InputError, setting
from fsdata.guards import check_output_apart, raise_if_environment
from fsdata.samples.events import _check_input_file, _chunks, _events, _open_events, iter_events, read_raw
from fsdata.samples.settings import LOG_FORMATS, SAMPLE_MODES, ConvertSettings  # noqa: F401 (SAMPLE_MODES: API)
from fsdata.samples.holdout import EvalSpool, HoldoutSummary, check_holdout_args, split_last
from fsdata.samples import ids as I
from fsdata.samples import sniff as Sn
from fsdata.samples.vocab import Vocabulary, vocab_dir_for

log = logging.getLogger("fsdata.convert")

FORMATS = LOG_FORMATS
#: Parquet key-value metadata key holding the JSON conversion summary.
CONVERT_META_KEY = b"freescale.convert"
#: Bytes of a ``sequences`` file parsed at once (plus the rest of the last line).
BLOCK_BYTES = 16 << 20
#: Longest ``sequences`` line accepted, in bytes (about 4 million ids); a longer one is refused.
MAX_LINE_BYTES = 32 << 20
#: Default events per temporary bucket of the ``events`` path; an input estimated at fewer events is
#: grouped in memory.
EVENTS_PER_BUCKET = 1_000_000
MAX_ITEMS_PER_PIECE = 1 << 24


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
    num_items: int = 0
    """Embedding-table size a model needs: largest item index (or id) + 1 over training and held-out data
    (and every item of the vocabulary); 0 is padding."""
    vocab: dict | None = None
    """With mapped ids: ``{"digest": "sha256:<hex>", "path": "OUTPUT.vocab" relative to the output's folder}``."""
    feature_columns: list[str] = field(default_factory=list)
    """Event columns carried as lists aligned with ``item_ids`` (``--feature-cols``)."""
    bad_lines_skipped: int = 0
    """Input lines skipped by ``--bad-lines skip``."""


def iter_sequences(path: Path, *, block_bytes: int | None = None,
                   max_line_bytes: int | None = None) -> Iterator[pl.DataFrame]:
    """Read ``user item1 item2 ...`` lines, a block of about ``block_bytes`` at a time.

    Args:
        path: the text file (UTF-8; a byte order mark is ignored; blank lines are skipped).
        block_bytes: bytes parsed at once (the block is extended to the end of its last line);
            default :data:`BLOCK_BYTES`.
        max_line_bytes: longest line accepted; default :data:`MAX_LINE_BYTES`.

    Yields:
        DataFrames ``user_id`` int64, ``item_ids`` list<int64> (chronological), in file order.

    Raises:
        InputError: empty file, a line without items, a token that is not an integer, a negative
            id, or a line longer than ``max_line_bytes`` (each names the line).
    """
    _check_input_file(path)
    block_bytes = block_bytes or BLOCK_BYTES
    max_line_bytes = max_line_bytes or MAX_LINE_BYTES
    lines_before = nonblank_before = 0
    carry = b""
    with open(path, "rb") as f:
        while True:
            data = f.read(block_bytes)
            buf = carry + data if carry else data
            if data:
                cut = buf.rfind(b"\n") + 1
                block, carry = buf[:cut], buf[cut:]
                if len(carry) > max_line_bytes:
                    _refuse_long_line(path, lines_before + block.count(b"\n") + 1, len(carry), max_line_bytes)
                if not block:
                    continue
            else:
                block, carry = buf, b""
                if not block:
                    break
            df = _parse_sequences_block(path, block, lines_before, nonblank_before, max_line_bytes)
            lines_before += block.count(b"\n")
            nonblank_before += df.height
            if df.height:
                yield df
    if nonblank_before == 0:
        raise InputError(f"input {path} has no non-blank lines; expected 'user item1 item2 ...' per line")


def _refuse_long_line(path: Path, line: int, num_bytes: int, max_line_bytes: int) -> None:
    raise InputError(f"input {path} line {line} is longer than {max_line_bytes >> 20} MiB ({num_bytes:,}+ bytes); "
                     f"a sequences line holds one user: split very long histories, or give the log as "
                     f"--format events (one 'user item' per line)")


def _parse_sequences_block(path: Path, block: bytes, lines_before: int, nonblank_before: int,
                           max_line_bytes: int) -> pl.DataFrame:
    """Parse whole lines of a ``sequences`` file (``lines_before`` physical, ``nonblank_before`` non-blank
    lines precede ``block``; both only name lines in errors)."""
    lines = pl.scan_lines(block).select(line=pl.col("line").str.strip_chars_start("\ufeff").str.strip_chars())
    # a UTF-8 byte order mark before the first line is not a token
    long = (pl.scan_lines(block).with_row_index("_line", offset=lines_before + 1)
            .filter(pl.col("line").str.len_bytes() > max_line_bytes).head(1).collect())
    if long.height:
        _refuse_long_line(path, int(long["_line"][0]), len(long["line"][0].encode()), max_line_bytes)
    try:
        df = (lines.filter(pl.col("line") != "").select(parts=pl.col("line").str.split(" ").list.eval(
            pl.element().filter(pl.element() != "").cast(pl.Int64, strict=True))).collect())
    except pl.exceptions.PolarsError as e:
        raise_if_environment(e, path, action="read")
        where = _first_bad_token(block, lines_before)
        raise InputError(f"input {path}{where} every token of a sequences line must be an integer "
                         f"('user item1 item2 ...'); check --format, or map ids to integers first") from None
    df = df.select(user_id=pl.col("parts").list.first(), item_ids=pl.col("parts").list.slice(1))
    neg = df.with_row_index("_line", offset=nonblank_before + 1).filter(
        (pl.col("user_id") < 0) | (pl.col("item_ids").list.min() < 0)).head(1)
    if neg.height:
        raise InputError(f"input {path}: non-blank line {neg['_line'][0]} has a negative id; user and item ids "
                         "must be >= 0: map them to non-negative integers first")
    return df


def _first_bad_token(block: bytes, lines_before: int) -> str:
    """`` line N: token 'x' is not an integer;`` for the first such token of a block, else ``:``."""
    try:
        rows = (pl.scan_lines(block).with_row_index("_line", offset=lines_before + 1)
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


# ---------------------------------------------------------------------------------------------- events

#: Column names that look like an event time (case-insensitive), for the missing --time-col warning.

def _window_samples(users: pl.DataFrame, mode: str, max_seq_len: int, first_sample_id: int,
                    max_items: int = MAX_ITEMS_PER_PIECE,
                    features: dict[str, pa.DataType] | None = None) -> Iterator[tuple[pa.Table, int]]:
    """Build samples for a chunk of users with vectorised offset arithmetic (no per-sample loop).

    Yields:
        ``(table, truncated)`` pieces of consecutive samples, each with at most ``max_items``
        history items (or one sample), in order; one piece when the chunk fits. Each of ``features``
        (a list column of ``users`` aligned with ``item_ids``) becomes a list column aligned with the
        history, cut the same way (after ``seq_len``).
    """
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
    uid = users["user_id"].to_numpy().astype(np.int64, copy=False)
    features = features or {}
    flat_f = {f: users[f].explode().to_numpy() for f in features}
    schema = sample_schema(has_ts, features)
    cum = np.cumsum(hist_len)
    a = 0
    while True:
        done = int(cum[a - 1]) if a else 0
        b = len(t) if not len(t) or cum[-1] - done <= max_items else max(
            a + 1, int(np.searchsorted(cum, done + max_items, side="right")))
        su, tt, hs, hl = sample_user[a:b], t[a:b], hist_start[a:b], hist_len[a:b]
        abs_start = base[su] + hs
        offsets = np.concatenate([[0], np.cumsum(hl)]).astype(np.int64)
        gather = np.repeat(abs_start - offsets[:-1], hl) + np.arange(offsets[-1])
        cols = {
            S.SAMPLE_ID: pa.array(np.arange(first_sample_id + a, first_sample_id + b, dtype=np.int64)),
            S.USER_ID: pa.array(uid[su]),
            S.ITEM_IDS: pa.LargeListArray.from_arrays(offsets, flat[gather]).cast(pa.list_(pa.int64())),
            S.TARGET_ITEM_ID: pa.array(flat[base[su] + tt]),
        }
        if has_ts:
            cols[S.TIMESTAMPS] = pa.LargeListArray.from_arrays(offsets, flat_ts[gather]).cast(pa.list_(pa.int64()))
        cols[S.SEQ_LEN] = pa.array(hl.astype(np.int32))
        for f, ftype in features.items():
            cols[f] = pa.LargeListArray.from_arrays(offsets, pa.array(flat_f[f][gather], ftype)).cast(pa.list_(ftype))
        yield pa.table(cols, schema=schema), int((tt - hl).sum())
        a = b
        if a >= len(t):
            return


# ---------------------------------------------------------------------------------------------- convert

def sample_schema(has_ts: bool, features: dict[str, pa.DataType]) -> pa.Schema:
    """The output schema: :func:`fsdata.samples.schema.sample_schema` with ``seq_len``, then the feature lists."""
    schema = S.sample_schema(has_ts, with_seq_len=True)
    for f, t in features.items():
        schema = schema.append(pa.field(f, pa.list_(t), nullable=False))
    return schema


def _spool_dir(output_path: str | os.PathLike, what: str = "spool") -> Path:
    """A fresh local folder for temporaries: a hidden sibling of a local output (removed by the next run if
    this one is killed, :func:`fsdata.atomic.clean_stale_tmp`), else one under the system temp folder."""
    if fsio.is_remote(output_path):
        return Path(tempfile.mkdtemp(prefix="fsdata-convert-"))
    final = Path(output_path).absolute()
    spool = final.parent / f".{final.name}.tmp-{os.getpid()}-{what}"
    shutil.rmtree(spool, ignore_errors=True)
    spool.mkdir(parents=True)
    return spool


def convert(input_path: str | os.PathLike, output_path: str | os.PathLike, settings: ConvertSettings | None = None, *,
            fmt: str | None = None, samples: str = "per-event", max_seq_len: int = 512, user_col: str | None = None,
            item_col: str | None = None, time_col: str | None = None, sep: str | None = None,
            has_header: bool | None = None, overwrite: bool = False, users_per_chunk: int = 2000, progress: bool = True,
            holdout: str = "none", holdout_output: str | os.PathLike | None = None,
            events_per_bucket: int | None = None, max_items_per_piece: int | None = None, remap_ids: bool = False,
            vocab: str | os.PathLike | None = None, bad_lines: str = "error",
            feature_cols: str | list[str] | None = None) -> ConvertSummary:
    """Convert an interaction log into one Parquet file of samples (atomically, streaming the input).

    Args:
        input_path: the log (see module docstring for formats).
        output_path: the Parquet file to write.
        settings: :class:`~fsdata.samples.settings.ConvertSettings` (``fsdata convert``'s flags): when
            given, the layout below (``fmt`` .. ``feature_cols``) is its fields'; its ``input`` is not read.
        fmt: ``sequences`` or ``events`` (without ``settings``).
        samples: ``per-user`` or ``per-event``.
        max_seq_len: keep at most this many most recent history items (>= 1).
        user_col, item_col, time_col, sep, has_header: events input layout (see :func:`_open_events`:
            ``.parquet``, ``.csv``/``.tsv`` or whitespace-separated text; header-less text columns
            are ``column_1`` ... or 0-based positions ``0``, ``1``, ``2``; ``sep`` defaults to
            ``,`` for .csv, tab for .tsv, else space; ``has_header`` to True for .csv/.tsv).
        overwrite: replace an existing output.
        users_per_chunk: users turned into samples at once (one write, so one or more row groups,
            per chunk; fewer users once their events pass :data:`fsdata.samples.events.MAX_EVENTS_PER_CHUNK`).
        progress: show a progress bar.
        holdout: ``none`` or ``last``: hold out each user's last item (:mod:`fsdata.samples.holdout`).
        holdout_output: with ``last``, the evaluation Parquet file to write (atomically, after the samples).
        events_per_bucket: events input: events per temporary bucket (module docstring; default
            :data:`EVENTS_PER_BUCKET`); inputs estimated at no more (file bytes / 8 for text, rows
            for Parquet) are grouped in memory.
        max_items_per_piece: most history items of one chunk built and written at once (a chunk
            over it is written as several pieces; default :data:`MAX_ITEMS_PER_PIECE`).
        remap_ids: map integer ids to dense indices too (string ids always are; :mod:`fsdata.samples.vocab`).
        vocab: an earlier ``OUTPUT.vocab`` folder (read, never modified): its ids keep their indices, new
            ids are appended; implies mapping. With mapping, the vocabulary is written as ``OUTPUT.vocab/``.
        bad_lines: ``error`` (a text line with the wrong field count is refused, with its number and text)
            or ``skip`` (skipped and counted: ``bad_lines_skipped``).
        feature_cols: numeric event columns (``"rating,action"`` or a list) written as list columns
            aligned with ``item_ids`` (int64 or float64 elements), also in the evaluation file.

    Returns: :class:`ConvertSummary`.

    Raises:
        ConfigError: unknown format/mode, ``max_seq_len < 1``, or an output that is (or lies in) the input.
        InputError: unreadable or invalid input (the message names the line), or no user with at least 2 items.
        EnvironmentFailure: disk full, read-only or permission denied (:mod:`fsdata.guards`).
    """
    if settings is None:  # loose keywords: the settings they make check them (ConvertSettings)
        ConvertSettings(samples=samples, max_seq_len=max_seq_len, bad_lines=bad_lines)  # type: ignore[arg-type]
    else:  # the layout is the settings' (field names as the keywords, ``format`` as ``fmt``)
        fmt, samples, max_seq_len, user_col, item_col, time_col, sep, has_header, feature_cols, bad_lines, remap_ids, \
            vocab = (getattr(settings, k) for k in ConvertSettings.__dataclass_fields__ if k != "input")
    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format '{fmt}'; use one of {', '.join(FORMATS)}")
    check_output_apart(output_path, [input_path], output_name="output", input_name="input")
    check_holdout_args(holdout, holdout_output)
    if holdout_output:
        check_output_apart(holdout_output, [input_path], output_name="--holdout-output", input_name="input")
        if Path(holdout_output).resolve() == Path(output_path).resolve():
            raise ConfigError(f"--holdout-output {holdout_output} is the training output too; give it its own path")
    if holdout_output and Path(holdout_output).exists() and not overwrite:
        raise ConfigError(f"output {holdout_output} already exists; choose a new path or pass "
                          f"{setting('overwrite_arg', True)} to replace it")
    if overwrite:  # before the input is read: only what FreeScale wrote is replaced
        check_replaceable(output_path, "samples", flag=setting("overwrite_arg", True))
        if holdout_output:
            check_replaceable(holdout_output, "eval", name="--holdout-output", flag=setting("overwrite_arg", True))
    vocab_out, prior = vocab_dir_for(output_path), None
    if overwrite and Path(vocab_out).exists():  # replaced at the end: refused now, before any work
        check_replaceable(vocab_out, "vocab", name="vocabulary output", flag=setting("overwrite_arg", True))
    if vocab is not None:
        check_output_apart(vocab_out, [input_path, vocab], output_name="vocabulary output", input_name="input")
        prior = Vocabulary.read(vocab)
    events_per_bucket = events_per_bucket or EVENTS_PER_BUCKET
    max_items_per_piece = max_items_per_piece or MAX_ITEMS_PER_PIECE
    src = Path(input_path)
    prep_dir = _spool_dir(output_path, "input")
    try:
        return _convert(src, output_path, prep_dir, fmt=fmt, samples=samples, max_seq_len=max_seq_len,
                        user_col=user_col, item_col=item_col, time_col=time_col, sep=sep, has_header=has_header,
                        overwrite=overwrite, users_per_chunk=users_per_chunk, progress=progress, holdout=holdout,
                        holdout_output=holdout_output, events_per_bucket=events_per_bucket,
                        max_items_per_piece=max_items_per_piece, remap_ids=remap_ids, prior=prior,
                        vocab_out=vocab_out, bad_lines=bad_lines,
                        feature_cols=[c.strip() for c in feature_cols.split(",") if c.strip()]
                        if isinstance(feature_cols, str) else list(feature_cols or ()))
    except InputError as e:  # a decompressed or rewritten copy keeps the lines: name the user's file
        msg = str(e)
        for name in ("input.txt", "kept.txt"):
            msg = msg.replace(str(prep_dir / name), str(src))
        raise InputError(msg) from None
    finally:
        shutil.rmtree(prep_dir, ignore_errors=True)


def _convert(src: Path, output_path, prep_dir: Path, *, fmt, samples, max_seq_len, user_col, item_col, time_col, sep,
             has_header, overwrite, users_per_chunk, progress, holdout, holdout_output, events_per_bucket,
             max_items_per_piece, remap_ids, prior, vocab_out, bad_lines, feature_cols) -> ConvertSummary:
    """:func:`convert` once its arguments are checked (``prep_dir``: a fresh folder for a copy of the input)."""
    events_src, read_from = None, src
    if fmt == "events":  # columns are resolved (and refused) before any output is touched
        force = {} if prior is None else {"user_id": prior.users.schema["id"] == pl.String,
                                          "item_id": prior.items.schema["id"] == pl.String}
        events_src = _open_events(src, user_col=user_col, item_col=item_col, time_col=time_col, sep=sep,
                                  has_header=has_header, force_string=force, bad_lines=bad_lines, tmp=prep_dir,
                                  feature_cols=tuple(feature_cols))
    elif feature_cols:
        raise ConfigError("--feature-cols needs --format events (a sequences file holds item ids only)")
    else:
        _check_input_file(src)
        kind, comp = Sn.detect(src)
        if kind != "text":
            raise Sn.binary_error(src, fmt, kind)
        if comp:
            read_from = Sn.prepare(src, prep_dir, sep=" ", has_header=False, comp=comp).path
        if remap_ids or prior is not None:
            raise ConfigError("--remap-ids and --vocab need --format events (a sequences file holds integer ids)")
    mapped = events_src is not None and I.needs_map(events_src.kinds, remap_ids, prior)
    if mapped and Path(vocab_out).exists() and not overwrite:
        raise ConfigError(f"output {vocab_out} already exists; choose a new path or pass "
                          f"{setting('overwrite_arg', True)} to replace it")
    new_vocab = None
    if events_src is not None:
        I.check_whole(events_src.raw, events_src.kinds, events_src.where, events_src.given, src)
        if mapped:
            new_vocab = I.build_maps(read_raw(events_src), events_src.kinds, prior, reread=lambda: read_raw(events_src))
    has_ts = events_src is not None and events_src.has_time
    with atomic_output(output_path, overwrite=overwrite, is_dir=False) as tmp:
        spool = _spool_dir(output_path)
        try:
            vocab_files = spool / "vocab" if new_vocab else None  # the vocabulary written now, its tables freed
            vocab_digest, vocab_items = I.write_and_map(new_vocab, vocab_files, events_src) if new_vocab else (None, 0)
            stats: dict = {}
            frames = iter_sequences(read_from) if events_src is None else iter_events(
                events_src, spool, events_per_bucket=events_per_bucket, stats=stats)
            features = events_src.feature_types() if events_src is not None else {}
            eval_spool = EvalSpool(spool / "eval.parquet", features) if holdout == "last" else None
            held = HoldoutSummary(holdout="last", max_seq_len=max_seq_len, num_users_evaluated=0,
                                  num_users_kept_whole=0, num_items_truncated=0) if eval_spool else None
            num_users = num_events = num_events_all = skipped = written = truncated = 0
            max_item = -1
            with pq.ParquetWriter(str(tmp), sample_schema(has_ts, features), compression="zstd",
                                  write_page_index=False) as writer:
                bar = tqdm(unit="user", desc="convert", disable=not progress)
                for chunk in _chunks(frames, users_per_chunk):
                    top = chunk["item_ids"].list.max().max()
                    max_item = max(max_item, -1 if top is None else int(top))
                    if eval_spool is not None:
                        num_events_all += _events(chunk)
                        chunk, eval_table, part = split_last(chunk, max_seq_len, features)
                        eval_spool.add(eval_table)
                        held.num_users_evaluated += part.num_users_evaluated
                        held.num_users_kept_whole += part.num_users_kept_whole
                        held.num_items_truncated += part.num_items_truncated
                    n = chunk["item_ids"].list.len()
                    num_users += chunk.height
                    num_events += int(n.cast(pl.Int64).sum())
                    skipped += int((n < 2).sum())
                    for table, cut in _window_samples(chunk, samples, max_seq_len, written, max_items_per_piece,
                                                      features):
                        if table.num_rows:
                            writer.write_table(table, row_group_size=1 << 20)
                        written += table.num_rows
                        truncated += cut
                    bar.update(chunk.height)
                bar.close()
                if stats.get("num_duplicates"):
                    log.warning("input %s has %d exact duplicate events (same user, item%s); they are kept as "
                                "separate interactions: deduplicate the log first if they are logging repeats",
                                src, stats["num_duplicates"], " and time" if has_ts else "")
                if skipped == num_users:
                    hint = ("; if each line holds one user's whole sequence ('user item1 item2 ...'), pass "
                            "--format sequences") if events_src is not None else ""
                    raise InputError(f"input {src}: no user has 2 or more items, so no (history, target) sample "
                                     f"exists{hint}")
                summary = ConvertSummary(input=str(src), format=fmt, samples=samples, max_seq_len=max_seq_len,
                                         num_users=num_users, num_events=num_events, num_samples=written,
                                         num_users_skipped=skipped, num_items_truncated=truncated)
                if events_src is not None:
                    summary.bad_lines_skipped = events_src.bad_lines_skipped
                    summary.feature_columns = list(features)
                if held is not None:
                    summary.num_events = num_events_all
                    summary.holdout = asdict(held)
                summary.num_items = max(max_item, vocab_items - 1 if vocab_files else -1) + 1
                with (atomic_output(vocab_out, overwrite=overwrite, is_dir=True, kind="vocab") if vocab_files
                      else contextlib.nullcontext()) as vtmp:
                    if vocab_files is not None:
                        shutil.copytree(vocab_files, vtmp, dirs_exist_ok=True)
                        summary.vocab = {"digest": vocab_digest, "path": vocab_out.name}
                    # the file name only: the same log under another path gives the same bytes (and input digest)
                    writer.add_key_value_metadata({CONVERT_META_KEY: json.dumps({**asdict(summary),
                                                                                  "input": src.name}).encode()})
                    writer.close()
                    if eval_spool is not None:
                        eval_spool.write(holdout_output, held, overwrite=overwrite, max_items=max_items_per_piece,
                                         num_items=summary.num_items)
        finally:
            shutil.rmtree(spool, ignore_errors=True)
    return summary
