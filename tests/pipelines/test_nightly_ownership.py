"""The nightly job deletes only its own runs and never writes into another output (issue 35)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdata.cli import main as fsdata_main
from fsdata.errors import ConfigError
from pipelines import nightly
from pipelines.nightly import run_nightly
from tests.fsdata.helpers import write_samples
from tests.pipelines.helpers import at, nightly_config

FAST = dict(format="samples", num_ranks=4, batch_size_per_rank=8, partitioner="lpt-swap")


def test_keep_runs_leaves_a_users_folder_under_runs(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=300)
    work = tmp_path / "work"
    mine = work / "runs" / "myproject"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("x")
    (mine / "_SUCCESS").write_text("{}")  # even one that looks complete
    keys = [run_nightly(at(nightly_config(input=str(inp), seed=s, **FAST), work, keep_runs=1))["run_key"]
            for s in range(2)]
    names = sorted(p.name for p in (work / "runs").iterdir())
    assert names == sorted([keys[-1], "myproject"])
    assert (mine / "thesis.tex").read_text() == "x" and (mine / "sub").is_dir()


def test_run_of_an_earlier_version_is_recognised_by_manifest_and_marker(tmp_path):
    run = tmp_path / "runs" / "00000000000000aa"
    (run / "shards").mkdir(parents=True)
    assert not nightly.store.is_our_run(run)
    (run / "shards" / "_manifest.json").write_text("{}")
    (run / "_SUCCESS").write_text("{}")
    assert nightly.store.is_our_run(run)
    assert nightly.store.is_our_run(tmp_path / "runs" / "00000000000000bb", recorded={"00000000000000bb"}) is False
    (tmp_path / "runs" / "00000000000000bb").mkdir()
    assert nightly.store.is_our_run(tmp_path / "runs" / "00000000000000bb", recorded={"00000000000000bb"})


@pytest.mark.parametrize("where", ["inside", "is"])
def test_output_inside_another_jobs_shards_is_refused_before_the_lock(tmp_path, capsys, where):
    inp = write_samples(tmp_path / "in.parquet", n=300)
    shards = tmp_path / "shards"
    assert fsdata_main(["balance", str(inp), str(shards), "--ranks", "2", "--batch-size-per-rank", "8",
                        "--no-progress"]) == 0
    before = sorted(p.name for p in shards.rglob("*"))
    work = shards / "rank-00000" / "w" if where == "inside" else shards
    with pytest.raises(ConfigError, match="fsdata balance OUTPUT"):
        run_nightly(at(nightly_config(input=str(inp), **FAST), work))
    assert sorted(p.name for p in shards.rglob("*")) == before
    assert fsdata_main(["verify", str(shards), "--input", str(inp), "--no-progress"]) == 0


def test_cost_model_and_config_inside_the_work_folder_are_inputs(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=300)
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    cm = work / "runs" / "cm.json"
    cm.write_text('{"name": "poly", "coefficients": [0, 1, 0]}')
    cfg = nightly_config(input=str(inp), cost_model=str(cm), **FAST)
    with pytest.raises(ConfigError, match="--cost-model"):
        run_nightly(at(cfg, work))
    conf = work / "c.yaml"
    conf.write_text("job:\n  keep_runs: 2\n")
    capsys.readouterr()
    assert nightly.main(["--config", str(conf), "-o", str(work), "--input", str(inp), "--format", "samples",
                         "--ranks", "2", "--batch-size-per-rank", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--config" in err and len(err.splitlines()) == 1 and Path(conf).exists() and cm.exists()
