"""The GPU check's ``pipeline_cpu`` section: ``bench_pipeline`` on a GPU machine's CPUs, with idle cores.

The 2-core development machine cannot show what a spare core per rank does to the overlapped
``prioritized`` pipeline (its prefetch thread shares a core with the dense compute there); a lent
GPU machine has 16 cores. This runs :mod:`benchmarks.bench_pipeline` (2 gloo ranks, default
preset, the GPU hidden, 1 torch thread per rank) alternately on all cores (``all``) and with both
ranks pinned to cores 0-1 (``2cores``, the control on the same machine), and summarizes each run:
step ms per pipeline and the ratios docs/pipeline.md quotes.

torchrec is not on the GPU image. ``make gpu-check-wheels`` downloads the builds that match its
torch 2.11 (fbgemm-gpu-cpu 1.6.0, torchrec 1.6.1, tensordict, pyvers: ~8 MB) into the git-ignored
``gpu-check-wheels/``; this section installs them with ``pip --no-index --no-deps --target`` into
its work folder when torchrec cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEELS = REPO_ROOT / "gpu-check-wheels"
#: what ``make gpu-check-wheels`` downloads (cp312, manylinux x86-64): torch 2.11's matching builds
WHEEL_PINS = ("fbgemm-gpu-cpu==1.6.0", "torchrec==1.6.1", "tensordict==0.15.3", "pyvers==0.2.3")
PIPELINES = "plain,sparse-dist,prioritized-no-overlap,prioritized"
ORDER = ("all", "2cores", "all", "2cores", "all")  # alternated; the quick run keeps the first two


def summarize(result: dict) -> dict:
    """The ratios of one ``bench_pipeline`` JSON (its :func:`benchmarks.bench_pipeline.run` result).

    Returns:
        ``step_ms`` per pipeline, ``better_stock_ms`` (the better of plain and sparse-dist),
        ``prioritized_over_better_stock``, ``inline_over_better_stock``, ``inline_over_prioritized``,
        ``inline_exposed_over_sparse_dist`` and ``prioritized_exposed_over_sparse_dist``.

    Raises:
        KeyError: a pipeline of :data:`PIPELINES` is missing from ``result``.
    """
    p = result["pipelines"]
    best = min(p["plain"]["step_ms"], p["sparse-dist"]["step_ms"])
    inline, prio, sd = p["prioritized-no-overlap"], p["prioritized"], p["sparse-dist"]
    return {"step_ms": {k: round(v["step_ms"], 2) for k, v in p.items() if "step_ms" in v},
            "better_stock_ms": round(best, 2),
            "prioritized_over_better_stock": prio["step_ms"] / best,
            "inline_over_better_stock": inline["step_ms"] / best,
            "inline_over_prioritized": inline["step_ms"] / prio["step_ms"],
            "inline_exposed_over_sparse_dist": inline["exposed_comm_ms"] / sd["exposed_comm_ms"],
            "prioritized_exposed_over_sparse_dist": prio["exposed_comm_ms"] / sd["exposed_comm_ms"]}


def torchrec_path(work: Path) -> tuple[str | None, str | None]:
    """``(extra PYTHONPATH entry or None, reason it cannot run or None)``: torchrec as installed,
    else the wheels of ``gpu-check-wheels/`` installed under ``work/site``."""
    from benchmarks.gpu_check_torchrec import torchrec_missing

    if torchrec_missing() is None:
        return None, None
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return None, f"needs torchrec: run `make gpu-check-wheels` before the GPU is lent ({WHEELS.name}/ is empty)"
    site = work / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(site), *map(str, wheels)], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        return None, f"the wheels of {WHEELS.name}/ did not install: {lines[-1] if lines else proc.returncode}"
    return str(site), None


def run(work: Path, *, quick: bool, limit: float, dry_run: bool) -> dict:
    """Alternated ``bench_pipeline`` runs (see the module doc) within ``limit`` seconds.

    Returns:
        ``runs``: per run ``cores`` (``all`` / ``2cores``), ``cpu_count``, ``load_average_1m_before``,
        ``seconds`` and :func:`summarize`'s ratios, or ``error``; or ``skipped`` with the reason.
    """
    if dry_run:
        return {"skipped": "dry run: bench_pipeline runs on the GPU machine's CPUs"}
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 4:
        return {"skipped": "needs 4+ cores (2 ranks, each with a spare core)"}
    extra, why = torchrec_path(work)
    if why:
        return {"skipped": why}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    deadline = time.monotonic() + limit - 10
    runs: list[dict] = []
    for i, cores in enumerate(ORDER[:2] if quick else ORDER):
        left = deadline - time.monotonic()
        if left < 40:
            runs.append({"cores": cores, "skipped": "time limit"})
            continue
        out = work / f"bench-pipeline-{i}"
        cmd = [sys.executable, "-m", "benchmarks.bench_pipeline", "--pipelines", PIPELINES, "--out", str(out),
               *(["--quick"] if quick else [])]
        rec: dict = {"cores": cores, "cpu_count": os.cpu_count(), "load_average_1m_before": os.getloadavg()[0]}
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=left,
                                  preexec_fn=(lambda: os.sched_setaffinity(0, {0, 1})) if cores == "2cores" else None)
        except subprocess.TimeoutExpired:
            runs.append({**rec, "error": f"timed out after {left:.0f} s"})
            continue
        rec["seconds"] = round(time.monotonic() - t0, 1)
        if proc.returncode or not (out / "bench_pipeline.json").exists():
            lines = proc.stderr.strip().splitlines()
            runs.append({**rec, "error": f"exit {proc.returncode}: {lines[-1] if lines else ''}"})
            continue
        result = json.loads((out / "bench_pipeline.json").read_text())
        runs.append({**rec, "torchrec": result["machine"].get("torchrec"), **summarize(result)})
    return {"command": f"bench_pipeline --pipelines {PIPELINES}" + (" --quick" if quick else ""),
            "order": list(ORDER[:2] if quick else ORDER), "runs": runs}


def table(sec: dict) -> list[str]:
    """Markdown rows of :func:`run`'s result, one per run."""
    out = ["| run | cores | load before | prioritized / better stock | inline / better stock | inline / prioritized "
           "| exposed: prioritized / sparse-dist | inline / sparse-dist |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(sec["runs"]):
        if "prioritized_over_better_stock" not in r:
            out.append(f"| {i + 1} | {r['cores']} | | {r.get('error') or r.get('skipped')} | | | | |")
            continue
        out.append(f"| {i + 1} | {r['cores']} | {r['load_average_1m_before']:.2f} "
                   f"| {r['prioritized_over_better_stock']:.2f}x | {r['inline_over_better_stock']:.2f}x "
                   f"| {r['inline_over_prioritized']:.2f}x | {r['prioritized_exposed_over_sparse_dist']:.2f}x "
                   f"| {r['inline_exposed_over_sparse_dist']:.2f}x |")
    return out
