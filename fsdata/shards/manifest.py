"""The shard format: one reader and one writer for ``_manifest.json`` (docs/format.md).

Everything that reads or writes an ``fsdata balance`` OUTPUT's manifest goes through
:class:`Manifest`: ``fsdata balance`` / ``fsdata finalize`` write it (:meth:`Manifest.write`),
``fsdata verify`` and ``fstrain`` read it (:meth:`Manifest.read`). This module imports neither
torch nor anything heavy, so ``fstrain`` uses it without pulling in the balancer. The names and
paths of the OUTPUT's files, the step stats (:func:`write_step_stats`) and the SHA-256 of the
files (:func:`sha256_file`) are defined in :mod:`fsdata.shards.layout` and exported here too, so
this module is the format's one import for the writer, verify, the engines and ``fstrain``.

OUTPUT may be a local folder or a :mod:`pyarrow.fs` URI (``s3://bucket/prefix``; :mod:`fsdata.fsio`):
every path here is joined and opened through :mod:`fsdata.fsio`. On an object store the manifest
is the commit marker (written last, one PUT): a prefix without it is an incomplete OUTPUT.

Versions: format_version 3 (written today), 2 and 1 (still read); their file names and what
differs are in :mod:`fsdata.shards.layout`. Readers take every path from the manifest, never from a glob.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdata import fsio
from fsdata.errors import FsdataError
from fsdata.shards.layout import (DROPPED_NAME, DROPPED_NAMES, FORMAT_VERSION, MANIFEST_NAME, MANIFEST_NAMES,
                                  READ_VERSIONS, STEP_STATS_COLUMNS, STEP_STATS_NAME, STEP_STATS_NAMES,
                                  STEP_STATS_OPTIONAL, STEP_STATS_TYPES, is_sha256, rank_dir_name, rank_file_path,
                                  sha256_file, write_step_stats)

__all__ = ["DROPPED_NAME", "DROPPED_NAMES", "FORMAT_VERSION", "KEYS", "MANIFEST_NAME", "MANIFEST_NAMES",
           "READ_VERSIONS", "STEP_STATS_COLUMNS", "STEP_STATS_NAME", "STEP_STATS_NAMES", "STEP_STATS_OPTIONAL",
           "STEP_STATS_TYPES", "FileEntry", "Manifest", "ManifestError", "find_manifest", "is_sha256", "rank_dir_name",
           "rank_file_path", "sha256_file", "write_step_stats"]

#: Key order of a written manifest (docs/format.md); unknown keys read from a file are kept after these.
KEYS = ("format_version", "fsdata_version", "num_ranks", "num_steps", "batch_size_per_rank", "batch_policy",
        "strategy", "num_samples_input", "num_samples_written", "num_samples_dropped", "remainder_policy",
        "dropped_file", "cost_model", "seed", "predicted_bubble", "baseline_predicted_bubble",
        "lower_bound_bubble", "columns", "step_stats_file", "step_stats_sha256", "dropped_sha256", "input_digest",
        "files", "settings")
_REQUIRED = ("format_version", "num_ranks", "num_steps", "batch_size_per_rank", "batch_policy", "files")
_V2_KEYS = ("fsdata_version", "input_digest", "step_stats_sha256", "dropped_sha256")


class ManifestError(FsdataError):
    """A manifest is missing, unparsable, of an unknown version, or malformed.

    Attributes:
        kind: ``missing``, ``version`` or ``invalid``.
    """

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


def find_manifest(output: str | os.PathLike) -> Path | str:
    """The manifest file of an OUTPUT: ``_manifest.json`` (v2, v3), else ``manifest.json`` (v1).

    Returns:
        Its path (a ``str`` URI for a remote OUTPUT).

    Raises:
        ManifestError: (kind ``missing``) neither exists; when OUTPUT holds rank folders the message
            calls it incomplete (the manifest is written last: the run failed, is still writing, or
            only ``fsdata write`` ran).
    """
    output = fsio.normalize(output)
    remote = fsio.is_remote(output)
    out = output if remote else Path(output)
    for version in sorted(MANIFEST_NAMES, reverse=True):
        p = fsio.join(out, MANIFEST_NAMES[version]) if remote else out / MANIFEST_NAMES[version]
        if fsio.is_file(p):
            return p
    missing = fsio.join(out, MANIFEST_NAMES[FORMAT_VERSION]) if remote else out / MANIFEST_NAMES[FORMAT_VERSION]
    try:
        ranks = fsio.is_dir(out) and any(name.startswith(("rank-", "rank=")) for name, _ in fsio.list_dir(out))
    except OSError:
        ranks = False
    if ranks:
        raise ManifestError(f"{missing} not found (nor the v1 manifest.json): {out} holds rank files but no manifest, "
                            "so it is an incomplete OUTPUT (the manifest is written last: the run failed, is still "
                            "writing, or only 'fsdata write' ran); rerun 'fsdata balance', or 'fsdata finalize "
                            "OUTPUT --plan PLAN' after 'fsdata write'", kind="missing")
    raise ManifestError(f"{missing} not found (nor the v1 manifest.json): "
                        f"{out} is not an 'fsdata balance' OUTPUT; create one with 'fsdata balance INPUT OUTPUT "
                        "--ranks R --batch-size-per-rank B'", kind="missing")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One rank file: ``rank``, ``path`` (relative to OUTPUT), ``num_rows``, ``num_bytes``, ``sha256``.

    ``step_tokens`` (not written to the manifest): shape ``[S]`` int64, the rank's history tokens per
    step, as counted by the writer (:func:`fsdata.shards.writer.write_rank`); None when unknown.
    """

    rank: int
    path: str
    num_rows: int
    num_bytes: int | None = None
    sha256: str | None = None
    step_tokens: Any = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict:
        return {"rank": self.rank, "path": self.path, "num_rows": self.num_rows, "num_bytes": self.num_bytes,
                "sha256": self.sha256}


