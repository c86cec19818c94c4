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
    with pytest.raises(ConfigError, match="--output .*notes.json is not a cost model fstrain calibrate wrote"):
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
    assert code == 2 and len(err) == 1 and "is not a cost model fstrain calibrate wrote" in err[0]
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


# --- one rule: fsdata.atomic.check_replaceable decides, with fstrain's kinds registered


def test_fstrain_kinds_are_fsdatas_rule(tmp_path):
    from fsdata.atomic import check_replaceable
    from fsdata.errors import FsdataError

    step = tmp_path / "step-00000001"
    _write(step / "fstrain.json", "{}")
    check_replaceable(str(step), "fstrain-checkpoint")  # the kinds live in fsdata's registry
    _write(step / "thesis.tex")
    with pytest.raises(FsdataError, match="holds files FreeScale did not write"):
        check_replaceable(str(step), "fstrain-checkpoint")
    cost = _write(tmp_path / "c.json", json.dumps({"kind": "polynomial", "coefficients": [0, 1, 0]}))
    check_replaceable(cost, "fstrain-cost-model")
    with pytest.raises(FsdataError, match="is not an evaluation result"):
        check_replaceable(cost, "fstrain-evaluate")


def test_empty_files_and_folders_are_replaceable_other_kinds_not(tmp_path):
    empty = _write(tmp_path / "empty.json", "")
    check_output_file(empty, "cost-model", "--output")  # empty: nothing to lose (fsdata's rule)
    os.makedirs(tmp_path / "ck" / "step-00000003")
    check_checkpoint_dir(str(tmp_path / "ck"))  # an empty step folder: a checkpoint cut short before writing
    _write(tmp_path / "ck2" / "step-00000003", "a file")
    with pytest.raises(ConfigError, match="holds step-00000003, which fstrain did not write"):
        check_checkpoint_dir(str(tmp_path / "ck2"))
    evaluation = _write(tmp_path / "e.json", json.dumps({"checkpoint": "ck", "num_users": 3}))
    with pytest.raises(ConfigError, match="is not a replay result fstrain replay wrote"):
        check_output_file(evaluation, "replay", "--output")  # ours, but another kind


def test_null_step_times_are_checked_like_step_times(tmp_path):
    m = tmp_path / "run"
    pq.write_table(pa.table({"step": [0], "rank": [0], "compute_seconds": [0.1]}),
                   str(_write(m / "x") and m / "null_step_times.parquet"))
    check_metrics_dir(str(m))
    pq.write_table(pa.table({"user": [1]}), str(m / "null_step_times.parquet"))
    with pytest.raises(ConfigError, match="holds null_step_times.parquet, which fstrain did not write"):
        check_metrics_dir(str(m))


def test_folders_inside_an_fsdata_output_are_refused(tmp_path):
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=1, batch_size_per_rank=2)
    for check, flag in ((check_checkpoint_dir, "--checkpoint-dir"), (check_metrics_dir, "--metrics-dir")):
        with pytest.raises(ConfigError, match=f"^{flag} .* lies inside the fsdata balance OUTPUT"):
            check(os.path.join(shards, "sub"), flag)
    with pytest.raises(ConfigError, match="lies inside the fsdata balance OUTPUT"):
        check_output_file(os.path.join(shards, "cost.json"), "cost-model", "--output")
    assert sorted(os.listdir(shards)) == ["_manifest.json", "_step_stats.parquet", "rank-00000"]


def test_report_figures_are_replaced_only_with_the_report_marker(tmp_path):
    png = tmp_path / "r-x.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20 + b"tEXtSoftware\0freescale-report")
    check_output_file(str(png), "report-figure", "figure")
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a user's own picture
    with pytest.raises(ConfigError, match="^figure .*r-x.png is not a figure fsdata report wrote"):
        check_output_file(str(png), "report-figure", "figure")
