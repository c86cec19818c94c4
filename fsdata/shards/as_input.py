"""An ``fsdata balance`` OUTPUT read back as a sample INPUT (``fsdata profile``, ``balance``,
``verify --input``; docs/fsdata.md, "Changing the world size").

The rank files are found through the manifest (never a glob: ``_step_stats.parquet`` and
``_dropped.parquet`` are not samples); their ``step`` and ``rank`` columns are dropped and every
other column is kept as it is (same names, same types). Which rows are read:

* no ``from_step``: every sample the OUTPUT holds, once. With E > 1 epochs each sample is written
  once per epoch (or dropped in some); it is read once, at its first step. Samples dropped in every
  epoch stay dropped.
* ``from_step = S`` (the samples not yet trained after S steps): with one epoch, or S in the last
  epoch, the rows of steps ``>= S``. With S in epoch ``e < E - 1`` the rest of epoch ``e`` (steps
  ``S .. end of e``) is a *partial epoch* followed by ``E - 1 - e`` whole epochs: every sample is
  read once and :attr:`OutputInput.first_epoch_mask` marks the partial epoch's samples.

Rows are read in rank-file order (rank 0's file, then rank 1's ...; inside a file by step and
position), so both engines see the same rows in the same order and write byte-identical outputs.
:func:`open_output` gives them as a :class:`~fsdata.samples.io.SampleSource`:

* **in place** when the rows read are a suffix of every rank file (one epoch, without
  ``from_step`` or with any; or S in the last epoch): the source is the rank files themselves,
  each read from its first row of a step ``>= S`` (found from the ``step`` column's row-group
  statistics and one row group's ``step`` values), ``step`` and ``rank`` left unread. Nothing is
  copied.
* otherwise (E > 1 without ``from_step`` or with S before the last epoch: first occurrences) the
  rows are copied into one scratch Parquet file (:func:`output_as_input`), read like any input.

Either way the input digest is that of the rank files' footers and the selection (``from_step``),
so both ways give the same output, byte for byte (tested).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.errors import ConfigError, InputError, setting
from fsdata.samples import schema as S
from fsdata.samples.io import SampleSource, open_sample_files, open_samples
from fsdata.shards.manifest import MANIFEST_NAMES, Manifest, ManifestError
from fsdata.shards.plan_file import PLAN_DIGEST_KEY

#: Name of the Parquet file an OUTPUT is read into (inside a temporary folder).
VIEW_NAME = "samples.parquet"
#: Rows per row group of that file.
VIEW_ROW_GROUP = 1 << 16
#: Codec of that file (a local scratch file, written and read once; written without dictionary
#: pages too: at 1M samples the copy took 5 s against 11 s with them, for 2.4x the bytes).
VIEW_COMPRESSION = "none"
#: Read an OUTPUT's rank files in place where the rows read are a suffix of every rank file
#: (:func:`open_output`); False: always through the scratch copy (tests compare the two ways).
READ_IN_PLACE = True


def is_output(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an ``fsdata balance`` OUTPUT folder (it holds a manifest)."""
    p = fsio.normalize(path)
    if not fsio.is_remote(p) and any(ch in str(p) for ch in "*?["):
        return False
    try:
        if not fsio.is_dir(p):
            return False
        return any(fsio.is_file(fsio.join(p, name) if fsio.is_remote(p) else os.path.join(p, name))
                   for name in MANIFEST_NAMES.values())
    except OSError:
        return False


@dataclass(kw_only=True, slots=True)
class OutputInput:
    """What was read from an OUTPUT.

    Attributes:
        manifest: the OUTPUT's manifest.
        plan_digest: the ``fsdata.plan_digest`` its rank files carry (None for outputs older than it).
        from_step: S, or None (the whole OUTPUT).
        epoch: the OUTPUT's epoch that step S falls in (0 without ``from_step``).
        epochs_left: epochs the samples read make: 1, or ``E - e`` with S in epoch ``e`` (a partial
            epoch, then ``E - 1 - e`` whole ones).
        num_samples: N, rows read.
        first_epoch_mask: shape ``[N]`` bool, the partial epoch's samples (None: no partial epoch
            before whole epochs).
        path: the Parquet file holding the rows (set by :func:`output_as_input`; "" when read in place).
        source: the rows read as a sample source (set by :func:`open_output`).
    """

    manifest: Manifest
    plan_digest: str | None
    from_step: int | None
    epoch: int = 0
    epochs_left: int = 1
    num_samples: int = 0
    first_epoch_mask: np.ndarray | None = field(default=None, repr=False)
    path: str = ""
    source: SampleSource | None = None

    @property
    def first_epoch_num_samples(self) -> int | None:
        """Samples of the partial first epoch (None: no partial epoch before whole ones)."""
        return None if self.first_epoch_mask is None else int(self.first_epoch_mask.sum())


