"""``fsdata`` command line: convert, profile, balance (= plan, write, finalize), verify, synth.

Errors a user can cause print one line ``fsdata: error: ...`` on stderr and exit with status 2;
nothing is written in that case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from fsdata import fsio
from fsdata.balancer.partitioners import names as partitioner_names  # the registry: the one list
from fsdata.cliutil import (add_common_flags, add_json_flag, add_settings_argument, add_version_flag, configure_logging,
                            resolve_progress, run_main)
from fsdata.errors import FsdataError, cli_terms
from fsdata.guards import check_output_apart
from fsdata.samples.settings import ConvertSettings
from fsdata.balancer.settings import BalanceSettings

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

COST_MODEL_HELP = ("per-sample cost: tokens | quadratic | verl | hstu[:d_model=256,num_heads=4,head_dim=64,"
                   "num_layers=4,causal=1] | poly:c0=..,c1=..,c2=.. | PATH.json (default: hstu)")


def _add_common(p: argparse.ArgumentParser) -> None:
    """The shared flags (fsdata.cliutil): --progress/--no-progress, -v/--verbose, -q/--quiet, --version."""
    add_common_flags(p, name="fsdata")


def _add_input_opts(p: argparse.ArgumentParser) -> None:
    _balance(p, "columns", metavar="MAP",
             help="map your column names to the sample schema: sample_id=id,item_ids=history,...")
    _balance(p, "cost_model", help=COST_MODEL_HELP)
    _balance(p, "num_ranks", "--ranks", help="number of ranks R (world size)")
    _balance(p, "batch_size_per_rank", help="samples per rank per step B")
    _balance(p, "seed", help="seed of the global-batch shuffle (default %(default)s)")
    _balance(p, "compose_window", metavar="W",
             help="regroup the samples of W consecutive random global batches so heavy samples share "
                  "steps in multiples of R (B per rank kept); 1 = off (default %(default)s, see docs/balancer.md)")


def _add_plan_opts(p: argparse.ArgumentParser) -> None:
    """The planning flags of ``fsdata plan`` (the same as ``fsdata balance``'s; keep them in step)."""
    _balance(p, "strategy", help="balanced (default) or shuffle: today's equal-count practice, same layout")
    _balance(p, "batch_policy",
             help="fixed: B samples per rank per step; cost-budget: variable counts, equal cost per step")
    _balance(p, "budget", help="cost-budget: per-rank per-step cost budget")
    _balance(p, "plan_window", metavar="K",
             help="steps planned together (rounded up to a multiple of --compose-window; default %(default)s): "
                  "bounds the planning memory per window, the unit of a Ray plan task (docs/cluster.md)")
    _balance(p, "partitioner", choices=partitioner_names(), help="per-step assignment: %(choices)s (default "
             "%(default)s: lpt-swap, plus time-bounded CP-SAT on the steps whose gap to the proven bound is worth it)")
    _balance(p, "remainder",
             help="samples that do not fill a last step: drop (recorded in _dropped.parquet) or error")
    _balance(p, "epochs", metavar="E",
             help="epochs written one after the other, each with its own seeded shuffle and composition; "
                  "steps are numbered on across epochs (default %(default)s; fixed policy, local engine)")


def _add_write_opts(p: argparse.ArgumentParser) -> None:
    _balance(p, "num_threads", metavar="N", help="threads for writing rank files (default %(default)s)")
    _balance(p, "bucket_compression",
             help="codec of the temporary per-rank buckets (none: fastest, temporary disk about the "
                  "decoded input size; lz4/zstd: less disk, more CPU)")


def _add_engine_opts(p: argparse.ArgumentParser) -> None:
    _balance(p, "engine", help="local (default: this process) or ray (Ray tasks on a Ray cluster, docs/cluster.md); "
                               "the output is byte-identical")
    _balance(p, "ray_address", metavar="HOST:PORT",
             help="--engine ray: the cluster's head ('ray start --head' prints it; default: RAY_ADDRESS, else a "
                  "Ray instance on this machine)")


def _balance(p: argparse.ArgumentParser, name: str, *flags: str, **kw) -> None:
    """A flag of a BalanceSettings field: its default, choices and type are the field's (declared once)."""
    add_settings_argument(p, BalanceSettings, name, *flags, **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdata", description="Profile, balance and pre-shard training samples "
                                     "so every rank's cost per step is equal.")
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="interaction log -> Parquet samples", epilog=_EPILOG_CONVERT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input")
    p.add_argument("output", help="Parquet file to write")
    p.add_argument("--format", required=True, choices=["sequences", "events"])
    for name in ("samples", "max_seq_len", "user_col", "item_col", "time_col", "sep"):
        add_settings_argument(p, ConvertSettings, name)  # default, choices, type and help from the field
    hdr = p.add_mutually_exclusive_group()
    add_settings_argument(hdr, ConvertSettings, "has_header", "--header", action="store_true")
    hdr.add_argument("--no-header", dest="has_header", action="store_false", help="text has no header line")
    p.add_argument("--holdout", default="none", choices=["none", "last"],
                   help="last: hold out each user's last item (leave-one-out, as SASRec/BERT4Rec) for evaluation")
    p.add_argument("--holdout-output", default=None, metavar="EVAL.parquet",
                   help="with --holdout last: evaluation file (user_id, item_ids, target_item_id, seq_len)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_common(p)

    p = sub.add_parser("profile", help="length statistics and the bubble of today's practice", epilog=_EPILOG_PROFILE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="Parquet file, directory of Parquet files, or glob")
    _add_input_opts(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_common(p)

    p = sub.add_parser("balance", help="write pre-balanced, pre-sharded Parquet (plan + write + finalize)",
                       epilog=_EPILOG_BALANCE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="Parquet file, directory of Parquet files, or glob")
    p.add_argument("output", help="OUTPUT folder (docs/format.md)")
    _add_input_opts(p)
    _add_plan_opts(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT atomically")
    _add_write_opts(p)
    _add_engine_opts(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_common(p)

    p = sub.add_parser("plan", help="stage 1 of balance: write the plan (sample_id, step, rank, position) as Parquet",
                       epilog=_EPILOG_STAGES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="Parquet file, directory of Parquet files, or glob")
    p.add_argument("plan", help="plan Parquet file to write (docs/fsdata.md, 'Stages')")
    _add_input_opts(p)
    _add_plan_opts(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing plan")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_common(p)

    p = sub.add_parser("write", help="stage 2 of balance: write the rank files of a plan",
                       epilog=_EPILOG_STAGES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="the INPUT the plan was made from")
    p.add_argument("plan", help="plan written by 'fsdata plan'")
    p.add_argument("output", help="OUTPUT folder to create (rank files only; then run 'fsdata finalize')")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT atomically")
    _add_write_opts(p)
    add_json_flag(p, "print the summary as JSON")
    _add_engine_opts(p)
    _add_common(p)

    p = sub.add_parser("finalize", help="stage 3 of balance: write the manifest and step stats of written rank files",
                       epilog=_EPILOG_STAGES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="OUTPUT folder written by 'fsdata write'")
    p.add_argument("--plan", required=True, help="the plan the rank files were written from")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_common(p)

    p = sub.add_parser("synth", help="generate samples whose lengths follow a real dataset's distribution",
                       epilog="examples:\n  fsdata synth big.parquet --num-samples 20000000 "
                              "--lengths-from ../shared/datasets/ml-1m_ensfm/sequences.txt --layout event\n",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="Parquet file to write")
    p.add_argument("--num-samples", type=int, required=True)
    p.add_argument("--lengths-from", required=True, help="a dataset file (sequences, events or CSV) to resample lengths from")
    p.add_argument("--layout", default="event", choices=["user", "event"], help="per-user or per-event lengths")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--num-items", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    add_json_flag(p, "print the summary as JSON")
    _add_common(p)

    p = sub.add_parser("verify", help="check an OUTPUT's invariants", epilog=_EPILOG_VERIFY,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output")
    p.add_argument("--input", default=None, help="the balance INPUT: check no sample was lost or duplicated")
    p.add_argument("--columns", default=None, metavar="MAP", help="column mapping used for the input")
    p.add_argument("--json", action="store_true")
    _add_common(p)

    p = sub.add_parser("report", help="HTML page (+ PNGs) of an OUTPUT: lengths, costs, per-rank load before/after",
                       epilog=_EPILOG_REPORT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="an fsdata balance OUTPUT folder (read only)")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="page to write (default: OUTPUT-report.html beside OUTPUT); PNGs go beside it")
    p.add_argument("--input", default=None,
                   help="the balance INPUT; needed only when sample_ids are not the input's row numbers")
    p.add_argument("--columns", default=None, metavar="MAP", help="column mapping used for the input")
    p.add_argument("--json", action="store_true", help="print the written paths and bubbles as JSON")
    _add_common(p)
    return parser


def _cmd_convert(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from fsdata.samples.convert import convert

    s = convert(a.input, a.output, fmt=a.format, samples=a.samples, max_seq_len=a.max_seq_len, user_col=a.user_col,
                item_col=a.item_col, time_col=a.time_col, sep=a.sep, has_header=a.has_header,
                overwrite=a.overwrite, progress=not a.no_progress, holdout=a.holdout,
                holdout_output=a.holdout_output)
    if a.json:
        print(json.dumps(asdict(s), indent=2))
    else:
        print(f"wrote {s.num_samples:,} samples ({s.samples}) from {s.num_users:,} users / {s.num_events:,} events "
              f"to {a.output}; {s.num_users_skipped} users with < 2 items skipped")
        if s.holdout:
            print(f"held out the last item of {s.holdout['num_users_evaluated']:,} users to {a.holdout_output} "
                  f"({s.holdout['num_users_kept_whole']} users with < 3 items kept whole in training)")
    return 0


def _load_lengths(a: argparse.Namespace):
    from fsdata.balancer.cost import load_cost_model
    from fsdata.samples.io import open_samples

    cost_model = load_cost_model(a.cost_model)
    src = open_samples(a.input, a.columns)
    lengths, ids = src.lengths_and_ids()
    return src, cost_model, lengths, ids


def _cmd_profile(a: argparse.Namespace) -> int:
    from fsdata.balancer.profile import format_report, profile

    _, cost_model, lengths, _ = _load_lengths(a)
    report = profile(lengths, cost_model, num_ranks=a.ranks, batch_size_per_rank=a.batch_size_per_rank, seed=a.seed,
                     compose_window=a.compose_window)
    print(json.dumps(report, indent=2) if a.json else format_report(report))
    return 0


#: BalanceSettings field -> argparse dest, where the flag's name differs from the field's.
_BALANCE_DEST = {"num_ranks": "ranks"}


def _settings_from_args(a: argparse.Namespace) -> BalanceSettings:
    """The ``BalanceSettings`` of a command's flags; a field the command has no flag for keeps the
    field's default (``fsdata plan`` has no write flags)."""
    from fsdata.balancer.compose import check_window
    from fsdata.balancer.settings import check_ranks_and_batch

    check_ranks_and_batch(a.ranks, a.batch_size_per_rank)
    check_window(a.compose_window)
    given = {f.name: getattr(a, _BALANCE_DEST.get(f.name, f.name)) for f in dataclasses.fields(BalanceSettings)
             if f.name not in ("progress", "num_workers") and hasattr(a, _BALANCE_DEST.get(f.name, f.name))}
    if given.get("bucket_compression") == "none":
        given["bucket_compression"] = None
    return BalanceSettings(**given, progress=not a.no_progress)


def _print_manifest_summary(a: argparse.Namespace, m: dict, timings: dict | None) -> None:
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
                print(f"  epochs             {summary['epochs']}, steps per epoch {per[:8]}{' ...' if len(per) > 8 else ''}"
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


def _cmd_balance(a: argparse.Namespace) -> int:
    from fsdata.engines import balance

    settings = _settings_from_args(a)
    log.info("balancing %s for %d ranks x %d", a.input, a.ranks, a.batch_size_per_rank)
    timings: dict[str, float] = {}
    m = balance(a.input, a.output, settings, timings=timings)
    _print_manifest_summary(a, m.to_json(), timings)
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
    from fsdata.engines.planning import make_plan_table
    from fsdata.shards.plan_file import write_plan
    from fsdata.samples.io import open_samples

    settings = _settings_from_args(a)
    a.input, a.plan = fsio.normalize(a.input), fsio.normalize(a.plan)
    check_output_apart(a.plan, [a.input], output_name="PLAN", input_name="INPUT")
    if fsio.exists(a.plan) and not a.overwrite:
        raise FsdataError(f"plan {a.plan} already exists; choose a new path or pass --overwrite to replace it")
    table = make_plan_table(open_samples(a.input, a.columns), settings)
    try:
        write_plan(a.plan, table, overwrite=a.overwrite)
    except OSError as e:  # a full disk or file-size limit is about PLAN, not the input
        from fsdata.guards import raise_if_environment

        raise_if_environment(e, a.plan, action="write")
        raise
    m = table.meta
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


def _cmd_write(a: argparse.Namespace) -> int:
    from fsdata.engines import write_from_plan

    a.input, a.plan, a.output = fsio.normalize(a.input), fsio.normalize(a.plan), fsio.normalize(a.output)
    files = write_from_plan(a.input, a.plan, a.output, overwrite=a.overwrite, engine=a.engine,
                            ray_address=a.ray_address, num_threads=a.num_threads, progress=not a.no_progress,
                            bucket_compression=None if a.bucket_compression == "none" else a.bucket_compression)
    if a.json:
        print(json.dumps({"output": str(a.output), "plan": str(a.plan), "num_rank_files": len(files)}, indent=2))
    else:
        print(f"wrote {len(files)} rank files to {a.output}; run 'fsdata finalize {a.output} --plan {a.plan}'")
    return 0


def _cmd_finalize(a: argparse.Namespace) -> int:
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


def _cmd_synth(a: argparse.Namespace) -> int:
    from fsdata.samples.synth import read_lengths, write_synth_samples

    check_output_apart(a.output, [a.lengths_from], output_name="output", input_name="--lengths-from")
    if Path(a.output).exists() and not a.overwrite:
        raise FsdataError(f"output {a.output} already exists; choose a new path or pass --overwrite to replace it")
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


def _cmd_verify(a: argparse.Namespace) -> int:
    from fsdata.shards.verify import verify

    r = verify(a.output, a.input, column_map=a.columns, progress=not a.no_progress)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        epochs = (f" ({r['epochs']} epochs of {min(r['epoch_num_steps'])}..{max(r['epoch_num_steps'])} steps, every "
                  "sample once per epoch)"
                  if r.get("epochs", 1) > 1 else "")
        print(f"OK {a.output}: {r['num_ranks']} ranks x {r['num_steps']} steps{epochs}, {r['num_samples_written']:,} samples "
              f"written, {r['num_samples_dropped']:,} dropped; predicted bubble {r['predicted_bubble']:.4%}"
              + ("; input fully accounted for" if r["checked_input"] else ""))
    return 0


def _cmd_report(a: argparse.Namespace) -> int:
    from fsdata.report import write_report

    r = write_report(a.output, a.html, input_path=a.input, column_map=a.columns)
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

    Piping into ``head`` exits 141 quietly; a full disk, read-only location or denied permission
    is one ``fsdata: error:`` line with exit 2 (:func:`fsdata.cliutil.run_main`).
    """
    parsed: list[argparse.Namespace] = []

    def body() -> int:
        parsed.append(build_parser().parse_args(argv))
        return _run(parsed[0])

    def location() -> str | None:
        return (getattr(parsed[0], "output", None) or getattr(parsed[0], "input", None)) if parsed else None

    return run_main("fsdata", body, location)


def _run(a: argparse.Namespace) -> int:
    a.no_progress = not resolve_progress(getattr(a, "progress", None))
    configure_logging(a.verbose, a.quiet)
    try:
        with cli_terms():
            return COMMANDS[a.command](a)
    except FsdataError as e:
        print(f"fsdata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fsdata: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
