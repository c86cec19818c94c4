"""Data safety on local paths (issue 19): every spelling of the input is refused as an output."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from fsdata.cli import main
from tests.fsdata.helpers import write_samples

def _run_py(code: str, *args, cwd) -> "subprocess.CompletedProcess":
    """``python -c code args`` importing this checkout's fsdata (the one the tests import)."""
    import os
    import subprocess
    import sys

    import fsdata

    root = str(Path(fsdata.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True)


_BALANCE = ["--ranks", "4", "--batch-size-per-rank", "16", "--seed", "3", "--no-progress"]


def _digests(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("spelling, how", [
    ("{t}/other/../in", "same path"), ("{t}/in/.", "same path"), ("{t}//in", "same path"), ("{t}/in/", "same path"),
    ("{t}/in/./out", "lies inside"), ("{t}/in//out", "lies inside"), ("file://{t}/x/../in/out/", "lies inside"),
])
def test_output_spellings_of_the_input_are_refused_locally(tmp_path, capsys, spelling, how):
    inp = write_samples(tmp_path / "in", n=300, num_files=2)
    (tmp_path / "other").mkdir()
    (tmp_path / "x").mkdir()
    before = _digests(inp)
    capsys.readouterr()
    assert main(["balance", str(inp), spelling.format(t=tmp_path), *_BALANCE, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert how in err and len(err.splitlines()) == 1
    assert _digests(inp) == before


_KILL_SECOND_RENAME = r"""
import os, sys
from pathlib import Path
from fsdata import atomic
atomic.exchange = lambda a, b: False          # the two-rename fallback
real, calls = os.replace, []
def replace(a, b):
    calls.append(1)
    if len(calls) == 2:                       # killed between moving the old output aside and the new one in
        os._exit(9)
    return real(a, b)
os.replace = replace
with atomic.atomic_output(sys.argv[1], overwrite=True) as tmp:
    (Path(tmp) / "new.txt").write_text("new")
"""


def test_kill_between_the_renames_of_a_local_replace_keeps_the_previous_output(tmp_path):
    from fsdata.atomic import atomic_output

    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    (final / "_manifest.json").write_text("{}")  # a FreeScale output: --overwrite replaces only those
    r = _run_py(_KILL_SECOND_RENAME, final, cwd=tmp_path)
    assert r.returncode == 9 and not final.exists()  # the kill point: the previous output lies aside
    with pytest.raises(Exception, match="already exists"):  # the next run puts it back first
        with atomic_output(final):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (final / "old.txt").read_text() == "old"


def test_local_replace_is_one_exchange(tmp_path, monkeypatch):
    from fsdata import atomic

    final = tmp_path / "out"
    final.mkdir()
    (final / "_manifest.json").write_text("{}")  # a FreeScale output: --overwrite replaces only those
    seen = []
    real = atomic.exchange
    monkeypatch.setattr(atomic, "exchange", lambda a, b: seen.append(real(a, b)) or seen[-1])
    with atomic.atomic_output(final, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert seen in ([True], [False])  # True where the file system has renameat2(RENAME_EXCHANGE)


_FINALIZE_UNDER_FSIZE = r"""
import resource, signal, sys
from fsdata.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))
sys.exit(main(["finalize", sys.argv[1], "--plan", sys.argv[2], "--no-progress"]))
"""


def test_finalize_rerun_that_fails_leaves_the_previous_complete_output(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=300)
    plan, out = tmp_path / "plan.parquet", tmp_path / "out"
    assert main(["plan", str(inp), str(plan), *_BALANCE]) == 0
    assert main(["write", str(inp), str(plan), str(out), "--no-progress"]) == 0
    assert main(["finalize", str(out), "--plan", str(plan), "--no-progress"]) == 0
    before = _digests(out)
    r = _run_py(_FINALIZE_UNDER_FSIZE, out, plan, cwd=tmp_path)
    assert r.returncode == 2 and "file too large" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _digests(out) == before and sorted(p.name for p in out.iterdir() if p.name.startswith("."))== []
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0


_KILL_LOCAL = r"""
import os, shutil, sys
from fsdata import atomic
from fsdata.cli import main
from fsdata.shards import finalize, writer
point = sys.argv[1]
die = lambda: os._exit(9)
real_rank, real_exchange, real_stats = writer.write_rank, atomic.exchange, finalize.write_step_stats
def write_rank(rank, *a, **k):
    if point == "rank" and rank == 2:
        die()
    return real_rank(rank, *a, **k)
def write_step_stats(*a, **k):
    if point == "finalize":
        die()
    return real_stats(*a, **k)
def exchange(a, b):
    if point == "before-exchange":
        die()
    done = real_exchange(a, b)
    if point == "after-exchange":
        die()
    return done
writer.write_rank, finalize.write_step_stats, atomic.exchange = write_rank, write_step_stats, exchange
sys.exit(main(["balance", *sys.argv[2:], "--num-threads", "1", "--overwrite"]))
"""


@pytest.mark.parametrize("point, survivor", [("rank", "previous"), ("finalize", "previous"),
                                             ("before-exchange", "previous"), ("after-exchange", "new")])
def test_kill_at_each_point_of_a_local_replace(tmp_path, point, survivor):
    inp = write_samples(tmp_path / "in.parquet", n=700)
    out, ref = tmp_path / "out", tmp_path / "ref"
    assert main(["balance", str(inp), str(ref), *_BALANCE]) == 0
    assert main(["balance", str(inp), str(out), *_BALANCE[:-3], "--seed", "9", "--no-progress"]) == 0
    before = _digests(out)
    r = _run_py(_KILL_LOCAL, point, inp, out, *_BALANCE, cwd=tmp_path)
    assert r.returncode == 9, r.stderr
    assert _digests(out) == (before if survivor == "previous" else _digests(ref))
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0
    assert main(["balance", str(inp), str(out), *_BALANCE, "--overwrite"]) == 0  # the next run cleans up
    assert _digests(out) == _digests(ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "out", "ref"]
