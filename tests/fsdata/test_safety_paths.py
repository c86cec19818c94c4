"""Data safety on local paths (issue 19): every spelling of the input is refused as an output."""

from __future__ import annotations

import hashlib

import pytest

from fsdata.cli import main
from tests.fsdata.helpers import write_samples

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
