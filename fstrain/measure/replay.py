"""Single-device replay: the bubble that R ranks would see on these shards, measured on one device.

For each step ``s``, every rank's batch runs forward + backward (embedding lookup, dense tower,
loss; no collective, no optimizer step) ``repeats`` times, the repeats interleaved over the ranks,
after a warm-up; the median is ``C[s, r]``. The measured bubble is ``fsdata.balancer.bubble.run_bubble(C)``; the
predicted bubble is the same formula on ``step_stats.parquet``'s ``predicted_cost`` of the replayed steps.
This isolates the load-imbalance part of the bubble: a real run adds communication on top.

Null control (the noise floor): in the same loop, rank 0's batch of each step is also timed once
per rank, interleaved with the real batches, so ``R`` identical pieces of work are timed exactly
as the ``R`` real ones. Their run bubble (``null_bubble``) is what timing noise alone reads as a
bubble on this machine; ``measured_bubble_minus_null`` subtracts it. The figure that decides
training time is the slowest rank per step: ``slowest_rank_seconds_per_step`` (mean over steps
of ``max_r C[s, r]``).
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.autograd.profiler import record_function

from fsdata.balancer.bubble import run_bubble, step_bubbles
from fsdata.errors import FsdataError
from fstrain.data.batch import Batch
from fstrain.data.manifest import load_manifest, resolve_num_items
from fstrain.data.reader import ShardReader
from fstrain.errors import ConfigError, ShardError
from fstrain.models.config import Config
from fstrain.models.negatives import attach_negatives
from fstrain.models.recommender import SequentialRecommender

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = ("auto", "thread", "wall")


@dataclass(kw_only=True, slots=True)
class TimingConfig:
    """How ``fstrain replay`` and ``fstrain calibrate`` time a batch on one device."""

    warmup: int = 3
    """Untimed runs first."""
    repeats: int = 3
    """Timed runs per batch."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:i]``."""
    num_threads: int = 1
    """Torch CPU threads (1: steady timings)."""
    clock: Literal["auto", "thread", "wall"] = "auto"
    """``auto``: thread CPU time on CPU with 1 thread, else wall."""

    def __post_init__(self) -> None:
        for flag, v, low in (("--repeats", self.repeats, 1), ("--warmup", self.warmup, 0),
                             ("--num-threads", self.num_threads, 0)):
            if v < low:
                raise ConfigError(f"{flag} must be >= {low}, got {v}")


@dataclass(kw_only=True, slots=True)
class ReplayConfig:
    """``fstrain replay``: the bubble R ranks would see, measured on one device (:func:`replay`)."""

    baseline: str | None = None
    """Another OUTPUT (e.g. ``--strategy shuffle``): report the reduction."""
    max_steps: int = 4
    """Replay the first K steps."""
    statistic: Literal["median", "min"] = "median"
    """Of the repeats."""
    null_control: bool = True
    """Also time rank 0's batch as every rank, the null control (``--no-null-control`` skips it and
    halves the timed work)."""
    timing: TimingConfig = field(default_factory=TimingConfig)
    """How each batch is timed."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.statistic not in ("median", "min"):
            raise ConfigError(f"unknown statistic {self.statistic!r}; use median or min")


def resolve_clock(clock: str, device: torch.device) -> Callable[[], float]:
    """The timer to use.

    ``thread`` is the calling thread's CPU time (``time.thread_time``): on a CPU device with one
    torch thread all compute runs on the calling thread, and time the OS gives to *other*
    processes is not counted, so timings stay steady on a shared, loaded machine. ``wall`` is
    ``time.perf_counter`` (needed on CUDA, where the host thread waits). ``auto``: ``thread`` on
    CPU with one torch thread, else ``wall``.

    Raises:
        ConfigError: unknown clock, or ``thread`` on CUDA / with several torch threads.
    """
    if clock not in CLOCKS:
        raise ConfigError(f"unknown clock {clock!r}; use one of {', '.join(CLOCKS)}")
    single = device.type == "cpu" and torch.get_num_threads() == 1
    if clock == "thread" and not single:
        raise ConfigError(f"--clock thread needs a CPU device and 1 torch thread (device {device}, "
                          f"{torch.get_num_threads()} threads); use --clock wall")
    return time.thread_time if (clock == "thread" or (clock == "auto" and single)) else time.perf_counter


def time_forward_backward(model: SequentialRecommender, batch: Batch, *, repeats: int,
                          device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of forward + backward of one batch.

    Args:
        model: an unsharded model on ``device``.
        batch: a batch with negatives (:func:`fstrain.models.negatives.with_negatives`) on ``device``.
        repeats: timed runs (>= 1).
        device: for synchronisation.
        clock: from :func:`resolve_clock`.

    Returns:
        Median seconds over ``repeats`` runs.
    """
    times = []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a timed run would be charged to whichever rank triggered it
    try:
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            _sync(device)
            t0 = clock()
            with record_function("## replay_forward_backward ##"):
                loss, _ = model(batch)
                loss.backward()
            _sync(device)
            times.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(times)


def make_replay_model(num_items: int, model: dict | None, seed: int, device: torch.device
                      ) -> SequentialRecommender:
    """An unsharded model for timing (``model``: :class:`Config` keyword arguments)."""
    torch.manual_seed(seed)
    cfg = Config(**{"num_items": num_items, **(model or {})})
    return SequentialRecommender(cfg).to(device)