def read_output_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of an OUTPUT given as INPUT.

    Raises:
        InputError: missing or malformed manifest (one line).
    """
    try:
        return Manifest.read(path)
    except ManifestError as e:
        raise InputError(f"input {path}: {e}") from None


def _unreadable(m: Manifest, r: int, e: Exception) -> InputError:
    return InputError(f"input {m.rank_file(r)}: cannot read the rank file ({str(e).splitlines()[0]}); "
                      f"run 'fsdata verify {m.path}'")


def _plan_digest(m: Manifest) -> str | None:
    digests = set()
    for r in range(m.num_ranks):
        fs, where = fsio.filesystem_and_path(m.rank_file(r))
        try:
            kv = pq.read_metadata(where, filesystem=fs).metadata or {}
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(m, r, e) from None
        digests.add(kv[PLAN_DIGEST_KEY].decode() if PLAN_DIGEST_KEY in kv else None)
    if len(digests) != 1:
        raise InputError(f"input {m.path}: its rank files carry different plan digests; it mixes two outputs: "
                         f"run 'fsdata verify {m.path}'")
    return digests.pop()


def check_from_step(m: Manifest, from_step: int | None) -> None:
    """Refuse a ``--from-step`` outside ``0 .. num_steps - 1``.

    Raises:
        ConfigError: one line naming the valid range.
    """
    if from_step is None:
        return
    if isinstance(from_step, bool) or not isinstance(from_step, (int, np.integer)) or not (
            0 <= from_step < m.num_steps):
        raise ConfigError(f"{setting('from_step', from_step)} is outside the steps of {m.path} "
                          f"(0 .. {m.num_steps - 1}); pass the number of steps already trained")


def _first_occurrence(ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Bool mask ``[n]``: the row of each sample_id with the smallest step."""
    order = np.lexsort((steps, ids))
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[order][1:] != ids[order][:-1]
    keep = np.zeros(len(ids), dtype=bool)
    keep[order[first]] = True
    return keep


def select_rows(m: Manifest, from_step: int | None) -> tuple[list[np.ndarray], OutputInput]:
    """Which rows of each rank file are read (module docstring).

    Returns:
        ``(per-rank bool masks over the file's rows, info)``; ``info.path`` is not set.

    Raises:
        ConfigError: ``from_step`` outside the OUTPUT's steps.
        InputError: a rank file cannot be read, or the files carry different plan digests.
    """
    check_from_step(m, from_step)
    info = OutputInput(manifest=m, plan_digest=_plan_digest(m), from_step=from_step)
    if from_step is None and m.epochs == 1:  # every row, once: nothing to read to choose them
        info.num_samples = sum(f.num_rows for f in m.files)
        return [np.ones(f.num_rows, dtype=bool) for f in m.files], info
    ids_l, steps_l = [], []
    for r in range(m.num_ranks):
        fs, where = fsio.filesystem_and_path(m.rank_file(r))
        try:
            t = pq.read_table(where, columns=[S.SAMPLE_ID, S.STEP], filesystem=fs)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input {m.rank_file(r)}: cannot read the rank file ({str(e).splitlines()[0]}); "
                             f"run 'fsdata verify {m.path}'") from None
        ids_l.append(t.column(0).to_numpy().astype(np.int64))
        steps_l.append(t.column(1).to_numpy().astype(np.int64))
    sizes = [len(x) for x in ids_l]
    ids, steps = np.concatenate(ids_l), np.concatenate(steps_l)
    E, first = m.epochs, m.epoch_first_steps()
    if from_step is None:
        keep = _first_occurrence(ids, steps) if E > 1 else np.ones(len(ids), dtype=bool)
    else:
        e = int(m.epoch_of_step(from_step))
        info.epoch = e
        if e == E - 1:  # one epoch, or S in the last one: the rows of the steps left
            keep = steps >= from_step
        else:  # the rest of epoch e, then whole epochs of every sample
            keep = _first_occurrence(ids, steps)
            partial = np.unique(ids[(steps >= from_step) & (steps < first[e + 1])])
            info.first_epoch_mask = np.isin(ids[keep], partial)
            info.epochs_left = E - e
    info.num_samples = int(keep.sum())
    if info.num_samples == 0:
        raise ConfigError(f"{setting('from_step', from_step)}: {m.path} holds no sample at or after that step; "
                          "nothing is left to train")
    return np.split(keep, np.cumsum(sizes)[:-1]), info


