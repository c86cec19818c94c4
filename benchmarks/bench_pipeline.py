"""Exposed communication per training step, with and without overlap (CPU, gloo or shm, 2 processes).

Trains the fstrain model with each pipeline of :mod:`fstrain.pipelines` on the same synthetic
batches (lognormal history lengths, Zipf-distributed item ids so consecutive batches share their
popular rows, as real sequence data does) and reports per step: wall time, compute (dense
forward + backward + optimizer) and exposed communication (the rest). ``pec`` is skipped where
it cannot run (CPU) and recorded with the reason.

Usage::

    python -m benchmarks.bench_pipeline --quick            # ~1 minute on 2 cores
    python -m benchmarks.bench_pipeline --out results/     # table on stdout + bench_pipeline.json
    python -m benchmarks.bench_pipeline --ranks 1          # no peer: each schedule's own CPU cost

Not a test: figures vary with the machine's load; they are recorded in docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import statistics
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from fstrain.models.config import Config

PIPELINES = ("plain", "sparse-dist", "prioritized-no-overlap", "prioritized", "pec")


def pipeline_config(name: str):
    """``prioritized-no-overlap`` is ``prioritized`` inline (``overlap=False``: 2 all-to-alls per step, main thread)."""
    from fstrain.pipelines import PipelineConfig

    if name == "prioritized-no-overlap":
        return PipelineConfig(name="prioritized", overlap=False)
    return PipelineConfig(name=name)


#: The benchmark's model: fstrain's :class:`~fstrain.models.config.Config` (every field not set here
#: keeps its default there), sized for a CPU run.
BENCH_MODEL = {"num_items": 200_000, "embedding_dim": 64, "num_layers": 2, "num_negatives": 256, "max_seq_len": 256}


def _model(**overrides) -> Config:
    return Config(**{**BENCH_MODEL, **overrides})


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """Sizes of one benchmark run: the model is fstrain's own config, the rest is the workload."""

    model: Config = field(default_factory=_model)
    """The model trained (:class:`fstrain.models.config.Config`; ``num_items`` rows in the item table,
    ``num_negatives`` shared negatives per step, histories capped at ``max_seq_len``)."""
    num_ranks: int = 2
    """Processes (gloo, one CPU thread each)."""
    num_steps: int = 30
    """Measured steps per pipeline."""
    num_warmup_steps: int = 5
    """Steps run before measuring (excluded)."""
    steps_per_round: int = 5
    """Pipelines take turns every this many steps (spreads machine-load drift evenly)."""
    batch_size_per_rank: int = 32
    """Samples per rank per step."""
    mean_length: float = 40.0
    """Mean history length (lognormal, sigma 0.8, capped at ``model.max_seq_len``)."""
    zipf_exponent: float = 1.1
    """Item popularity: ``P(rank k) ~ k^-zipf_exponent``."""


QUICK = BenchConfig(num_steps=10, num_warmup_steps=3, batch_size_per_rank=16, mean_length=24.0,
                    model=_model(num_items=50_000, embedding_dim=32, num_layers=1, num_negatives=64, max_seq_len=128))


def make_batches(cfg: BenchConfig, rank: int, num_steps: int, seed: int = 0) -> list:
    """Per-step batches of ``rank`` (with negatives), deterministic in ``(seed, step, rank)``."""
    from fstrain.data import make_batch
    from fstrain.models import with_negatives

    out = []
    for step in range(num_steps):
        rng = np.random.default_rng([seed, step, rank])
        B = cfg.batch_size_per_rank
        mu = np.log(cfg.mean_length) - 0.32  # lognormal mean = exp(mu + sigma^2 / 2), sigma = 0.8
        lengths = np.clip(rng.lognormal(mu, 0.8, B).astype(np.int64), 1, cfg.model.max_seq_len)
        ids = (rng.zipf(cfg.zipf_exponent, int(lengths.sum()) + B) - 1) % cfg.model.num_items
        batch = make_batch(ids[:-B], lengths, ids[-B:], np.arange(B) + step * B * cfg.num_ranks + rank * B, step,
                           B * cfg.num_ranks)
        out.append(with_negatives(batch, cfg.model.num_items, cfg.model.num_negatives, seed))
    return out


def cpu_clocks() -> dict[str, float]:
    """Seconds on this rank's clocks: wall, the process's CPU (every thread: main, the prefetch
    thread, gloo's), the main thread's CPU, and the machine's busy and total CPU time over all cores
    (``psutil.cpu_times``; absent without psutil)."""
    import time

    out = {"wall": time.perf_counter(), "process_cpu": time.process_time(), "main_thread_cpu": time.thread_time()}
    try:
        import psutil
    except ImportError:
        return out
    t = psutil.cpu_times()
    out["machine_total"] = sum(t)
    out["machine_busy"] = out["machine_total"] - t.idle - getattr(t, "iowait", 0.0)
    return out


