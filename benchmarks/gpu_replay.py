"""Calibrate + replay with the torch-only model step (:mod:`benchmarks.gpu_model`), for the GPU check.

The same procedure as ``fstrain calibrate`` and ``fstrain replay`` (docs/fstrain.md), with the
torch-only step in place of fstrain's torchrec model (which the lent GPU image cannot import):

1. **Data** (:func:`prepare`): NVIDIA's benchmark setting, synthetic history lengths
   ``min(Zipf(1.2), 4096)`` (``numpy.random.Generator.zipf``, seed 0), ``S`` global batches of
   ``R * B`` samples (R=16, B=32), written to ``samples.npz`` in a data folder (git-ignored).
2. **Calibrate** (:func:`calibrate`): forward + backward times of a grid of batches (homogeneous
   ``n x L`` plus mixed ones) fitted to ``t = b0 + c0 n + c1 sum L + c2 sum L^2`` by non-negative
   least squares on relative errors (as :mod:`fstrain.measure.calibrate`).
3. **Balance**: every step's samples assigned to ranks by :func:`fsdata.balancer.partition_fast.lpt_swap_steps`
   on the calibrated per-sample cost ``c0 + c1 L + c2 L^2``; the baseline ("shuffled") cuts each
   step's random order into ``R`` contiguous batches (what ``--strategy shuffle`` does).
4. **Replay** (:func:`replay`): every rank's batch of every step timed on this one device,
   ``repeats`` times interleaved over the ranks, median kept: ``C[s, r]`` (seconds). Null control:
   rank 0's batch timed once per rank in the same loop. Reported per assignment: slowest-rank
   ms/step (mean over steps of ``max_r C``), measured bubble (:func:`fsdata.balancer.bubble.run_bubble`),
   null bubble, their difference, and the predicted bubble of the calibrated model.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu_model import StepConfig, TorchOnlyStep, make_batch, time_step

#: NVIDIA's benchmark setting (lengths Zipf 1.2, max 4096, R=16 ranks, B=32 per rank).
SETTING = {"zipf_a": 1.2, "max_len": 4096, "num_ranks": 16, "batch_size_per_rank": 32}
DATA_FILE = "samples.npz"


def zipf_lengths(n: int, a: float, max_len: int, seed: int) -> np.ndarray:
    """``[n]`` int64 lengths ``min(Zipf(a), max_len)`` (>= 1)."""
    return np.minimum(np.random.default_rng(seed).zipf(a, n), max_len).astype(np.int64)


def prepare(data: Path, num_steps: int, setting: dict | None = None, seed: int = 0) -> Path:
    """Write ``data/samples.npz``: ``lengths`` ``[S x R*B]`` int64 and the setting (JSON). Returns its path."""
    s = {**SETTING, **(setting or {})}
    n = s["num_ranks"] * s["batch_size_per_rank"]
    lengths = zipf_lengths(num_steps * n, s["zipf_a"], s["max_len"], seed).reshape(num_steps, n)
    data.mkdir(parents=True, exist_ok=True)
    path = data / DATA_FILE
    tmp = data / (DATA_FILE + ".tmp.npz")
    np.savez(tmp, lengths=lengths, setting=json.dumps({**s, "seed": seed, "num_steps": num_steps}))
    tmp.replace(path)
    return path


def load(data: Path) -> tuple[np.ndarray, dict]:
    """``(lengths [S x R*B], setting)`` from :func:`prepare`'s file.

    Raises:
        FileNotFoundError: no ``samples.npz`` in ``data``.
    """
    with np.load(data / DATA_FILE) as z:
        return z["lengths"], json.loads(str(z["setting"]))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: every column subset solved, best feasible kept
    (:func:`fstrain.measure.calibrate.nnls`, which cannot be imported without torchrec)."""
    k = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s = a / scale
    best, best_res = np.zeros(k), float(b @ b)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            x, *_ = np.linalg.lstsq(a_s[:, cols], b, rcond=None)
            res = float(np.sum((a_s[:, cols] @ x - b) ** 2))
            if (x >= 0).all() and res < best_res:
                best, best_res = np.zeros(k), res
                best[list(cols)] = x
    return best / scale


