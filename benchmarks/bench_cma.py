"""Per-byte cost of a cross-memory read (``process_vm_readv``) against a local memcpy, two processes at once.

The single-copy path of the shared-memory all-to-all replaces two memcpys per byte (into a ring,
out of it) with one ``process_vm_readv``; it can only win if that read costs less than two
memcpys. Two processes (a fork) each time, in the same rounds, (a) a local copy of ``N`` MB
between two of their own buffers and (b) a read of ``N`` MB from the other process's buffer into
their own with ``process_vm_readv``, both processes at once as in a 2-rank all-to-all. Prints the
median milliseconds per process and the ratio read / memcpy, and (c) the same memcpy with the other
process idle (``memcpy_alone``): ``both/alone`` is how much two ranks copying at once slow each
other (the memory's ceiling for a 2-rank exchange); ``--out`` writes JSON.

Examples:
    python -m benchmarks.bench_cma --sizes-mb 1 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _measure(size: int, rounds: int, inp: int, outp: int, first: bool) -> dict[str, float]:
    from fstrain.distributed.comm.shm_cma import PeerReader

    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    mine, dst = src.copy(), np.zeros(size, np.uint8)
    os.write(outp, f"{src.ctypes.data:020d}|{os.getpid():010d}".encode())
    peer_addr, peer_pid = map(int, os.read(inp, 31).decode().split("|"))
    reader = PeerReader()
    times: dict[str, list[float]] = {"memcpy": [], "process_vm_readv": [], "memcpy_alone": []}
    for _ in range(rounds):
        for mode in times:
            os.write(outp, b"x")  # both processes start each copy together
            os.read(inp, 1)
            t = time.perf_counter()
            if mode == "process_vm_readv":
                reader.read(peer_pid, peer_addr, dst.ctypes.data, size)
            elif mode == "memcpy" or first:  # memcpy_alone: the peer does not copy
                dst[:] = mine
            times[mode].append(time.perf_counter() - t)
    os.write(outp, b"x")
    os.read(inp, 1)  # the peer's buffer stays alive until both are done
    return {mode: statistics.median(t) for mode, t in times.items()}


def run(size: int, rounds: int) -> dict:
    """Time both copies of ``size`` bytes in two processes at once; returns rank 0's medians (s)."""
    a2b, b2a = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _measure(size, rounds, a2b[0], b2a[1], False)
        finally:
            os._exit(0)
    try:
        medians = _measure(size, rounds, b2a[0], a2b[1], True)
    finally:
        os.waitpid(pid, 0)
    return {"bytes": size, "rounds": rounds, "memcpy_ms": medians["memcpy"] * 1e3,
            "process_vm_readv_ms": medians["process_vm_readv"] * 1e3,
            "ratio": medians["process_vm_readv"] / medians["memcpy"],
            "memcpy_alone_ms": medians["memcpy_alone"] * 1e3,
            "concurrent_over_alone": medians["memcpy"] / medians["memcpy_alone"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("Examples:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 8, 32], help="bytes per copy, MB")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per size (median)")
    parser.add_argument("--out", default=None, help="directory for bench_cma.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(s < 1 for s in args.sizes_mb):
        parser.error("--rounds and --sizes-mb must be >= 1")
    load_before = os.getloadavg()[0]
    rows = [run(s << 20, args.rounds) for s in args.sizes_mb]
    load_after = os.getloadavg()[0]
    print(f"two processes at once, median ms per process; 1-minute load average {load_before:.1f} before, "
          f"{load_after:.1f} after, {os.cpu_count()} cores")
    print(f"{'MB':>4} | {'memcpy ms':>10} {'process_vm_readv ms':>20} {'memcpy alone ms':>16} | "
          f"{'readv/memcpy':>12} {'both/alone':>10}")
    for r in rows:
        print(f"{r['bytes'] >> 20:>4} | {r['memcpy_ms']:>10.2f} {r['process_vm_readv_ms']:>20.2f} "
              f"{r['memcpy_alone_ms']:>16.2f} | {r['ratio']:>11.2f}x {r['concurrent_over_alone']:>9.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench_cma.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"command": " ".join([sys.executable, "-m", "benchmarks.bench_cma", *(argv or sys.argv[1:])]),
                       "load_average_1min_before": load_before, "load_average_1min": load_after,
                       "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
