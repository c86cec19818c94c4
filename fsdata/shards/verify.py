"""``fsdata verify``: recompute everything a reader of an OUTPUT relies on (docs/format.md).

Checks, each failure one :class:`VerifyError` line (the CLI exits 2, never a traceback):

* the manifest (format_version 1 or 2) parses and is well typed (:class:`fsdata.shards.manifest.Manifest`),
  with a SHA-256 and byte size for every rank file, the rank files at their format's paths, a
  3-coefficient cost model, known policy names and settings that agree with the top-level keys;
* nothing under OUTPUT that the manifest does not list (an extra ``part-00001.parquet`` or
  ``rank-00064/`` would be read by every folder-level reader);
* every rank file: present, of the recorded size and SHA-256 and row count, the manifest's
  ``columns`` with ``step`` int32 (and ``rank`` int32 equal to the file's rank in v2), rows ordered
  by step, steps ``0..num_steps-1``, row groups that hold whole steps with ``step`` statistics;
* ``_step_stats.parquet`` recomputed from the rank files (counts exactly, predicted costs to
  1e-9 relative: float sums in another order), ``batch_size_per_rank`` per rank per step under
  the fixed policy, ``sample_id`` unique, the counts and ``_dropped.parquet`` consistent;
* ``predicted_bubble`` recomputed from the rank files; ``lower_bound_bubble`` recomputed from
  the written steps (fixed policy);
* ``num_tokens`` of the step stats (fsdata >= 0.3; older outputs lack it) equals the sum of the
  rows' ``len(item_ids)`` per (step, rank), exactly;
* with E epochs (``epochs``, ``steps_per_epoch`` or under cost-budget ``epoch_num_steps``;
  absent = 1): epoch e is steps ``e*steps_per_epoch .. (e+1)*steps_per_epoch - 1`` (cost-budget:
  the epochs' step counts in order), and every epoch holds every sample exactly
  once, written in that epoch or recorded as dropped in that epoch (``_dropped.parquet``'s
  ``epoch`` column); no sample twice in one epoch, none missing;
* with ``--input``: written plus dropped equals the input set (in every epoch); every written row's content equals
  the input row of the same ``sample_id`` (a per-sample hash of all input columns); the written
  steps hold the seeded global batches (``seed``; epoch e: :func:`fsdata.balancer.order.epoch_seed`), window by window under composition
  (``settings.compose_window``); ``baseline_predicted_bubble`` recomputed from the input; under ``strategy = shuffle`` every per-rank
  batch is the seeded contiguous slice.

OUTPUT (and ``--input``) may be a :mod:`pyarrow.fs` URI (``s3://bucket/shards``; :mod:`fsdata.fsio`):
every listing and read then goes through its ``FileSystem``; a prefix without ``_manifest.json`` is
reported as an incomplete OUTPUT (on object stores the manifest is the commit marker, written last).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from fsdata import fsio
from fsdata.balancer import bubble
from fsdata.samples import schema as S
from fsdata.balancer.cost import CostModel, load_cost_model
from fsdata.errors import FsdataError, InputError, VerifyError
from fsdata.samples.io import open_samples, sorted_unique
from fsdata.shards.manifest import (
    MANIFEST_NAMES,
    Manifest,
    ManifestError,
    is_sha256,
    rank_dir_name,
    rank_file_path,
    sha256_file,
)
from fsdata.balancer.plan import BATCH_POLICIES, LEGACY_SHUFFLE, REMAINDER_POLICIES, STRATEGIES, shuffled_steps

_HASH_SEED = 0x5EEDF5DA7A


def read_manifest(output: str | os.PathLike) -> Manifest:
    """Read an OUTPUT's manifest (thin wrapper of :meth:`Manifest.read`).

    Raises:
        VerifyError: missing, unparsable, unknown ``format_version``, or malformed.
    """
    try:
        return Manifest.read(output)
    except ManifestError as e:
        raise VerifyError(str(e)) from None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 + 1e-9 * abs(b)


def _cost_model(m: Manifest) -> CostModel:
    coef = m.cost_model.get("coefficients")
    if not isinstance(coef, list) or len(coef) != 3 or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) for c in coef):
        raise VerifyError(f"manifest cost_model coefficients {coef!r} are not 3 numbers [c0, c1, c2]; "
                          "rerun 'fsdata balance'")
    try:
        return load_cost_model(m.cost_model)
    except FsdataError as e:
        raise VerifyError(f"manifest cost_model: {e}") from None


_V2_SETTINGS = ("num_ranks", "batch_size_per_rank", "seed", "strategy", "batch_policy", "remainder", "partitioner")


_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?([.+-]?[0-9A-Za-z.+-]*)?$")


def _check_recorded_settings(m: Manifest, where: str) -> None:
    """What the manifest records about how it was made must hang together (without the input):
    ``batch_policy`` against ``settings.budget_used`` / ``partition_info`` and the per-rank counts'
    policy, the partitioner name, ``plan_window``, the cost model's name and ``fsdata_version``."""
    from fsdata.balancer.plan import PARTITIONERS  # noqa: PLC0415

    s = m.settings or {}
    fix = "the manifest was edited: rerun 'fsdata balance'"
    if m.format_version >= 2 and m.fsdata_version is not None and (
            not isinstance(m.fsdata_version, str) or not _VERSION.match(m.fsdata_version)):
        raise VerifyError(f"{where}: fsdata_version {m.fsdata_version!r} is not a version; {fix}")
    if "partitioner" in s and isinstance(s["partitioner"], str) and s["partitioner"] not in PARTITIONERS:
        raise VerifyError(f"{where}: settings.partitioner {s['partitioner']!r} is not one of "
                          f"{', '.join(PARTITIONERS)}; {fix}")
    info = s.get("partition_info")
    method = info.get("method") if isinstance(info, dict) else None
    if "budget_used" in s:
        if m.batch_policy == "fixed" and s["budget_used"] is not None:
            raise VerifyError(f"{where}: batch_policy is 'fixed' but settings.budget_used is {s['budget_used']!r} "
                              f"(set by cost-budget only); {fix}")
        if m.batch_policy == "cost-budget" and m.strategy == "balanced" and not isinstance(s["budget_used"],
                                                                                          (int, float)):
            raise VerifyError(f"{where}: batch_policy is 'cost-budget' but settings.budget_used is "
                              f"{s['budget_used']!r}; {fix}")
    if method is not None and m.strategy == "balanced" and (method == "cost-budget") != (m.batch_policy == "cost-budget"):
        raise VerifyError(f"{where}: batch_policy is {m.batch_policy!r} but settings.partition_info.method is "
                          f"{method!r}; {fix}")
    pw, cw = s.get("plan_window"), s.get("compose_window", 1)
    if pw is not None and (not isinstance(pw, int) or isinstance(pw, bool) or pw < 1
                           or (isinstance(cw, int) and cw >= 1 and pw % cw)):
        raise VerifyError(f"{where}: settings.plan_window {pw!r} is not a positive multiple of compose_window "
                          f"{cw!r}; {fix}")
    name = m.cost_model.get("name") if isinstance(m.cost_model, dict) else None
    if isinstance(name, str) and name.split(":", 1)[0] in ("tokens", "quadratic", "verl", "hstu", "poly"):
        try:
            named = load_cost_model(name)
        except FsdataError:
            raise VerifyError(f"{where}: cost_model name {name!r} is not a cost model; {fix}") from None
        coef = m.cost_model.get("coefficients")
        if not isinstance(coef, list) or len(coef) != 3 or any(
                not isinstance(c, (int, float)) or not _close(float(c), float(n))
                for c, n in zip(coef, named.coefficients)):
            raise VerifyError(f"{where}: cost_model name {name!r} has coefficients {list(named.coefficients)}, "
                              f"the manifest records {coef!r}; {fix}")