def predicted_costs(shards: str, num_steps: int) -> np.ndarray:
    """``[S x R]`` predicted per-rank costs of the first ``num_steps`` steps (the step stats).

    Raises:
        ShardError: the step stats are missing, unreadable or malformed.
    """
    m = load_manifest(shards)
    try:
        t = m.read_step_stats(columns=["step", "rank", "predicted_cost"], filters=[("step", "<", num_steps)])
    except FsdataError as e:  # fsdata's ManifestError: missing, unreadable or malformed step stats
        raise ShardError(str(e)) from None
    c = np.zeros((num_steps, m.num_ranks))
    c[t.column("step").to_numpy(), t.column("rank").to_numpy()] = t.column("predicted_cost").to_numpy()
    return c


def replay(shards: str, config: ReplayConfig | None = None, *, model: dict | None = None, seed: int = 0,
           progress: Callable[[int, int], None] | None = None) -> dict:
    """Measure the bubble of ``shards`` by timing every rank's batch of every step on one device.

    Args:
        shards: an ``fsdata balance`` OUTPUT.
        config: :class:`ReplayConfig` (default: its defaults): the first ``max_steps`` steps; per
            (step, rank) ``timing.repeats`` timed runs after ``timing.warmup`` untimed ones (of the
            first batches), of which ``statistic`` is kept (``min`` rejects the time other processes
            steal on a loaded machine; noise only ever adds time); ``timing.num_threads`` torch CPU
            threads (1 keeps timings steady on shared machines; 0: as is); ``timing.clock`` as
            :func:`resolve_clock`; ``null_control``: also time rank 0's batch as every rank (doubles
            the timed work). ``baseline`` is the CLI's (a second call).
        model: :class:`fstrain.models.config.Config` keyword arguments (``num_items`` inferred if absent).
        seed: parameter init and negatives.
        progress: called with ``(steps done, steps total)``.

    Returns:
        JSON-ready dict: ``measured_bubble``, ``predicted_bubble`` (same steps, from step_stats),
        ``manifest_predicted_bubble``, ``num_ranks``, ``num_steps``, ``strategy``,
        ``cost_model``, ``step_measured_bubble`` ``[S]``, ``compute_seconds`` ``[S x R]``,
        ``slowest_rank_seconds_per_step`` (mean over steps of the slowest rank; also as
        ``mean_step_seconds``, its earlier name), ``mean_rank_seconds_per_step``; with
        ``null_control``: ``null_bubble`` (run bubble of the null control), ``null_step_bubble``
        ``[S]``, ``measured_bubble_minus_null``, ``null_compute_seconds`` ``[S x R]``,
        ``null_slowest_rank_seconds_per_step``.

    Raises:
        ShardError: bad shards or step statistics.
    """
    config = config or ReplayConfig()
    timing = config.timing
    warmup, repeats, statistic, null_control = timing.warmup, timing.repeats, config.statistic, config.null_control
    if timing.num_threads:
        torch.set_num_threads(timing.num_threads)
    m = load_manifest(shards)
    S = min(config.max_steps, m.num_steps)
    dev = torch.device(timing.device)
    from fstrain.models.config import objective_for  # noqa: PLC0415

    mdl = make_replay_model(resolve_num_items(m)[0], {"objective": objective_for(m), **(model or {})}, seed, dev)
    readers = [ShardReader(shards, r, None, max_steps=S, num_prefetch_batches=0) for r in range(m.num_ranks)]
    iters = [iter(rd) for rd in readers]
    C = np.zeros((S, m.num_ranks))
    N = np.zeros((S, m.num_ranks))
    tick = resolve_clock(timing.clock, dev)
    for s in range(S):
        batches = [attach_negatives(next(it), mdl.config, seed).to(dev)
                   for it in iters]
        if s == 0:
            for i in range(warmup):
                time_forward_backward(mdl, batches[i % len(batches)], repeats=1, device=dev, clock=tick)
        # repeats interleaved over ranks, so a slow period of the machine hits every rank of the step;
        # the null control (rank 0's batch as every rank) is interleaved the same way
        timed = batches + [batches[0]] * (len(batches) if null_control else 0)
        runs = np.array([[time_forward_backward(mdl, b, repeats=1, device=dev, clock=tick) for b in timed]
                         for _ in range(repeats)])
        stat = np.median(runs, axis=0) if statistic == "median" else runs.min(axis=0)
        C[s] = stat[:m.num_ranks]
        if null_control:
            N[s] = stat[m.num_ranks:]
        if progress:
            progress(s + 1, S)
    predicted = predicted_costs(shards, S)
    out = {"measured_bubble": run_bubble(C), "predicted_bubble": run_bubble(predicted),
            "manifest_predicted_bubble": m.predicted_bubble, "num_ranks": m.num_ranks, "num_steps": S,
            "strategy": m.strategy, "batch_size_per_rank": m.batch_size_per_rank,
            "cost_model": m.cost_model, "shards": os.path.abspath(shards), "warmup": warmup, "repeats": repeats,
            "statistic": statistic,
            "clock": "thread" if tick is time.thread_time else "wall",
            "mean_step_seconds": float(C.max(axis=1).mean()), "step_measured_bubble": step_bubbles(C).tolist(),
            "slowest_rank_seconds_per_step": float(C.max(axis=1).mean()),
            "mean_rank_seconds_per_step": float(C.mean()), "compute_seconds": C.tolist()}
    if null_control:
        out.update(null_bubble=run_bubble(N), null_step_bubble=step_bubbles(N).tolist(),
                   measured_bubble_minus_null=run_bubble(C) - run_bubble(N),
                   null_slowest_rank_seconds_per_step=float(N.max(axis=1).mean()), null_compute_seconds=N.tolist())
    return out

