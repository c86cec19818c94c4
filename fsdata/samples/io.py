"""Reading sample inputs: one Parquet file, a directory of them, or a glob; schema validation.

Validation (every problem is one :class:`InputError` line naming the fix): the path exists and
holds Parquet, every file is readable, the required columns are present (after ``--columns``
mapping) with integer / list-of-integer types, no nulls, no empty ``item_ids``, ``timestamps``
aligned with ``item_ids``, and ``sample_id`` unique.

The input may be a :mod:`pyarrow.fs` URI (``s3://bucket/samples/``, a file, a prefix or a glob;
:mod:`fsdata.fsio`): its files are then listed and read through the URI's ``FileSystem`` and
:attr:`SampleSource.files` holds their URIs.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.samples import schema as S
from fsdata.samples.diagnose import check_column_map, check_id_range, check_ids_non_negative, text_log_hint
from fsdata.errors import ConfigError, InputError, setting
from fsdata.guards import raise_if_environment


def sorted_unique(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Sorted distinct values and the number of duplicates.

    ``np.unique`` took 22-34 s on 20M int64 ids here (numpy 2.4); a sort and a neighbour compare
    take 0.4 s.

    Args:
        ids: shape ``[N]``, integer.

    Returns:
        ``(distinct values sorted [U], N - U)``.
    """
    s = np.sort(np.asarray(ids))
    if len(s) == 0:
        return s, 0
    keep = np.empty(len(s), dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    distinct = s[keep]
    return distinct, len(s) - len(distinct)


#: Ids within ``[min, min + DENSE_ID_SPAN * N)`` are counted with a bitmap of that span instead of a sort.
DENSE_ID_SPAN = 4


def num_duplicates(ids: np.ndarray) -> int:
    """``N`` minus the number of distinct values of ``ids`` (shape ``[N]``, integer).

    Ids spanning at most ``DENSE_ID_SPAN * N`` values (an OUTPUT's rows, ids from ``fsdata convert``
    or ``synth``) are marked in a bool bitmap of that span (O(N); at most 4 bytes of memory per id,
    plus an int64 copy of the ids shifted to 0 when the smallest is not 0):
    20M shuffled ids 0.16-0.19 s against 0.31-0.35 s for :func:`sorted_unique`'s sort (this machine,
    2026-11-27). Any other span falls back to the sort.
    """
    ids = np.asarray(ids)
    if len(ids) < 2:
        return 0
    lo, hi = int(ids.min()), int(ids.max())
    if hi - lo >= DENSE_ID_SPAN * len(ids):
        return sorted_unique(ids)[1]
    seen = np.zeros(hi - lo + 1, dtype=bool)
    seen[ids - lo if lo else ids] = True
    return len(ids) - int(np.count_nonzero(seen))


def parse_column_map(text: str | None) -> dict[str, str]:
    """Parse ``--columns sample_id=my_id,item_ids=history`` into ``{their_name: contract_name}``.

    Raises:
        ConfigError: malformed pair or an unknown contract column.
    """
    if not text:
        return {}
    out: dict[str, str] = {}
    known = set(S.REQUIRED_COLUMNS) | set(S.OPTIONAL_COLUMNS)
    for part in text.split(","):
        ours, sep, theirs = part.partition("=")
        ours, theirs = ours.strip(), theirs.strip()
        if not sep or not ours or not theirs:
            raise ConfigError(f"{setting('columns')} entry '{part}' must be CONTRACT_NAME=YOUR_NAME, "
                              f"e.g. {setting('columns', 'item_ids=history')}")
        if ours not in known:
            raise ConfigError(f"{setting('columns')}: '{ours}' is not a sample-schema column; use one of "
                              f"{sorted(known)}")
        out[theirs] = ours
    return out


def list_parquet_files(path: str | os.PathLike) -> list[str]:
    """Parquet files of an input: the file itself, ``*.parquet`` below a directory, or a glob.

    Returns:
        Sorted list of file paths (URIs for a remote input; the input's row order is this file
        order, then row order).

    Raises:
        InputError: nothing exists at ``path`` or it holds no Parquet file.
    """
    p = str(fsio.normalize(path))
    if fsio.is_remote(p):
        return _list_remote(p)
    if any(ch in p for ch in "*?["):
        files = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    elif os.path.isdir(p):
        if any(os.path.isfile(os.path.join(p, name)) for name in ("_manifest.json", "manifest.json")):
            raise InputError(f"input {p} is an 'fsdata balance' OUTPUT: 'fsdata profile', 'fsdata balance' and "
                             "'fsdata verify --input' read it as INPUT; here pass the samples' Parquet")
        files = sorted(str(f) for f in Path(p).rglob("*.parquet") if not f.name.startswith("."))
    elif os.path.isfile(p):
        files = [p]
    else:
        raise InputError(f"input {p} does not exist; pass a Parquet file, a directory of Parquet files, or a glob")
    if not files:
        raise InputError(f"input {p} holds no .parquet file; run 'fsdata convert' first or point at the files")
    return files


def _list_remote(p: str) -> list[str]:
    """:func:`list_parquet_files` of a URI: a glob, a prefix (``*.parquet`` below it, hidden names
    skipped) or one object."""
    try:
        if fsio.has_glob(p):
            files = fsio.glob_remote(p)
        elif fsio.is_dir(p):
            files = [f for f in fsio.walk_files(p)
                     if (name := fsio.resolve(f).path.rsplit("/", 1)[-1]).endswith(".parquet")
                     and not name.startswith(".")]
        elif fsio.is_file(p):
            files = [p]
        else:
            raise InputError(f"input {p} does not exist; pass a Parquet file, a directory of Parquet files, or a glob")
    except (OSError, pa.ArrowException) as e:
        raise_if_environment(e, p, action="read")
        raise InputError(f"input {p}: cannot list it ({str(e).splitlines()[0]}); check the URI and the "
                         "credentials (AWS_* environment variables for s3://)") from None
    if not files:
        raise InputError(f"input {p} holds no .parquet file; run 'fsdata convert' first or point at the files")
    return files


def unknown_null_columns(meta: pq.FileMetaData, row_groups, rename: dict[str, str]) -> set[str]:
    """Contract-named columns whose null count the footer ``meta`` does not prove to be 0 in
    ``row_groups`` (statistics missing, or a non-zero null count: an empty list may count as a leaf
    null); only these need a scan. Every engine validates nulls by this rule.

    Args:
        meta: a Parquet file's footer.
        row_groups: the row-group indices to look at.
        rename: ``{their_name: contract_name}``.
    """
    unknown: set[str] = set()
    for rg in row_groups:
        group = meta.row_group(rg)
        for j in range(group.num_columns):
            col = group.column(j)
            top = col.path_in_schema.split(".")[0]
            st = col.statistics
            if st is None or not st.has_null_count or st.null_count:
                unknown.add(rename.get(top, top))
    return unknown


def skip_rows(batches, skip: int):
    """The record batches ``batches`` without their first ``skip`` rows (in order)."""
    for batch in batches:
        if skip:
            if batch.num_rows <= skip:
                skip -= batch.num_rows
                continue
            batch, skip = batch.slice(skip), 0
        yield batch


def row_groups_from(meta: pq.FileMetaData, start: int) -> list[int]:
    """The row groups of a file (footer ``meta``) that hold rows ``start ..`` of it."""
    out, first = [], 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if first + n > start:
            out.append(g)
        first += n
    return out


@dataclass(kw_only=True, slots=True)
class SampleSource:
    """A validated sample input.

    Attributes:
        path: what the user passed.
        files: the Parquet files, in input order.
        rename: ``{their_name: contract_name}`` applied on read.
        columns: contract-named columns, in file order.
        num_rows: total rows.
        has_timestamps: whether the optional ``timestamps`` column is present.
        has_seq_len: whether the optional ``seq_len`` column is present (then lengths are read
            from it without decoding ``item_ids``; balance and verify check it against the lists).
        row_starts: per file, the first row read (rows ``start .. end of file``; an OUTPUT's rank
            files read in place from a step, :mod:`fsdata.shards.as_input`); None: every row.
            ``num_rows`` counts the rows read; every reader of the source honours it.
        drop_columns: file columns not read (an OUTPUT's ``step`` and ``rank``); not in ``columns``.
        digest_files: the files whose footers identify the input in its digest
            (:func:`fsdata.shards.plan_file.input_digest`); None: ``files``.
        selection: which rows of the files are read, hashed into the input digest ("": all).
    """

    path: str
    files: list[str]
    rename: dict[str, str] = field(default_factory=dict)
    columns: list[str] = field(default_factory=list)
    num_rows: int = 0
    has_timestamps: bool = False
    has_seq_len: bool = False
    row_starts: list[int] | None = None
    drop_columns: tuple[str, ...] = ()
    digest_files: list[str] | None = None
    selection: str = ""

    @property
    def file_columns(self) -> list[str] | None:
        """The file columns read (their names, in file order); None: every column."""
        if not self.drop_columns:
            return None
        theirs = {v: k for k, v in self.rename.items()}
        return [theirs.get(c, c) for c in self.columns]

    def scan(self) -> pl.LazyFrame:
        """Lazy frame of the rows read (``row_starts``) with contract column names, without
        ``drop_columns`` (Polars streaming friendly)."""
        if self.row_starts is None or not any(self.row_starts):
            lf = fsio.scan_parquet(self.files)
        else:
            lf = pl.concat([fsio.scan_parquet([f]).slice(start) for f, start in zip(self.files, self.row_starts,
                                                                                   strict=True)], how="vertical")
        if self.drop_columns:
            lf = lf.drop(self.drop_columns)
        return lf.rename(self.rename) if self.rename else lf

    def iter_batches(self, batch_size: int):
        """Record batches of the rows read (``row_starts``; the file columns without
        ``drop_columns``, their names), in input order.

        Raises:
            pyarrow.ArrowException, OSError: a file fails to read.
        """
        for i, path in enumerate(self.files):
            fs, inner = fsio.filesystem_and_path(path)
            pf = pq.ParquetFile(inner, filesystem=fs, pre_buffer=False)
            skip = 0 if self.row_starts is None else self.row_starts[i]
            groups = row_groups_from(pf.metadata, skip)
            skip -= sum(pf.metadata.row_group(g).num_rows for g in range(groups[0] if groups else 0))
            yield from skip_rows(pf.iter_batches(batch_size=batch_size, row_groups=groups, columns=self.file_columns),
                                 skip)

    def _null_counts(self) -> dict[str, int]:
        """Null counts per contract column from Parquet statistics (footers only); a full scan for
        columns whose statistics are missing or non-zero (an empty list may count as a leaf null)."""
        counts: dict[str, int] = {c: 0 for c in self.columns}
        unknown: set[str] = set()
        for i, f in enumerate(self.files):
            meta = fsio.read_parquet_metadata(f)
            start = 0 if self.row_starts is None else self.row_starts[i]
            unknown |= unknown_null_columns(meta, row_groups_from(meta, start), self.rename)
        unknown &= set(self.columns)
        if unknown:
            lf = self.scan()
            exprs = []
            for c in sorted(unknown):
                if c in (S.ITEM_IDS, S.TIMESTAMPS):
                    # null lists, plus null elements inside non-null lists (a null list counts once)
                    exprs.append((pl.col(c).null_count()
                                  + pl.col(c).drop_nulls().explode(empty_as_null=False).null_count()).alias(c))
                else:
                    exprs.append(pl.col(c).null_count().alias(c))
            counts.update(lf.select(exprs).collect(engine="streaming").row(0, named=True))
        return counts

    def lengths_and_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """Sequence lengths and sample ids in input order (validating nulls and empty lists).

        Returns:
            ``(lengths int64 [N], sample_ids int64 [N])``.

        Raises:
            InputError: nulls, empty ``item_ids``, misaligned ``timestamps``, duplicate ids.
        """
        lf = self.scan()
        length = pl.col(S.SEQ_LEN) if self.has_seq_len else pl.col(S.ITEM_IDS).list.len()
        exprs = [pl.col(S.SAMPLE_ID).cast(pl.Int64), length.cast(pl.Int64).alias("_len")]
        if self.has_timestamps:
            exprs.append(pl.col(S.TIMESTAMPS).list.len().cast(pl.Int64).alias("_tlen"))
        try:
            df = lf.select(exprs).collect(engine="streaming")
            nulls = self._null_counts()
        except (pl.exceptions.PolarsError, OSError, pa.ArrowException) as e:
            raise_if_environment(e, self.path, action="read")
            raise InputError(f"input {self.path}: cannot read ({str(e).splitlines()[0]}); "
                             "the file is corrupt or not Parquet: regenerate it") from None
        lengths = df["_len"].to_numpy()
        ids = df[S.SAMPLE_ID].to_numpy()
        mismatched = int((df["_tlen"].to_numpy() != lengths).sum()) if self.has_timestamps else 0
        check_lengths_and_ids(self.path, lengths, ids, nulls=nulls, timestamp_mismatches=mismatched)
        return lengths, ids


def check_lengths_and_ids(path: str, lengths: np.ndarray, ids: np.ndarray, *, nulls: dict[str, int],
                          timestamp_mismatches: int) -> None:
    """The input checks every engine makes on the lengths it read (one wording for all engines).

    Args:
        path: the input, for the message.
        lengths: shape ``[N]``, int64, ``len(item_ids)`` per sample.
        ids: shape ``[N]``, int64, ``sample_id`` per sample.
        nulls: null count per column.
        timestamp_mismatches: samples whose ``timestamps`` length differs from ``item_ids``'.

    Raises:
        InputError: nulls, an empty history, misaligned timestamps, or a repeated ``sample_id``.
    """
    # ids in increasing order (as fsdata convert and synth write them) have no duplicate: one
    # compare instead of a sort of N ids (20M: 0.03 s against 1.5 s, docs/results/bench_offline_stage.md)
    increasing = len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1]))
    duplicates = 0 if increasing else num_duplicates(ids)
    check_input_counts(path, nulls=nulls, num_empty=int((lengths == 0).sum()) if len(lengths) else 0,
                       timestamp_mismatches=timestamp_mismatches, num_duplicate_ids=duplicates)


