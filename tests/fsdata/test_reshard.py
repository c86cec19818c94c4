"""Changing the world size (docs/fsdata.md): an OUTPUT read back as INPUT, ``--from-step`` reshards,
on real data (ml-1m per-user samples, three epochs planned for R=4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from fsdata.shards.manifest import Manifest
from fsdata.shards.verify import verify
from tests.conftest import dataset_path

B = 16
FAST = ["--compose-window", "1", "--no-progress"]


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    """ml-1m per-user samples and an OUTPUT of them for R=4, B=16, three epochs."""
    data = dataset_path("ml-1m_ensfm/sequences.txt")
    d = tmp_path_factory.mktemp("reshard")
    assert main(["convert", str(data), str(d / "s.parquet"), "--format", "sequences", "--samples", "per-user",
                 "--no-progress"]) == 0
    assert main(["balance", str(d / "s.parquet"), str(d / "old"), "--ranks", "4", "--batch-size-per-rank", str(B),
                 "--epochs", "3", *FAST]) == 0
    return d


def _rows(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """(sample_id, step) of every written row, read from the rank files through the manifest."""
    m = Manifest.read(out)
    t = [pq.read_table(m.rank_file(r), columns=["sample_id", "step"]) for r in range(m.num_ranks)]
    return (np.concatenate([x.column(0).to_numpy() for x in t]).astype(np.int64),
            np.concatenate([x.column(1).to_numpy() for x in t]).astype(np.int64))


def _dropped(out: Path) -> tuple[np.ndarray, np.ndarray]:
    m = Manifest.read(out)
    if not m.dropped_file:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    t = pq.read_table(out / m.dropped_file)
    ep = t.column("epoch").to_numpy() if "epoch" in t.schema.names else np.zeros(t.num_rows, np.int64)
    return t.column("sample_id").to_numpy().astype(np.int64), ep.astype(np.int64)


@pytest.mark.parametrize("from_step,ranks", [(50, 3), (150, 2), (230, 3)])
def test_every_sample_once_per_epoch_across_the_reshard(old, from_step, ranks):
    """Trained ids read from OLD's steps < S and NEW's steps: every sample of OLD once per epoch,
    or listed as dropped in that epoch; NEW verifies alone and against OLD from S."""
    new = old / f"new-{from_step}-{ranks}"
    assert main(["balance", str(old / "old"), str(new), "--ranks", str(ranks), "--batch-size-per-rank", str(B),
                 "--from-step", str(from_step), *FAST]) == 0
    mo, mn = Manifest.read(old / "old"), Manifest.read(new)
    all_ids = pq.read_table(old / "s.parquet", columns=["sample_id"]).column(0).to_numpy()
    e0 = int(mo.epoch_of_step(from_step))
    assert mn.epochs == 3 - e0
    assert mn.extra["resharded_from"] == {"plan_digest": pq.read_metadata(mo.rank_file(0)).metadata[
        b"fsdata.plan_digest"].decode(), "from_step": from_step}
    assert mn.settings["samples"] == "per-user"
    oid, ostep = _rows(old / "old")
    nid, nstep = _rows(new)
    odrop, odrop_e = _dropped(old / "old")
    ndrop, ndrop_e = _dropped(new)
    oep, nep = mo.epoch_of_step(ostep), mn.epoch_of_step(nstep)
    for e in range(3):
        if e < e0:
            trained, dropped = oid[oep == e], odrop[odrop_e == e]
        elif e == e0:
            trained = np.concatenate([oid[(oep == e) & (ostep < from_step)], nid[nep == 0]])
            dropped = np.concatenate([odrop[odrop_e == e], ndrop[ndrop_e == 0]])
        else:
            trained, dropped = nid[nep == e - e0], ndrop[ndrop_e == e - e0]
        held = np.concatenate([trained, dropped])
        assert len(held) == len(all_ids), e
        assert np.array_equal(np.sort(held), np.sort(all_ids)), e
    r = verify(str(new), str(old / "old"), from_step=from_step)
    assert r["checked_input"]
    if e0 < 2:
        assert mn.extra["first_epoch_num_samples"] == int((nep == 0).sum()) + int((ndrop_e == 0).sum())


def test_resharded_bubble_is_that_of_balance_on_the_same_samples(old, tmp_path):
    """S in the last epoch: NEW is the plan of OLD's rows of steps >= S (rank-file order)."""
    S = 230
    new = tmp_path / "new"
    assert main(["balance", str(old / "old"), str(new), "--ranks", "3", "--batch-size-per-rank", str(B),
                 "--from-step", str(S), *FAST]) == 0
    m = Manifest.read(old / "old")
    parts = []
    for r in range(m.num_ranks):
        t = pq.read_table(m.rank_file(r))
        t = t.filter(pa.compute.greater_equal(t.column("step"), S)).drop_columns(["step", "rank"])
        parts.append(t.replace_schema_metadata(None))
    pq.write_table(pa.concat_tables(parts), tmp_path / "same.parquet")
    assert main(["balance", str(tmp_path / "same.parquet"), str(tmp_path / "direct"), "--ranks", "3",
                 "--batch-size-per-rank", str(B), *FAST]) == 0
    a, b = Manifest.read(new), Manifest.read(tmp_path / "direct")
    assert a.predicted_bubble == b.predicted_bubble
    assert a.num_steps == b.num_steps and a.num_samples_input == b.num_samples_input


