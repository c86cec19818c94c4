"""``fstrain``: train on fsdata shards, replay their bubble on one device, calibrate the cost model, report.

Errors a user can cause print one line on stderr and exit with status 2 (like ``parser.error``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from fsdata.common.cli import (add_common_flags, add_json_flag, add_output_flag, add_settings_flags, add_subcommands,
                            add_version_flag, cli_main, configure_logging, new_parser, resolve_progress)
from fsdata.guards import check_output_apart
from fstrain.components.outputs import check_output_file
from fstrain.config import KEY_ROOT
from fstrain.distributed.launch import parse_once, report_user_error, run_recorded
from fstrain.errors import ConfigError, FstrainError
from fstrain.quiet import show_all_noise, silence_known_noise

_TRAIN_EPILOG = """examples:
  torchrun --nproc-per-node 2 -m fstrain.cli train shards/ --max-steps 100 --log-every-steps 10
  fstrain train shards/ --checkpoint-dir ckpt/ --checkpoint-every-steps 50 --resume --metrics-dir run/
"""
_EVAL_EPILOG = """examples:
  fsdata convert sequences.txt train.parquet --format sequences --holdout last --holdout-output eval.parquet
  fstrain evaluate ckpt/step-00000100 eval.parquet --json
  fstrain train shards/ --eval-data eval.parquet --eval-every-steps 50 --metrics-dir run/
"""
_REPLAY_EPILOG = """examples:
  fstrain replay balanced/ --baseline shuffled/          # 4 steps, 3 repeats, small model: < 1 min
  fstrain replay balanced/ --baseline shuffled/ --max-steps 8 --repeats 21 --statistic min -o replay.json
"""
_REPORT_EPILOG = """examples:
  fstrain report shards/ --metrics-dir run/                  # writes run/report.html (+ PNGs)
  fstrain report shards/ --metrics-dir run/ --html review/run.html
"""
_CALIBRATE_EPILOG = """examples:
  fstrain calibrate -o calibrated.json --embedding-dim 32 --num-layers 1
  fstrain calibrate -o calibrated.json --from-shards shuffled/ --shard-steps 4 --embedding-dim 32
  fsdata balance samples.parquet shards/ --ranks 16 --batch-size-per-rank 32 --cost-model calibrated.json
"""


#: ``fstrain replay``'s default model: the small model every documented replay figure uses, so the
#: README example finishes in under a minute on 2 CPU cores (train's default model is 3-4x slower).
REPLAY_MODEL_DEFAULTS = {"embedding_dim": 32, "num_layers": 1, "num_negatives": 64}


def _add_model_flags(p, defaults: dict | None = None, *, override: bool = False) -> None:
    """The model flags of :class:`fstrain.models.config.Config` (``model.*``) and ``--seed``
    (:class:`fstrain.config.TrainConfig`'s), generated from the fields."""
    from fstrain.config import TrainConfig, add_config_flags
    from fstrain.models.config import Config

    add_config_flags(p, Config, prefix="model.", defaults=Config(**(defaults or {})), override=override)
    add_settings_flags(p, TrainConfig, section=KEY_ROOT, include=("seed",), title="run")


def _model_kwargs(a: argparse.Namespace) -> dict:
    """:class:`fstrain.models.config.Config` keyword arguments of the parsed model flags (``None`` left out)."""
    kw = {k.split(".", 1)[1]: v for k, v in vars(a).items() if k.startswith("model.")}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items() if v is not None}


def _add_command_flags(p, cls: type, section: str, **choices) -> None:
    """The flags of a command's settings dataclass (``cls``: :class:`fstrain.config.ReplayConfig`, ...),
    its ``timing`` aside (:func:`_add_timing_flags`)."""
    add_settings_flags(p, cls, section=f"{KEY_ROOT}.{section}", choices=choices or None,
                       title=f"{section} ({cls.__module__}.{cls.__qualname__})")


