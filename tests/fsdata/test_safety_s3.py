"""Data safety on object stores (issue 19): URI spellings, replace-never-delete-first, error lines.

Runs against the same moto S3 server as ``test_object_store.py`` (its fixtures are imported here).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install 'freescale[test]'")

from fsdata import fsio
from fsdata.cli import main
from fsdata.guards import overlap
from tests.fsdata.test_object_store import (  # noqa: F401 (fixtures)
    _BALANCE,
    _local_digests,
    local_out,
    s3,
    s3_input,
    samples,
)


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("spelling, how", [
    ("s3://{b}/other/../in", "same path"),
    ("s3://{b}/in/.", "same path"),
    ("s3://{b}//in", "same path"),
    ("s3://{b}/in/", "same path"),
    ("s3://{b}/in/./out", "lies inside"),
    ("s3://{b}/in//out", "lies inside"),
    ("s3://{b}/x/../in/out/", "lies inside"),
])
def test_output_spellings_of_the_input_are_refused_on_s3(s3, s3_input, capsys, spelling, how):
    b, inp = s3_input
    before = s3.digests(f"{b}/in")
    capsys.readouterr()
    assert main(["balance", inp, spelling.format(b=b), *_BALANCE, "--overwrite"]) == 2
    err = _err_line(capsys)
    assert how in err and "INPUT" in err
    assert s3.digests(f"{b}/in") == before  # nothing written into or deleted from the input


@pytest.mark.parametrize("spelling", ["s3://{b}/keep/..", "s3://{b}/.", "s3://{b}//", "s3://{b}/a/./../"])
def test_bucket_root_output_is_refused_however_spelt(s3, s3_input, capsys, spelling):
    b, inp = s3_input
    with s3.fs.open_output_stream(f"{b}/keep/notes.txt") as f:
        f.write(b"keep me")
    capsys.readouterr()
    assert main(["balance", inp, spelling.format(b=b), *_BALANCE, "--overwrite"]) == 2
    err = _err_line(capsys)
    assert "whole bucket" in err
    assert s3.keys(f"{b}/keep") == ["notes.txt"] and len(s3.keys(f"{b}/in")) == 3


def test_uri_above_the_bucket_is_one_line(s3, s3_input, capsys):
    b, inp = s3_input
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/../other/out", *_BALANCE]) == 2
    assert "climbs above the bucket" in _err_line(capsys)


def test_overlap_normalises_keys():
    assert fsio.normalize("s3://b/x/../in/?region=us-east-1") == "s3://b/in?region=us-east-1"
    assert fsio.normalize("hdfs://h:9/a/./b//c/") == "hdfs://h:9/a/b/c"


def test_overlap_on_normalised_keys_on_s3(s3, s3_input):
    b, _ = s3_input
    assert overlap(f"s3://{b}/other/../in", f"s3://{b}/in") == "is"
    assert overlap(f"s3://{b}//in//out", f"s3://{b}/in/") == "lies inside"
    assert overlap(f"s3://{b}/in/..", f"s3://{b}/in") == "contains"
    assert overlap(f"s3://{b}/in/../inn", f"s3://{b}/in") is None


def test_write_and_plan_refuse_spellings_of_their_inputs(s3, s3_input, capsys):
    b, inp = s3_input
    plan = f"s3://{b}/plan.parquet"
    assert main(["plan", inp, plan, *_BALANCE]) == 0
    capsys.readouterr()
    assert main(["plan", inp, f"s3://{b}/x/../in/plan.parquet", *_BALANCE]) == 2
    assert "lies inside INPUT" in _err_line(capsys)
    assert main(["write", inp, plan, f"s3://{b}/in/sub/..", "--no-progress", "--overwrite"]) == 2
    assert "same path" in _err_line(capsys)
    assert len(s3.keys(f"{b}/in")) == 3


# ---- replace, never delete first ------------------------------------------------------------------

def _current(s3, prefix: str) -> str:
    """``bucket/prefix/_versions/<id>`` named by the pointer object, checked to be the only version."""
    import json

    with s3.fs.open_input_stream(f"{prefix}/_current.json") as f:
        target = json.loads(f.read())["target"]
    assert {k.split("/")[0] for k in s3.keys(f"{prefix}/_versions")} == {target.split("/")[1]}
    return f"{prefix}/{target}"


def test_overwrite_that_fails_while_writing_keeps_the_previous_output(s3, s3_input, local_out, monkeypatch, capsys):
    from fsdata.errors import InputError
    from fsdata.shards import writer

    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 0
    before = s3.digests(f"{b}/out")
    real = writer.write_rank

    def bad_input_at_rank_2(rank, *args, **kwargs):
        if rank == 2:
            raise InputError("row 17: seq_len 5 but 4 item ids (injected)")
        return real(rank, *args, **kwargs)

    monkeypatch.setattr(writer, "write_rank", bad_input_at_rank_2)
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--num-threads", "1", "--overwrite"]) == 2
    assert "seq_len" in capsys.readouterr().err
    assert s3.digests(f"{b}/out") == before  # nothing deleted, nothing left of the failed run
    assert main(["verify", f"s3://{b}/out", "--no-progress"]) == 0


def test_overwrite_that_fails_with_a_store_error_says_the_previous_output_is_unchanged(s3, s3_input, monkeypatch,
                                                                                    capsys):
    from fsdata.shards import writer

    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 0
    before = s3.digests(f"{b}/out")
    real = writer.write_rank

    def fail(rank, *args, **kwargs):
        if rank == 1:
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation (injected)")
        return real(rank, *args, **kwargs)

    monkeypatch.setattr(writer, "write_rank", fail)
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--num-threads", "1", "--overwrite"]) == 2
    err = _err_line(capsys)
    assert f"the previous s3://{b}/out is unchanged" in err and "nothing was written" not in err
    assert s3.digests(f"{b}/out") == before


def test_overwrite_switches_a_pointer_readers_and_verify_follow(s3, s3_input, local_out, capsys):
    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--seed", "9"]) == 0
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--overwrite"]) == 0
    cur = _current(s3, f"{b}/out")
    assert s3.digests(cur) == _local_digests(local_out)  # the new output, byte for byte
    # the previous output is gone: only the pointer and the one version remain
    assert {k.split("/")[0] for k in s3.keys(f"{b}/out")} == {"_current.json", "_versions"}
    capsys.readouterr()
    assert main(["verify", f"s3://{b}/out", "--input", inp, "--no-progress"]) == 0
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--overwrite"]) == 0  # replace a replaced one
    cur2 = _current(s3, f"{b}/out")
    assert cur2 != cur and s3.digests(cur2) == _local_digests(local_out)
    from fsdata.shards.manifest import Manifest

    assert Manifest.read(f"s3://{b}/out").path == f"s3://{cur2}"
    data = pytest.importorskip("fstrain.data", reason="fstrain needs torch")
    assert [batch.step for batch in data.ShardReader(f"s3://{b}/out", 1, 4)] == list(range(15))


def test_failed_cleanup_is_reported_with_what_remains(s3, s3_input, monkeypatch, caplog):
    from fsdata import atomic

    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 0
    real = fsio.delete

    def refuse_old(path):
        if "/_versions/" not in path and not path.endswith("_manifest.json"):
            raise OSError("AWS Error NETWORK_CONNECTION during DeleteObjects (injected)")
        return real(path)

    monkeypatch.setattr(fsio, "delete", refuse_old)
    with caplog.at_level("WARNING", logger="fsdata"):
        assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--overwrite"]) == 0
    msgs = " ".join(r.getMessage() for r in caplog.records if r.name == atomic.log.name)
    assert "objects of the previous output remain under" in msgs and "aws s3 rm --recursive" in msgs
    assert main(["verify", f"s3://{b}/out", "--no-progress"]) == 0  # the new output is the current one


# ---- object-store failures: one line naming the store and the cause ---------------------------------

def test_refused_credentials_are_one_line(s3, s3_input, monkeypatch, capsys):
    from moto import settings

    b, inp = s3_input
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto now checks the (unknown) keys
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 2
    err = _err_line(capsys)
    assert f"object store s3://{b}" in err and "credentials were refused" in err
    assert main(["verify", f"s3://{b}/in", "--no-progress"]) == 2
    err = _err_line(capsys)
    assert "credentials were refused" in err and "malformed" not in err


def test_unreachable_endpoint_is_one_line(s3, s3_input, monkeypatch, capsys):
    b, inp = s3_input
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    fsio._filesystem.cache_clear()
    try:
        capsys.readouterr()
        assert main(["verify", f"s3://{b}/out", "--no-progress"]) == 2
        err = _err_line(capsys)
        assert f"object store s3://{b}" in err and "endpoint cannot be reached" in err and "127.0.0.1:1" in err
    finally:
        monkeypatch.undo()
        fsio._filesystem.cache_clear()


def test_network_cut_mid_write_reports_what_remains(s3, s3_input, monkeypatch, capsys):
    from fsdata.shards import writer

    b, inp = s3_input
    real = writer.write_rank

    def cut_at_rank_2(rank, *args, **kwargs):
        if rank == 2:
            monkeypatch.setattr(fsio, "delete", lambda p: (_ for _ in ()).throw(
                OSError("AWS Error NETWORK_CONNECTION during DeleteObjects operation: curlCode: 7 (injected)")))
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7 (injected)")
        return real(rank, *args, **kwargs)

    monkeypatch.setattr(writer, "write_rank", cut_at_rank_2)
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--num-threads", "1"]) == 2
    err = _err_line(capsys)
    assert "nothing was written" not in err
    assert re.search(rf"\d+ objects of this run remain under s3://{b}/out", err) and "aws s3 rm --recursive" in err


def test_killed_runs_bucket_folders_are_cleaned(s3, s3_input, tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"fsdata-buckets-{int(dead.stdout)}-abc123"
    stale.mkdir()
    (stale / "00000.arrow").write_bytes(b"x" * 100)
    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 0
    assert not stale.exists() and not list(tmp_path.glob("fsdata-buckets-*"))


# ---- kills at every write and switch point: the previous output intact, or the new one complete -----

_KILL_BALANCE = r"""
import os, sys
from fsdata import atomic, fsio
from fsdata.cli import main
from fsdata.shards import manifest, writer
point = sys.argv[1]
die = lambda: os._exit(9)
real_rank, real_write, real_bytes, real_remove = writer.write_rank, manifest.Manifest.write, fsio.write_bytes, \
    atomic.remove_remote