def _check_manifest_fields(m: Manifest, where: str) -> None:
    for value, allowed, key in ((m.strategy, STRATEGIES, "strategy"), (m.batch_policy, BATCH_POLICIES, "batch_policy"),
                                (m.remainder_policy, REMAINDER_POLICIES, "remainder_policy")):
        if value not in allowed:
            raise VerifyError(f"{where}: {key} {value!r} is not one of {', '.join(allowed)}; rerun 'fsdata balance'")
    for key in ("num_samples_input", "num_samples_written", "num_samples_dropped", "seed", "predicted_bubble",
                "step_stats_file"):
        if getattr(m, key) is None:
            raise VerifyError(f"{where} lacks '{key}'; rerun 'fsdata balance'")
    if m.format_version >= 2:
        for key in ("fsdata_version", "input_digest", "baseline_predicted_bubble", "lower_bound_bubble",
                    "step_stats_sha256"):
            if getattr(m, key) is None:
                raise VerifyError(f"{where} lacks '{key}'; rerun 'fsdata balance'")
        for key in ("step_stats_sha256", "dropped_sha256"):
            v = getattr(m, key)
            if v is not None and not is_sha256(v):
                raise VerifyError(f"{where}: {key} {v!r} is not a SHA-256 hex digest; rerun 'fsdata balance'")
        if not re.fullmatch(r"sha256-footers:[0-9a-f]{64}", m.input_digest):
            raise VerifyError(f"{where}: input_digest {m.input_digest!r} is not 'sha256-footers:<64 hex>'; "
                              "rerun 'fsdata balance'")
        if (m.dropped_sha256 is None) != (m.dropped_file is None):
            raise VerifyError(f"{where}: dropped_sha256 and dropped_file must both be set or both null; "
                              "rerun 'fsdata balance'")
    for f in m.files:
        if not is_sha256(f.sha256):
            raise VerifyError(f"{where}: the file entry of rank {f.rank} has no valid sha256 ({f.sha256!r}); "
                              "rerun 'fsdata balance'")
        if f.num_bytes is None:
            raise VerifyError(f"{where}: the file entry of rank {f.rank} has no num_bytes; rerun 'fsdata balance'")
        expected = rank_file_path(f.rank, m.format_version)
        if f.path != expected:
            raise VerifyError(f"{where}: rank {f.rank}'s file is {f.path!r}, format_version {m.format_version} "
                              f"puts it at {expected!r}; rerun 'fsdata balance'")
    if m.format_version >= 2:
        import json

        from fsdata.shards.manifest import KEYS

        raw = json.loads(fsio.read_bytes(_at(m.path, MANIFEST_NAMES[2])).decode())
        missing = [k for k in KEYS if k not in raw]
        if missing:
            raise VerifyError(f"{where} lacks keys {missing}; rerun 'fsdata balance'")
        for k in ("predicted_bubble", "baseline_predicted_bubble", "lower_bound_bubble"):
            if raw[k] is not None and not isinstance(raw[k], float):  # fsdata writes these as JSON floats
                raise VerifyError(f"{where}: {k} is {raw[k]!r}, not a float as fsdata writes it; the manifest was "
                                  "edited: rerun 'fsdata balance'")
        missing = [k for k in _V2_SETTINGS if k not in m.settings]
        if missing:
            raise VerifyError(f"{where}: settings lacks {missing}; rerun 'fsdata balance'")
    # settings recorded in v2 must agree with the top-level keys
    s = m.settings
    for key, top in (("num_ranks", m.num_ranks), ("batch_size_per_rank", m.batch_size_per_rank), ("seed", m.seed),
                     ("strategy", m.strategy), ("batch_policy", m.batch_policy), ("remainder", m.remainder_policy)):
        if key in s and s[key] != top:
            raise VerifyError(f"{where}: settings.{key} is {s[key]!r} but {key if key != 'remainder' else 'remainder_policy'}"
                              f" is {top!r}; the manifest was edited: rerun 'fsdata balance'")
    _check_recorded_settings(m, where)
    if m.remainder_policy == "error" and m.num_samples_dropped:
        raise VerifyError(f"{where}: remainder_policy is 'error' but {m.num_samples_dropped} samples are recorded as dropped")
    if m.num_samples_dropped and not m.dropped_file:
        raise VerifyError(f"{where}: {m.num_samples_dropped} samples dropped but no dropped_file; rerun 'fsdata balance'")


