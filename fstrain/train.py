"""The training loop on fsdata shards: one process per rank, gloo on CPU, NCCL on GPU.

Every step comes from a pipeline (:func:`fstrain.pipelines.pipeline_for_run`), ``--pipeline none``
included: the loop's own step (:class:`fstrain.pipelines.loop.LoopPipeline`: the timed
``measured_step`` or the reference ``plain_step``), so the loop has one shape.

Resumption: the reader starts at the checkpoint's step; negatives depend only on
``(seed, step)``; so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel

from fstrain.data.manifest import (check_counts, check_eval_ids, infer_num_codes, infer_num_items, load_manifest,
                                   max_history_length, plan_digest, resharded_from, resolve_action_column,
                                   resolve_num_items)
from fstrain.data.merge import merge_factor, open_rank_reader
from fstrain.distributed.env import DistEnv, init_distributed, planned_device
from fstrain.errors import ConfigError, FstrainError, ShardError
from fstrain.components.checkpoint import (Checkpointer, checkpoint_num_items, init_from_checkpoint,
                                           latest_checkpoint, resolve_checkpoint, resume_checkpoint)
from fstrain.components.heap import HeapTrimmer
from fstrain.components.outputs import check_checkpoint_dir, check_metrics_dir
from fstrain.components.metrics import NULL_TIMES, StepTiming, describe_bubble, summarize, write_json, write_step_times
from fstrain.models.config import MODELS
from fstrain.models.negatives import attach_negatives
from fstrain.config import TrainConfig
from fstrain.distributed.watchdog import PeerGuard
from fstrain.pipelines import model_builder, pipeline_for_run, resolve_pipeline_name
from fstrain.components.schedule import StepSchedule
from fstrain.components.steplog import StepLog

logger = logging.getLogger(__name__)


def _check_all_ranks(ok: bool, message: str, env: DistEnv) -> None:
    """Agree on a rank-local validation result so a bad shard fails every rank instead of hanging:
    every rank raises the first failing rank's message (so rank 0 can print it, once)."""
    if dist.get_world_size() > 1:
        messages: list = [None] * dist.get_world_size()
        dist.all_gather_object(messages, "" if ok else message)
        message = next((m for m in messages if m), "")
    if message or not ok:
        raise ShardError(message or "a rank failed to open its shard")


def _num_items(cfg: TrainConfig, manifest) -> tuple[int, str]:
    """The model's ``num_items`` and its source: ``--num-items``, else
    :func:`fstrain.data.manifest.resolve_num_items` (manifest, evaluation file metadata, inferred
    over shards and evaluation file); the shards' and the evaluation file's ids are checked against it.

    Raises:
        ConfigError: an item id of the shards or of the evaluation file is ``>= num_items``, or the
            shards' longest history (``seq_len`` statistics) exceeds ``--max-seq-len``.
    """
    if cfg.model.num_items is not None:
        num_items, source = cfg.model.num_items, "--num-items"
    else:
        num_items, source = resolve_num_items(manifest, cfg.eval.data)
    if source != "inferred":
        try:
            seen = infer_num_items(manifest)
        except ShardError:
            seen = None  # no footer statistics: nothing to check cheaply
        if seen is not None and seen > num_items:
            raise ConfigError(f"{cfg.shards} has item id {seen - 1} but the model has num_items {num_items} "
                              f"({source}); pass --num-items {seen} or more")
    if cfg.eval.data:
        check_eval_ids(cfg.eval.data, num_items, source)
    longest = max_history_length(manifest)
    if longest is not None and longest > cfg.model.max_seq_len:  # else every rank fails in its first step
        raise ConfigError(f"{cfg.shards} has a history of {longest} items but max_seq_len is {cfg.model.max_seq_len}; "
                          f"pass --max-seq-len {longest} or cap lengths in fsdata convert (--max-seq-len)")
    return num_items, source


def _init_source(cfg: TrainConfig) -> str | None:
    """The checkpoint ``--init-from`` starts from, or ``None`` (not given, or ``--resume`` finds one)."""
    if not cfg.checkpoint.init_from:
        return None
    if cfg.checkpoint.resume and cfg.checkpoint.dir and latest_checkpoint(cfg.checkpoint.dir):
        return None  # a restarted run resumes its own checkpoints
    return resolve_checkpoint(cfg.checkpoint.init_from)


@dataclass(slots=True)
class TrainResult:
    """What :func:`train` returns: the run summary, the sharded model and its optimizer."""

    summary: dict
    model: DistributedModelParallel
    optimizer: object


