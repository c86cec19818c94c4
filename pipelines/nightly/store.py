"""The run store of the nightly job: the work folder's lock, the runs, their checksums, history,
publishing, rollback and cleanup (the layout is in :mod:`pipelines.nightly`)."""

from __future__ import annotations

import contextlib
import datetime as dt
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
from pathlib import Path

from filelock import FileLock, Timeout

from fsdata.atomic import exchange
from fsdata.errors import ConfigError, FsdataError
from fsdata.guards import OUTPUT_MARKERS, check_not_inside_output
from fsdata.shards.manifest import MANIFEST_NAMES, Manifest, sha256_file

log = logging.getLogger("pipelines.nightly")

LOCK_NAME = ".nightly.lock"
HOLDER_NAME = ".nightly.lock.holder"
HISTORY_NAME = "history.jsonl"
RUN_INFO_NAME = "run.json"
SUCCESS_NAME = "_SUCCESS"
_RUN_KEY = re.compile(r"^[0-9a-f]{16}$")
#: The hidden folders of a run being built (``.KEY.tmp-PID-ID``) or moved aside (``.KEY.old-PID-ID``).
_RUN_TMP = re.compile(r"^\.([0-9a-f]{16})\.(tmp|old)-\d+-[0-9a-f]{8}$")


class LockHeldError(FsdataError):
    """Another nightly run holds the work folder's lock."""


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


def swap_in(stage: Path, run_dir: Path) -> None:
    """Move the complete ``stage`` to ``run_dir``, replacing a previous ``run_dir``.

    With a previous one, the two are swapped in one atomic step (``renameat2(RENAME_EXCHANGE)``),
    so ``run_dir`` (and ``latest``, which may name it) always holds a complete run; then the
    previous one (now at the stage's name) is removed. Where the file system has no exchange,
    two renames; a kill between them leaves the previous run at ``.<key>.old-...``, which the
    next run moves back (:func:`clean_unfinished`).
    """
    if not run_dir.exists():
        os.replace(stage, run_dir)
        return
    if exchange(stage, run_dir):
        remove(stage)  # the previous run, now at the stage's name
        return
    old = run_dir.parent / f".{run_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(run_dir, old)
    try:
        os.replace(stage, run_dir)
    except BaseException:
        os.replace(old, run_dir)
        raise
    remove(old)


@contextlib.contextmanager
def work_lock(work_dir: str | os.PathLike, timeout_seconds: float = 0.0) -> Iterator[None]:
    """Hold the work folder's lock (``filelock``); the holder is written next to it.

    Once the lock is held, the ``.latest.tmp-PID`` and holder temporaries left by killed runs and
    rollbacks are removed (:func:`_clean_stale_work_tmp`).

    Args:
        work_dir: the work folder (``--output``); created if missing.
        timeout_seconds: how long to wait for another run to finish (0: fail at once).

    Raises:
        LockHeldError: another process holds the lock; the message names its pid, host and start.
        ConfigError: the work folder is or lies inside an ``fsdata balance`` OUTPUT.
    """
    work = Path(work_dir)
    check_not_inside_output(work, name="--output")  # before the lock is written: another job's output stays intact
    if any((work / m).is_file() for m in OUTPUT_MARKERS):
        raise ConfigError(f"--output {work} is an fsdata balance OUTPUT, which is never modified; choose the nightly "
                          "job's own work folder")
    work.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(work / LOCK_NAME), timeout=timeout_seconds)
    try:
        lock.acquire()
    except Timeout:
        raise LockHeldError(f"another nightly run holds {work / LOCK_NAME} ({_describe_holder(work)}); wait for it "
                            "to finish, or pass --lock-timeout SECONDS to wait for it") from None
    holder = work / HOLDER_NAME
    try:
        _clean_stale_work_tmp(work)  # before our own: a killed run's or rollback's, whichever command comes next
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


def now_ns() -> int:
    """Wall-clock time now, integer nanoseconds since the Unix epoch (``time.time_ns``)."""
    return time.time_ns()


