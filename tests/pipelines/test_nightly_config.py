"""The nightly job's settings are declared once (:mod:`pipelines.nightly.config`): its flags are
generated from the dataclass fields, the flags it shares with ``fsdata balance`` / ``fsdata convert``
have the fields' names, defaults and choices there too, ``--config`` / ``--print-config`` round-trip,
and the run key hashes exactly the settings that change the output."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from fsdata.common.cli import action_choices
from fsdata.samples.settings import ConvertSettings
from fsdata.balancer.settings import BalanceSettings
from pipelines import nightly
from pipelines.nightly.config import NO_FLAG, NOT_IN_KEY, SECTIONS, JobSettings, NightlyConfig
from tests.pipelines.helpers import nightly_config

#: fsdata convert reads logs only and asks which kind (``--format`` required); the job also takes
#: sample Parquet (``format: samples``) and defaults to the field's ``sequences``.
SUBSET_CHOICES_IN_FSDATA = REQUIRED_IN_FSDATA = {"--format"}


def _ours() -> dict[str, argparse.Action]:
    return {s: a for a in nightly.build_parser()._actions for s in a.option_strings}


def _fsdata(command: str) -> dict[str, argparse.Action]:
    from fsdata.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}


def _field(cls: type, name: str) -> tuple[object, object, tuple | None]:
    """(default or MISSING, type hint, choices spelled as on a command line or None)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    lits = [a for a in args if typing.get_origin(a) is typing.Literal]
    if typing.get_origin(hint) is typing.Literal:
        choices = args
    elif lits:
        choices = ("none", *typing.get_args(lits[0]))
    else:
        choices = None
    return f.default, hint, choices


def test_every_field_has_one_flag_with_help_and_its_default():
    ours = _ours()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            acts = [a for a in set(ours.values()) if a.dest == f"{section}.{f.name}"]
            if f.name in NO_FLAG.get(section, ()):
                assert not acts, (section, f.name)
                continue
            assert acts, f"{section}.{f.name} has no flag"
            default, _, choices = _field(cls, f.name)
            for a in acts:
                assert a.help and a.help != f.name, f"{a.option_strings}: no help from the field's docstring"
                want = None if default is dataclasses.MISSING else default
                assert a.default == ("none" if want is None and choices and choices[0] == "none" else want), a.dest


def test_flags_shared_with_fsdata_match_the_settings_fields():
    ours, checked = _ours(), set()
    for command, section, cls in (("convert", "convert", ConvertSettings), ("balance", "balance", BalanceSettings)):
        theirs = _fsdata(command)
        for flag, act in ours.items():
            if flag not in theirs or not act.dest.startswith(section + "."):
                continue
            name = act.dest.split(".", 1)[1]
            default, hint, choices = _field(cls, name)
            their = theirs[flag]
            assert their.dest == f"{section}.{name}", (flag, their.dest, name)
            if default is dataclasses.MISSING or flag in REQUIRED_IN_FSDATA:
                assert their.required, f"fsdata {command} {flag}: the field has no default, the flag must be required"
            elif isinstance(their, argparse._StoreFalseAction):
                assert default is None, flag  # --no-header: the namespace default is --header's (checked there)
            else:
                assert their.default == ("none" if default is None and choices and choices[0] == "none" else default), (
                    f"fsdata {command} {flag} default {their.default!r} != {cls.__name__}.{name} {default!r}")
            if choices is not None:
                if flag in SUBSET_CHOICES_IN_FSDATA:
                    assert set(their.choices) < set(choices), flag
                else:
                    assert action_choices(their) == choices, (flag, action_choices(their), choices)
            elif their.type in (int, float):
                assert their.type in typing.get_args(hint) + (hint,), (flag, their.type, hint)
            checked.add(flag)
    assert {"--ranks", "--batch-size-per-rank", "--cost-model", "--columns", "--seed", "--strategy", "--batch-policy",
            "--budget", "--partitioner", "--remainder", "--compose-window", "--plan-window", "--epochs",
            "--num-threads", "--bucket-compression", "--engine", "--ray-address", "--format", "--samples",
            "--max-seq-len", "--user-col", "--item-col", "--time-col", "--sep", "--header", "--no-header"} <= checked


def test_a_wrong_choice_is_one_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        nightly.build_parser().parse_args(["-o", "w", "--strategy", "fast"])
    assert e.value.code == 2 and "fast" in capsys.readouterr().err