def _add_timing_flags(p, cls: type, section: str) -> None:
    """The flags of ``cls``'s ``timing`` (:class:`fstrain.config.TimingConfig`), with ``cls``'s default timing."""
    timing = cls().timing
    add_settings_flags(p, type(timing), section=f"{KEY_ROOT}.{section}.timing", defaults=timing,
                       title=f"timing ({type(timing).__module__}.{type(timing).__qualname__})")


def _settings(a: argparse.Namespace, cls: type, parser):
    """``cls`` (a command's settings dataclass) built straight from its parsed flags, its ``timing``
    too; a value it refuses (its own checks, on construction) is a usage error naming the flag."""
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if f.name != "timing"}
    try:
        if "timing" in {f.name for f in dataclasses.fields(cls)}:
            kw["timing"] = _settings(a, type(cls().timing), parser)
        return cls(**kw)
    except ConfigError as e:
        parser.error(str(e))


def _nest(flat: dict) -> dict:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    out: dict = {}
    for key, value in flat.items():
        *heads, last = key.split(".")
        node = out
        for h in heads:
            node = node.setdefault(h, {})
        node[last] = value
    return out


def _config_file_action():
    """``fstrain train --config FILE``: jsonargparse's config action reading the YAML ``--print-config``
    prints (checked by :func:`fstrain.config.load_yaml`: a bad file is one line naming the problem) into
    the settings flags' keys, so the command line is parsed once. :func:`parse_args` puts it first, so
    every flag given on the command line overrides the file, wherever it stands."""
    from jsonargparse import ActionConfigFile

    class TrainConfigFile(ActionConfigFile):
        def __call__(self, parser, cfg, values, option_string=None):
            from fstrain.config import NOT_FLAGS, load_yaml

            flat = {k if k == "shards" else f"{KEY_ROOT}.{k}": v for k, v in load_yaml(values).items()
                    if k not in NOT_FLAGS}  # progress: a flag of its own; the shm timeout: the collective one
            self.apply_config(parser, cfg, self.dest, json.dumps(_nest(flat)))

    return TrainConfigFile


def _config_first(argv: list[str]) -> list[str]:
    """``argv`` with ``fstrain train``'s ``--config FILE`` moved to just after ``train``."""
    if "train" not in argv:
        return argv
    at = argv.index("train") + 1
    rest, moved, i = list(argv[at:]), [], 0
    while i < len(rest):
        if rest[i] == "--config" and i + 1 < len(rest):
            moved += rest[i:i + 2]
            del rest[i:i + 2]
        elif rest[i].startswith("--config="):
            moved.append(rest.pop(i))
        else:
            i += 1
    return argv[:at] + moved + rest


def _command(help: str, epilog: str):  # noqa: A002
    return new_parser(description=help, epilog=epilog), help


