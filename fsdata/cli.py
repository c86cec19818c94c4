"""``fsdata`` command line: convert, profile, balance (= plan, write, finalize), verify, synth.

Errors a user can cause print one line ``fsdata: error: ...`` on stderr and exit with status 2;
nothing is written in that case.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

# Arrow's allocator (mimalloc) keeps the pages it frees for reuse instead of handing them back to
# the OS at once: the write stage frees and allocates GBs of Arrow buffers, and every page handed
# back is faulted and zeroed again when reused (perf: 7.7% of the CPU at 20M samples). Measured at
# 20M (docs/results/bench_offline_stage.md): about 8% less wall time, +0.2 GiB peak RSS. Read
# when pyarrow loads, so it is set before the imports below load it; a value in the environment wins.
# ``fsdata convert`` is bounded by its peak memory (1 GiB on the 2 GB benchmark input, string ids included),
# not by those pages: it keeps mimalloc's default, and Polars' allocator (jemalloc) hands freed pages back at
# once (docs/results/bench_convert_strings.md: with the other changes there, 935 -> 510 MiB on a 0.24 GB log).
if sys.argv[1:2] == ["convert"]:
    os.environ.setdefault("_RJEM_MALLOC_CONF", "dirty_decay_ms:0,muzzy_decay_ms:0")
else:
    os.environ.setdefault("MIMALLOC_PURGE_DELAY", "-1")

from fsdata import fsio
from fsdata.common.cli import (add_common_flags, add_json_flag, add_settings_flags, add_subcommands, add_version_flag,
                               cli_main, configure_logging, new_parser, resolve_progress, settings_help,
                               settings_values)
from fsdata.errors import ConfigError, FsdataError, setting
from fsdata.atomic import check_replaceable
from fsdata.guards import check_output_apart
from fsdata.samples.settings import LOG_FORMATS, ConvertSettings
from fsdata.balancer.settings import BalanceSettings, PlanSettings, RunSettings, check_seed

log = logging.getLogger("fsdata")

_EPILOG_CONVERT = """examples:
  fsdata convert ../shared/datasets/ml-1m_ensfm/sequences.txt ml1m.parquet --format sequences \\
      --samples per-event --max-seq-len 512
  fsdata convert ratings.csv ml.parquet --format events --user-col userId --item-col Id --time-col timestamp
  fsdata convert beauty.txt beauty.parquet --format events        # 'user item' lines, no header
  fsdata convert sequences.txt train.parquet --format sequences --holdout last --holdout-output eval.parquet
"""
_EPILOG_PROFILE = """examples:
  fsdata profile ml1m.parquet --ranks 256 --batch-size-per-rank 32
  fsdata profile ml1m.parquet --ranks 16 --batch-size-per-rank 4 --cost-model hstu:d_model=512 --json
"""
_EPILOG_BALANCE = """examples:
  fsdata balance ml1m.parquet shards/ --ranks 256 --batch-size-per-rank 32
  fsdata balance ml1m.parquet baseline/ --ranks 256 --batch-size-per-rank 32 --strategy shuffle
  fsdata balance ml1m.parquet shards/ --ranks 16 --batch-size-per-rank 32 --cost-model calibrated.json
  fsdata balance ml1m.parquet shards/ --ranks 256 --batch-size-per-rank 32 --engine ray --ray-address HEAD:6379
"""
_EPILOG_STAGES = """the three stages of 'fsdata balance', run one by one (same output, byte for byte):
  fsdata plan ml1m.parquet plan.parquet --ranks 256 --batch-size-per-rank 32
  fsdata write ml1m.parquet plan.parquet shards/
  fsdata finalize shards/ --plan plan.parquet
"""
_EPILOG_VERIFY = """examples:
  fsdata verify shards/ --input ml1m.parquet
"""
_EPILOG_REPORT = """examples:
  fsdata report shards/                          # writes shards-report.html (+ PNGs) beside shards/
  fsdata report shards/ --html review/shards.html
  fsdata report shards/ --input my_samples.parquet   # when sample_ids are not the input's row numbers