def test_print_config_round_trips_through_config(tmp_path, capsys):
    argv = ["--input", "log.txt", "-o", str(tmp_path / "w"), "--ranks", "4", "--batch-size-per-rank", "8",
            "--no-header", "--strategy", "shuffle", "--lock-timeout", "2.5", "--bucket-compression", "lz4"]
    assert nightly.main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "balance:\n  num_ranks: 4\n" in text and "has_header: false" in text and "lock_timeout_seconds: 2.5" in text
    (tmp_path / "c.yaml").write_text(text)
    assert nightly.main(["--config", str(tmp_path / "c.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == text
    # flags after --config override it; the resolved settings are what a run gets
    from pipelines.nightly.cli import config_from_args

    a = nightly.build_parser().parse_args(["--config", str(tmp_path / "c.yaml"), "--seed", "7", "--no-progress"])
    cfg = config_from_args(a)
    assert cfg.balance == BalanceSettings(num_ranks=4, batch_size_per_rank=8, strategy="shuffle", seed=7,
                                          bucket_compression="lz4", progress=False)
    assert cfg.convert == ConvertSettings(input="log.txt", has_header=False)
    assert cfg.job == JobSettings(output=str(tmp_path / "w"), lock_timeout_seconds=2.5)
    # "none" on the command line is None in the settings
    a = nightly.build_parser().parse_args(["--ranks", "2", "--batch-size-per-rank", "2",
                                           "--bucket-compression", "none"])
    assert config_from_args(a).balance.bucket_compression is None


def test_config_file_with_an_unknown_setting_is_one_usage_error(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("balance:\n  num_rankz: 4\n")
    with pytest.raises(SystemExit) as e:
        nightly.main(["--config", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "w")])
    assert e.value.code == 2 and "num_rankz" in capsys.readouterr().err


def test_missing_ranks_is_one_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        nightly.main(["--input", "x", "-o", str(tmp_path / "w")])
    assert e.value.code == 2 and "--ranks, --batch-size-per-rank" in capsys.readouterr().err


def test_run_key_hashes_exactly_the_settings_that_change_the_output():
    base = nightly_config(input="x", format="samples", num_ranks=4, batch_size_per_rank=8, partitioner="lpt-swap",
                          seed=3, extra={"v": 1})
    key = nightly.run_key(base, "d")
    # the key the flat NightlyConfig gave before the settings were nested (computed with that code):
    # existing runs stay up to date
    assert key == "ba422bc0e3c5d77c"
    same = {"num_threads": 5, "progress": True, "bucket_compression": "zstd", "overwrite": True, "engine": "ray",
            "ray_address": "head:6379"}
    assert set(same) | {"num_workers"} == NOT_IN_KEY
    for name, value in same.items():
        cfg = dataclasses.replace(base, balance=dataclasses.replace(base.balance, **{name: value}))
        assert nightly.run_key(cfg, "d") == key, name
    cfg = dataclasses.replace(base, job=JobSettings(output="elsewhere", keep_runs=9, lock_timeout_seconds=3.0))
    assert nightly.run_key(dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, extra={"v": 1})), "d") == key
    changed = {"convert": {"format": "sequences", "samples": "per-user", "max_seq_len": 50, "user_col": "u",
                           "item_col": "i", "time_col": "t", "sep": ",", "has_header": True, "remap_ids": True,
                           "vocab": "v.vocab", "bad_lines": "skip", "feature_cols": "r"},
               "balance": {"num_ranks": 8, "batch_size_per_rank": 4, "cost_model": "tokens", "columns": "sample_id=id",
                           "seed": 4, "strategy": "shuffle", "batch_policy": "cost-budget", "remainder": "error",
                           "partitioner": "kk", "budget": 9.0, "compose_window": 8, "plan_window": 64, "epochs": 2,
                           "from_step": 5},
               "job": {"extra": {"v": 2}}}
    for section, values in changed.items():
        declared = {f.name for f in dataclasses.fields(SECTIONS[section])}
        if section != "job":
            assert declared - set(values) <= ({"input"} | NOT_IN_KEY), (section, declared - set(values))
        for name, value in values.items():
            cfg = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **{name: value})})
            assert nightly.run_key(cfg, "d") != key, f"{section}.{name} does not enter the run key"
    assert nightly.run_key(base, "e") != key


def test_nightly_config_needs_the_balance_settings():
    with pytest.raises(TypeError):
        NightlyConfig()  # num_ranks and batch_size_per_rank have no default