def check_input_counts(path: str, *, nulls: dict[str, int], num_empty: int, timestamp_mismatches: int,
                       num_duplicate_ids: int) -> None:
    """:func:`check_lengths_and_ids` on counts an engine gathered piecewise (same words, same order).

    Args:
        path: the input, for the message.
        nulls: null count per column.
        num_empty: samples with an empty ``item_ids``.
        timestamp_mismatches: samples whose ``timestamps`` length differs from ``item_ids``'.
        num_duplicate_ids: ``N`` minus the number of distinct ``sample_id`` values.

    Raises:
        InputError: nulls, an empty history, misaligned timestamps, or a repeated ``sample_id``.
    """
    bad = {k: v for k, v in nulls.items() if v}
    if bad:
        raise InputError(f"input {path}: null values {bad}; the sample schema allows no nulls: "
                         "drop or fill those rows")
    if num_empty:
        raise InputError(f"input {path}: {num_empty} samples have empty item_ids; "
                         "every sample needs a non-empty history: drop them")
    if timestamp_mismatches:
        raise InputError(f"input {path}: {timestamp_mismatches} samples have timestamps not aligned with item_ids "
                         "(different lengths); fix or drop the timestamps column")
    if num_duplicate_ids:
        raise InputError(f"input {path}: sample_id is not unique ({num_duplicate_ids} "
                         "duplicates); give every sample its own id")