def fit(batches: list[np.ndarray], seconds: np.ndarray) -> dict:
    """Fit ``t = b0 + c0 n + c1 sum L + c2 sum L^2`` (non-negative, relative errors).

    Returns:
        ``batch_overhead_seconds`` (b0), ``coefficients`` ``[c0, c1, c2]`` (seconds per sample, per
        item, per squared item), ``relative_rms_error``, ``max_relative_error``.
    """
    t = np.asarray(seconds, dtype=np.float64)
    a = np.array([[1.0, len(L), float(np.sum(L)), float(np.sum(np.asarray(L, dtype=np.float64) ** 2))]
                  for L in batches])
    x = nnls(a / t[:, None], np.ones(len(t)))
    rel = a @ x / t - 1.0
    return {"batch_overhead_seconds": float(x[0]), "coefficients": [float(v) for v in x[1:]],
            "relative_rms_error": float(np.sqrt(np.mean(rel ** 2))), "max_relative_error": float(np.abs(rel).max())}


def calibrate(model: TorchOnlyStep, device: torch.device, lengths: list[int], batch_sizes: list[int],
              repeats: int, seed: int = 0) -> dict:
    """Time the grid (homogeneous ``n x L`` for every pair plus as many mixed batches) and fit.

    Returns:
        :func:`fit`'s dict plus ``num_measurements`` and ``grid`` (``n``, ``sum_L``, ``seconds``).
    """
    rng = np.random.default_rng(seed)
    grid = [np.full(n, L, dtype=np.int64) for n in batch_sizes for L in lengths]
    grid += [rng.choice(np.asarray(lengths), int(rng.choice(batch_sizes))) for _ in range(len(grid) // 2)]
    batches = [make_batch(model, L, seed + i, device) for i, L in enumerate(grid)]
    time_step(model, batches[-1], device)  # warm-up (kernels, allocator)
    runs = np.array([[time_step(model, b, device) for b in batches] for _ in range(repeats)])
    seconds = np.median(runs, axis=0)
    out = fit([b["lengths"] for b in batches], seconds)
    out.update(num_measurements=len(grid), grid=[{"n": int(len(b["lengths"])), "sum_L": int(b["lengths"].sum()),
                                                  "seconds": float(s)} for b, s in zip(batches, seconds)])
    return out


def assign(lengths: np.ndarray, num_ranks: int, batch_size_per_rank: int, coefficients) -> dict[str, np.ndarray]:
    """Per step, the rank of every sample: ``balanced`` (LPT + swaps on the calibrated cost) and
    ``shuffled`` (contiguous cut of the random order). Both ``[S x R*B]`` int32."""
    from fsdata.balancer.partition_fast import lpt_swap_steps

    c0, c1, c2 = coefficients
    L = lengths.astype(np.float64)
    costs = c0 + L * (c1 + c2 * L)
    shuffled = np.broadcast_to(np.repeat(np.arange(num_ranks, dtype=np.int32), batch_size_per_rank),
                               lengths.shape).copy()
    return {"balanced": lpt_swap_steps(costs, num_ranks, batch_size_per_rank), "shuffled": shuffled}


def _summary(C: np.ndarray, N: np.ndarray, P: np.ndarray) -> dict:
    from fsdata.balancer.bubble import run_bubble

    return {"slowest_rank_ms_per_step": 1e3 * float(C.max(axis=1).mean()),
            "mean_rank_ms_per_step": 1e3 * float(C.mean()),
            "measured_bubble": run_bubble(C), "null_bubble": run_bubble(N),
            "measured_bubble_minus_null": run_bubble(C) - run_bubble(N),
            "null_slowest_rank_ms_per_step": 1e3 * float(N.max(axis=1).mean()),
            "predicted_bubble": run_bubble(P), "num_steps": int(C.shape[0]), "compute_seconds": C.tolist()}


def replay(model: TorchOnlyStep, device: torch.device, lengths: np.ndarray, plans: dict[str, np.ndarray],
           num_ranks: int, coefficients, repeats: int, seed: int = 0, deadline: float | None = None) -> dict:
    """Time every rank's batch of every step under each assignment (module doc, step 4).

    The assignments take turns step by step, so a run cut short by ``deadline`` has replayed the
    same steps under each.

    Args:
        lengths: ``[S x R*B]`` int64.
        plans: name -> ``[S x R*B]`` int32 ranks (:func:`assign`).
        coefficients: the calibrated ``[c0, c1, c2]`` (for the predicted bubble).
        deadline: ``time.monotonic()`` past which no further step starts (at least one runs).

    Returns:
        name -> JSON-ready dict: ``slowest_rank_ms_per_step``, ``mean_rank_ms_per_step``,
        ``measured_bubble``, ``null_bubble``, ``measured_bubble_minus_null``,
        ``null_slowest_rank_ms_per_step``, ``predicted_bubble``, ``num_steps`` (replayed),
        ``compute_seconds`` ``[S x R]``.
    """
    import time

    S = lengths.shape[0]
    mats = {k: (np.zeros((S, num_ranks)), np.zeros((S, num_ranks)), np.zeros((S, num_ranks))) for k in plans}
    c0, c1, c2 = coefficients
    done = 0
    for s in range(S):
        if s and deadline is not None and time.monotonic() > deadline:
            break
        for k, ranks in plans.items():
            C, N, P = mats[k]
            per_rank = [lengths[s][ranks[s] == r] for r in range(num_ranks)]
            P[s] = [float(np.sum(c0 + L * (c1 + c2 * L.astype(np.float64)))) for L in per_rank]
            batches = [make_batch(model, L, seed + 1000 * s + r, device) for r, L in enumerate(per_rank)]
            if s == 0:
                time_step(model, batches[0], device)  # warm-up
            timed = batches + [batches[0]] * num_ranks  # the null control, interleaved the same way
            runs = np.array([[time_step(model, b, device) for b in timed] for _ in range(repeats)])
            med = np.median(runs, axis=0)
            C[s], N[s] = med[:num_ranks], med[num_ranks:]
        done = s + 1
    return {k: _summary(C[:done], N[:done], P[:done]) for k, (C, N, P) in mats.items()}


def run(data: Path, device: torch.device, *, model: StepConfig, num_steps: int, repeats: int,
        calib_lengths: list[int], calib_batch_sizes: list[int], seed: int = 0, setting: dict | None = None,
        deadline: float | None = None) -> dict:
    """The whole check: load (or :func:`prepare` with ``setting``) the data, calibrate, assign, replay both
    (no new step past ``deadline``, a ``time.monotonic()`` value).

    Returns:
        JSON-ready dict: ``setting``, ``model``, ``device``, ``calibration``, ``balanced``, ``shuffled``,
        ``slowest_rank_speedup`` (shuffled / balanced slowest-rank ms/step), ``peak_memory_gib``
        (CUDA's peak allocated, GiB; None on CPU), ``data_prepared_here``.
    """
    prepared_here = not (data / DATA_FILE).exists()
    if prepared_here:
        prepare(data, num_steps, setting, seed=seed)
    lengths, setting = load(data)
    lengths = np.minimum(lengths[:num_steps], model.max_seq_len)
    torch.manual_seed(seed)
    mdl = TorchOnlyStep(model).to(device)
    cal = calibrate(mdl, device, calib_lengths, calib_batch_sizes, repeats, seed)
    R, B = setting["num_ranks"], setting["batch_size_per_rank"]
    plans = assign(lengths, R, B, cal["coefficients"])
    res = replay(mdl, device, lengths, plans, R, cal["coefficients"], repeats, seed, deadline)
    cuda = device.type == "cuda"
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None
    return {"setting": setting, "model": model.to_json(), "device": dev_name, "calibration": cal, **res,
            "peak_memory_gib": peak,
            "slowest_rank_speedup": res["shuffled"]["slowest_rank_ms_per_step"]
            / res["balanced"]["slowest_rank_ms_per_step"],
            "num_steps": res["balanced"]["num_steps"], "steps_prepared": int(lengths.shape[0]), "repeats": repeats,
            "data_prepared_here": prepared_here}
