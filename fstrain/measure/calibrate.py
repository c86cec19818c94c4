"""Calibrate the per-sample cost model ``c0 + c1*L + c2*L^2`` on the current device.

Times forward + backward of the model (:func:`fstrain.measure.replay.time_forward_backward`) over a grid
of batches: homogeneous ones (``n`` samples of length ``L``) and mixed ones (lengths drawn from the
grid), and fits the batch time

    ``t = b0 + c0 * n + c1 * sum(L) + c2 * sum(L^2)``

by non-negative least squares on relative errors (each row divided by its measured time).
``b0`` is the per-batch overhead: every rank pays it once per step, so it cannot create a
bubble and is not part of the per-sample model. The output JSON
``{"kind": "polynomial", "name": ..., "coefficients": [c0, c1, c2], ...}`` (seconds) is what
``fsdata balance --cost-model PATH.json`` reads (:func:`fsdata.balancer.cost.load_cost_model`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fstrain.data.batch import make_batch
from fstrain.errors import ConfigError
from fstrain.models.negatives import attach_negatives
from fstrain.measure.replay import TimingConfig, make_replay_model, resolve_clock, time_forward_backward

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (4, 16, 48, 96, 160, 256, 384, 512)
DEFAULT_BATCH_SIZES = (8, 32)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    """``"4,16"`` -> ``(4, 16)``.

    Raises:
        ConfigError: not comma-separated positive integers.
    """
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"{flag} needs positive integers, got {text!r}")
    return vals


@dataclass(kw_only=True, slots=True)
class CalibrateConfig:
    """``fstrain calibrate``: the grid timed to fit the per-sample cost model (:func:`calibrate`)."""

    lengths: str = ",".join(map(str, DEFAULT_LENGTHS))
    """Comma-separated grid lengths."""
    batch_sizes: str = ",".join(map(str, DEFAULT_BATCH_SIZES))
    """Comma-separated samples per batch."""
    mixed: int = 12
    """Extra batches of random grid lengths."""
    from_shards: str | None = None
    """Also time the real per-rank batches of this fsdata OUTPUT (best: ``--strategy shuffle``)."""
    shard_steps: int = 4
    """Steps of ``--from-shards`` to time."""
    name: str | None = None
    """Cost model name recorded in manifests."""
    timing: TimingConfig = field(default_factory=lambda: TimingConfig(repeats=5))
    """How each batch is timed."""

    def __post_init__(self) -> None:
        _ = self.length_grid, self.batch_size_grid  # both parse
        if self.mixed < 0:
            raise ConfigError(f"--mixed must be >= 0, got {self.mixed}")
        if self.shard_steps < 1:
            raise ConfigError(f"--shard-steps must be >= 1, got {self.shard_steps}")

    @property
    def length_grid(self) -> tuple[int, ...]:
        """``lengths`` as integers."""
        return _ints(self.lengths, "--lengths")

    @property
    def batch_size_grid(self) -> tuple[int, ...]:
        """``batch_sizes`` as integers."""
        return _ints(self.batch_sizes, "--batch-sizes")


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns (best feasible subset).

    Args:
        a: ``[M x K]`` float64, K small (every one of the ``2^K`` column subsets is solved).
        b: ``[M]`` float64.

    Returns:
        ``[K]`` float64, ``x >= 0`` minimising ``||a x - b||``.
    """
    m, k = a.shape
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s = a / scale
    best, best_res = np.zeros(k), float(np.sum(b * b))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            x, *_ = np.linalg.lstsq(a_s[:, cols], b, rcond=None)
            if (x < 0).any():
                continue
            res = float(np.sum((a_s[:, cols] @ x - b) ** 2))
            if res < best_res:
                best = np.zeros(k)
                best[list(cols)] = x
                best_res = res
    return best / scale


