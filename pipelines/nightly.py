"""The nightly preprocessing job on one machine: convert, profile, balance, verify, publish.

Composition only (the logic lives in :mod:`fsdata`). Layout under the work folder ``-o/--output``::

    .nightly.lock                    # held while a run works (filelock); one run at a time
    .nightly.lock.holder             # JSON: pid, host, start time and command of the holder
    history.jsonl                    # one line per publish or rollback
    runs/<run_key>/run.json          # run key, creation time, settings, fsdata version
    runs/<run_key>/samples.parquet   # convert output (absent when --format samples)
    runs/<run_key>/profile.json
    runs/<run_key>/shards/           # fsdata balance OUTPUT (docs/format.md)
    runs/<run_key>/verify.json
    runs/<run_key>/_SUCCESS          # written last: summary and the SHA-256 of every file of the run
    runs/.<run_key>.tmp-<pid>-<id>/  # a run being built; renamed to runs/<run_key> when complete
    runs/.<run_key>.tmp-.../.input/  # the copy of the input the run reads (removed before _SUCCESS)
    latest -> runs/<run_key>         # switched atomically (symlink + rename) after verify passes

``run_key`` hashes the input files' bytes and every setting that changes the output, so a rerun
with the same inputs is a no-op -- after the published run's files are checked against their
recorded SHA-256 (a changed or truncated file is detected and the run rebuilt). The run reads a copy of
the input taken while hashing it, and is stored under the key of the bytes it read (an input
replaced mid-run cannot be published under the old input's key; cost: one extra read and a
transient copy of the input in the work folder). A run is built in a hidden folder; a failed or
killed run is removed (at once, or by the next run) and redone from the start; a killed run that
was already complete is kept. A rebuilt run replaces the previous one with one atomic exchange, so
``latest`` names a complete run at every point; ``.latest.tmp-*`` left by a killed publish are
removed by the next run. ``latest`` only moves forward, to a run created no earlier than the published one and
after the last rollback; ``--rollback RUN`` publishes an older complete run on purpose. After a
publish, ``--keep-runs N`` keeps the N newest runs (never the published run or the last rollback
target). A failure never touches ``latest``: trainers keep reading the previous verified output.

Usage::

    python -m pipelines.nightly --input ../shared/datasets/ml-1m_ensfm/sequences.txt --format sequences \\
        --samples per-event --max-seq-len 512 --output nightly/ --ranks 256 --batch-size-per-rank 32
    python -m pipelines.nightly --output nightly/ --rollback 3f2a9c0d1e2b4a5f
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from fsdata import __version__ as fsdata_version
from fsdata.atomic import exchange
from fsdata.engines import balance
from fsdata.shards.manifest import sha256_file
from fsdata.shards.writer import BalanceSettings
from fsdata.cliutil import (add_common_flags, add_engine_flags, add_num_threads_flag, add_output_flag, configure_logging,
                            resolve_progress, run_main)
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW
from fsdata.balancer.plan import DEFAULT_PLAN_WINDOW
from fsdata.samples.convert import convert
from fsdata.balancer.cost import load_cost_model
from fsdata.errors import ConfigError, FsdataError, cli_terms
from fsdata.guards import check_output_apart
from fsdata.samples.io import list_parquet_files, open_samples
from fsdata.balancer.plan import DEFAULT_PARTITIONER, high_bubble_warning
from fsdata.balancer.profile import profile
from fsdata.shards.verify import verify

log = logging.getLogger("pipelines.nightly")

LOCK_NAME = ".nightly.lock"
HOLDER_NAME = ".nightly.lock.holder"
HISTORY_NAME = "history.jsonl"
RUN_INFO_NAME = "run.json"
SUCCESS_NAME = "_SUCCESS"
#: Manifest names of the balance OUTPUT, newest format first (v2 ``_manifest.json``, v1 ``manifest.json``).
MANIFEST_NAMES = ("_manifest.json", "manifest.json")
_RUN_KEY = re.compile(r"^[0-9a-f]{16}$")


class LockHeldError(FsdataError):
    """Another nightly run holds the work folder's lock."""


