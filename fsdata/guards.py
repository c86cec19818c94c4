"""Guards shared by every command that writes: output/input overlap and environment failures.

Two questions every writer asks before and while it writes:

* :func:`check_output_apart` -- does the OUTPUT equal, contain or lie inside one of the inputs?
  (Resolved real paths, symlinks followed, plus a device/inode comparison so that hard links and
  bind mounts of the same folder are caught too.) Asked before anything is created or removed,
  so ``fsdata balance X X --overwrite`` cannot replace its own input.
* :func:`environment_error` -- is an ``OSError`` (raised by Python, PyArrow or Polars) a failure of
  the machine rather than of the data: a full disk, a read-only file system, a denied permission?
  Then the user gets one line naming the real cause and the location, not "the input is corrupt".

* :func:`process_alive` -- does the process that left a temporary (or shares a segment) still run?
"""

from __future__ import annotations

import errno
import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path

from fsdata import fsio
from fsdata.errors import ConfigError, FsdataError


class EnvironmentFailure(FsdataError):
    """The machine, not the data, stopped a command: disk full, read-only file system, permission
    denied, file too large, I/O error. The message names the cause, the location and the fix."""


# ---------------------------------------------------------------------------------------------
# output / input overlap


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _input_paths(path: str | os.PathLike) -> list[str]:
    """What an input names on disk: the path itself, or for a glob the files it matches plus the
    fixed folder before the first wildcard when the glob is recursive (``**``)."""
    p = os.fspath(fsio.normalize(path))
    if not fsio.has_glob(p):
        return [p]
    if fsio.is_remote(p):
        return [*fsio.glob_remote(p), *([fsio.glob_base(p)] if "**" in p else [])]
    out = sorted(glob.glob(p, recursive=True))
    if "**" in p:
        head = re.split(r"[*?\[]", p, maxsplit=1)[0]
        out.append(os.path.dirname(head) or ".")
    return out


def _ancestors_stat(path: str) -> Iterable[tuple[str, os.stat_result]]:
    """``(path, stat)`` of ``path`` (if it exists) and of every existing parent, innermost first."""
    cur = path
    while True:
        try:
            yield cur, os.stat(cur)
        except OSError:
            pass
        parent = os.path.dirname(cur)
        if parent == cur:
            return
        cur = parent


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def overlap(output: str | os.PathLike, input_path: str | os.PathLike) -> str | None:
    """How ``output`` overlaps ``input_path``: ``"is"``, ``"lies inside"``, ``"contains"`` or None.

    Both are resolved to real paths (symlinks followed, ``..`` removed); where they exist, folders
    are also compared by device and inode, which catches hard links and bind mounts. URIs
    (:mod:`fsdata.fsio`) are compared by file system type and normalized path inside it (the
    query, e.g. an endpoint, is ignored: same bucket and key means the same place); a URI never
    overlaps a local path.
    """
    output, input_path = fsio.normalize(output), fsio.normalize(input_path)
    if fsio.is_remote(output) or fsio.is_remote(input_path):
        a, b = fsio.location_key(output), fsio.location_key(input_path)
        if a is None or b is None or a[0] != b[0]:
            return None
        if a[1] == b[1]:
            return "is"
        if a[1].startswith(b[1] + "/"):
            return "lies inside"
        if b[1].startswith(a[1] + "/"):
            return "contains"
        return None
    out, inp = _real(output), _real(input_path)
    if out == inp:
        return "is"
    if out.startswith(inp.rstrip(os.sep) + os.sep):
        return "lies inside"
    if inp.startswith(out.rstrip(os.sep) + os.sep):
        return "contains"
    try:
        in_stat = os.stat(inp)
    except OSError:
        in_stat = None
    try:
        out_stat = os.stat(out)
    except OSError:
        out_stat = None
    if in_stat is not None and out_stat is not None and _same(in_stat, out_stat):
        return "is"
    if in_stat is not None:
        for _, st in list(_ancestors_stat(out))[1:]:
            if _same(st, in_stat):
                return "lies inside"
    if out_stat is not None:
        for _, st in list(_ancestors_stat(inp))[1:]:
            if _same(st, out_stat):
                return "contains"
    return None


def check_not_bucket_root(output: str | os.PathLike, *, output_name: str = "output") -> None:
    """Refuse an object-store output that is a whole bucket, however it is spelt (the URI is
    normalised first: ``s3://b/.``, ``s3://b/keep/..`` and ``s3://b//`` are ``s3://b``).

    Raises:
        ConfigError: one line naming the output and a prefix to use instead.
    """
    out = fsio.normalize(output)
    if not fsio.is_remote(out):
        return
    r = fsio.resolve(out)
    if r.prefix.endswith("://") and "/" not in r.path:
        raise ConfigError(f"{output_name} {output} is a whole bucket ({r.uri()}); write into a prefix inside it, "
                          f"e.g. {r.uri(r.path + '/shards')}")


