"""Command line of the nightly job: ``python -m pipelines.nightly``.

Generated from :class:`~pipelines.nightly.config.NightlyConfig` (``jsonargparse``): one flag per
setting, with the field's type, default, choices and docstring; ``--config FILE`` reads the same
settings from YAML (sections ``convert``, ``balance``, ``job``; flags after it override it) and
``--print-config`` prints the resolved settings in that form and exits.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path

import jsonargparse
import yaml

from fsdata.common.cli import (add_common_flags, add_settings_flags, cli_main, configure_logging, new_parser,
                            resolve_progress, settings_values)
from fsdata.guards import check_output_apart
from pipelines import nightly
from pipelines.nightly.config import NO_FLAG, SECTIONS, NightlyConfig
from pipelines.nightly.job import run_nightly
from pipelines.nightly.store import rollback


def _choices(section: str) -> dict[str, list[str]] | None:
    """Registry names of the section's ``str`` fields (the registry is the one list)."""
    if section != "balance":
        return None
    from fsdata.balancer.partitioners import names as partitioner_names  # noqa: PLC0415
    from fsdata.engines import names as engine_names  # noqa: PLC0415

    return {"partitioner": partitioner_names(), "engine": engine_names()}


def build_parser() -> jsonargparse.ArgumentParser:
    """The nightly job's flags, one per field of :class:`NightlyConfig` (``--field-name``, or the
    spelling in the field's metadata: ``--ranks``, ``-o/--output``), plus
    ``--config``, ``--print-config``, ``--json`` and the common flags."""
    doc = nightly.__doc__
    p = new_parser(prog="python -m pipelines.nightly", description=doc.split("\n\n")[0],
                   epilog=doc[doc.index("Usage::"):doc.index("\n\nModules:")].replace("Usage::", "examples:"))
    p.add_argument("--config", action=jsonargparse.ActionConfigFile, metavar="FILE",
                   help="YAML file of settings (sections convert, balance, job; --print-config writes one); "
                        "flags after it override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved settings as YAML (the --config form) and exit")
    for section, cls in SECTIONS.items():
        add_settings_flags(p, cls, section=section, choices=_choices(section),
                           exclude=NO_FLAG.get(section, ()),
                           title=f"{section} ({cls.__module__}.{cls.__name__})")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    add_common_flags(g)
    return p


def _sections(a: jsonargparse.Namespace, *, as_flags: bool = False) -> dict[str, dict]:
    """The parsed settings by section: values as the dataclasses take them, or (``as_flags``) as
    the command line and ``--config`` spell them (``none`` for an unset codec)."""
    out = {}
    for section, cls in SECTIONS.items():
        given = a.get(section) or {}
        values = {f.name: given[f.name] for f in fields(cls) if f.name in given}
        out[section] = values if as_flags else settings_values(cls, values)
    return out


def config_from_args(a: jsonargparse.Namespace) -> NightlyConfig:
    """Build the :class:`NightlyConfig` of parsed flags (``--progress`` resolved into ``balance.progress``)."""
    s = _sections(a)
    cls = SECTIONS
    return NightlyConfig(convert=cls["convert"](**s["convert"]),
                         balance=cls["balance"](**s["balance"], progress=resolve_progress(a.progress)),
                         job=cls["job"](**s["job"]))


def _main(a: jsonargparse.Namespace, parser: jsonargparse.ArgumentParser) -> int:
    configure_logging(a.verbose, a.quiet, default=logging.INFO, fmt="%(asctime)s %(name)s: %(message)s")
    if a.print_config:
        print(yaml.safe_dump(_sections(a, as_flags=True), sort_keys=False), end="")
        return 0
    job = a.job
    if not job.output:
        parser.error("the following arguments are required: -o/--output")
    if job.rollback:
        r = rollback(job.output, job.rollback, lock_timeout_seconds=job.lock_timeout_seconds)
        if a.json:
            print(json.dumps({k: r[k] for k in ("run_dir", "run_key", "published", "previous")}, indent=2))
        else:
            print(f"rolled back: {Path(job.output) / 'latest'} -> {r['run_dir']} (was {r['previous']})")
        return 0
    if not a.convert.input:
        parser.error("--input is required (unless --rollback RUN)")
    missing = [flag for flag, name in (("--ranks", "num_ranks"), ("--batch-size-per-rank", "batch_size_per_rank"))
               if a.balance.get(name) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (unless --rollback RUN)")
    configs = [str(c) for c in (a.get("config") or []) if c is not None]  # every file read is an input
    check_output_apart(job.output, configs, output_name="--output", input_name="--config")
    r = run_nightly(config_from_args(a))
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
        print(f"{state}: {Path(job.output) / 'latest'} -> {r['run_dir']}")
    print(f"  bubble before (equal counts) {v['baseline_predicted_bubble']:.2%}  after {v['predicted_bubble']:.4%}"
          f"  ({v['num_ranks']} ranks x {v['num_steps']} steps, {v['num_samples_written']:,} samples)")
    if v.get("warning"):
        print(f"  warning: {v['warning']}")
    if r["removed_runs"]:
        print(f"  removed {len(r['removed_runs'])} old or unfinished runs")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; errors are one ``nightly: error:`` line and exit 2, piping into ``head`` exits 141
    (:func:`fsdata.common.cli.cli_main`)."""
    parser = build_parser()
    return cli_main("nightly", lambda: parser.parse_args(argv), lambda a: _main(a, parser), location=("job.output",))
