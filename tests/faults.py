"""Kill a command at every point where it changes storage (issue 19): the harness of the fault-injection tests.

A harness process imports fsdata and the nightly job once and forks one run per request. It counts every
point where the run changes storage: file opens for writing, renames, removals, symlinks and folder
creations under the test's folder (Python audit events), the Parquet and Arrow IPC writers, fsio's
object-store writes and deletes, and the atomic exchange. The forked run is killed (``os._exit(9)``) at
point ``k``; a test runs ``k = 1 .. N`` for the ``N`` points of a complete run and checks what readers see
after each kill. Used by ``tests/fsdata/test_fault_injection*.py`` (balance, finalize) and
``tests/pipelines/test_nightly_fault_injection.py`` (the nightly job).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import fsdata

_HARNESS = r"""
import os, sys
root = os.environ["KILL_ROOT"]
kill_at, points = 0, []
def hit(label):
    points.append(label)
    if len(points) == kill_at:
        os._exit(9)
def under_root(p):
    try:
        return os.path.abspath(os.fsdecode(p)).startswith(root)
    except TypeError:
        return False
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def audit(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & _WRITE)
        if writing and under_root(path):
            hit(f"open {path}")
    elif event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate") and args \
            and under_root(args[0]):
        hit(f"{event} {args[0]}")
    elif event in ("os.symlink", "os.link") and len(args) > 1 and under_root(args[1]):  # (target, link name)
        hit(f"{event} {args[1]}")
sys.addaudithook(audit)

import pyarrow as pa, pyarrow.parquet as pq
from fsdata import atomic, fsio
def counted(label, fn):
    def wrapper(*a, **k):
        hit(label)
        out = fn(*a, **k)
        hit(label + " done")
        return out
    return wrapper
pq.write_table = counted("pq.write_table", pq.write_table)
class ParquetWriter(pq.ParquetWriter):
    def __init__(self, *a, **k):
        hit("ParquetWriter open")
        super().__init__(*a, **k)
    def write_table(self, *a, **k):
        hit("ParquetWriter.write_table")
        return super().write_table(*a, **k)
    def close(self):
        hit("ParquetWriter.close")
        return super().close()
pq.ParquetWriter = ParquetWriter
pa.ipc.new_file = counted("ipc.new_file", pa.ipc.new_file)
for name in ("write_bytes", "delete"):
    setattr(fsio, name, counted(f"fsio.{name}", getattr(fsio, name)))
if os.environ.get("KILL_NO_EXCHANGE"):  # a file system without renameat2(RENAME_EXCHANGE): callers fall back
    atomic.exchange = lambda a, b: False
for name in ("exchange", "remove_remote"):
    if hasattr(atomic, name):
        setattr(atomic, name, counted(f"atomic.{name}", getattr(atomic, name)))
# imported after the patches, so modules that bind these names at import get the counted ones
from fsdata.cli import main as fsdata_main
from pipelines.nightly import main as nightly_main
import pyarrow.dataset  # imported once here rather than in every forked run (fsio's input scans; about 0.4 s each)
try:  # the nightly job's report plots, likewise
    import fsdata.common.page
    fsdata.common.page.pyplot()
except ImportError:
    pass
else:  # the report's figures drawn once per distinct output: each killed or recovering nightly run re-renders the
    # same PNG bytes (matplotlib, about 5 s a run); a run still writes every file and passes every point itself
    import hashlib, pickle
    from fsdata import report as _report
    _draw, _drawn = _report.output_figures, os.environ["KILL_FIGURES"]
    def output_figures(d):
        key = hashlib.sha256(pickle.dumps(d, protocol=5)).hexdigest()
        path = os.path.join(_drawn, key)
        if os.path.exists(path):
            with open(path, "rb") as f:
                return pickle.load(f)
        figures = _draw(d)
        with open(f"{path}.{os.getpid()}", "wb") as f:
            pickle.dump(figures, f)
        os.replace(f"{path}.{os.getpid()}", path)
        return figures
    _report.output_figures = output_figures
entries = {"fsdata": fsdata_main, "nightly": nightly_main}

# one request per stdin line: "K COUNT_FILE ENTRY ARGS..." -> a forked child runs `ENTRY ARGS` killed at
# point K (0: never) and writes the points it passed to COUNT_FILE; the reply is its exit status
for line in sys.stdin:
    k, count_file, entry, *args = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the reply channel is the parent's alone
        os.dup2(devnull, 2)  # log lines of hundreds of runs would fill a pipe nobody reads
        kill_at, points = int(k), []
        rc = 1
        try:
            rc = entries[entry](args)
        finally:
            with open(count_file, "w") as f:
                f.write("\n".join(points))
            os._exit(rc)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Harness:
    """A process that imports fsdata once and forks one killed run per request (see ``_HARNESS``).

    Args:
        root: the folder whose changes are counted (an absolute path; also ``TMPDIR`` is ``root/tmp``,
            which must exist).
        cwd: the harness's working folder.
        no_exchange: make :func:`fsdata.atomic.exchange` report no atomic exchange (the two-rename fallback).
    """

    def __init__(self, root: Path, cwd: Path, *, no_exchange: bool = False) -> None:
        repo = str(Path(fsdata.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
               "KILL_ROOT": str(root), "TMPDIR": str(root / "tmp"), "PYTHONDONTWRITEBYTECODE": "1",
               "KILL_FIGURES": str(cwd / "harness-figures")}  # outside root: not counted
        if no_exchange:
            env["KILL_NO_EXCHANGE"] = "1"
        (cwd / "harness-figures").mkdir(exist_ok=True)
        if str(cwd / "harness-figures").startswith(str(root)):
            raise ValueError(f"the harness's figure cache {cwd}/harness-figures would lie under the counted {root}")
        self.root = root
        self._log = open(root.parent / "harness.log", "w+")  # closed in close()
        self.proc = subprocess.Popen([sys.executable, "-c", _HARNESS], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)

    def run(self, args: list[str], kill_at: int, *, entry: str = "fsdata") -> tuple[int, list[str]]:
        """``ENTRY ARGS`` (``fsdata`` or ``nightly``) killed at point ``kill_at`` (0: never): (exit code,
        points passed)."""
        count = self.root.parent / f"points-{kill_at}.txt"
        self.proc.stdin.write("\t".join([str(kill_at), str(count), entry, *args]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self._log.seek(0)
            raise AssertionError(f"the harness died: {self._log.read()[-2000:]}")
        points = count.read_text().splitlines() if count.exists() else []
        count.unlink(missing_ok=True)
        return int(line), points

    def points(self, args: list[str], *, entry: str = "fsdata") -> list[str]:
        """The points of a complete run of ``ENTRY ARGS`` (which must succeed and pass at least 5)."""
        rc, points = self.run(args, 0, entry=entry)
        assert rc == 0, f"{entry} {args[0]} failed under the harness"
        assert len(points) >= 5, f"the harness saw only {points}: it no longer reaches the write points"
        return points

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._log.close()


def digests(root: Path, *, visible: bool = False) -> dict[str, str]:
    """sha256 per file under ``root``; ``visible``: only what folder readers read (no hidden entries)."""
    files = (p for p in sorted(root.rglob("*")) if p.is_file())
    if visible:
        files = (p for p in files if not any(part.startswith((".", "_tmp")) for part in p.relative_to(root).parts))
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
