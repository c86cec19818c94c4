"""Logs as they come (``fsdata convert``): what a file holds, decided by its content, not only its name.

* :func:`detect`: Parquet (magic ``PAR1``), gzip / zstd / bzip2 (their magic bytes), text, or binary.
* :func:`prepare`: a compressed log is decompressed, and a ``::``-separated one (MovieLens ``.dat``)
  rewritten with a one-byte separator, streaming into a temporary file beside the output, since the
  CSV readers take single-byte separators and uncompressed files only.
* :func:`sniff`: the separator (``,`` ``;`` tab ``::`` space) and whether the first line is a header,
  from the first lines.
* :func:`scan_text`: one streaming pass (PyArrow's CSV reader) finding lines whose field count is
  wrong (``--bad-lines``) and the kind of each id column (:mod:`fsdata.samples.ids`); with
  ``--bad-lines skip`` the kept lines are copied to a temporary file that the conversion reads.
"""

from __future__ import annotations

import bz2
import gzip
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.csv as pacsv

from fsdata.errors import InputError
from fsdata.samples.settings import BAD_LINES  # noqa: F401 (Sn.BAD_LINES)

MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bz2"}
PARQUET_MAGIC = b"PAR1"
#: Separators tried, in order of preference on a tie.
SEPARATORS = ("::", "\t", ";", ",", " ")
#: The byte a ``::`` separator is rewritten to (ASCII unit separator, never in a text log).
UNIT_SEP = "\x1f"
#: Standard column names (lower-cased, without a typed suffix such as ``:token``).
STANDARD = {"user_id": ("user_id", "userid", "user"), "item_id": ("item_id", "itemid", "item", "movieid"),
            "ts": ("timestamp", "time", "ts")}
_BLOCK = 1 << 22


def detect(path: Path) -> tuple[str, str | None]:
    """``(kind, compression)``: kind ``parquet``, ``text`` or ``binary``; compression ``gzip``, ``zstd``,
    ``bz2`` or None (the kind is then of the decompressed start)."""
    with open(path, "rb") as f:
        head = f.read(8)
    comp = next((c for m, c in MAGIC.items() if head.startswith(m)), None)
    if head.startswith(PARQUET_MAGIC):
        return "parquet", None
    with _open(path, comp) if comp else open(path, "rb") as f:
        start = f.read(8192)
    if start.startswith(PARQUET_MAGIC):
        return "parquet", comp
    if b"\x00" in start:
        return "binary", comp
    try:
        start.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(start) - 4:
            return "binary", comp
    return "text", comp


def _open(path: Path, comp: str | None):
    if comp == "gzip":
        return gzip.open(path, "rb")
    if comp == "bz2":
        return bz2.open(path, "rb")
    if comp == "zstd":
        return pa.input_stream(str(path), compression="zstd")
    return open(path, "rb")


def binary_error(path: Path, fmt: str, kind: str) -> InputError:
    """The one line for an input that is not a text log (``kind`` from :func:`detect`)."""
    if kind == "parquet":
        return InputError(f"input {path} is a Parquet file, not a '{fmt}' text log; pass --format events for an "
                          "event table, or give sample Parquet to 'fsdata balance' directly (the nightly job: "
                          "--format samples)")
    return InputError(f"input {path} is binary, not a text log or Parquet; decompress it (gzip, zstd and bzip2 are "
                      "read as they are) or export it as CSV or Parquet, then pass --format events or sequences")


