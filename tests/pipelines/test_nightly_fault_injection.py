"""Kills the nightly job at every write, rename and delete point (issue 19).

The harness of :mod:`tests.faults` counts every point where ``python -m pipelines.nightly`` changes
the work folder (the lock and its holder, the input snapshot, convert, profile, balance, verify, the
report, ``_SUCCESS``, the rename or exchange of the run, the publish of ``latest``, the history,
the removal of old runs) and kills the run at point ``k``; each test runs ``k`` over the points of a
complete run and checks after each kill that ``latest`` names a complete run -- the previously
published one intact or the new one complete -- whose shards pass ``fsdata verify --input``, and that
the next run succeeds, publishes the new run and leaves nothing of the killed one behind (that
recovery run after every kill from the run's ``_SUCCESS`` on, where publish, history and cleanup
happen, and after every 6th kill before it: each recovery is a whole nightly run). Named-point
kill tests with the reason for each case live in ``test_nightly_safety.py``; this file checks that no
point was missed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fsdata.cli import main as fsdata_main
from pipelines import nightly
from tests.faults import Harness, digests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a few minutes on a quiet 2-core machine

_JOB = ["--format", "sequences", "--samples", "per-user", "--batch-size-per-rank", "4", "--partitioner",
        "lpt-swap", "--no-progress", "--num-threads", "1", "--keep-runs", "1"]


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """The counted folder: ``seq.txt`` (a small sequences log), ``work/`` (the job's) and ``tmp/`` (TMPDIR)."""
    root = tmp_path / "w"
    (root / "tmp").mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(root / "tmp"))
    rng = np.random.default_rng(0)
    (root / "seq.txt").write_text("".join(
        " ".join(map(str, [u, *rng.integers(1, 500, size=int(rng.integers(2, 30)))])) + "\n" for u in range(160)))
    return root


def _args(root: Path, ranks: int) -> list[str]:
    return ["--input", str(root / "seq.txt"), "--output", str(root / "work"), "--ranks", str(ranks), *_JOB]


def _latest(work: Path) -> Path:
    return Path(os.path.realpath(work / "latest"))


def _verified(run: Path) -> bool:
    """The run's shards pass ``fsdata verify --input`` against the samples it was built from."""
    return fsdata_main(["verify", str(run / "shards"), "--input", str(run / "samples.parquet"), "--no-progress"]) == 0


def _recovers(h: Harness, root: Path, args: list[str], new_shards: dict[str, str], where: str) -> None:
    """The next run succeeds, publishes the complete new run and leaves nothing of a killed run behind."""
    work = root / "work"
    rc, _ = h.run(args, 0, entry="nightly")
    assert rc == 0, f"the run after a kill at {where} failed"
    run = _latest(work)
    assert nightly.check_run(run) is None and digests(run / "shards") == new_shards, where
    assert sorted(p.name for p in work.iterdir()) == [".nightly.lock", "history.jsonl", "latest", "runs"], where
    assert [p.name for p in (work / "runs").iterdir()] == [run.name], where  # --keep-runs 1, no .tmp/.old left
    last = json.loads((work / "history.jsonl").read_text().splitlines()[-1])
    assert last["run_key"] == run.name and not last["rollback"], f"{where}: history does not record the publish"
    assert not [p.name for p in (root / "tmp").iterdir() if p.name.startswith("fsdata-")], where


def _kill_everywhere(h: Harness, root: Path, args: list[str], *, first: int = 1,
                     aside_ok: bool = False) -> dict[str, int]:
    """Kill ``nightly ARGS`` at points ``first .. N`` over a copy of the work folder as it is now.

    ``aside_ok``: a kill between the two renames of the fallback rebuild (no atomic exchange) may leave
    ``latest`` naming nothing while the previous run lies intact at ``runs/.<key>.old-*``, which the
    next run moves back first (``pipelines.nightly.store.swap_in``); with an exchange it may not.

    Returns:
        How many kills left the previous run published, the new one, or (``aside_ok``) the previous
        one aside.
    """
    work, pristine = root / "work", root.parent / "pristine"
    shutil.copytree(work, pristine, symlinks=True)
    previous = _latest(work)
    before = digests(previous)
    points = h.points(args, entry="nightly")
    new_run = _latest(work)
    assert new_run.name != previous.name or digests(new_run) != before
    new_shards = digests(new_run / "shards")
    survivors = {"previous": 0, "new": 0, "aside": 0}
    complete = _success_point(points)
    for k in range(first, len(points) + 1):
        where = f"point {k} ({points[k - 1].replace(str(root), '')})"
        shutil.rmtree(work)
        shutil.copytree(pristine, work, symlinks=True)
        rc, _ = h.run(args, k, entry="nightly")
        assert rc == 9, f"{where}: exit {rc}"
        run = _latest(work)
        aside = list((work / "runs").glob(f".{previous.name}.old-*"))
        if not run.is_dir() and aside_ok and len(aside) == 1 and digests(aside[0]) == before:
            survivors["aside"] += 1
            run = aside[0]
        elif not run.is_dir():
            raise AssertionError(f"killed at {where}: latest names no run")
        elif run.name == previous.name and digests(run) == before:
            survivors["previous"] += 1
        else:
            assert run.name == new_run.name and nightly.check_run(run) is None, \
                f"killed at {where}: latest is neither the previous run intact nor the new one complete"
            assert digests(run / "shards") == new_shards, where
            survivors["new"] += 1
        assert _verified(run), where
        if k >= complete or k % 6 == 0 or k == first:
            _recovers(h, root, args, new_shards, where)
        print(f"{where}: {survivors}", flush=True)  # progress (shown with -s, and on a failure)
    shutil.rmtree(pristine)
    return survivors