def write_rows(m: Manifest, masks: list[np.ndarray], path: str) -> None:
    """Write the selected rows of every rank file, in rank-file order, without ``step`` and
    ``rank``, to the local Parquet file ``path`` (column types kept)."""
    def read(r: int) -> pa.Table:
        fs, where = fsio.filesystem_and_path(m.rank_file(r))
        try:
            names = pq.read_schema(where, filesystem=fs).names
            t = pq.read_table(where, columns=[c for c in names if c not in (S.STEP, S.RANK)], filesystem=fs)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input {m.rank_file(r)}: cannot read the rank file ({str(e).splitlines()[0]}); "
                             f"run 'fsdata verify {m.path}'") from None
        t = t.replace_schema_metadata(None)
        return t if masks[r].all() else t.filter(pa.array(masks[r]))

    writer = None
    try:  # the next rank file is read (on a thread, Arrow releases the GIL) while one is written
        with ThreadPoolExecutor(max_workers=1) as ex:
            ahead = ex.submit(read, 0)
            for r in range(len(masks)):
                t = ahead.result()
                if r + 1 < len(masks):
                    ahead = ex.submit(read, r + 1)
                if writer is None:  # a scratch file read once: plain pages, no codec (encoding cost more than I/O)
                    writer = pq.ParquetWriter(path, t.schema, compression=VIEW_COMPRESSION, use_dictionary=False)
                if t.num_rows:
                    writer.write_table(t, row_group_size=VIEW_ROW_GROUP)
                del t
    finally:
        if writer is not None:
            writer.close()


@contextlib.contextmanager
def output_as_input(path: str | os.PathLike, from_step: int | None = None) -> Iterator[OutputInput]:
    """Read an OUTPUT's samples into a temporary Parquet file (local ``TMPDIR``), removed on exit.

    Args:
        path: an ``fsdata balance`` OUTPUT (local folder or URI).
        from_step: S: only the samples not yet trained after S steps (module docstring).

    Yields:
        :class:`OutputInput` with ``path`` the temporary file.

    Raises:
        InputError: a missing or malformed manifest, an unreadable rank file.
        ConfigError: ``from_step`` outside the OUTPUT's steps.
    """
    m = read_output_manifest(path)
    masks, info = select_rows(m, from_step)
    tmp = tempfile.mkdtemp(prefix="fsdata-output-input-")
    try:
        info.path = os.path.join(tmp, VIEW_NAME)
        write_rows(m, masks, info.path)
        yield info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _first_row_at(m: Manifest, r: int, step: int) -> int:
    """The first row of rank file ``r`` with ``step >= step`` (its rows are in step order): row
    groups skipped by the ``step`` column's statistics, one row group's ``step`` values read."""
    fs, where = fsio.filesystem_and_path(m.rank_file(r))
    try:
        pf = pq.ParquetFile(where, filesystem=fs)
        meta = pf.metadata
        leaf = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == S.STEP)
        first = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            st = meta.row_group(g).column(leaf).statistics
            if st is not None and st.has_min_max and (st.max < step or st.min >= step):
                if st.min >= step:
                    return first
                first += n
                continue
            steps = pf.read_row_group(g, columns=[S.STEP]).column(0).to_numpy()
            k = int(np.searchsorted(steps, step, side="left"))
            if k < n:
                return first + k
            first += n
        return first
    except (OSError, pa.ArrowException, StopIteration) as e:
        raise _unreadable(m, r, e) from None


def suffix_row_starts(m: Manifest, from_step: int | None) -> list[int] | None:
    """Per rank file, its first row read when the rows read are a suffix of every rank file (one
    epoch, or ``from_step`` in the last epoch; module docstring), else None (first occurrences:
    the scratch copy).

    Raises:
        InputError: a rank file cannot be read.
    """
    if m.epochs > 1 and (from_step is None or int(m.epoch_of_step(from_step)) != m.epochs - 1):
        return None
    if from_step is None or from_step == 0:  # every row: no footer to open
        return [0] * m.num_ranks
    return [_first_row_at(m, r, int(from_step)) for r in range(m.num_ranks)]


def _identify(src: SampleSource, m: Manifest, from_step: int | None) -> SampleSource:
    """Name the input by the rank files and the selection (:func:`fsdata.shards.plan_file.input_digest`)."""
    src.digest_files = [m.rank_file(r) for r in range(m.num_ranks)]
    src.selection = f"fsdata-output-rows/1 from_step={from_step}"
    return src