"""

#: The BalanceSettings fields each command takes as flags (``fsdata balance`` takes them all but
#: ``progress``, the common ``--progress/--no-progress``); every one is generated from its field, whose
#: metadata holds a spelling other than ``--field-name`` (``num_ranks``: ``--ranks``) and its metavar.
INPUT_FIELDS = ("columns", "cost_model", "num_ranks", "batch_size_per_rank", "seed", "compose_window")
PLAN_FIELDS = ("strategy", "batch_policy", "budget", "plan_window", "partitioner", "remainder", "epochs")
WRITE_FIELDS = ("overwrite", "num_threads", "bucket_compression", "engine", "ray_address")
BALANCE_FIELDS = {"profile": INPUT_FIELDS + ("from_step",),
                  "balance": INPUT_FIELDS + PLAN_FIELDS + WRITE_FIELDS + ("from_step",),
                  "plan": INPUT_FIELDS + PLAN_FIELDS, "write": WRITE_FIELDS, "verify": ("columns", "from_step"),
                  "report": ("columns",)}
#: ConvertSettings fields that are not flags of ``fsdata convert``: ``INPUT`` is positional and
#: ``--format`` (a log's, required) is written out below.
CONVERT_NOT_FLAGS = ("input", "format")


def _balance_flags(p, command: str) -> None:
    """The flags of ``command`` generated from :class:`BalanceSettings` fields (namespace ``balance.*``)."""
    from fsdata.balancer.partitioners import names as partitioner_names  # the registries: the one lists
    from fsdata.engines import names as engine_names

    add_settings_flags(p, BalanceSettings, section="balance", include=BALANCE_FIELDS[command], require=True,
                       choices={"partitioner": partitioner_names(), "engine": engine_names()},
                       title="settings (fsdata.BalanceSettings)")


def _command(help: str, epilog: str | None = None, **kw):  # noqa: A002
    """A subcommand's parser: ``(parser, help)`` for :func:`fsdata.common.cli.add_subcommands`."""
    return new_parser(description=help, epilog=epilog, **kw), help


