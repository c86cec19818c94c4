"""Where a shared-memory all-to-all call spends its time (``bench_alltoall --breakdown``).

Each rank times its own ``ShmBackend.all_to_all_v`` calls (K back to back after each barrier, as
``--calls-per-sample``) with the transport's steps wrapped by timers, and splits every call into:

* ``outside``: the call's Python before and after the exchange loop (split checks, the lock,
  output checks: :meth:`ShmBackend.all_to_all_v` less ``_exchange``);
* ``compiled``: the compiled exchange (:mod:`fstrain.distributed.comm.shm_fast`; every call whose
  messages are one ring chunk or a single-copy pull each, i.e. every call with the default settings
  where single copy runs): its copies, pulls, counters, the doorbells it rings (only for a peer that
  announced it may sleep) and spinning for up to ``spin_us`` while the peer's chunk has not arrived;
* ``copies``: bytes moved by the Python loop (calls with a message of several ring chunks): the own
  rows, ring copy-in and copy-out (``memmove``) and single-copy reads (``process_vm_readv``);
* ``doorbell``: the Python loop's FIFO writes that wake a waiting peer (one system call each; 0 on the
  compiled path, which rings inside ``compiled``);
* ``sleep``: blocked in ``poll()`` on this rank's doorbell (after ``spin_us`` of spinning), the
  liveness check after it, and announcing the sleep to the peers first;
* ``rest``: the rest of the exchange's Python (the compiled path's driver, or the Python loop's
  set-up, headers and counters) plus spinning there while the peer's chunk or acknowledgement has not
  arrived: with one rank there is nothing to wait for, so the one-rank row's ``rest`` is pure Python.

The wrappers add about 1 us per wrapped call (a few per exchange); compare a call's total here with
the same size's figure in the timing table of the same run, not across machines. The split is per
rank (median over calls of each part; the parts' medians need not add up to the call's median).
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.bench_alltoall import _ROW_FLOATS, _fmt_bytes

PARTS = ("outside", "copies", "compiled", "doorbell", "sleep", "rest")


def _iterations(size_bytes: int, quick: bool) -> int:
    n = 100 if size_bytes <= 1 << 20 else 20
    return max(5, n // 5) if quick else n


def breakdown_worker(rank: int, world_size: int, init_file: str, sizes: list[int], quick: bool, shm_cfg: dict,
                     calls: int, result_path: str) -> None:
    """One rank: per size, the median microseconds of each part of a call (rows written by rank 0)."""
    import fstrain.distributed.comm.shm as shm_mod
    import fstrain.distributed.comm.shm_fast as fast_mod
    from fstrain.distributed.comm import CommConfig, ShmBackend, build_backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    shm = build_backend(CommConfig(backend="shm", shm=ShmBackend.Config(**shm_cfg)))
    assert isinstance(shm, ShmBackend)
    acc = dict.fromkeys(("exchange", "copies", "compiled", "doorbell", "sleep"), 0.0)
    clock = time.perf_counter

    def timed(fn, part):
        def wrapper(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[part] += clock() - t0
        return wrapper

    memmove = shm_mod._memmove
    step = fast_mod.exchange_step
    shm_mod._memmove = timed(memmove, "copies")  # the module global the exchange loop calls
    fast_mod.exchange_step = timed(step, "compiled")  # likewise for the small-message path
    shm._exchange = timed(shm._exchange, "exchange")  # type: ignore[method-assign]
    shm._ring = timed(shm._ring, "doorbell")  # type: ignore[method-assign]
    shm._stall = timed(shm._stall, "sleep")  # type: ignore[method-assign]
    if shm._reader is not None:
        shm._reader.pull = timed(shm._reader.pull, "copies")  # type: ignore[method-assign]
    rows = []
    try:
        for size in sizes:
            per_peer = max(1, size // (_ROW_FLOATS * 4 * world_size))
            splits = [per_peer] * world_size
            x = torch.randn(per_peer * world_size, _ROW_FLOATS)
            out = torch.empty_like(x)
            parts: dict[str, list[float]] = {p: [] for p in ("call", *PARTS)}
            for i in range(2 + _iterations(size, quick)):
                dist.barrier()
                for _ in range(calls):
                    for k in acc:
                        acc[k] = 0.0
                    t0 = clock()
                    shm.all_to_all_v(x, splits, splits, out=out)
                    total = clock() - t0
                    if i < 2:  # warm-up
                        continue
                    us = {k: v * 1e6 for k, v in acc.items()}
                    parts["call"].append(total * 1e6)
                    parts["outside"].append(total * 1e6 - us["exchange"])
                    timed_parts = ("copies", "compiled", "doorbell", "sleep")
                    for k in timed_parts:
                        parts[k].append(us[k])
                    parts["rest"].append(us["exchange"] - sum(us[k] for k in timed_parts))
            rows.append({"backend": "shm-breakdown", "world_size": world_size, "rank": rank,
                         "bytes_per_rank": x.numel() * 4, "calls_per_sample": calls, "calls": len(parts["call"]),
                         "data_path": shm.data_path,
                         "median_us": {k: statistics.median(v) for k, v in parts.items()}})
    finally:
        shm_mod._memmove, fast_mod.exchange_step = memmove, step
        shm.close()
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump([r for rank_rows in gathered for r in rank_rows], f)
    dist.destroy_process_group()


def format_breakdown(rows: list[dict]) -> str:
    """The table ``bench_alltoall --breakdown`` prints: one line per world size, size and rank."""
    head = (f"{'ranks':>5} {'bytes/rank':>10} {'rank':>4} | {'call us':>8} | "
            + " ".join(f"{p + ' us':>11}" for p in PARTS))
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["bytes_per_rank"], r["rank"])):
        m = r["median_us"]
        lines.append(f"{r['world_size']:>5} {_fmt_bytes(r['bytes_per_rank']):>10} {r['rank']:>4} | {m['call']:>8.1f} | "
                     + " ".join(f"{m[p]:>11.1f}" for p in PARTS))
    return "\n".join(lines)
