"""Kills at every write, rename and delete point of balance and finalize on the S3 test server (issue 19).

The harness of :mod:`tests.faults` against the moto S3 server of
``test_object_store.py``: after each kill, the objects readers resolve (through ``_current.json``)
are the previous output intact or the new one complete, ``verify --input`` passes, and the next
replace removes what the killed run left.
"""

from __future__ import annotations

import pytest

pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install 'freescale[test]'")

from fsdata import fsio
from fsdata.cli import main
from tests.faults import Harness
from tests.fsdata.test_object_store import (  # noqa: F401 (fixtures)
    _local_digests,
    s3,
    s3_input,
    samples,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a few minutes on a quiet 2-core machine

# 2 ranks: every kind of write point (rank files, step stats, manifest, pointer, version prefixes)
# with half the rank-file points of test_object_store.py's 4 ranks; each point costs a killed run, a
# verify and often a restoring run on the S3 server
_BALANCE = ["--ranks", "2", "--batch-size-per-rank", "16", "--seed", "3", "--no-progress"]


@pytest.fixture(scope="module")
def local_out(samples, tmp_path_factory):
    """The reference: the same balance on local paths."""
    out = tmp_path_factory.mktemp("ref2") / "out"
    assert main(["balance", str(samples), str(out), *_BALANCE]) == 0
    return out


def test_s3_balance_killed_at_every_write_point_keeps_the_previous_output_or_the_new_one(
        s3, s3_input, local_out, tmp_path, monkeypatch):
    root = tmp_path / "w"
    (root / "tmp").mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(root / "tmp"))
    b, inp = s3_input
    out = f"s3://{b}/killed"
    previous = ["balance", inp, out, *_BALANCE, "--seed", "9", "--overwrite"]
    args = ["balance", inp, out, *_BALANCE, "--num-threads", "1", "--overwrite"]

    def current():  # the objects readers resolve, a killed run's version prefix aside
        d = s3.digests(fsio.resolve_pointer(out)[len("s3://"):])
        return {k: v for k, v in d.items() if not k.startswith(("_versions/", "_current.json"))}

    assert main(previous) == 0
    before, new = current(), _local_digests(local_out)
    h = Harness(root, tmp_path)  # after the s3 fixture set the endpoint variables
    try:
        points = h.points(args)
        assert current() == new
        survivors = {"previous": 0, "new": 0}
        for k in range(1, len(points) + 1):
            if current() != before:
                assert main(previous) == 0
            rc, passed = h.run(args, k)
            # a replace over a previous output that is itself a replaced one removes one more version
            # prefix than the counting run did, so a run may finish before its last points
            assert rc == 9 or (rc == 0 and len(passed) < k), f"point {k} ({points[k - 1]}): exit {rc}"
            now = current()
            assert now in (before, new), f"killed at point {k} ({points[k - 1]}): the output is neither the " \
                                         "previous one nor the new one"
            survivors["previous" if now == before else "new"] += 1
            assert main(["verify", out, "--input", inp, "--no-progress"]) == 0, points[k - 1]
        assert survivors["previous"] and survivors["new"], survivors
        assert main(args) == 0  # the next replace cleans up after every killed run
        assert current() == new
        assert {k.split("/")[0] for k in s3.keys(f"{b}/killed")} == {"_current.json", "_versions"}
        assert len({k.split("/")[0] for k in s3.keys(f"{b}/killed/_versions")}) == 1
        # our temporaries (fsdata-*) are gone; the in-process S3 test server may keep its own there
        assert not [p.name for p in (root / "tmp").iterdir() if p.name.startswith("fsdata-")]
    finally:
        h.close()


def test_s3_finalize_rerun_killed_at_every_write_point_leaves_a_complete_output(
        s3, s3_input, local_out, tmp_path, monkeypatch):
    """The stages on S3 (plan, write, finalize), then ``finalize`` re-run and killed at each point: the
    finalized output readers see stays the complete one, verifies, and the next finalize succeeds."""
    root = tmp_path / "w"
    (root / "tmp").mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(root / "tmp"))
    b, inp = s3_input
    plan, out = f"s3://{b}/fplan.parquet", f"s3://{b}/finalized"
    assert main(["plan", inp, plan, *_BALANCE]) == 0
    assert main(["write", inp, plan, out, "--no-progress"]) == 0
    assert main(["finalize", out, "--plan", plan, "--no-progress"]) == 0
    want = _local_digests(local_out)

    def current():
        d = s3.digests(fsio.resolve_pointer(out)[len("s3://"):])
        return {k: v for k, v in d.items() if not k.startswith(("_versions/", "_current.json"))}

    assert current() == want
    args = ["finalize", out, "--plan", plan, "--no-progress"]
    h = Harness(root, tmp_path)
    try:
        points = h.points(args)
        assert points, "a finalize re-run changes nothing on the store: nothing to kill"
        assert current() == want  # a re-run writes the same output
        for k in range(1, len(points) + 1):
            rc, passed = h.run(args, k)
            assert rc == 9 or (rc == 0 and len(passed) < k), f"point {k} ({points[k - 1]}): exit {rc}"
            assert current() == want, f"killed at point {k} ({points[k - 1]}): the output changed"
            assert main(["verify", out, "--input", inp, "--no-progress"]) == 0, points[k - 1]
            assert main(args) == 0, f"the finalize after a kill at {points[k - 1]} failed"
            assert current() == want
        assert not [p.name for p in (root / "tmp").iterdir() if p.name.startswith("fsdata-")]
    finally:
        h.close()
