"""The stages bind to their plan (issue 19, items 6 and 9): finalize refuses rank files of another
plan, extra files and hidden folders; an edited or corrupt plan gives one error line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from tests.fsdata.helpers import write_samples

_PLAN = ["--ranks", "4", "--batch-size-per-rank", "16", "--no-progress"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fsdata: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def staged(tmp_path):
    """``(input, plan, output)``: a plan (seed 1) and its rank files written, not finalized."""
    inp = write_samples(tmp_path / "in.parquet", n=700, with_timestamps=True)
    plan, out = tmp_path / "plan.parquet", tmp_path / "out"
    assert main(["plan", str(inp), str(plan), *_PLAN, "--seed", "1"]) == 0
    assert main(["write", str(inp), str(plan), str(out), "--no-progress"]) == 0
    return inp, plan, out


@pytest.mark.parametrize("other", [["--seed", "2"], ["--strategy", "shuffle"], ["--cost-model", "quadratic"]])
def test_finalize_refuses_rank_files_of_another_plan_with_equal_counts(staged, tmp_path, capsys, other):
    inp, _, out = staged
    plan_b = tmp_path / "plan-b.parquet"
    assert main(["plan", str(inp), str(plan_b), *_PLAN, "--seed", "1", *other]) == 0
    capsys.readouterr()
    assert main(["finalize", str(out), "--plan", str(plan_b), "--no-progress"]) == 2
    assert "written from another plan" in _one_line(capsys)
    assert not (out / "_manifest.json").exists()


@pytest.mark.parametrize("extra", ["rank-00001/part-00001.parquet", ".hidden/part-00000.parquet",
                                   "_extra/part-00000.parquet", "rank-00004/part-00000.parquet", "notes.txt"])
def test_finalize_refuses_extra_files_and_hidden_folders(staged, capsys, extra):
    _, plan, out = staged
    (out / extra).parent.mkdir(parents=True, exist_ok=True)
    (out / extra).write_bytes((out / "rank-00001/part-00000.parquet").read_bytes())
    capsys.readouterr()
    assert main(["finalize", str(out), "--plan", str(plan), "--no-progress"]) == 2
    err = _one_line(capsys)
    assert extra in err and "besides the plan's 4 rank files" in err
    assert not (out / "_manifest.json").exists()
    top = out / extra.split("/")[0]
    shutil.rmtree(top) if top.is_dir() and top.name != "rank-00001" else (out / extra).unlink()
    assert main(["finalize", str(out), "--plan", str(plan), "--no-progress"]) == 0


def _edit(plan_path, out_path, *, column=None, row=0, value=None, meta=None, keep_checksum=True):
    t = pq.read_table(plan_path)
    md = dict(t.schema.metadata)
    if column is not None:
        a = t.column(column).to_numpy().copy()
        a[row] = value
        t = t.set_column(t.schema.get_field_index(column), column, pa.array(a, type=t.schema.field(column).type))
    if meta is not None:
        m = json.loads(md[b"fsdata.plan"])
        m.update(meta)
        md[b"fsdata.plan"] = json.dumps(m).encode()
    if not keep_checksum:
        md.pop(b"fsdata.plan_sha256", None)
    pq.write_table(t.replace_schema_metadata(md), out_path)
    return out_path


_EDITS = {
    "rank -3": dict(column="rank", value=-3),
    "rank out of range": dict(column="rank", value=4),
    "negative step": dict(column="step", value=-2),
    "step out of range": dict(column="step", value=10**6),
    "num_steps + 1": dict(meta="steps+1"),
    "num_steps - 1": dict(meta="steps-1"),
    "num_ranks 3": dict(meta={"num_ranks": 3}),
    "num_ranks -1": dict(meta={"num_ranks": -1}),
    "num_ranks text": dict(meta={"num_ranks": "4"}),
}


@pytest.mark.parametrize("keep_checksum", [True, False])
@pytest.mark.parametrize("edit", list(_EDITS))
def test_edited_or_corrupt_plan_is_one_line_for_write_and_finalize(staged, tmp_path, capsys, edit, keep_checksum):
    inp, plan, out = staged
    kw = dict(_EDITS[edit])
    if kw.get("meta") in ("steps+1", "steps-1"):
        S = json.loads(pq.read_schema(plan).metadata[b"fsdata.plan"])["num_steps"]
        kw["meta"] = {"num_steps": S + (1 if kw["meta"] == "steps+1" else -1)}
    bad = _edit(plan, tmp_path / "edited.parquet", keep_checksum=keep_checksum, **kw)
    capsys.readouterr()
    assert main(["write", str(inp), str(bad), str(tmp_path / "out2"), "--no-progress"]) == 2
    err = _one_line(capsys)
    assert "edited or is corrupt" in err or "not an integer" in err
    assert not (tmp_path / "out2").exists()
    assert main(["finalize", str(out), "--plan", str(bad), "--no-progress"]) == 2
    _one_line(capsys)
    assert not (out / "_manifest.json").exists()


def test_dropped_rows_are_exactly_the_rank_minus_one_rows(staged):
    """A plan that passes the checks drops only rank -1 rows, all listed in _dropped.parquet."""
    inp, plan, out = staged
    assert main(["finalize", str(out), "--plan", str(plan), "--no-progress"]) == 0
    t = pq.read_table(plan)
    dropped = set(t.column("sample_id").to_numpy()[t.column("rank").to_numpy() == -1].tolist())
    assert set(pq.read_table(out / "_dropped.parquet").column("sample_id").to_pylist()) == dropped
    written = np.concatenate([pq.read_table(out / f"rank-{r:05d}/part-00000.parquet").column("sample_id").to_numpy()
                              for r in range(4)])
    assert len(written) + len(dropped) == 700 and len(set(written.tolist()) | dropped) == 700
