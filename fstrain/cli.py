"""``fstrain``: train on fsdata shards, replay their bubble on one device, calibrate the cost model.

Errors a user can cause print one line on stderr and exit with status 2 (like ``parser.error``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from fsdata.errors import FsdataError
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
  fstrain replay shards/ --max-steps 20 --json
  fstrain replay balanced/ --baseline shuffled/ --max-steps 20 --repeats 5 --out replay.json
"""
_CALIBRATE_EPILOG = """examples:
  fstrain calibrate --output calibrated.json --embedding-dim 32 --num-layers 1
  fstrain calibrate --output calibrated.json --from-shards shuffled/ --shard-steps 4 --embedding-dim 32
  fsdata balance samples.parquet shards/ --ranks 16 --batch-size-per-rank 32 --cost-model calibrated.json
"""


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (fstrain.model.Config)")
    g.add_argument("--num-items", type=int, default=None, help="item table rows (default: max id + 1 from the shards)")
    g.add_argument("--embedding-dim", type=int, default=64)
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--num-heads", type=int, default=2)
    g.add_argument("--num-negatives", type=int, default=128, help="sampled-softmax negatives shared per step")
    g.add_argument("--max-seq-len", type=int, default=512)
    g.add_argument("--bucket-ratio", type=float, default=1.25, help="attention length-bucket ratio (>= 1)")
    g.add_argument("--attention", choices=("bucketed", "reference"), default="bucketed")
    p.add_argument("--seed", type=int, default=0, help="init and negatives seed (default 0)")


def _model_kwargs(a: argparse.Namespace) -> dict:
    kw = {"embedding_dim": a.embedding_dim, "num_layers": a.num_layers, "num_heads": a.num_heads,
          "num_negatives": a.num_negatives, "max_seq_len": a.max_seq_len, "bucket_ratio": a.bucket_ratio,
          "attention": a.attention}
    if a.num_items is not None:
        kw["num_items"] = a.num_items
    return kw


def _add_timing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per batch (default 5)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steady timings)")
    p.add_argument("--clock", choices=("auto", "thread", "wall"), default="auto",
                   help="auto: thread CPU time on CPU with 1 thread, else wall")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fstrain", description=__doc__.splitlines()[0])
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
    t.add_argument("--pipeline", choices=("auto", "prioritized", "pec", "sparse-dist", "plain", "none"),
                   default="auto", help="train pipeline (docs/pipeline.md): auto = torchrec TrainPipelinePEC where it "
                   "runs (CUDA), else our prioritized pipeline; none: the --step-mode loop (default auto)")
    t.add_argument("--step-mode", choices=("measured", "plain"), default="measured",
                   help="loop used with --pipeline none: measured (timed) or plain")
    t.add_argument("--backend", choices=("auto", "gloo", "nccl", "shm"), default="auto",
                   help="auto: nccl with CUDA, else gloo; shm: fstrain.comm shared-memory transport (CPU)")
    t.add_argument("--dense-lr", type=float, default=1e-3)
    t.add_argument("--sparse-lr", type=float, default=0.05)
    t.add_argument("--sparse-optimizer", choices=("rowwise_adagrad", "sgd"), default="rowwise_adagrad")
    t.add_argument("--eval-data", default=None, metavar="EVAL.parquet",
                   help="held-out file (fsdata convert --holdout last): HR@10/NDCG@10 into eval.parquet and the summary")
    t.add_argument("--eval-every-steps", type=int, default=0, help="with --eval-data: period in steps (0: at the end)")
    t.add_argument("--eval-max-users", type=int, default=None,
                   help="with --eval-data: evaluate a fixed seeded sample of this many users (default: all)")
    t.add_argument("--simulate-ranks", action="store_true",
                   help="one process trains on each step's whole global batch (all rank files): the update of "
                        "num_ranks ranks, for quality measurements on a small machine")
    t.add_argument("--json", action="store_true", help="print the summary as JSON (rank 0)")
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
    e.add_argument("--backend", choices=("auto", "gloo", "nccl", "shm"), default="auto")
    e.add_argument("--out", default=None, help="also write the result JSON here")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_model_flags(e)
    # model flags override the config recorded in the checkpoint only when given
    e.set_defaults(embedding_dim=None, num_layers=None, num_heads=None, num_negatives=None, max_seq_len=None,
                   bucket_ratio=None, attention=None)

    r = sub.add_parser("replay", help="measure the bubble R ranks would see, on one device", epilog=_REPLAY_EPILOG,
                       formatter_class=fmt)
    r.add_argument("shards", help="fsdata balance OUTPUT")
    r.add_argument("--baseline", default=None, help="another OUTPUT (e.g. --strategy shuffle): report the reduction")
    r.add_argument("--max-steps", type=int, default=20, help="replay the first K steps (default 20)")
    r.add_argument("--statistic", choices=("median", "min"), default="median", help="of the repeats")
    r.add_argument("--json", action="store_true", help="print the result as one JSON object")
    r.add_argument("--out", default=None, help="also write the full result (per-step times) to this JSON file")
    _add_timing_flags(r)
    _add_model_flags(r)

    c = sub.add_parser("calibrate", help="fit the per-sample cost model c0 + c1 L + c2 L^2 on this device",
                       epilog=_CALIBRATE_EPILOG, formatter_class=fmt)
    c.add_argument("--output", "-o", required=True, help="JSON file for fsdata balance --cost-model")
    c.add_argument("--lengths", default="4,16,48,96,160,256,384,512", help="comma-separated grid lengths")
    c.add_argument("--batch-sizes", default="8,32", help="comma-separated samples per batch")
    c.add_argument("--mixed", type=int, default=12, help="extra batches of random grid lengths (default 12)")
    c.add_argument("--from-shards", default=None,
                   help="also time the real per-rank batches of this fsdata OUTPUT (best: --strategy shuffle)")
    c.add_argument("--shard-steps", type=int, default=4, help="steps of --from-shards to time (default 4)")
    c.add_argument("--name", default=None, help="cost model name recorded in manifests")
    c.add_argument("--json", action="store_true", help="print the fit as JSON")
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
    from fstrain.dist import OptimConfig
    from fstrain.train import TrainConfig, train

    if a.max_steps is not None and a.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {a.max_steps}")
    if a.eval_every_steps < 0:
        parser.error(f"--eval-every-steps must be >= 0, got {a.eval_every_steps}")
    if a.eval_every_steps and not a.eval_data:
        parser.error("--eval-every-steps needs --eval-data EVAL.parquet")
    if a.resume and not a.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("fstrain").setLevel(logging.WARNING)
    cfg = TrainConfig(shards=a.shards, model=_model_kwargs(a), max_steps=a.max_steps, seed=a.seed,
                      log_every_steps=a.log_every_steps, checkpoint_dir=a.checkpoint_dir,
                      checkpoint_every_steps=a.checkpoint_every_steps, resume=a.resume, step_mode=a.step_mode,
                      metrics_dir=a.metrics_dir, backend=a.backend,
                      pipeline=None if a.pipeline == "none" else a.pipeline, eval_data=a.eval_data,
                      eval_every_steps=a.eval_every_steps, simulate_ranks=a.simulate_ranks,
                      eval_max_users=a.eval_max_users,
                      optim=OptimConfig(dense_lr=a.dense_lr, sparse_lr=a.sparse_lr,
                                        sparse_optimizer=a.sparse_optimizer))
    try:
        res = train(cfg)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if a.json and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(res.summary, sort_keys=True))
    return 0