def _is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(t)


def open_samples(path: str | os.PathLike, column_map: str | dict | None = None) -> SampleSource:
    """Open and validate the schema of a sample input (reads only the Parquet footers).

    Args:
        path: a Parquet file, a directory (``*.parquet`` below it) or a glob.
        column_map: ``--columns`` text or a parsed ``{their_name: contract_name}`` dict.

    Returns:
        :class:`SampleSource`.

    Raises:
        InputError: missing path, no Parquet (a text log is named as such), corrupt file, missing or
            mistyped columns, uint64 ids above the int64 maximum, no rows, files with different schemas.
        ConfigError: a ``--columns`` entry names a column the input lacks or collides with another.
        EnvironmentFailure: a file cannot be read for permission or I/O reasons (:mod:`fsdata.guards`).
    """
    path = fsio.normalize(path)
    rename = parse_column_map(column_map) if not isinstance(column_map, dict) else column_map
    return open_sample_files(path, list_parquet_files(path), rename)


def open_sample_files(path: str | os.PathLike, files: list[str], rename: dict[str, str], *,
                      row_starts: list[int] | None = None, drop_columns: tuple[str, ...] = ()) -> SampleSource:
    """:func:`open_samples` of listed files: ``path`` names the input in messages; ``row_starts``
    and ``drop_columns`` as in :class:`SampleSource` (an OUTPUT's rank files read in place).

    Raises:
        InputError: as :func:`open_samples`; a row start past the end of its file.
    """
    first_schema = None
    num_rows = 0
    files_seen: list[str] = []
    for f in files:
        try:
            fs, where = fsio.filesystem_and_path(f)
            meta = pq.read_metadata(where, filesystem=fs)
            sch = pq.read_schema(where, filesystem=fs)
        except (pa.ArrowException, OSError) as e:
            raise_if_environment(e, f, action="read")
            hint = text_log_hint(f)
            if hint:
                raise InputError(f"input file {f} is not readable Parquet: {hint}") from None
            raise InputError(f"input file {f} is not readable Parquet ({str(e).splitlines()[0]}); "
                             "it is corrupt or truncated: regenerate it") from None
        if first_schema is None:
            first_schema = sch
        elif not sch.equals(first_schema):
            raise InputError(f"input file {f} has a different schema from {files[0]}; all files must match")
        start = 0 if row_starts is None else row_starts[len(files_seen)]
        if not 0 <= start <= meta.num_rows:
            raise InputError(f"input file {f}: row {start} is past its {meta.num_rows} rows; the file changed: rerun")
        files_seen.append(f)
        num_rows += meta.num_rows - start
    if first_schema is None:  # list_parquet_files returns at least one file
        raise InputError(f"input {path} holds no Parquet file")
    if drop_columns:
        first_schema = pa.schema([fl for fl in first_schema if fl.name not in drop_columns])
    check_column_map(rename, first_schema.names, path)
    names = [rename.get(n, n) for n in first_schema.names]
    types = dict(zip(names, first_schema.types))
    missing = [c for c in S.REQUIRED_COLUMNS if c not in types]
    if missing:
        raise InputError(f"input {path} lacks required columns {missing} (has {first_schema.names}); "
                         f"add them or map yours with {setting('columns', 'sample_id=...,item_ids=...')}")
    for c in (S.SAMPLE_ID, S.USER_ID, S.TARGET_ITEM_ID) + ((S.SEQ_LEN,) if S.SEQ_LEN in types else ()):
        if not _is_int(types[c]):
            raise InputError(f"input {path}: column {c} has type {types[c]}, expected int64; cast it to integers")
    for c in (S.ITEM_IDS, S.TIMESTAMPS):
        if c not in types:
            continue
        t = types[c]
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not _is_int(t.value_type):
            raise InputError(f"input {path}: column {c} has type {t}, expected list<int64>; "
                             "store it as a list of integers")
    if num_rows == 0:
        raise InputError(f"input {path} has no rows; it must hold at least one step of samples")
    check_id_range(files, first_schema, rename, [S.SAMPLE_ID, S.USER_ID, S.TARGET_ITEM_ID, S.ITEM_IDS], path)
    check_ids_non_negative(files, first_schema, rename, [S.USER_ID, S.TARGET_ITEM_ID, S.ITEM_IDS], path)
    return SampleSource(path=str(path), files=files, rename=rename, columns=names, num_rows=num_rows,
                        has_timestamps=S.TIMESTAMPS in types, has_seq_len=S.SEQ_LEN in types,
                        row_starts=None if row_starts is None else list(row_starts), drop_columns=tuple(drop_columns))