def test_output_as_input_reads_its_samples_once(old, tmp_path, capsys):
    """No --from-step: each sample of a three-epoch OUTPUT once, every column but step/rank as is."""
    assert main(["profile", str(old / "old"), "--ranks", "2", "--batch-size-per-rank", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_samples"] == 6040
    new = tmp_path / "again"
    assert main(["balance", str(old / "old"), str(new), "--ranks", "2", "--batch-size-per-rank", str(B),
                 *FAST]) == 0
    mn = Manifest.read(new)
    assert mn.num_samples_input == 6040 and "resharded_from" not in mn.extra
    src = pq.read_schema(old / "s.parquet")
    got = pq.read_schema(mn.rank_file(0))
    assert [(f.name, f.type) for f in got][:-2] == [(f.name, f.type) for f in src]
    assert verify(str(new), str(old / "old"))["checked_input"]


def test_verify_from_another_step_fails(old, tmp_path, capsys):
    new = tmp_path / "new"
    assert main(["balance", str(old / "old"), str(new), "--ranks", "2", "--batch-size-per-rank", str(B),
                 "--from-step", "230", *FAST]) == 0
    assert main(["verify", str(new), "--input", str(old / "old"), "--from-step", "231"]) == 2
    assert "does not equal the input" in capsys.readouterr().err


@pytest.mark.parametrize("args,words", [
    (["--from-step", "9999"], "outside the steps"),
    (["--from-step", "10", "--epochs", "2"], "drop --epochs or pass --epochs 3"),
    (["--columns", "item_ids=history"], "--columns does not apply"),
])
def test_bad_reshard_is_one_line(old, tmp_path, capsys, args, words):
    rc = main(["balance", str(old / "old"), str(tmp_path / "x"), "--ranks", "2", "--batch-size-per-rank", str(B),
               *args, *FAST])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "x").exists()


def test_from_step_needs_an_output(old, tmp_path, capsys):
    rc = main(["balance", str(old / "s.parquet"), str(tmp_path / "x"), "--ranks", "2", "--batch-size-per-rank",
               str(B), "--from-step", "3", *FAST])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "needs an 'fsdata balance' OUTPUT as INPUT" in err


def test_plan_refuses_an_output_with_the_commands_that_read_it(old, tmp_path, capsys):
    rc = main(["plan", str(old / "old"), str(tmp_path / "p.parquet"), "--ranks", "2", "--batch-size-per-rank", "8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "is an 'fsdata balance' OUTPUT" in err


def test_verify_from_step_needs_input(old, capsys):
    assert main(["verify", str(old / "old"), "--from-step", "3"]) == 2
    assert "--from-step needs --input OLD" in capsys.readouterr().err


def test_profile_from_step_reads_the_samples_left(old, capsys):
    """--from-step 230 (last epoch of 3 x 94 steps): the 52 steps left, 64 samples each."""
    assert main(["profile", str(old / "old"), "--ranks", "2", "--batch-size-per-rank", "8", "--from-step", "230",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == (282 - 230) * 4 * B
    assert main(["profile", str(old / "s.parquet"), "--ranks", "2", "--batch-size-per-rank", "8",
                 "--from-step", "3"]) == 2
    assert "needs an 'fsdata balance' OUTPUT as INPUT" in capsys.readouterr().err


def test_dropped_samples_stay_dropped(tmp_path):
    """One epoch: the samples read are exactly the written ones (the remainder is not read back)."""
    from tests.fsdata.helpers import write_samples

    inp = write_samples(tmp_path / "in.parquet", n=500)
    assert main(["balance", str(inp), str(tmp_path / "old"), "--ranks", "4", "--batch-size-per-rank", "8",
                 *FAST]) == 0
    assert main(["balance", str(tmp_path / "old"), str(tmp_path / "new"), "--ranks", "2", "--batch-size-per-rank",
                 "8", *FAST]) == 0
    mo, mn = Manifest.read(tmp_path / "old"), Manifest.read(tmp_path / "new")
    assert mo.num_samples_dropped == 500 - 480 and mn.num_samples_input == 480
    assert set(_rows(tmp_path / "new")[0]) | set(_dropped(tmp_path / "new")[0]) == set(_rows(tmp_path / "old")[0])


def test_carried_keys_rewrite_the_vocab_path(tmp_path):
    from types import SimpleNamespace

    from fsdata.shards.as_input import carried_keys

    old = SimpleNamespace(path=str(tmp_path / "nightly" / "old"),
                          extra={"num_items": 3707, "feature_columns": ["user_id"], "other": 1,
                                 "vocab": {"digest": "sha256:ab", "path": "../vocab.json"}})
    got = carried_keys(old, tmp_path / "restart" / "new")
    assert got == {"num_items": 3707, "feature_columns": ["user_id"],
                   "vocab": {"digest": "sha256:ab", "path": "../../nightly/vocab.json"}}
    assert carried_keys(SimpleNamespace(path="x", extra={}), "y") == {}


def test_a_corrupt_rank_file_is_one_line(tmp_path, capsys):
    from tests.fsdata.helpers import write_samples

    inp = write_samples(tmp_path / "in.parquet", n=300)
    assert main(["balance", str(inp), str(tmp_path / "old"), "--ranks", "2", "--batch-size-per-rank", "8",
                 *FAST]) == 0
    victim = Manifest.read(tmp_path / "old").rank_file(1)
    Path(victim).write_bytes(Path(victim).read_bytes()[:200])
    rc = main(["balance", str(tmp_path / "old"), str(tmp_path / "new"), "--ranks", "3", "--batch-size-per-rank",
               "8", "--from-step", "2", *FAST])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot read the rank file" in err, err
    assert not (tmp_path / "new").exists()