@dataclass(frozen=True, slots=True)
class Fit:
    """A fitted batch-time model (seconds).

    Attributes:
        batch_overhead_seconds: b0.
        coefficients: ``(c0, c1, c2)``: per sample, per item, per squared item.
        relative_rms_error: RMS of ``(predicted - measured) / measured`` over the grid.
        max_relative_error: the largest ``|predicted - measured| / measured``.
    """

    batch_overhead_seconds: float
    coefficients: tuple[float, float, float]
    relative_rms_error: float
    max_relative_error: float


def fit_batch_times(batches: list[np.ndarray], seconds: np.ndarray) -> Fit:
    """Fit ``t = b0 + c0 n + c1 sum L + c2 sum L^2`` (non-negative, relative least squares).

    Args:
        batches: per measurement the lengths of its samples (``[n]`` int).
        seconds: ``[M]`` measured batch times.

    Returns:
        The :class:`Fit`.
    """
    t = np.asarray(seconds, dtype=np.float64)
    a = np.array([[1.0, len(L), float(np.sum(L)), float(np.sum(np.asarray(L, dtype=np.float64) ** 2))]
                  for L in batches])
    x = nnls(a / t[:, None], np.ones(len(t)))
    rel = a @ x / t - 1.0
    return Fit(float(x[0]), (float(x[1]), float(x[2]), float(x[3])), float(np.sqrt(np.mean(rel ** 2))),
               float(np.abs(rel).max()))


def calibration_grid(lengths=DEFAULT_LENGTHS, batch_sizes=DEFAULT_BATCH_SIZES, num_mixed: int = 12,
                     seed: int = 0) -> list[np.ndarray]:
    """Batch compositions to time: homogeneous ``(n, L)`` for every pair, plus mixed batches.

    Returns:
        list of ``[n]`` int64 length arrays.
    """
    rng = np.random.default_rng(seed)
    grid = [np.full(n, L, dtype=np.int64) for n in batch_sizes for L in lengths]
    for _ in range(num_mixed):
        n = int(rng.choice(batch_sizes))
        grid.append(rng.choice(np.asarray(lengths, dtype=np.int64), n))
    return grid


def shard_batches(shards: str, max_steps: int) -> list[np.ndarray]:
    """Length compositions of real per-rank batches: every rank's batch of the first ``max_steps`` steps.

    Calibrating on these (best from ``--strategy shuffle`` shards, whose batches are diverse) fits
    the model on the length mix the balancer will actually see.

    Returns:
        list of ``[B]`` int64 length arrays.
    """
    from fstrain.data.manifest import load_manifest
    from fstrain.data.reader import ShardReader

    m = load_manifest(shards)
    out = []
    for r in range(m.num_ranks):
        for b in ShardReader(shards, r, None, max_steps=max_steps, num_prefetch_batches=0):
            out.append(b.lengths.numpy().astype(np.int64))
    return out


