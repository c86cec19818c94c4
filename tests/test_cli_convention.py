"""One CLI convention for every entry point (README.md, "CLI conventions"; flags in fsdata/common/cli.py).

Every parser of ``fsdata``, ``fstrain``, ``python -m pipelines.nightly`` and ``python -m
pipelines.demo`` (every subcommand) has ``--version``, ``-v/--verbose`` and ``-q/--quiet``;
``--progress/--no-progress`` where it shows progress; ``--json`` where it prints a summary; the
output location (where it is not one of fsdata's positional OUTPUT/PLAN arguments) is
``-o/--output``; thread counts are ``--num-threads``. The old spellings (``--out``, ``--work-dir``,
``--num-workers``, ``--threads``) are gone (0.3.0): a usage error, never a prefix of the new flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdata.common.cli import OUR_LOGGERS, package_version

ROOT = Path(__file__).resolve().parents[1]
DEPRECATED = ("--out", "--work-dir", "--threads", "--num-workers")


#: Named second outputs of a command that also has its main output location.
SECOND_OUTPUTS = {"--holdout-output"}

def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _parsers() -> list[tuple[str, argparse.ArgumentParser, bool]]:
    """(name, parser, shows progress) for every command of every entry point."""
    from fsdata.cli import build_parser as fsdata_parser
    from fstrain.cli import build_parser as fstrain_parser
    from pipelines.demo import build_parser as demo_parser
    from pipelines.nightly import build_parser as nightly_parser

    out = [(f"fsdata {n}", p, True) for n, p in _subcommands(fsdata_parser()).items()]
    out += [(f"fstrain {n}", p, n != "report" and n != "evaluate" or _has(p, "--no-progress"))
            for n, p in _subcommands(fstrain_parser()).items()]
    return out + [("nightly", nightly_parser(), True), ("demo", demo_parser(), True)]


def _visible(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def _has(p: argparse.ArgumentParser, flag: str) -> bool:
    return flag in _visible(p)


PARSERS = _parsers()


def test_every_entry_point_has_subcommands_covered():
    names = {n for n, _, _ in PARSERS}
    assert {"fsdata convert", "fsdata profile", "fsdata balance", "fsdata plan", "fsdata write", "fsdata finalize",
            "fsdata verify", "fsdata synth", "fsdata report", "fstrain train", "fstrain replay",
            "fstrain calibrate", "fstrain report", "nightly", "demo"} <= names


@pytest.mark.parametrize("name,parser,progress", PARSERS, ids=[n for n, _, _ in PARSERS])
def test_parser_follows_the_convention(name, parser, progress):
    flags = _visible(parser)
    assert "--version" in flags and isinstance(flags["--version"], argparse._VersionAction), name
    assert flags["-v"] is flags["--verbose"] and flags["-q"] is flags["--quiet"], name
    assert "--json" in flags, f"{name}: prints a summary but has no --json"
    if progress:
        assert flags["--no-progress"] is flags["--progress"] and flags["--progress"].dest == "progress", name
    for old in DEPRECATED:
        assert old not in flags, f"{name}: {old} is visible; use the convention's name"
    # the output location is -o/--output; a command's second, named output is --<what>-output
    # (fsdata convert --holdout-output), never a bare --out/--work-dir
    out = [s for s in flags if (s.endswith("output") and s not in SECOND_OUTPUTS) or s == "-o"]
    assert not out or set(out) == {"-o", "--output"} and flags["-o"] is flags["--output"], (name, out)
    threads = [s for s in flags if "thread" in s or "worker" in s]
    assert threads in ([], ["--num-threads"]), (name, threads)
    for a in parser._actions:  # deprecated spellings: hidden, and they store where the new flag does
        hidden = [s for s in a.option_strings if s in DEPRECATED]
        if hidden:
            assert a.help == argparse.SUPPRESS, (name, hidden)
            assert any(b.dest == a.dest and b.help != argparse.SUPPRESS for b in parser._actions), (name, hidden)


def test_top_level_parsers_have_version():
    from fsdata.cli import build_parser as fsdata_parser
    from fstrain.cli import build_parser as fstrain_parser

    for p in (fsdata_parser(), fstrain_parser()):
        assert "--version" in _visible(p)


def _nightly(argv):
    from pipelines.nightly import build_parser

    return build_parser().parse_args(argv)


def _demo(argv):
    from pipelines.demo import build_parser

    return build_parser().parse_args(argv)


def _fsdata(argv):
    from fsdata.cli import parse_args

    return parse_args(argv)


def _fstrain(argv):
    from fstrain.cli import parse_args

    return parse_args(argv)


BAL = ["balance", "in.parquet", "out", "--ranks", "2", "--batch-size-per-rank", "2"]
REMOVED = [  # (parse, argv with a spelling removed in 0.3.0): a usage error now
    (_fsdata, BAL + ["--num-workers", "3"]),
    (_fsdata, ["write", "in.parquet", "plan.parquet", "out", "--num-workers", "3"]),
    (_nightly, ["--work-dir", "w", "--input", "x"]),
    (_nightly, ["--output", "w", "--num-workers", "3"]),
    (_fstrain, ["replay", "shards", "--out", "r.json"]),
    (_fstrain, ["evaluate", "ckpt", "eval.parquet", "--out", "r.json"]),
    (_fstrain, ["replay", "shards", "--threads", "2"]),
    (_fstrain, ["calibrate", "-o", "c.json", "--threads", "2"]),
]  # (demo's ``--out`` still parses: argparse reads it as an abbreviation of ``--output``)


@pytest.mark.parametrize("parse,argv", REMOVED, ids=[f"{a[1][0]}-{a[1][-2]}" for a in REMOVED])
def test_removed_spelling_is_a_usage_error(parse, argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    old = next(s for s in argv if s in DEPRECATED)
    err = capsys.readouterr().err
    assert e.value.code == 2 and old in err, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].count("error:") == 1, err


def test_new_names_have_the_old_defaults():
    assert _fsdata(BAL).balance.num_threads == 2 and _nightly(["-o", "w"]).balance.num_threads == 2
    assert _fstrain(["replay", "s"]).num_threads == 1 and _fstrain(["replay", "s"]).output is None
    assert _nightly(["-o", "w"]).job.output == "w"


def test_nightly_without_output_is_one_usage_error(capsys):
    from pipelines.nightly import main

    with pytest.raises(SystemExit) as e:
        main(["--input", "x"])
    assert e.value.code == 2 and "-o/--output" in capsys.readouterr().err


def test_verbose_and_quiet_set_our_loggers(tmp_path, capsys):
    from fsdata.cli import main

    saved = {n: logging.getLogger(n).level for n in OUR_LOGGERS}
    try:
        assert main(["verify", str(tmp_path / "absent"), "-v"]) == 2
        assert all(logging.getLogger(n).level == logging.DEBUG for n in OUR_LOGGERS)
        assert main(["verify", str(tmp_path / "absent"), "-q"]) == 2
        assert all(logging.getLogger(n).level == logging.ERROR for n in OUR_LOGGERS)
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
    assert "fsdata: error:" in capsys.readouterr().err


@pytest.mark.parametrize("module,name", [("fsdata", "fsdata"), ("fstrain.cli", "fstrain"),
                                         ("pipelines.nightly", "python -m pipelines.nightly"),
                                         ("pipelines.demo", "python -m pipelines.demo")])
def test_version_exits_0_and_prints_the_version(module, name):
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{name} {package_version()}"
    assert package_version()[0].isdigit()


def test_python_api_takes_num_threads_and_the_old_keyword():
    from fsdata import BalanceSettings

    assert BalanceSettings(num_ranks=2, batch_size_per_rank=2).num_threads == 2
    with pytest.warns(DeprecationWarning, match="num_threads"):
        s = BalanceSettings(num_ranks=2, batch_size_per_rank=2, num_workers=3)
    assert s.num_threads == 3 and s.num_workers is None
