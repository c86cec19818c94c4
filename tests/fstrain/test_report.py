"""``fstrain report``: the shard report plus measured compute, wait and loss from step_times.parquet."""

from __future__ import annotations

import json
import re

import pytest

from fsdata.cli import main as fsdata_main
from fstrain.cli import main
from fstrain.components.metrics import StepTiming, write_step_times
from tests.fsdata.helpers import write_samples


def _shards(tmp_path, ranks=2):
    samples = write_samples(tmp_path / "s.parquet", n=400, id_offset=0)
    out = tmp_path / f"shards{ranks}"
    assert fsdata_main(["balance", str(samples), str(out), "--ranks", str(ranks), "--batch-size-per-rank", "8",
                        "--no-progress"]) == 0
    return out


def _metrics(folder, ranks, steps, null_steps=0):
    nulls = [StepTiming(step=k, rank=r, num_samples=0, num_tokens=0, sparse_forward_seconds=0.0,
                        compute_seconds=0.01 + 0.0005 * ((k + r) % 2), wait_seconds=0.0, sync_seconds=0.0)
             for k in range(null_steps) for r in range(ranks)]
    if nulls:
        write_step_times(nulls, str(folder / "null_step_times.parquet"))
    recs = []
    for s in range(steps):
        for r in range(ranks):
            t = StepTiming(step=s, rank=r, num_samples=8, num_tokens=100, sparse_forward_seconds=0.001,
                           compute_seconds=0.01 + 0.002 * ((s + r) % 3), wait_seconds=0.001 * r, sync_seconds=0.002)
            t.loss = 5.0 - 0.1 * s
            recs.append(t)
    write_step_times(recs, str(folder / "step_times.parquet"))


def test_train_report_adds_measured_heat_maps_and_loss(tmp_path, capsys):
    shards = _shards(tmp_path)
    run = tmp_path / "run"
    _metrics(run, 2, 5)
    capsys.readouterr()
    assert main(["report", str(shards), "--metrics-dir", str(run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    html = (run / "report.html").read_text()
    assert r["html"] == str(run / "report.html") and r["num_steps"] == 5
    assert r["loss_last_step"] == pytest.approx(4.6)
    assert len(re.findall(r"<img ", html)) == 7 and len(r["png"]) == 7  # 3 training + 4 shard figures
    for text in ("Measured per-rank compute", "straggler wait", "Training loss", "Per-rank predicted load"):
        assert text in html
    assert 0 < r["measured_bubble"] < 1
    assert "null_bubble" not in r and "not recorded (fstrain train --null-control-steps)" in html


def test_train_report_shows_the_noise_floor_of_the_null_control(tmp_path, capsys):
    shards = _shards(tmp_path)
    run = tmp_path / "run"
    _metrics(run, 2, 5, null_steps=4)
    capsys.readouterr()
    assert main(["report", str(shards), "--metrics-dir", str(run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    html = (run / "report.html").read_text()
    assert r["null_bubble"] == pytest.approx(0.00025 / 0.0105)  # each control: (0.0105 - 0.01025) / 0.0105
    assert "null control: bubble of identical work (timing noise)" in html and "over 4 control steps" in html
    assert "noise floor" in html and "fstrain calibrate" in html
    assert len(r["png"]) == 7


def test_train_report_refuses_metrics_from_other_shards(tmp_path, capsys):
    shards = _shards(tmp_path)
    run = tmp_path / "run"
    _metrics(run, 3, 2)
    capsys.readouterr()
    assert main(["report", str(shards), "--metrics-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "3 ranks" in err and not (run / "report.html").exists()
    assert main(["report", str(shards), "--metrics-dir", str(tmp_path / "none")]) == 2
    assert "--metrics-dir" in capsys.readouterr().err


def test_train_report_replaces_only_its_own_figures(tmp_path, capsys):
    shards = _shards(tmp_path)
    run = tmp_path / "run"
    _metrics(run, 2, 5)
    capsys.readouterr()
    assert main(["report", str(shards), "--metrics-dir", str(run), "--json"]) == 0
    pngs = json.loads(capsys.readouterr().out)["png"]
    assert main(["report", str(shards), "--metrics-dir", str(run)]) == 0  # its own page and PNGs: replaced
    capsys.readouterr()
    mine = b"\x89PNG\r\n\x1a\n my holiday picture"
    with open(pngs[-1], "wb") as f:  # a user's PNG where a figure would go (a shard figure)
        f.write(mine)
    page = (run / "report.html").read_bytes()
    assert main(["report", str(shards), "--metrics-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a figure fsdata report wrote" in err[0] and "--overwrite" not in err[0], err
    assert open(pngs[-1], "rb").read() == mine and (run / "report.html").read_bytes() == page  # nothing written