def train(cfg: TrainConfig, env: DistEnv | None = None) -> TrainResult:
    """Train on ``cfg.shards``; rank 0 logs and writes the metrics.

    With more than one rank, a :class:`fstrain.distributed.watchdog.CollectiveWatchdog` guards the run: a
    peer that stops making progress for ``cfg.collective_timeout_seconds`` makes this rank print
    one line naming it (and the collective and step) and exit with status 3; a collective that
    fails because a peer died raises :class:`fstrain.distributed.watchdog.PeerFailureError` with that line.

    Returns:
        :class:`TrainResult`; ``summary`` has the measured bubble (see :func:`fstrain.components.metrics.summarize`).

    Raises:
        ShardMismatchError: shards written for another world size (before any collective).
        ShardError / ConfigError: bad shards or settings.
        PeerFailureError: a peer rank exited or stopped responding during a collective.
    """
    from fstrain.distributed.comm.base import CommError
    from fstrain.distributed.watchdog import PeerFailureError

    guard = PeerGuard(cfg.collective_timeout_seconds)
    try:
        return _train(cfg, env, guard)
    except FstrainError as e:
        e.rank_local = guard.stepping  # before the first step every rank raises the same error
        raise
    except (RuntimeError, CommError, dist.DistError) as e:
        line = guard.watchdog.peer_failure(e) if guard.watchdog is not None else None
        if line is None:
            raise
        raise PeerFailureError(line) from e
    finally:
        guard.stop()


