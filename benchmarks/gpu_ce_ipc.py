"""``cuda-ce`` between two processes sharing one GPU through CUDA IPC, equal byte for byte to a CPU reference.

Two processes on ``cuda:0`` form a gloo process group (NCCL refuses two ranks on one device) and
build :class:`fstrain.distributed.comm.CopyEngineBackend` on it with both ranks' GPU UUIDs (the
same GPU: no peer access needed, :func:`fstrain.distributed.comm.cuda_ce.copy_engine_reason`). Its
staging buffers are symmetric memory, mapped into the other process through CUDA IPC; the pulls
are ``cudaMemcpyAsync`` from the peer's mapping. Every case's output on every rank is compared
byte for byte with :func:`reference` computed on the CPU from the same seeded inputs (every rank
can generate every rank's input). A small staging buffer (1 MiB per rank) and 256 KiB chunks force
several rounds and interleaved pulls; the ``large`` case (about 40 MB per rank) goes through a
second transport with the default settings (256 MiB staging, 4 MiB chunks) and is timed (best of 3).

``--transport gloo`` runs the same harness on CPU tensors with gloo's ``all_to_all_single``
(what ``gpu_check --dry-run`` uses to check the harness without a GPU; the ``large`` case is left out).

Worker: ``python -m benchmarks.gpu_ce_ipc --rank R --world-size 2 --init FILE --out JSON --transport cuda-ce``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

#: (name, rows drawn below, dtype, trailing shape); seeded per case.
CASES = (("small-f32", 50, torch.float32, (8,)), ("empty-pair-i64", 5, torch.int64, ()),
         ("multi-round-bf16", 20_000, torch.bfloat16, (128,)), ("large-bf16", 20_000, torch.bfloat16, (1024,)))
TRANSPORTS = ("cuda-ce", "gloo")


def case_inputs(world_size: int, case_index: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``(m, inputs)``: ``m[p][q]`` rows rank ``p`` sends to rank ``q``; ``inputs[p]`` CPU ``[sum m[p] x ...]``."""
    name, rows_max, dtype, trailing = CASES[case_index]
    g = torch.Generator().manual_seed(1000 + case_index)
    m = torch.randint(0, rows_max, (world_size, world_size), generator=g)
    if name.startswith("large"):
        m = torch.full((world_size, world_size), rows_max)
    if name.startswith("empty"):
        m[0, -1] = 0  # an empty pair (rank 0 sends nothing to the last rank)
    inputs = []
    for p in range(world_size):
        x = torch.randn(int(m[p].sum()), *trailing, generator=g) * 100 + p
        inputs.append(x.to(dtype) if dtype.is_floating_point else x.round().to(dtype))
    return m.tolist(), inputs


