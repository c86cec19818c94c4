"""Atomic outputs: write to a temporary sibling, move into place only when complete.

A run that fails or is killed midway leaves no OUTPUT (and no half-overwritten one); the hidden
temporary sibling it leaves behind is removed by the next run once its owner process is gone.

Object stores (``s3://``, ``gs://``, ... URIs, :mod:`fsdata.fsio`) have no rename, so there the
publish is different (docs/cluster.md, "Object stores"): everything is written directly under the
final prefix, the OUTPUT's ``_manifest.json`` is written last and is the commit marker (readers
refuse a prefix without it as incomplete), an existing prefix is refused unless ``overwrite`` (then
it is deleted first, its manifest first: not atomic), and a failure deletes what was written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from fsdata import fsio
from fsdata.errors import ConfigError, FsdataError, setting
from fsdata.guards import EnvironmentFailure, environment_error


def _tmp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_tmp(final: Path) -> None:
    """Remove temporaries of ``final`` left by processes that no longer run."""
    parent = final.parent
    if not parent.is_dir():
        return
    prefix = _tmp_prefix(final)
    for p in parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        try:
            pid = int(p.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
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


#: Names deleted first when an object-store OUTPUT is overwritten (the commit markers, v2 and v1).
COMMIT_MARKERS = ("_manifest.json", "manifest.json")


@contextlib.contextmanager
def _remote_output(final: str, *, overwrite: bool) -> Iterator[str]:
    """The object-store publish (module docstring): yields ``final`` itself."""
    r = fsio.resolve(final)
    if r.prefix.endswith("://") and "/" not in r.path:
        raise ConfigError(f"output {final} is a whole bucket; write into a prefix inside it, e.g. "
                          f"{r.prefix}{r.path}/shards")
    if fsio.exists(final):
        if not overwrite:
            raise ConfigError(f"output {final} already exists; choose a new path or pass "
                              f"{setting('overwrite_arg', True)} to replace it")
        for name in COMMIT_MARKERS:  # readers see the old output as incomplete from here on
            fsio.delete(fsio.join(final, name))
        fsio.delete(final)
    try:
        yield final
    except BaseException as e:
        with contextlib.suppress(Exception):  # the first error is the one to report
            fsio.delete(final)
        if isinstance(e, OSError) and not isinstance(e, FsdataError):
            cause = getattr(e, "cause", None) or e  # a Ray task's error carries the task's exception
            env = environment_error(cause, final, action="write")
            if env is not None:
                raise env from None
            raise EnvironmentFailure(f"cannot write {final.split('?', 1)[0]}: {str(cause).splitlines()[0]}; check "
                                     "the object store's credentials, permissions and endpoint; nothing was "
                                     "written") from None
        raise


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
        with _remote_output(final, overwrite=overwrite) as out:
            yield out
        return
    final = Path(final)
    if output_taken(final, is_dir=is_dir) and not overwrite:
        raise ConfigError(f"output {final} already exists and is not empty; choose a new path or pass "
                          f"{setting('overwrite_arg', True)} to replace it")
    created = [p for p in [final.parent, *final.parent.parents] if not p.exists()]
    tmp = final.parent / f"{_tmp_prefix(final)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
        old = final.parent / f"{_tmp_prefix(final)}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
        try:
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