def add_cpu(acc: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    """Add the clocks' advance from ``before`` to ``after`` into ``acc`` (seconds per key)."""
    for k in after:
        acc[k] = acc.get(k, 0.0) + after[k] - before[k]


def cpu_profile(per_rank_cpu: list[dict[str, float]], num_steps: int, num_cpus: int) -> dict:
    """Where a pipeline's CPU time went, per step (ms), from each rank's :func:`add_cpu` totals.

    Returns:
        ``wall_ms`` (the rank's own clock, mean over ranks), ``process_cpu_ms`` and
        ``main_thread_cpu_ms`` (means over ranks), ``other_threads_cpu_ms`` (their difference: the
        prefetch thread and the backend's threads), ``cores_busy`` (the ranks' CPU over their wall
        time, summed over ranks: 2.0 = both cores of a 2-core machine), and ``machine_busy_share``
        (the whole machine's non-idle share during these steps, rank 0's reading; None without
        psutil).
    """
    n = max(1, num_steps)
    mean = lambda k: 1e3 * statistics.fmean(c[k] for c in per_rank_cpu) / n  # noqa: E731
    r0 = per_rank_cpu[0]
    return {"wall_ms": mean("wall"), "process_cpu_ms": mean("process_cpu"),
            "main_thread_cpu_ms": mean("main_thread_cpu"),
            "other_threads_cpu_ms": mean("process_cpu") - mean("main_thread_cpu"),
            "cores_busy": sum(c["process_cpu"] / c["wall"] for c in per_rank_cpu if c["wall"] > 0),
            "machine_busy_share": (r0["machine_busy"] / r0["machine_total"]
                                   if r0.get("machine_total") else None), "num_cpus": num_cpus}


def _run_rank(rank: int, cfg: BenchConfig, names: list[str], port: int, out_dir: str, backend: str = "gloo") -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(cfg.num_ranks), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    logging.disable(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict = {}
    try:
        from fstrain.distributed.env import init_distributed
        from fstrain.distributed.optim import OptimConfig
        from fstrain.pipelines import PipelineUnavailableError, make_pipeline, model_builder, run_steps

        env = init_distributed(backend)
        total = cfg.num_warmup_steps + cfg.num_steps
        batches = make_batches(cfg, rank, total)
        pipes, iters = {}, {}
        for name in names:
            torch.manual_seed(0)
            pcfg = pipeline_config(name)
            dmp, opt = model_builder(pcfg.name)(cfg.model, OptimConfig(), env)  # pec: the PEC-wrapped table
            try:
                pipes[name] = make_pipeline(pcfg, dmp, opt, env.device)
            except PipelineUnavailableError as e:
                result[name] = {"skipped": str(e)}
                continue
            iters[name] = iter(batches)
            run_steps(pipes[name], iters[name], cfg.num_warmup_steps)
            result[name] = {"stats": []}
        # interleave the pipelines in rounds so that load from other processes hits all of them alike
        for start in range(0, cfg.num_steps, cfg.steps_per_round):
            for name, pipe in pipes.items():
                dist.barrier()
                before = cpu_clocks()
                outs = run_steps(pipe, iters[name], min(cfg.steps_per_round, cfg.num_steps - start))
                add_cpu(result[name].setdefault("cpu", {}), before, cpu_clocks())
                result[name]["stats"].extend(asdict(o.stats) for o in outs)
        for pipe in pipes.values():
            pipe.close()
        result = ("ok", result)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run(cfg: BenchConfig, names: list[str], backend: str = "gloo") -> dict:
    """Run every pipeline in ``names`` on ``cfg.num_ranks`` spawned processes, every collective of
    every pipeline on ``backend`` (``gloo``: torchrec's stock CPU path; ``shm``: fstrain's shared-memory
    all-to-all as the default process group, :func:`fstrain.distributed.env.init_distributed`).

    Returns:
        ``{"config", "machine", "pipelines": {name: summary}}``; a summary has ``step_ms`` (the
        slowest rank's step, averaged over steps), means over ranks and steps of
        ``compute_ms``, ``straggler_wait_ms`` and ``exposed_comm_ms`` (and its median), the
        exposed share of the step, ``phase_ms`` and, for ``prioritized``, the share of unique
        rows fetched ahead; or ``skipped`` with the reason.

    Raises:
        RuntimeError: a rank failed (its traceback in the message).
    """
    import torch.multiprocessing as mp

    load_at_start = os.getloadavg()[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_run_rank, args=(cfg, names, port, d, backend), nprocs=cfg.num_ranks,
                           start_method="spawn")
        per_rank = []
        for r in range(cfg.num_ranks):
            with open(os.path.join(d, f"{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r}: {value}")
            per_rank.append(value)
    summary = {}
    for name in names:
        if "skipped" in per_rank[0][name]:
            summary[name] = {"skipped": per_rank[0][name]["skipped"]}
            continue
        stats = [s for r in per_rank for s in r[name]["stats"]]
        # a step lasts as long as its slowest rank: take the max over ranks per step for wall time
        num_steps = len(per_rank[0][name]["stats"])
        steps = [max(r[name]["stats"][i]["step_seconds"] for r in per_rank) for i in range(num_steps)]
        ahead = sum(s["num_rows_ahead"] for s in stats)
        after = sum(s["num_rows_after_update"] for s in stats)
        summary[name] = {
            "num_steps": len(steps), "step_ms": 1e3 * statistics.fmean(steps),
            "compute_ms": 1e3 * statistics.fmean(s["compute_seconds"] for s in stats),
            "exposed_comm_ms": 1e3 * statistics.fmean(s["exposed_comm_seconds"] for s in stats),
            "straggler_wait_ms": 1e3 * statistics.fmean(s["straggler_wait_seconds"] for s in stats),
            "exposed_comm_ms_median": 1e3 * statistics.median(s["exposed_comm_seconds"] for s in stats),
            "exposed_share": sum(s["exposed_comm_seconds"] for s in stats) / sum(s["step_seconds"] for s in stats),
            "rows_ahead_share": ahead / (ahead + after) if ahead + after else None,
            "phase_ms": {k: 1e3 * sum(s["phase_seconds"].get(k, 0.0) for s in stats) / len(stats)
                         for k in sorted({k for s in stats for k in s["phase_seconds"]})},
            "cpu": cpu_profile([r[name]["cpu"] for r in per_rank], num_steps, os.cpu_count() or 1),
        }
    import torch
    import torchrec

    machine = {"cpu_count": os.cpu_count(), "load_average_1m_at_start": load_at_start,
               "load_average_1m_at_end": os.getloadavg()[0],
               "torch": torch.__version__, "torchrec": torchrec.__version__, "backend": backend}
    return {"config": asdict(cfg), "machine": machine, "pipelines": summary,
            "idle_core_estimate": idle_core_estimate(summary)}


def idle_core_estimate(summary: dict) -> dict | None:
    """How far ``prioritized`` can go on this machine, from this run's figures (estimates, not measurements).

    * ``step_ms``: its step less the compute its prefetch thread took from the main thread's core
      (overlapped compute minus the inline control's compute, at least 0): an idle core for that thread.
    * ``floor_ms``: its CPU time per step (every thread of the rank) plus its straggler wait. With one
      core per rank, no schedule of the same work is shorter: overlap hides waiting, not CPU time.
    * ``idle_core_floor_ms``: the main thread's CPU time plus the straggler wait: the floor when the
      prefetch thread (and the backend's threads) run on a core of their own. A lower bound, not a
      forecast: it leaves out the dense compute slowed beside the busy prefetch thread (1.5-2.3 ms per
      step measured with ``--ranks 1`` on a 2-core VM) and the main thread's waiting for the peer in the
      step-boundary all-to-alls (docs/results/bench_pipeline.md).

    Returns:
        those three with ``compute_inflation_ms`` and each ratio to the better of ``plain`` and
        ``sparse-dist`` (``*_over_better_stock``), or None when a pipeline it needs did not run.
    """
    need = ("prioritized", "prioritized-no-overlap")
    stock = [summary[n]["step_ms"] for n in ("plain", "sparse-dist") if "step_ms" in summary.get(n, {})]
    if not stock or any("step_ms" not in summary.get(n, {}) for n in need):
        return None
    p = summary["prioritized"]
    inflation = max(0.0, p["compute_ms"] - summary["prioritized-no-overlap"]["compute_ms"])
    out = {"step_ms": p["step_ms"] - inflation, "compute_inflation_ms": inflation}
    if "cpu" in p:
        out["floor_ms"] = p["cpu"]["process_cpu_ms"] + p["straggler_wait_ms"]
        out["idle_core_floor_ms"] = p["cpu"]["main_thread_cpu_ms"] + p["straggler_wait_ms"]
    for k in ("step_ms", "floor_ms", "idle_core_floor_ms"):
        if k in out:
            out[k.replace("_ms", "_over_better_stock")] = out[k] / min(stock)
    return out


def format_table(result: dict) -> str:
    """Markdown table of :func:`run`'s summary."""
    lines = ["| pipeline | step ms | compute ms | straggler wait ms | exposed comm ms (median) | exposed share "
             "| rows ahead |", "|---|---|---|---|---|---|---|"]
    for name, s in result["pipelines"].items():
        if "skipped" in s:
            lines.append(f"| {name} | not run: {s['skipped']} | | | | | |")
            continue
        ahead = "-" if s["rows_ahead_share"] is None else f"{100 * s['rows_ahead_share']:.0f}%"
        lines.append(f"| {name} | {s['step_ms']:.1f} | {s['compute_ms']:.1f} | {s['straggler_wait_ms']:.1f} "
                     f"| {s['exposed_comm_ms']:.1f} "
                     f"({s['exposed_comm_ms_median']:.1f}) | {100 * s['exposed_share']:.0f}% | {ahead} |")
    lines += ["", "| pipeline | rank wall ms | process CPU ms | main thread CPU ms | other threads CPU ms "
              "| cores busy (ranks) | machine busy |", "|---|---|---|---|---|---|---|"]
    for name, s in result["pipelines"].items():
        c = s.get("cpu")
        if c:
            busy = "-" if c["machine_busy_share"] is None else f"{100 * c['machine_busy_share']:.0f}%"
            lines.append(f"| {name} | {c['wall_ms']:.1f} | {c['process_cpu_ms']:.1f} | {c['main_thread_cpu_ms']:.1f} "
                         f"| {c['other_threads_cpu_ms']:.1f} | {c['cores_busy']:.2f} of {c['num_cpus']} | {busy} |")
    est = result.get("idle_core_estimate")
    if est:
        lines.append(f"\nidle core for the prefetch thread (estimate): prioritized step {est['step_ms']:.1f} ms "
                     f"(compute inflation {est['compute_inflation_ms']:.1f} ms removed), "
                     f"{est['step_over_better_stock']:.2f}x the better of plain and sparse-dist")
        if "floor_ms" in est:
            lines.append(f"prioritized floor on this machine (CPU per step + straggler wait) {est['floor_ms']:.1f} ms "
                         f"= {est['floor_over_better_stock']:.2f}x the better stock step; with an idle core for its "
                         f"other threads (main-thread CPU + wait) {est['idle_core_floor_ms']:.1f} ms "
                         f"= {est['idle_core_floor_over_better_stock']:.2f}x (a lower bound: compute slowed beside "
                         "the busy thread and the step-boundary waiting are left out; --ranks 1 measures the first)")
    for name, s in result["pipelines"].items():
        if s.get("phase_ms"):
            phases = ", ".join(f"{k} {v:.1f}" for k, v in s["phase_ms"].items())
            lines.append(f"\n{name} phases, ms per step: {phases}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_pipeline", description=__doc__.split("\n")[0],
                                     epilog="example: python -m benchmarks.bench_pipeline --quick --out /tmp/bench")
    parser.add_argument("--quick", action="store_true", help="small model and few steps (~1 minute)")
    parser.add_argument("--out", help="folder for bench_pipeline.json (written atomically)")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help="comma-separated names (default: all)")
    parser.add_argument("--steps", type=int, help="measured steps per pipeline (overrides the preset)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "shm"],
                        help="every pipeline's collectives on gloo (default, torchrec's stock CPU path) or on "
                             "fstrain's shared-memory all-to-all (--backend shm of fstrain train)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="processes (default 2); 1 runs every schedule with no peer, its prefetch thread on a "
                             "core of its own on a 2-core machine: the schedules' own CPU cost, nothing to hide")
    args = parser.parse_args(argv)
    names = [n for n in args.pipelines.split(",") if n]
    unknown = sorted(set(names) - set(PIPELINES))
    if unknown:
        parser.error(f"unknown pipelines {unknown}; choose from {', '.join(PIPELINES)}")
    cfg = QUICK if args.quick else BenchConfig()
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        cfg = replace(cfg, num_steps=args.steps)
    if args.ranks is not None:
        if args.ranks < 1:
            parser.error(f"--ranks must be >= 1, got {args.ranks}")
        cfg = replace(cfg, num_ranks=args.ranks)
    result = run(cfg, names, args.backend)
    print(format_table(result))
    if args.out:
        from fstrain.components.metrics import write_json

        path = os.path.join(args.out, "bench_pipeline.json")
        write_json(result, path)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["BenchConfig", "QUICK", "make_batches", "run", "format_table", "cpu_clocks", "add_cpu", "cpu_profile",
           "idle_core_estimate", "main"]
