"""Kills at every write, rename and delete point of balance and finalize (issue 19).

The harness of :mod:`tests.faults` counts every point where a stage changes storage and kills the
run at point ``k``; the test runs ``k = 1 .. N`` for the ``N`` points of a complete run and checks
after each kill that readers see the previous output intact or the
new one complete (``verify --input`` passes), and that the next run cleans up after the killed one.
Named-point kill tests with the reasons for each survivor live in ``test_safety_paths.py`` and
``test_safety_s3.py``; this file checks that no point was missed.
"""

from __future__ import annotations

import shutil

import pytest

from fsdata.cli import main
from tests.faults import Harness
from tests.faults import digests as _digests
from tests.fsdata.helpers import write_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a few minutes on a quiet 2-core machine

# 2 ranks: every kind of write point (rank folders and files, step stats, manifest, the exchange) with
# half the rank-file points of 4; each point costs a killed run, a verify and a recovering run
_BALANCE = ["--ranks", "2", "--batch-size-per-rank", "16", "--no-progress", "--num-threads", "1"]


@pytest.fixture
def harness(tmp_path, monkeypatch):
    root = tmp_path / "w"
    (root / "tmp").mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(root / "tmp"))
    h = Harness(root, tmp_path)
    yield h
    h.close()


def test_balance_killed_at_every_write_point_keeps_the_previous_output_or_the_new_one(tmp_path, harness):
    root = harness.root
    inp = write_samples(root / "in.parquet", n=500)
    out, ref, previous = root / "out", tmp_path / "ref", tmp_path / "previous"
    assert main(["balance", str(inp), str(ref), *_BALANCE, "--seed", "3"]) == 0
    assert main(["balance", str(inp), str(previous), *_BALANCE, "--seed", "9"]) == 0
    before, new = _digests(previous), _digests(ref)
    args = ["balance", str(inp), str(out), *_BALANCE, "--seed", "3", "--overwrite"]
    shutil.copytree(previous, out)
    points = harness.points(args)
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
    points = harness.points(args)
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