def build_parser():
    """The ``fsdata`` command line (``jsonargparse``); settings flags are generated from
    :class:`ConvertSettings` and :class:`BalanceSettings` (:func:`fsdata.common.cli.add_settings_flags`)."""
    parser = new_parser(prog="fsdata", description="Profile, balance and pre-shard training samples so every rank's "
                        "cost per step is equal.")
    add_version_flag(parser)
    cmds = {}

    p, _ = cmds["convert"] = _command("interaction log -> Parquet samples", _EPILOG_CONVERT)
    p.add_argument("input", help="the interaction log")
    p.add_argument("output", help="Parquet file to write")
    p.add_argument("--format", dest="convert.format", required=True, choices=list(LOG_FORMATS),
                   help=settings_help(ConvertSettings)["format"])
    add_settings_flags(p, ConvertSettings, section="convert", exclude=CONVERT_NOT_FLAGS,
                       title="settings (fsdata.samples.settings.ConvertSettings)")
    p.add_argument("--holdout", default="none", choices=["none", "last"],
                   help="last: hold out each user's last item (leave-one-out, as SASRec/BERT4Rec) for evaluation")
    p.add_argument("--holdout-output", default=None, metavar="EVAL.parquet",
                   help="with --holdout last: evaluation file (user_id, item_ids, target_item_id, seq_len)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    add_json_flag(p)
    add_common_flags(p, name="fsdata")

    p, _ = cmds["profile"] = _command("length statistics and the bubble of today's practice",
                                      _EPILOG_PROFILE)
    p.add_argument("input", help="Parquet file, directory of Parquet files, or glob")
    _balance_flags(p, "profile")
    add_json_flag(p, "print JSON instead of a table")
    add_common_flags(p, name="fsdata")

    p, _ = cmds["balance"] = _command("write pre-balanced, pre-sharded Parquet (plan + write + finalize)",
                                      _EPILOG_BALANCE)
    p.add_argument("input", help="Parquet file, directory of Parquet files, or glob")
    p.add_argument("output", help="OUTPUT folder (docs/format.md)")
    _balance_flags(p, "balance")
    add_json_flag(p)
    add_common_flags(p, name="fsdata")

    p, _ = cmds["plan"] = _command("stage 1 of balance: write the plan (sample_id, step, rank, position) as "
                                   "Parquet", _EPILOG_STAGES)
    p.add_argument("input", help="Parquet file, directory of Parquet files, or glob")
    p.add_argument("plan", help="plan Parquet file to write (docs/fsdata.md, 'Stages')")
    _balance_flags(p, "plan")
    p.add_argument("--overwrite", action="store_true", help="replace an existing plan")
    add_json_flag(p)
    add_common_flags(p, name="fsdata")

    p, _ = cmds["write"] = _command("stage 2 of balance: write the rank files of a plan", _EPILOG_STAGES)
    p.add_argument("input", help="the INPUT the plan was made from")
    p.add_argument("plan", help="plan written by 'fsdata plan'")
    p.add_argument("output", help="OUTPUT folder to create (rank files only; then run 'fsdata finalize')")
    _balance_flags(p, "write")
    add_json_flag(p)
    add_common_flags(p, name="fsdata")

    p, _ = cmds["finalize"] = _command("stage 3 of balance: write the manifest and step stats of written "
                                       "rank files", _EPILOG_STAGES)
    p.add_argument("output", help="OUTPUT folder written by 'fsdata write'")
    p.add_argument("--plan", required=True, help="the plan the rank files were written from")
    add_json_flag(p)
    add_common_flags(p, name="fsdata")

    p, _ = cmds["synth"] = _command("generate samples whose lengths follow a real dataset's distribution",
                                    "examples:\n  fsdata synth big.parquet --num-samples 20000000 "
                                    "--lengths-from ../shared/datasets/ml-1m_ensfm/sequences.txt --layout event\n")
    p.add_argument("output", help="Parquet file to write")
    p.add_argument("--num-samples", type=int, required=True, help="samples to write")
    p.add_argument("--lengths-from", required=True, help="a dataset file (sequences, events or CSV) to resample "
                                                         "lengths from")
    p.add_argument("--layout", default="event", choices=["user", "event"], help="per-user or per-event lengths")
    p.add_argument("--max-seq-len", type=int, default=512, help="longest history")
    p.add_argument("--num-items", type=int, default=100_000, help="item ids are drawn below this")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and item ids")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    add_json_flag(p)
    add_common_flags(p, name="fsdata")

    p, _ = cmds["verify"] = _command("check an OUTPUT's invariants", _EPILOG_VERIFY)
    p.add_argument("output", help="an fsdata balance OUTPUT folder")
    p.add_argument("--input", default=None, help="the balance INPUT: check no sample was lost or duplicated")
    _balance_flags(p, "verify")
    add_json_flag(p)
    add_common_flags(p, name="fsdata")

    p, _ = cmds["report"] = _command("HTML page (+ PNGs) of an OUTPUT: lengths, costs, per-rank load "
                                     "before/after", _EPILOG_REPORT)
    p.add_argument("output", help="an fsdata balance OUTPUT folder (read only)")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="page to write (default: OUTPUT-report.html beside OUTPUT); PNGs go beside it")
    p.add_argument("--input", default=None,
                   help="the balance INPUT; needed only when sample_ids are not the input's row numbers")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing file that fsdata report did not write (its own pages are replaced anyway)")
    _balance_flags(p, "report")
    add_json_flag(p, "print the written paths and bubbles as JSON")
    add_common_flags(p, name="fsdata")
    add_subcommands(parser, cmds)
    return parser


def parse_args(argv: list[str] | None = None):
    """Parse a command line: the subcommand's namespace (its arguments; the settings fields under
    ``balance.`` / ``convert.``, as the dataclasses name them), with ``command`` set to its name."""
    a = build_parser().parse_args(argv)
    sub = a[a.command]
    sub.command = a.command
    return sub


def _settings(cls, a, section: str = "balance", **more):
    """``cls`` (a settings dataclass) of the flags of ``section``, which check themselves:
    ``cls(**settings_values(cls, a[section]))``; ``more``: fields set here (``progress``)."""
    return cls(**settings_values(cls, a[section].as_dict()), **more)