def check_output_apart(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], *,
                       output_name: str = "output", input_name: str = "input") -> None:
    """Refuse an output that equals, contains or lies inside any input, before anything is touched.

    Writing into an input would replace it (``--overwrite``), delete files of it, or add files a
    later read of the input would pick up as data.

    Args:
        output: the path the command will write (file or folder; need not exist).
        inputs: every path the command reads (files, folders or globs); ``None`` entries are skipped.
        output_name: how the error names the output (e.g. ``"OUTPUT"``, ``"--output"``).
        input_name: how the error names the inputs (e.g. ``"INPUT"``, ``"--from-shards"``).

    Raises:
        ConfigError: the paths overlap, or ``output`` is a whole bucket (``s3://b``, also spelt
            ``s3://b/.`` or ``s3://b/x/..``); the message names both and the fix.
    """
    check_not_bucket_root(output, output_name=output_name)
    for given in inputs:
        if given is None:
            continue
        for inp in _input_paths(given):
            how = overlap(output, inp)
            if how is None:
                continue
            shown = f"{inp}" if os.fspath(given) == inp else f"{inp} (from {given})"
            if how == "is":
                what = f"is the same path as {input_name} {shown}"
            elif how == "lies inside":
                what = f"lies inside {input_name} {shown}"
            else:
                what = f"contains {input_name} {shown}"
            raise ConfigError(f"{output_name} {output} {what}; writing there would modify or delete the "
                              f"input: choose an {output_name} outside the input")


# ---------------------------------------------------------------------------------------------
# outputs inside outputs

#: Names of the files that mark a folder (or object-store prefix) as an ``fsdata balance`` OUTPUT:
#: the manifest (v2/v3, v1) and the pointer object of a replaced object-store OUTPUT.
OUTPUT_MARKERS = ("_manifest.json", "manifest.json", fsio.POINTER_NAME)


def enclosing_output(path: str | os.PathLike) -> str | None:
    """The ``fsdata balance`` OUTPUT that ``path`` lies inside (a parent holding a manifest or an
    object store's ``_current.json``), or None. ``path`` itself does not count."""
    p = fsio.normalize(path)
    if fsio.is_remote(p):
        r = fsio.resolve(p)
        parts = r.path.rstrip("/").split("/")
        parents = [r.uri("/".join(parts[:i])) for i in range(len(parts) - 1, 1, -1)]
    else:
        real = Path(_real(p))
        parents = [str(q) for q in real.parents]
    for parent in parents:
        try:
            if any(fsio.is_file(fsio.join(parent, m)) for m in OUTPUT_MARKERS):
                return parent
        except OSError:
            continue
    return None


def check_not_inside_output(path: str | os.PathLike, *, name: str = "output") -> None:
    """Refuse to write ``path`` inside another ``fsdata balance`` OUTPUT (which is never modified:
    ``fsdata verify`` would then fail it, and ``--overwrite`` would replace a part of it).

    Raises:
        ConfigError: one line naming the enclosing OUTPUT and the fix.
    """
    parent = enclosing_output(path)
    if parent is not None:
        raise ConfigError(f"{name} {path} lies inside the fsdata balance OUTPUT {parent}, which is never modified; "
                          f"choose a path outside it")


# ---------------------------------------------------------------------------------------------
# environment failures

#: errno -> (cause, fix)
_CAUSES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free space on that file system or choose another location"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota or choose another location"),
    errno.EFBIG: ("file too large for this file system or process limit",
                  "choose a file system that allows larger files or raise the file size limit (ulimit -f)"),
    errno.EROFS: ("read-only file system", "choose a writable location"),
    errno.EACCES: ("permission denied", "fix the permissions or choose another location"),
    errno.EPERM: ("operation not permitted", "fix the permissions or choose another location"),
    errno.EIO: ("input/output error", "check the device (dmesg) and retry"),
    errno.EMFILE: ("too many open files", "raise the open-file limit (ulimit -n) or lower --num-threads"),
}
_STRERROR = {os.strerror(code).lower(): code for code in _CAUSES}
_ERRNO_IN_TEXT = re.compile(r"(?:\[errno (\d+)\]|\(os error (\d+)\)|errno[ =:](\d+))", re.IGNORECASE)
_QUOTED_PATH = re.compile(r"'(/[^']+)'")


def environment_errno(exc: BaseException) -> int | None:
    """The errno of an environment failure carried by ``exc``, or None if it is something else.

    Looks at ``exc.errno`` (Python and PyArrow's ``OSError``), then at the text, which is all that
    Polars (``... (os error 28)``) and some Arrow paths (``Detail: [errno 28] ...``) keep.
    """
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in _CAUSES:
        return code
    text = str(exc)
    for m in _ERRNO_IN_TEXT.finditer(text):
        code = int(next(g for g in m.groups() if g))
        if code in _CAUSES:
            return code
    low = text.lower()
    for s, code in _STRERROR.items():
        if s in low:
            return code
    return None