@contextlib.contextmanager
def open_output(path: str | os.PathLike, from_step: int | None = None) -> Iterator[OutputInput]:
    """An OUTPUT's samples (module docstring) as :attr:`OutputInput.source`: its rank files read in
    place when the rows read are a suffix of each (:func:`suffix_row_starts`, :data:`READ_IN_PLACE`),
    else a scratch copy (:func:`output_as_input`, removed on exit).

    Raises:
        InputError: a missing or malformed manifest, an unreadable rank file.
        ConfigError: ``from_step`` outside the OUTPUT's steps, or no sample at or after it.
    """
    m = read_output_manifest(path)
    check_from_step(m, from_step)
    starts = suffix_row_starts(m, from_step) if READ_IN_PLACE else None
    if starts is None:
        with output_as_input(path, from_step) as copied:
            copied.source = _identify(open_samples(copied.path), m, from_step)
            yield copied
        return
    info = OutputInput(manifest=m, plan_digest=_plan_digest(m), from_step=from_step)
    if from_step is not None:
        info.epoch = int(m.epoch_of_step(from_step))
    files = [m.rank_file(r) for r in range(m.num_ranks)]
    # every step of an OUTPUT holds samples: rows are left at any valid from_step
    src = open_sample_files(m.path, files, {}, row_starts=starts, drop_columns=(S.STEP, S.RANK))
    info.num_samples = src.num_rows
    info.source = _identify(src, m, from_step)
    yield info


def carried_keys(old: Manifest, new_output: str | os.PathLike) -> dict:
    """The optional manifest keys a resharded OUTPUT carries over from the old one: ``num_items``,
    ``vocab`` (its ``path`` rewritten relative to the new OUTPUT, or null when that cannot be
    expressed) and ``feature_columns``, where present."""
    out = {}
    for key in ("num_items", "vocab", "feature_columns"):
        if key in old.extra:
            out[key] = old.extra[key]
    vocab = out.get("vocab")
    if isinstance(vocab, dict) and vocab.get("path"):
        new_output = fsio.normalize(new_output)
        if fsio.is_remote(old.path) or fsio.is_remote(new_output):
            out["vocab"] = {**vocab, "path": None}
        else:
            target = os.path.join(old.path, vocab["path"])
            out["vocab"] = {**vocab, "path": os.path.relpath(os.path.abspath(target), os.path.abspath(new_output))}
    return out


def reshard_settings(settings, view: OutputInput):
    """The settings to plan ``view``'s samples with: with ``from_step``, the epochs left of the old
    OUTPUT (``view.epochs_left``: the partial epoch, then the whole ones); ``--epochs`` may be left
    at 1 or name that number.

    Raises:
        ConfigError: ``--epochs`` other than 1 or the epochs left.
    """
    import dataclasses  # noqa: PLC0415

    if view.from_step is None:
        return settings
    E = view.epochs_left
    if settings.epochs not in (1, E):
        raise ConfigError(f"--epochs {settings.epochs} with {setting('from_step', view.from_step)}: the new OUTPUT "
                          f"holds the {E} epoch(s) left of {view.manifest.path} "
                          f"(the rest of its epoch {view.epoch}, then the "
                          f"whole ones after it); drop --epochs or pass --epochs {E}")
    if view.plan_digest is None:
        raise InputError(f"input {view.manifest.path}: its rank files record no plan digest (written by an older "
                         "fsdata), so the new OUTPUT's lineage could not name it; rerun 'fsdata balance' on the "
                         "samples instead")
    return dataclasses.replace(settings, epochs=E)


def record_lineage(plan, view: OutputInput, new_output: str | os.PathLike) -> None:
    """Record in ``plan``'s metadata (so in the new manifest) what the old OUTPUT knew and, with
    ``from_step``, the lineage: ``settings.samples`` (the sample kind, which picks the training
    objective), the keys of :func:`carried_keys`, ``resharded_from`` ``{"plan_digest", "from_step"}``
    and, with a partial first epoch, ``first_epoch_num_samples``."""
    old = view.manifest
    meta = plan.meta
    if meta.settings.get("samples") is None:
        meta.settings["samples"] = (old.settings or {}).get("samples")
    extra = meta.manifest_extra
    extra.update(carried_keys(old, new_output))
    if view.from_step is not None:
        extra["resharded_from"] = {"plan_digest": view.plan_digest, "from_step": int(view.from_step)}
    if view.first_epoch_mask is not None:
        extra["first_epoch_num_samples"] = view.first_epoch_num_samples