def _cmd_convert(a) -> int:
    from dataclasses import asdict

    from fsdata.samples.convert import convert

    s = convert(a.input, a.output, _settings(ConvertSettings, a, "convert", input=a.input), overwrite=a.overwrite,
                progress=not a.no_progress, holdout=a.holdout, holdout_output=a.holdout_output)
    if a.json:
        print(json.dumps(asdict(s), indent=2))
    else:
        print(f"wrote {s.num_samples:,} samples ({s.samples}) from {s.num_users:,} users / {s.num_events:,} events "
              f"to {a.output}; {s.num_users_skipped} users with < 2 items skipped")
        if s.bad_lines_skipped:
            print(f"skipped {s.bad_lines_skipped:,} bad lines (--bad-lines skip)")
        if s.vocab:
            print(f"wrote the vocabulary ({s.num_items - 1:,} items) to {a.output}.vocab")
        if s.holdout:
            print(f"held out the last item of {s.holdout['num_users_evaluated']:,} users to {a.holdout_output} "
                  f"({s.holdout['num_users_kept_whole']} users with < 3 items kept whole in training)")
    return 0


def _load_lengths(a, s: PlanSettings):
    from fsdata.balancer.cost import load_cost_model
    from fsdata.samples.io import open_samples
    from fsdata.shards.as_input import is_output, open_output

    cost_model = load_cost_model(s.cost_model)
    if is_output(a.input):  # an OUTPUT's samples (docs/fsdata.md, "Changing the world size")
        with open_output(a.input, s.from_step) as view:
            src = view.source
            assert src is not None  # open_output sets it
            lengths, ids = src.lengths_and_ids()
        return src, cost_model, lengths, ids
    if s.from_step is not None:
        raise ConfigError(f"{setting('from_step')} needs an 'fsdata balance' OUTPUT as INPUT; {a.input} is not "
                          "one (it has no _manifest.json)")
    src = open_samples(a.input, s.columns)
    lengths, ids = src.lengths_and_ids()
    return src, cost_model, lengths, ids


def _cmd_profile(a) -> int:
    from fsdata.balancer.profile import format_report, profile

    s = _settings(PlanSettings, a)
    _, cost_model, lengths, _ = _load_lengths(a, s)
    report = profile(lengths, cost_model, num_ranks=s.num_ranks, batch_size_per_rank=s.batch_size_per_rank,
                     seed=s.seed, compose_window=s.compose_window)
    print(json.dumps(report, indent=2) if a.json else format_report(report))
    return 0


def _print_manifest_summary(a, m: dict, timings: dict | None) -> None:
    summary = {k: m[k] for k in ("num_ranks", "num_steps", "batch_size_per_rank", "batch_policy", "strategy",
                                 "num_samples_input", "num_samples_written", "num_samples_dropped",
                                 "predicted_bubble", "baseline_predicted_bubble", "lower_bound_bubble")}
    from fsdata.balancer.plan import high_bubble_warning

    settings = m.get("settings") or {}
    summary["compose_window"] = settings.get("compose_window", 1)
    summary["epochs"] = m.get("epochs", 1)
    summary["steps_per_epoch"] = m.get("steps_per_epoch", round(m["num_steps"] / summary["epochs"]))
    if "epoch_num_steps" in m:
        summary["epoch_num_steps"] = m["epoch_num_steps"]
    summary["warning"] = high_bubble_warning(m)
    if summary["warning"]:
        log.warning(summary["warning"])
    summary["output"] = str(a.output)
    if timings is not None:
        summary["stage_seconds"] = timings
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {a.output}: {m['num_ranks']} ranks x {m['num_steps']} steps, "
              f"{m['num_samples_written']:,} samples ({m['num_samples_dropped']:,} dropped, see manifest)")
        if summary["epochs"] > 1:
            if "steps_per_epoch" in m:
                print(f"  epochs             {summary['epochs']} x {summary['steps_per_epoch']} steps (epoch e: steps "
                      f"e*{summary['steps_per_epoch']} .. (e+1)*{summary['steps_per_epoch']}-1)")
            else:
                per = m["epoch_num_steps"]
                print(f"  epochs             {summary['epochs']}, steps per epoch "
                      f"{per[:8]}{' ...' if len(per) > 8 else ''}"
                      " (epoch_num_steps in the manifest)")
        print(f"  predicted bubble   {m['predicted_bubble']:.4%}  ({m['strategy']}, {m['batch_policy']})")
        print(f"  equal-count today  {m['baseline_predicted_bubble']:.4%}")
        print(f"  proven bound       {m['lower_bound_bubble']:.4%}  (pigeonhole bound of these steps, equal "
              f"counts; gap {m['predicted_bubble'] - m['lower_bound_bubble']:+.4%})")
        ci = settings.get("compose") or {}
        if summary["compose_window"] > 1 and "windows_composed" in ci:
            print(f"  composition        window {summary['compose_window']} ({ci['algorithm']}): "
                  f"{ci['windows_composed']} of {ci['num_windows']} windows regrouped; bound without it "
                  f"{ci['uncomposed_lower_bound_bubble']:.4%}")
        if timings:
            print("  stage seconds      " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))