def reference(m: list[list[int]], inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What ``rank`` receives from an all-to-all-v: rank ``p``'s rows for ``rank``, in rank order."""
    parts = []
    for p, x in enumerate(inputs):
        start = sum(m[p][:rank])
        parts.append(x[start:start + m[p][rank]])
    return torch.cat(parts)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN-safe: compares the raw bytes)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def worker(rank: int, world_size: int, init: str, transport: str) -> dict:
    """One rank: every case through ``transport``, compared with :func:`reference`."""
    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    res = {"rank": rank, "transport": transport, "cases": []}
    comm = None
    if transport == "cuda-ce":
        from torch.distributed import _symmetric_memory as symm_mem

        from fstrain.distributed.comm import CopyEngineBackend

        torch.cuda.set_device(0)
        if hasattr(symm_mem, "set_backend"):  # two processes on one GPU: CUDA IPC, not NVSHMEM (one PE per GPU)
            try:
                symm_mem.set_backend("CUDA")
            except Exception as e:  # noqa: BLE001 - recorded; the default backend is tried
                res["set_backend_error"] = f"{type(e).__name__}: {e}"
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        cfg = CopyEngineBackend.Config(buffer_bytes=world_size * (1 << 20), chunk_bytes=256 << 10)
        comm = CopyEngineBackend(dist.group.WORLD, config=cfg, peer_uuids=[uuid] * world_size)
        res.update(uses_copy_engines=comm.uses_copy_engines, fallback_reason=comm.fallback_reason,
                   device=torch.cuda.get_device_name(0), torch=torch.__version__)
        try:
            res["symm_mem_backend"] = str(symm_mem.get_backend(torch.device("cuda", 0)))
        except Exception as e:  # noqa: BLE001 - older torch: recorded as unknown
            res["symm_mem_backend"] = f"unknown ({type(e).__name__})"
        if not comm.uses_copy_engines:  # its NCCL fallback cannot run on gloo: nothing to compare
            dist.destroy_process_group()
            return res
    big = None  # the large case goes through the default settings (256 MiB staging, 4 MiB chunks)
    for i, (name, *_rest) in enumerate(CASES):
        if comm is None and name.startswith("large"):
            continue  # the timed case is for the GPU; on CPU it only costs memory
        m, inputs = case_inputs(world_size, i)
        want = reference(m, inputs, rank)
        in_splits, out_splits = m[rank], [m[p][rank] for p in range(world_size)]
        x = inputs[rank].cuda() if comm is not None else inputs[rank]
        use = comm
        if comm is not None and name.startswith("large"):
            try:
                big = big or CopyEngineBackend(dist.group.WORLD, config=CopyEngineBackend.Config(),
                                               peer_uuids=[uuid] * world_size)
                use = big if big.uses_copy_engines else comm
            except Exception as e:  # noqa: BLE001 - recorded; the small-buffer transport carries it
                res["default_config_error"] = f"{type(e).__name__}: {e}"
        times = []
        for _ in range(3 if name.startswith("large") else 1):  # the large case: best of 3 (first call warms up)
            if comm is not None:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            if use is not None:
                got = use.all_to_all_v(x, out_splits, in_splits)
                torch.cuda.synchronize()
            else:
                got = torch.empty_like(want)
                dist.all_to_all_single(got, x, out_splits, in_splits)
            times.append(time.perf_counter() - t0)
        row_bytes = want[:1].numel() * want.element_size()
        moved = sum(out_splits[p] for p in range(world_size) if p != rank) * row_bytes
        res["cases"].append({"case": name, "equal": same_bytes(got.cpu(), want), "bytes_received_from_peers": moved,
                             "seconds": min(times), "gb_per_second": moved / min(times) / 1e9,
                             "staging_bytes": None if use is None else use.config.buffer_bytes})
    dist.barrier()
    dist.destroy_process_group()
    return res


def run(work: Path, transport: str, world_size: int = 2, timeout: float = 240.0, env: dict | None = None) -> dict:
    """Start ``world_size`` worker processes and gather their results.

    Returns:
        JSON-ready dict: ``transport``, ``ranks`` (each worker's result, or its ``returncode`` and
        last stderr line), ``equal`` (every case on every rank byte-equal to the reference),
        ``uses_copy_engines`` (rank 0's; ``None`` for gloo), ``fallback_reason``.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
    work.mkdir(parents=True, exist_ok=True)
    init = work / f"ce-ipc-{transport}-init"
    init.unlink(missing_ok=True)
    outs = [work / f"ce-ipc-{transport}-rank{r}.json" for r in range(world_size)]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_ce_ipc", "--rank", str(r), "--world-size",
                               str(world_size), "--init", str(init), "--out", str(outs[r]), "--transport", transport],
                              env=env or dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world_size)]
    ranks = []
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = (err or "") + f"\ntimed out after {timeout:.0f} s"
        if p.returncode == 0 and outs[r].exists():
            ranks.append(json.loads(outs[r].read_text()))
        else:
            lines = [ln for ln in (err or "").strip().splitlines() if ln.strip()]
            ranks.append({"rank": r, "returncode": p.returncode, "error": lines[-1] if lines else "(no stderr)"})
    equal = all(r.get("cases") and all(c["equal"] for c in r["cases"]) for r in ranks)
    return {"transport": transport, "world_size": world_size, "ranks": ranks, "equal": equal,
            "uses_copy_engines": ranks[0].get("uses_copy_engines"), "fallback_reason": ranks[0].get("fallback_reason")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_ce_ipc", description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--init", required=True, help="rendezvous file (file:// init method)")
    p.add_argument("--out", required=True, help="this rank's result JSON")
    p.add_argument("--transport", choices=TRANSPORTS, default="cuda-ce")
    a = p.parse_args(argv)
    res = worker(a.rank, a.world_size, a.init, a.transport)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
