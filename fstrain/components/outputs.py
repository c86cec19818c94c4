"""Ownership of fstrain's outputs: replace only what is missing, empty, or fstrain-written of the same kind.

One rule for fsdata and fstrain: :func:`fsdata.atomic.check_replaceable` decides, with fstrain's
kinds taught to it by :func:`fsdata.atomic.register_output_kind` (docs/fstrain.md, "Where fstrain
writes"). It covers ``--checkpoint-dir``, ``--metrics-dir``, ``--tensorboard-dir``,
``fstrain calibrate -o``, ``fstrain evaluate`` / ``replay --output`` and ``fstrain report --html``
with its figures. Each check runs before anything is written and refuses with one
:class:`~fstrain.errors.ConfigError` line naming the flag, the path and the fix:

* a folder fstrain writes into must not be a file, an ``fsdata balance`` OUTPUT (it holds
  ``_manifest.json``: a file there would break ``fsdata verify``), nor lie inside one. Inside it,
  a ``step-XXXXXXXX`` folder of ``--checkpoint-dir`` is replaced only when it is empty or holds
  nothing but DCP files (``.metadata``, ``*.distcp``) and ``fstrain.json``; a metrics file
  (``summary.json``, ``step_times.parquet``, ``null_step_times.parquet``, ``eval.parquet``) only
  when it is empty or one fstrain wrote (its keys or columns). Other files there are left alone.
* a file output must not be a folder, and replaces an existing non-empty file only when fstrain
  wrote it: a cost model, an evaluation or replay result (its JSON keys), a report page (its
  title), a report figure (PNG ``Software: freescale-report``, as ``fsdata report`` writes them).

Overlap with the inputs (an output equal to, inside or containing an input) is
:func:`fsdata.guards.check_output_apart`'s, called beside these checks.
"""

from __future__ import annotations

import json
import os
import re

from fsdata.atomic import check_replaceable, register_output_kind
from fsdata.errors import FsdataError
from fstrain.errors import ConfigError

#: File names a ``--checkpoint-dir`` ``step-XXXXXXXX`` folder holds (DCP's and fstrain's).
_CHECKPOINT_FILE = re.compile(r"^(\.metadata|(__\d+)?\.metadata\.tmp|__\d+_\d+\.distcp|fstrain\.json|\.tmp-\w+)$")
_STEP_TIMES = {"step", "rank", "compute_seconds"}
#: Metrics files ``fstrain train`` writes -> columns or keys showing fstrain wrote one.
_METRICS_FILES = {"summary.json": {"measured_bubble"}, "step_times.parquet": _STEP_TIMES,
                  "null_step_times.parquet": _STEP_TIMES, "eval.parquet": {"step"}}
#: File outputs: kind -> (JSON keys an existing file of that kind has, how messages name it).
_JSON_KINDS = {"cost-model": ({"kind", "coefficients"}, "a cost model fstrain calibrate wrote"),
               "evaluate": ({"checkpoint", "num_users"}, "an evaluation result fstrain evaluate wrote"),
               "replay": ({"measured_bubble", "predicted_bubble"}, "a replay result fstrain replay wrote")}
_REPORT_TITLE = b"<title>fstrain report: "
_MANIFEST_NAMES = ("_manifest.json", "manifest.json")
#: How messages name what replaces an output (fstrain has no ``--overwrite``).
_WHO = "fstrain"


def _kind(kind: str) -> str:
    """The name of an fstrain kind in :mod:`fsdata.atomic`'s registry (fsdata's own kinds unchanged)."""
    return kind if kind == "report-figure" else f"fstrain-{kind}"