def _success_point(points: list[str]) -> int:
    """The point (1-based) that renames the run's ``_SUCCESS`` into place."""
    done = [i for i, p in enumerate(points, 1)
            if p.startswith("os.rename") and p.endswith(f".{nightly.SUCCESS_NAME}.tmp")]
    assert len(done) == 1, points
    return done[0]


def _first_after_complete(h: Harness, root: Path, args: list[str]) -> int:
    """The first point after the run's ``_SUCCESS`` is in place (where a rebuild starts to differ from a new run)."""
    work, probe = root / "work", root.parent / "probe"
    shutil.copytree(work, probe, symlinks=True)
    points = h.points(args, entry="nightly")
    shutil.rmtree(work)
    probe.rename(work)
    return _success_point(points) + 1


def test_new_run_killed_at_every_point_keeps_latest_complete(root, tmp_path):
    h = Harness(root, tmp_path)
    try:
        assert h.run(_args(root, 2), 0, entry="nightly")[0] == 0  # the published run: other settings
        survivors = _kill_everywhere(h, root, _args(root, 4))
    finally:
        h.close()
    assert survivors["previous"] and survivors["new"], survivors  # both sides of the publish were hit


@pytest.mark.parametrize("no_exchange", [False, True], ids=["exchange", "two-renames"])
def test_rebuild_killed_at_every_point_keeps_latest_complete(root, tmp_path, no_exchange):
    """A published run whose files changed is rebuilt in place: with ``renameat2(RENAME_EXCHANGE)`` and
    with the two-rename fallback of file systems without it. The points before the rebuilt run is
    complete are those of a new run (the test above); here every point from there on is killed."""
    h = Harness(root, tmp_path, no_exchange=no_exchange)
    try:
        args = _args(root, 4)
        assert h.run(args, 0, entry="nightly")[0] == 0
        profile = _latest(root / "work") / "profile.json"
        profile.write_text(profile.read_text() + " ")  # a published run whose files no longer match
        assert nightly.check_run(_latest(root / "work")) is not None
        survivors = _kill_everywhere(h, root, args, first=_first_after_complete(h, root, args),
                                     aside_ok=no_exchange)
    finally:
        h.close()
    assert survivors["previous"] and survivors["new"], survivors
    assert survivors["aside"] == (1 if no_exchange else 0), survivors  # the one kill between the two renames


def test_rollback_killed_at_every_point_keeps_latest_complete(root, tmp_path):
    h = Harness(root, tmp_path)
    work = root / "work"
    try:
        assert h.run([*_args(root, 2), "--keep-runs", "2"], 0, entry="nightly")[0] == 0
        old = _latest(work).name
        assert h.run([*_args(root, 4), "--keep-runs", "2"], 0, entry="nightly")[0] == 0
        new = _latest(work).name
        pristine = tmp_path / "pristine"
        shutil.copytree(work, pristine, symlinks=True)
        args = ["--output", str(work), "--rollback", old]
        points = h.points(args, entry="nightly")
        seen = set()
        for k in range(1, len(points) + 1):
            where = f"point {k} ({points[k - 1].replace(str(root), '')})"
            shutil.rmtree(work)
            shutil.copytree(pristine, work, symlinks=True)
            assert h.run(args, k, entry="nightly")[0] == 9, where
            run = _latest(work)
            assert run.name in (old, new) and nightly.check_run(run) is None and _verified(run), where
            seen.add(run.name)
            assert h.run(args, 0, entry="nightly")[0] == 0, where
            assert _latest(work).name == old and nightly.check_run(_latest(work)) is None, where
            assert sorted(p.name for p in work.iterdir()) == [".nightly.lock", "history.jsonl", "latest", "runs"]
            assert json.loads((work / "history.jsonl").read_text().splitlines()[-1]) | {"published_unix_ns": 0} \
                == {"run_key": old, "rollback": True, "published_unix_ns": 0,
                    "created_unix_ns": nightly.store.created_ns(_latest(work))}, where
    finally:
        h.close()
    assert seen == {old, new}, seen