def sniff(head: str, sep: str | None, has_header: bool | None, suffix: str,
          wanted: tuple[str, ...] = ()) -> tuple[str, bool]:
    """The separator and header of a text log from its first lines (a given one is kept).

    The separator is the candidate whose field count (>= 2) holds on most of the first lines; the first
    line is a header when it names a standard column or a column of ``wanted`` (the column flags), when it
    has no number where every later line has one in that field, or (``.csv``/``.tsv``) when it is not all
    numbers.
    """
    lines = [ln for ln in head.splitlines()[:200] if ln.strip()]
    if not lines:
        return sep or " ", bool(has_header)
    if sep is None:
        best = (0.0, 0, " ")
        for rank, cand in enumerate(SEPARATORS):
            counts = [len(ln.split(cand)) for ln in lines] if cand != " " else [len(ln.split()) for ln in lines]
            mode = max(set(counts), key=counts.count)
            share = counts.count(mode) / len(counts)
            if mode >= 2 and (share, -rank) > (best[0], -best[1]):
                best = (share, rank, cand)
        sep = best[2] if best[0] >= 0.5 else (" " if suffix not in (".csv", ".tsv") else
                                               "," if suffix == ".csv" else "\t")
    if has_header is None:
        split = (lambda s: s.split()) if sep == " " else (lambda s: s.split(sep))
        first = [f.strip().strip('"').split(":")[0].lower() for f in split(lines[0])]
        named = any(f in names for names in STANDARD.values() for f in first)
        rest = [split(ln) for ln in lines[1:]]

        def num(x: str) -> bool:
            return re.fullmatch(r"\s*[+-]?\d+(\.\d*)?([eE][+-]?\d+)?\s*", x) is not None
        numeric_col = any(rest and all(len(r) > j and num(r[j]) for r in rest) and not num(f)
                          for j, f in enumerate(split(lines[0])))
        raw = [f.strip().strip('"') for f in split(lines[0])]
        flagged = any(w in raw or w in [f.split(":")[0] for f in raw] for w in wanted)
        has_header = (named or numeric_col or flagged
                      or (suffix in (".csv", ".tsv") and not all(num(f) for f in split(lines[0]))))
    return sep, has_header


@dataclass(kw_only=True, slots=True)
class Prepared:
    """A text log ready for the CSV readers: ``path`` (the input or a temporary copy), ``sep`` (one byte)
    and ``has_header``; ``shown_sep`` is the separator as the file has it."""

    path: Path
    sep: str
    has_header: bool
    shown_sep: str


def prepare(path: Path, tmp: Path, *, sep: str | None, has_header: bool | None, comp: str | None,
            wanted: tuple[str, ...] = ()) -> Prepared:
    """Decompress and rewrite ``::`` separators into ``tmp`` (a fresh folder) when needed, then :func:`sniff`.

    Line numbers are kept (only separators change), so messages name the input's lines.
    """
    with _open(path, comp) as f:
        head = f.read(1 << 16).decode("utf-8", errors="replace").lstrip("\ufeff")
    sep, has_header = sniff(head, sep, has_header, Path(path.name.removesuffix(f".{_EXT.get(comp, '')}")).suffix.lower()
                            if comp else path.suffix.lower(), wanted)
    shown = sep
    if comp is None and len(sep) == 1:
        return Prepared(path=path, sep=sep, has_header=has_header, shown_sep=shown)
    out = tmp / "input.txt"
    with _open(path, comp) as f, open(out, "wb") as g:
        if len(sep) == 1:
            shutil.copyfileobj(f, g, _BLOCK)
        else:
            carry, enc, unit = b"", sep.encode(), UNIT_SEP.encode()
            while True:  # whole lines at a time: a separator never spans a line end
                block = f.read(_BLOCK)
                buf = carry + block
                if not block:
                    g.write(buf.replace(enc, unit))
                    break
                cut = buf.rfind(b"\n") + 1
                g.write(buf[:cut].replace(enc, unit))
                carry = buf[cut:]
    return Prepared(path=out, sep=UNIT_SEP if len(sep) > 1 else sep, has_header=has_header, shown_sep=shown)


_EXT = {"gzip": "gz", "zstd": "zst", "bz2": "bz2"}


