"""Read torch.distributed.checkpoint (DCP) folders without executing code from them.

DCP unpickles in two places: the ``.metadata`` file (``pickle.load`` in
``FileSystemReader.read_metadata``) and every non-tensor entry (``torch.load(..., weights_only=False)``
in ``DefaultLoadPlanner.load_bytes``). A crafted checkpoint can run any command through either.
This module replaces both:

* :class:`SafeFileSystemReader` reads ``.metadata`` with :class:`MetadataUnpickler`, a
  :class:`pickle.Unpickler` whose ``find_class`` resolves only the classes DCP's own metadata is
  made of (:data:`ALLOWED_GLOBALS`: DCP's metadata dataclasses, ``torch.Size``, the torch dtypes,
  layouts and memory formats, ``pathlib`` paths); any other global (``os.system``, ``builtins.eval``,
  ...) is refused before anything is called ("Restricting Globals", Python's pickle documentation).
  Tensor data is read by DCP's own code, ``torch.load(..., weights_only=True)``.
* :class:`SafeLoadPlanner` loads non-tensor entries with ``torch.load(..., weights_only=True)``,
  torch's restricted unpickler (primitive types, containers, tensors).

:func:`check_checkpoint_files` reads the metadata this way and checks that every byte range it
names lies inside an existing file, so a truncated or tampered checkpoint is one
:class:`~fstrain.errors.FstrainError` line instead of a traceback from inside DCP.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from fstrain.errors import FstrainError

#: ``(module, name)`` pairs the ``.metadata`` pickle may name: what DCP writes (torch 2.4 - 2.13).
ALLOWED_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
       ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
       ("pathlib", "PureWindowsPath"), ("pathlib", "Path")]
    + [("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), (torch.dtype, torch.layout,
                                                                               torch.memory_format))])
#: DCP's metadata file name inside a checkpoint folder.
METADATA_NAME = ".metadata"


class UntrustedCheckpointError(FstrainError):
    """A checkpoint's metadata names a Python global outside :data:`ALLOWED_GLOBALS` (refused unrun)."""


class MetadataUnpickler(pickle.Unpickler):
    """:class:`pickle.Unpickler` that resolves only :data:`ALLOWED_GLOBALS`.

    Raises:
        UntrustedCheckpointError: from :meth:`find_class`, for any other global.
    """

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UntrustedCheckpointError(f"refers to {module}.{name}, which a checkpoint written by fstrain "
                                       "never contains")


def read_metadata(path: str):
    """DCP ``Metadata`` of checkpoint folder ``path``, unpickled with :class:`MetadataUnpickler`.

    Raises:
        FstrainError: missing, truncated, or naming a global outside :data:`ALLOWED_GLOBALS` (one line).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = os.path.join(path, METADATA_NAME)
    try:
        with open(meta_path, "rb") as f:
            md = MetadataUnpickler(f).load()
    except UntrustedCheckpointError as e:
        raise UntrustedCheckpointError(f"refusing checkpoint {path}: its {METADATA_NAME} {e} (loading it could "
                                       "run code); use only checkpoints written by fstrain train") from None
    except OSError as e:
        raise FstrainError(f"cannot read checkpoint {path}: {meta_path}: {e.strerror}; pass a complete "
                           "ckpt/step-XXXXXXXX folder written by fstrain train") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled pickle: EOFError, UnpicklingError, ...
        raise FstrainError(f"checkpoint {path} is corrupt or truncated ({METADATA_NAME}: {type(e).__name__}: "
                           f"{str(e)[:200]}); use an earlier checkpoint or retrain") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "storage_data", None), dict):
        raise FstrainError(f"checkpoint {path}: {METADATA_NAME} is not DCP metadata; use only checkpoints "
                           "written by fstrain train")
    return md


def check_checkpoint_files(path: str):
    """Read the metadata safely and check every byte range it names is inside its data file.

    Returns:
        The DCP ``Metadata``.

    Raises:
        FstrainError: a data file missing, outside the folder, or shorter than the metadata says.
    """
    md = read_metadata(path)
    root = os.path.realpath(path)
    sizes: dict[str, int] = {}
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not isinstance(off, int) or not isinstance(length, int) or off < 0 or length < 0:
            raise FstrainError(f"checkpoint {path}: {METADATA_NAME} has a malformed storage entry; use only "
                               "checkpoints written by fstrain train")
        full = os.path.realpath(os.path.join(root, rel))
        if os.path.dirname(full) != root:
            raise FstrainError(f"checkpoint {path}: {METADATA_NAME} names a data file outside the checkpoint "
                               f"({rel!r}); use only checkpoints written by fstrain train")
        if rel not in sizes:
            try:
                sizes[rel] = os.path.getsize(full)
            except OSError:
                raise FstrainError(f"checkpoint {path} is incomplete: data file {rel} is missing; use an "
                                   "earlier checkpoint or retrain") from None
        if off + length > sizes[rel]:
            raise FstrainError(f"checkpoint {path} is truncated: {rel} has {sizes[rel]:,} bytes, its metadata "
                               f"needs {off + length:,}; use an earlier checkpoint or retrain")
    return md


class SafeFileSystemReader(FileSystemReader):
    """:class:`torch.distributed.checkpoint.FileSystemReader` reading ``.metadata`` with :class:`MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        md = read_metadata(str(self.path)) if rank is None else None
        if md is None:  # a per-rank metadata file (not written by fstrain): the same restricted unpickler
            with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
                md = MetadataUnpickler(f).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """:class:`DefaultLoadPlanner` whose non-tensor entries load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            why = next((x.strip() for x in str(e).splitlines() if "GLOBAL" in x), str(e).splitlines()[0][:200])
            raise UntrustedCheckpointError(f"refusing checkpoint entry {read_item.dest_index.fqn!r}: {why} (loading it "
                                           "could run code); use only checkpoints written by fstrain train") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict, path: str) -> None:
    """``dcp.load(state, checkpoint_id=path)`` with :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`.

    Args:
        state: the state dict to load into, in place (tensors keep their storage).
        path: the checkpoint folder.

    Raises:
        FstrainError: anything a checkpoint's files can cause (one line; :func:`check_checkpoint_files`
            first, then DCP's own errors, e.g. tensors of other shapes).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_checkpoint_files(path)
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        cause = first_cause(e)
        if isinstance(cause, FstrainError):
            raise type(cause)(f"{cause} ({path})") from None
        raise FstrainError(f"cannot load checkpoint {path} ({describe(cause)})") from None


def first_cause(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (``e`` itself otherwise)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            return wrapped[0]  # (exception, stack frames)
        return getattr(wrapped, "exc", wrapped)
    return e


def describe(e: BaseException) -> str:
    """``Type: first line`` of an exception, at most 300 characters."""
    lines = [x for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
