"""Kills at every write, rename and delete point of balance and finalize (issue 19).

A harness (run as a subprocess) counts every point where a stage changes storage: file opens for
writing, renames, removals and folder creations under the test's folder (Python audit events), the
Parquet and Arrow IPC writers, fsio's object-store writes and deletes, and the atomic exchange. It
kills the process (``os._exit(9)``) at point ``k``; the test runs ``k = 1 .. N`` for the ``N`` points
of a complete run and checks after each kill that readers see the previous output intact or the
new one complete (``verify --input`` passes), and that the next run cleans up after the killed one.
Named-point kill tests with the reasons for each survivor live in ``test_safety_paths.py`` and
``test_safety_s3.py``; this file checks that no point was missed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fsdata
from fsdata.cli import main
from tests.fsdata.helpers import write_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a few minutes on a quiet 2-core machine

_BALANCE = ["--ranks", "4", "--batch-size-per-rank", "16", "--no-progress", "--num-threads", "1"]

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
for name in ("exchange", "remove_remote"):
    if hasattr(atomic, name):
        setattr(atomic, name, counted(f"atomic.{name}", getattr(atomic, name)))
from fsdata.cli import main

# one request per stdin line: "K COUNT_FILE ARGS..." -> a forked child runs `fsdata ARGS` killed at point K
# (0: never) and writes the points it passed to COUNT_FILE; the reply is its exit status
for line in sys.stdin:
    k, count_file, *args = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the reply channel is the parent's alone
        kill_at, points = int(k), []
        rc = 1
        try:
            rc = main(args)
        finally:
            with open(count_file, "w") as f:
                f.write("\n".join(points))
            os._exit(rc)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Harness:
    """A process that imports fsdata once and forks one killed run per request (see ``_HARNESS``)."""

    def __init__(self, root: Path, cwd: Path) -> None:
        repo = str(Path(fsdata.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
               "KILL_ROOT": str(root), "TMPDIR": str(root / "tmp"), "PYTHONDONTWRITEBYTECODE": "1"}
        self.root = root
        self.proc = subprocess.Popen([sys.executable, "-c", _HARNESS], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, args: list[str], kill_at: int) -> tuple[int, list[str]]:
        """``fsdata ARGS`` killed at point ``kill_at`` (0: never): (exit code, points passed)."""
        count = self.root.parent / f"points-{kill_at}.txt"
        self.proc.stdin.write("\t".join([str(kill_at), str(count), *args]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the harness died: {self.proc.stderr.read()[-2000:]}"
        points = count.read_text().splitlines() if count.exists() else []
        count.unlink(missing_ok=True)
        return int(line), points

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture
def harness(tmp_path, monkeypatch):
    root = tmp_path / "w"
    (root / "tmp").mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(root / "tmp"))
    h = Harness(root, tmp_path)
    yield h
    h.close()


def _digests(root: Path, *, visible: bool = False) -> dict[str, str]:
    """sha256 per file under ``root``; ``visible``: only what folder readers read (no hidden entries)."""
    files = (p for p in sorted(root.rglob("*")) if p.is_file())
    if visible:
        files = (p for p in files if not any(part.startswith((".", "_tmp")) for part in p.relative_to(root).parts))
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _points(h: Harness, args: list[str]) -> list[str]:
    rc, points = h.run(args, 0)
    assert rc == 0, f"fsdata {args[0]} failed under the harness"
    assert len(points) >= 5, f"the harness saw only {points}: it no longer reaches the write points"
    return points


def test_balance_killed_at_every_write_point_keeps_the_previous_output_or_the_new_one(tmp_path, harness):
    root = harness.root
    inp = write_samples(root / "in.parquet", n=500)
    out, ref, previous = root / "out", tmp_path / "ref", tmp_path / "previous"
    assert main(["balance", str(inp), str(ref), *_BALANCE, "--seed", "3"]) == 0
    assert main(["balance", str(inp), str(previous), *_BALANCE, "--seed", "9"]) == 0
    before, new = _digests(previous), _digests(ref)
    args = ["balance", str(inp), str(out), *_BALANCE, "--seed", "3", "--overwrite"]
    shutil.copytree(previous, out)
    points = _points(harness, args)
    assert _digests(out) == new
    survivors = {"previous": 0, "new": 0}
    for k in range(1, len(points) + 1):
        shutil.rmtree(out)
        shutil.copytree(previous, out)
        rc, _ = harness.run(args, k)
        assert rc == 9, f"point {k} ({points[k - 1]}): exit {rc}"
        now = _digests(out) if out.exists() else None
        assert now in (before, new), f"killed at point {k} ({points[k - 1]}): the output is neither the " \
                                     "previous one nor the new one"
        survivors["previous" if now == before else "new"] += 1
        assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0, points[k - 1]
        assert main(args) == 0, f"the run after a kill at {points[k - 1]} failed"  # and cleans up after it
        assert _digests(out) == new
        assert sorted(p.name for p in root.iterdir()) == ["in.parquet", "out", "tmp"], points[k - 1]
        # our temporaries are gone (Python's tempfile probes TMPDIR with a random file on first use: not ours)
        assert not [p.name for p in (root / "tmp").iterdir() if p.name.startswith("fsdata-")], \
            f"leftovers after a kill at {points[k - 1]}"
    assert survivors["previous"] and survivors["new"], survivors  # both sides of the switch were hit


def test_finalize_rerun_killed_at_every_write_point_leaves_a_complete_output(tmp_path, harness):
    root = harness.root
    inp = write_samples(root / "in.parquet", n=500)
    plan, out, pristine = root / "plan.parquet", root / "out", tmp_path / "pristine"
    assert main(["plan", str(inp), str(plan), *_BALANCE[:-2], "--seed", "3"]) == 0
    assert main(["write", str(inp), str(plan), str(out), "--no-progress"]) == 0
    assert main(["finalize", str(out), "--plan", str(plan), "--no-progress"]) == 0
    shutil.copytree(out, pristine)
    before = _digests(out)
    args = ["finalize", str(out), "--plan", str(plan), "--no-progress"]
    points = _points(harness, args)
    assert _digests(out) == before  # a re-run writes the same output
    for k in range(1, len(points) + 1):
        rc, _ = harness.run(args, k)
        assert rc == 9, f"point {k} ({points[k - 1]}): exit {rc}"
        assert _digests(out, visible=True) == _digests(pristine, visible=True), \
            f"killed at point {k} ({points[k - 1]}): the output changed"
        assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0, points[k - 1]
        assert main(args) == 0, f"the finalize after a kill at {points[k - 1]} failed"
        assert _digests(out) == before
        assert sorted(p.name for p in root.iterdir()) == ["in.parquet", "out", "plan.parquet", "tmp"], points[k - 1]
        if _digests(out) != _digests(pristine):
            shutil.rmtree(out)
            shutil.copytree(pristine, out)