@dataclass(kw_only=True, slots=True)
class NightlyConfig:
    """Settings of one nightly run (all of them enter the run key)."""

    input: str
    """Raw log (``--format sequences|events``) or sample Parquet (``--format samples``)."""
    format: str = "sequences"
    samples: str = "per-event"
    max_seq_len: int = 512
    user_col: str = "0"
    item_col: str = "1"
    time_col: str | None = None
    sep: str | None = None
    has_header: bool | None = None
    columns: str | None = None
    """``--columns`` mapping of a ``--format samples`` input onto the sample schema."""
    num_ranks: int = 256
    batch_size_per_rank: int = 32
    cost_model: str = "hstu"
    seed: int = 0
    strategy: str = "balanced"
    batch_policy: str = "fixed"
    budget: float | None = None
    partitioner: str = DEFAULT_PARTITIONER
    remainder: str = "drop"
    compose_window: int = DEFAULT_COMPOSE_WINDOW
    """``--compose-window`` W of ``fsdata balance`` (docs/balancer.md, "Composition"); 1 = off."""
    plan_window: int = DEFAULT_PLAN_WINDOW
    """``--plan-window`` K of ``fsdata balance`` (steps planned together)."""
    epochs: int = 1
    """``--epochs`` E of ``fsdata balance`` (E epochs, each with its own seeded shuffle and composition)."""
    extra: dict | None = None
    """Anything else a caller wants in the key (e.g. a dataset version tag)."""


def _input_digest(path: str) -> str:
    p = Path(path)
    files = [str(p)] if p.is_file() else list_parquet_files(path)
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def run_key(cfg: NightlyConfig, input_digest: str | None = None) -> str:
    """Hex key of a run: SHA-256 of the input bytes, the settings and the fsdata version (16 chars).

    Args:
        cfg: the settings.
        input_digest: the digest of the bytes the run read (:func:`snapshot_input`); default:
            hash ``cfg.input`` now.
    """
    if input_digest is None:
        if not Path(cfg.input).exists():
            raise FsdataError(f"input {cfg.input} does not exist; pass the nightly log or sample files")
        input_digest = _input_digest(cfg.input)
    h = hashlib.sha256()
    h.update(input_digest.encode())
    h.update(json.dumps({**asdict(cfg), "input": None, "fsdata": fsdata_version}, sort_keys=True).encode())
    return h.hexdigest()[:16]


SNAPSHOT_NAME = ".input"


def snapshot_input(path: str, dest: Path, chunk_bytes: int = 1 << 22) -> tuple[str, str]:
    """Copy the input into ``dest`` while hashing the bytes copied; the run reads the copy.

    So the run key names exactly the bytes the run read, even when the input is replaced while the
    job runs. File names are kept (a text log's extension picks its separator); the files of a
    folder input are numbered so their order is kept.

    Returns:
        ``(path to read, input digest)``: the digest equals :func:`_input_digest` of an unchanged input.

    Raises:
        FsdataError: the input does not exist or holds no Parquet file.
    """
    p = Path(path)
    if not p.exists():
        raise FsdataError(f"input {path} does not exist; pass the nightly log or sample files")
    files = [str(p)] if p.is_file() else list_parquet_files(path)
    dest.mkdir()
    h = hashlib.sha256()
    for i, f in enumerate(files):
        name = os.path.basename(f)
        target = dest / (name if p.is_file() else f"{i:06d}-{name}")
        fh = hashlib.sha256()
        with open(f, "rb") as src, open(target, "wb") as out:
            while block := src.read(chunk_bytes):
                fh.update(block)
                out.write(block)
        h.update(name.encode())
        h.update(fh.hexdigest().encode())
    return (str(dest / os.path.basename(files[0])) if p.is_file() else str(dest)), h.hexdigest()


def publish(work_dir: Path, run_dir: Path) -> None:
    """Point ``work_dir/latest`` at ``run_dir`` atomically (new symlink, then rename over the old)."""
    tmp = work_dir / f".latest.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(run_dir, work_dir), tmp)
    os.replace(tmp, work_dir / "latest")


def _clean_stale_work_tmp(work: Path) -> list[str]:
    """Remove ``.latest.tmp-PID`` and ``.nightly.lock.holder.tmp-PID`` left by killed runs (we hold
    the lock, so every one is stale)."""
    removed = []
    for p in work.glob(".*.tmp-*"):
        if p.name.startswith((".latest.tmp-", f".{HOLDER_NAME}.tmp-")):
            p.unlink(missing_ok=True)
            removed.append(str(p))
    return removed


def _swap_in(stage: Path, run_dir: Path) -> None:
    """Move the complete ``stage`` to ``run_dir``, replacing a previous ``run_dir``.

    With a previous one, the two are swapped in one atomic step (``renameat2(RENAME_EXCHANGE)``),
    so ``run_dir`` (and ``latest``, which may name it) always holds a complete run; then the
    previous one (now at the stage's name) is removed. Where the file system has no exchange,
    two renames; a kill between them leaves the previous run at ``.<key>.old-...``, which the
    next run moves back (:func:`_clean_unfinished`).
    """
    if not run_dir.exists():
        os.replace(stage, run_dir)
        return
    if exchange(stage, run_dir):
        _remove(stage)  # the previous run, now at the stage's name
        return
    old = run_dir.parent / f".{run_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(run_dir, old)
    try:
        os.replace(stage, run_dir)
    except BaseException:
        os.replace(old, run_dir)
        raise
    _remove(old)