def _cmd_evaluate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.evaluate import evaluate_checkpoint
    from fstrain.metrics import write_json

    if a.k < 1 or a.batch_size < 1:
        parser.error(f"--k and --batch-size must be >= 1, got {a.k} and {a.batch_size}")
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
        if a.out:
            write_json(res, a.out)
        if a.json:
            print(json.dumps(res, sort_keys=True))
        else:
            print(f"{a.checkpoint} (step {res['step']}): HR@{a.k} {res[f'hr@{a.k}']:.4f}  NDCG@{a.k} "
                  f"{res[f'ndcg@{a.k}']:.4f}  over {res['num_users']:,} users, {res['num_candidates']:,} candidate "
                  f"items (history {'masked' if a.mask_history else 'not masked'})")
    return 0


def _cmd_replay(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fsdata.bubble import reduction
    from fstrain.metrics import write_json
    from fstrain.replay import replay

    if a.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {a.max_steps}")
    kw = dict(max_steps=a.max_steps, warmup=a.warmup, repeats=a.repeats, model=_model_kwargs(a), seed=a.seed,
              device=a.device, num_threads=a.threads, clock=a.clock, statistic=a.statistic)
    res = replay(a.shards, **kw)
    if a.baseline:
        base = replay(a.baseline, **kw)
        res["baseline"] = {k: base[k] for k in ("shards", "strategy", "measured_bubble", "predicted_bubble",
                                                "mean_step_seconds")}
        res["measured_reduction"] = reduction(res["measured_bubble"], base["measured_bubble"])
        res["predicted_reduction"] = reduction(res["predicted_bubble"], base["predicted_bubble"])
    if a.out:
        write_json(res, a.out)
    brief = {k: v for k, v in res.items() if k not in ("compute_seconds", "step_measured_bubble")}
    if a.json:
        print(json.dumps(brief, sort_keys=True))
    else:
        print(f"{res['shards']}: {res['num_ranks']} ranks, {res['num_steps']} steps, strategy {res['strategy']}: "
              f"measured bubble {res['measured_bubble']:.2%}, predicted {res['predicted_bubble']:.2%}, "
              f"slowest rank {res['mean_step_seconds'] * 1e3:.1f} ms/step")
        if a.baseline:
            print(f"baseline {a.baseline}: measured {res['baseline']['measured_bubble']:.2%}; "
                  f"measured reduction {res['measured_reduction']:.1%} "
                  f"(predicted {res['predicted_reduction']:.1%})")
    return 0


def _cmd_calibrate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fstrain.calibrate import calibrate, shard_batches
    from fstrain.metrics import write_json

    lengths = _ints(a.lengths, "--lengths", parser)
    sizes = _ints(a.batch_sizes, "--batch-sizes", parser)
    kw = _model_kwargs(a)
    num_items = kw.pop("num_items", 4000)
    if a.shard_steps < 1:
        parser.error(f"--shard-steps must be >= 1, got {a.shard_steps}")
    extra = shard_batches(a.from_shards, a.shard_steps) if a.from_shards else None
    res = calibrate(model=kw, num_items=num_items, lengths=lengths, batch_sizes=sizes, num_mixed=a.mixed,
                    extra_batches=extra,
                    warmup=a.warmup, repeats=a.repeats, seed=a.seed, device=a.device, num_threads=a.threads,
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
    """Entry point of the ``fstrain`` console script."""
    parser = build_parser()
    a = parser.parse_args(argv)
    # Libraries (fbgemm, torchrec) log INFO on the root logger: keep it at WARNING, fstrain at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("fstrain").setLevel(logging.INFO)
    cmd = {"train": _cmd_train, "replay": _cmd_replay, "calibrate": _cmd_calibrate,
           "evaluate": _cmd_evaluate}[a.command]
    try:
        return cmd(a, parser)
    except (FstrainError, FsdataError) as e:
        print(f"fstrain {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