def _train(cfg: TrainConfig, env: DistEnv | None, guard: PeerGuard) -> TrainResult:
    """:func:`train`'s body; ``guard`` receives the watchdog and the progress marks."""
    cfg.check()
    cfg = replace(cfg, comm=cfg.comm.resolved())  # --backend auto decided once, here; later code takes the name
    manifest = load_manifest(cfg.shards)  # cheap checks first: before init, no collective can hang
    check_counts(manifest)  # untrusted counts against the files, before anything is sized by them
    if cfg.checkpoint.dir:
        check_checkpoint_dir(cfg.checkpoint.dir)  # outputs replace only what fstrain wrote
    for flag, folder in (("--metrics-dir", cfg.metrics.dir), ("--tensorboard-dir", cfg.metrics.tensorboard_dir)):
        if folder:
            check_metrics_dir(folder, flag)
    world = int(os.environ.get("WORLD_SIZE", "1")) if env is None else env.world_size
    if cfg.simulate_ranks and world != 1:
        raise ConfigError(f"--simulate-ranks runs in one process (it reads every rank file); this job has world "
                          f"size {world}")
    if not cfg.simulate_ranks:
        merge_factor(manifest, world)  # R or a divisor of R (fstrain.data.merge); else the reshard command
    # the pipeline decides the model layout (pec: PEC-wrapped table); decided once, before init
    pipe_name = resolve_pipeline_name(cfg.pipeline.name, env.device if env else planned_device(cfg.comm.backend),
                                      pec_fallback=cfg.pipeline.pec_fallback)
    if pipe_name == "pec" and cfg.checkpoint.dir and cfg.checkpoint.every_steps:
        raise ConfigError("--pipeline pec defers each step's NOL gradient to the next step, so a mid-run "
                          "checkpoint would miss it; use --checkpoint-every-steps 0 (checkpoint at the end) "
                          "or --pipeline prioritized")
    num_items, source = _num_items(cfg, manifest)  # and the evaluation file checked against it: before init
    init_from = _init_source(cfg)
    if init_from and source == "inferred":  # items of the checkpoint absent from today's shards keep their rows
        num_items = max(num_items, checkpoint_num_items(init_from) or 0)
    action = resolve_action_column(manifest, MODELS.get(cfg.model.model).actions_by_default, cfg.model.action_column)
    num_actions = (cfg.model.num_actions or infer_num_codes(manifest, action)) if action else None
    if action and cfg.eval.data:
        from fstrain.components.evaluator import load_eval_data

        load_eval_data(cfg.eval.data, action_column=action)  # the evaluation file carries the action column too
    env = env or init_distributed(timeout_seconds=cfg.collective_timeout_seconds, comm=cfg.comm)
    guard.start(env)
    if env.rank == 0:
        logger.info("num_items %d (%s)", num_items, source)
    torch.manual_seed(cfg.seed)
    mcfg = replace(cfg.model.for_data(manifest, num_items=num_items), action_column=action, num_actions=num_actions)
    if env.rank == 0 and action:
        logger.info("action input: feature column %r, %d codes", action, num_actions)
    dmp, opt = model_builder(pipe_name)(mcfg, cfg.optim, env)
    dmp.module.dense.seed = cfg.seed  # dropout masks keyed by (seed, step, sample, position)
    start, offset = 0, 0  # first step of the shards to train; global step = shards step + offset
    digest = plan_digest(manifest)
    ckpt_extra = {"shards": os.path.abspath(cfg.shards), "model": asdict(mcfg), "plan_digest": digest}
    if cfg.checkpoint.resume and cfg.checkpoint.dir:
        found = resume_checkpoint(dmp, opt, cfg.checkpoint.dir, env.world_size, shards=cfg.shards,
                                  plan_digest=digest, resharded_from=resharded_from(manifest))
        if found:
            start, offset = found[2], found[1] - found[2]
            if env.rank == 0:
                logger.info("resumed from %s: global step %d, step %d of these shards%s", found[0], found[1], start,
                            f" (resharded at global step {offset}; log lines name both)" if offset else "")
    if init_from:
        loaded = init_from_checkpoint(dmp, init_from, mcfg.num_items)
        ckpt_extra["init_from"] = os.path.abspath(loaded)
        if env.rank == 0:
            logger.info("starting from the weights of %s (num_items %d)", loaded, mcfg.num_items)
    max_steps = None if cfg.max_steps is None else max(0, cfg.max_steps - start - offset)
    try:
        if cfg.simulate_ranks:
            from fstrain.data.simulate import GlobalBatchReader

            reader, err = GlobalBatchReader(cfg.shards, start_step=start, max_steps=max_steps, action_column=action), ""
        else:
            reader, err = open_rank_reader(cfg.shards, env.rank, env.world_size, start_step=start,
                                           max_steps=max_steps, action_column=action), ""
    except FstrainError as e:
        reader, err = None, str(e)
    _check_all_ranks(reader is not None, err, env)
    guard.step(start)
    evaluator = None
    if cfg.eval.data:
        from fstrain.components.evaluator import Evaluator

        schedule = StepSchedule.evaluation(manifest.epoch_first_steps(), every_steps=cfg.eval.every_steps,
                                           every_epochs=cfg.eval.every_epochs, step_offset=offset)
        evaluator = Evaluator(cfg.eval.data, schedule=schedule, num_items=mcfg.num_items,
                              rank=env.rank, world_size=env.world_size, device=env.device,
                              max_users=cfg.eval.max_users, action_column=action)
    ckpts = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.every_steps, step_offset=offset, rank=env.rank,
                         world_size=env.world_size, extra=ckpt_extra)  # names: the global step
    timings: list[StepTiming] = []
    steplog = StepLog(env.rank, env.world_size, cfg.metrics.tensorboard_dir, step_offset=offset)  # TensorBoard: global
    logs = StepSchedule(every_steps=cfg.metrics.log_every_steps, step_offset=offset)
    window_loss = torch.zeros((), dtype=torch.float64, device=env.device)  # no per-step device sync
    window_n, window_samples, window_tokens, t_window = 0, 0, 0, time.perf_counter()
    total_samples, total_tokens, t_start = 0, 0, time.perf_counter()
    paused = 0.0  # seconds of evaluation, checkpoint saves and control steps: outside every throughput figure
    step = start
    pipe = pipeline_for_run(replace(cfg.pipeline, name=pipe_name), dmp, opt, env.device)  # none: the loop's step
    if mcfg.objective == "all-positions" and env.world_size > 1 and not reader.has_token_counts:
        raise ShardError(f"{cfg.shards} does not record per-step token counts (_step_stats.parquet num_tokens, "
                         "fsdata >= 0.3), which the all-positions loss of a multi-rank job needs as its normaliser; "
                         "re-run fsdata balance, or train with --objective last-position")
    host = (attach_negatives(b, mcfg, cfg.seed) for b in reader)
    # CUDA: read each step's timing events one step late (no host wait on the GPU per step),
    # unless checkpoints are taken between steps (the state must match the item's step)
    lag = env.device.type == "cuda" and not ckpts.periodic
    from tqdm import tqdm

    total_steps = manifest.num_steps - start if max_steps is None else min(max_steps, manifest.num_steps - start)
    heap = HeapTrimmer()  # resident memory flat over long runs (fstrain/components/heap.py)
    bar = tqdm(total=max(0, total_steps), unit="step", desc="train", disable=not (cfg.progress and env.rank == 0),
               file=sys.stderr)
    guard.stepping = True
    nullctl = None
    if cfg.metrics.null_control_steps and env.world_size > 1 and pipe.records_timings:
        from fstrain.components.nullcontrol import NullControl

        nullctl = NullControl(cfg.shards, start_step=start, total_steps=max(0, total_steps),
                              num_controls=cfg.metrics.null_control_steps, dense=dmp.module.dense, model_config=mcfg,
                              seed=cfg.seed, rank=env.rank, device=env.device)
    for index, (batch_step, loss_sum, n, _tokens, timing) in enumerate(pipe.steps(host, env.rank, lag=lag)):
        num_samples = timing.num_samples  # histories
        recorded = timing if pipe.records_timings else None  # --step-mode plain: the reference step, untimed
        if recorded is not None:
            timings.append(recorded)
        # n: the loss's supervised positions: the tokens of tokens/s (histories for last-position)
        step = batch_step + 1
        steplog.add(batch_step, loss_sum, n, recorded)
        bar.update(1)
        guard.step(step)
        heap.step(step)
        window_loss += loss_sum.to(torch.float64)
        window_n += n
        window_samples += num_samples
        window_tokens += n
        total_samples += num_samples
        total_tokens += n
        t_pause = time.perf_counter()
        if nullctl is not None:
            nullctl.after(index, batch_step)
        if logs.due(step):
            stats = torch.stack([window_loss] + [torch.tensor(float(v), dtype=torch.float64, device=env.device)
                                                 for v in (window_n, window_samples, window_tokens)])
            dist.all_reduce(stats)
            dt = max(1e-9, t_pause - t_window)
            if env.rank == 0:
                logger.info("%s loss %.4f samples/s %.1f tokens/s %.0f", logs.label(step),
                            stats[0].item() / max(1.0, stats[1].item()), stats[2].item() / dt, stats[3].item() / dt)
            steplog.window(step, samples_per_second=stats[2].item() / dt, tokens_per_second=stats[3].item() / dt)
            window_loss = torch.zeros((), dtype=torch.float64, device=env.device)
            window_n, window_samples, window_tokens = 0, 0, 0
            t_window = t_pause  # the window ended at this step's end; pauses after it are moved below
        if ckpts.after_step(dmp, opt, step, flush=pipe.flush):  # flush: prioritized's deferred sparse update
            guard.step(step)  # a long save is progress, not a hang
        if evaluator and (metrics := evaluator.after_step(dmp.module, step, flush=pipe.flush)):
            steplog.log_eval(step, metrics)
            guard.step(step)  # an evaluation is progress, not a hang
        dt_pause = time.perf_counter() - t_pause  # control steps, logging, checkpoint, evaluation
        paused += dt_pause
        t_window += dt_pause
    bar.close()
    pipe.close()  # flushes
    train_seconds = time.perf_counter() - t_start - paused
    if evaluator and step > start:
        metrics = evaluator.finish(dmp.module, step)
        if metrics:
            steplog.log_eval(step, metrics)
    ckpts.finish(dmp, opt, step, start)
    if evaluator:
        steplog.log_best(evaluator.best())
    steplog.finish()  # losses of the last window into the timings; closes TensorBoard
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, (timings, nullctl.records if nullctl else []))
    all_timings = [t for part in gathered for t in part[0]]
    null_timings = [t for part in gathered for t in part[1]]
    summary = summarize(all_timings, manifest.predicted_bubble, null_timings)
    if nullctl is not None and nullctl.after_steps:
        summary.update(null_control_after_steps=nullctl.after_steps, null_control_batch_step=nullctl.control_step)
    summary.update({"first_step": start, "end_step": step, "global_end_step": step + offset,
                    "world_size": env.world_size,
                    "strategy": manifest.strategy})
    summary["simulate_ranks"] = cfg.simulate_ranks
    totals = torch.tensor([float(total_samples), float(total_tokens)], dtype=torch.float64, device=env.device)
    dist.all_reduce(totals)
    summary.update({"num_samples_trained": int(totals[0]), "num_tokens_trained": int(totals[1]),
                    "train_seconds": train_seconds, "tokens_per_second": float(totals[1]) / max(train_seconds, 1e-9),
                    "samples_per_second": float(totals[0]) / max(train_seconds, 1e-9)})
    summary["objective"] = mcfg.objective
    summary["model"] = mcfg.model
    if evaluator:
        summary["eval"] = evaluator.records
        summary["eval_final"] = evaluator.records[-1] if evaluator.records else None
        summary["eval_best"] = evaluator.best()
    if env.rank == 0:
        if cfg.metrics.dir and all_timings:
            write_step_times(all_timings, os.path.join(cfg.metrics.dir, "step_times.parquet"))
        if cfg.metrics.dir and null_timings:
            write_step_times(null_timings, os.path.join(cfg.metrics.dir, NULL_TIMES))
        if cfg.metrics.dir and evaluator and evaluator.records:
            evaluator.write(os.path.join(cfg.metrics.dir, "eval.parquet"))
        if cfg.metrics.dir:
            write_json(summary, os.path.join(cfg.metrics.dir, "summary.json"))
        logger.info("done: steps %d..%d%s; %s", start, step - 1,
                    f" of these shards (global steps {start + offset}..{step - 1 + offset})" if offset else "",
                    describe_bubble(summary))
    return TrainResult(summary, dmp, opt)
