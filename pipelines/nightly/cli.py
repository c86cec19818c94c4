"""Command line of the nightly job: ``python -m pipelines.nightly``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW
from fsdata.balancer.plan import DEFAULT_PARTITIONER, DEFAULT_PLAN_WINDOW
from fsdata.cliutil import (add_common_flags, add_engine_flags, add_num_threads_flag, add_output_flag, configure_logging,
                            resolve_progress, run_main)
from fsdata.errors import FsdataError, cli_terms
from pipelines import nightly
from pipelines.nightly.job import NightlyConfig, run_nightly
from pipelines.nightly.store import rollback

def build_parser() -> argparse.ArgumentParser:
    """The nightly job's flags; those it shares with ``fsdata balance`` mean the same there."""
    from fsdata.cli import COST_MODEL_HELP

    doc = nightly.__doc__
    p = argparse.ArgumentParser(prog="python -m pipelines.nightly", description=doc.split("\n\n")[0],
                                epilog=doc[doc.index("Usage::"):].replace("Usage::", "examples:"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", default=None,
                   help="the nightly log (--format sequences|events) or sample Parquet file/folder/glob (--format "
                        "samples); required unless --rollback")
    g.add_argument("--format", default="sequences", choices=["sequences", "events", "samples"],
                   help="sequences: 'user item1 item2 ...' lines; events: one interaction per row; samples: "
                        "Parquet already in the sample schema (default sequences)")
    g.add_argument("--samples", default="per-event", choices=["per-user", "per-event"],
                   help="convert: one sample per user or per interaction (default per-event)")
    g.add_argument("--max-seq-len", type=int, default=512, help="convert: most recent history items kept (default 512)")
    g.add_argument("--user-col", default="0", help="events: user column name or 0-based position (default 0)")
    g.add_argument("--item-col", default="1", help="events: item column name or position (default 1)")
    g.add_argument("--time-col", default=None, help="events: timestamp column (sorts each user's events)")
    g.add_argument("--sep", default=None, help="events text separator (default: ',' for .csv, tab for .tsv, else space)")
    hdr = g.add_mutually_exclusive_group()
    hdr.add_argument("--header", dest="has_header", action="store_true", default=None, help="events text has a header line")
    hdr.add_argument("--no-header", dest="has_header", action="store_false", help="events text has no header line")
    g.add_argument("--columns", default=None, metavar="MAP",
                   help="--format samples: map your column names to the sample schema: sample_id=id,item_ids=history,...")
    b = p.add_argument_group("balance (same meaning as in fsdata balance)")
    b.add_argument("--ranks", type=int, default=256, help="number of ranks R (world size) (default 256)")
    b.add_argument("--batch-size-per-rank", type=int, default=32, help="samples per rank per step B (default 32)")
    b.add_argument("--cost-model", default="hstu", help=COST_MODEL_HELP)
    b.add_argument("--seed", type=int, default=0, help="seed of the global-batch shuffle (default 0)")
    b.add_argument("--strategy", default="balanced", choices=["balanced", "shuffle"],
                   help="balanced (default) or shuffle: today's equal-count practice, same layout")
    b.add_argument("--batch-policy", default="fixed", choices=["fixed", "cost-budget"],
                   help="fixed: B samples per rank per step; cost-budget: variable counts, equal cost per step")
    b.add_argument("--budget", type=float, default=None, help="cost-budget: per-rank per-step cost budget")
    b.add_argument("--partitioner", default=DEFAULT_PARTITIONER,
                   help="per-step assignment: auto (default), lpt-swap, lpt-swap-cpsat, lpt, kk, roundrobin, shuffle")
    b.add_argument("--remainder", default="drop", choices=["drop", "error"],
                   help="samples that do not fill a last step: drop (recorded in the OUTPUT) or error")
    b.add_argument("--compose-window", type=int, default=DEFAULT_COMPOSE_WINDOW, metavar="W",
                   help="regroup the samples of W consecutive random global batches so heavy samples share "
                        f"steps in multiples of R (B per rank kept); 1 = off (default {DEFAULT_COMPOSE_WINDOW}, "
                        "see docs/balancer.md)")
    b.add_argument("--plan-window", type=int, default=DEFAULT_PLAN_WINDOW, metavar="K",
                   help=f"steps planned together (rounded up to a multiple of --compose-window; default "
                        f"{DEFAULT_PLAN_WINDOW}): bounds the planning memory per window, the unit of a Ray plan task")
    b.add_argument("--epochs", type=int, default=1, metavar="E",
                   help="epochs written, each with its own seeded shuffle and composition, steps numbered on "
                        "(default 1)")
    add_num_threads_flag(b, default=2, help="threads for writing rank files (default 2)")
    b.add_argument("--bucket-compression", default="none", choices=["none", "lz4", "zstd"],
                   help="codec of the temporary per-rank buckets (none: fastest; lz4/zstd: less disk)")
    add_engine_flags(b)  # the same --engine/--ray-address as fsdata balance
    j = p.add_argument_group("job")
    add_output_flag(j, metavar="DIR",
                    help="work folder of runs/, latest and the lock (must not hold the input); required")
    j.add_argument("--keep-runs", type=int, default=3,
                   help="after a publish, keep this many newest runs; the published run and the last rollback "
                        "target are always kept (default 3)")
    j.add_argument("--rollback", default=None, metavar="RUN",
                   help="publish the complete run RUN (a key under runs/) even though it is older than latest, "
                        "then stop; no other flag is needed")
    j.add_argument("--lock-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="wait this long for a concurrent run holding the lock (default 0: fail at once)")
    j.add_argument("--json", action="store_true", help="print the result as JSON")
    add_common_flags(j)
    return p


def _main(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    configure_logging(a.verbose, a.quiet, default=logging.INFO, fmt="%(asctime)s %(name)s: %(message)s")
    if not a.output:
        parser.error("the following arguments are required: -o/--output")
    if a.rollback:
        r = rollback(a.output, a.rollback, lock_timeout_seconds=a.lock_timeout)
        if a.json:
            print(json.dumps({k: r[k] for k in ("run_dir", "run_key", "published", "previous")}, indent=2))
        else:
            print(f"rolled back: {Path(a.output) / 'latest'} -> {r['run_dir']} (was {r['previous']})")
        return 0
    if not a.input:
        parser.error("--input is required (unless --rollback RUN)")
    cfg = NightlyConfig(input=a.input, format=a.format, samples=a.samples, max_seq_len=a.max_seq_len,
                        user_col=a.user_col, item_col=a.item_col, time_col=a.time_col, sep=a.sep,
                        has_header=a.has_header, columns=a.columns, num_ranks=a.ranks,
                        batch_size_per_rank=a.batch_size_per_rank, cost_model=a.cost_model, seed=a.seed,
                        strategy=a.strategy, batch_policy=a.batch_policy, budget=a.budget,
                        partitioner=a.partitioner, remainder=a.remainder, compose_window=a.compose_window,
                        plan_window=a.plan_window, epochs=a.epochs)
    r = run_nightly(cfg, a.output, progress=resolve_progress(a.progress), keep_runs=a.keep_runs,
                    num_threads=a.num_threads,
                    bucket_compression=None if a.bucket_compression == "none" else a.bucket_compression,
                    engine=a.engine, ray_address=a.ray_address,
                    lock_timeout_seconds=a.lock_timeout)
    if a.json:
        print(json.dumps({k: r[k] for k in ("run_dir", "run_key", "skipped", "rebuilt", "published",
                                            "not_published_reason", "removed_runs", "seconds")}
                         | {"verify": r["verify"]}, indent=2))
        return 0
    v = r["verify"]
    if not r["published"]:
        print(f"complete, not published: {r['not_published_reason']}")
    else:
        state = "rebuilt and published" if r["rebuilt"] else "up to date" if r["skipped"] else "published"
        print(f"{state}: {Path(a.output) / 'latest'} -> {r['run_dir']}")
    print(f"  bubble before (equal counts) {v['baseline_predicted_bubble']:.2%}  after {v['predicted_bubble']:.4%}"
          f"  ({v['num_ranks']} ranks x {v['num_steps']} steps, {v['num_samples_written']:,} samples)")
    if v.get("warning"):
        print(f"  warning: {v['warning']}")
    if r["removed_runs"]:
        print(f"  removed {len(r['removed_runs'])} old or unfinished runs")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; errors are one ``nightly: error:`` line and exit 2, piping into ``head`` exits 141."""
    parser = build_parser()
    parsed: list[argparse.Namespace] = []

    def body() -> int:
        parsed.append(parser.parse_args(argv))
        try:
            with cli_terms():
                return _main(parsed[0], parser)
        except FsdataError as e:
            print(f"nightly: error: {e}", file=sys.stderr)
            return 2

    return run_main("nightly", body, lambda: parsed[0].output if parsed else None)

