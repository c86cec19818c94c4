"""Say what is really wrong with an input that does not read as samples.

Reading an input can fail for reasons that have nothing to do with corruption, and the message
must send the user the right way:

* a raw interaction log (text) passed where Parquet samples are expected: run ``fsdata convert``;
* a ``--columns`` entry naming a column the input does not have, or mapping onto a column that
  already exists;
* ids stored as ``uint64`` with values above the int64 maximum the sample schema uses.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.errors import ConfigError, InputError, setting

#: Largest value of the sample schema's int64 ids.
INT64_MAX = 2**63 - 1
_PARQUET_MAGIC = b"PAR1"


def text_log_hint(path: str | os.PathLike, probe_bytes: int = 4096) -> str | None:
    """If ``path`` looks like a text log rather than Parquet, a hint naming ``fsdata convert``.

    A file "looks like text" when it does not start with the Parquet magic ``PAR1``, its first
    ``probe_bytes`` hold no NUL byte, decode as UTF-8 and contain mostly printable characters.

    Returns:
        ``"it looks like a text log (first line '...'); run 'fsdata convert ...' first ..."`` or None.
    """
    try:
        with fsio.open_input(path) as f:
            head = f.read(probe_bytes)
    except OSError:
        return None
    if not head or head.startswith(_PARQUET_MAGIC) or b"\x00" in head:
        return None
    try:
        text = head.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        # a multi-byte character cut at the probe's end is still text
        try:
            text = head[:-4].decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            return None
    printable = sum(ch.isprintable() or ch in "\t\r\n" for ch in text)
    if printable < 0.95 * len(text):
        return None
    first = text.splitlines()[0] if text.splitlines() else ""
    if len(first) > 60:
        first = first[:57] + "..."
    fmt = "events --user-col C --item-col C" if ("," in first or "\t" in first) else "sequences|events"
    return (f"it looks like a text log (first line '{first}'), not Parquet samples; run "
            f"'fsdata convert {path} samples.parquet --format {fmt}' first and pass samples.parquet")


def check_column_map(rename: dict[str, str], file_columns: list[str], path: str | os.PathLike) -> None:
    """Every ``--columns`` entry must name an existing column and not collide with another.

    Args:
        rename: ``{their_name: contract_name}`` from ``--columns``.
        file_columns: the input's column names.
        path: the input (for the message).

    Raises:
        ConfigError: an entry names a column the input lacks, or two columns would get one name.
    """
    for theirs, ours in rename.items():
        if theirs not in file_columns:
            raise ConfigError(f"{setting('columns', f'{ours}={theirs}', owner=None)}: input {path} has no column "
                              f"'{theirs}' (its columns are {file_columns}); fix the {setting('columns')} entry")
    renamed = [rename.get(n, n) for n in file_columns]
    for name in sorted(set(renamed)):
        sources = [n for n, r in zip(file_columns, renamed) if r == name]
        if len(sources) > 1:
            raise ConfigError(f"{setting('columns')} maps '{[s for s in sources if s != name][0]}' to {name}, "
                              "but input "
                              f"{path} already has a column '{name}'; map that one away too "
                              f"(e.g. {setting('columns', f'{name}=...')}) or drop one of them")


def _is_uint64(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_uint64(t)


def check_id_range(files: list[str], schema: pa.Schema, rename: dict[str, str], columns: list[str],
                   path: str | os.PathLike) -> None:
    """Refuse ``uint64`` id columns holding values above the int64 maximum (they cannot be cast).

    Reads the maxima from the Parquet footers' statistics (no data pages); a column without
    statistics is scanned.

    Args:
        files: the input's Parquet files.
        schema: their (common) Arrow schema, with the file's column names.
        rename: ``{their_name: contract_name}``.
        columns: contract columns to check (``sample_id``, ``user_id``, ``item_ids``, ...).
        path: the input (for the message).

    Raises:
        InputError: a value above ``2**63 - 1``; the message names the column, the value and the fix.
    """
    theirs = {rename.get(n, n): n for n in schema.names}
    todo = [c for c in columns if c in theirs and _is_uint64(schema.field(theirs[c]).type)]
    for c in todo:
        name = theirs[c]
        hi = _stats_bound(files, name, "max")
        if hi is None:
            hi = _scan_bound(files, name, "max")
        if hi is not None and hi > INT64_MAX:
            shown = f"{name} (mapped to {c})" if name != c else c
            raise InputError(f"input {path}: column {shown} is uint64 and holds {hi}, above the int64 maximum "
                             f"{INT64_MAX} of the sample schema; remap the ids to int64 (e.g. their rank, "
                             "or a hash into 0..2^63-1) and write the input again")


def check_ids_non_negative(files: list[str], schema: pa.Schema, rename: dict[str, str], columns: list[str],
                           path: str | os.PathLike) -> None:
    """Refuse negative user/item ids (fstrain's embedding tables index them, and ``fstrain
    evaluate`` refuses them): reads the minima from the footers' statistics; a column without
    statistics is scanned.

    Raises:
        InputError: a negative value; the message names the column, the value and the fix.
    """
    theirs = {rename.get(n, n): n for n in schema.names}
    for c in (c for c in columns if c in theirs):
        name = theirs[c]
        t = schema.field(name).type
        if pa.types.is_unsigned_integer(t.value_type if (pa.types.is_list(t) or pa.types.is_large_list(t)) else t):
            continue
        lo = _stats_bound(files, name, "min")
        if lo is None:
            lo = _scan_bound(files, name, "min")
        if lo is not None and lo < 0:
            shown = f"{name} (mapped to {c})" if name != c else c
            raise InputError(f"input {path}: column {shown} holds {lo}; user and item ids must be >= 0 (fstrain's "
                             "embedding tables index them): remap them to non-negative integers")


def _stats_bound(files: list[str], name: str, which: str) -> int | None:
    """Smallest (``which="min"``) or largest (``"max"``) value of column ``name`` from footer
    statistics; None if any row group lacks them."""
    pick = min if which == "min" else max
    out = None
    for f in files:
        fs, where = fsio.filesystem_and_path(f)
        md = pq.read_metadata(where, filesystem=fs)
        idx = [j for j in range(md.num_columns) if md.schema.column(j).path.split(".")[0] == name]
        for g in range(md.num_row_groups):
            for j in idx:
                st = md.row_group(g).column(j).statistics
                if st is None or not st.has_min_max:
                    return None
                v = st.min if which == "min" else st.max
                out = v if out is None else pick(out, v)
    return out


def _scan_bound(files: list[str], name: str, which: str) -> int | None:
    """The same bound by scanning the column (list columns exploded)."""
    import polars as pl

    col = pl.col(name)
    lf = fsio.scan_parquet(files)
    if isinstance(lf.collect_schema()[name], pl.List):
        col = col.explode()
    return lf.select(col.min() if which == "min" else col.max()).collect().item()