def _cmd_balance(a) -> int:
    from fsdata.engines import balance

    settings = _settings(BalanceSettings, a, progress=not a.no_progress)
    log.info("balancing %s for %d ranks x %d", a.input, settings.num_ranks, settings.batch_size_per_rank)
    timings: dict[str, float] = {}
    m = balance(a.input, a.output, settings, timings=timings)
    _print_manifest_summary(a, m.to_json(), timings)
    return 0


def _cmd_plan(a) -> int:
    from fsdata.balancer.cost import cost_model_file
    from fsdata.engines.planning import make_plan_table
    from fsdata.shards.plan_file import write_plan
    from fsdata.samples.io import open_samples

    settings = _settings(PlanSettings, a)
    a.input, a.plan = fsio.normalize(a.input), fsio.normalize(a.plan)
    check_output_apart(a.plan, [a.input], output_name="PLAN", input_name="INPUT")
    check_output_apart(a.plan, [cost_model_file(settings.cost_model)], output_name="PLAN", input_name="--cost-model")
    if fsio.exists(a.plan) and not a.overwrite:
        raise FsdataError(f"plan {a.plan} already exists; choose a new path or pass --overwrite to replace it")
    check_replaceable(a.plan, "plan", name="PLAN")
    table = make_plan_table(open_samples(a.input, settings.columns), settings)
    try:
        write_plan(a.plan, table, overwrite=a.overwrite)
    except OSError as e:  # a full disk or file-size limit is about PLAN, not the input
        from fsdata.guards import raise_if_environment

        raise_if_environment(e, a.plan, action="write")
        raise
    m = table.meta.to_dict()
    out = {k: m[k] for k in ("num_ranks", "num_steps", "batch_size_per_rank", "num_samples_input",
                             "predicted_bubble", "baseline_predicted_bubble", "lower_bound_bubble")}
    out["plan"] = str(a.plan)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"wrote plan {a.plan}: {m['num_ranks']} ranks x {m['num_steps']} steps, "
              f"{m['num_samples_input']:,} input samples; predicted bubble {m['predicted_bubble']:.4%} "
              f"(equal-count today {m['baseline_predicted_bubble']:.4%})")
    return 0


def _cmd_write(a) -> int:
    from fsdata.engines import write_from_plan

    a.input, a.plan, a.output = fsio.normalize(a.input), fsio.normalize(a.plan), fsio.normalize(a.output)
    run = _settings(RunSettings, a, progress=not a.no_progress)  # the planning settings are the plan's own
    files = write_from_plan(a.input, a.plan, a.output, **dataclasses.asdict(run))
    if a.json:
        print(json.dumps({"output": str(a.output), "plan": str(a.plan), "num_rank_files": len(files)}, indent=2))
    else:
        print(f"wrote {len(files)} rank files to {a.output}; run 'fsdata finalize {a.output} --plan {a.plan}'")
    return 0


def _cmd_finalize(a) -> int:
    from fsdata.guards import check_not_bucket_root
    from fsdata.shards.finalize import finalize
    from fsdata.shards.plan_file import read_plan

    a.output, a.plan = fsio.normalize(a.output), fsio.normalize(a.plan)
    check_not_bucket_root(a.output, output_name="OUTPUT")
    if not fsio.is_dir(a.output):
        raise FsdataError(f"output {a.output} does not exist; write it with 'fsdata write INPUT PLAN OUTPUT'")
    m = finalize(a.output, read_plan(a.plan))
    _print_manifest_summary(a, m.to_json(), None)
    return 0


