"""``fsdata balance --engine local`` vs ``--engine ray`` on generated inputs of growing size.

Usage::

    python -m benchmarks.bench_engines [--sizes 1000000,5000000,20000000] [--work DIR] [--out DIR]
        [--ranks 256] [--batch-size-per-rank 32] [--max-seq-len 64] [--ray-cpus 2]
        [--object-store-mb 2048]

For each size: generates the input once (``fsdata synth``, lengths resampled from MovieLens-1M
per-event lengths capped at ``--max-seq-len``, as ``bench_e2e``), then, side by side in one run:

* ``local``: ``fsdata balance INPUT OUT --engine local`` in a child process;
* ``ray``: a real Ray cluster started for the run (``ray start --head --num-cpus N
  --object-store-memory M`` with its own temp dir), then ``fsdata balance ... --engine ray
  --ray-address HEAD``; the cluster is stopped after (its processes, by pid).

Measured: wall seconds of the command; peak resident memory of every process involved (sampled
every 0.2 s with psutil: the CLI process and its children, and for Ray every process of the
cluster: GCS, raylet with the object store, workers), reported as the largest process and the
largest Ray worker; bytes spilled by Ray (``ray memory --stats-only`` before the cluster stops,
and the peak size of the spill folder); and whether the two outputs are byte-identical (SHA-256
of every file). Prints a table and writes ``OUT/bench_engines.json``.

``--engines copy,local`` (the offline stage against the I/O floor, docs/results/bench_offline_stage.md)
instead alternates, ``--rounds`` times per size in one run with the input in the page cache, a
Polars copy of the input (``pl.scan_parquet(INPUT).sink_parquet(OUT)``) and ``fsdata balance
--engine local``, and records the 1-minute load average before each round: a round starting above
``--max-load`` is marked and not used for the ratio of record (:mod:`benchmarks.bench_offline_stage`;
``--quick``: a tiny run). Writes ``OUT/bench_offline_stage.json``.

``--engines reshard`` (docs/results/bench_reshard.md) times ``fsdata balance OLD NEW --ranks R/2
--from-step 0`` (OLD: the input balanced for ``--ranks``) against ``fsdata balance INPUT NEW --ranks
R/2`` from the samples' Parquet, ``--rounds`` times, the order alternating each round and each run
after the load settles (as ``copy,local``; a round with either run above ``--max-load`` is marked and
left out of ``ratio_of_record``, the median of the unmarked rounds' ratios); writes
``OUT/bench_reshard.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks import bench_offline_stage as offline_stage

DATASETS = Path(os.environ.get("FREESCALE_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
REPO_ROOT = Path(__file__).resolve().parents[1]


class Sampler:
    """Peak RSS per process of a process tree plus every process whose command line names ``marker``."""

    def __init__(self, root_pid: int, marker: str | None = None, spill_root: Path | None = None,
                 interval: float = 0.2) -> None:
        self.root_pid, self.marker, self.spill_root, self.interval = root_pid, marker, spill_root, interval
        self.peak: dict[int, tuple[int, str]] = {}
        self.peak_private: dict[int, tuple[int, str]] = {}
        self.peak_spill_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _procs(self) -> list[psutil.Process]:
        procs: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.root_pid)
            procs[root.pid] = root
            for c in root.children(recursive=True):
                procs[c.pid] = c
        except psutil.NoSuchProcess:
            pass
        if self.marker:  # the cluster's daemons name the temp dir; its workers are the raylet's children
            for p in psutil.process_iter(["cmdline"]):
                if any(self.marker in a for a in (p.info["cmdline"] or [])):
                    procs[p.pid] = p
                    try:
                        for c in p.children(recursive=True):
                            procs[c.pid] = c
                    except psutil.NoSuchProcess:
                        pass
        return list(procs.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self._procs():
                try:
                    mi = p.memory_info()
                    cmd = p.cmdline()
                    name = cmd[0] if cmd and cmd[0].startswith("ray::") else p.name()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if mi.rss > self.peak.get(p.pid, (0, ""))[0]:
                    self.peak[p.pid] = (mi.rss, name)
                private = mi.rss - mi.shared  # without shared pages (the Ray object store is shared memory)
                if private > self.peak_private.get(p.pid, (0, ""))[0]:
                    self.peak_private[p.pid] = (private, name)
            if self.spill_root is not None:
                total = 0
                for d in self.spill_root.glob("session_*/ray_spilled_objects*"):
                    for f in d.rglob("*"):
                        try:
                            total += f.stat().st_size
                        except OSError:
                            pass
                self.peak_spill_bytes = max(self.peak_spill_bytes, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        procs = sorted(self.peak.values(), reverse=True)
        private = sorted(self.peak_private.values(), reverse=True)
        workers = [r for r, n in private if n.startswith("ray::")]
        return {"num_processes": len(procs),
                "driver_peak_rss_bytes": self.peak.get(self.root_pid, (0, ""))[0],
                "driver_peak_private_bytes": self.peak_private.get(self.root_pid, (0, ""))[0],
                "max_process_rss_bytes": procs[0][0] if procs else 0,
                "max_process_name": procs[0][1] if procs else "",
                "max_process_private_bytes": private[0][0] if private else 0,
                "max_private_process_name": private[0][1] if private else "",
                "max_ray_worker_private_bytes": max(workers) if workers else None,
                "top_processes_rss": [{"name": n, "peak_rss_bytes": r} for r, n in procs[:6]],
                "top_processes_private": [{"name": n, "peak_private_bytes": r} for r, n in private[:6]]}


def digests(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` by relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while b := f.read(1 << 22):
                    h.update(b)
            out[str(p.relative_to(root))] = h.hexdigest()
    return out


def run_measured(cmd: list[str], env: dict, marker: str | None = None, spill_root: Path | None = None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with Sampler(proc.pid, marker, spill_root) as s:
        out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.strip()[-1500:]}")
    stages = json.loads(out).get("stage_seconds", {})
    return {"wall_seconds": wall, "stage_seconds": stages, **s.summary(), "peak_spill_dir_bytes": s.peak_spill_bytes}


def stop_cluster(marker: str) -> None:
    """End every process whose command line names ``marker`` (this run's Ray temp dir), by pid."""
    procs = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in a for a in (p.info["cmdline"] or [])):
            procs[p.pid] = p
            for c in p.children(recursive=True):
                procs[c.pid] = c
    procs.pop(os.getpid(), None)
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=20)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def spilled_from_ray_memory(ray_bin: str, addr: str, env: dict) -> dict:
    r = subprocess.run([ray_bin, "memory", "--stats-only", f"--address={addr}"], env=env, capture_output=True,
                       text=True, timeout=120)
    text = r.stdout + r.stderr
    m = re.search(r"Spilled\s+([\d.]+)\s+MiB,\s+(\d+)\s+objects", text)
    restored = re.search(r"Restored\s+([\d.]+)\s+MiB,\s+(\d+)\s+objects", text)
    return {"spilled_mib": float(m.group(1)) if m else 0.0, "spilled_objects": int(m.group(2)) if m else 0,
            "restored_mib": float(restored.group(1)) if restored else 0.0, "ray_memory_ok": r.returncode == 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_size(n: int, a: argparse.Namespace, work: Path) -> dict:
    py = sys.executable
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    inp = work / f"synth-{n}-L{a.max_seq_len}.parquet"
    if not inp.exists():
        subprocess.run([py, "-m", "fsdata", "synth", str(inp), "--num-samples", str(n), "--lengths-from",
                        a.lengths_from, "--layout", "event", "--max-seq-len", str(a.max_seq_len), "--no-progress"],
                       check=True, env=env)
    common = [str(inp), "--ranks", str(a.ranks), "--batch-size-per-rank", str(a.batch_size_per_rank),
              "--no-progress", "--json", "--overwrite", "--bucket-compression", a.bucket_compression,
              *(["--plan-window", str(a.plan_window)] if a.plan_window else [])]
    row: dict = {"num_samples": n, "input_bytes": inp.stat().st_size}
    out_local, out_ray = work / f"out-local-{n}", work / f"out-ray-{n}"
    with_local = "local" in a.engines.split(",")
    if with_local:
        row["local"] = run_measured([py, "-m", "fsdata", "balance", common[0], str(out_local), *common[1:],
                                     "--engine", "local", "--num-threads", str(a.ray_cpus)], env)
        print(f"  {n:,} local: {row['local']['wall_seconds']:.1f} s", flush=True)
    ray_bin = str(Path(py).with_name("ray"))
    temp_dir = tempfile.mkdtemp(prefix="fsbe-", dir="/tmp")
    port = free_port()
    addr = f"127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--include-dashboard=false",
                        f"--temp-dir={temp_dir}", f"--num-cpus={a.ray_cpus}",
                        f"--object-store-memory={a.object_store_mb * 1024 * 1024}", "--disable-usage-stats"],
                       env=env, check=True, capture_output=True, timeout=300)
        row["ray_cluster_start_seconds"] = time.perf_counter() - t0
        row["ray"] = run_measured([py, "-m", "fsdata", "balance", common[0], str(out_ray), *common[1:],
                                   "--engine", "ray", "--ray-address", addr], env, marker=temp_dir,
                                  spill_root=Path(temp_dir))
        row["ray"].update(spilled_from_ray_memory(ray_bin, addr, env))
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(f"  {n:,} ray:   {row['ray']['wall_seconds']:.1f} s", flush=True)
    if with_local:
        da, db = digests(out_local), digests(out_ray)
        row["byte_identical"] = da == db
        row["num_files_compared"] = len(da)
        row["ray_over_local_wall"] = row["ray"]["wall_seconds"] / row["local"]["wall_seconds"]
    if not a.keep_outputs:
        shutil.rmtree(out_local, ignore_errors=True)
        shutil.rmtree(out_ray, ignore_errors=True)
    return row


