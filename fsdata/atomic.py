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
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from fsdata import fsio
from fsdata.errors import ConfigError, FsdataError, setting
from fsdata.guards import (OUTPUT_MARKERS, EnvironmentFailure, check_not_inside_output, enclosing_output,
                           environment_errno, environment_error, process_alive)

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


# ---------------------------------------------------------------------------------------------
# ownership: replace only what FreeScale wrote

#: The Parquet key-value metadata keys that mark a file as FreeScale's, by kind.
PARQUET_KEYS = {"samples": (b"freescale.convert", b"freescale.synth"), "plan": (b"fsdata.plan",),
                "eval": (b"freescale.holdout",)}
#: The marker every page ``fsdata report`` writes carries in its ``<head>``.
HTML_MARKER = '<meta name="generator" content="freescale-report">'
_RANK_DIR = re.compile(r"^rank[-=]\d+$")
#: kind -> (what it is called in messages, test: path -> whether FreeScale wrote it, a folder kind)
_KINDS: dict[str, tuple[str, Callable[[str], bool], bool]] = {}


def register_output_kind(kind: str, what: str, test: Callable[[str], bool], *, folder: bool = False) -> None:
    """Teach :func:`check_replaceable` another kind of output (e.g. fstrain's checkpoint folders).

    Args:
        kind: the name callers pass as ``kind``.
        what: how messages name such an output (``"an fsdata balance OUTPUT"``).
        test: ``test(path) -> bool``: whether the existing, non-empty ``path`` (a local path or
            URI) is one FreeScale wrote of this kind; it must not raise for foreign content.
        folder: the output is a folder (else a file).
    """
    _KINDS[kind] = (what, test, folder)


def _children(path: str) -> list[tuple[str, bool]]:
    try:
        return fsio.list_dir(path)
    except OSError:
        return []


def _is_shards_folder(path: str) -> bool:
    names = _children(path)
    if any(n in OUTPUT_MARKERS for n, _ in names):
        return True
    # the rank folders of 'fsdata write' before 'fsdata finalize' (and an object store's _versions/)
    return bool(names) and all(is_dir and (_RANK_DIR.match(n) or n == fsio.VERSIONS_DIR) for n, is_dir in names)


def _parquet_test(keys: tuple[bytes, ...]):
    def test(path: str) -> bool:
        try:
            meta = fsio.read_parquet_metadata(path).metadata or {}
        except Exception:  # noqa: BLE001 - not Parquet, unreadable: not ours
            return False
        return any(k in meta for k in keys)
    return test


def _head_has(marker: bytes, magic: bytes = b""):
    def test(path: str) -> bool:
        try:
            with fsio.open_input(path) as f:
                head = f.read(4096)
        except OSError:
            return False
        return head.startswith(magic) and marker in head
    return test


_is_report_page = _head_has(HTML_MARKER.encode())


register_output_kind("shards", "an fsdata balance OUTPUT (a folder with a _manifest.json, or rank folders only)",
                     _is_shards_folder, folder=True)
for _k, _keys in PARQUET_KEYS.items():
    register_output_kind(_k, f"a {_k} Parquet file FreeScale wrote (footer key {_keys[0].decode()})",
                         _parquet_test(_keys))
register_output_kind("report", "a page fsdata report wrote (it carries the generator tag freescale-report)",
                     _is_report_page)
register_output_kind("report-figure", "a figure fsdata report wrote (PNG with Software freescale-report)",
                     _head_has(b"freescale-report", b"\x89PNG"))


def check_regenerable(path: str | os.PathLike, kind: str, *, overwrite: bool, name: str = "output") -> None:
    """The rule of outputs regenerated at will (report pages and their figures): ``path`` may be
    replaced when it is missing, empty or something FreeScale wrote of ``kind``; any other file
    only with ``overwrite``; a folder never; nothing inside an ``fsdata balance`` OUTPUT.

    Raises:
        ConfigError: one line naming the path, what it holds and the fix.
    """
    try:
        check_replaceable(path, kind, name=name)
    except ConfigError:
        p = fsio.normalize(path)
        if fsio.is_dir(p) or enclosing_output(p) is not None:
            raise
        if not overwrite:
            raise ConfigError(f"{name} {path} already exists and is not {_KINDS[kind][0]}; choose another path or "
                              f"pass {setting('overwrite_arg', True)} to replace it") from None
        log.warning("%s %s: replacing a file FreeScale did not write (--overwrite)", name, path)


