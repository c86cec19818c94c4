"""Data safety on object stores (issue 19): URI spellings, replace-never-delete-first, error lines.

Runs against the same moto S3 server as ``test_object_store.py`` (its fixtures are imported here).
"""

from __future__ import annotations

import pytest

pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install 'freescale[test]'")

from fsdata import fsio  # noqa: E402
from fsdata.cli import main  # noqa: E402
from fsdata.guards import overlap  # noqa: E402
from tests.fsdata.test_object_store import (  # noqa: E402,F401 (fixtures)
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