def bench_reshard(n: int, a: argparse.Namespace, work: Path) -> dict:
    """``--engines reshard``: ``fsdata balance OLD NEW --ranks R/2 --from-step S`` (OLD: the input
    balanced for ``--ranks``, not timed) against ``fsdata balance INPUT --ranks R/2`` on the samples'
    Parquet, alternated ``--rounds`` times, local engine, each in a child process (wall seconds,
    stage seconds, peak memory). S = 0 plans every sample of OLD, as many as the direct run."""
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    inp = work / f"synth-{n}-L{a.max_seq_len}.parquet"
    if not inp.exists():
        subprocess.run([py, "-m", "fsdata", "synth", str(inp), "--num-samples", str(n), "--lengths-from",
                        a.lengths_from, "--layout", "event", "--max-seq-len", str(a.max_seq_len), "--no-progress"],
                       check=True, env=env)
    old = work / f"reshard-old-{n}"
    flags = ["--batch-size-per-rank", str(a.batch_size_per_rank), "--no-progress", "--json", "--overwrite",
             "--cost-model", a.cost_model, "--num-threads", str(a.ray_cpus)]
    if not old.exists():
        subprocess.run([py, "-m", "fsdata", "balance", str(inp), str(old), "--ranks", str(a.ranks), *flags],
                       check=True, env=env, capture_output=True)
    new_ranks = max(1, a.ranks // 2)
    row: dict = {"num_samples": n, "old_ranks": a.ranks, "new_ranks": new_ranks, "from_step": 0, "rounds": []}
    runs: tuple[tuple[str, Path, list[str]], ...] = (("balance", inp, []), ("reshard", old, ["--from-step", "0"]))
    for i in range(a.rounds):
        r: dict = {"order": []}
        # the order alternates (balance first in odd rounds, reshard first in even ones): neither run
        # always starts at the load its predecessor left; each waits for --max-load first
        for name, src, extra in (runs if i % 2 == 0 else runs[::-1]):
            out = work / f"reshard-{name}-{n}"
            before = offline_stage.settle(a.max_load, a.settle_seconds)
            r["order"].append(name)
            r[f"{name}_load_average_before"] = os.getloadavg()  # a shared machine: how loaded each run started
            r[f"{name}_settle_seconds"] = before["settle_seconds"]
            r[f"{name}_loaded"] = before["load_average_1m"] > a.max_load
            r[name] = run_measured([py, "-m", "fsdata", "balance", str(src), str(out), "--ranks", str(new_ranks),
                                    *flags, *extra], env)
            shutil.rmtree(out, ignore_errors=True)
        r["reshard_over_balance_wall"] = r["reshard"]["wall_seconds"] / r["balance"]["wall_seconds"]
        r["loaded"] = r["balance_loaded"] or r["reshard_loaded"]
        row["rounds"].append(r)
        print(f"  {n:,} round {i + 1} ({' then '.join(r['order'])}): balance {r['balance']['wall_seconds']:.1f} s, "
              f"reshard {r['reshard']['wall_seconds']:.1f} s{' (loaded)' if r['loaded'] else ''}", flush=True)
    walls = {k: statistics.median(r[k]["wall_seconds"] for r in row["rounds"]) for k in ("balance", "reshard")}
    quiet = [r["reshard_over_balance_wall"] for r in row["rounds"] if not r["loaded"]]
    row.update(median_wall_seconds=walls, reshard_over_balance_wall=walls["reshard"] / walls["balance"],
               max_load=a.max_load, quiet_rounds=len(quiet),
               # the median of the per-round ratios over rounds whose two runs both started at most --max-load
               ratio_of_record=statistics.median(quiet) if len(quiet) >= a.min_quiet_rounds else None)
    if not a.keep_outputs:
        shutil.rmtree(old, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000000,5000000,20000000", help="comma-separated sample counts")
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--batch-size-per-rank", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=64)
    p.add_argument("--lengths-from", default=str(DATASETS / "ml-1m_ensfm" / "sequences.txt"))
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 2,
                   help="CPUs of the Ray node, and threads of the local engine (--num-threads)")
    p.add_argument("--object-store-mb", type=int, default=8192,
                   help="Ray object store size (MiB; Ray's own default is 30%% of the memory, ~7 GiB on a 24 GiB "
                        "machine; the 20M input's rows take ~4.9 GB as held)")
    p.add_argument("--work", default="bench-output/engines-work")
    p.add_argument("--out", default="bench-output")
    p.add_argument("--bucket-compression", default="zstd", choices=["none", "lz4", "zstd"],
                   help="passed to both engines (local: temporary buckets; ray: object-store pieces when "
                        "they would not fit 75%% of the store); default: fsdata's (zstd)")
    p.add_argument("--keep-outputs", action="store_true")
    p.add_argument("--plan-window", type=int, default=None,
                   help="--plan-window K passed to both engines (default: fsdata's)")
    p.add_argument("--engines", default="local,ray", choices=["local,ray", "ray", "copy,local", "reshard"],
                   help="local,ray (both: byte identity checked), ray, copy,local (against a Polars copy), or "
                        "reshard (balance OLD --from-step against balance from the samples' Parquet)")
    p.add_argument("--rounds", type=int, default=3, help="copy,local: copy and balance alternated this many times")
    p.add_argument("--max-load", type=float, default=0.5,
                   help="copy,local and reshard: a round whose 1-minute load average before it (reshard: before "
                        "either run) exceeds this is marked and left out of the ratio of record (default 0.5, for a "
                        "2-core machine)")
    p.add_argument("--settle-seconds", type=float, default=180.0,
                   help="copy,local: before each round, reshard: before each run, wait up to this long for the "
                        "load average to fall to --max-load (default 180)")
    p.add_argument("--min-quiet-rounds", type=int, default=3,
                   help="copy,local and reshard: unmarked rounds needed for a ratio of record (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="copy,local: a tiny run that exercises every part (%s where not given)"
                        % ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in offline_stage.QUICK.items()))
    p.add_argument("--cost-model", default="quadratic", help="copy,local: --cost-model (default L^2 + 64L)")
    p.add_argument("--keep-input", action="store_true", help="copy,local: keep the generated inputs")
    a = p.parse_args(argv)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if a.engines == "reshard":  # fsdata balance OLD NEW --from-step against balance from the samples' Parquet
        rows = [bench_reshard(int(x), a, work) for x in a.sizes.split(",") if x]
        (out / "bench_reshard.json").write_text(json.dumps(
            {"settings": vars(a), "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
             "results": rows}, indent=2) + "\n")
        for r in rows:
            print(f"{r['num_samples']:>11,} R {r['old_ranks']} -> {r['new_ranks']}: balance "
                  f"{r['median_wall_seconds']['balance']:.1f} s, reshard {r['median_wall_seconds']['reshard']:.1f} s "
                  f"({r['reshard_over_balance_wall']:.2f}x on medians); ratio of record "
                  + (f"{r['ratio_of_record']:.3f} over {r['quiet_rounds']} quiet rounds" if r["ratio_of_record"]
                     else f"none ({r['quiet_rounds']} rounds started at most --max-load {a.max_load})"))
        print(f"JSON: {out / 'bench_reshard.json'}")
        return 0
    if a.engines == "copy,local":
        given = {act.dest for act in p._actions
                 if any(x == o or x.startswith(o + "=") for o in act.option_strings for x in argv)}
        return offline_stage.run(a, given)
    rows = []
    json_path = out / ("bench_engines.json" if a.bucket_compression == "zstd" else
                       f"bench_engines-{a.bucket_compression}.json")
    for n in [int(x) for x in a.sizes.split(",") if x]:
        rows.append(bench_size(n, a, work))
        json_path.write_text(json.dumps({"settings": vars(a), "results": rows}, indent=2) + "\n")
    gib = 1024**3
    print(f"\nfsdata balance, R={a.ranks} B={a.batch_size_per_rank}, max_seq_len {a.max_seq_len}, "
          f"{a.ray_cpus} CPUs, object store {a.object_store_mb} MiB, bucket compression {a.bucket_compression}")
    print("GiB columns: peak resident memory of the largest process (rss), and without shared pages (private:")
    print("the object store is shared memory, mapped by the raylet and every worker that touched it)")
    print(f"{'samples':>11} {'local s':>8} {'ray s':>8} {'ray/local':>9} {'local rss':>9} {'ray rss':>8} "
          f"{'ray private':>11} {'worker private':>14} {'driver private':>14} {'spilled MiB':>11} {'identical':>9}")
    na = float("nan")
    for r in rows:
        lw = r["ray"]["max_ray_worker_private_bytes"]
        loc = r.get("local", {})
        print(f"{r['num_samples']:>11,} {loc.get('wall_seconds', na):>8.1f} {r['ray']['wall_seconds']:>8.1f} "
              f"{r.get('ray_over_local_wall', na):>9.2f} {loc.get('max_process_rss_bytes', na) / gib:>9.2f} "
              f"{r['ray']['max_process_rss_bytes'] / gib:>8.2f} {r['ray']['max_process_private_bytes'] / gib:>11.2f} "
              f"{(lw or 0) / gib:>14.2f} {r['ray']['driver_peak_private_bytes'] / gib:>14.2f} "
              f"{r['ray']['spilled_mib']:>11.0f} {str(r.get('byte_identical', '-')):>9}")
    print(f"JSON: {json_path}")
    return 0 if all(r.get("byte_identical", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