def check_replaceable(path: str | os.PathLike, kind: str, *, name: str = "output",
                      flag: str = "--overwrite") -> None:
    """The ownership rule of every ``--overwrite``: refuse to replace what FreeScale did not write.

    ``path`` may be replaced when it does not exist, is an empty folder (a folder ``kind``) or an
    empty file (a file ``kind``), or is something FreeScale wrote of the same ``kind``:

    * ``"shards"`` (a folder or object-store prefix): it holds ``_manifest.json`` / ``manifest.json``,
      or ``_current.json`` (an object store's replaced OUTPUT), or only rank folders
      (``fsdata write`` before ``fsdata finalize``), or ``_versions/``;
    * ``"samples"``, ``"plan"``, ``"eval"`` (a file): a Parquet file whose footer carries
      :data:`PARQUET_KEYS` of that kind;
    * ``"report"`` (a file): an HTML page whose first 4 KiB carry :data:`HTML_MARKER`;
    * any kind added with :func:`register_output_kind`.

    A folder kind is never put in place of a file nor a file kind in place of a folder, and nothing
    is replaced that lies inside another OUTPUT (:func:`check_not_inside_output`). Local paths and
    URIs (:mod:`fsdata.fsio`) follow the same rule; a symlink is judged by what it points to.

    Args:
        path: the output about to be replaced (local path or URI).
        kind: one of the kinds above.
        name: how the message names the output (``"output"``, ``"--html"``).
        flag: the flag that asked for the replacement, named in the message.

    Raises:
        ConfigError: one line naming the path, what it holds and the fix; nothing was touched.
        KeyError: an unknown ``kind`` (a programming error).
    """
    what, test, folder_kind = _KINDS[kind]
    p = fsio.normalize(path)
    check_not_inside_output(p, name=name)
    if not fsio.exists(p):
        return
    fix = "choose another path, or move it away yourself if it is to go"
    if fsio.is_dir(p):
        if not folder_kind:
            raise ConfigError(f"{name} {path} is a folder; {flag} replaces only {what}, never a folder with a "
                              f"file: {fix}")
        names = _children(p)
        if not names or test(p):
            return
        shown = ", ".join(n + ("/" if d else "") for n, d in names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"{name} {path} holds files FreeScale did not write ({shown}); {flag} replaces only an "
                          f"empty folder or {what}: {fix}")
    if folder_kind:
        raise ConfigError(f"{name} {path} is a file; {flag} replaces only an empty folder or {what}: {fix}")
    try:
        empty = fsio.size(p) == 0
    except OSError:
        empty = False
    if not empty and not test(p):
        raise ConfigError(f"{name} {path} is not {what}; {flag} replaces only such a file or an empty one: {fix}")


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
def _remote_output(final: str, *, overwrite: bool, is_dir: bool = True, kind: str = "shards") -> Iterator[str]:
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
    if existed:
        check_replaceable(final, kind, flag=setting("overwrite_arg", True))
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
def atomic_output(final: str | os.PathLike, *, overwrite: bool = False, is_dir: bool = True,
                  kind: str | None = None) -> Iterator[Path | str]:
    """Yield a temporary path next to ``final``; move it to ``final`` when the block succeeds.

    For an object-store URI (``s3://...``; :func:`fsdata.fsio.is_remote`) it yields ``final``
    itself (a ``str``): the caller writes there directly and writes its commit marker (the
    manifest) last; on failure everything under ``final`` is deleted (module docstring).

    Args:
        final: the output path the caller wants.
        overwrite: replace an existing ``final`` (the old one is moved aside, the new one moved in,
            then the old one deleted); when False an existing ``final`` is an error.
        is_dir: the temporary path is created as an empty directory (else it does not exist yet).
        kind: what ``final`` is (:func:`check_replaceable`: ``shards``, ``samples``, ``plan``,
            ``eval``, ``report`` or a registered kind; default ``shards`` for a folder): an existing
            ``final`` is replaced only when FreeScale wrote it as this kind (or it is empty).

    Yields:
        The temporary path (same filesystem as ``final``, so the final move is a rename).

    Raises:
        ConfigError: ``final`` exists and ``overwrite`` is False, or it is something FreeScale did
            not write as ``kind`` (:func:`check_replaceable`), or it lies inside another OUTPUT.
    """
    final = fsio.normalize(final)
    kind = kind or ("shards" if is_dir else "samples")
    if fsio.is_remote(final):
        check_not_inside_output(final)
        with _remote_output(final, overwrite=overwrite, is_dir=is_dir, kind=kind) as out:
            yield out
        return
    final = Path(final)
    clean_stale_tmp(final)  # first: a previous output a killed replace left aside is put back
    check_not_inside_output(final)
    if output_taken(final, is_dir=is_dir) and not overwrite:
        raise ConfigError(f"output {final} already exists and is not empty; choose a new path or pass "
                          f"{setting('overwrite_arg', True)} to replace it")
    if overwrite:
        check_replaceable(final, kind, flag=setting("overwrite_arg", True))
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
        try:
            if not overwrite:
                raise ConfigError(f"output {final} appeared while this run was writing; pass "
                                  f"{setting('overwrite_arg', True)} to replace it")
            check_replaceable(final, kind, flag=setting("overwrite_arg", True))  # what appeared meanwhile
        except ConfigError:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise
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