def _int(raw: dict, key: str, where: str, *, minimum: int = 0) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ManifestError(f"{where}: '{key}' is {v!r}, expected an integer >= {minimum}; rerun 'fsdata balance'")
    return v


def _float_or_none(raw: dict, key: str, where: str) -> float | None:
    v = raw.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ManifestError(f"{where}: '{key}' is {v!r}, expected a number; rerun 'fsdata balance'")
    return float(v)


def _str(raw: dict, key: str, where: str, default: str | None = None) -> str:
    v = raw.get(key, default)
    if not isinstance(v, str):
        raise ManifestError(f"{where}: '{key}' is {v!r}, expected a string; rerun 'fsdata balance'")
    return v


@dataclass(kw_only=True, slots=True)
class Manifest:
    """An OUTPUT's manifest (docs/format.md, "_manifest.json").

    Attributes:
        path: the OUTPUT folder (not stored in the file).
        format_version: 1, 2, 3 or 4 (:data:`READ_VERSIONS`).
        num_ranks: R, the world size the shards are for.
        num_steps: steps per rank (equal on every rank).
        batch_size_per_rank: B (fixed policy) or the nominal B (cost-budget).
        batch_policy: ``fixed`` or ``cost-budget``.
        strategy: ``balanced`` or ``shuffle`` ("" when absent).
        files: one :class:`FileEntry` per rank, sorted by rank.
        num_samples_input, num_samples_written, num_samples_dropped: row counts (None when absent).
        remainder_policy: ``drop`` or ``error``.
        dropped_file: name of the dropped-samples file, or None.
        cost_model: the cost model's JSON form (``{}`` when absent).
        seed: seed of the global-batch shuffle.
        predicted_bubble, baseline_predicted_bubble, lower_bound_bubble: run bubbles (None when absent).
        columns: columns of the rank files.
        step_stats_file: name of the step-stats file.
        step_stats_sha256, dropped_sha256: SHA-256 of the step-stats and dropped files (v2; the
            latter None without a dropped file).
        fsdata_version: the fsdata that wrote it (v2 and later).
        input_digest: digest of the input (v2; see :func:`fsdata.shards.plan_file.input_digest`).
        settings: every creation setting.
        extra: keys this fsdata does not know, kept as read (written back after the known keys);
            ``epochs``, ``steps_per_epoch`` and ``epoch_num_steps`` live here (written only when
            E > 1; read through :attr:`epochs`, :attr:`steps_per_epoch`, :attr:`epoch_num_steps`).
    """

    path: str = ""
    format_version: int = FORMAT_VERSION
    num_ranks: int
    num_steps: int
    batch_size_per_rank: int
    batch_policy: str
    strategy: str = ""
    files: list[FileEntry]
    num_samples_input: int | None = None
    num_samples_written: int | None = None
    num_samples_dropped: int | None = None
    remainder_policy: str = "drop"
    dropped_file: str | None = None
    cost_model: dict = field(default_factory=dict)
    seed: int | None = None
    predicted_bubble: float | None = None
    baseline_predicted_bubble: float | None = None
    lower_bound_bubble: float | None = None
    columns: list[str] = field(default_factory=list)
    step_stats_file: str | None = None
    step_stats_sha256: str | None = None
    dropped_sha256: str | None = None
    fsdata_version: str | None = None
    input_digest: str | None = None
    settings: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    # ---- reading ----------------------------------------------------------------------------
    @property
    def num_items(self) -> int | None:
        """Embedding-table size of the items (``num_items``: largest item index + 1 over training and
        held-out data, from ``fsdata convert``); None when absent (older outputs, other inputs)."""
        v = self.extra.get("num_items")
        return None if v is None else int(v)

    @property
    def vocab(self) -> dict | None:
        """``{"digest": "sha256:<hex>", "path": <vocabulary folder relative to OUTPUT, or None>}`` of the
        input's ``fsdata convert`` vocabulary (``vocab``); None when absent."""
        return self.extra.get("vocab")

    @property
    def feature_columns(self) -> list[str] | None:
        """Event feature columns aligned with ``item_ids`` (``feature_columns``); None when absent."""
        v = self.extra.get("feature_columns")
        return None if v is None else list(v)

    @property
    def epochs(self) -> int:
        """E, the epochs the shards hold (``epochs``; 1 when absent: one-epoch outputs)."""
        return int(self.extra.get("epochs", 1))

    @property
    def plan_digest(self) -> str | None:
        """The plan digest every rank file carries (``plan_digest``; the rank files' Parquet key
        ``fsdata.plan_digest``, :func:`fsdata.shards.plan_file.plan_digest`); None in outputs
        written by earlier versions."""
        v = self.extra.get("plan_digest")
        return v if isinstance(v, str) else None

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch: ``steps_per_epoch`` when every epoch has the same count (always under
        the fixed policy; epoch ``e`` is then steps ``e*steps_per_epoch .. (e+1)*steps_per_epoch - 1``);
        under cost-budget with unequal epochs the nominal ``round(num_steps / epochs)`` (exact
        boundaries: :attr:`epoch_num_steps`); ``num_steps`` for a one-epoch output."""
        if "steps_per_epoch" in self.extra:
            return int(self.extra["steps_per_epoch"])
        return int(round(self.num_steps / self.epochs))

    @property
    def epoch_num_steps(self) -> list[int]:
        """Steps of each epoch: E ints summing to ``num_steps`` (``epoch_num_steps``, written under
        cost-budget; else ``steps_per_epoch`` E times)."""
        if "epoch_num_steps" in self.extra:
            return [int(x) for x in self.extra["epoch_num_steps"]]
        return [self.steps_per_epoch] * self.epochs

    def epoch_first_steps(self):
        """First step of each epoch plus ``num_steps`` at the end: shape ``[E+1]`` int64 (epoch ``e``
        is steps ``first[e] .. first[e+1] - 1``)."""
        import numpy as np  # noqa: PLC0415 (kept out of the import of the manifest reader)

        return np.concatenate([[0], np.cumsum(self.epoch_num_steps)]).astype(np.int64)

    def epoch_of_step(self, step):
        """Epoch of a step (int or integer array), shape like ``step``, int64."""
        import numpy as np  # noqa: PLC0415

        return np.searchsorted(self.epoch_first_steps()[1:], step, side="right")

    def rank_file(self, rank: int) -> str:
        """Path of ``rank``'s Parquet file (``path`` joined with the entry's relative path; a URI
        for a remote OUTPUT)."""
        if fsio.is_remote(self.path):
            return fsio.join(self.path, self.files[rank].path)
        return os.path.join(self.path, self.files[rank].path)

    def step_stats_path(self) -> str:
        """Path of the step-stats file (``step_stats_file``, else this version's default name)."""
        name = self.step_stats_file or STEP_STATS_NAMES[self.format_version]
        if fsio.is_remote(self.path):
            return fsio.join(self.path, name)
        return os.path.join(self.path, name)

    def read_step_stats(self, columns: list[str] | None = None, filters: list | None = None):
        """Read the step stats (the one reader of that file for verify, the report and fstrain).

        Args:
            columns: subset of ``step``, ``rank``, ``num_samples``, ``predicted_cost``, ``num_tokens``
                (None: all the file has: ``num_tokens`` only when present, fsdata >= 0.3).
            filters: pyarrow row filters, e.g. ``[("step", "<", 8)]``.

        Returns:
            ``pyarrow.Table`` with the requested columns (written with the types of
            :data:`STEP_STATS_TYPES`; any integer or float width is accepted here).

        Raises:
            ManifestError: the file is missing, unreadable, or a column is missing or of another type.
        """
        import pyarrow as pa  # noqa: PLC0415 (kept out of the import of the manifest reader)
        import pyarrow.parquet as pq  # noqa: PLC0415

        path = self.step_stats_path()
        want = list(STEP_STATS_TYPES) if columns is None else list(columns)
        try:
            fs, where = fsio.filesystem_and_path(path)
            if columns is None:  # an older output lacks the optional columns
                names = pq.read_schema(where, filesystem=fs).names
                want = [c for c in want if c in names or c not in STEP_STATS_OPTIONAL]
            t = pq.read_table(where, columns=want, filters=filters, filesystem=fs)
        except (OSError, pa.ArrowException) as e:
            raise ManifestError(f"{path} is missing or unreadable ({str(e).splitlines()[0]}); rerun 'fsdata balance'",
                                kind="missing") from None
        for name in want:  # readers take any integer / float width; verify insists on the exact types
            typ = t.schema.field(name).type
            ok = pa.types.is_floating(typ) if name == "predicted_cost" else pa.types.is_integer(typ)
            if not ok:
                raise ManifestError(f"{path}: column {name} is {typ}, expected {STEP_STATS_TYPES[name]}; "
                                    "rerun 'fsdata balance'")
        return t

    @property
    def raw(self) -> dict:
        """The manifest's JSON value (:meth:`to_json`)."""
        return self.to_json()

    def to_json(self) -> dict:
        """The manifest as written: :data:`KEYS` in order (v2 keys omitted for a v1 manifest when
        unset), then :attr:`extra`."""
        out: dict[str, Any] = {}
        for k in KEYS:
            v = getattr(self, k)
            if k == "files":
                v = [f.to_json() for f in v]
            if self.format_version == 1 and k in _V2_KEYS and v is None:
                continue
            out[k] = v
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, raw: Any, *, path: str | os.PathLike = "", where: str = "manifest") -> "Manifest":
        """Parse and check a manifest's JSON value.

        Raises:
            ManifestError: not a JSON object (kind ``invalid``), an unknown ``format_version`` (kind
                ``version``), a missing or mistyped key, or a rank without exactly one file entry.
        """
        if not isinstance(raw, dict):
            raise ManifestError(f"{where} is a JSON {type(raw).__name__}, expected an object; rerun 'fsdata balance'")
        version = raw.get("format_version")
        if version not in READ_VERSIONS:
            raise ManifestError(f"{where}: format_version {version!r} is not supported (this fsdata reads "
                                f"{', '.join(map(str, READ_VERSIONS))}); rerun 'fsdata balance' with this version",
                                kind="version")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ManifestError(f"{where} lacks keys {missing}; rerun 'fsdata balance'")
        num_ranks = _int(raw, "num_ranks", where, minimum=1)
        num_steps = _int(raw, "num_steps", where)
        B = _int(raw, "batch_size_per_rank", where, minimum=1)
        files_raw = raw["files"]
        if not isinstance(files_raw, list):
            raise ManifestError(f"{where}: 'files' is not a list; rerun 'fsdata balance'")
        if len(files_raw) != num_ranks:  # before anything is allocated by num_ranks (an untrusted count)
            raise ManifestError(f"{where}: num_ranks is {num_ranks} but 'files' has {len(files_raw)} entries (one "
                                "per rank); rerun 'fsdata balance'")
        files: dict[int, FileEntry] = {}
        for i, e in enumerate(files_raw):
            w = f"{where}: files[{i}]"
            if not isinstance(e, dict):
                raise ManifestError(f"{w} is not an object; rerun 'fsdata balance'")
            r = _int(e, "rank", w)
            rel = _str(e, "path", w)
            if os.path.isabs(rel) or ".." in Path(rel).parts or not rel:
                raise ManifestError(f"{w}: path {rel!r} must be relative to OUTPUT and inside it; "
                                    "rerun 'fsdata balance'")
            sha = e.get("sha256")
            nbytes = e.get("num_bytes")
            if sha is not None and not isinstance(sha, str):
                raise ManifestError(f"{w}: sha256 is {sha!r}, expected a hex string; rerun 'fsdata balance'")
            if nbytes is not None:
                nbytes = _int(e, "num_bytes", w)
            if r in files:
                raise ManifestError(f"{where}: rank {r} has two file entries; rerun 'fsdata balance'")
            files[r] = FileEntry(rank=r, path=rel, num_rows=_int(e, "num_rows", w), num_bytes=nbytes, sha256=sha)
        absent = sorted(set(range(num_ranks)) - set(files))
        outside = sorted(set(files) - set(range(num_ranks)))
        if absent or outside:
            raise ManifestError(f"{where}: num_ranks is {num_ranks} but the file entries cover ranks "
                                f"{sorted(files)[:8]}{'...' if len(files) > 8 else ''} (missing {absent[:8]}, "
                                f"outside {outside[:8]}); rerun 'fsdata balance'")
        fewest = min((f.num_rows for f in files.values()), default=0)
        if num_steps > fewest:  # every step holds at least one sample on every rank
            raise ManifestError(f"{where}: num_steps {num_steps} exceeds the {fewest} rows of the smallest rank "
                                "file (every step holds at least one sample per rank); rerun 'fsdata balance'")
        counts = {k: (_int(raw, k, where) if k in raw else None)
                  for k in ("num_samples_input", "num_samples_written", "num_samples_dropped")}
        seed = raw.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ManifestError(f"{where}: 'seed' is {seed!r}, expected an integer; rerun 'fsdata balance'")
        cost_model = raw.get("cost_model") or {}
        if not isinstance(cost_model, dict):
            raise ManifestError(f"{where}: 'cost_model' is {cost_model!r}, expected an object; rerun 'fsdata balance'")
        columns = raw.get("columns", [])
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
            raise ManifestError(f"{where}: 'columns' is {columns!r}, expected a list of names; rerun 'fsdata balance'")
        settings = raw.get("settings") or {}
        if not isinstance(settings, dict):
            raise ManifestError(f"{where}: 'settings' is not an object; rerun 'fsdata balance'")
        for k in ("dropped_file", "step_stats_file", *_V2_KEYS):
            v = raw.get(k)
            if v is not None and not isinstance(v, str):
                raise ManifestError(f"{where}: '{k}' is {v!r}, expected a string or null; rerun 'fsdata balance'")
        for k in ("dropped_file", "step_stats_file"):
            v = raw.get(k)
            if v is not None and (os.path.isabs(v) or ".." in Path(v).parts or "/" in v or not v):
                raise ManifestError(f"{where}: '{k}' {v!r} must be a file name inside OUTPUT; rerun 'fsdata balance'")
        if raw.get("plan_digest") is not None and not isinstance(raw["plan_digest"], str):
            raise ManifestError(f"{where}: 'plan_digest' is {raw['plan_digest']!r}, expected a string; "
                                "rerun 'fsdata balance'")
        if "epochs" in raw or "steps_per_epoch" in raw or "epoch_num_steps" in raw:
            E = _int(raw, "epochs", where, minimum=1)
            per = raw.get("epoch_num_steps")
            if per is not None and (not isinstance(per, list) or len(per) != E or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in per) or sum(per) != num_steps):
                raise ManifestError(f"{where}: epoch_num_steps {per!r} is not {E} positive step counts summing to "
                                    f"num_steps {num_steps}; rerun 'fsdata balance'")
            if "steps_per_epoch" in raw or per is None:
                S_e = _int(raw, "steps_per_epoch", where, minimum=1 if num_steps else 0)
                if E * S_e != num_steps or (per is not None and set(per) != {S_e}):
                    raise ManifestError(f"{where}: epochs {E} x steps_per_epoch {S_e} != num_steps {num_steps}"
                                        f"{'' if per is None else ' or epoch_num_steps'}; rerun 'fsdata balance'")
        return cls(
            path=str(path), format_version=version, num_ranks=num_ranks, num_steps=num_steps, batch_size_per_rank=B,
            batch_policy=_str(raw, "batch_policy", where), strategy=_str(raw, "strategy", where, ""),
            files=[files[r] for r in range(num_ranks)], **counts,
            remainder_policy=_str(raw, "remainder_policy", where, "drop"), dropped_file=raw.get("dropped_file"),
            cost_model=cost_model, seed=seed,
            predicted_bubble=_float_or_none(raw, "predicted_bubble", where),
            baseline_predicted_bubble=_float_or_none(raw, "baseline_predicted_bubble", where),
            lower_bound_bubble=_float_or_none(raw, "lower_bound_bubble", where),
            columns=list(columns), step_stats_file=raw.get("step_stats_file"),
            step_stats_sha256=raw.get("step_stats_sha256"), dropped_sha256=raw.get("dropped_sha256"),
            fsdata_version=raw.get("fsdata_version"), input_digest=raw.get("input_digest"), settings=settings,
            extra={k: v for k, v in raw.items() if k not in KEYS})

    @classmethod
    def read(cls, output: str | os.PathLike) -> "Manifest":
        """Read an OUTPUT's manifest (``_manifest.json``, else v1 ``manifest.json``).

        Args:
            output: an ``fsdata balance`` OUTPUT folder.

        Returns:
            The checked :class:`Manifest` with ``path = output``.

        Raises:
            ManifestError: missing (kind ``missing``), unknown version (kind ``version``), or
                unparsable / malformed (kind ``invalid``); one line naming the file and the fix.
        """
        output = fsio.resolve_pointer(output)  # an object-store OUTPUT replaced with --overwrite
        p = find_manifest(output)
        try:
            raw = json.loads(p.read_text() if isinstance(p, Path) else fsio.read_bytes(p).decode())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{p} is not valid JSON ({str(e).splitlines()[0]}); rerun 'fsdata balance'") from None
        m = cls.from_json(raw, path=str(output), where=str(p))
        expected_name = MANIFEST_NAMES[m.format_version]
        name = p.name if isinstance(p, Path) else fsio.resolve(p).path.rsplit("/", 1)[-1]
        if name != expected_name:
            raise ManifestError(f"{p} says format_version {m.format_version}, whose manifest is named {expected_name}; "
                                "rerun 'fsdata balance'")
        return m

    # ---- writing ----------------------------------------------------------------------------
    def dumps(self) -> str:
        """The file's text: indented JSON plus a newline (deterministic: same manifest, same bytes)."""
        return json.dumps(self.to_json(), indent=2) + "\n"

    def write(self, output: str | os.PathLike) -> Path | str:
        """Write ``OUTPUT/_manifest.json`` (the v2 name) atomically (temporary file, then rename;
        on an object store one PUT of the whole file, which readers see whole or not at all).

        Returns:
            The path written (a ``str`` URI for a remote OUTPUT).
        """
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"this fsdata writes format_version {FORMAT_VERSION} only")
        output = fsio.normalize(output)
        if fsio.is_remote(output):
            final_uri = fsio.join(output, MANIFEST_NAMES[FORMAT_VERSION])
            fsio.write_bytes(final_uri, self.dumps().encode())
            return final_uri
        final = Path(output) / MANIFEST_NAMES[FORMAT_VERSION]
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        tmp.write_text(self.dumps())
        os.replace(tmp, final)
        return final

