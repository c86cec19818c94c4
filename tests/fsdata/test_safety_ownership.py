"""Never delete what is not ours (issue 35): ``--overwrite`` replaces only an empty path or something
FreeScale wrote of the same kind (:func:`fsdata.atomic.check_replaceable`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fsdata.atomic import check_replaceable
from fsdata.cli import main
from fsdata.errors import ConfigError
from tests.fsdata.helpers import write_samples

_BALANCE = ["--ranks", "2", "--batch-size-per-rank", "8", "--seed", "3", "--no-progress"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fsdata: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _digests(root: Path) -> dict:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _user_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "thesis.tex").write_text("x")
    (root / "sub" / "notes.txt").write_text("y")
    return root


def test_balance_overwrite_refuses_a_users_folder(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    u = _user_folder(tmp_path / "u")
    before = _digests(u)
    capsys.readouterr()
    assert main(["balance", str(inp), str(u), *_BALANCE, "--overwrite"]) == 2
    err = _one_line(capsys)
    assert "did not write" in err and "thesis.tex" in err
    assert _digests(u) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "u"]


def test_balance_overwrite_replaces_its_own_output_and_an_empty_folder(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["balance", str(inp), str(out), *_BALANCE, "--overwrite"]) == 0  # empty: free
    assert main(["balance", str(inp), str(out), *_BALANCE[:-3], "--seed", "4", "--no-progress", "--overwrite"]) == 0
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0


def test_overwrite_onto_a_rank_folder_of_another_output_is_refused(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    other = tmp_path / "other"
    assert main(["balance", str(inp), str(other), *_BALANCE]) == 0
    before = _digests(other)
    capsys.readouterr()
    for target in (other / "rank-00001", other / "new"):
        assert main(["balance", str(inp), str(target), *_BALANCE, "--overwrite"]) == 2
        assert "lies inside the fsdata balance OUTPUT" in _one_line(capsys)
    assert _digests(other) == before
    assert main(["verify", str(other), "--input", str(inp), "--no-progress"]) == 0


def test_rank_folder_alone_is_not_an_output(tmp_path):
    (tmp_path / "r" / "rank-00000").mkdir(parents=True)
    check_replaceable(tmp_path / "r", "shards")  # the rank folders of 'fsdata write' before finalize
    (tmp_path / "r" / "rank-00000" / "x.parquet").write_text("x")
    with pytest.raises(ConfigError, match="did not write"):
        check_replaceable(tmp_path / "r" / "rank-00000", "shards")


def test_convert_overwrite_never_replaces_a_folder_with_a_file(tmp_path, capsys):
    log = tmp_path / "x.txt"
    log.write_text("1 2 3 4\n2 3 4 5\n")
    d = _user_folder(tmp_path / "dir")
    before = _digests(d)
    capsys.readouterr()
    assert main(["convert", str(log), str(d), "--format", "sequences", "--overwrite"]) == 2
    assert "is a folder" in _one_line(capsys)
    assert _digests(d) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", str(log), str(empty), "--format", "sequences", "--overwrite"]) == 2
    assert "is a folder" in _one_line(capsys) and empty.is_dir()


def test_convert_overwrite_replaces_only_samples_freescale_wrote(tmp_path, capsys):
    log = tmp_path / "x.txt"
    log.write_text("1 2 3 4\n2 3 4 5\n")
    foreign = tmp_path / "data.parquet"
    write_samples(foreign, n=10)  # a Parquet file FreeScale did not write
    text = tmp_path / "notes.txt"
    text.write_text("keep")
    before = {**_digests(foreign), **_digests(text)}
    capsys.readouterr()
    for target in (foreign, text):
        assert main(["convert", str(log), str(target), "--format", "sequences", "--overwrite"]) == 2
        assert "is not a samples Parquet file FreeScale wrote" in _one_line(capsys)
    assert {**_digests(foreign), **_digests(text)} == before
    ours = tmp_path / "s.parquet"
    assert main(["convert", str(log), str(ours), "--format", "sequences"]) == 0
    assert main(["convert", str(log), str(ours), "--format", "sequences", "--overwrite"]) == 0
    (tmp_path / "zero.parquet").write_bytes(b"")
    assert main(["convert", str(log), str(tmp_path / "zero.parquet"), "--format", "sequences", "--overwrite"]) == 0


def test_plan_overwrite_replaces_only_a_plan(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    other = write_samples(tmp_path / "other.parquet", n=20)
    before = _digests(other)
    capsys.readouterr()
    assert main(["plan", str(inp), str(other), *_BALANCE, "--overwrite"]) == 2
    assert "is not a plan Parquet file" in _one_line(capsys) and _digests(other) == before
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), *_BALANCE]) == 0
    assert main(["plan", str(inp), str(plan), *_BALANCE, "--overwrite"]) == 0


def test_write_overwrite_refuses_a_users_folder(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), *_BALANCE]) == 0
    u = _user_folder(tmp_path / "u")
    before = _digests(u)
    capsys.readouterr()
    assert main(["write", str(inp), str(plan), str(u), "--overwrite", "--no-progress"]) == 2
    assert "did not write" in _one_line(capsys) and _digests(u) == before
    w = tmp_path / "w"
    assert main(["write", str(inp), str(plan), str(w), "--no-progress"]) == 0
    assert main(["write", str(inp), str(plan), str(w), "--overwrite", "--no-progress"]) == 0  # rank folders only


def test_synth_overwrite_replaces_only_samples_freescale_wrote(tmp_path, capsys):
    src = tmp_path / "seq.txt"
    src.write_text("1 2 3 4\n2 3 4 5 6\n")
    args = ["--num-samples", "50", "--lengths-from", str(src)]
    foreign = tmp_path / "keep.csv"
    foreign.write_text("a,b\n")
    capsys.readouterr()
    assert main(["synth", str(foreign), *args, "--overwrite"]) == 2
    assert "is not a samples Parquet file" in _one_line(capsys) and foreign.read_text() == "a,b\n"
    out = tmp_path / "s.parquet"
    assert main(["synth", str(out), *args]) == 0
    assert main(["synth", str(out), *args, "--seed", "2", "--overwrite"]) == 0


def test_a_file_where_an_output_folder_goes_is_refused(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    f = tmp_path / "out"
    f.write_text("mine")
    capsys.readouterr()
    assert main(["balance", str(inp), str(f), *_BALANCE, "--overwrite"]) == 2
    assert "is a file" in _one_line(capsys) and f.read_text() == "mine"


# --- fsdata report --html (issue 35): its own pages only; never inside OUTPUT, never onto an input


@pytest.fixture
def balanced(tmp_path):
    pytest.importorskip("matplotlib")
    inp = write_samples(tmp_path / "s.parquet", n=200)
    out = tmp_path / "out"
    assert main(["balance", str(inp), str(out), *_BALANCE]) == 0
    return inp, out


def test_report_replaces_its_own_page_but_no_other_file_without_overwrite(balanced, tmp_path, capsys):
    inp, out = balanced
    rep = ["report", str(out), "--input", str(inp), "--html"]
    page = tmp_path / "page.html"
    assert main([*rep, str(page)]) == 0
    assert main([*rep, str(page)]) == 0  # its own page: replaced
    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>mine</html>")
    capsys.readouterr()
    assert main([*rep, str(foreign)]) == 2
    assert "--overwrite" in _one_line(capsys) and foreign.read_text() == "<html>mine</html>"
    assert not list(tmp_path.glob("notes-*.png"))  # nothing written beside it either
    png = tmp_path / "fig-lengths.png"
    png.write_bytes(b"\x89PNG mine")
    assert main([*rep, str(tmp_path / "fig.html")]) == 2
    assert "figure" in _one_line(capsys) and png.read_bytes() == b"\x89PNG mine"
    assert main([*rep, str(foreign), "--overwrite"]) == 0
    assert "freescale-report" in foreign.read_text()


def test_report_never_onto_its_input_nor_inside_output(balanced, tmp_path, capsys):
    inp, out = balanced
    before = {**_digests(inp), **_digests(out)}
    capsys.readouterr()
    for html in (inp, out / "r.html", out / "rank-00000" / "r.html"):
        assert main(["report", str(out), "--input", str(inp), "--html", str(html), "--overwrite"]) == 2
        assert "OUTPUT or --input" in _one_line(capsys)
    assert {**_digests(inp), **_digests(out)} == before
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0
    d = tmp_path / "folder.html"
    d.mkdir()
    assert main(["report", str(out), "--input", str(inp), "--html", str(d), "--overwrite"]) == 2
    assert "is a folder" in _one_line(capsys) and d.is_dir()


# --- every file a command reads is an input for the overlap rules (issue 35)


def test_cost_model_inside_output_is_refused_like_a_plan(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    out = tmp_path / "out"
    assert main(["balance", str(inp), str(out), *_BALANCE]) == 0
    cm = out / "cm.json"
    cm.write_text('{"name": "poly", "coefficients": [0, 1, 0]}')
    before = _digests(out)
    capsys.readouterr()
    assert main(["balance", str(inp), str(out), *_BALANCE, "--cost-model", str(cm), "--overwrite"]) == 2
    err = _one_line(capsys)
    assert "--cost-model" in err and "contains" in err
    assert _digests(out) == before
    assert main(["plan", str(inp), str(cm), *_BALANCE, "--cost-model", str(cm), "--overwrite"]) == 2
    assert "--cost-model" in _one_line(capsys) and _digests(out) == before


def test_register_output_kind_extends_the_one_rule(tmp_path):
    from fsdata.atomic import register_output_kind

    register_output_kind("test-ckpt", "a test checkpoint folder", lambda p: (Path(p) / ".ckpt").is_file(),
                         folder=True)
    ck = tmp_path / "ck"
    ck.mkdir()
    check_replaceable(ck, "test-ckpt")  # empty
    (ck / "model.pt").write_text("x")
    with pytest.raises(ConfigError, match="did not write"):
        check_replaceable(ck, "test-ckpt")
    (ck / ".ckpt").write_text("")
    check_replaceable(ck, "test-ckpt")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_replaceable(f, "test-ckpt")
