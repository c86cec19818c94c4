"""Errors name the fix in the caller's terms (one table, two renderings); an empty OUTPUT folder is free."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import fsdata
from fsdata.cli import build_parser, main
from fsdata.errors import SETTINGS, ConfigError, FsdataError, InputError, cli_terms, in_cli, setting
from tests.fsdata.helpers import write_samples

BAL = ["--ranks", "2", "--batch-size-per-rank", "8", "--no-progress"]


def _settings(**kw) -> fsdata.BalanceSettings:
    return fsdata.BalanceSettings(**{"num_ranks": 2, "batch_size_per_rank": 8, "progress": False, **kw})


def test_one_table_matches_both_apis():
    """Every flag of the table is a flag of the CLI, every keyword a field or argument of its owner."""
    flags = {s for a in build_parser()._subparsers._group_actions[0].choices["balance"]._actions
             for s in a.option_strings}
    fields = {f.name for f in dataclasses.fields(fsdata.BalanceSettings)}
    from fstrain.data import ShardDataset
    for name, s in SETTINGS.items():
        if s.owner == "BalanceSettings":
            assert s.cli in flags and s.python in fields, (name, s)
        elif s.owner == "ShardDataset":
            assert s.python in inspect.signature(ShardDataset).parameters and s.cli == "--nproc-per-node"
    assert setting("overwrite", True) == "BalanceSettings(overwrite=True)"
    assert setting("remainder", "drop") == "BalanceSettings(remainder='drop')"
    with cli_terms():
        assert in_cli() and setting("overwrite", True) == "--overwrite" and setting("num_ranks", 4) == "--ranks 4"
    assert not in_cli()


def test_existing_output_python_names_the_setting_cli_the_flag(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=256)
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ConfigError) as e:
        fsdata.balance(inp, out, _settings())
    assert "BalanceSettings(overwrite=True)" in str(e.value) and "--overwrite" not in str(e.value)
    assert main(["balance", str(inp), str(out), *BAL]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "BalanceSettings" not in err and (out / "keep").exists()
    with pytest.raises(ConfigError, match="did not write"):  # a folder FreeScale did not write is never replaced
        fsdata.balance(inp, out, _settings(overwrite=True))
    assert (out / "keep").exists()
    (out / "keep").unlink()
    fsdata.balance(inp, out, _settings())
    fsdata.balance(inp, out, _settings(overwrite=True))
    assert (out / "_manifest.json").exists()


def test_impossible_sizes_in_each_callers_terms(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=100)
    with pytest.raises(InputError) as e:
        fsdata.balance(inp, tmp_path / "o", _settings(num_ranks=64, batch_size_per_rank=32))
    assert str(e.value).startswith("num_ranks=64, batch_size_per_rank=32 needs at least 2048 samples")
    assert "--ranks" not in str(e.value)
    with pytest.raises(ConfigError, match=r"BalanceSettings\(remainder='drop'\)"):
        fsdata.balance(inp, tmp_path / "o", _settings(remainder="error"))
    with pytest.raises(ConfigError, match="^compose_window must be"):
        fsdata.balance(inp, tmp_path / "o", _settings(compose_window=0))
    assert main(["balance", str(inp), str(tmp_path / "o"), "--ranks", "64", "--batch-size-per-rank", "32",
                 "--no-progress"]) == 2
    assert "--ranks 64 --batch-size-per-rank 32 needs at least 2048" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("how", ["python", "cli"])
def test_empty_existing_output_folder_is_accepted(tmp_path, how):
    inp = write_samples(tmp_path / "in.parquet", n=256)
    out = tmp_path / "made-ahead"
    out.mkdir()
    if how == "python":
        m = fsdata.balance(inp, out, _settings())
        assert m.num_ranks == 2
    else:
        assert main(["balance", str(inp), str(out), *BAL]) == 0
    assert (out / "_manifest.json").exists() and (out / "rank-00001").is_dir()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(FsdataError, match="already exists and is not empty"):  # now it holds an OUTPUT
        fsdata.balance(inp, out, _settings())


def test_reader_world_size_mismatch_in_each_callers_terms(tmp_path):
    from fstrain.data import ShardDataset
    from fstrain.errors import ShardMismatchError
    inp = write_samples(tmp_path / "in.parquet", n=256)
    fsdata.balance(inp, tmp_path / "o", _settings())
    with pytest.raises(ShardMismatchError) as e:
        ShardDataset(str(tmp_path / "o"), 0, 3)
    msg = str(e.value)
    assert "launch 2 processes (or a divisor of 2) and pass world_size=2" in msg
    assert "BalanceSettings(num_ranks=3, from_step=S, ...)" in msg
    assert "--nproc-per-node" not in msg
    with cli_terms(), pytest.raises(ShardMismatchError) as e:
        ShardDataset(str(tmp_path / "o"), 0, 3)
    assert "--nproc-per-node 2" in str(e.value) and f"fsdata balance {tmp_path / 'o'} NEW --ranks 3 --from-step S" \
        in str(e.value)


def test_column_mapping_and_cost_model_in_each_callers_terms(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=100)
    with pytest.raises(ConfigError) as e:
        fsdata.balance(inp, tmp_path / "o", _settings(columns="bogus"))
    assert str(e.value) == ("columns entry 'bogus' must be CONTRACT_NAME=YOUR_NAME, "
                            "e.g. BalanceSettings(columns='item_ids=history')")
    with pytest.raises(ConfigError, match=r"example: BalanceSettings\(cost_model='hstu:d_model=512,num_layers=8'\)"):
        fsdata.balance(inp, tmp_path / "o", _settings(cost_model="hstu:d_model"))
    assert main(["balance", str(inp), str(tmp_path / "o"), *BAL, "--columns", "bogus"]) == 2
    assert "--columns entry 'bogus' must be CONTRACT_NAME=YOUR_NAME, e.g. --columns item_ids=history" in \
        capsys.readouterr().err


def test_flag_spellings_come_from_the_fields():
    """The table holds every balance setting, spelled as its field declares (no second declaration)."""
    from pathlib import Path

    from fsdata.balancer.settings import PlanSettings, RunSettings
    from fsdata.errors import flag_of
    for cls in (PlanSettings, RunSettings):
        for f in dataclasses.fields(cls):
            assert SETTINGS[f.name].cli == flag_of(f) and SETTINGS[f.name].owner == "BalanceSettings"
    assert SETTINGS["num_ranks"].cli == "--ranks"
    assert '"--ranks"' not in (Path(fsdata.__file__).parent / "errors.py").read_text()
