"""Paths that may be URIs: local paths as always, ``scheme://...`` through :mod:`pyarrow.fs`.

Every INPUT, PLAN and OUTPUT that fsdata reads or writes may be a local path or a URI that
:meth:`pyarrow.fs.FileSystem.from_uri` understands: ``s3://bucket/prefix``, ``gs://bucket/prefix``,
``hdfs://host:port/path``, ``file:///abs/path`` (docs/cluster.md, "Object stores"). This module is
the one place that tells them apart and does the file operations on them:

* a plain local path (and ``file://`` URIs, turned into one by :func:`normalize`) goes through
  exactly the calls fsdata always made (``open``, ``os.stat``, ``pathlib``, PyArrow with a path),
  so local outputs keep their bytes, errors and atomic tmp-then-rename publish;
* any other URI is resolved once per file system (:func:`resolve`: the ``FileSystem`` object is
  cached per scheme, bucket/host and query) and every read, write, listing and delete goes through
  that ``FileSystem`` object.

Credentials and endpoints come from the file system's usual sources: for S3 the standard AWS
environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``, honoured by PyArrow's S3 client) or the URI's query
(``s3://bucket/prefix?endpoint_override=host:port&scheme=http&region=...``). A remote path keeps
its query when joined (:func:`join`), so a child path resolves to the same file system.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pyarrow.fs as pafs

from fsdata.errors import ConfigError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
#: Schemes whose FileSystem path is ``bucket/key`` (so a child needs no new ``from_uri``).
_BUCKET_SCHEMES = ("s3", "gs", "gcs")
PathLike = str | os.PathLike


def _clean_key(path: str, uri: str) -> str:
    """A URI's path with ``.``, ``..``, empty segments and trailing slashes resolved, like
    :func:`posixpath.normpath` but never above the root (and ``//`` collapsed at the start too).

    Raises:
        ConfigError: ``..`` climbs above the bucket / root.
    """
    out: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not out:
                raise ConfigError(f"{uri.split('?', 1)[0]}: '..' climbs above the bucket or root; "
                                  "write the path without '..'")
            out.pop()
            continue
        out.append(seg)
    return ("/" if path.startswith("/") else "") + "/".join(out)


def normalize(path: PathLike) -> PathLike:
    """A path's one spelling, applied before any check or use.

    ``file:///abs/path`` -> ``/abs/path`` (a local path, handled as one; local paths are compared
    by their real path where it matters, :func:`fsdata.guards.overlap`). A remote URI gets its
    path normalised: ``.`` and empty segments (``//``) dropped, ``..`` applied, trailing ``/``
    removed (``s3://b/x/../in/`` -> ``s3://b/in``); the scheme, authority and query are kept.
    Anything else is returned unchanged.

    Raises:
        ConfigError: a URI whose ``..`` climbs above its bucket or root.
    """
    if isinstance(path, str) and path[:7].lower() == "file://":
        parts = urllib.parse.urlsplit(path)
        return urllib.parse.unquote(parts.path) or "/"
    if isinstance(path, str) and _SCHEME.match(path):
        parts = urllib.parse.urlsplit(path)
        clean = _clean_key(parts.path, path)
        if parts.path.startswith("/") and not clean.startswith("/"):
            clean = "/" + clean
        if clean == "/":
            clean = ""
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, clean, parts.query, parts.fragment))
    return path


def is_remote(path: PathLike | None) -> bool:
    """Whether ``path`` is a URI handled by :mod:`pyarrow.fs` (``s3://...``; not ``file://``)."""
    return isinstance(path, str) and bool(_SCHEME.match(path)) and path[:7].lower() != "file://"


@dataclass(frozen=True, slots=True)
class RemotePath:
    """A resolved URI.

    Attributes:
        fs: the :class:`pyarrow.fs.FileSystem` (shared by every path of the same root).
        path: the path inside ``fs`` (``bucket/key`` for S3), without a trailing ``/``.
        prefix: ``scheme://`` plus, for non-bucket schemes, the authority (``hdfs://host:port``).
        query: ``""`` or ``"?..."``, kept on every derived path.
    """

    fs: pafs.FileSystem
    path: str
    prefix: str
    query: str

    def uri(self, path: str | None = None) -> str:
        """The URI of ``path`` (default: this path) on the same file system."""
        p = self.path if path is None else path
        if self.prefix.endswith("://") or p.startswith("/"):
            return f"{self.prefix}{p}{self.query}"
        return f"{self.prefix}/{p}{self.query}"


def _from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:  # ArrowInvalid is a ValueError; network/credential failures OSError
        shown = uri.split("?", 1)[0]
        raise ConfigError(f"cannot open {shown} ({str(e).splitlines()[0]}); pass a local path or a URI pyarrow.fs "
                          "understands (s3://bucket/prefix, gs://, hdfs://, file:///abs/path) and check its "
                          "credentials and endpoint (for s3:// the AWS_* environment variables, e.g. "
                          "AWS_ENDPOINT_URL, or ?endpoint_override=HOST:PORT&scheme=http)") from None


@functools.lru_cache(maxsize=64)
def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    return _from_uri(uri)


def resolve(uri: str) -> RemotePath:
    """Resolve a remote URI (:func:`is_remote`) with :meth:`pyarrow.fs.FileSystem.from_uri`.

    The file system of ``s3://``/``gs://`` URIs is created once per bucket and query (the
    bucket-region lookup runs once); other schemes are resolved per call.

    Raises:
        ValueError: ``uri`` is not remote.
        ConfigError: the URI names an unknown scheme or cannot be resolved (e.g. the bucket's
            region cannot be looked up); one line naming the URI and the fix.
    """
    if not is_remote(uri):
        raise ValueError(f"{uri!r} is not a remote URI")
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    query = f"?{parts.query}" if parts.query else ""
    if scheme in _BUCKET_SCHEMES:
        fs, _ = _filesystem(f"{scheme}://{parts.netloc}/{query}")
        bucket = parts.hostname if parts.hostname is not None else parts.netloc
        key = _clean_key(urllib.parse.unquote(parts.path), uri).strip("/")
        return RemotePath(fs=fs, path=f"{bucket}/{key}".rstrip("/"), prefix=f"{scheme}://", query=query)
    fs, inner = _from_uri(uri)
    root = f"{parts.scheme}://{parts.netloc}"
    return RemotePath(fs=fs, path=_clean_key(inner, uri).rstrip("/") or "/", prefix=root, query=query)


def resolve_fs(path: PathLike) -> tuple[pafs.FileSystem, str]:
    """``(FileSystem, path inside it)`` for any path: a local path gives ``LocalFileSystem`` and its
    absolute path."""
    path = normalize(path)
    if is_remote(path):
        r = resolve(path)
        return r.fs, r.path
    return pafs.LocalFileSystem(), os.path.abspath(os.fspath(path))


def filesystem_and_path(path: PathLike) -> tuple[pafs.FileSystem | None, str]:
    """What to pass PyArrow's readers and writers: ``(None, str(path))`` for a local path (PyArrow
    then behaves exactly as with a plain path), ``(FileSystem, inner path)`` for a URI."""
    path = normalize(path)
    if is_remote(path):
        r = resolve(path)
        return r.fs, r.path
    return None, os.fspath(path)


def join(base: PathLike, *parts: str) -> str:
    """``base/part/...``: a local path as ``pathlib`` joins it; a URI keeps its scheme and query."""
    base = normalize(base)
    if not is_remote(base):
        return str(Path(base).joinpath(*parts))
    r = resolve(base)
    inner = "/".join([r.path.rstrip("/"), *(p.strip("/") for p in parts if p)])
    return r.uri(inner)


def exists(path: PathLike) -> bool:
    """Whether anything (a file, a folder, or for object stores any object under the prefix) is there."""
    path = normalize(path)
    if not is_remote(path):
        return Path(path).exists()
    r = resolve(path)
    return r.fs.get_file_info(r.path).type != pafs.FileType.NotFound


def is_file(path: PathLike) -> bool:
    """Whether a file (an object) is there."""
    path = normalize(path)
    if not is_remote(path):
        return Path(path).is_file()
    r = resolve(path)
    return r.fs.get_file_info(r.path).type == pafs.FileType.File


def is_dir(path: PathLike) -> bool:
    """A folder; for object stores a prefix holding at least one object."""
    path = normalize(path)
    if not is_remote(path):
        return Path(path).is_dir()
    r = resolve(path)
    return r.fs.get_file_info(r.path).type == pafs.FileType.Directory


def size(path: PathLike) -> int:
    """Size in bytes of a file.

    Raises:
        FileNotFoundError: nothing there.
    """
    path = normalize(path)
    if not is_remote(path):
        return Path(path).stat().st_size
    r = resolve(path)
    info = r.fs.get_file_info(r.path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"{path} is not a file")
    return int(info.size)


def list_dir(path: PathLike) -> list[tuple[str, bool]]:
    """``(name, is_folder)`` of the direct children of a folder, sorted by name."""
    path = normalize(path)
    if not is_remote(path):
        return sorted((p.name, p.is_dir()) for p in Path(path).iterdir())
    r = resolve(path)
    infos = r.fs.get_file_info(pafs.FileSelector(r.path, allow_not_found=True, recursive=False))
    return sorted((i.base_name, i.type == pafs.FileType.Directory) for i in infos)


def walk_files(path: PathLike) -> list[str]:
    """Every file below a remote folder (recursive), as URIs sorted by path."""
    r = resolve(normalize(path))
    infos = r.fs.get_file_info(pafs.FileSelector(r.path, allow_not_found=True, recursive=True))
    return [r.uri(i.path) for i in sorted(infos, key=lambda i: i.path) if i.type == pafs.FileType.File]


def _glob_regex(pattern: str) -> re.Pattern:
    """Glob -> regex: ``*``/``?``/``[...]`` within one path segment, ``**`` across segments."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j + 1
                continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def has_glob(path: PathLike) -> bool:
    """Whether ``path`` holds a wildcard: ``*``, ``?`` or ``[`` (for a URI: ``*`` or ``[`` in its
    path; ``?`` starts a URI's query, so remote globs have no ``?`` wildcard)."""
    path = os.fspath(normalize(path))
    if is_remote(path):
        return any(ch in urllib.parse.urlsplit(path).path for ch in "*[")
    return any(ch in path for ch in "*?[")


def glob_base(pattern: str) -> str:
    """The fixed folder of a remote glob (the part before its first wildcard), as a URI."""
    r = resolve(normalize(pattern))
    head = re.split(r"[*?\[]", r.path, maxsplit=1)[0]
    return r.uri(head.rsplit("/", 1)[0] if "/" in head else head)


def glob_remote(pattern: str) -> list[str]:
    """Files matching a remote glob (``s3://bucket/logs/*/part-*.parquet``), as URIs sorted by path;
    ``*`` and ``[...]`` stay within one path segment, ``**`` spans segments."""
    r = resolve(normalize(pattern))
    head = re.split(r"[*?\[]", r.path, maxsplit=1)[0]
    base = head.rsplit("/", 1)[0] if "/" in head else head
    rx = _glob_regex(r.path)
    infos = r.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
    return [r.uri(i.path) for i in sorted(infos, key=lambda i: i.path)
            if i.type == pafs.FileType.File and rx.match(i.path)]


@contextmanager
def open_input(path: PathLike) -> Iterator[BinaryIO]:
    """A readable, seekable binary file (local: ``open(path, "rb")``)."""
    path = normalize(path)
    if not is_remote(path):
        with open(path, "rb") as f:
            yield f
        return
    r = resolve(path)
    with r.fs.open_input_file(r.path) as f:
        yield f


def read_bytes(path: PathLike) -> bytes:
    """A whole file's bytes."""
    with open_input(path) as f:
        return f.read()


def write_bytes(path: PathLike, data: bytes) -> None:
    """Write a whole file (an object store's single PUT: readers see all of it or nothing)."""
    path = normalize(path)
    if not is_remote(path):
        Path(path).write_bytes(data)
        return
    r = resolve(path)
    with r.fs.open_output_stream(r.path) as f:
        f.write(data)


def delete(path: PathLike) -> None:
    """Remove a file or a whole folder / prefix; nothing there is fine."""
    path = normalize(path)
    if not is_remote(path):
        import shutil  # noqa: PLC0415

        p = Path(path)
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return
    r = resolve(path)
    info = r.fs.get_file_info(r.path)
    if info.type == pafs.FileType.Directory:
        r.fs.delete_dir(r.path)
    elif info.type == pafs.FileType.File:
        r.fs.delete_file(r.path)


def sha256(path: PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    path = normalize(path)
    if not is_remote(path):
        with open(path, "rb") as f:
            while block := f.read(chunk_bytes):
                h.update(block)
        return h.hexdigest()
    r = resolve(path)
    with r.fs.open_input_stream(r.path) as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def location_key(path: PathLike) -> tuple[str, str] | None:
    """``(file system type, normalized path inside it)`` of a remote path, for overlap checks;
    None for a local path."""
    path = normalize(path)
    if not is_remote(path):
        return None
    r = resolve(path)
    return r.fs.type_name, r.path.rstrip("/")


def read_parquet_metadata(path: PathLike):
    """A Parquet footer (``pyarrow.parquet.FileMetaData``) of a local path or URI."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    fs, where = filesystem_and_path(path)
    return pq.read_metadata(where, filesystem=fs)


def scan_parquet(files: list[str]):
    """Lazy Polars frame over Parquet files: ``polars.scan_parquet`` for local paths; for URIs a
    PyArrow dataset on their :mod:`pyarrow.fs` file system (so the same credentials apply; Polars'
    own cloud readers would need theirs configured separately)."""
    import polars as pl  # noqa: PLC0415

    if files and is_remote(files[0]):
        import pyarrow.dataset as ds  # noqa: PLC0415

        r = resolve(files[0])
        return pl.scan_pyarrow_dataset(ds.dataset([resolve(f).path for f in files], filesystem=r.fs,
                                                  format="parquet"))
    return pl.scan_parquet(files)


#: The pointer object of an object-store OUTPUT that was replaced (``--overwrite``): it names the
#: version prefix (``_versions/<id>``, inside OUTPUT) that holds the current output (docs/fsdata.md,
#: "Replacing an output on an object store").
POINTER_NAME = "_current.json"
VERSIONS_DIR = "_versions"


def resolve_pointer(path: PathLike) -> PathLike:
    """The location that holds an OUTPUT now: ``path`` itself, or for an object-store OUTPUT with a
    pointer object (``_current.json``) the version prefix it names.

    Readers resolve the pointer once and then read everything (manifest, rank files, stats) from
    the returned prefix. A local path is returned unchanged (local outputs are replaced by rename).

    Raises:
        ConfigError: the pointer object is unreadable or names something outside ``_versions/``.
    """
    path = normalize(path)
    if not is_remote(path):
        return path
    ptr = join(path, POINTER_NAME)
    if not is_file(ptr):
        return path
    try:
        target = json.loads(read_bytes(ptr).decode())["target"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{ptr.split('?', 1)[0]} is not a valid pointer object ({type(e).__name__}: {e}); "
                          "rerun the command that wrote this output with --overwrite") from None
    parts = target.split("/") if isinstance(target, str) else []
    if len(parts) != 2 or parts[0] != VERSIONS_DIR or parts[1] in ("", ".", ".."):
        raise ConfigError(f"{ptr.split('?', 1)[0]} names {target!r}, not a version inside the output; "
                          "rerun the command that wrote this output with --overwrite")
    return join(path, target)
