"""``fstrain``: train on fsdata shards, replay their bubble on one device, calibrate the cost model, report.

Errors a user can cause print one line on stderr and exit with status 2 (like ``parser.error``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from fsdata.cliutil import (add_common_flags, add_num_threads_flag, add_output_flag, add_version_flag,
                            configure_logging, resolve_progress, run_main)
from fsdata.errors import FsdataError, cli_terms
from fsdata.guards import check_output_apart
from fstrain.distributed.backends import BACKEND_CHOICES
from fstrain.errors import FstrainError

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


def _add_model_flags(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    from fstrain.models.config import MODELS, OBJECTIVES, Config

    base = {f: Config.__dataclass_fields__[f].default for f in
            ("model", "embedding_dim", "num_layers", "num_heads", "num_negatives", "max_seq_len", "dropout",
             "temperature", "bucket_ratio", "attention", "negatives")}
    d = {**base, **(defaults or {})}
    g = p.add_argument_group("model (fstrain.models.config.Config)")
    g.add_argument("--model", choices=MODELS, default=d["model"],
                   help=f"sasrec (softmax attention) or hstu (Zhai et al. 2024) (default {d['model']})")
    g.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help="all-positions (next item at every history position) or last-position; default: from the "
                        "manifest's sample kind (per-user: all-positions, per-event: last-position)")
    g.add_argument("--num-items", type=int, default=None, help="item table rows (default: max id + 1 from the shards)")
    g.add_argument("--embedding-dim", type=int, default=d["embedding_dim"],
                   help=f"a multiple of 4 (default {d['embedding_dim']})")
    g.add_argument("--num-layers", type=int, default=d["num_layers"], help=f"default {d['num_layers']}")
    g.add_argument("--num-heads", type=int, default=d["num_heads"], help=f"default {d['num_heads']}")
    g.add_argument("--attention-dim", type=int, default=None, help="hstu: query/key width per head (default d/heads)")
    g.add_argument("--linear-dim", type=int, default=None, help="hstu: value/gate width per head (default d/heads)")
    g.add_argument("--num-negatives", type=int, default=d["num_negatives"],
                   help=f"sampled-softmax negatives shared per step; 0: full softmax (default {d['num_negatives']})")
    g.add_argument("--negatives", choices=("step", "sample"), default=d.get("negatives", "step"),
                   help="step: K negatives shared by the step; sample: K per sample, keyed by sample id (both "
                        "independent of the rank a sample lands on) (default step)")
    g.add_argument("--temperature", type=float, default=d["temperature"],
                   help=f"logits = similarity / temperature (default {d['temperature']})")
    g.add_argument("--no-l2-normalize", dest="l2_normalize", action="store_false", default=True,
                   help="plain dot products instead of cosine similarity")
    g.add_argument("--dropout", type=float, default=d["dropout"], help=f"dropout rate (default {d['dropout']})")
    g.add_argument("--max-seq-len", type=int, default=d["max_seq_len"], help=f"default {d['max_seq_len']}")
    g.add_argument("--bucket-ratio", type=float, default=d["bucket_ratio"], help="attention length-bucket ratio (>= 1)")
    g.add_argument("--attention", choices=("bucketed", "reference"), default=d["attention"])
    p.add_argument("--seed", type=int, default=0, help="init, dropout and negatives seed (default 0)")


_MODEL_FLAGS = ("model", "objective", "embedding_dim", "num_layers", "num_heads", "attention_dim", "linear_dim",
                "num_negatives", "negatives", "temperature", "l2_normalize", "dropout", "max_seq_len", "bucket_ratio", "attention")


def _model_kwargs(a: argparse.Namespace) -> dict:
    kw = {k: getattr(a, k) for k in _MODEL_FLAGS}
    for k in ("objective", "attention_dim", "linear_dim"):  # None: decided later (manifest, model)
        if kw[k] is None:
            del kw[k]
    if a.num_items is not None:
        kw["num_items"] = a.num_items
    return kw


def _add_timing_flags(p: argparse.ArgumentParser, repeats: int = 5) -> None:
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    p.add_argument("--repeats", type=int, default=repeats, help=f"timed runs per batch (default {repeats})")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    add_num_threads_flag(p, default=1, help="torch CPU threads (default 1: steady timings)", deprecated=("--threads",))
    p.add_argument("--clock", choices=("auto", "thread", "wall"), default="auto",
                   help="auto: thread CPU time on CPU with 1 thread, else wall")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fstrain", description=__doc__.splitlines()[0])
    add_version_flag(parser, "fstrain")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    t = sub.add_parser("train", help="train on an fsdata balance OUTPUT", epilog=_TRAIN_EPILOG, formatter_class=fmt)
    t.add_argument("shards", help="fsdata balance OUTPUT written for this world size")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: all)")
    t.add_argument("--log-every-steps", "--log-every", type=int, default=10, help="rank-0 log period (default 10)")
    t.add_argument("--checkpoint-dir", default=None)
    t.add_argument("--checkpoint-every-steps", type=int, default=0, help="0: only at the end")
    t.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --checkpoint-dir")
    t.add_argument("--metrics-dir", default=None, help="write step_times.parquet and summary.json here")
    t.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard event files here (loss, samples/s, per-rank compute, straggler wait, "
                        "exposed communication per step); view with: tensorboard --logdir DIR")
    t.add_argument("--pipeline", choices=("auto", "prioritized", "pec", "sparse-dist", "plain", "none"),
                   default="auto", help="train pipeline (docs/pipeline.md): auto = torchrec TrainPipelinePEC where it "
                   "runs (CUDA), else our prioritized pipeline; none: the --step-mode loop (default auto)")
    t.add_argument("--step-mode", choices=("measured", "plain"), default="measured",
                   help="loop used with --pipeline none: measured (timed) or plain")
    t.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="auto: nccl with CUDA, else gloo; shm: fstrain.distributed.comm shared-memory all-to-all (CPU); "
                   "cuda-ce: all-to-all on copy engines inside a node, the rest on NCCL (GPU; docs/comm.md)")
    t.add_argument("--collective-timeout-seconds", type=float, default=120.0,
                   help="a rank that makes no progress for this long makes every other rank exit with one line "
                   "naming it, the collective and the step (default 120)")
    from fstrain.distributed.optim import SPARSE_OPTIMIZERS, OptimConfig

    o = OptimConfig()
    t.add_argument("--dense-lr", type=float, default=o.dense_lr, help=f"AdamW learning rate (default {o.dense_lr})")
    t.add_argument("--weight-decay", type=float, default=o.weight_decay,
                   help=f"AdamW weight decay of the dense tower (default {o.weight_decay})")
    t.add_argument("--sparse-lr", type=float, default=o.sparse_lr, help=f"item-table learning rate (default {o.sparse_lr})")
    t.add_argument("--sparse-optimizer", choices=SPARSE_OPTIMIZERS, default=o.sparse_optimizer,
                   help="fused item-table optimizer (adam: CUDA only, fbgemm has no CPU Adam) "
                        f"(default {o.sparse_optimizer})")
    t.add_argument("--eval-data", default=None, metavar="EVAL.parquet",
                   help="held-out file (fsdata convert --holdout last): HR@10/NDCG@10 into eval.parquet and the summary")
    t.add_argument("--eval-every-steps", type=int, default=0, help="with --eval-data: period in steps (0: at the end)")
    t.add_argument("--eval-every-epochs", type=int, default=0,
                   help="with --eval-data: evaluate after every N epochs of the shards (fsdata balance --epochs)")
    t.add_argument("--eval-max-users", type=int, default=None,
                   help="with --eval-data: evaluate a fixed seeded sample of this many users (default: all)")
    t.add_argument("--simulate-ranks", action="store_true",
                   help="one process trains on each step's whole global batch (all rank files): the update of "
                        "num_ranks ranks, for quality measurements on a small machine")
    t.add_argument("--json", action="store_true", help="print the summary as JSON (rank 0)")
    add_common_flags(t, name="fstrain")
    _add_model_flags(t)

    e = sub.add_parser("evaluate", help="HR@10/NDCG@10 of a checkpoint on a held-out file", epilog=_EVAL_EPILOG,
                       formatter_class=fmt)
    e.add_argument("checkpoint", help="a ckpt/step-XXXXXXXX folder written by fstrain train --checkpoint-dir")
    e.add_argument("eval_data", help="evaluation file from fsdata convert --holdout last --holdout-output")
    e.add_argument("--k", type=int, default=10, help="cutoff K of HR@K and NDCG@K (default 10)")
    e.add_argument("--batch-size", type=int, default=256, help="users per scoring batch (default 256)")
    e.add_argument("--no-mask-history", dest="mask_history", action="store_false",
                   help="keep the user's history items among the candidates (default: masked, as SASRec's negatives)")
    e.add_argument("--padding-id", type=int, default=0, help="item id excluded from the candidates (-1: none; default 0)")
    e.add_argument("--max-users", type=int, default=None,
                   help="evaluate a fixed seeded sample of this many users (default: all)")
    e.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="process-group backend when run under torchrun (default auto)")
    add_output_flag(e, help="also write the result JSON here", deprecated=("--out",))
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    add_common_flags(e, progress=False, name="fstrain")
    _add_model_flags(e)
    # model flags override the config recorded in the checkpoint only when given
    e.set_defaults(**{k: None for k in _MODEL_FLAGS})

    r = sub.add_parser("replay", help="measure the bubble R ranks would see, on one device", epilog=_REPLAY_EPILOG,
                       formatter_class=fmt)
    r.add_argument("shards", help="fsdata balance OUTPUT")
    r.add_argument("--baseline", default=None, help="another OUTPUT (e.g. --strategy shuffle): report the reduction")
    r.add_argument("--max-steps", type=int, default=4, help="replay the first K steps (default 4)")
    r.add_argument("--statistic", choices=("median", "min"), default="median", help="of the repeats")
    r.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_output_flag(r, help="also write the full result (per-step times) to this JSON file", deprecated=("--out",))
    r.add_argument("--no-null-control", action="store_true",
                   help="skip the null control (rank 0's batch timed as every rank; halves the timed work)")
    add_common_flags(r, name="fstrain")
    _add_timing_flags(r, repeats=3)
    _add_model_flags(r, REPLAY_MODEL_DEFAULTS)

    rp = sub.add_parser("report", help="HTML page: the shards' report plus measured per-rank compute, wait, loss",
                        epilog=_REPORT_EPILOG, formatter_class=fmt)
    rp.add_argument("shards", help="the fsdata balance OUTPUT that was trained on")
    rp.add_argument("--metrics-dir", required=True, help="the fstrain train --metrics-dir folder of that run")
    rp.add_argument("--html", default=None, metavar="PATH",
                    help="page to write (default: METRICS_DIR/report.html); PNGs go beside it")
    rp.add_argument("--input", default=None, help="the balance INPUT, when sample_ids are not its row numbers")
    rp.add_argument("--json", action="store_true", help="print the written paths and figures as JSON")
    add_common_flags(rp, progress=False, name="fstrain")

    c = sub.add_parser("calibrate", help="fit the per-sample cost model c0 + c1 L + c2 L^2 on this device",
                       epilog=_CALIBRATE_EPILOG, formatter_class=fmt)
    add_output_flag(c, required=True, help="JSON file for fsdata balance --cost-model")
    c.add_argument("--lengths", default="4,16,48,96,160,256,384,512", help="comma-separated grid lengths")
    c.add_argument("--batch-sizes", default="8,32", help="comma-separated samples per batch")
    c.add_argument("--mixed", type=int, default=12, help="extra batches of random grid lengths (default 12)")
    c.add_argument("--from-shards", default=None,
                   help="also time the real per-rank batches of this fsdata OUTPUT (best: --strategy shuffle)")
    c.add_argument("--shard-steps", type=int, default=4, help="steps of --from-shards to time (default 4)")
    c.add_argument("--name", default=None, help="cost model name recorded in manifests")
    c.add_argument("--json", action="store_true", help="print the fit as JSON")
    add_common_flags(c, name="fstrain")
    _add_timing_flags(c)
    _add_model_flags(c)
    return parser


def _ints(text: str, flag: str, parser: argparse.ArgumentParser) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        parser.error(f"{flag} must be comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        parser.error(f"{flag} needs positive integers, got {text!r}")
    return vals


def _cmd_train(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.distributed.optim import OptimConfig
    from fstrain.train import TrainConfig, train

    if a.max_steps is not None and a.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {a.max_steps}")
    if a.eval_every_steps < 0:
        parser.error(f"--eval-every-steps must be >= 0, got {a.eval_every_steps}")
    if a.eval_every_epochs < 0:
        parser.error(f"--eval-every-epochs must be >= 0, got {a.eval_every_epochs}")
    if (a.eval_every_steps or a.eval_every_epochs) and not a.eval_data:
        parser.error("--eval-every-steps / --eval-every-epochs need --eval-data EVAL.parquet")
    if a.resume and not a.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    for flag, path in (("--checkpoint-dir", a.checkpoint_dir), ("--metrics-dir", a.metrics_dir)):
        if path:
            check_output_apart(path, [a.shards], output_name=flag, input_name="SHARDS")
    if not a.collective_timeout_seconds > 0:
        parser.error(f"--collective-timeout-seconds must be > 0, got {a.collective_timeout_seconds}")
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("fstrain").setLevel(logging.WARNING)
    cfg = TrainConfig(shards=a.shards, model=_model_kwargs(a), max_steps=a.max_steps, seed=a.seed,
                      log_every_steps=a.log_every_steps, checkpoint_dir=a.checkpoint_dir,
                      checkpoint_every_steps=a.checkpoint_every_steps, resume=a.resume, step_mode=a.step_mode,
                      metrics_dir=a.metrics_dir, backend=a.backend, tensorboard_dir=a.tensorboard_dir,
                      progress=resolve_progress(a.progress),
                      collective_timeout_seconds=a.collective_timeout_seconds,
                      pipeline=None if a.pipeline == "none" else a.pipeline,
                      eval_data=a.eval_data, eval_every_steps=a.eval_every_steps,
                      eval_every_epochs=a.eval_every_epochs,
                      simulate_ranks=a.simulate_ranks, eval_max_users=a.eval_max_users,
                      optim=OptimConfig(dense_lr=a.dense_lr, sparse_lr=a.sparse_lr, weight_decay=a.weight_decay,
                                        sparse_optimizer=a.sparse_optimizer))
    from fstrain.distributed.watchdog import PEER_FAILURE_EXIT_CODE, PeerFailureError

    try:
        res = train(cfg)
    except PeerFailureError as e:  # peers are gone: no teardown collective, no interpreter shutdown wait
        print(f"fstrain train: error: {e}", file=sys.stderr, flush=True)
        os._exit(PEER_FAILURE_EXIT_CODE)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if a.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(res.summary, sort_keys=True))
    return 0


def _cmd_evaluate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.components.evaluator import evaluate_checkpoint
    from fstrain.components.metrics import write_json

    if a.k < 1 or a.batch_size < 1:
        parser.error(f"--k and --batch-size must be >= 1, got {a.k} and {a.batch_size}")
    if a.output:
        check_output_apart(a.output, [a.checkpoint, a.eval_data], output_name="--output",
                           input_name="CHECKPOINT or EVAL_DATA")
    given = {k: v for k, v in _model_kwargs(a).items() if v is not None}
    try:
        res = evaluate_checkpoint(a.checkpoint, a.eval_data, model=given, k=a.k, batch_size=a.batch_size,
                                  mask_history=a.mask_history, padding_id=a.padding_id, backend=a.backend,
                                  max_users=a.max_users)
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
            print(f"{a.checkpoint} (step {res['step']}): HR@{a.k} {res[f'hr@{a.k}']:.4f}  NDCG@{a.k} "
                  f"{res[f'ndcg@{a.k}']:.4f}  over {res['num_users']:,} users, {res['num_candidates']:,} candidate "
                  f"items (history {'masked' if a.mask_history else 'not masked'})")
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
    null = f"{r['null_bubble']:>12.2%}{r['measured_bubble_minus_null']:>12.2%}" if "null_bubble" in r else f"{'-':>12}{'-':>12}"
    return (f"{label:<28}{r['measured_bubble']:>10.2%}{null}{r['predicted_bubble']:>11.2%}"
            f"{r['slowest_rank_seconds_per_step'] * 1e3:>17.1f}")


def _cmd_replay(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fsdata.balancer.bubble import reduction
    from fstrain.components.metrics import write_json
    from fstrain.measure.replay import replay

    if a.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {a.max_steps}")
    if a.output:
        check_output_apart(a.output, [a.shards, a.baseline], output_name="--output", input_name="shards")
    kw = dict(max_steps=a.max_steps, warmup=a.warmup, repeats=a.repeats, model=_model_kwargs(a), seed=a.seed,
              device=a.device, num_threads=a.num_threads, clock=a.clock, statistic=a.statistic,
              null_control=not a.no_null_control)
    runs = [a.shards] + ([a.baseline] if a.baseline else [])
    bar = _progress_bar(a, total=0)
    results = []
    try:
        for path in runs:
            bar.set_description(f"replay {os.path.basename(os.path.normpath(path))}")

            def tick(done: int, total: int, _bar=bar) -> None:
                if _bar.total != total * len(runs):
                    _bar.total = total * len(runs)
                _bar.update(1)

            results.append(replay(path, progress=tick, **kw))
    finally:
        bar.close()
    res = results[0]
    if a.baseline:
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
              f"{a.repeats} repeats ({a.statistic}, {res['clock']} clock); null control = rank 0's batch timed as "
              "every rank (identical work: what noise alone reads as a bubble)")
        print(f"{'shards':<28}{'measured':>10}{'null ctrl':>12}{'minus null':>12}{'predicted':>11}"
              f"{'slowest ms/step':>17}")
        print(_replay_row(f"{os.path.basename(os.path.normpath(a.shards))} ({res['strategy']})", res))
        if a.baseline:
            print(_replay_row(f"{os.path.basename(os.path.normpath(a.baseline))} ({base['strategy']})", base))
            line = (f"measured reduction {res['measured_reduction']:.1%} (predicted {res['predicted_reduction']:.1%}"
                    + (f", above the null control {res['measured_reduction_minus_null']:.1%}" if "null_bubble" in res
                       else "") + "); slowest rank "
                    f"{base['slowest_rank_seconds_per_step'] * 1e3:.1f} -> {res['slowest_rank_seconds_per_step'] * 1e3:.1f}"
                    f" ms/step ({-res['slowest_rank_reduction']:+.1%}): the figure that decides training time")
            print(line)
    return 0


def _cmd_report(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.measure.report import write_train_report

    r = write_train_report(a.shards, a.metrics_dir, a.html, input_path=a.input)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"wrote {r['html']} (+ {len(r['png'])} PNG files beside it); {r['num_steps']} steps: measured bubble "
              f"{r['measured_bubble']:.2%}, predicted {r['predicted_bubble']:.4%}")
    return 0


def _cmd_calibrate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_output_apart(a.output, [a.from_shards], output_name="--output", input_name="--from-shards")
    from fstrain.measure.calibrate import calibrate, shard_batches
    from fstrain.components.metrics import write_json

    lengths = _ints(a.lengths, "--lengths", parser)
    sizes = _ints(a.batch_sizes, "--batch-sizes", parser)
    kw = _model_kwargs(a)
    num_items = kw.pop("num_items", 4000)
    if a.shard_steps < 1:
        parser.error(f"--shard-steps must be >= 1, got {a.shard_steps}")
    extra = shard_batches(a.from_shards, a.shard_steps) if a.from_shards else None
    from tqdm import tqdm

    bar = tqdm(total=0, unit="batch", desc="calibrate", disable=not resolve_progress(a.progress), file=sys.stderr)

    def tick(done: int, total: int) -> None:
        bar.total = total
        bar.update(1)

    with bar:
        res = calibrate(model=kw, num_items=num_items, lengths=lengths, batch_sizes=sizes, num_mixed=a.mixed,
                        extra_batches=extra, progress=tick,
                        warmup=a.warmup, repeats=a.repeats, seed=a.seed, device=a.device, num_threads=a.num_threads,
                        clock=a.clock, name=a.name)
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
    """Entry point of the ``fstrain`` console script (piping into ``head`` exits quietly, 141)."""
    parser = build_parser()
    parsed: list[argparse.Namespace] = []

    def body() -> int:
        parsed.append(parser.parse_args(argv))
        return _main(parsed[0], parser)

    def location() -> str | None:
        a = parsed[0] if parsed else None
        return a and next((getattr(a, k) for k in ("output", "metrics_dir", "checkpoint_dir")
                           if getattr(a, k, None)), None)

    return run_main("fstrain", body, location)


def _main(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Libraries (fbgemm, torchrec) log INFO on the root logger: keep it at WARNING, fstrain at INFO.
    configure_logging(a.verbose, a.quiet, default=logging.INFO, fmt="%(asctime)s %(levelname)s %(name)s: %(message)s",
                      force=True)
    cmd = {"train": _cmd_train, "replay": _cmd_replay, "calibrate": _cmd_calibrate, "report": _cmd_report,
           "evaluate": _cmd_evaluate}[a.command]
    try:
        with cli_terms():
            return cmd(a, parser)
    except (FstrainError, FsdataError) as e:
        print(f"fstrain {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
