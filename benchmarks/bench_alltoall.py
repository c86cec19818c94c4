"""All-to-all-v latency and bandwidth: shared-memory backend vs gloo (CPU), copy engine vs NCCL (GPU).

CPU section: for 2 and 4 ranks (processes on this node) and message sizes from 1 KB to 64 MB per
rank, time ``all_to_all_v`` of the ``shm`` backend and of gloo's ``all_to_all_single``, and in
the same iterations a one-process ``memcpy`` of the same bytes per rank (rank 0 copies its input
into its output, ``Tensor.copy_``; the other ranks idle): the physical limit of moving those bytes
once through memory on this machine. Each iteration starts after a barrier; its time is the
slowest rank's; the table gives the median over iterations, the bus bandwidth (bytes leaving one
rank for other ranks / time; for memcpy, the bytes copied / time) and ``shm/memcpy``: the memcpy
time divided by the shm time, i.e. the share of memcpy's speed shm reaches on the same bytes per
rank (a copy-in/copy-out transport tops out near 50%). Where shm runs its single-copy path (the
receiver reads each peer's rows from the peer's input with ``process_vm_readv``, ``data_path`` "cma"
in the JSON), the same iterations also time the rings alone (``shm-copy``, ``cma=False``: the
copy-in/copy-out path), so before and after come from one run. ``--fixed-cost`` also times shm with
one rank (no peer: the call's own fixed cost). The load average is recorded before and after.
``--breakdown`` then splits shm's calls into their parts, per rank (Python outside the exchange
loop, copies, doorbell writes, sleeping, the loop's own Python and spinning;
:mod:`benchmarks.shm_breakdown`), in a separate pass after the timing.

``--calls-per-sample K`` times K calls back to back after each barrier and divides by K: ranks
leave a barrier up to a scheduler wake-up apart, and with K = 1 that skew is inside every small
message's figure (shm and gloo alike); with K > 1 it is spread over K calls, which is how a training
step issues them (several all-to-alls between synchronisations). ``--steady K`` adds a table with
K (e.g. 2000) calls per barrier up to 64 KB and K x 64 KB / size above (at least 32), where the skew
no longer counts: the per-call cost in steady state, next to one rank's (with ``--fixed-cost``),
gloo's and the memcpy of the main table; with 2 ranks and messages up to 64 KB, also its null control
(both ranks running one-rank calls at once, paired call by call, the slower counted: what a two-rank call
costs when only the later rank's own call counts) and the two-core floor of the peer's bytes.

GPU section (only with >= 2 CUDA devices): GEMM throughput alone and while an all-to-all-v loop
runs on the copy engines (``cuda-ce``) or on NCCL kernels, showing how much compute each steals.
Without CUDA it prints that it was not measured.

Examples:
    python -m benchmarks.bench_alltoall --quick
    python -m benchmarks.bench_alltoall --out results/ --ranks 2 4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger("bench_alltoall")

_ROW_FLOATS = 64  # float32 rows of 256 bytes, an embedding-sized row
_FULL_SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
_QUICK_SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _iterations(size_bytes: int, quick: bool) -> int:
    if size_bytes <= 64 << 10:
        n = 200
    elif size_bytes <= 1 << 20:
        n = 50
    else:
        n = 10 if size_bytes <= 16 << 20 else 5
    return max(3, n // 4) if quick else n


def _time(fns: dict, iters: int, warmup: int = 2, calls: int = 1) -> dict[str, float]:
    """Median over iterations of the slowest rank's time per call, seconds (each iteration times
    ``calls`` calls back to back after one barrier and divides by ``calls``).

    The functions alternate inside each iteration, so load from other processes on the node hits
    them alike.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            dt = torch.tensor([(time.perf_counter() - t0) / calls], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times[name].append(dt.item())
    return {name: statistics.median(t) for name, t in times.items()}


def _inputs(size: int, world_size: int) -> tuple[int, list[int], torch.Tensor, torch.Tensor]:
    """Rows per peer, even splits, input ``[rows x 64]`` float32 and an output like it for ``size`` bytes per rank."""
    per_peer = max(1, size // (_ROW_FLOATS * 4 * world_size))
    x = torch.randn(per_peer * world_size, _ROW_FLOATS)
    return per_peer, [per_peer] * world_size, x, torch.empty_like(x)


def _cpu_worker(rank: int, world_size: int, init_file: str, sizes: list[int], quick: bool, shm_cfg: dict,
                calls: int, result_path: str) -> None:
    from fstrain.distributed.comm import CommConfig, ShmBackend, build_backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    shm = build_backend(CommConfig(backend="shm", shm=ShmBackend.Config(**shm_cfg)))
    assert isinstance(shm, ShmBackend)
    gloo = build_backend(CommConfig(backend="gloo")) if world_size > 1 else None
    # The rings alone (copy-in/copy-out, the path before single copy) in the same run, when shm reads peers.
    rings = (build_backend(CommConfig(backend="shm", shm=ShmBackend.Config(**{**shm_cfg, "cma": False})))
             if shm.cma else None)
    rows = []
    for size in sizes:
        per_peer, splits, x, out = _inputs(size, world_size)
        iters = _iterations(size, quick)
        fns = {name: (lambda c=comm: c.all_to_all_v(x, splits, splits, out=out))
               for name, comm in (("shm", shm), ("shm-copy", rings), ("gloo", gloo)) if comm is not None}
        if world_size > 1:
            fns["memcpy"] = (lambda: out.copy_(x)) if rank == 0 else (lambda: None)
        medians = _time(fns, iters, calls=calls)
        for name, seconds in medians.items():
            cross_bytes = per_peer * (world_size - 1) * _ROW_FLOATS * 4 if name != "memcpy" else x.numel() * 4
            rows.append({"backend": name if world_size > 1 else "shm-1rank", "world_size": world_size,
                         "bytes_per_rank": x.numel() * 4, "iterations": iters, "calls_per_sample": calls,
                         "latency_us": seconds * 1e6,
                         "bus_bandwidth_gbps": cross_bytes / seconds / 1e9})
            comm = shm if name == "shm" else rings if name == "shm-copy" else None
            if isinstance(comm, ShmBackend):
                rows[-1].update(data_path=comm.data_path, cma_reason=comm.cma_reason,
                                cma_min_bytes=comm.config.cma_min_bytes)
    for comm in (shm, rings):
        if comm is not None:
            comm.close()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


STEADY_FULL_BYTES = 64 << 10  # messages up to this size get all K calls per barrier in --steady


def steady_calls(size_bytes: int, calls: int) -> int:
    """Calls per barrier for ``--steady K`` at ``size_bytes`` per rank: K up to 64 KB, then K x 64 KB / size,
    at least min(K, 32): enough for the 100-300 us barrier skew to be a few percent of the sample."""
    return calls if size_bytes <= STEADY_FULL_BYTES else max(min(calls, 32), calls * STEADY_FULL_BYTES // size_bytes)


def _paired_one_rank(shm, x, splits, out, shm_cfg: dict, rank: int, size: int, calls: int, samples: int = 5,
                     warmup: int = 1) -> tuple[float, float, float]:
    """The null control of a two-rank call: both ranks run one-rank calls (a world-size-1 shm transport each,
    the same bytes per rank) at the same time, each call timed; call i of rank 0 is paired with call i of
    rank 1 and the slower counts, as the later rank ends a two-rank call. Alternated with ``calls`` two-rank
    calls of ``shm`` (slowest rank's total) after each barrier, so both see the same load.

    Returns:
        seconds per call, medians over ``samples``: the two-rank call (alternated), the paired one-rank
        calls (mean over i of max(rank 0's call i, rank 1's call i)), and the slower rank's one-rank total
        / ``calls`` (the pairing's lower bound: a rank waits only for the other's total).
    """
    from fstrain.distributed.comm import ShmBackend

    solo = ShmBackend(dist.HashStore(), rank=0, world_size=1, config=ShmBackend.Config(**shm_cfg),
                      prefix=f"solo{rank}")
    _, solo_splits, sx, sout = _inputs(size, 1)
    two, paired, slowest = [], [], []
    clock = time.perf_counter_ns
    try:
        for i in range(warmup + samples):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                shm.all_to_all_v(x, splits, splits, out=out)
            dt = torch.tensor([(time.perf_counter() - t0) / calls], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            per_call = [0] * calls
            dist.barrier()
            for j in range(calls):
                t = clock()
                solo.all_to_all_v(sx, solo_splits, solo_splits, out=sout)
                per_call[j] = clock() - t
            both: list = [None, None]
            dist.all_gather_object(both, per_call)
            if i >= warmup:
                two.append(dt.item())
                paired.append(sum(map(max, both[0], both[1])) / calls / 1e9)
                slowest.append(max(sum(both[0]), sum(both[1])) / calls / 1e9)
    finally:
        solo.close()
    return statistics.median(two), statistics.median(paired), statistics.median(slowest)


def _steady_worker(rank: int, world_size: int, init_file: str, sizes: list[int], shm_cfg: dict, calls: int,
                   result_path: str) -> None:
    """``--steady K``: per size, ``steady_calls(size, K)`` calls back to back after one barrier (shm, and
    gloo with more than one rank), slowest rank's total / calls, median of 5 samples: the skew with which
    ranks leave the barrier (100-300 us on the 2-core VM) is spread over many calls, as in a training
    step's run of collectives. Rows ``shm-steady``, ``gloo-steady``, ``shm-1rank-steady``; with 2 ranks and
    messages up to 64 KB per rank also ``shm-1rank-paired`` (`_paired_one_rank`: both ranks' one-rank calls at
    once, paired call by call, the null control of a two-rank call) and ``cross-core-floor``: the same exchange
    between two pinned threads with no Python (:mod:`benchmarks.cross_core`), measured right after, while
    rank 1 waits in a barrier."""
    from fstrain.distributed.comm import CommConfig, ShmBackend, build_backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    shm = build_backend(CommConfig(backend="shm", shm=ShmBackend.Config(**shm_cfg)))
    gloo = build_backend(CommConfig(backend="gloo")) if world_size > 1 else None
    rows = []
    for size in sizes:
        per_peer, splits, x, out = _inputs(size, world_size)
        fns = {name: (lambda c=comm: c.all_to_all_v(x, splits, splits, out=out))
               for name, comm in (("shm", shm), ("gloo", gloo)) if comm is not None}
        k = steady_calls(size, calls)
        for name, seconds in _time(fns, 5, warmup=1, calls=k).items():
            rows.append({"backend": f"{name}-steady" if world_size > 1 else "shm-1rank-steady",
                         "world_size": world_size, "bytes_per_rank": x.numel() * 4, "iterations": 5,
                         "calls_per_sample": k, "latency_us": seconds * 1e6})
        if world_size == 2 and size <= STEADY_FULL_BYTES:
            # each rank's own call, both ranks at once (the null control)
            two, paired, slowest = _paired_one_rank(shm, x, splits, out, shm_cfg, rank, size, k)
            rows.append({"backend": "shm-1rank-paired", "world_size": 2, "bytes_per_rank": x.numel() * 4,
                         "iterations": 5, "calls_per_sample": k, "latency_us": paired * 1e6,
                         "slowest_total_us": slowest * 1e6, "shm_alternated_us": two * 1e6})
            # the cores' own cost of the peer's bytes, now
            dist.barrier()
            if rank == 0:  # rank 1 blocks in the barrier meanwhile: both cores are free
                from benchmarks.cross_core import exchange_floor_us

                floor = [exchange_floor_us(per_peer * _ROW_FLOATS * 4, iters=k) for _ in range(5)]
                rows.append({"backend": "cross-core-floor", "world_size": 2, "bytes_per_rank": x.numel() * 4,
                             "iterations": 5, "calls_per_sample": k, "latency_us": statistics.median(floor)})
            dist.barrier()
    shm.close()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _gpu_worker(rank: int, world_size: int, init_file: str, quick: bool, result_path: str) -> None:
    """GEMM TFLOP/s alone and during an all-to-all-v loop (cuda-ce vs nccl). Needs CUDA."""
    from fstrain.distributed.comm import CommConfig, CopyEngineBackend, build_backend

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, device_id=torch.device("cuda", rank))
    n, size = 8192, 64 << 20
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    per_peer = size // (_ROW_FLOATS * 4 * world_size)
    x = torch.randn(per_peer * world_size, _ROW_FLOATS, device="cuda")
    splits = [per_peer] * world_size
    gemms, exchanges = (10, 5) if quick else (50, 20)

    def gemm_tflops(comm=None) -> tuple[float, float]:
        side = torch.cuda.Stream()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if comm is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(exchanges):
                    comm.all_to_all_v(x, splits, splits)
        for _ in range(gemms):
            a @ a
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return 2 * n**3 * gemms / dt / 1e12, exchanges * size / dt / 1e9 if comm else 0.0

    rows = [{"mode": "gemm alone", "gemm_tflops": gemm_tflops()[0], "a2a_gbps": 0.0}]
    for name, cfg in (("cuda-ce", CopyEngineBackend.Config()),
                      ("nccl", CopyEngineBackend.Config(force_nccl=True))):
        comm = build_backend(CommConfig(backend="cuda-ce", cuda_ce=cfg))
        gemm_tflops(comm)  # warm up
        tflops, gbps = gemm_tflops(comm)
        rows.append({"mode": f"gemm + {name} all-to-all-v", "gemm_tflops": tflops,
                     "a2a_gbps": gbps, "copy_engines": getattr(comm, "uses_copy_engines", False)})
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _spawn(fn, world_size: int, *args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        mp.spawn(fn, args=(world_size, os.path.join(tmp, "init"), *args, result),
                 nprocs=world_size, join=True)
        with open(result) as f:
            return json.load(f)


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("Examples:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--out", default=None, help="directory for bench_alltoall.json")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (CPU)")
    parser.add_argument("--fixed-cost", action="store_true", help="also time shm with one rank (its fixed cost)")
    parser.add_argument("--shm-chunk-bytes", type=int, default=None, help="ShmBackend.Config.chunk_bytes")
    parser.add_argument("--shm-spin-us", type=int, default=None, help="ShmBackend.Config.spin_us")
    parser.add_argument("--shm-num-slots", type=int, default=None, help="ShmBackend.Config.num_slots")
    parser.add_argument("--shm-cma-min-bytes", type=int, default=None, help="ShmBackend.Config.cma_min_bytes")
    parser.add_argument("--shm-no-cma", action="store_true",
                        help="ShmBackend.Config.cma=False: the rings only (no single copy, no shm-copy rows)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also split shm's calls into copies, doorbells, sleeping and Python (per rank)")
    parser.add_argument("--calls-per-sample", type=int, default=1, metavar="K",
                        help="calls timed back to back after each barrier (time per call = total / K; default 1)")
    parser.add_argument("--steady", type=int, default=0, metavar="K",
                        help="also time every size in steady state: K calls back to back after one barrier up "
                             "to 64 KB, fewer above (K x 64 KB / size, at least 32); with --fixed-cost, one rank too")
    args = parser.parse_args(argv)
    if args.steady < 0:
        parser.error(f"--steady must be >= 0, got {args.steady}")
    if args.calls_per_sample < 1:
        parser.error(f"--calls-per-sample must be >= 1, got {args.calls_per_sample}")
    if any(r < 2 for r in args.ranks):
        parser.error(f"--ranks needs world sizes >= 2, got {args.ranks}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = _QUICK_SIZES if args.quick else _FULL_SIZES
    shm_cfg = {k: v for k, v in (("chunk_bytes", args.shm_chunk_bytes), ("spin_us", args.shm_spin_us),
                                 ("num_slots", args.shm_num_slots), ("cma_min_bytes", args.shm_cma_min_bytes),
                                 ("cma", False if args.shm_no_cma else None)) if v is not None}
    load_before = os.getloadavg()
    cpu_rows: list[dict] = []
    for w in ([1] if args.fixed_cost else []) + args.ranks:
        logger.info("CPU: %d ranks ...", w)
        cpu_rows += _spawn(_cpu_worker, w, sizes, args.quick, shm_cfg, args.calls_per_sample)
    for w in (([1] if args.fixed_cost else []) + args.ranks) if args.steady else []:
        logger.info("CPU: %d ranks, steady state (%d calls per barrier) ...", w, args.steady)
        cpu_rows += _spawn(_steady_worker, w, sizes, shm_cfg, args.steady)
    load_after = os.getloadavg()
    breakdown: list[dict] = []
    if args.breakdown:
        from benchmarks.shm_breakdown import breakdown_worker

        for w in ([1] if args.fixed_cost else []) + args.ranks:
            logger.info("CPU: %d ranks, shm call breakdown ...", w)
            breakdown += _spawn(breakdown_worker, w, sizes, args.quick, shm_cfg, args.calls_per_sample)
    print(f"\nall-to-all-v, CPU, float32 rows of {_ROW_FLOATS}, even splits (median of slowest-rank "
          f"times per call, {args.calls_per_sample} call(s) per barrier; torch threads = 1 per rank; "
          f"1-minute load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after, on {os.cpu_count()} cores; shm settings {shm_cfg or 'default'})")
    paths = sorted({f"{r['backend']}: {r['data_path']}" + (f" ({r['cma_reason']})" if r["cma_reason"] else "")
                    for r in cpu_rows if r["backend"] in ("shm", "shm-copy")})
    print(f"shm data paths: {'; '.join(paths)} (cma: single copy for messages >= cma_min_bytes, copy: the rings)")
    print(f"{'ranks':>5} {'bytes/rank':>10} | {'memcpy us':>10} {'shm us':>10} {'shm-copy us':>11} {'gloo us':>10} | "
          f"{'memcpy GB/s':>11} {'shm GB/s':>9} {'gloo GB/s':>9} | {'shm/memcpy':>10} {'copy/memcpy':>11} "
          f"{'shm/gloo':>8} {'shm 1 rank us':>13}")
    by_key = {(r["backend"], r["world_size"], r["bytes_per_rank"]): r for r in cpu_rows}
    nan = {"latency_us": float("nan")}
    for w in args.ranks:
        for size in sorted({r["bytes_per_rank"] for r in cpu_rows if r["world_size"] == w}):
            s, g, m = by_key[("shm", w, size)], by_key[("gloo", w, size)], by_key[("memcpy", w, size)]
            c, one = by_key.get(("shm-copy", w, size), nan), by_key.get(("shm-1rank", 1, size), nan)
            print(f"{w:>5} {_fmt_bytes(size):>10} | {m['latency_us']:>10.1f} {s['latency_us']:>10.1f} "
                  f"{c['latency_us']:>11.1f} {g['latency_us']:>10.1f} | {m['bus_bandwidth_gbps']:>11.2f} "
                  f"{s['bus_bandwidth_gbps']:>9.2f} {g['bus_bandwidth_gbps']:>9.2f} | "
                  f"{m['latency_us'] / s['latency_us']:>9.0%} {m['latency_us'] / c['latency_us']:>10.0%} "
                  f"{g['latency_us'] / s['latency_us']:>7.2f}x {one['latency_us']:>13.1f}")
    if args.steady:
        print(f"\nsteady state: {args.steady} calls back to back after one barrier up to "
              f"{_fmt_bytes(STEADY_FULL_BYTES)} per rank, K x {_fmt_bytes(STEADY_FULL_BYTES)} / size above (at least "
              f"{min(args.steady, 32)}); slowest rank's total / calls, median of 5; memcpy from the table above;\n"
              "paired 1 rank: both ranks run one-rank calls at once, call i of each paired, the slower counted (the "
              "two-rank call's null control), alternated with two-rank calls (alt shm)")
        print(f"{'ranks':>5} {'bytes/rank':>10} {'calls':>5} | {'shm us':>9} {'shm 1 rank us':>13} "
              f"{'shm/1 rank':>10} {'2-core floor us':>15} {'shm/(1 rank+floor)':>18} | {'paired 1 rank us':>16} "
              f"{'alt shm us':>10} {'alt shm/(paired+floor)':>22} | {'gloo us':>9} {'shm/gloo':>8} | "
              f"{'shm/memcpy':>10}")
        for w in args.ranks:
            for size in sorted({r["bytes_per_rank"] for r in cpu_rows if r["backend"] == "shm-steady"
                                and r["world_size"] == w}):
                s, g = by_key[("shm-steady", w, size)], by_key[("gloo-steady", w, size)]
                one, m = by_key.get(("shm-1rank-steady", 1, size), nan), by_key.get(("memcpy", w, size), nan)
                floor = by_key.get(("cross-core-floor", w, size), nan)["latency_us"]
                pair = by_key.get(("shm-1rank-paired", w, size), {"latency_us": nan["latency_us"],
                                                                   "shm_alternated_us": nan["latency_us"]})
                print(f"{w:>5} {_fmt_bytes(size):>10} {s['calls_per_sample']:>5} | {s['latency_us']:>9.1f} "
                      f"{one['latency_us']:>13.1f} {s['latency_us'] / one['latency_us']:>9.2f}x {floor:>15.2f} "
                      f"{s['latency_us'] / (one['latency_us'] + floor):>17.2f}x | {pair['latency_us']:>16.1f} "
                      f"{pair['shm_alternated_us']:>10.1f} "
                      f"{pair['shm_alternated_us'] / (pair['latency_us'] + floor):>21.2f}x | "
                      f"{g['latency_us']:>9.1f} {g['latency_us'] / s['latency_us']:>7.2f}x | "
                      f"{m['latency_us'] / s['latency_us']:>9.0%}")
    if breakdown:
        from benchmarks.shm_breakdown import format_breakdown

        print(f"\nshm calls split into parts (median us per call and rank, {args.calls_per_sample} call(s) per "
              "barrier; rest = the exchange loop's Python and spinning; benchmarks/shm_breakdown.py):")
        print(format_breakdown(breakdown))
    gpu_rows: list[dict] | str
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        gpu_rows = _spawn(_gpu_worker, torch.cuda.device_count(), args.quick)
        print("\nGPU: GEMM throughput while the all-to-all-v runs")
        for r in gpu_rows:
            print(f"  {r['mode']:<32} {r['gemm_tflops']:8.1f} TFLOP/s  a2a {r['a2a_gbps']:7.1f} GB/s")
    else:
        gpu_rows = "not measured: needs CUDA (at least 2 CUDA devices)"
        print(f"\nGPU section: {gpu_rows}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench_alltoall.json")
        command = [sys.executable, "-m", "benchmarks.bench_alltoall", *(argv or sys.argv[1:])]
        payload = {"command": " ".join(command),
                   "cpu_count": os.cpu_count(), "load_average_1min": load_after[0],
                   "load_average_1min_before": load_before[0], "shm_config": shm_cfg,
                   "calls_per_sample": args.calls_per_sample, "steady_calls": args.steady,
                   "torch": torch.__version__,
                   "cpu": cpu_rows, "breakdown": breakdown, "gpu": gpu_rows}
        with open(path + ".tmp", "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(path + ".tmp", path)  # appears whole or not at all
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
