"""Ownership of fstrain's outputs: replace only what is missing, empty, or fstrain-written of the same kind.

One place for the rule of docs/fstrain.md ("Outputs"): ``--checkpoint-dir``, ``--metrics-dir``,
``--tensorboard-dir``, ``fstrain calibrate -o``, ``fstrain evaluate`` / ``replay --output`` and
``fstrain report --html``. Each check runs before anything is written and refuses with one
:class:`~fstrain.errors.ConfigError` line naming the flag, the path and the fix:

* a folder output must not be a file, nor an ``fsdata balance`` OUTPUT (it holds ``_manifest.json``:
  a file there would break ``fsdata verify``). A ``step-XXXXXXXX`` folder of ``--checkpoint-dir``
  is replaced only when it holds nothing but DCP files (``.metadata``, ``*.distcp``) and
  ``fstrain.json``; a metrics file (``summary.json``, ``step_times.parquet``, ``eval.parquet``) only
  when it is one fstrain wrote (its keys or columns). Other files in these folders are left alone.
* a file output must not be a folder, and replaces an existing file only when fstrain wrote it
  (a cost model, an evaluation or replay result: its JSON keys; a report page: its title).

Overlap with the inputs (an output equal to, inside or containing an input) is
:func:`fsdata.guards.check_output_apart`'s, called beside these checks.
"""

from __future__ import annotations

import json
import os
import re

from fstrain.errors import ConfigError

#: File names a ``--checkpoint-dir`` ``step-XXXXXXXX`` folder holds (DCP's and fstrain's).
_CHECKPOINT_FILE = re.compile(r"^(\.metadata|(__\d+)?\.metadata\.tmp|__\d+_\d+\.distcp|fstrain\.json|\.tmp-\w+)$")
#: Metrics files ``fstrain train`` writes -> columns or keys showing fstrain wrote one.
_METRICS_FILES = {"summary.json": {"measured_bubble"}, "step_times.parquet": {"step", "rank", "compute_seconds"},
                  "eval.parquet": {"step"}}
#: File outputs: kind -> JSON keys an existing file of that kind has.
_JSON_KINDS = {"cost-model": {"kind", "coefficients"}, "evaluate": {"checkpoint", "num_users"},
               "replay": {"measured_bubble", "predicted_bubble"}}
_REPORT_TITLE = "<title>fstrain report: "
_MANIFEST_NAMES = ("_manifest.json", "manifest.json")


def _refuse(flag: str, path: str, what: str, fix: str) -> None:
    raise ConfigError(f"{flag} {path} {what}; {fix}")


def _is_fsdata_output(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n)) for n in _MANIFEST_NAMES)


def is_checkpoint_folder(path: str) -> bool:
    """Whether ``path`` holds only what :func:`fstrain.components.checkpoint.save_checkpoint` writes
    (complete or cut short), so it may be replaced."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(_CHECKPOINT_FILE.match(n) and os.path.isfile(os.path.join(path, n)) for n in names)


def _check_folder(path: str, flag: str) -> bool:
    """Common folder rules; returns whether ``path`` exists."""
    if not os.path.lexists(path):
        return False
    if not os.path.isdir(path):
        _refuse(flag, path, "is a file, not a folder", "choose a new or empty folder")
    if _is_fsdata_output(path):
        _refuse(flag, path, "is an fsdata balance OUTPUT (it holds a manifest)",
                "writing there would break it: choose a folder outside every OUTPUT")
    return True


def check_checkpoint_dir(path: str, flag: str = "--checkpoint-dir") -> None:
    """Refuse a checkpoint folder that is a file, an fsdata OUTPUT, or holds a ``step-*`` entry
    fstrain did not write (it would be replaced by a checkpoint of that step).

    Raises:
        ConfigError: one line naming the entry and the fix.
    """
    if not _check_folder(path, flag):
        return
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.startswith("step-") and not (os.path.isdir(full) and is_checkpoint_folder(full)):
            _refuse(flag, path, f"holds {name}, which fstrain did not write (a checkpoint would replace it)",
                    "move it away or choose another --checkpoint-dir")


def _ours(path: str, name: str) -> bool:
    keys = _METRICS_FILES[name]
    try:
        if name.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
            return isinstance(data, dict) and keys <= set(data)
        import pyarrow.parquet as pq

        return keys <= set(pq.read_schema(path).names)
    except Exception:  # noqa: BLE001 - unreadable (OSError, bad JSON, not Parquet): not ours
        return False


def check_metrics_dir(path: str, flag: str = "--metrics-dir") -> None:
    """Refuse a metrics (or TensorBoard) folder that is a file, an fsdata OUTPUT, or holds a
    ``summary.json`` / ``step_times.parquet`` / ``eval.parquet`` fstrain did not write.

    Raises:
        ConfigError: one line naming the file and the fix.
    """
    if not _check_folder(path, flag):
        return
    for name in _METRICS_FILES:
        full = os.path.join(path, name)
        if os.path.lexists(full) and not (os.path.isfile(full) and _ours(full, name)):
            _refuse(flag, path, f"holds {name}, which fstrain did not write (a run would replace it)",
                    "move it away or choose another folder")


def check_output_file(path: str, kind: str, flag: str) -> None:
    """Refuse a file output that is a folder, or an existing file fstrain did not write as ``kind``.

    Args:
        kind: ``cost-model``, ``evaluate``, ``replay`` (JSON keys) or ``report`` (an HTML page).

    Raises:
        ConfigError: one line naming the path and the fix.
    """
    if not os.path.lexists(path):
        return
    if not os.path.isfile(path):
        _refuse(flag, path, "is a folder, not a file", "name a file inside it or another path")
    if kind == "report":
        try:
            with open(path, "rb") as f:
                head = f.read(4096).decode("utf-8", "replace")
        except OSError:
            head = ""
        ours = _REPORT_TITLE in head
        what = "an fstrain report page"
    else:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        ours = isinstance(data, dict) and _JSON_KINDS[kind] <= set(data)
        what = {"cost-model": "a cost model", "evaluate": "an evaluation result", "replay": "a replay result"}[kind]
    if not ours:
        _refuse(flag, path, f"exists and is not {what} written by fstrain", "choose another path or move it away")


__all__ = ["check_checkpoint_dir", "check_metrics_dir", "check_output_file", "is_checkpoint_folder"]