def _at(out: Path | str, *parts: str) -> Path | str:
    """``out/part/...``: a :class:`Path` for a local OUTPUT, a URI string for a remote one."""
    return fsio.join(out, *parts) if isinstance(out, str) else out.joinpath(*parts)


def _check_listing(out: Path | str, m: Manifest) -> None:
    """Nothing under OUTPUT that the manifest does not list."""
    allowed_root = {MANIFEST_NAMES[m.format_version], m.step_stats_file}
    if m.dropped_file:
        allowed_root.add(m.dropped_file)
    rank_dirs = {rank_dir_name(f.rank, m.format_version): f for f in m.files}
    for name, folder in fsio.list_dir(out):
        p = _at(out, name)
        if name in allowed_root and not folder:
            continue
        if isinstance(out, str) and name == fsio.VERSIONS_DIR and folder:
            continue  # versions of an object-store OUTPUT (a replace killed before its pointer switched)
        f = rank_dirs.get(name)
        if f is not None and folder:
            inside = sorted(q for q, _ in fsio.list_dir(p))
            want = Path(f.path).name
            extra = [n for n in inside if n != want]
            if extra:
                raise VerifyError(f"{p}: holds {extra[:5]} that the manifest does not list (only {want}); folder-level "
                                  "readers would read them: remove them or rerun 'fsdata balance'")
            continue
        kind = "folder" if folder else "file"
        raise VerifyError(f"{p}: {kind} that the manifest does not list; folder-level readers would read it: remove it "
                          "or rerun 'fsdata balance'")


def _check_sha(path: Path | str, digest: str | None, check: bool) -> None:
    if check and digest is not None and fsio.is_file(path) and sha256_file(path) != digest:
        raise VerifyError(f"checksum of {path} differs from the manifest (file changed or corrupt); rerun 'fsdata balance'")


def _read_step_stats(out: Path | str, m: Manifest, check_checksums: bool = True) -> pa.Table:
    path = _at(out, m.step_stats_file)
    _check_sha(path, m.step_stats_sha256, check_checksums)
    try:
        t = m.read_step_stats()
    except ManifestError as e:
        raise VerifyError(str(e)) from None
    need = {"step": pa.int32(), "rank": pa.int32(), "num_samples": pa.int32(), "predicted_cost": pa.float64()}
    if "num_tokens" in t.schema.names:  # fsdata >= 0.3
        need["num_tokens"] = pa.int64()
    if t.schema.names != list(need) or any(t.schema.field(k).type != v for k, v in need.items()):
        raise VerifyError(f"{path}: columns {t.schema} differ from step int32, rank int32, num_samples int32, "
                          "predicted_cost float64[, num_tokens int64]; rerun 'fsdata balance'")
    if t.num_rows != m.num_steps * m.num_ranks or any(t.column(k).null_count for k in need):
        raise VerifyError(f"{path} has {t.num_rows} rows (or nulls), expected num_steps*num_ranks = "
                          f"{m.num_steps * m.num_ranks}; rerun 'fsdata balance'")
    steps = np.repeat(np.arange(m.num_steps), m.num_ranks)
    ranks = np.tile(np.arange(m.num_ranks), m.num_steps)
    if not (np.array_equal(t.column("step").to_numpy(), steps) and np.array_equal(t.column("rank").to_numpy(), ranks)):
        raise VerifyError(f"{path}: rows are not one per (step, rank) sorted by step then rank; rerun 'fsdata balance'")
    return t