def build_parser():
    """The ``fstrain`` command line (``jsonargparse``): every settings flag is generated from a
    dataclass field of :mod:`fstrain.config` or :class:`fstrain.models.config.Config`."""
    from fstrain.config import CHOICES, CalibrateConfig, EvaluateConfig, ReplayConfig, TrainConfig, add_config_flags

    parser = new_parser(prog="fstrain", description=__doc__.splitlines()[0])
    add_version_flag(parser, "fstrain")
    cmds = {}

    t, _ = cmds["train"] = _command("train on an fsdata balance OUTPUT", _TRAIN_EPILOG)
    t.add_argument("shards", nargs="?", default=argparse.SUPPRESS,  # not given: --config's, else None
                   help="fsdata balance OUTPUT written for this world size")
    t.add_argument("--config", action=_config_file_action(), metavar="FILE.yaml",
                   help="read the settings from this YAML file (keys as --print-config prints them); flags given "
                        "on the command line override it")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    add_json_flag(t, "print the summary as JSON (rank 0)")
    add_common_flags(t, name="fstrain")
    add_config_flags(t, TrainConfig)

    e, _ = cmds["evaluate"] = _command("HR@10/NDCG@10 of a checkpoint on a held-out file", _EVAL_EPILOG)
    e.add_argument("checkpoint", help="a ckpt/step-XXXXXXXX folder written by fstrain train --checkpoint-dir")
    e.add_argument("eval_data", help="evaluation file from fsdata convert --holdout last --holdout-output")
    _add_command_flags(e, EvaluateConfig, "evaluate", backend=CHOICES["evaluate.backend"])
    add_output_flag(e, help="also write the result JSON here")
    add_json_flag(e, "print the result as JSON")
    add_common_flags(e, progress=False, name="fstrain")
    _add_model_flags(e, override=True)  # given flags override the config recorded in the checkpoint

    r, _ = cmds["replay"] = _command("measure the bubble R ranks would see, on one device", _REPLAY_EPILOG)
    r.add_argument("shards", help="fsdata balance OUTPUT")
    _add_command_flags(r, ReplayConfig, "replay")
    add_json_flag(r, "print the result as one JSON object")
    add_output_flag(r, help="also write the full result (per-step times) to this JSON file")
    add_common_flags(r, name="fstrain")
    _add_timing_flags(r, ReplayConfig, "replay")
    _add_model_flags(r, REPLAY_MODEL_DEFAULTS)

    rp, _ = cmds["report"] = _command("HTML page: the shards' report plus measured per-rank compute, wait, loss",
                                      _REPORT_EPILOG)
    rp.add_argument("shards", help="the fsdata balance OUTPUT that was trained on")
    rp.add_argument("--metrics-dir", required=True, help="the fstrain train --metrics-dir folder of that run")
    rp.add_argument("--html", default=None, metavar="PATH",
                    help="page to write (default: METRICS_DIR/report.html); PNGs go beside it")
    rp.add_argument("--input", default=None, help="the balance INPUT, when sample_ids are not its row numbers")
    add_json_flag(rp, "print the written paths and figures as JSON")
    add_common_flags(rp, progress=False, name="fstrain")

    c, _ = cmds["calibrate"] = _command("fit the per-sample cost model c0 + c1 L + c2 L^2 on this device",
                                        _CALIBRATE_EPILOG)
    add_output_flag(c, required=True, help="JSON file for fsdata balance --cost-model")
    _add_command_flags(c, CalibrateConfig, "calibrate")
    add_json_flag(c, "print the fit as JSON")
    add_common_flags(c, name="fstrain")
    _add_timing_flags(c, CalibrateConfig, "calibrate")
    _add_model_flags(c)
    add_subcommands(parser, cmds)
    return parser


def parse_args(argv: list[str], parser=None) -> argparse.Namespace:
    """Parse a command line into the flat namespace the commands read: ``command``, ``_argv``, the
    subcommand's arguments by name, settings fields by name (``max_steps``), and the model's and
    ``fstrain train``'s config fields by their dotted path (``model.embedding_dim``, ``metrics.dir``)."""
    a = (parser or build_parser()).parse_args(_config_first(list(argv)))
    flat = argparse.Namespace(command=a.command, _argv=list(argv))
    for key, value in a[a.command].items(branches=False):
        key = key.removeprefix(KEY_ROOT + ".")
        dotted = a.command == "train" or key.startswith("model.")
        setattr(flat, key if dotted else key.rsplit(".", 1)[-1], value)
    return flat


def _train_config(a: argparse.Namespace, parser):
    """The :class:`fstrain.config.TrainConfig` of ``fstrain train``'s flags (its ``--config`` file
    read by the parser, :func:`_config_file_action`)."""
    from fstrain.config import NOT_FLAGS, TrainConfig, from_dict, walk_fields

    paths = {p for p, *_ in walk_fields(TrainConfig)} & set(vars(a)) - NOT_FLAGS  # the flags' fields
    values = {k: getattr(a, k) for k in paths}
    values.update(shards=getattr(a, "shards", None), progress=resolve_progress(a.progress))
    return a, from_dict(values)