def is_checkpoint_folder(path: str) -> bool:
    """Whether ``path`` holds only what :func:`fstrain.components.checkpoint.save_checkpoint` writes
    (complete or cut short), so it may be replaced."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(_CHECKPOINT_FILE.match(n) and os.path.isfile(os.path.join(path, n)) for n in names)


def _has_keys(path: str, keys: set[str]) -> bool:
    """Whether ``path`` is a JSON object with ``keys``, or (``*.parquet``) a Parquet file with those columns."""
    try:
        if not path.endswith(".parquet"):
            with open(path) as f:
                data = json.load(f)
            return isinstance(data, dict) and keys <= set(data)
        import pyarrow.parquet as pq

        return keys <= set(pq.read_schema(path).names)
    except Exception:  # noqa: BLE001 - unreadable (OSError, bad JSON, not Parquet): not ours
        return False


def _is_report_page(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return _REPORT_TITLE in f.read(4096)
    except OSError:
        return False


register_output_kind(_kind("checkpoint"), "a checkpoint folder fstrain wrote (only .metadata, *.distcp, fstrain.json)",
                     is_checkpoint_folder, folder=True)
for _name, _keys in _METRICS_FILES.items():
    register_output_kind(_kind(_name), f"a {_name} fstrain train wrote ({', '.join(sorted(_keys))})",
                         lambda p, k=_keys: _has_keys(p, k))
for _k, (_keys, _what) in _JSON_KINDS.items():
    register_output_kind(_kind(_k), f"{_what} (JSON keys {', '.join(sorted(_keys))})",
                         lambda p, k=_keys: _has_keys(p, k))
register_output_kind(_kind("report"), "an fstrain report page (its title starts 'fstrain report: ')", _is_report_page)
register_output_kind(_kind("folder"), "a folder fstrain writes into", lambda p: True, folder=True)


def _replaceable(path: str, kind: str, flag: str) -> None:
    """:func:`fsdata.atomic.check_replaceable` with fstrain's error class."""
    try:
        check_replaceable(path, _kind(kind), name=flag, flag=_WHO)
    except FsdataError as e:
        raise ConfigError(str(e)) from None


def _check_folder(path: str, flag: str) -> bool:
    """Common folder rules (not a file, not an fsdata OUTPUT nor inside one); returns whether ``path`` exists."""
    if any(os.path.isfile(os.path.join(path, n)) for n in _MANIFEST_NAMES):
        raise ConfigError(f"{flag} {path} is an fsdata balance OUTPUT (it holds a manifest); writing there would "
                          "break it: choose a folder outside every OUTPUT")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a folder; choose a new or empty folder")
    _replaceable(path, "folder", flag)  # inside another OUTPUT
    return os.path.isdir(path)


def _check_entry(folder: str, name: str, kind: str, flag: str, why: str, fix: str) -> None:
    """Refuse when ``folder/name`` exists and fstrain may not replace it as ``kind`` (the message names
    the entry; the decision is :func:`fsdata.atomic.check_replaceable`'s)."""
    full = os.path.join(folder, name)
    if not os.path.lexists(full):
        return
    try:
        _replaceable(full, kind, flag)
    except ConfigError:
        raise ConfigError(f"{flag} {folder} holds {name}, which fstrain did not write ({why}); {fix}") from None


def check_checkpoint_dir(path: str, flag: str = "--checkpoint-dir") -> None:
    """Refuse a checkpoint folder that is a file, an fsdata OUTPUT or inside one, or holds a ``step-*``
    entry fstrain did not write (it would be replaced by a checkpoint of that step).

    Raises:
        ConfigError: one line naming the entry and the fix.
    """
    if not _check_folder(path, flag):
        return
    for name in sorted(os.listdir(path)):
        if name.startswith("step-"):
            _check_entry(path, name, "checkpoint", flag, "a checkpoint would replace it",
                         "move it away or choose another --checkpoint-dir")


def check_metrics_dir(path: str, flag: str = "--metrics-dir") -> None:
    """Refuse a metrics (or TensorBoard) folder that is a file, an fsdata OUTPUT or inside one, or holds a
    ``summary.json`` / ``step_times.parquet`` / ``null_step_times.parquet`` / ``eval.parquet`` fstrain
    did not write.

    Raises:
        ConfigError: one line naming the file and the fix.
    """
    if not _check_folder(path, flag):
        return
    for name in _METRICS_FILES:
        _check_entry(path, name, name, flag, "a run would replace it", "move it away or choose another folder")


def check_output_file(path: str, kind: str, flag: str) -> None:
    """Refuse a file output that is a folder, inside an fsdata OUTPUT, or an existing non-empty file
    fstrain did not write as ``kind``.

    Args:
        kind: ``cost-model``, ``evaluate``, ``replay`` (JSON keys), ``report`` (an fstrain report
            page) or ``report-figure`` (a PNG carrying ``Software: freescale-report``).

    Raises:
        ConfigError: one line naming the path, what it holds and the fix.
    """
    _replaceable(path, kind, flag)


__all__ = ["check_checkpoint_dir", "check_metrics_dir", "check_output_file", "is_checkpoint_folder"]