def _read_dropped(out: Path | str, m: Manifest, check_checksums: bool = True) -> np.ndarray:
    if not m.dropped_file:
        return np.empty(0, np.int64)
    path = _at(out, m.dropped_file)
    _check_sha(path, m.dropped_sha256, check_checksums)
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        t = pq.read_table(where, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise VerifyError(f"{path} is missing or unreadable ({str(e).splitlines()[0]}); rerun 'fsdata balance'") from None
    if (S.SAMPLE_ID not in t.schema.names or not pa.types.is_integer(t.schema.field(S.SAMPLE_ID).type)
            or t.column(S.SAMPLE_ID).null_count):
        raise VerifyError(f"{path}: no integer sample_id column without nulls; rerun 'fsdata balance'")
    return t.column(S.SAMPLE_ID).to_numpy().astype(np.int64)


def _read_dropped_epochs(out: Path | str, m: Manifest, num_dropped: int) -> np.ndarray:
    """Epoch of each dropped row: the ``epoch`` column of ``_dropped.parquet`` (E > 1), else zeros."""
    if m.epochs == 1 or not m.dropped_file:
        return np.zeros(num_dropped, np.int64)
    path = _at(out, m.dropped_file)
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        t = pq.read_table(where, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise VerifyError(f"{path} is missing or unreadable ({str(e).splitlines()[0]}); rerun 'fsdata balance'") from None
    if "epoch" not in t.schema.names or not pa.types.is_integer(t.schema.field("epoch").type) or t.column("epoch").null_count:
        raise VerifyError(f"{path}: no integer epoch column without nulls, though the output holds {m.epochs} epochs; "
                          "rerun 'fsdata balance'")
    ep = t.column("epoch").to_numpy().astype(np.int64)
    if len(ep) and (ep.min() < 0 or ep.max() >= m.epochs):
        raise VerifyError(f"{path}: epoch {int(ep[(ep < 0) | (ep >= m.epochs)][0])} lies outside 0..{m.epochs - 1}; "
                          "rerun 'fsdata balance'")
    return ep


def _check_epochs(m: Manifest, ids: np.ndarray, steps_written: np.ndarray, dropped: np.ndarray,
                  dropped_epoch: np.ndarray) -> None:
    """Every epoch holds every sample exactly once: written in it or dropped in it (E > 1)."""
    E, first = m.epochs, m.epoch_first_steps()
    if m.settings.get("epochs", E) != E:
        raise VerifyError(f"manifest settings.epochs is {m.settings.get('epochs')!r} but epochs is {E}; the manifest "
                          "was edited: rerun 'fsdata balance'")
    epoch = m.epoch_of_step(steps_written)
    reference = None
    for e in range(E):
        span = f"steps {int(first[e])}..{int(first[e + 1]) - 1}"
        written = ids[epoch == e]
        dropped_e = dropped[dropped_epoch == e]
        uniq, dup = sorted_unique(written)
        if dup:
            raise VerifyError(f"epoch {e} ({span}): {dup} samples appear more than once; "
                              "every epoch must hold every sample exactly once: rerun 'fsdata balance'")
        if len(dropped_e) and (sorted_unique(dropped_e)[1] or np.isin(dropped_e, uniq).any()):
            raise VerifyError(f"epoch {e}: some samples are recorded as dropped twice, or both written and dropped")
        held = np.sort(np.concatenate([written, dropped_e]))
        if len(held) != m.num_samples_input:
            raise VerifyError(f"epoch {e} ({span}) holds {len(held)} samples written or "
                              f"dropped, the input has {m.num_samples_input}; every epoch must hold every sample "
                              "exactly once: rerun 'fsdata balance'")
        if reference is None:
            reference = held
        elif not np.array_equal(held, reference):
            lost = np.setdiff1d(reference, held)
            raise VerifyError(f"epoch {e} lacks {len(lost)} samples of epoch 0 (e.g. sample_id "
                              f"{lost[:3].tolist()}); every epoch must hold every sample exactly once: rerun "
                              "'fsdata balance'")


def _row_hashes(table: pa.Table) -> np.ndarray:
    """Per-row uint64 hash of all columns of ``table`` (Polars ``hash_rows`` with a fixed seed; both sides hashed in one process)."""
    return pl.from_arrow(table).hash_rows(seed=_HASH_SEED).to_numpy()


def _check_rank_file(out: Path | str, m: Manifest, f, check_checksums: bool, hash_content: bool):
    r, path = f.rank, _at(out, f.path)
    if not fsio.is_file(path):
        raise VerifyError(f"rank {r}: file {path} is missing; rerun 'fsdata balance' or copy the whole OUTPUT")
    num_bytes = fsio.size(path)
    if num_bytes != f.num_bytes:
        raise VerifyError(f"rank {r}: {path} has {num_bytes} bytes, the manifest says {f.num_bytes} "
                          "(file changed or truncated)")
    if check_checksums and sha256_file(path) != f.sha256:
        raise VerifyError(f"rank {r}: checksum of {path} differs from the manifest (file changed or corrupt)")
    need = [S.SAMPLE_ID, S.ITEM_IDS, S.STEP] + ([S.RANK] if m.format_version >= 2 else [])
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        pf = pq.ParquetFile(where, filesystem=fs)
        names = pf.schema_arrow.names
        if names != m.columns:
            raise VerifyError(f"rank {r}: {path} has columns {names}, the manifest says {m.columns}")
        missing = [c for c in need if c not in names]
        if missing:
            raise VerifyError(f"rank {r}: {path} lacks columns {missing}")
        # all columns only when comparing content with the input; else the ones checked here
        t = pf.read(columns=None if hash_content else need)
    except (pa.ArrowException, OSError) as e:
        raise VerifyError(f"rank {r}: {path} is unreadable ({str(e).splitlines()[0]})") from None
    if t.schema.field(S.STEP).type != pa.int32() or (m.format_version >= 2 and t.schema.field(S.RANK).type != pa.int32()):
        raise VerifyError(f"rank {r}: {path}: step/rank are not int32")
    if t.num_rows != f.num_rows:
        raise VerifyError(f"rank {r}: {t.num_rows} rows, manifest says {f.num_rows}")
    for c in (S.SAMPLE_ID, S.STEP, S.ITEM_IDS) + ((S.RANK,) if m.format_version >= 2 else ()):
        if t.column(c).null_count:
            raise VerifyError(f"rank {r}: {path}: column {c} holds nulls")
    if m.format_version >= 2:
        rk = t.column(S.RANK).to_numpy()
        if len(rk) and (rk != r).any():
            raise VerifyError(f"rank {r}: {path}: the rank column holds {int(rk[rk != r][0])}, not {r}")
    step = t.column(S.STEP).to_numpy().astype(np.int64)
    if len(step) and (step.min() < 0 or step.max() >= m.num_steps):
        raise VerifyError(f"rank {r}: steps {int(step.min())}..{int(step.max())} lie outside 0..{m.num_steps - 1}")
    if len(step) and (np.diff(step) < 0).any():
        raise VerifyError(f"rank {r}: rows are not ordered by step")
    # row groups hold whole steps, with step statistics (readers resume and cut steps with them)
    md = pf.metadata
    step_col = next(j for j in range(md.num_columns) if pf.schema.column(j).path == S.STEP)
    start = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        n = rg.num_rows
        st = rg.column(step_col).statistics
        if n and (st is None or not st.has_min_max or int(st.min) != step[start] or int(st.max) != step[start + n - 1]):
            raise VerifyError(f"rank {r}: {path} row group {g} lacks correct step statistics; rerun 'fsdata balance'")
        if g and n and start and step[start] == step[start - 1]:
            raise VerifyError(f"rank {r}: {path} row group {g} starts inside step {int(step[start])} (a step spans two "
                              "row groups); rerun 'fsdata balance'")
        start += n
    lengths = pc.list_value_length(t.column(S.ITEM_IDS)).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(lengths) and lengths.min() < 1:
        raise VerifyError(f"rank {r}: {path}: some item_ids are empty")
    hashes = None
    if hash_content:
        drop = [S.STEP] + ([S.RANK] if m.format_version >= 2 else [])
        hashes = _row_hashes(t.drop_columns(drop))
    return step, lengths, t.column(S.SAMPLE_ID).to_numpy().astype(np.int64), hashes


def verify(output: str | os.PathLike, input_path: str | os.PathLike | None = None, *,
           column_map: str | None = None, check_checksums: bool = True, progress: bool = False) -> dict:
    """Verify an OUTPUT; raise on the first violated invariant (see the module docstring).

    Args:
        output: the OUTPUT folder of ``fsdata balance`` (format_version 1 or 2).
        input_path: the balance INPUT, to check samples, content, seed and the input-side bubbles.
        column_map: ``--columns`` mapping used for the input.
        check_checksums: recompute SHA-256 of every rank file.
        progress: show a progress bar over rank files.

    Returns:
        Summary dict: ``format_version``, ``num_ranks``, ``num_steps``, ``num_samples_written``,
        ``num_samples_dropped``, ``predicted_bubble`` (recomputed), ``baseline_predicted_bubble``,
        ``lower_bound_bubble``, ``checked_input``.

    Raises:
        VerifyError: any violation or malformed file, one line with the rank/step and numbers.
        InputError: ``input_path`` is not a readable sample input.
    """
    output = fsio.resolve_pointer(output)  # normalised; an object store's pointer object followed
    if input_path is not None:
        input_path = fsio.normalize(input_path)
    try:
        return _verify(output if fsio.is_remote(output) else Path(output), input_path, column_map, check_checksums,
                       progress)
    except FsdataError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed output must give one line, never a traceback
        from fsdata.guards import environment_error  # noqa: PLC0415

        env = environment_error(e, output, action="read")
        if env is not None:  # the store or the machine failed, not the output
            raise env from None
        msg = str(e).splitlines()[0] if str(e) else ""
        raise VerifyError(f"{output} is malformed ({type(e).__name__}: {msg}); rerun 'fsdata balance'") from None


def _verify(out: Path | str, input_path, column_map, check_checksums: bool, progress: bool) -> dict:
    if not fsio.is_dir(out):
        what = "prefix holding objects" if isinstance(out, str) else "folder"
        raise VerifyError(f"{out} is not a {what}; pass an 'fsdata balance' OUTPUT")
    m = read_manifest(out)
    where = str(_at(out, MANIFEST_NAMES[m.format_version]))
    _check_manifest_fields(m, where)
    _check_listing(out, m)
    cost_model = _cost_model(m)
    R, steps, B = m.num_ranks, m.num_steps, m.batch_size_per_rank
    stats = _read_step_stats(out, m, check_checksums)
    expected_counts = stats.column("num_samples").to_numpy().astype(np.int64).reshape(steps, R)
    if m.batch_policy == "fixed" and not (expected_counts == B).all():
        raise VerifyError(f"step_stats counts differ from batch_size_per_rank={B} under the fixed policy")
    recorded = (m.extra or {}).get("per_rank_count")
    if recorded is not None:
        c = expected_counts
        want = {"min": int(c.min()), "median": float(np.median(c)), "max": int(c.max()), "mean": float(c.mean())}
        if not isinstance(recorded, dict) or any(not isinstance(recorded.get(k), (int, float))
                                                 or not _close(float(recorded[k]), v) for k, v in want.items()):
            raise VerifyError(f"manifest per_rank_count {recorded!r} differs from the step stats' {want}; "
                              "rerun 'fsdata balance'")
    loads = np.zeros((steps, R))
    tokens = np.zeros((steps, R), dtype=np.int64)
    all_ids: list[np.ndarray] = []
    all_hashes: list[np.ndarray] = []
    step_of: list[np.ndarray] = []
    rank_of: list[np.ndarray] = []
    cost_of: list[np.ndarray] = []
    for f in tqdm(m.files, unit="rank", desc="verify", disable=not progress):
        r = f.rank
        step, lengths, ids, hashes = _check_rank_file(out, m, f, check_checksums, input_path is not None)
        got = np.bincount(step, minlength=steps)
        bad = np.flatnonzero(got != expected_counts[:, r])
        if len(bad):
            s = int(bad[0])
            raise VerifyError(f"rank {r}, step {s}: {int(got[s])} rows, step_stats says {int(expected_counts[s, r])}; "
                              "ranks would disagree on the step count")
        costs = cost_model.cost(lengths)
        loads[:, r] = np.bincount(step, weights=costs, minlength=steps)
        tokens[:, r] = np.bincount(step, weights=lengths.astype(np.float64), minlength=steps).astype(np.int64)
        all_ids.append(ids)
        rank_of.append(np.full(len(ids), r, dtype=np.int64))
        step_of.append(step)
        cost_of.append(costs)
        if hashes is not None:
            all_hashes.append(hashes)
    recorded_costs = stats.column("predicted_cost").to_numpy().reshape(steps, R)
    off = np.argwhere(np.abs(recorded_costs - loads) > 1e-9 * np.maximum(np.abs(loads), 1.0))
    if len(off):
        s, r = map(int, off[0])
        raise VerifyError(f"step_stats predicted_cost of step {s} rank {r} is {float(recorded_costs[s, r])!r}, recomputed "
                          f"{float(loads[s, r])!r} under the manifest's cost model; rerun 'fsdata balance'")
    if "num_tokens" in stats.schema.names:
        recorded_tokens = stats.column("num_tokens").to_numpy().reshape(steps, R)
        off = np.argwhere(recorded_tokens != tokens)
        if len(off):
            s, r = map(int, off[0])
            raise VerifyError(f"step_stats num_tokens of step {s} rank {r} is {int(recorded_tokens[s, r])}, the rank "
                              f"file's rows hold {int(tokens[s, r])} history items; rerun 'fsdata balance'")
    ids = np.concatenate(all_ids) if all_ids else np.empty(0, np.int64)
    if len(ids) != m.num_samples_written:
        raise VerifyError(f"{len(ids)} rows written, manifest says num_samples_written={m.num_samples_written}")
    E = m.epochs
    if E == 1:
        uniq, duplicates = sorted_unique(ids)
        if duplicates:
            raise VerifyError(f"{duplicates} samples appear more than once across ranks")
    dropped = _read_dropped(out, m, check_checksums)
    if len(dropped) != m.num_samples_dropped:
        raise VerifyError(f"{len(dropped)} dropped ids recorded, manifest says num_samples_dropped={m.num_samples_dropped}")
    if m.num_samples_written + m.num_samples_dropped != E * m.num_samples_input:
        raise VerifyError("num_samples_written + num_samples_dropped != num_samples_input"
                          f"{f' x epochs ({E})' if E > 1 else ''} in the manifest")
    dropped_epoch = _read_dropped_epochs(out, m, len(dropped))
    if E > 1:
        _check_epochs(m, ids, np.concatenate(step_of) if step_of else np.empty(0, np.int64), dropped, dropped_epoch)
    elif len(dropped) and (sorted_unique(dropped)[1] or np.isin(dropped, uniq).any()):
        raise VerifyError("some samples are recorded as dropped twice, or both written and dropped")
    achieved = bubble.run_bubble(loads)
    if not _close(achieved, m.predicted_bubble):
        raise VerifyError(f"recomputed predicted bubble {achieved:.9%} differs from the manifest's {m.predicted_bubble:.9%}")
    lower = m.lower_bound_bubble
    if m.batch_policy == "fixed" and lower is not None:
        # the bound depends only on each written step's cost multiset (composed or not)
        step_all, cost_all = np.concatenate(step_of), np.concatenate(cost_of)
        order = np.argsort(step_all, kind="stable")
        lb = bubble.lower_bound_bubble(cost_all[order].reshape(steps, R * B), R, B, kind=_bound_kind(m))
        if not _close(lb, lower):
            raise VerifyError(f"recomputed lower_bound_bubble {lb:.9%} differs from the manifest's {lower:.9%}")
    checked_input = False
    baseline = m.baseline_predicted_bubble
    if input_path is not None:
        baseline = _check_against_input(m, input_path, column_map, cost_model, ids, np.concatenate(step_of),
                                        np.concatenate(all_hashes), dropped, out, dropped_epoch,
                                        np.concatenate(rank_of))
        checked_input = True
    return {"format_version": m.format_version, "num_ranks": R, "num_steps": steps,
            "num_samples_written": int(len(ids)), "num_samples_dropped": int(len(dropped)),
            "predicted_bubble": achieved, "baseline_predicted_bubble": baseline, "lower_bound_bubble": lower,
            "checked_input": checked_input, **({"epochs": E, "steps_per_epoch": m.steps_per_epoch, "epoch_num_steps": m.epoch_num_steps}
               if E > 1 else {})}


def _check_against_input(m: Manifest, input_path, column_map, cost_model: CostModel, ids: np.ndarray,
                         steps_written: np.ndarray, hashes: np.ndarray, dropped: np.ndarray, out: Path | str,
                         dropped_epoch: np.ndarray | None = None, ranks_written: np.ndarray | None = None):
    """Sample set, per-sample content, seed, strategy and input-side bubbles against the input
    (per epoch with E > 1); the input digest; and (same fsdata version, one epoch) the whole plan
    recomputed from the input and the recorded settings (:func:`_check_recomputed_plan`)."""
    from fsdata.balancer.order import epoch_seed

    if column_map is None:
        column_map = m.settings.get("input_columns_renamed") or None
    src = open_samples(input_path, column_map)
    lengths, in_ids = src.lengths_and_ids()
    E, first_steps = m.epochs, m.epoch_first_steps()
    epoch_written = m.epoch_of_step(steps_written) if E > 1 else np.zeros(len(ids), np.int64)
    if dropped_epoch is None:
        dropped_epoch = np.zeros(len(dropped), np.int64)
    for e in range(E):
        accounted = np.concatenate([ids[epoch_written == e], dropped[dropped_epoch == e]])
        if len(in_ids) != len(accounted) or not np.array_equal(np.sort(in_ids), np.sort(accounted)):
            lost = np.setdiff1d(in_ids, accounted)
            extra = np.setdiff1d(accounted, in_ids)
            raise VerifyError(f"written + dropped{f' in epoch {e}' if E > 1 else ''} does not equal the input: "
                              f"{len(lost)} input samples missing (e.g. {lost[:5].tolist()}), {len(extra)} not in "
                              f"the input (e.g. {extra[:5].tolist()})")
    if len(in_ids) != m.num_samples_input:
        raise VerifyError(f"the input has {len(in_ids)} samples, the manifest says num_samples_input={m.num_samples_input}")
    # content: hash every input row (cast to the rank files' column types) and compare by sample_id
    from fsdata.shards.writer import output_schema

    schema = output_schema(src)
    in_schema = pa.schema([schema.field(i) for i in range(len(schema) - 2)])
    in_hash = np.empty(len(in_ids), dtype=np.uint64)
    pos = 0
    for path in src.files:
        fs, inner = fsio.filesystem_and_path(path)
        for batch in pq.ParquetFile(inner, filesystem=fs).iter_batches(batch_size=16384):
            t = pa.Table.from_batches([batch]).rename_columns(in_schema.names).cast(in_schema)
            in_hash[pos:pos + t.num_rows] = _row_hashes(t)
            pos += t.num_rows
    where = np.searchsorted(np.sort(in_ids), ids)
    order = np.argsort(in_ids, kind="stable")
    differ = np.flatnonzero(in_hash[order][where] != hashes)
    if len(differ):
        raise VerifyError(f"{len(differ)} written rows differ in content from the input row of the same sample_id "
                          f"(e.g. sample_id {int(ids[differ[0]])}); rerun 'fsdata balance'")
    # seeded global batches, input-side bubbles, strategy
    R, B, N = m.num_ranks, m.batch_size_per_rank, len(in_ids)
    if N < R * B:
        raise VerifyError(f"the input has {N} samples, fewer than one step of {R}x{B}")
    shuffle = (m.settings or {}).get("shuffle", LEGACY_SHUFFLE)
    costs = cost_model.cost(lengths)
    from fsdata.balancer.partition import per_rank_loads

    W = _compose_window(m)
    idx_of = np.argsort(in_ids, kind="stable")
    all_gsteps = []
    baseline_loads = []
    for e in range(E):
        gsteps, _ = shuffled_steps(N, R, B, epoch_seed(m.seed, e), shuffle=shuffle)
        step_costs = costs[gsteps]
        baseline_ranks = np.broadcast_to(np.arange(R * B, dtype=np.int32) // B, gsteps.shape)
        baseline_loads.append(per_rank_loads(step_costs, baseline_ranks, R))
        del step_costs, gsteps
    baseline = bubble.run_bubble(np.concatenate(baseline_loads))
    if m.baseline_predicted_bubble is not None and not _close(baseline, m.baseline_predicted_bubble):
        raise VerifyError(f"recomputed baseline_predicted_bubble {baseline:.9%} (seed {m.seed}) differs from the "
                          f"manifest's {m.baseline_predicted_bubble:.9%}")
    for e in range(E):
        seed_e = epoch_seed(m.seed, e)
        gsteps, _ = shuffled_steps(N, R, B, seed_e, shuffle=shuffle)
        if m.batch_policy == "fixed":
            # every written step holds samples of the seeded global batches of its composition window
            # (W = 1: exactly the seeded global batch of that step; docs/balancer.md, "Composition")
            sel = epoch_written == e
            step_of_id = np.full(N, -1, dtype=np.int64)
            row = idx_of[np.searchsorted(in_ids[idx_of], ids[sel])]
            e0 = int(first_steps[e])
            step_of_id[row] = steps_written[sel] - e0
            expect = np.repeat(np.arange(len(gsteps)), R * B)
            bad = np.flatnonzero(step_of_id[gsteps.ravel()] // W != expect // W)
            if len(bad):
                s = int(expect[bad[0]]) + e0
                where = "step" if W == 1 else f"window of {W} steps starting at step"
                first = s - (s - e0) % W
                raise VerifyError(f"{where} {first} does not hold the seeded global batch{'es' if W > 1 else ''} of "
                                  f"seed {m.seed}{f' (epoch {e}, epoch seed {seed_e})' if E > 1 else ''}; the output "
                                  "was made with another seed or edited: rerun 'fsdata balance'")
            if m.strategy == "shuffle":
                all_gsteps.append(gsteps)
    if m.batch_policy == "fixed":
        if m.strategy == "shuffle":
            gsteps = np.concatenate(all_gsteps)
            for f in m.files:
                fs, inner = fsio.filesystem_and_path(str(_at(out, f.path)))
                t = pq.read_table(inner, columns=[S.SAMPLE_ID], filesystem=fs)
                got = t.column(0).to_numpy().reshape(len(gsteps), B)
                want = in_ids[gsteps[:, f.rank * B:(f.rank + 1) * B]]
                if not np.array_equal(got, want):
                    raise VerifyError(f"rank {f.rank}: strategy is 'shuffle' but its per-rank batches are not the "
                                      f"seeded contiguous slices (seed {m.seed}); rerun 'fsdata balance'")
    if m.input_digest is not None:  # after the row checks, which name a lost or changed sample
        from fsdata.shards.plan_file import input_digest  # noqa: PLC0415

        got = input_digest(src)
        if got != m.input_digest:
            raise VerifyError(f"the manifest's input_digest {m.input_digest[:30]}... is not the digest of --input "
                              f"{input_path} ({got[:30]}...): the output was made from another input (or a rewritten "
                              "copy of it), or the manifest was edited: rerun 'fsdata balance' on this input")
    if ranks_written is not None and E == 1:  # several epochs: the per-epoch checks above
        _check_recomputed_plan(m, src, cost_model, costs, in_ids, ids, steps_written, ranks_written, out)
    return baseline


def _canon(x):
    import json  # noqa: PLC0415

    return json.loads(json.dumps(x, sort_keys=True, default=float))


def _check_recomputed_plan(m: Manifest, src, cost_model: CostModel, costs: np.ndarray, in_ids: np.ndarray,
                           ids: np.ndarray, steps_written: np.ndarray, ranks_written: np.ndarray,
                           out: Path | str) -> None:
    """Recompute the plan from the input and the manifest's settings (as ``fsdata balance`` made
    it) and require the output to be exactly it: every sample at its step, rank and position, and
    every recorded setting and figure (``settings`` incl. ``partition_info``, ``compose``,
    ``plan_window``, ``budget_used``; the extra figures; ``predicted_bubble``...) equal.

    Skipped (with a log line) for outputs of another fsdata version or shuffle, whose plans this
    version does not reproduce.

    Raises:
        VerifyError: the first difference, one line.
    """
    import logging  # noqa: PLC0415

    from fsdata._version import __version__  # noqa: PLC0415
    from fsdata.balancer.order import SHUFFLE  # noqa: PLC0415
    from fsdata.balancer.settings import BalanceSettings, plan_costs  # noqa: PLC0415
    from fsdata.shards.plan_file import plan_table_from_plan  # noqa: PLC0415

    st = m.settings or {}
    if m.fsdata_version != __version__ or st.get("shuffle") != SHUFFLE:
        logging.getLogger(__name__).info("plan not recomputed: %s was written by fsdata %s (this is %s)", out,
                                         m.fsdata_version, __version__)
        return
    try:
        settings = BalanceSettings(
            num_ranks=m.num_ranks, batch_size_per_rank=m.batch_size_per_rank, seed=m.seed, strategy=m.strategy,
            batch_policy=m.batch_policy, remainder=m.remainder_policy, partitioner=st.get("partitioner"),
            budget=st.get("budget"),
            compose_window=(st.get("compose") or {}).get("compose_window_requested") or st.get("compose_window") or 1,
            plan_window=st.get("plan_window") or 1, progress=False)
        plan = plan_costs(costs, settings)
        table = plan_table_from_plan(src, plan, in_ids, costs, cost_model, settings)
    except FsdataError as e:
        raise VerifyError(f"the manifest's settings do not reproduce a plan ({e}); the manifest was edited: rerun "
                          "'fsdata balance'") from None
    fix = "the output was edited or made with other settings: rerun 'fsdata balance'"
    meta = table.meta
    for key in sorted(set(meta["settings"]) | set(st)):
        want, got = _canon(meta["settings"].get(key)), _canon(st.get(key))
        if want != got:
            raise VerifyError(f"manifest settings.{key} is {str(got)[:120]}, recomputing the plan from --input gives "
                              f"{str(want)[:120]}; {fix}")
    for key, want in meta.get("manifest_extra", {}).items():
        if _canon((m.extra or {}).get(key)) != _canon(want):
            raise VerifyError(f"manifest {key} is {str((m.extra or {}).get(key))[:120]}, recomputing the plan "
                              f"gives {str(want)[:120]}; {fix}")
    for key in ("num_steps", "batch_policy", "strategy", "remainder_policy"):
        if getattr(m, key) != meta[key]:
            raise VerifyError(f"manifest {key} is {getattr(m, key)!r}, recomputing the plan gives {meta[key]!r}; {fix}")
    for key in ("predicted_bubble", "baseline_predicted_bubble", "lower_bound_bubble"):
        got = getattr(m, key)
        if (got is None) != (meta[key] is None) or (got is not None and float(got) != float(meta[key])):  # bit for bit
            shown = [None if x is None else float(x) for x in (got, meta[key])]
            raise VerifyError(f"manifest {key} is {shown[0]!r}, recomputing the plan gives {shown[1]!r}; {fix}")
    # every sample at the plan's step and rank, in the plan's order inside each rank file
    order = np.argsort(in_ids, kind="stable")
    row = order[np.searchsorted(in_ids[order], ids)]
    bad = np.flatnonzero((table.step[row] != steps_written) | (table.rank[row] != ranks_written))
    if len(bad):
        i = int(bad[0])
        raise VerifyError(f"sample_id {int(ids[i])} is at step {int(steps_written[i])} rank {int(ranks_written[i])}, "
                          f"the plan recomputed from --input puts it at step {int(table.step[row[i]])} rank "
                          f"{int(table.rank[row[i]])}; {fix}")
    want_key = (table.step[row].astype(np.int64) * m.num_ranks + table.rank[row]) * (len(ids) + 1) + \
        table.position[row]
    for r in range(m.num_ranks):
        sel = ranks_written == r
        k = want_key[sel]
        if len(k) > 1 and (np.diff(k) < 0).any():
            j = int(np.flatnonzero(np.diff(k) < 0)[0])
            raise VerifyError(f"rank {r}: rows {j} and {j + 1} are not in the plan's order inside their step (or "
                              f"steps); {fix}")


def _bound_kind(m) -> str:
    """Which lower-bound formula the manifest's ``lower_bound_bubble`` used (older outputs: ``simple``)."""
    kind = (m.extra or {}).get("lower_bound_kind", "simple")
    if kind not in bubble.BOUND_KINDS:
        raise VerifyError(f"manifest lower_bound_kind {kind!r} is not one of {bubble.BOUND_KINDS}; rerun 'fsdata balance'")
    return kind


def _compose_window(m) -> int:
    """The composition window the output was written with (1 when absent: older outputs)."""
    w = (m.settings or {}).get("compose_window", 1)
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise VerifyError(f"manifest settings.compose_window {w!r} is not a positive integer; rerun 'fsdata balance'")
    return w


__all__ = ["InputError", "VerifyError", "read_manifest", "verify"]