def write_rank(rank, *a, **k):
    if point == "rank" and rank == 2:
        die()
    return real_rank(rank, *a, **k)
def write(self, out):
    if point == "manifest":
        die()
    return real_write(self, out)
def write_bytes(path, data):
    if point == "pointer" and path.split("?")[0].endswith("_current.json"):
        die()
    return real_bytes(path, data)
def remove_remote(prefix, what):
    if point == "cleanup" and what == "the previous output":
        die()
    return real_remove(prefix, what)
writer.write_rank, manifest.Manifest.write, fsio.write_bytes, atomic.remove_remote = \
    write_rank, write, write_bytes, remove_remote
sys.exit(main(["balance", *sys.argv[2:], "--num-threads", "1", "--overwrite"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("point, survivor", [("rank", "previous"), ("manifest", "previous"),
                                             ("pointer", "previous"), ("cleanup", "new")])
@pytest.mark.parametrize("layout", ["flat", "versioned"])
def test_kill_at_each_point_of_an_s3_replace(s3, s3_input, local_out, tmp_path, point, survivor, layout):
    from tests.fsdata.test_safety_paths import _run_py

    b, inp = s3_input
    out = f"s3://{b}/out"
    assert main(["balance", inp, out, *_BALANCE, "--seed", "9"]) == 0
    if layout == "versioned":  # a previous output that is itself a replaced one
        assert main(["balance", inp, out, *_BALANCE, "--seed", "9", "--overwrite"]) == 0
    def current():  # the objects of the output readers resolve (a killed run's version prefix aside)
        d = s3.digests(fsio.resolve_pointer(out)[len("s3://"):])
        return {k: v for k, v in d.items() if not k.startswith(("_versions/", "_current.json"))}

    before = current()
    r = _run_py(_KILL_BALANCE, point, inp, out, *_BALANCE, cwd=tmp_path)
    assert r.returncode == 9, r.stderr
    now = current()
    assert now == (before if survivor == "previous" else _local_digests(local_out))
    assert main(["verify", out, "--input", inp, "--no-progress"]) == 0
    assert main(["balance", inp, out, *_BALANCE, "--overwrite"]) == 0  # the next replace cleans up
    assert s3.digests(fsio.resolve_pointer(out)[len("s3://"):]) == _local_digests(local_out)
    assert {k.split("/")[0] for k in s3.keys(f"{b}/out")} == {"_current.json", "_versions"}
    assert len({k.split("/")[0] for k in s3.keys(f"{b}/out/_versions")}) == 1  # stale versions removed


def test_overwrite_refuses_a_prefix_freescale_did_not_write(s3, s3_input, capsys):
    b, inp = s3_input
    with s3.fs.open_output_stream(f"{b}/user/notes.txt") as f:
        f.write(b"keep me")
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/user", *_BALANCE, "--overwrite"]) == 2
    err = _err_line(capsys)
    assert "did not write" in err and "notes.txt" in err
    assert s3.keys(f"{b}/user") == ["notes.txt"]


def test_overwrite_onto_a_rank_prefix_of_another_output_is_refused_on_s3(s3, s3_input, capsys):
    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/other", *_BALANCE]) == 0
    before = s3.digests(f"{b}/other")
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/other/rank-00001", *_BALANCE, "--overwrite"]) == 2
    assert "lies inside the fsdata balance OUTPUT" in _err_line(capsys)
    assert s3.digests(f"{b}/other") == before