def scan_text(prep: Prepared, names: list[str], given: dict[str, str], *, bad_lines: str, tmp: Path,
              shown: Path) -> tuple[dict[str, str], int, Prepared]:
    """One streaming pass over a text log: bad lines (wrong field count) and the kind of each id column.

    Args:
        prep: from :func:`prepare`.
        names: the columns (from the header, or ``column_1`` ...).
        given: our id name -> the input's column.
        bad_lines: ``error`` (the first bad line is refused, with its number and text) or ``skip``.
        tmp: a folder for the copy without bad lines (``skip``).
        shown: the input as the user named it (messages).

    Returns:
        ``(kinds, bad_lines_skipped, prep)``; ``prep`` points at the copy when lines were skipped.

    Raises:
        InputError: a bad line under ``error``.
    """
    bad: list[str] = []

    def handler(row) -> str:
        bad.append(row.text)
        return "skip"

    cols = list(dict.fromkeys(given.values()))
    reader = pacsv.open_csv(prep.path, read_options=pacsv.ReadOptions(
        block_size=2 << 20, column_names=names, skip_rows=1 if prep.has_header else 0),
        parse_options=pacsv.ParseOptions(delimiter=prep.sep, ignore_empty_lines=False, invalid_row_handler=handler),
        convert_options=pacsv.ConvertOptions(include_columns=cols, column_types={c: pa.string() for c in cols},
                                             strings_can_be_null=True))
    nonint, nonfloat, nonnull = dict.fromkeys(given, 0), dict.fromkeys(given, 0), dict.fromkeys(given, 0)
    for batch in reader:
        if bad and bad_lines == "error":
            break
        df = pl.from_arrow(batch)
        for ours, theirs in given.items():
            c = pl.col(theirs)
            # an integer too large for int64 stays an integer (and is refused as such later)
            st = df.select((c.is_not_null() & ~c.str.contains(r"^\s*[+-]?\d+\s*$")).sum().alias("a"),
                           (c.is_not_null() & c.cast(pl.Float64, strict=False).is_null()).sum().alias("b"),
                           c.is_not_null().sum().alias("c")).row(0)
            nonint[ours] += st[0]
            nonfloat[ours] += st[1]
            nonnull[ours] += st[2]
    kinds = {c: "int" if not nonint[c] else "float" if not nonfloat[c] else "string" for c in given}
    if kinds.get("ts") == "string" and nonfloat["ts"] < nonnull["ts"]:
        kinds["ts"] = "int"  # numbers and a few bad values: a bad number, not an ISO time column
    if not bad:
        return kinds, 0, prep
    if bad_lines == "error":
        line = _line_number(prep.path, bad[0])
        text = bad[0].replace(UNIT_SEP, prep.shown_sep)
        text = text if len(text) <= 200 else text[:197] + "..."
        raise InputError(f"input {shown} line {line} has {_fields(bad[0], prep.sep)} fields where the header or first "
                         f"line has {len(names)} (separator {prep.shown_sep!r}): {text!r}; " + (
                             "if each line holds one user's whole sequence, pass --format sequences; else "
                             if prep.shown_sep == " " else "") + "fix or quote it, or pass --bad-lines skip to skip "
                         "and count such lines")
    out = tmp / "kept.txt"
    drop = set(bad)
    with open(prep.path, encoding="utf-8", errors="surrogateescape", newline="") as f, \
            open(out, "w", encoding="utf-8", errors="surrogateescape", newline="") as g:
        for ln in f:
            if ln.rstrip("\r\n") not in drop:
                g.write(ln)
    return kinds, len(bad), Prepared(path=out, sep=prep.sep, has_header=prep.has_header, shown_sep=prep.shown_sep)


def _fields(text: str, sep: str) -> int:
    return len(text.split(sep)) if sep != " " else len(text.split(" "))


def _line_number(path: Path, text: str) -> int | str:
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        for n, ln in enumerate(f, 1):
            if ln.rstrip("\r\n") == text:
                return n
    return "?"


def standard_columns(names: list[str]) -> dict[str, str]:
    """Our name -> the input's column for each standard name the header has (``user_id:token`` matches by
    its base name, case-insensitively)."""
    found: dict[str, str] = {}
    for ours, cands in STANDARD.items():
        for n in names:
            if n.split(":")[0].strip().lower() in cands and ours not in found:
                found[ours] = n
    return found
