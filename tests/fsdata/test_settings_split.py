"""One settings object from flag to file, checked once (issue 40): ``PlanSettings`` (what the plan
depends on and records) and ``RunSettings`` (what never changes the output) check themselves on
construction; ``BalanceSettings`` is both; the flags are generated from the fields, spellings
included; ``fsdata write`` takes the plan's own planning settings."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fsdata
from fsdata.balancer.plan import make_plan
from fsdata.balancer.settings import BalanceSettings, PlanSettings, RunSettings
from fsdata.cli import main, parse_args
from fsdata.errors import ConfigError, cli_terms
from fsdata.samples.settings import ConvertSettings
from fsdata.shards.plan_file import read_plan
from tests.fsdata.helpers import write_samples

RB = {"num_ranks": 2, "batch_size_per_rank": 4}

#: (bad setting, the message's start from Python, from a command line): the messages of 0.3.
BAD: list[tuple[dict, str, str]] = [
    ({"num_ranks": 0}, "num_ranks must be >= 1, got 0", "--ranks must be >= 1, got 0"),
    ({"batch_size_per_rank": 0}, "batch_size_per_rank must be >= 1, got 0", "--batch-size-per-rank must be >= 1"),
    ({"seed": -1}, "--seed must be an integer in 0..", "--seed must be an integer in 0.."),
    ({"compose_window": 0}, "compose_window must be an integer >= 1", "--compose-window must be an integer >= 1"),
    ({"plan_window": 0}, "plan_window must be an integer >= 1", "--plan-window must be an integer >= 1"),
    ({"epochs": 0}, "--epochs must be an integer >= 1, got 0", "--epochs must be an integer >= 1, got 0"),
    ({"strategy": "best"}, "unknown --strategy 'best'", "unknown --strategy 'best'"),
    ({"num_threads": 0}, "--num-threads must be an integer in 1..4096", "--num-threads must be an integer in 1..4096"),
]


@pytest.mark.parametrize("bad,python,cli", BAD, ids=[next(iter(b)) for b, _, _ in BAD])
def test_settings_check_themselves_in_the_callers_terms(bad, python, cli):
    cls = RunSettings if "num_threads" in bad else PlanSettings
    for make in (cls, BalanceSettings):
        kw = bad if cls is RunSettings and make is RunSettings else {**RB, **bad}
        with pytest.raises(ConfigError) as e:
            make(**kw)
        assert str(e.value).startswith(python) and "\n" not in str(e.value)
        with cli_terms(), pytest.raises(ConfigError) as e:
            make(**kw)
        assert str(e.value).startswith(cli)


def test_library_functions_given_loose_values_fail_clearly():
    """make_plan makes its PlanSettings (which check themselves); fsdata.balance gets a settings object."""
    with pytest.raises(ConfigError, match="^num_ranks must be >= 1, got 0"):
        make_plan(np.ones(100), num_ranks=0, batch_size_per_rank=4)
    with pytest.raises(ConfigError, match="^unknown --batch-policy 'x'"):
        make_plan(np.ones(100), num_ranks=2, batch_size_per_rank=4, batch_policy="x")


def test_balance_settings_is_plan_and_run_settings():
    s = BalanceSettings(**RB, seed=3, compose_window=4, num_threads=1, engine="local", progress=False)
    assert isinstance(s, PlanSettings) and isinstance(s, RunSettings)
    assert s.plan_settings == PlanSettings(**RB, seed=3, compose_window=4)
    assert s.run_settings == RunSettings(num_threads=1, progress=False)
    assert BalanceSettings.of(s.plan_settings, s.run_settings) == s
    plan = {f.name for f in dataclasses.fields(PlanSettings)}
    run = {f.name for f in dataclasses.fields(RunSettings)}
    assert not plan & run and {"num_threads", "engine", "bucket_compression", "ray_address"} <= run
    assert {f.name for f in dataclasses.fields(BalanceSettings)} == plan | run | {"num_workers"}
    assert fsdata.BalanceSettings is BalanceSettings


def test_spellings_live_on_the_fields():
    """--ranks and --header are declared once, on the field, and parse straight into it."""
    assert {f.name: f.metadata.get("flag") for f in dataclasses.fields(PlanSettings)}["num_ranks"] == "--ranks"
    assert {f.name: f.metadata.get("flag") for f in dataclasses.fields(ConvertSettings)}["has_header"] == "--header"
    a = parse_args(["balance", "in", "out", "--ranks", "3", "--batch-size-per-rank", "5", "--bucket-compression",
                    "none"])
    assert (a.balance.num_ranks, a.balance.batch_size_per_rank, a.balance.bucket_compression) == (3, 5, "none")
    c = parse_args(["convert", "log.csv", "out.parquet", "--format", "events", "--header"])
    assert c.convert.has_header is True and c.convert.format == "events"


def test_write_takes_the_plans_own_planning_settings(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), "--ranks", "2", "--batch-size-per-rank", "8", "--seed", "5",
                 "--compose-window", "2", "--partitioner", "lpt"]) == 0
    meta = read_plan(plan).meta
    s = meta.balance_settings(num_threads=1, engine="local")
    assert (s.num_ranks, s.batch_size_per_rank, s.seed, s.compose_window, s.partitioner) == (2, 8, 5, 2, "lpt")
    assert s.num_threads == 1 and meta.plan_settings() == s.plan_settings
    with pytest.raises(TypeError):  # a planning setting cannot be given beside the plan
        meta.balance_settings(num_ranks=3)
    with pytest.raises(SystemExit):  # nor on the command line
        parse_args(["write", str(inp), str(plan), str(tmp_path / "o"), "--ranks", "3"])
    capsys.readouterr()


def test_convert_takes_convert_settings(tmp_path):
    """convert(input, output, ConvertSettings(...)) writes what the keywords write, byte for byte."""
    from fsdata.samples.convert import convert

    log = tmp_path / "log.txt"
    log.write_text("".join(f"{u} {' '.join(str(1 + (u * 7 + i) % 50) for i in range(2 + u % 9))}\n"
                           for u in range(1, 40)))
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    convert(log, a, fmt="sequences", samples="per-user", max_seq_len=5, progress=False)
    convert(log, b, ConvertSettings(format="sequences", samples="per-user", max_seq_len=5), progress=False)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("bad,message", [({"samples": "per-day"}, "unknown --samples 'per-day'"),
                                         ({"bad_lines": "drop"}, "unknown --bad-lines 'drop'"),
                                         ({"max_seq_len": 0}, "--max-seq-len must be an integer in 1..")])
def test_convert_settings_check_themselves(bad, message, tmp_path):
    from fsdata.samples.convert import convert

    with pytest.raises(ConfigError, match=f"^{message}"):
        ConvertSettings(**bad)
    with pytest.raises(ConfigError, match=f"^{message}"):  # the same check, from loose keywords
        convert(tmp_path / "log.txt", tmp_path / "out.parquet", fmt="sequences", **bad)
    assert not (tmp_path / "out.parquet").exists()