def iso(ns: int) -> str:
    """``ns`` (nanoseconds since the Unix epoch) as an ISO 8601 UTC time to the second."""
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds")


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def history(work: Path) -> list[dict]:
    """The records of ``WORK/history.jsonl`` (one per publish or rollback), oldest first; lines that
    are not JSON records naming a ``run_key`` (one cut off by a kill) are skipped."""
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


def append_history(work: Path, rec: dict) -> None:
    """Append one record to ``WORK/history.jsonl`` (one JSON line, flushed and fsynced)."""
    with open(work / HISTORY_NAME, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def created_ns(run_dir: Path) -> int | None:
    """A run's creation time (``run.json``'s ``created_unix_ns``, integer nanoseconds), None when unknown."""
    info = _read_json(run_dir / RUN_INFO_NAME)
    return int(info["created_unix_ns"]) if info and "created_unix_ns" in info else None


def published_run(work: Path) -> Path | None:
    """The run ``WORK/latest`` points at (resolved), None when nothing is published."""
    link = work / "latest"
    if not link.is_symlink():
        return None
    target = Path(os.path.realpath(link))
    return target if target.is_dir() else None


def _manifest(shards: Path) -> Manifest | None:
    """The shards' manifest, read and checked by :meth:`fsdata.shards.manifest.Manifest.read` (the one
    manifest reader); None when it is missing, unreadable or malformed."""
    try:
        return Manifest.read(shards)
    except FsdataError:
        return None


def _has_manifest(shards: Path) -> bool:
    """Whether the shards hold a manifest file (any format version's name), readable or not."""
    return any((shards / name).is_file() for name in MANIFEST_NAMES.values())


def check_run(run_dir: str | os.PathLike) -> str | None:
    """Re-check a complete run's files against their recorded SHA-256.

    Checks every file listed in the shard manifest's ``files`` (path and ``sha256``; manifest read
    by :meth:`fsdata.shards.manifest.Manifest.read`) and every file whose digest ``_SUCCESS`` records
    (the manifest, step stats, samples, reports).

    Returns:
        None when everything matches, else one line naming the first problem.
    """
    run = Path(run_dir)
    done = _read_json(run / SUCCESS_NAME)
    if done is None:
        return f"{run / SUCCESS_NAME} is missing or unreadable"
    m = _manifest(run / "shards")
    if m is None:
        return f"{run / 'shards'} has no readable manifest with a files list"
    expected: dict[Path, str] = {}
    for f in m.files:
        if not f.path or not f.sha256:
            return f"{run / 'shards'}: a manifest files entry lacks path or sha256"
        expected[run / "shards" / f.path] = f.sha256
    recorded = done.get("files") if isinstance(done.get("files"), dict) else {}
    for rel, digest in recorded.items():
        expected.setdefault(run / rel, digest)
    for path, digest in expected.items():
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != digest:
            return f"{path} changed since it was verified (SHA-256 differs; size {path.stat().st_size} bytes)"
    return None


def file_digests(run_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of a run except ``_SUCCESS`` and the rank files (whose digests the
    shard manifest already holds), keyed by path relative to the run."""
    m = _manifest(run_dir / "shards")
    in_manifest = {run_dir / "shards" / f.path for f in (m.files if m is not None else [])}
    out = {}
    for p in sorted(run_dir.rglob("*")):
        if p.is_file() and p.name != SUCCESS_NAME and p not in in_manifest:
            out[str(p.relative_to(run_dir))] = sha256_file(p)
    return out


def remove(path: Path) -> None:
    """Remove a file, link or folder tree; a missing path is no error."""
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def is_our_run(path: str | os.PathLike, recorded: set[str] | None = None) -> bool:
    """Whether ``runs/NAME`` is a run this job wrote, the only folders it ever deletes.

    A run folder is named by its run key (16 hex digits) and is either recorded in
    ``history.jsonl`` (``recorded``), or carries the job's marker (``run.json`` naming that key),
    or, written by an earlier version, holds a shard manifest and ``_SUCCESS``. A hidden
    ``.KEY.tmp-PID-ID`` / ``.KEY.old-PID-ID`` folder is one being built or moved aside. Anything
    else under ``runs/`` (a user's ``runs/myproject/``) is not the job's and is left alone.
    """
    p = Path(path)
    if _RUN_TMP.match(p.name):
        return p.is_dir() and not p.is_symlink()
    if not _RUN_KEY.match(p.name) or p.is_symlink() or not p.is_dir():
        return False
    if recorded is not None and p.name in recorded:
        return True
    info = _read_json(p / RUN_INFO_NAME)
    if info is not None and info.get("run_key") == p.name:
        return True
    return _has_manifest(p / "shards") and (p / SUCCESS_NAME).exists()


def _recorded(runs: Path) -> set[str]:
    return {str(h["run_key"]) for h in history(runs.parent)}


def clean_unfinished(runs: Path, protect: Path | None) -> list[str]:
    """Remove runs being built by a dead process (we hold the lock: every one is stale) and run
    folders without ``_SUCCESS``; never ``protect`` (the published run) and never a folder that is
    not one of the job's runs (:func:`is_our_run`)."""
    removed = []
    if not runs.is_dir():
        return removed
    recorded = _recorded(runs)
    for p in sorted(runs.iterdir()):
        if not is_our_run(p, recorded):
            continue
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
        stale = p.name.startswith(".")
        unfinished = not p.name.startswith(".") and not (p / SUCCESS_NAME).exists()
        if (stale or unfinished) and (protect is None or p.resolve() != protect.resolve()):
            log.warning("removing unfinished run %s (a failed or killed earlier run); it is redone from the start", p)
            remove(p)
            removed.append(str(p))
    return removed


def keep_newest_runs(work_dir: str | os.PathLike, keep_runs: int) -> list[str]:
    """Remove complete runs beyond the ``keep_runs`` newest (by recorded creation time).

    Never removes the published run, the target of the last rollback, or a folder that is not one
    of the job's runs (:func:`is_our_run`).

    Returns:
        The removed run folders.
    """
    work = Path(work_dir)
    runs = work / "runs"
    if keep_runs < 1 or not runs.is_dir():
        return []
    published = published_run(work)
    protect = {published.resolve()} if published else set()
    rollbacks = [h for h in history(work) if h.get("rollback")]
    if rollbacks:
        protect.add((runs / rollbacks[-1]["run_key"]).resolve())
    recorded = _recorded(runs)
    complete = [p for p in runs.iterdir()
                if not p.name.startswith(".") and (p / SUCCESS_NAME).exists() and is_our_run(p, recorded)]
    complete.sort(key=lambda p: (created_ns(p) or 0, p.name), reverse=True)
    removed = []
    for p in complete[keep_runs:]:
        if p.resolve() in protect:
            continue
        log.info("--keep-runs %d: removing old run %s", keep_runs, p)
        remove(p)
        removed.append(str(p))
    return removed


def forward_floor(work: Path) -> tuple[int, str]:
    """Creation time a run needs to move ``latest`` forward, and why (for the message)."""
    floor, why = 0, ""
    published = published_run(work)
    if published is not None:
        created = created_ns(published)
        if created is not None:
            floor, why = created, f"the published run {published.name} was created {iso(created)}"
    rollbacks = [h for h in history(work) if h.get("rollback")]
    if rollbacks and rollbacks[-1].get("published_unix_ns", 0) > floor:
        floor = rollbacks[-1]["published_unix_ns"]
        why = f"latest was rolled back to {rollbacks[-1]['run_key']} at {iso(floor)}"
    return floor, why


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
        previous = published_run(work)
        publish(work, run_dir)
        append_history(work, {"run_key": key, "created_unix_ns": created_ns(run_dir) or 0,
                               "published_unix_ns": now_ns(), "rollback": True})
        done = json.loads((run_dir / SUCCESS_NAME).read_text())
    return {"run_dir": str(run_dir), "run_key": key, "published": True, "verify": done.get("verify"),
            "previous": str(previous) if previous else None}