# ---------------------------------------------------------------------------------------------
# lock


@contextlib.contextmanager
def work_lock(work_dir: str | os.PathLike, timeout_seconds: float = 0.0) -> Iterator[None]:
    """Hold the work folder's lock (``filelock``); the holder is written next to it.

    Args:
        work_dir: the work folder (``--output``); created if missing.
        timeout_seconds: how long to wait for another run to finish (0: fail at once).

    Raises:
        LockHeldError: another process holds the lock; the message names its pid, host and start.
    """
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(work / LOCK_NAME), timeout=timeout_seconds)
    try:
        lock.acquire()
    except Timeout:
        raise LockHeldError(f"another nightly run holds {work / LOCK_NAME} ({_describe_holder(work)}); wait for it "
                            "to finish, or pass --lock-timeout SECONDS to wait for it") from None
    holder = work / HOLDER_NAME
    try:
        tmp = work / f".{HOLDER_NAME}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                   "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                   "command": " ".join(sys.argv)}) + "\n")
        os.replace(tmp, holder)
        yield
    finally:
        with contextlib.suppress(OSError):
            holder.unlink()
        lock.release()


def _describe_holder(work: Path) -> str:
    try:
        h = json.loads((work / HOLDER_NAME).read_text())
        return f"pid {h['pid']} on {h['host']}, started {h['started_at']}: {h.get('command', '?')}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"holder unknown: {work / HOLDER_NAME} is missing or unreadable"


# ---------------------------------------------------------------------------------------------
# runs: creation time, integrity, history


def _now_ns() -> int:
    return time.time_ns()


def _iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds")


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _history(work: Path) -> list[dict]:
    out = []
    try:
        lines = (work / HISTORY_NAME).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict) and "run_key" in rec:
                out.append(rec)
    return out


