"""Atomic outputs: write to a temporary sibling, move into place only when complete.

A run that fails or is killed midway leaves no OUTPUT (and no half-overwritten one); the hidden
temporary sibling it leaves behind is removed by the next run once its owner process is gone.

A local folder is replaced by an atomic exchange (``renameat2(RENAME_EXCHANGE)``) where the file
system offers one, else by two renames; a kill between those two renames leaves the previous
output in a hidden ``-old-`` sibling, which the next run moves back.

Object stores (``s3://``, ``gs://``, ... URIs, :mod:`fsdata.fsio`) have no rename, so there the
publish is different (docs/cluster.md, "Object stores"; docs/fsdata.md, "Replacing an output on an
object store"): a new OUTPUT is written directly under the final prefix, its ``_manifest.json``
written last as the commit marker (readers refuse a prefix without it as incomplete). An existing
prefix is refused unless ``overwrite``; then nothing of it is deleted first: the new output is
written under ``OUTPUT/_versions/<id>/``, and only once it is complete the pointer object
``OUTPUT/_current.json`` (one PUT) switches readers to it; then the previous output is deleted.
A failure deletes what this run wrote and leaves the previous output as it was; a cleanup that
fails is reported with what remains and how to remove it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from fsdata import fsio
from fsdata.errors import ConfigError, FsdataError, setting
from fsdata.guards import EnvironmentFailure, environment_errno, environment_error, process_alive

log = logging.getLogger(__name__)


def tmp_prefix(final: Path) -> str:
    """Name prefix of ``final``'s temporaries (siblings): ``.NAME.tmp-PID-...``; :func:`clean_stale_tmp` removes
    those of processes that no longer run."""
    return f".{final.name}.tmp-"


def clean_stale_tmp(final: Path) -> None:
    """Remove temporaries of ``final`` left by processes that no longer run."""
    parent = final.parent
    if not parent.is_dir():
        return
    prefix = tmp_prefix(final)
    for p in parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        try:
            pid = int(p.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if not process_alive(pid):
            if "-old-" in p.name and not os.path.lexists(final):
                # killed between the two renames of a replace: this is the previous output; put it back
                os.replace(p, final)
                log.warning("restored %s from %s left by a killed run", final, p.name)
                continue
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def output_taken(final: str | os.PathLike, *, is_dir: bool = True) -> bool:
    """Whether ``final`` holds something that writing there would replace.

    For a folder output (``is_dir``) an existing *empty* local folder is free (one made ahead of
    time, e.g. by a job scheduler): it is replaced without ``overwrite``, like a missing one.
    """
    final = fsio.normalize(final)
    if fsio.is_remote(final):
        return fsio.exists(final)
    p = Path(final)
    if is_dir and p.is_dir() and not p.is_symlink():
        with os.scandir(p) as entries:
            return next(entries, None) is not None
    return p.exists() or p.is_symlink()


_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns:
        True when swapped; False when this system or file system has no atomic exchange (the
        caller then falls back to two renames).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))


#: The commit markers of an OUTPUT (v3 and v2: _manifest.json; v1: manifest.json).
COMMIT_MARKERS = ("_manifest.json", "manifest.json")


def _shown(uri: str) -> str:
    return uri.split("?", 1)[0]


def remove_remote(prefix: str, what: str) -> str | None:
    """Delete ``prefix`` (a URI) and check nothing remains.

    Returns:
        None when gone; else one sentence naming what remains and how to remove it.
    """
    cause = None
    try:
        fsio.delete(prefix)
    except Exception as e:  # noqa: BLE001 - reported below, with what remains
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
    try:
        left = len(fsio.walk_files(prefix)) if fsio.exists(prefix) else 0
    except Exception as e:  # noqa: BLE001
        left = None
        cause = cause or (str(e).splitlines()[0] if str(e) else type(e).__name__)
    if left == 0 and cause is None:
        return None
    n = "an unknown number of" if left is None else str(left)
    why = f" ({cause})" if cause else ""
    return (f"{n} objects of {what} remain under {_shown(prefix)}{why}; remove them with "
            f"'aws s3 rm --recursive {_shown(prefix)}/' (or your store's delete) once it is reachable")


def _wrap_write_error(e: BaseException, final: str, left: str) -> None:
    """Raise the one-line error of a failed object-store write (``left`` says what state remains)."""
    if isinstance(e, OSError) and not isinstance(e, FsdataError):
        cause = getattr(e, "cause", None) or e  # a Ray task's error carries the task's exception
        env = environment_error(cause, final, action="write")
        if env is not None and environment_errno(cause) is None:  # the object store's own failure
            raise EnvironmentFailure(f"cannot write {_shown(final)}: {env}; {left}") from None
        if env is not None:
            msg = str(env)
            if msg.endswith("; nothing was written"):
                msg = msg[: -len("; nothing was written")]
            raise EnvironmentFailure(f"{msg}; {left}") from None
        raise EnvironmentFailure(f"cannot write {_shown(final)}: {str(cause).splitlines()[0]}; check "
                                 f"the object store's credentials, permissions and endpoint; {left}") from None


@contextlib.contextmanager
def _remote_output(final: str, *, overwrite: bool, is_dir: bool = True) -> Iterator[str]:
    """The object-store publish (module docstring): yields where to write (``final``, or a new
    version prefix inside it when an existing output is replaced)."""
    r = fsio.resolve(final)
    if r.prefix.endswith("://") and "/" not in r.path:
        raise ConfigError(f"output {final} is a whole bucket; write into a prefix inside it, e.g. "
                          f"{r.prefix}{r.path}/shards")
    existed = fsio.exists(final)
    if existed and not overwrite:
        raise ConfigError(f"output {final} already exists; choose a new path or pass "
                          f"{setting('overwrite_arg', True)} to replace it")
    if not existed or not is_dir:
        # a new prefix, or one object (a single PUT replaces it whole: nothing to delete first)
        try:
            yield final
        except BaseException as e:
            problem = None if existed else remove_remote(final, "this run")
            left = (f"the previous {_shown(final)} is unchanged" if existed
                    else "nothing was written" if problem is None else problem)
            _wrap_write_error(e, final, left)
            if problem:
                log.warning("%s", problem)
            raise
        return
    version = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"
    target_rel = f"{fsio.VERSIONS_DIR}/{version}"
    target = fsio.join(final, target_rel)
    try:
        yield target
        if not fsio.exists(target):
            raise ConfigError(f"the new output under {_shown(target)} is empty; nothing to publish")
    except BaseException as e:
        problem = remove_remote(target, "the unfinished new output")
        versions = fsio.join(final, fsio.VERSIONS_DIR)
        with contextlib.suppress(Exception):  # an empty _versions/ (a marker the store may keep) goes too
            if not fsio.walk_files(versions):
                fsio.delete(versions)
        left = f"the previous {_shown(final)} is unchanged" + (f"; {problem}" if problem else "")
        _wrap_write_error(e, final, left)
        if problem:
            log.warning("%s", problem)
        raise
    pointer = {"format": "fsdata-pointer", "version": 1, "target": target_rel}
    fsio.write_bytes(fsio.join(final, fsio.POINTER_NAME), (json.dumps(pointer, indent=2) + "\n").encode())
    # the new output is what readers resolve from here on; the previous one goes
    stale = [name for name, _ in fsio.list_dir(final) if name not in (fsio.POINTER_NAME, fsio.VERSIONS_DIR)]
    stale = [fsio.join(final, n) for n in stale]
    stale += [fsio.join(final, fsio.VERSIONS_DIR, n) for n, _ in fsio.list_dir(fsio.join(final, fsio.VERSIONS_DIR))
              if n != version]
    for p in sorted(stale, key=lambda p: (not any(p.endswith(m) for m in COMMIT_MARKERS), p)):
        problem = remove_remote(p, "the previous output")
        if problem:
            log.warning("replaced %s (now %s), but %s", _shown(final), target_rel, problem)


@contextlib.contextmanager
def atomic_output(final: str | os.PathLike, *, overwrite: bool = False, is_dir: bool = True) -> Iterator[Path | str]:
    """Yield a temporary path next to ``final``; move it to ``final`` when the block succeeds.

    For an object-store URI (``s3://...``; :func:`fsdata.fsio.is_remote`) it yields ``final``
    itself (a ``str``): the caller writes there directly and writes its commit marker (the
    manifest) last; on failure everything under ``final`` is deleted (module docstring).

    Args:
        final: the output path the caller wants.
        overwrite: replace an existing ``final`` (the old one is moved aside, the new one moved in,
            then the old one deleted); when False an existing ``final`` is an error.
        is_dir: the temporary path is created as an empty directory (else it does not exist yet).

    Yields:
        The temporary path (same filesystem as ``final``, so the final move is a rename).

    Raises:
        ConfigError: ``final`` exists and ``overwrite`` is False.
    """
    final = fsio.normalize(final)
    if fsio.is_remote(final):
        with _remote_output(final, overwrite=overwrite, is_dir=is_dir) as out:
            yield out
        return
    final = Path(final)
    clean_stale_tmp(final)  # first: a previous output a killed replace left aside is put back
    if output_taken(final, is_dir=is_dir) and not overwrite:
        raise ConfigError(f"output {final} already exists and is not empty; choose a new path or pass "
                          f"{setting('overwrite_arg', True)} to replace it")
    created = [p for p in [final.parent, *final.parent.parents] if not p.exists()]
    tmp = final.parent / f"{tmp_prefix(final)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(final)
        if is_dir:
            tmp.mkdir()
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        for p in created:  # innermost first; only the folders this call made, and only if empty
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    if output_taken(final, is_dir=is_dir):
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise ConfigError(f"output {final} appeared while this run was writing; pass "
                              f"{setting('overwrite_arg', True)} to replace it")
        old = final.parent / f"{tmp_prefix(final)}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
        try:
            if exchange(tmp, final):  # one atomic step: final is the new output, tmp the previous one
                os.replace(tmp, old)
            else:
                os.replace(final, old)
                try:
                    os.replace(tmp, final)
                except BaseException:
                    os.replace(old, final)  # put the previous output back
                    raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    else:
        try:
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise
