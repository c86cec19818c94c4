"""SM-free data movement on one GPU: a GEMM's slowdown while the same bytes move by copy engine vs SM kernel.

For each transfer size (1, 4, 16, 64 MB) and each way of moving it, a side stream copies
back-to-back transfers of that size for the whole time a main-stream loop of bf16 GEMMs runs; the
GEMM loop's TFLOP/s is compared with the same loop alone (measured right before, same size):

* ``copy_engine_d2d``: ``dst.copy_(src)`` between two contiguous buffers of the same GPU, i.e.
  ``cudaMemcpyAsync`` device-to-device on a side stream (what ``cuda-ce`` issues for its peer
  pulls; whether the driver runs a same-device memcpy on a copy engine is what this measures);
* ``copy_engine_d2h``: ``copy_`` into pinned host memory, ``non_blocking`` (always a copy engine;
  the control);
* ``sm_kernel``: ``torch.mul(src, 1, out=dst)``, an elementwise kernel on the SMs, what NCCL's copy
  kernels are (the published reference: 30-40% GEMM slowdown under NCCL kernels).

The device-side copies are replayed from a CUDA graph (thousands of 1 MB copies cannot be
launched from Python as fast as they run; the pinned-host ones are slow enough to launch one by
one), as many as cover the GEMM loop given the copy's time alone (``covered`` records that they
did). All times by CUDA events; medians of ``repeats``, the loop alone and the loop during the copies
alternated in each repeat (alone, during, alone, ...) after about ``warmup_s`` seconds of GEMMs, so that
clock and power states reach both equally (a first run on an H100 that measured every "alone" first
read 3-15% *faster* GEMMs during copies). ``gemm_alone_spread`` (max - min of the alone loops over
their median) is the noise floor a slowdown must exceed.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

SIZES_MB = (1, 4, 16, 64)
VARIANTS = ("copy_engine_d2d", "copy_engine_d2h", "sm_kernel")
MAX_GRAPH_COPIES = 2048


def copies_needed(window_ms: float, copy_ms: float, margin: float = 1.3) -> int:
    """Back-to-back copies of ``copy_ms`` each that cover ``margin * window_ms`` (at least 1)."""
    if copy_ms <= 0:
        raise ValueError(f"copy time must be > 0 ms, got {copy_ms}")
    return max(1, math.ceil(margin * window_ms / copy_ms))


def graph_plan(num_copies: int, max_per_graph: int = MAX_GRAPH_COPIES) -> tuple[int, int]:
    """``(copies per graph, graph replays)`` with ``per_graph * replays >= num_copies``."""
    per_graph = min(num_copies, max_per_graph)
    return per_graph, math.ceil(num_copies / per_graph)


def _copy_fn(variant: str, size_bytes: int, device: torch.device):
    src = torch.empty(size_bytes // 2, dtype=torch.float16, device=device).normal_()
    if variant == "copy_engine_d2h":
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        return lambda: dst.copy_(src, non_blocking=True)
    dst = torch.empty_like(src)
    if variant == "copy_engine_d2d":
        return lambda: dst.copy_(src)
    return lambda: torch.mul(src, 1, out=dst)


def _graph(fn, n: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return g


class _Copies:
    """``n`` back-to-back copies enqueued on the current stream: replays of a CUDA graph of up to
    :data:`MAX_GRAPH_COPIES` copies (``graph``), or launched one by one (the pinned-host copies:
    each takes >= ~20 us, longer than a launch, and a capture would touch the host allocator)."""

    def __init__(self, fn, n: int, side: torch.cuda.Stream, graph: bool) -> None:
        self.fn = fn
        self.per, self.replays = graph_plan(n) if graph else (n, 1)
        self.g = _graph(fn, self.per, side) if graph else None
        self.count = self.per * self.replays

    def enqueue(self) -> None:
        if self.g is None:
            for _ in range(self.per):
                self.fn()
        else:
            for _ in range(self.replays):
                self.g.replay()


def run(device: torch.device, *, sizes_mb=SIZES_MB, gemm_n: int = 8192, gemm_iters: int = 40,
        repeats: int = 5, warmup_s: float = 2.0) -> dict:
    """Measure every (size, variant). Needs CUDA.

    Returns:
        JSON-ready dict: ``gemm_n``, ``gemm_iters``, ``dtype``, ``rows`` (per size and variant:
        ``size_mb``, ``variant``, ``gemm_tflops_alone``, ``gemm_tflops_during``, ``slowdown``
        (``1 - alone / during`` = the GEMM throughput lost), ``gemm_alone_spread`` (the noise floor),
        ``gemm_time_increase``
        (``during / alone - 1``), ``copy_gbps_alone``, ``copy_gbps_during``, ``copies``, ``launch`` (``graph`` or
        ``eager``), ``covered`` (the copies ran for the whole GEMM loop); or ``error``).
    """
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    b = torch.randn(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    flops = 2 * gemm_n ** 3 * gemm_iters

    def ev():
        return torch.cuda.Event(enable_timing=True)

    def gemm_loop_ms() -> float:
        torch.cuda.synchronize(device)
        s0, s1 = ev(), ev()
        s0.record(main)
        for _ in range(gemm_iters):
            torch.mm(a, b)
        s1.record(main)
        torch.cuda.synchronize(device)
        return s0.elapsed_time(s1)

    t_end = time.monotonic() + warmup_s  # warm-up: cuBLAS heuristics, clocks and power at steady state
    while time.monotonic() < t_end:
        gemm_loop_ms()
    rows = []
    for size_mb in sizes_mb:
        size = size_mb << 20
        for variant in VARIANTS:
            row = {"size_mb": size_mb, "variant": variant}
            graph = variant != "copy_engine_d2h"
            try:
                fn = _copy_fn(variant, size, device)
                probe = _Copies(fn, 128, side, graph)
                torch.cuda.synchronize(device)
                c0, c1 = ev(), ev()
                with torch.cuda.stream(side):
                    c0.record(side)
                    probe.enqueue()
                    c1.record(side)
                torch.cuda.synchronize(device)
                copy_ms = c0.elapsed_time(c1) / probe.count
                del probe
                alone_runs = [gemm_loop_ms()]
                copies = _Copies(fn, copies_needed(alone_runs[0], copy_ms, 1.3 if graph else 2.0), side, graph)
                during, gbps, covered = [], [], []
                for rep in range(repeats):
                    if rep:
                        alone_runs.append(gemm_loop_ms())  # alternated with the runs during copies
                    torch.cuda.synchronize(device)
                    c0, c1, s0, s1 = ev(), ev(), ev(), ev()
                    with torch.cuda.stream(side):
                        c0.record(side)
                        copies.enqueue()
                        c1.record(side)
                    s0.record(main)
                    for _ in range(gemm_iters):
                        torch.mm(a, b)
                    s1.record(main)
                    torch.cuda.synchronize(device)
                    during.append(s0.elapsed_time(s1))
                    gbps.append(copies.count * size / (c0.elapsed_time(c1) / 1e3) / 1e9)
                    covered.append(c0.elapsed_time(s0) >= 0 and s1.elapsed_time(c1) >= 0)
                d = statistics.median(during)
                alone = statistics.median(alone_runs)
                row.update(gemm_alone_spread=(max(alone_runs) - min(alone_runs)) / alone,
                           gemm_tflops_alone=flops / (alone / 1e3) / 1e12, gemm_tflops_during=flops / (d / 1e3) / 1e12,
                           slowdown=1 - alone / d, gemm_time_increase=d / alone - 1,
                           copy_gbps_alone=size / (copy_ms / 1e3) / 1e9,
                           copy_gbps_during=statistics.median(gbps), copies=copies.count,
                           launch="graph" if graph else "eager", covered=all(covered))
                del copies
            except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                try:
                    torch.cuda.synchronize(device)
                except Exception as e2:  # noqa: BLE001 - a broken context: the rest cannot run
                    row["error"] += f"; then {type(e2).__name__}"
                    rows.append(row)
                    break
            rows.append(row)
            torch.cuda.empty_cache()
    return {"gemm_n": gemm_n, "gemm_iters": gemm_iters, "dtype": "bfloat16", "repeats": repeats, "rows": rows}


def table(res: dict) -> list[str]:
    """Markdown rows: one per (size, variant)."""
    out = ["| MB per transfer | moved by | GEMM TFLOP/s alone | during | GEMM throughput lost | noise (alone spread) "
           "| copy GB/s alone | during | covered |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        if "error" in r:
            out.append(f"| {r['size_mb']} | {r['variant']} | error: {r['error'][:80]} | | | | | | |")
        else:
            out.append(f"| {r['size_mb']} | {r['variant']} | {r['gemm_tflops_alone']:.0f} "
                       f"| {r['gemm_tflops_during']:.0f} | {r['slowdown']:.1%} "
                       f"| {r.get('gemm_alone_spread', float('nan')):.1%} | {r['copy_gbps_alone']:.0f} "
                       f"| {r['copy_gbps_during']:.0f} "
                       f"| {'yes' if r['covered'] else 'no'} |")
    return out