def calibrate(config: CalibrateConfig | None = None, *, model: dict | None = None, num_items: int = 4000,
              extra_batches: list[np.ndarray] | None = None, seed: int = 0,
              progress: Callable[[int, int], None] | None = None) -> dict:
    """Time the grid on ``device`` and fit the cost model.

    Args:
        config: :class:`CalibrateConfig` (default: its defaults): the grid (``lengths``, each <=
            ``max_seq_len``, x ``batch_sizes``, plus ``mixed`` batches of random grid lengths that
            check additivity), the batches of ``from_shards`` (:func:`shard_batches`), ``name``
            (recorded as the cost model's name) and the timing (``timing.repeats`` timed runs per
            batch, median; ``timing.num_threads``: match what replay / training uses).
        model: :class:`fstrain.models.config.Config` keyword arguments (the model you will train).
        num_items: item table rows (timing barely depends on it).
        extra_batches: more batch compositions to time (e.g. :func:`shard_batches` of real shards).
        seed: lengths of the mixed batches, ids, init.
        progress: called as ``progress(done, total)`` after each timed batch (``total`` = repeats x
            grid batches), e.g. to move a progress bar; ``None``: nothing.

    Returns:
        JSON-ready dict: ``kind``, ``name``, ``coefficients`` ``[c0, c1, c2]`` (seconds per sample,
        per item, per squared item), ``batch_overhead_seconds``, ``fit`` (errors), ``device``,
        ``model``, ``measurements`` (lengths summary and seconds of every grid batch).

    Raises:
        ConfigError: empty grid, a length above ``max_seq_len``, or a fit where time does not
            grow with length.
    """
    config = config or CalibrateConfig()
    timing = config.timing
    lengths, warmup, repeats = config.length_grid, timing.warmup, timing.repeats
    if config.from_shards:
        extra_batches = shard_batches(config.from_shards, config.shard_steps) + list(extra_batches or [])
    if timing.num_threads:
        torch.set_num_threads(timing.num_threads)
    dev = torch.device(timing.device)
    mdl = make_replay_model(num_items, model, seed, dev)
    cfg = mdl.config
    if max(lengths) > cfg.max_seq_len:
        raise ConfigError(f"calibration length {max(lengths)} exceeds max_seq_len {cfg.max_seq_len}; "
                          f"pass --lengths up to {cfg.max_seq_len}")
    grid = calibration_grid(lengths, config.batch_size_grid, config.mixed, seed) + list(extra_batches or [])
    if max(int(L.max()) for L in grid) > cfg.max_seq_len:
        raise ConfigError(f"a calibration batch has a history longer than max_seq_len {cfg.max_seq_len}; "
                          "raise --max-seq-len")
    rng = np.random.default_rng(seed + 1)

    def batch_of(L: np.ndarray, step: int):
        n = len(L)
        b = make_batch(rng.integers(0, num_items, int(L.sum())), L, rng.integers(0, num_items, n),
                       np.arange(n), step, n)
        return attach_negatives(b, cfg, seed).to(dev)

    tick = resolve_clock(timing.clock, dev)
    for i in range(warmup):
        time_forward_backward(mdl, batch_of(grid[i % len(grid)], i), repeats=1, device=dev, clock=tick)
    batches = [batch_of(L, i) for i, L in enumerate(grid)]
    total, done = repeats * len(batches), 0

    def timed(b) -> float:
        nonlocal done
        t = time_forward_backward(mdl, b, repeats=1, device=dev, clock=tick)
        done += 1
        if progress is not None:
            progress(done, total)
        return t

    runs = np.array([[timed(b) for b in batches] for _ in range(repeats)])  # repeats interleaved over the grid
    seconds = np.median(runs, axis=0)
    fit = fit_batch_times(grid, seconds)
    c0, c1, c2 = fit.coefficients
    if c1 <= 0 and c2 <= 0:
        raise ConfigError("calibration found no growth of time with length (c1 = c2 = 0); use longer --lengths "
                          "or more --repeats")
    model_desc = {k: getattr(cfg, k) for k in ("embedding_dim", "num_layers", "num_heads", "ffn_multiplier",
                                                 "num_negatives", "attention")}
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    name = config.name or f"calibrated:{dev.type}:d{cfg.embedding_dim}l{cfg.num_layers}"
    return {"kind": "polynomial", "name": name,
            "coefficients": [c0, c1, c2], "units": "seconds", "batch_overhead_seconds": fit.batch_overhead_seconds,
            "fit": {"relative_rms_error": fit.relative_rms_error, "max_relative_error": fit.max_relative_error,
                    "num_measurements": len(grid)},
            "device": dev_name, "model": model_desc, "clock": "thread" if tick is time.thread_time else "wall",
            "measurements": [{"num_samples": int(len(L)), "sum_length": int(L.sum()),
                              "sum_length_sq": int((L.astype(np.int64) ** 2).sum()), "seconds": float(s)}
                             for L, s in zip(grid, seconds)]}
