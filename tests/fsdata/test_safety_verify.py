"""verify checks every manifest field it can (issue 19, item 7): a sample moved between two steps
of one composition window, edited settings and figures, and an input digest that is not --input's."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from tests.fsdata.helpers import write_samples

_ARGS = ["--ranks", "4", "--batch-size-per-rank", "8", "--seed", "3", "--no-progress"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``(input, output)``: the default settings (auto, W = 256 > the run's steps)."""
    d = tmp_path_factory.mktemp("v")
    inp = write_samples(d / "in.parquet", n=800, with_timestamps=True)
    assert main(["balance", str(inp), str(d / "out"), *_ARGS]) == 0
    return inp, d / "out"


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fsdata: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _fix_file_entry(out, rank):
    m = json.loads((out / "_manifest.json").read_text())
    p = out / m["files"][rank]["path"]
    m["files"][rank]["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    m["files"][rank]["num_bytes"] = p.stat().st_size
    (out / "_manifest.json").write_text(json.dumps(m, indent=2) + "\n")


def test_sample_moved_between_two_steps_of_one_window_is_caught(made, tmp_path, capsys):
    inp, ref = made
    out = _copy(ref, tmp_path / "out")
    m = json.loads((out / "_manifest.json").read_text())
    assert m["settings"]["compose"]["compose_window"] >= m["num_steps"]  # one window for the whole run
    path = out / "rank-00001/part-00000.parquet"
    t = pq.read_table(path)
    step = t.column("step").to_numpy()
    n = pa.compute.list_value_length(t.column("item_ids")).to_numpy()
    i = 0
    j = next(k for k in range(len(n)) if step[k] != step[i] and n[k] == n[i])  # equal length, other step
    idx = np.arange(t.num_rows)
    idx[i], idx[j] = j, i
    moved = t.drop_columns(["step"]).take(pa.array(idx))
    moved = moved.add_column(t.schema.get_field_index("step"), t.schema.field("step"), t.column("step"))
    pq.write_table(moved.cast(t.schema), path, compression="zstd")
    _fix_file_entry(out, 1)
    assert main(["verify", str(out), "--no-progress"]) == 0  # self-consistent: counts, loads, checksums hold
    capsys.readouterr()
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 2
    assert "the plan recomputed from --input puts it at step" in _one_line(capsys)


def _set(path, value):
    def edit(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return edit


_EDITS = {
    "batch_policy cost-budget": lambda m: (_set(["batch_policy"], "cost-budget")(m),
                                           _set(["settings", "batch_policy"], "cost-budget")(m)),
    "partitioner": _set(["settings", "partitioner"], "kk"),
    "partitioner unknown": _set(["settings", "partitioner"], "magic"),
    "partition_info": _set(["settings", "partition_info", "cpsat_steps"], lambda v: v + 3),
    "plan_window": _set(["settings", "plan_window"], 512),
    "compose": _set(["settings", "compose", "windows_composed"], lambda v: v + 1),
    "cost_model.name": _set(["cost_model", "name"], "tokens"),
    "input_digest": _set(["input_digest"], "sha256-footers:" + "0" * 64),
    "fsdata_version": _set(["fsdata_version"], "not a version"),
}


@pytest.mark.parametrize("edit", list(_EDITS))
def test_edited_manifest_fields_are_caught(made, tmp_path, capsys, edit):
    inp, ref = made
    out = _copy(ref, tmp_path / "out")
    m = json.loads((out / "_manifest.json").read_text())
    _EDITS[edit](m)
    (out / "_manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    capsys.readouterr()
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 2
    _one_line(capsys)


def test_input_digest_is_compared_with_input(made, tmp_path, capsys):
    inp, out = made
    other = tmp_path / "rewritten.parquet"  # the same rows, written again: another file, another digest
    pq.write_table(pq.read_table(inp), other, row_group_size=100)
    capsys.readouterr()
    assert main(["verify", str(out), "--input", str(other), "--no-progress"]) == 2
    assert "input_digest" in _one_line(capsys)


def test_unedited_output_passes(made):
    inp, out = made
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0


def test_edited_budget_of_a_cost_budget_output_is_caught(made, tmp_path, capsys):
    inp, _ = made
    out = tmp_path / "cb"
    assert main(["balance", str(inp), str(out), *_ARGS, "--batch-policy", "cost-budget"]) == 0
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 0
    m = json.loads((out / "_manifest.json").read_text())
    m["settings"]["budget"] = m["settings"]["budget_used"] * 2
    (out / "_manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    capsys.readouterr()
    assert main(["verify", str(out), "--input", str(inp), "--no-progress"]) == 2
    _one_line(capsys)
