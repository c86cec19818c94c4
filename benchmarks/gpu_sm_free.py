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

The side stream's copies are replayed from a CUDA graph (thousands of 1 MB copies cannot be
launched from Python as fast as they run), sized from the copy's time alone so that they cover
the GEMM loop (``covered`` records that they did). All times by CUDA events; medians of
``repeats``.
"""

from __future__ import annotations

import math
import statistics

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


def run(device: torch.device, *, sizes_mb=SIZES_MB, gemm_n: int = 8192, gemm_iters: int = 40,
        repeats: int = 3) -> dict:
    """Measure every (size, variant). Needs CUDA.

    Returns:
        JSON-ready dict: ``gemm_n``, ``gemm_iters``, ``dtype``, ``rows`` (per size and variant:
        ``size_mb``, ``variant``, ``gemm_tflops_alone``, ``gemm_tflops_during``, ``slowdown``
        (``1 - during / alone``), ``copy_gbps_alone``, ``copy_gbps_during``, ``copies``,
        ``covered``; or ``error``).
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

    def graph_ms(g, replays) -> float:
        torch.cuda.synchronize(device)
        c0, c1 = ev(), ev()
        with torch.cuda.stream(side):
            c0.record(side)
            for _ in range(replays):
                g.replay()
            c1.record(side)
        torch.cuda.synchronize(device)
        return c0.elapsed_time(c1)

    gemm_loop_ms()  # warm-up: cuBLAS heuristics, clocks
    rows = []
    for size_mb in sizes_mb:
        size = size_mb << 20
        for variant in VARIANTS:
            row = {"size_mb": size_mb, "variant": variant}
            try:
                fn = _copy_fn(variant, size, device)
                probe = min(64, MAX_GRAPH_COPIES)
                copy_ms = graph_ms(_graph(fn, probe, side), 1) / probe
                alone = statistics.median(gemm_loop_ms() for _ in range(repeats))
                per_graph, replays = graph_plan(copies_needed(alone, copy_ms))
                g = _graph(fn, per_graph, side)
                during, gbps, covered = [], [], []
                for _ in range(repeats):
                    torch.cuda.synchronize(device)
                    c0, c1, s0, s1 = ev(), ev(), ev(), ev()
                    with torch.cuda.stream(side):
                        c0.record(side)
                        for _ in range(replays):
                            g.replay()
                        c1.record(side)
                    s0.record(main)
                    for _ in range(gemm_iters):
                        torch.mm(a, b)
                    s1.record(main)
                    torch.cuda.synchronize(device)
                    during.append(s0.elapsed_time(s1))
                    gbps.append(per_graph * replays * size / (c0.elapsed_time(c1) / 1e3) / 1e9)
                    covered.append(c0.elapsed_time(s0) >= 0 and s1.elapsed_time(c1) >= 0)
                del g
                d = statistics.median(during)
                row.update(gemm_tflops_alone=flops / (alone / 1e3) / 1e12, gemm_tflops_during=flops / (d / 1e3) / 1e12,
                           slowdown=1 - alone / d, copy_gbps_alone=size / (copy_ms / 1e3) / 1e9,
                           copy_gbps_during=statistics.median(gbps), copies=per_graph * replays,
                           covered=all(covered))
            except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            rows.append(row)
            torch.cuda.empty_cache()
    return {"gemm_n": gemm_n, "gemm_iters": gemm_iters, "dtype": "bfloat16", "repeats": repeats, "rows": rows}


def table(res: dict) -> list[str]:
    """Markdown rows: one per (size, variant)."""
    out = ["| MB per transfer | moved by | GEMM TFLOP/s alone | during | GEMM slowdown | copy GB/s alone | during "
           "| covered |",
           "|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        if "error" in r:
            out.append(f"| {r['size_mb']} | {r['variant']} | error: {r['error'][:80]} | | | | | |")
        else:
            out.append(f"| {r['size_mb']} | {r['variant']} | {r['gemm_tflops_alone']:.0f} "
                       f"| {r['gemm_tflops_during']:.0f} | {r['slowdown']:.1%} | {r['copy_gbps_alone']:.0f} "
                       f"| {r['copy_gbps_during']:.0f} "
                       f"| {'yes' if r['covered'] else 'no'} |")
    return out
