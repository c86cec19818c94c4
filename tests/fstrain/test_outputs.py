"""fstrain's outputs replace only what is missing, empty or fstrain-written of the same kind, and never
land on an input (issue 35, "Ownership before deletion")."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fstrain.cli import main
from fstrain.components.outputs import check_checkpoint_dir, check_metrics_dir, check_output_file
from fstrain.errors import ConfigError
from tests.fstrain.shards import write_shards


def _write(path, text="x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_checkpoint_dir_rules(tmp_path):
    ck = tmp_path / "ck"
    check_checkpoint_dir(str(ck))  # missing: fine
    _write(ck / "step-00000002" / "fstrain.json", "{}")
    _write(ck / "step-00000002" / ".metadata")
    _write(ck / "step-00000002" / "__0_0.distcp")
    _write(ck / "notes.txt")  # not replaced by anything: left alone
    check_checkpoint_dir(str(ck))
    _write(ck / "step-00000004" / "thesis.tex")
    with pytest.raises(ConfigError, match="holds step-00000004, which fstrain did not write"):
        check_checkpoint_dir(str(ck))
    with pytest.raises(ConfigError, match="is a file"):
        check_checkpoint_dir(_write(tmp_path / "f"))
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=1, batch_size_per_rank=2)
    with pytest.raises(ConfigError, match="is an fsdata balance OUTPUT"):
        check_checkpoint_dir(shards)


def test_metrics_dir_rules(tmp_path):
    m = tmp_path / "run"
    _write(m / "summary.json", json.dumps({"measured_bubble": 0.1}))
    pq.write_table(pa.table({"step": [0], "rank": [0], "compute_seconds": [0.1]}), str(m / "step_times.parquet"))
    _write(m / "README.md")
    check_metrics_dir(str(m))
    _write(m / "summary.json", json.dumps({"my": "results"}))
    with pytest.raises(ConfigError, match="--tensorboard-dir .* holds summary.json, which fstrain did not write"):
        check_metrics_dir(str(m), "--tensorboard-dir")
    os.remove(m / "summary.json")
    _write(m / "step_times.parquet", "not parquet")
    with pytest.raises(ConfigError, match="step_times.parquet"):
        check_metrics_dir(str(m))


def test_output_file_rules(tmp_path):
    cost = _write(tmp_path / "cost.json", json.dumps({"kind": "polynomial", "coefficients": [0, 1, 0]}))
    check_output_file(cost, "cost-model", "--output")
    check_output_file(str(tmp_path / "new.json"), "cost-model", "--output")
    notes = _write(tmp_path / "notes.json", json.dumps({"todo": 1}))
    with pytest.raises(ConfigError, match="--output .*notes.json exists and is not a cost model"):
        check_output_file(notes, "cost-model", "--output")
    with pytest.raises(ConfigError, match="is a folder"):
        check_output_file(str(tmp_path), "evaluate", "--output")
    page = _write(tmp_path / "r.html", "<!doctype html><html><head><meta charset='utf-8'><title>fstrain report: s")
    check_output_file(page, "report", "--html")
    with pytest.raises(ConfigError, match="not an fstrain report page"):
        check_output_file(_write(tmp_path / "mine.html", "<html>my page</html>"), "report", "--html")


def _cli(capsys, *argv):
    code = main(list(argv))
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    return code, err


def test_cli_refuses_foreign_outputs_and_inputs(tmp_path, capsys):
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=4)
    notes = _write(tmp_path / "notes.txt", "mine")
    code, err = _cli(capsys, "calibrate", "-o", notes)
    assert code == 2 and len(err) == 1 and "exists and is not a cost model" in err[0]
    assert open(notes).read() == "mine"
    metrics = tmp_path / "run"
    _write(metrics / "summary.json", json.dumps({"thesis": 1}))
    code, err = _cli(capsys, "train", shards, "--metrics-dir", str(metrics), "--pipeline", "none")
    assert code == 2 and len(err) == 1 and "holds summary.json, which fstrain did not write" in err[0]
    assert json.loads(open(metrics / "summary.json").read()) == {"thesis": 1}
    code, err = _cli(capsys, "train", shards, "--tensorboard-dir", os.path.join(shards, "tb"))
    assert code == 2 and len(err) == 1 and "--tensorboard-dir" in err[0] and "lies inside" in err[0]
    _write(tmp_path / "ck" / "step-00000001" / "data.csv")
    code, err = _cli(capsys, "train", shards, "--checkpoint-dir", str(tmp_path / "ck"))
    assert code == 2 and len(err) == 1 and "holds step-00000001" in err[0]
    assert os.path.exists(tmp_path / "ck" / "step-00000001" / "data.csv")
    m2 = tmp_path / "m2"
    pq.write_table(pa.table({"step": [0], "rank": [0], "compute_seconds": [0.1]}), str(_write(m2 / "x") and
                                                                                          m2 / "step_times.parquet"))
    code, err = _cli(capsys, "report", shards, "--metrics-dir", str(m2), "--html", str(m2 / "step_times.parquet"))
    assert code == 2 and len(err) == 1 and "--html" in err[0] and "same path" in err[0]
    code, err = _cli(capsys, "report", shards, "--metrics-dir", str(m2), "--html", os.path.join(shards, "r.html"))
    assert code == 2 and len(err) == 1 and "lies inside" in err[0]
    code, err = _cli(capsys, "report", shards, "--metrics-dir", str(m2), "--html", _write(tmp_path / "my.html"))
    assert code == 2 and len(err) == 1 and "not an fstrain report page" in err[0]