def _cmd_train(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.config import to_yaml

    a, cfg = _train_config(a, parser)
    if a.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    from fstrain.components.heap import configure_heap

    configure_heap()  # the step's tensors from the heap, trimmed every 10 steps (fstrain/components/heap.py)
    if cfg.shards is None:
        raise ConfigError("fstrain train needs SHARDS (an fsdata balance OUTPUT), on the command line or in --config")
    cfg.check()
    for flag, path in (("--checkpoint-dir", cfg.checkpoint.dir), ("--metrics-dir", cfg.metrics.dir),
                       ("--tensorboard-dir", cfg.metrics.tensorboard_dir)):
        if path:
            check_output_apart(path, [cfg.shards, cfg.checkpoint.init_from, cfg.eval.data], output_name=flag,
                               input_name="SHARDS, --init-from or --eval-data")
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("fstrain").setLevel(logging.WARNING)
    from fstrain.distributed.watchdog import PEER_FAILURE_EXIT_CODE, PeerFailureError
    from fstrain.train import train

    try:
        res = train(cfg)
    except PeerFailureError as e:  # peers are gone: no teardown collective, no interpreter shutdown wait
        report_user_error(f"fstrain train: error: {e}", rank_local=True)
        os._exit(PEER_FAILURE_EXIT_CODE)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if a.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(res.summary, sort_keys=True))
    return 0


def _cmd_evaluate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.components.evaluator import EvaluateConfig, evaluate_checkpoint
    from fstrain.components.metrics import write_json

    cfg = _settings(a, EvaluateConfig, parser)
    if a.output:
        check_output_apart(a.output, [a.checkpoint, a.eval_data], output_name="--output",
                           input_name="CHECKPOINT or EVAL_DATA")
        check_output_file(a.output, "evaluate", "--output")
    given = _model_kwargs(a)
    try:
        res = evaluate_checkpoint(a.checkpoint, a.eval_data, cfg, model=given)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        if a.output:
            write_json(res, a.output)
        if a.json:
            print(json.dumps(res, sort_keys=True))
        else:
            print(f"{a.checkpoint} (step {res['step']}): HR@{cfg.k} {res[f'hr@{cfg.k}']:.4f}  NDCG@{cfg.k} "
                  f"{res[f'ndcg@{cfg.k}']:.4f}  over {res['num_users']:,} users, {res['num_candidates']:,} candidate "
                  f"items (history {'masked' if cfg.mask_history else 'not masked'})")
    return 0


_REPLAY_BRIEF_DROP = ("compute_seconds", "step_measured_bubble", "null_compute_seconds", "null_step_bubble")
_REPLAY_BASELINE_KEYS = ("shards", "strategy", "measured_bubble", "predicted_bubble", "mean_step_seconds",
                         "slowest_rank_seconds_per_step", "mean_rank_seconds_per_step", "null_bubble",
                         "measured_bubble_minus_null", "null_slowest_rank_seconds_per_step")


def _progress_bar(a: argparse.Namespace, total: int):
    """tqdm on stderr: shown on a TTY, forced with --progress, hidden with --no-progress."""
    from tqdm import tqdm

    return tqdm(total=total, unit="step", desc="replay", disable=not resolve_progress(a.progress), file=sys.stderr)


def _replay_row(label: str, r: dict) -> str:
    null = (f"{r['null_bubble']:>12.2%}{r['measured_bubble_minus_null']:>12.2%}" if "null_bubble" in r
            else f"{'-':>12}{'-':>12}")
    return (f"{label:<28}{r['measured_bubble']:>10.2%}{null}{r['predicted_bubble']:>11.2%}"
            f"{r['slowest_rank_seconds_per_step'] * 1e3:>17.1f}")