_AWS_ERROR = re.compile(r"AWS Error ([A-Z_]+)(?: \(HTTP status (\d+)\))?")
_S3_WHERE = re.compile(r"(?:key '([^']*)' in )?bucket '([^']+)'")
_DENIED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "INVALID_CLIENT_TOKEN_ID",
           "EXPIRED_TOKEN", "MISSING_AUTHENTICATION_TOKEN")
_UNREACHABLE = ("NETWORK_CONNECTION", "ENDPOINT_RESOLUTION_FAILURE", "REQUEST_TIMEOUT", "SLOW_DOWN",
                "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE")


def object_store_error(exc: BaseException, location: str | os.PathLike | None = None) -> EnvironmentFailure | None:
    """Turn an object-store failure (credentials refused, endpoint unreachable, network cut; the
    ``AWS Error ...`` text of PyArrow's S3 client) into one line naming the store and the cause.

    Returns:
        The error to raise, or None when ``exc`` is not an object-store failure.
    """
    text = str(exc)
    m = _AWS_ERROR.search(text)
    if m is None and "curlCode" not in text:
        return None
    code = m.group(1) if m else "NETWORK_CONNECTION"
    w = _S3_WHERE.search(text)
    if w is not None:
        where = f"s3://{w.group(2)}" + (f"/{w.group(1)}" if w.group(1) else "")
    else:
        where = str(location).split("?", 1)[0] if location else "the object store"
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    store = f"{where} (endpoint {endpoint})" if endpoint else where
    detail = text.split(f"AWS Error {code}", 1)[-1].split("operation:", 1)[-1].strip().splitlines()[0][:160]
    if code in _DENIED or (m and m.group(2) in ("401", "403")):
        cause = f"access denied: the credentials were refused ({code})"
        fix = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE or the instance role) "
               "and the bucket's permissions")
    elif code in _UNREACHABLE or "curlCode" in text:
        cause = f"the endpoint cannot be reached ({code}: {detail})"
        fix = ("check the endpoint (AWS_ENDPOINT_URL or ?endpoint_override=HOST:PORT&scheme=http), the network "
               "and the region, then rerun")
    else:
        cause = f"the store refused the request ({code}: {detail})"
        fix = "check the bucket, its region and your permissions, then rerun"
    return EnvironmentFailure(f"object store {store}: {cause}; {fix}")


def public_path(path: str | os.PathLike) -> str:
    """The path a user asked for: hidden atomic temporaries (``.NAME.tmp-<pid>-<id>``, see
    :mod:`fsdata.atomic`) and anything below them are replaced by ``NAME``."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        m = re.match(r"^\.(.+)\.tmp-\d+-", part)
        if m:
            return str(Path(*parts[:i], m.group(1)))
    return str(path)


_WRITE_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def environment_error(exc: BaseException, location: str | os.PathLike | None = None, *,
                      action: str | None = None) -> EnvironmentFailure | None:
    """Turn an environment ``OSError`` into a one-line :class:`EnvironmentFailure`, else None.

    Args:
        exc: the exception raised (``OSError``, ``pyarrow.ArrowException`` or a Polars error).
        location: where the command was reading or writing; the exception's own file name, when
            it has one, wins. Hidden temporaries are shown as the output the user asked for.
        action: ``"write"``, ``"read"`` or None (``write`` for a full disk, a read-only file
            system or a too-large file, else ``access``): how the message names the operation.

    Returns:
        The error to raise (``raise env from None``), or None when ``exc`` is not an environment
        failure (then it is a data problem or a bug, and the caller handles it as before).
    """
    code = environment_errno(exc)
    if code is None:
        return object_store_error(exc, location)
    where = getattr(exc, "filename", None)
    if not where:
        m = _QUOTED_PATH.search(str(exc))
        where = m.group(1) if m else location
    where = public_path(where) if where else "the output location"
    cause, fix = _CAUSES[code]
    if action is None:
        action = "write" if code in _WRITE_ONLY else "access"
    left = "; nothing was written" if action == "write" else ""
    return EnvironmentFailure(f"cannot {action} {where}: {cause} ({errno.errorcode.get(code, code)}); "
                              f"{fix}{left}")


def raise_if_environment(exc: BaseException, location: str | os.PathLike | None = None, *,
                         action: str | None = None) -> None:
    """Raise :func:`environment_error` of ``exc`` if it is one; return otherwise."""
    env = environment_error(exc, location, action=action)
    if env is not None:
        raise env from None


# ---------------------------------------------------------------------------------------------
# processes


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs on this machine.

    Read from ``/proc/PID/stat``: a zombie (``Z``) or dead (``X``) process counts as exited, since
    it holds nothing any more and no one waits for it to finish its work. Without ``/proc`` a
    signal-0 probe (``os.kill(pid, 0)``) answers: no such process is exited, one of another user
    (``PermissionError``) runs.

    Args:
        pid: the process id.

    Returns:
        False when the process has exited (or is a zombie), else True.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
