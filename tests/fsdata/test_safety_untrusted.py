"""Untrusted metadata and unstable inputs (issue 35): counts read from a manifest or plan are checked
against the files before anything is allocated for them."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from fsdata.shards.manifest import Manifest, ManifestError
from fsdata.shards.plan_file import PLAN_METADATA_KEY, PLAN_SHA256_KEY
from tests.fsdata.helpers import write_samples

_ARGS = ["--ranks", "2", "--batch-size-per-rank", "8", "--seed", "3", "--no-progress"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fsdata: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("u")
    inp = write_samples(d / "in.parquet", n=300)
    assert main(["balance", str(inp), str(d / "out"), *_ARGS]) == 0
    assert main(["plan", str(inp), str(d / "plan.parquet"), *_ARGS]) == 0
    return inp, d / "out", d / "plan.parquet"


def _edited(out, tmp_path, edit):
    dst = shutil.copytree(out, tmp_path / "edited")
    m = json.loads((dst / "_manifest.json").read_text())
    edit(m)
    (dst / "_manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(num_ranks=10**12), "'files' has 2 entries"),
    (lambda m: m.update(num_steps=10**12), "exceeds the"),
    (lambda m: [f.update(num_rows=10**13) for f in m["files"]] and m.update(num_steps=10**12), "expected num_steps"),
])
def test_huge_counts_in_a_manifest_are_one_line_and_fast(made, tmp_path, capsys, edit, words):
    _, out, _ = made
    bad = _edited(out, tmp_path, edit)
    capsys.readouterr()
    assert main(["verify", str(bad), "--no-progress"]) == 2
    assert words in _one_line(capsys)


def test_manifest_read_refuses_num_ranks_beyond_its_files_before_allocating(made, tmp_path):
    _, out, _ = made
    bad = _edited(out, tmp_path, lambda m: m.update(num_ranks=10**12))
    with pytest.raises(ManifestError, match="one per rank"):
        Manifest.read(bad)  # the reader fstrain's ShardDataset uses too


@pytest.mark.parametrize("key, words", [("epochs", "epochs 1000000000000"), ("num_steps", "exceeds its"),
                                        ("num_ranks", "exceeds its")])
def test_huge_counts_in_a_plan_are_one_line_and_fast(made, tmp_path, capsys, key, words):
    inp, _, plan = made
    t = pq.read_table(plan)
    md = dict(t.schema.metadata)
    meta = json.loads(md[PLAN_METADATA_KEY])
    meta[key] = 10**12
    md[PLAN_METADATA_KEY] = json.dumps(meta).encode()
    md.pop(PLAN_SHA256_KEY, None)
    pq.write_table(t.replace_schema_metadata(md), tmp_path / "p.parquet")
    capsys.readouterr()
    assert main(["write", str(inp), str(tmp_path / "p.parquet"), str(tmp_path / "w"), "--no-progress"]) == 2
    assert words in _one_line(capsys) and not (tmp_path / "w").exists()


# --- the manifest records the plan digest its rank files carry


def test_manifest_records_the_plan_digest_of_its_rank_files(made):
    _, out, _ = made
    m = Manifest.read(out)
    assert m.plan_digest and list(m.to_json())[-1] == "plan_digest"
    for r in range(m.num_ranks):
        assert pq.read_schema(m.rank_file(r)).metadata[b"fsdata.plan_digest"].decode() == m.plan_digest


def test_verify_refuses_a_rank_file_of_another_plan_with_updated_checksums(made, tmp_path, capsys):
    import hashlib

    inp, out, _ = made
    other = tmp_path / "other"
    assert main(["balance", str(inp), str(other), *_ARGS[:-3], "--seed", "9", "--no-progress"]) == 0
    bad = shutil.copytree(out, tmp_path / "bad")
    m = json.loads((bad / "_manifest.json").read_text())
    src = other / m["files"][1]["path"]
    shutil.copyfile(src, bad / m["files"][1]["path"])
    m["files"][1].update(sha256=hashlib.sha256(src.read_bytes()).hexdigest(), num_bytes=src.stat().st_size)
    (bad / "_manifest.json").write_text(json.dumps(m))
    capsys.readouterr()
    assert main(["verify", str(bad), "--no-progress"]) == 2
    assert "plan digest" in _one_line(capsys)


# --- an input replaced while balance runs


@pytest.mark.parametrize("stage", ["plan", "finalize"])
def test_input_replaced_during_balance_publishes_nothing(tmp_path, monkeypatch, capsys, stage):
    import os

    from fsdata.engines import base
    from fsdata.engines.local import LocalEngine

    inp = write_samples(tmp_path / "in.parquet", n=300, seed=1)
    new = write_samples(tmp_path / "new.parquet", n=300, seed=2)
    prev = tmp_path / "prev"
    assert main(["balance", str(inp), str(prev), *_ARGS]) == 0
    before = {p.name: p.read_bytes() for p in prev.rglob("*") if p.is_file()}
    real = base.finalize if stage == "finalize" else LocalEngine.plan

    def swap_then(*a, **k):
        os.replace(new, inp)  # mv new.parquet in.parquet while the run works
        return real(*a, **k)

    if stage == "finalize":
        monkeypatch.setattr(base, "finalize", swap_then)
    else:
        monkeypatch.setattr(LocalEngine, "plan", swap_then)
    capsys.readouterr()
    assert main(["balance", str(inp), str(tmp_path / "out"), *_ARGS]) == 2
    assert "changed while this run read it" in _one_line(capsys)
    assert not (tmp_path / "out").exists()
    assert {p.name: p.read_bytes() for p in prev.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "prev"]


# --- verify says what it could not check


def test_verify_without_input_says_what_it_did_not_check(made, capsys):
    from fsdata.shards.verify import verify

    inp, out, _ = made
    capsys.readouterr()
    assert main(["verify", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "not checked: the samples against the input" in printed and "--input" in printed
    assert verify(out)["not_checked"] and verify(out, inp)["not_checked"] == []


def test_verify_names_the_plan_check_it_skips_for_an_edited_fsdata_version(made, tmp_path, capsys):
    inp, out, _ = made
    bad = _edited(out, tmp_path, lambda m: m.update(fsdata_version="0.1.0"))
    capsys.readouterr()
    assert main(["verify", str(bad), "--input", str(inp), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "not checked: the plan recomputed from --input" in printed and "fsdata 0.1.0" in printed


# --- negative and huge integers in flags: one line, exit 2


@pytest.mark.parametrize("args, words", [
    (["balance", "{inp}", "{t}/o", "--ranks", "2", "--batch-size-per-rank", "8", "--seed", "-5"], "--seed"),
    (["balance", "{inp}", "{t}/o", "--ranks", "2", "--batch-size-per-rank", "8", "--seed", str(2**70)], "--seed"),
    (["profile", "{inp}", "--ranks", "2", "--batch-size-per-rank", "8", "--seed", "-5"], "--seed"),
    (["plan", "{inp}", "{t}/p.parquet", "--ranks", "2", "--batch-size-per-rank", "8", "--seed", "-5"], "--seed"),
    (["balance", "{inp}", "{t}/o", "--ranks", "2", "--batch-size-per-rank", "8", "--num-threads", "-3"],
     "--num-threads"),
    (["balance", "{inp}", "{t}/o", "--ranks", "2", "--batch-size-per-rank", "8", "--epochs", str(10**14)],
     "lower --epochs"),
    (["synth", "{t}/s.parquet", "--num-samples", "10", "--lengths-from", "{log}", "--seed", "-5"], "--seed"),
    (["synth", "{t}/s.parquet", "--num-samples", "10", "--lengths-from", "{log}", "--num-items", str(10**20)],
     "--num-items"),
    (["convert", "{log}", "{t}/c.parquet", "--format", "sequences", "--max-seq-len", str(10**20)], "--max-seq-len"),
])
def test_negative_or_huge_integer_flags_are_one_line(made, tmp_path, capsys, args, words):
    inp, _, _ = made
    log = tmp_path / "log.txt"
    log.write_text("1 2 3 4\n2 3 4 5\n")
    argv = [a.format(inp=inp, t=tmp_path, log=log) for a in args] + ["--no-progress"] * (args[0] != "convert")
    capsys.readouterr()
    assert main(argv) == 2
    assert words in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt"]


def test_nightly_negative_seed_is_one_line_before_the_lock(made, tmp_path, capsys):
    from pipelines import nightly

    inp, _, _ = made
    capsys.readouterr()
    assert nightly.main(["-o", str(tmp_path / "w"), "--input", str(inp), "--format", "samples", "--ranks", "2",
                         "--batch-size-per-rank", "8", "--seed", "-5", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nightly: error:") and "--seed" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "w").exists()