def _cmd_replay(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fsdata.balancer.bubble import reduction
    from fstrain.components.metrics import write_json
    from fstrain.measure.replay import ReplayConfig, replay

    cfg = _settings(a, ReplayConfig, parser)
    if a.output:
        check_output_apart(a.output, [a.shards, cfg.baseline], output_name="--output", input_name="shards")
        check_output_file(a.output, "replay", "--output")
    runs = [a.shards] + ([cfg.baseline] if cfg.baseline else [])
    bar = _progress_bar(a, total=0)
    results = []
    try:
        for path in runs:
            bar.set_description(f"replay {os.path.basename(os.path.normpath(path))}")

            def tick(done: int, total: int, _bar=bar) -> None:
                if _bar.total != total * len(runs):
                    _bar.total = total * len(runs)
                _bar.update(1)

            results.append(replay(path, cfg, model=_model_kwargs(a), seed=a.seed, progress=tick))
    finally:
        bar.close()
    res = results[0]
    if cfg.baseline:
        base = results[1]
        res["baseline"] = {k: base[k] for k in _REPLAY_BASELINE_KEYS if k in base}
        res["measured_reduction"] = reduction(res["measured_bubble"], base["measured_bubble"])
        res["predicted_reduction"] = reduction(res["predicted_bubble"], base["predicted_bubble"])
        res["slowest_rank_reduction"] = reduction(res["slowest_rank_seconds_per_step"],
                                                  base["slowest_rank_seconds_per_step"])
        if "null_bubble" in res:
            res["measured_reduction_minus_null"] = reduction(max(0.0, res["measured_bubble_minus_null"]),
                                                             max(0.0, base["measured_bubble_minus_null"]))
    if a.output:
        write_json(res, a.output)
    brief = {k: v for k, v in res.items() if k not in _REPLAY_BRIEF_DROP}
    if a.json:
        print(json.dumps(brief, sort_keys=True))
    else:
        print(f"{res['num_ranks']} ranks x {res['num_steps']} steps, B = {res['batch_size_per_rank']}, "
              f"{cfg.timing.repeats} repeats ({cfg.statistic}, {res['clock']} clock); null control = rank 0's batch "
              "timed as every rank (identical work: what noise alone reads as a bubble)")
        print(f"{'shards':<28}{'measured':>10}{'null ctrl':>12}{'minus null':>12}{'predicted':>11}"
              f"{'slowest ms/step':>17}")
        print(_replay_row(f"{os.path.basename(os.path.normpath(a.shards))} ({res['strategy']})", res))
        if cfg.baseline:
            print(_replay_row(f"{os.path.basename(os.path.normpath(cfg.baseline))} ({base['strategy']})", base))
            line = (f"measured reduction {res['measured_reduction']:.1%} (predicted {res['predicted_reduction']:.1%}"
                    + (f", above the null control {res['measured_reduction_minus_null']:.1%}" if "null_bubble" in res
                       else "") + "); slowest rank "
                    f"{base['slowest_rank_seconds_per_step'] * 1e3:.1f} -> "
                    f"{res['slowest_rank_seconds_per_step'] * 1e3:.1f}"
                    f" ms/step ({-res['slowest_rank_reduction']:+.1%}): the figure that decides training time")
            print(line)
    return 0


def _cmd_report(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.measure.report import write_train_report

    html = a.html or os.path.join(a.metrics_dir, "report.html")
    metrics_files = [os.path.join(a.metrics_dir, n) for n in ("step_times.parquet", "summary.json", "eval.parquet")]
    check_output_apart(html, [a.shards, a.input, *metrics_files], output_name="--html",
                       input_name="SHARDS, --input or a --metrics-dir file")
    check_output_file(html, "report", "--html")
    r = write_train_report(a.shards, a.metrics_dir, html, input_path=a.input)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"wrote {r['html']} (+ {len(r['png'])} PNG files beside it); {r['num_steps']} steps: measured bubble "
              f"{r['measured_bubble']:.2%}, predicted {r['predicted_bubble']:.4%}")
    return 0


def _cmd_calibrate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.measure.calibrate import CalibrateConfig, calibrate

    cfg = _settings(a, CalibrateConfig, parser)
    check_output_apart(a.output, [cfg.from_shards], output_name="--output", input_name="--from-shards")
    check_output_file(a.output, "cost-model", "--output")
    from fstrain.components.metrics import write_json

    kw = _model_kwargs(a)
    num_items = kw.pop("num_items", 4000)
    from tqdm import tqdm

    bar = tqdm(total=0, unit="batch", desc="calibrate", disable=not resolve_progress(a.progress), file=sys.stderr)

    def tick(done: int, total: int) -> None:
        bar.total = total
        bar.update(1)

    with bar:
        res = calibrate(cfg, model=kw, num_items=num_items, seed=a.seed, progress=tick)
    write_json(res, a.output)
    if a.json:
        print(json.dumps({k: v for k, v in res.items() if k != "measurements"}, sort_keys=True))
    else:
        c0, c1, c2 = res["coefficients"]
        print(f"{a.output}: cost(L) = {c0:.3e} + {c1:.3e} L + {c2:.3e} L^2 seconds "
              f"(+ {res['batch_overhead_seconds'] * 1e3:.2f} ms per batch); relative fit error "
              f"rms {res['fit']['relative_rms_error']:.1%}, max {res['fit']['max_relative_error']:.1%} "
              f"over {res['fit']['num_measurements']} batches on {res['device']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fstrain`` console script; returns the exit status.

    A user error is one ``fstrain COMMAND: error:`` line with exit 2; piping into ``head`` exits 141
    quietly (:func:`fsdata.common.cli.cli_main`).

    Under torchrun (docs/fstrain.md, "Errors under torchrun") a user error is printed once, by
    rank 0 (:mod:`fstrain.distributed.launch`), every worker exits 2, and the line goes to torch
    elastic's error file, so torchrun's summary shows it; anything else runs under ``@record``.
    """
    parser = build_parser()
    args = sys.argv[1:] if argv is None else list(argv)
    return run_recorded(lambda: cli_main(
        "fstrain", lambda: parse_once(lambda: _parse_or_exit(args, parser)), lambda a: _main(a, parser),
        errors=(FstrainError,), location=("output", "metrics.dir", "checkpoint.dir"),
        label=lambda a: f"fstrain {a.command}"))


def _parse_or_exit(args: list[str], parser) -> argparse.Namespace:
    """:func:`parse_args`; a bad ``--config`` file (a user error raised while parsing) is kept in the
    namespace and raised by :func:`_main`, which reports it as every command's user errors."""
    try:
        return parse_args(args, parser)
    except FstrainError as e:
        return argparse.Namespace(command=args[0], parse_error=e, verbose=False, quiet=False, _argv=list(args))


def _main(a: argparse.Namespace, parser) -> int:
    # Libraries (fbgemm, torchrec) log INFO on the root logger: keep it at WARNING, fstrain at INFO.
    configure_logging(a.verbose, a.quiet, default=logging.INFO, fmt="%(asctime)s %(levelname)s %(name)s: %(message)s",
                      force=True)
    # known library noise (fstrain.quiet) shows with -v only; our own warnings always
    (show_all_noise if a.verbose else silence_known_noise)()
    cmd = {"train": _cmd_train, "replay": _cmd_replay, "calibrate": _cmd_calibrate, "report": _cmd_report,
           "evaluate": _cmd_evaluate}[a.command]
    from fsdata.errors import FsdataError

    try:
        if getattr(a, "parse_error", None) is not None:
            raise a.parse_error
        return cmd(a, parser)
    except (FsdataError, FstrainError) as e:  # once per job under torchrun (fstrain.distributed.launch)
        report_user_error(f"fstrain {a.command}: error: {e}", rank_local=getattr(e, "rank_local", False))
        return 2


if __name__ == "__main__":
    sys.exit(main())