def _append_history(work: Path, rec: dict) -> None:
    with open(work / HISTORY_NAME, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _created_ns(run_dir: Path) -> int | None:
    info = _read_json(run_dir / RUN_INFO_NAME)
    return int(info["created_unix_ns"]) if info and "created_unix_ns" in info else None


def _published_run(work: Path) -> Path | None:
    link = work / "latest"
    if not link.is_symlink():
        return None
    target = Path(os.path.realpath(link))
    return target if target.is_dir() else None


def _manifest(shards: Path) -> dict | None:
    for name in MANIFEST_NAMES:
        m = _read_json(shards / name)
        if m is not None:
            return m
    return None


def check_run(run_dir: str | os.PathLike) -> str | None:
    """Re-check a complete run's files against their recorded SHA-256.

    Checks every file listed in the shard manifest's ``files`` (path and ``sha256``; manifest read
    as ``_manifest.json``, then ``manifest.json``) and every file whose digest ``_SUCCESS`` records
    (the manifest, step stats, samples, reports).

    Returns:
        None when everything matches, else one line naming the first problem.
    """
    run = Path(run_dir)
    done = _read_json(run / SUCCESS_NAME)
    if done is None:
        return f"{run / SUCCESS_NAME} is missing or unreadable"
    m = _manifest(run / "shards")
    if m is None or not isinstance(m.get("files"), list):
        return f"{run / 'shards'} has no readable manifest with a files list"
    expected: dict[Path, str] = {}
    for f in m["files"]:
        if not isinstance(f, dict) or not f.get("path") or not f.get("sha256"):
            return f"{run / 'shards'}: a manifest files entry lacks path or sha256"
        expected[run / "shards" / f["path"]] = f["sha256"]
    recorded = done.get("files") if isinstance(done.get("files"), dict) else {}
    for rel, digest in recorded.items():
        expected.setdefault(run / rel, digest)
    for path, digest in expected.items():
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != digest:
            return f"{path} changed since it was verified (SHA-256 differs; size {path.stat().st_size} bytes)"
    return None


def _file_digests(run_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of a run except ``_SUCCESS`` and the rank files (whose digests the
    shard manifest already holds), keyed by path relative to the run."""
    m = _manifest(run_dir / "shards") or {}
    in_manifest = {run_dir / "shards" / f["path"] for f in m.get("files", []) if isinstance(f, dict) and "path" in f}
    out = {}
    for p in sorted(run_dir.rglob("*")):
        if p.is_file() and p.name != SUCCESS_NAME and p not in in_manifest:
            out[str(p.relative_to(run_dir))] = sha256_file(p)
    return out


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _clean_unfinished(runs: Path, protect: Path | None) -> list[str]:
    """Remove runs being built by a dead process (we hold the lock: every one is stale) and run
    folders without ``_SUCCESS``; never ``protect`` (the published run)."""
    removed = []
    if not runs.is_dir():
        return removed
    for p in sorted(runs.iterdir()):
        if p.name.startswith(".") and ".old-" in p.name:
            key = p.name[1:].split(".old-", 1)[0]
            if not (runs / key).exists() and (p / SUCCESS_NAME).exists():
                # killed between the two renames of a rebuild: this is the previous run; put it back
                os.replace(p, runs / key)
                log.warning("restored run %s from %s left by a killed run", key, p.name)
                continue
        if p.name.startswith(".") and ".tmp-" in p.name and (p / SUCCESS_NAME).exists():
            key = p.name[1:].split(".tmp-", 1)[0]
            if not (runs / key).exists() and check_run(p) is None:
                # killed after the run was complete, before its rename: keep it
                os.replace(p, runs / key)
                log.warning("kept complete run %s from %s left by a killed run", key, p.name)
                continue
        stale = p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name)
        unfinished = not p.name.startswith(".") and p.is_dir() and not (p / SUCCESS_NAME).exists()
        if (stale or unfinished) and (protect is None or p.resolve() != protect.resolve()):
            log.warning("removing unfinished run %s (a failed or killed earlier run); it is redone from the start", p)
            _remove(p)
            removed.append(str(p))
    return removed


def keep_newest_runs(work_dir: str | os.PathLike, keep_runs: int) -> list[str]:
    """Remove complete runs beyond the ``keep_runs`` newest (by recorded creation time).

    Never removes the published run or the target of the last rollback.

    Returns:
        The removed run folders.
    """
    work = Path(work_dir)
    runs = work / "runs"
    if keep_runs < 1 or not runs.is_dir():
        return []
    published = _published_run(work)
    protect = {published.resolve()} if published else set()
    rollbacks = [h for h in _history(work) if h.get("rollback")]
    if rollbacks:
        protect.add((runs / rollbacks[-1]["run_key"]).resolve())
    complete = [p for p in runs.iterdir() if not p.name.startswith(".") and (p / SUCCESS_NAME).exists()]
    complete.sort(key=lambda p: (_created_ns(p) or 0, p.name), reverse=True)
    removed = []
    for p in complete[keep_runs:]:
        if p.resolve() in protect:
            continue
        log.info("--keep-runs %d: removing old run %s", keep_runs, p)
        _remove(p)
        removed.append(str(p))
    return removed


def _forward_floor(work: Path) -> tuple[int, str]:
    """Creation time a run needs to move ``latest`` forward, and why (for the message)."""
    floor, why = 0, ""
    published = _published_run(work)
    if published is not None:
        created = _created_ns(published)
        if created is not None:
            floor, why = created, f"the published run {published.name} was created {_iso(created)}"
    rollbacks = [h for h in _history(work) if h.get("rollback")]
    if rollbacks and rollbacks[-1].get("published_unix_ns", 0) > floor:
        floor = rollbacks[-1]["published_unix_ns"]
        why = f"latest was rolled back to {rollbacks[-1]['run_key']} at {_iso(floor)}"
    return floor, why


# ---------------------------------------------------------------------------------------------
# the job


def _validate(cfg: NightlyConfig) -> None:
    if cfg.format not in ("sequences", "events", "samples"):
        raise ConfigError(f"unknown --format '{cfg.format}'; use sequences, events or samples")
    if cfg.columns and cfg.format != "samples":
        raise ConfigError("--columns maps the columns of a sample Parquet input; it needs --format samples "
                          "(convert already writes the sample schema)")


def _build(cfg: NightlyConfig, stage: Path, key: str, created_ns: int, *, progress: bool, num_threads: int,
           bucket_compression: str | None, engine: str = "local", ray_address: str | None = None,
           read_from: str | None = None) -> dict:
    """Run convert, profile, balance and verify into ``stage``; write ``_SUCCESS`` last.

    ``read_from`` is the input snapshot to read (:func:`snapshot_input`; default ``cfg.input``);
    it is removed before ``_SUCCESS`` is written."""
    info = {"run_key": key, "created_unix_ns": created_ns, "created_at": _iso(created_ns),
            "built_at": _iso(_now_ns()), "host": socket.gethostname(), "fsdata_version": fsdata_version,
            "input": os.path.abspath(cfg.input), "config": asdict(cfg)}
    (stage / RUN_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    source = read_from or cfg.input
    samples = source
    if cfg.format != "samples":
        samples = str(stage / "samples.parquet")
        log.info("convert %s -> %s", cfg.input, samples)
        convert(source, samples, fmt=cfg.format, samples=cfg.samples, max_seq_len=cfg.max_seq_len,
                user_col=cfg.user_col, item_col=cfg.item_col, time_col=cfg.time_col, sep=cfg.sep,
                has_header=cfg.has_header, progress=progress)
    columns = cfg.columns if cfg.format == "samples" else None
    cost_model = load_cost_model(cfg.cost_model)
    lengths, _ = open_samples(samples, columns).lengths_and_ids()
    report = profile(lengths, cost_model, num_ranks=cfg.num_ranks, batch_size_per_rank=cfg.batch_size_per_rank,
                     seed=cfg.seed, compose_window=cfg.compose_window)
    (stage / "profile.json").write_text(json.dumps(report, indent=2))
    del lengths
    settings = BalanceSettings(num_ranks=cfg.num_ranks, batch_size_per_rank=cfg.batch_size_per_rank,
                               cost_model=cfg.cost_model, columns=columns, seed=cfg.seed, strategy=cfg.strategy,
                               batch_policy=cfg.batch_policy, remainder=cfg.remainder, partitioner=cfg.partitioner,
                               budget=cfg.budget, compose_window=cfg.compose_window, plan_window=cfg.plan_window,
                               epochs=cfg.epochs, num_threads=num_threads,
                               bucket_compression=bucket_compression, progress=progress,
                               engine=engine, ray_address=ray_address)
    manifest = balance(samples, stage / "shards", settings)  # the same entry point as `fsdata balance`
    checked = verify(stage / "shards", samples, column_map=columns, progress=progress)
    checked["warning"] = high_bubble_warning(manifest.to_json())
    if checked["warning"]:
        log.warning(checked["warning"])
    (stage / "verify.json").write_text(json.dumps(checked, indent=2))
    _write_report(stage, key, samples, columns)
    if read_from is not None:
        _remove(stage / SNAPSHOT_NAME)
    summary = {"profile": report, "verify": checked}
    tmp_done = stage / f".{SUCCESS_NAME}.tmp"
    tmp_done.write_text(json.dumps({**summary, "files": _file_digests(stage)}))
    os.replace(tmp_done, stage / SUCCESS_NAME)
    return summary


def _write_report(stage: Path, key: str, samples: str, columns: str | None) -> None:
    """``report.html`` (and its PNGs) next to the run's shards (:func:`fsdata.report.write_report`);
    skipped with a warning when the plotting extra is not installed (the run itself is complete)."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        log.warning("report skipped: matplotlib is not installed (pip install 'freescale[report]')")
        return
    from fsdata.report import write_report  # noqa: PLC0415

    write_report(stage / "shards", stage / "report.html", input_path=samples, column_map=columns,
                 label=f"nightly run {key}")


def run_nightly(cfg: NightlyConfig, work_dir: str | os.PathLike, *, progress: bool = True, keep_runs: int = 3,
                num_threads: int = 2, bucket_compression: str | None = None,
                lock_timeout_seconds: float = 0.0, engine: str = "local",
                ray_address: str | None = None) -> dict:
    """Run (or skip) the nightly job under the work folder's lock.

    Args:
        cfg: the job's settings.
        work_dir: folder holding ``runs/``, ``latest`` and the lock.
        progress: show progress bars.
        keep_runs: after a publish keep this many newest runs (>= 1; the published run and the last
            rollback target are always kept).
        num_threads: threads writing rank files (does not change the output).
        bucket_compression: codec of balance's temporary buckets (does not change the output).
        lock_timeout_seconds: wait this long for a concurrent run (0: fail at once).
        engine: ``local`` or ``ray`` (``fsdata balance --engine``, docs/cluster.md): where balance
            runs; the output is byte-identical, so the engine is not part of the run key.
        ray_address: the Ray cluster for ``engine="ray"`` (None: ``RAY_ADDRESS`` or a local instance).

    Returns:
        Dict with ``run_dir``, ``run_key``, ``skipped`` (already complete and intact), ``rebuilt``
        (a complete run whose files changed was built again), ``published`` (``latest`` points at
        this run), ``not_published_reason`` (when an older run stays unpublished), ``profile``,
        ``verify``, ``removed_runs`` and ``seconds``.

    Raises:
        LockHeldError: another run holds the lock.
        ConfigError: impossible settings, ``keep_runs < 1``, or a work folder (``--output``) overlapping
            the input.
        FsdataError: any stage's user error; ``latest`` is left as it was and the failed run removed.
    """
    t0 = time.perf_counter()
    _validate(cfg)
    if keep_runs < 1:
        raise ConfigError(f"--keep-runs must be >= 1, got {keep_runs}")
    check_output_apart(work_dir, [cfg.input], output_name="--output", input_name="--input")
    work = Path(work_dir)
    with work_lock(work, lock_timeout_seconds):
        key = run_key(cfg)
        runs = work / "runs"
        run_dir = runs / key
        _clean_stale_work_tmp(work)
        published = _published_run(work)
        removed = _clean_unfinished(runs, published)
        published = _published_run(work)  # a run put back by the cleanup
        skipped = rebuilt = False
        problem = check_run(run_dir) if (run_dir / SUCCESS_NAME).exists() else "absent"
        if problem is None:
            skipped = True
            log.info("run %s is complete and its files match their checksums; nothing to build", key)
        else:
            if problem != "absent":
                rebuilt = True
                log.warning("run %s was complete but %s; building it again", key, problem)
            known = [h["created_unix_ns"] for h in _history(work) if h["run_key"] == key and "created_unix_ns" in h]
            created = _created_ns(run_dir) or (min(known) if known else _now_ns())
            runs.mkdir(parents=True, exist_ok=True)
            stage = runs / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            stage.mkdir()
            try:
                # the run reads a copy of the input made while hashing it: the key names the bytes read
                read_from, digest = snapshot_input(cfg.input, stage / SNAPSHOT_NAME)
                read_key = run_key(cfg, digest)
                if read_key != key:
                    log.warning("input %s changed after it was hashed; this run is built from the bytes it read "
                                "(run %s, not %s)", cfg.input, read_key, key)
                    key, run_dir = read_key, runs / read_key
                    known = [h["created_unix_ns"] for h in _history(work)
                             if h["run_key"] == key and "created_unix_ns" in h]
                    created = _created_ns(run_dir) or (min(known) if known else _now_ns())
                _build(cfg, stage, key, created, progress=progress, num_threads=num_threads,
                       bucket_compression=bucket_compression, engine=engine, ray_address=ray_address,
                       read_from=read_from)
                _swap_in(stage, run_dir)
            except BaseException:
                _remove(stage)
                raise
        done = json.loads((run_dir / SUCCESS_NAME).read_text())
        created = _created_ns(run_dir) or 0
        floor, why = _forward_floor(work)
        is_published = published is not None and published.resolve() == run_dir.resolve()
        reason = None
        if is_published or created >= floor:
            publish(work, run_dir)
            if not is_published:
                _append_history(work, {"run_key": key, "created_unix_ns": created, "published_unix_ns": _now_ns(),
                                       "rollback": False})
            is_published = True
            removed += keep_newest_runs(work, keep_runs)
        else:
            reason = (f"run {key} (created {_iso(created)}) is older than the output trainers read: {why}; "
                      f"latest stays; pass --rollback {key} to publish it")
            log.warning("%s", reason)
    return {"run_dir": str(run_dir), "run_key": key, "skipped": skipped, "rebuilt": rebuilt,
            "published": is_published, "not_published_reason": reason,
            "profile": done.get("profile"), "verify": done.get("verify"), "removed_runs": removed,
            "seconds": time.perf_counter() - t0}


def rollback(work_dir: str | os.PathLike, run: str, *, lock_timeout_seconds: float = 0.0) -> dict:
    """Publish an existing complete run on purpose, even if it is older than ``latest``.

    Args:
        work_dir: the work folder (``--output``).
        run: a run key, or the path of a run folder under ``work_dir/runs``.
        lock_timeout_seconds: wait this long for a concurrent run.

    Returns:
        Dict with ``run_dir``, ``run_key``, ``published`` (True), ``verify`` and ``previous``
        (the run ``latest`` pointed at before, or None).

    Raises:
        ConfigError: no such complete run, or its files no longer match their checksums.
        LockHeldError: another run holds the lock.
    """
    work = Path(work_dir)
    if not work.is_dir():
        raise ConfigError(f"--output {work} does not exist; pass the folder of the nightly runs")
    with work_lock(work, lock_timeout_seconds):
        key = Path(run).name
        run_dir = work / "runs" / key
        have = sorted(p.name for p in (work / "runs").glob("*")
                      if _RUN_KEY.match(p.name) and (p / SUCCESS_NAME).exists())
        if not _RUN_KEY.match(key):
            raise ConfigError(f"--rollback {run}: not a run key (16 hex digits; a hidden .tmp/.old folder is a run "
                              f"being built or removed, never published); complete runs are {have}")
        if not (run_dir / SUCCESS_NAME).exists():
            raise ConfigError(f"--rollback {run}: no complete run {run_dir}; complete runs are {have}")
        problem = check_run(run_dir)
        if problem is not None:
            raise ConfigError(f"--rollback {run}: {problem}; rerun its command to rebuild it instead")
        previous = _published_run(work)
        publish(work, run_dir)
        _append_history(work, {"run_key": key, "created_unix_ns": _created_ns(run_dir) or 0,
                               "published_unix_ns": _now_ns(), "rollback": True})
        done = json.loads((run_dir / SUCCESS_NAME).read_text())
    return {"run_dir": str(run_dir), "run_key": key, "published": True, "verify": done.get("verify"),
            "previous": str(previous) if previous else None}


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    """The nightly job's flags; those it shares with ``fsdata balance`` mean the same there."""
    from fsdata.cli import COST_MODEL_HELP

    p = argparse.ArgumentParser(prog="python -m pipelines.nightly", description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.index("Usage::"):].replace("Usage::", "examples:"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", default=None,
                   help="the nightly log (--format sequences|events) or sample Parquet file/folder/glob (--format "
                        "samples); required unless --rollback")
    g.add_argument("--format", default="sequences", choices=["sequences", "events", "samples"],
                   help="sequences: 'user item1 item2 ...' lines; events: one interaction per row; samples: "
                        "Parquet already in the sample schema (default sequences)")
    g.add_argument("--samples", default="per-event", choices=["per-user", "per-event"],
                   help="convert: one sample per user or per interaction (default per-event)")
    g.add_argument("--max-seq-len", type=int, default=512, help="convert: most recent history items kept (default 512)")
    g.add_argument("--user-col", default="0", help="events: user column name or 0-based position (default 0)")
    g.add_argument("--item-col", default="1", help="events: item column name or position (default 1)")
    g.add_argument("--time-col", default=None, help="events: timestamp column (sorts each user's events)")
    g.add_argument("--sep", default=None, help="events text separator (default: ',' for .csv, tab for .tsv, else space)")
    hdr = g.add_mutually_exclusive_group()
    hdr.add_argument("--header", dest="has_header", action="store_true", default=None, help="events text has a header line")
    hdr.add_argument("--no-header", dest="has_header", action="store_false", help="events text has no header line")
    g.add_argument("--columns", default=None, metavar="MAP",
                   help="--format samples: map your column names to the sample schema: sample_id=id,item_ids=history,...")
    b = p.add_argument_group("balance (same meaning as in fsdata balance)")
    b.add_argument("--ranks", type=int, default=256, help="number of ranks R (world size) (default 256)")
    b.add_argument("--batch-size-per-rank", type=int, default=32, help="samples per rank per step B (default 32)")
    b.add_argument("--cost-model", default="hstu", help=COST_MODEL_HELP)
    b.add_argument("--seed", type=int, default=0, help="seed of the global-batch shuffle (default 0)")
    b.add_argument("--strategy", default="balanced", choices=["balanced", "shuffle"],
                   help="balanced (default) or shuffle: today's equal-count practice, same layout")
    b.add_argument("--batch-policy", default="fixed", choices=["fixed", "cost-budget"],
                   help="fixed: B samples per rank per step; cost-budget: variable counts, equal cost per step")
    b.add_argument("--budget", type=float, default=None, help="cost-budget: per-rank per-step cost budget")
    b.add_argument("--partitioner", default=DEFAULT_PARTITIONER,
                   help="per-step assignment: auto (default), lpt-swap, lpt-swap-cpsat, lpt, kk, roundrobin, shuffle")
    b.add_argument("--remainder", default="drop", choices=["drop", "error"],
                   help="samples that do not fill a last step: drop (recorded in the OUTPUT) or error")
    b.add_argument("--compose-window", type=int, default=DEFAULT_COMPOSE_WINDOW, metavar="W",
                   help="regroup the samples of W consecutive random global batches so heavy samples share "
                        f"steps in multiples of R (B per rank kept); 1 = off (default {DEFAULT_COMPOSE_WINDOW}, "
                        "see docs/balancer.md)")
    b.add_argument("--plan-window", type=int, default=DEFAULT_PLAN_WINDOW, metavar="K",
                   help=f"steps planned together (rounded up to a multiple of --compose-window; default "
                        f"{DEFAULT_PLAN_WINDOW}): bounds the planning memory per window, the unit of a Ray plan task")
    b.add_argument("--epochs", type=int, default=1, metavar="E",
                   help="epochs written, each with its own seeded shuffle and composition, steps numbered on "
                        "(default 1)")
    add_num_threads_flag(b, default=2, help="threads for writing rank files (default 2)")
    b.add_argument("--bucket-compression", default="none", choices=["none", "lz4", "zstd"],
                   help="codec of the temporary per-rank buckets (none: fastest; lz4/zstd: less disk)")
    add_engine_flags(b)  # the same --engine/--ray-address as fsdata balance
    j = p.add_argument_group("job")
    add_output_flag(j, metavar="DIR",
                    help="work folder of runs/, latest and the lock (must not hold the input); required")
    j.add_argument("--keep-runs", type=int, default=3,
                   help="after a publish, keep this many newest runs; the published run and the last rollback "
                        "target are always kept (default 3)")
    j.add_argument("--rollback", default=None, metavar="RUN",
                   help="publish the complete run RUN (a key under runs/) even though it is older than latest, "
                        "then stop; no other flag is needed")
    j.add_argument("--lock-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="wait this long for a concurrent run holding the lock (default 0: fail at once)")
    j.add_argument("--json", action="store_true", help="print the result as JSON")
    add_common_flags(j)
    return p


def _main(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    configure_logging(a.verbose, a.quiet, default=logging.INFO, fmt="%(asctime)s %(name)s: %(message)s")
    if not a.output:
        parser.error("the following arguments are required: -o/--output")
    if a.rollback:
        r = rollback(a.output, a.rollback, lock_timeout_seconds=a.lock_timeout)
        if a.json:
            print(json.dumps({k: r[k] for k in ("run_dir", "run_key", "published", "previous")}, indent=2))
        else:
            print(f"rolled back: {Path(a.output) / 'latest'} -> {r['run_dir']} (was {r['previous']})")
        return 0
    if not a.input:
        parser.error("--input is required (unless --rollback RUN)")
    cfg = NightlyConfig(input=a.input, format=a.format, samples=a.samples, max_seq_len=a.max_seq_len,
                        user_col=a.user_col, item_col=a.item_col, time_col=a.time_col, sep=a.sep,
                        has_header=a.has_header, columns=a.columns, num_ranks=a.ranks,
                        batch_size_per_rank=a.batch_size_per_rank, cost_model=a.cost_model, seed=a.seed,
                        strategy=a.strategy, batch_policy=a.batch_policy, budget=a.budget,
                        partitioner=a.partitioner, remainder=a.remainder, compose_window=a.compose_window,
                        plan_window=a.plan_window, epochs=a.epochs)
    r = run_nightly(cfg, a.output, progress=resolve_progress(a.progress), keep_runs=a.keep_runs,
                    num_threads=a.num_threads,
                    bucket_compression=None if a.bucket_compression == "none" else a.bucket_compression,
                    engine=a.engine, ray_address=a.ray_address,
                    lock_timeout_seconds=a.lock_timeout)
    if a.json:
        print(json.dumps({k: r[k] for k in ("run_dir", "run_key", "skipped", "rebuilt", "published",
                                            "not_published_reason", "removed_runs", "seconds")}
                         | {"verify": r["verify"]}, indent=2))
        return 0
    v = r["verify"]
    if not r["published"]:
        print(f"complete, not published: {r['not_published_reason']}")
    else:
        state = "rebuilt and published" if r["rebuilt"] else "up to date" if r["skipped"] else "published"
        print(f"{state}: {Path(a.output) / 'latest'} -> {r['run_dir']}")
    print(f"  bubble before (equal counts) {v['baseline_predicted_bubble']:.2%}  after {v['predicted_bubble']:.4%}"
          f"  ({v['num_ranks']} ranks x {v['num_steps']} steps, {v['num_samples_written']:,} samples)")
    if v.get("warning"):
        print(f"  warning: {v['warning']}")
    if r["removed_runs"]:
        print(f"  removed {len(r['removed_runs'])} old or unfinished runs")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; errors are one ``nightly: error:`` line and exit 2, piping into ``head`` exits 141."""
    parser = build_parser()
    parsed: list[argparse.Namespace] = []

    def body() -> int:
        parsed.append(parser.parse_args(argv))
        try:
            with cli_terms():
                return _main(parsed[0], parser)
        except FsdataError as e:
            print(f"nightly: error: {e}", file=sys.stderr)
            return 2

    return run_main("nightly", body, lambda: parsed[0].output if parsed else None)


if __name__ == "__main__":
    sys.exit(main())
