"""Each flag and default is declared once: every settings flag of ``fsdata``, ``fstrain`` and the
nightly job is compared with the dataclass field it comes from (name, default, choices, help), and a
field shared by several command lines reads the same in each of them.

The expectations are computed here from the dataclasses, their docstrings and the registries of
names (models, pipelines, backends, ...), not from the generator's own tables of types.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from fsdata.common.cli import action_choices, settings_help, subparsers
from fsdata.samples.settings import ConvertSettings
from fsdata.balancer.settings import BalanceSettings


def _fsdata_sections(command: str) -> dict:
    return {"balance": (BalanceSettings, None), "convert": (ConvertSettings, None)}


def _nightly_sections() -> dict:
    from pipelines.nightly.config import SECTIONS

    return {name: (cls, None) for name, cls in SECTIONS.items()}


def _fstrain_sections(command: str) -> dict:
    from fstrain.cli import REPLAY_MODEL_DEFAULTS
    from fstrain.config import (KEY_ROOT, CalibrateConfig, EvaluateConfig, ReplayConfig, TimingConfig, TrainConfig,
                                get_path, sections)
    from fstrain.models.config import Config

    train = TrainConfig(shards="s")
    if command == "train":
        return {f"{KEY_ROOT}.{p}".rstrip("."): (cls, get_path(train, p) if p else train)
                for p, cls in sections(TrainConfig)}
    out = {KEY_ROOT: (TrainConfig, train)}
    if command == "evaluate":
        out.update({f"{KEY_ROOT}.evaluate": (EvaluateConfig, EvaluateConfig()),
                    f"{KEY_ROOT}.model": (Config, "override")})
    elif command == "replay":
        out.update({f"{KEY_ROOT}.replay": (ReplayConfig, ReplayConfig()),
                    f"{KEY_ROOT}.replay.timing": (TimingConfig, ReplayConfig().timing),
                    f"{KEY_ROOT}.model": (Config, Config(**REPLAY_MODEL_DEFAULTS))})
    elif command == "calibrate":
        out.update({f"{KEY_ROOT}.calibrate": (CalibrateConfig, CalibrateConfig()),
                    f"{KEY_ROOT}.calibrate.timing": (TimingConfig, CalibrateConfig().timing),
                    f"{KEY_ROOT}.model": (Config, Config())})
    return out


def _registries() -> dict[tuple, tuple]:
    """Choices of ``str`` fields, by (class, field): each from the registry that defines the names."""
    from fsdata.balancer.partitioners import names as partitioner_names
    from fsdata.engines import names as engine_names
    from fstrain.config import EvaluateConfig
    from fstrain.distributed.backends import BACKEND_CHOICES
    from fstrain.distributed.comm import CommConfig
    from fstrain.distributed.optim import SPARSE_OPTIMIZERS, OptimConfig
    from fstrain.models.config import ATTENTIONS, MODELS, NEGATIVE_MODES, OBJECTIVES, Config
    from fstrain.pipelines import NO_PIPELINE, PIPELINE_NAMES, STEP_MODES, PipelineConfig

    out: dict[tuple, tuple] = {
        (Config, "model"): MODELS.names(), (Config, "objective"): OBJECTIVES, (Config, "negatives"): NEGATIVE_MODES,
        (Config, "attention"): ATTENTIONS, (OptimConfig, "sparse_optimizer"): SPARSE_OPTIMIZERS,
        (PipelineConfig, "name"): (*PIPELINE_NAMES, NO_PIPELINE), (PipelineConfig, "step_mode"): STEP_MODES,
        (CommConfig, "backend"): BACKEND_CHOICES, (EvaluateConfig, "backend"): BACKEND_CHOICES,
        (BalanceSettings, "partitioner"): tuple(partitioner_names()),
        (BalanceSettings, "engine"): tuple(engine_names())}
    return out


def _parsers() -> list[tuple[str, argparse.ArgumentParser, dict]]:
    from fsdata.cli import build_parser as fsdata_parser
    from fstrain.cli import build_parser as fstrain_parser
    from pipelines.nightly import build_parser as nightly_parser

    out = [(f"fsdata {n}", p, _fsdata_sections(n)) for n, p in subparsers(fsdata_parser()).items()]
    out += [(f"fstrain {n}", p, _fstrain_sections(n)) for n, p in subparsers(fstrain_parser()).items()]
    return out + [("nightly", nightly_parser(), _nightly_sections())]


PARSERS = _parsers()


def _expected_default(cls: type, name: str, instance: object):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if instance == "override":
        return None
    if instance is not None:
        return getattr(instance, name)
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _expected_choices(cls: type, name: str) -> tuple | None:
    reg = _registries().get((cls, name))
    if reg is not None:
        return tuple(reg)
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
        return ("none", *typing.get_args(args[0]))
    return None


def _field_flags(parser: argparse.ArgumentParser, table: dict) -> list[tuple[argparse.Action, type, str, object]]:
    """``(action, class, field, defaults instance)`` of every flag whose namespace key is a field of a section."""
    out = []
    for a in parser._actions:
        if not a.option_strings or "." not in a.dest:
            continue
        section, name = a.dest.rsplit(".", 1)
        if section in table:
            cls, instance = table[section]
            out.append((a, cls, name, instance))
    return out


@pytest.mark.parametrize("label,parser,table", PARSERS, ids=[p[0] for p in PARSERS])
def test_every_settings_flag_is_its_field(label, parser, table):
    flags = _field_flags(parser, table)
    assert flags or label in ("fsdata finalize", "fsdata synth", "fstrain report"), f"{label}: no settings flags"
    for a, cls, name, instance in flags:
        where = f"{label} {'/'.join(a.option_strings)} ({cls.__name__}.{name})"
        assert name in {f.name for f in dataclasses.fields(cls)}, where
        hint = typing.get_type_hints(cls)[name]
        default = _expected_default(cls, name, instance)
        # help: the field's docstring (marked when the flag is required; "not --x" for the --no-x of a bool | None)
        doc = settings_help(cls)[name]
        assert doc, f"{where}: the field has no docstring"
        text = (a.help or "").replace("%%", "%")
        assert text in (doc, f"{doc} (required)") or text.startswith("not --") and hint == bool | None, (where, text)
        if (cls, name) == (ConvertSettings, "format") and label == "fsdata convert":
            # fsdata convert reads logs only and asks which kind; the job also takes sample Parquet
            assert a.required and set(action_choices(a)) < set(_expected_choices(cls, name)), where
            continue
        # default (required when the field has none)
        if default is dataclasses.MISSING:
            assert a.required or a.default is None, where
            continue
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
            base = typing.get_args(hint) and hint == bool | None
            assert hint is bool or base, where
            negated = all(s.startswith("--no-") for s in a.option_strings)
            assert negated == isinstance(a, argparse._StoreFalseAction), where
            if not base and instance != "override":
                assert isinstance(a, argparse._StoreFalseAction) == (default is True), where
            assert a.default == (None if instance == "override" or base else default), where
            continue
        choices = _expected_choices(cls, name)
        want = list(default) if isinstance(default, tuple) else default
        if want is None and choices and choices[0] == "none":
            want = "none"
        assert a.default == want, (where, a.default, want)
        assert action_choices(a) == choices, (where, action_choices(a), choices)


def test_every_field_has_a_flag():
    """No setting is out of reach of a command line: the fields without a flag are listed with the reason."""
    by_label = {label: (parser, table) for label, parser, table in PARSERS}
    no_flag = {  # field -> why it has no flag of its own
        (BalanceSettings, "progress"): "--progress/--no-progress (every command)",
        (BalanceSettings, "num_workers"): "removed spelling of num_threads",
        (ConvertSettings, "input"): "positional INPUT",
    }
    from fstrain.config import NOT_FLAGS, TrainConfig, walk_fields

    for label, cls, section in (("fsdata balance", BalanceSettings, "balance"),
                                ("fsdata convert", ConvertSettings, "convert")):
        parser, table = by_label[label]
        have = {name for _, _, name, _ in _field_flags(parser, table)}
        missing = {f.name for f in dataclasses.fields(cls)} - have - {n for (c, n) in no_flag if c is cls}
        assert missing <= ({"format"} if cls is ConvertSettings else set()), (label, missing)
    parser, table = by_label["fstrain train"]
    have = {a.dest.split(".", 1)[1] for a, *_ in _field_flags(parser, table)}
    want = {p for p, f, *_ in walk_fields(TrainConfig)} - NOT_FLAGS - {"shards"}
    assert want == have, (want - have, have - want)
    for label in ("fstrain evaluate", "fstrain replay", "fstrain calibrate"):
        parser, table = by_label[label]
        for section, (cls, _) in table.items():
            if cls is TrainConfig:
                continue
            have = {name for _, c, name, _ in _field_flags(parser, table) if c is cls}
            sections = {f.name for f in dataclasses.fields(cls) if f.name == "timing"}  # a section of its own
            assert have == {f.name for f in dataclasses.fields(cls)} - sections, (label, cls.__name__)


def test_a_field_reads_the_same_in_every_command_line():
    """The same field under the same flag: same help and choices everywhere (fsdata and the nightly
    job share ``ConvertSettings`` and ``BalanceSettings``; fstrain's commands share the model's)."""
    seen: dict[tuple[type, str, str], tuple[str, str, object]] = {}
    shared = 0
    for label, parser, table in PARSERS:
        for a, cls, name, instance in _field_flags(parser, table):
            key = (cls, name, a.option_strings[-1])
            if (cls, name) == (ConvertSettings, "format"):
                continue  # fsdata convert: logs only (checked above)
            got = ((a.help or "").removesuffix(" (required)"), action_choices(a))
            if key in seen:
                shared += 1
                assert got == seen[key][1:], (label, seen[key][0], key)
            else:
                seen[key] = (label, *got)
    assert shared > 40, shared


def test_flag_names_are_the_public_ones():
    """The option strings of earlier releases (public contracts) are the generated ones."""
    from fsdata.cli import build_parser as fsdata_parser

    balance = {s for a in subparsers(fsdata_parser())["balance"]._actions for s in a.option_strings}
    assert {"--ranks", "--batch-size-per-rank", "--cost-model", "--columns", "--seed", "--strategy", "--batch-policy",
            "--remainder", "--partitioner", "--budget", "--compose-window", "--plan-window", "--num-threads",
            "--bucket-compression", "--overwrite", "--engine", "--ray-address", "--epochs"} <= balance
    convert = {s for a in subparsers(fsdata_parser())["convert"]._actions for s in a.option_strings}
    assert {"--format", "--samples", "--max-seq-len", "--user-col", "--item-col", "--time-col", "--sep", "--header",
            "--no-header", "--holdout", "--holdout-output", "--overwrite"} <= convert
    from fstrain.cli import build_parser as fstrain_parser

    sub = subparsers(fstrain_parser())
    names = {n: {s for a in p._actions for s in a.option_strings} for n, p in sub.items()}
    assert {"--k", "--batch-size", "--no-mask-history", "--padding-id", "--max-users", "--backend", "-o", "--output",
            "--embedding-dim", "--no-l2-normalize", "--seed"} <= names["evaluate"]
    assert {"--baseline", "--max-steps", "--statistic", "--no-null-control", "--warmup", "--repeats", "--device",
            "--num-threads", "--clock", "--seed", "--embedding-dim"} <= names["replay"]
    assert {"--lengths", "--batch-sizes", "--mixed", "--from-shards", "--shard-steps", "--name", "--warmup",
            "--repeats", "--num-threads", "--clock", "-o", "--output"} <= names["calibrate"]