def _cmd_synth(a) -> int:
    from fsdata.samples.synth import read_lengths, write_synth_samples

    check_seed(a.seed)
    for flag, v, hi in (("--num-samples", a.num_samples, 2**63 - 1), ("--max-seq-len", a.max_seq_len, 2**31 - 1),
                        ("--num-items", a.num_items, 2**63 - 2)):  # item ids are drawn in 1..num_items (int64)
        if not 1 <= v <= hi:
            raise FsdataError(f"{flag} must be an integer in 1..{hi}, got {v}")
    check_output_apart(a.output, [a.lengths_from], output_name="output", input_name="--lengths-from")
    if Path(a.output).exists() and not a.overwrite:
        raise FsdataError(f"output {a.output} already exists; choose a new path or pass --overwrite to replace it")
    check_replaceable(a.output, "samples")
    if not Path(a.lengths_from).exists():
        raise FsdataError(f"--lengths-from {a.lengths_from} does not exist; pass a dataset file")
    source = read_lengths(a.lengths_from, layout=a.layout, max_seq_len=a.max_seq_len)
    info = write_synth_samples(a.output, a.num_samples, source, seed=a.seed, num_items=a.num_items)
    if a.json:
        print(json.dumps({"output": str(a.output), "lengths_from": str(a.lengths_from), "layout": a.layout,
                          **info}, indent=2, default=str))
        return 0
    print(f"wrote {info['num_samples']:,} samples ({info['num_bytes'] / 1e9:.2f} GB) to {a.output}, lengths "
          f"resampled from {a.lengths_from} ({a.layout} layout)")
    return 0


def _cmd_verify(a) -> int:
    from fsdata.shards.verify import verify

    r = verify(a.output, a.input, column_map=a.balance.columns, progress=not a.no_progress,
               from_step=a.balance.from_step)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        epochs = (f" ({r['epochs']} epochs of {min(r['epoch_num_steps'])}..{max(r['epoch_num_steps'])} steps, every "
                  "sample once per epoch)"
                  if r.get("epochs", 1) > 1 else "")
        print(f"OK {a.output}: {r['num_ranks']} ranks x {r['num_steps']} steps{epochs}, "
              f"{r['num_samples_written']:,} samples "
              f"written, {r['num_samples_dropped']:,} dropped; predicted bubble {r['predicted_bubble']:.4%}"
              + ("; input fully accounted for" if r["checked_input"] else ""))
        for what in r.get("not_checked", []):
            print(f"  not checked: {what}")
    return 0


def _cmd_report(a) -> int:
    from fsdata.report import write_report

    r = write_report(a.output, a.html, input_path=a.input, column_map=a.balance.columns, overwrite=a.overwrite)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"wrote {r['html']} (+ {len(r['png'])} PNG files beside it); predicted bubble before "
              f"{r['predicted_bubble_before']:.2%}, after {r['predicted_bubble_after']:.4%}")
    return 0


COMMANDS = {"convert": _cmd_convert, "profile": _cmd_profile, "balance": _cmd_balance, "verify": _cmd_verify,
            "synth": _cmd_synth, "plan": _cmd_plan, "write": _cmd_write, "finalize": _cmd_finalize,
            "report": _cmd_report}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fsdata`` console script; returns the exit status.

    A user error is one ``fsdata: error:`` line with exit 2, Ctrl-C exit 130 (nothing written);
    piping into ``head`` exits 141 quietly; a full disk, read-only location or denied permission
    is one ``fsdata: error:`` line with exit 2 (:func:`fsdata.common.cli.cli_main`).
    """
    return cli_main("fsdata", lambda: parse_args(argv), _run, location=("output", "input"),
                    interrupted="interrupted; nothing was written")


def _run(a) -> int:
    a.no_progress = not resolve_progress(getattr(a, "progress", None))
    configure_logging(a.verbose, a.quiet)
    return COMMANDS[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
