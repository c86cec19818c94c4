"""The GPU check's sections that need fstrain's torchrec runtime (skipped where torchrec is missing).

* ``train``: ``fstrain train`` at world size 1 on this GPU per pipeline (plain, sparse-dist, pec,
  prioritized): steps/s from ``step_times.parquet``.
* ``multi_gpu`` (2+ GPUs): ``benchmarks.bench_alltoall``'s GPU section and 2-rank training with
  ``--backend cuda-ce`` vs ``nccl`` (exposed communication per step).
* ``quality``: the ml-1m SASRec row of the reproduction table at world size 1 (needs
  ``../shared/datasets``, which does not travel to a lent GPU machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def torchrec_missing() -> str | None:
    """``"needs torchrec"``-style reason when torchrec or fbgemm_gpu cannot be imported, else ``None``."""
    import importlib.util

    for name in ("torchrec", "fbgemm_gpu"):
        try:
            if importlib.util.find_spec(name) is None:
                return f"needs {name} (not installed here)"
        except (ImportError, ValueError):
            return f"needs {name} (not importable here)"
    return None


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _write_shards(root: Path, ranks: int, steps: int, batch: int, max_len: int) -> str:
    from tests.fstrain.shards import write_shards  # real fsdata format

    return write_shards(str(root / f"balanced-r{ranks}"), num_ranks=ranks, num_steps=steps, batch_size_per_rank=batch,
                        strategy="balanced", seed=11, num_items=20000, max_len=max_len, steps_per_row_group=4)


def _train(shards: str, pipeline: str, backend: str, metrics: Path, steps: int, nproc: int = 1) -> dict:
    args = ["train", shards, "--pipeline", pipeline, "--backend", backend, "--max-steps", str(steps),
            "--log-every-steps", "0", "--metrics-dir", str(metrics), "--embedding-dim", "64", "--json"]
    cmd = [sys.executable, "-m", "fstrain.cli", *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "fstrain.cli", *args]
    t0 = time.perf_counter()
    proc = _run(cmd, timeout=240)
    out = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "wall_seconds": time.perf_counter() - t0}
    if proc.returncode:
        out["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "(no stderr)"
        return out
    out["summary"] = json.loads(proc.stdout.strip().splitlines()[-1])
    st = metrics / "step_times.parquet"
    if st.exists():
        import numpy as np
        import pyarrow.parquet as pq

        t = pq.read_table(st)
        step = t.column("step").to_numpy()
        parts = {k: t.column(k).to_numpy() for k in ("compute_seconds", "wait_seconds", "sync_seconds")}
        total = sum(parts.values())
        steps_ = np.unique(step)
        out["mean_step_seconds"] = float(np.mean([total[step == s].max() for s in steps_]))  # slowest rank
        out["steps_per_second"] = 1.0 / out["mean_step_seconds"] if out["mean_step_seconds"] > 0 else None
        out["mean_exposed_comm_seconds"] = float(np.mean([parts["sync_seconds"][step == s].max() for s in steps_]))
    return out


def check_train(work: Path, quick: bool) -> dict:
    shards = _write_shards(work / "train1", ranks=1, steps=30 if quick else 100, batch=32, max_len=128)
    return {p: _train(shards, p, "nccl", work / f"m-{p}", steps=30 if quick else 100)
            for p in ("plain", "sparse-dist", "pec", "prioritized")}


def check_multi_gpu(work: Path, quick: bool) -> dict:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"needs 2+ GPUs (this machine has {n})"}
    bench = [sys.executable, "-m", "benchmarks.bench_alltoall", "--out", str(work / "alltoall"), "--ranks", "2"]
    proc = _run(bench + (["--quick"] if quick else []), timeout=300)
    res = {"bench_alltoall": {"command": " ".join(bench[1:]), "returncode": proc.returncode,
                              "tail": proc.stdout[-4000:] if proc.returncode == 0 else proc.stderr[-3000:]}}
    shards = _write_shards(work / "train2", ranks=2, steps=40, batch=32, max_len=128)
    for backend in ("nccl", "cuda-ce"):
        res[f"train_{backend}"] = _train(shards, "prioritized", backend, work / f"m2-{backend}", 40, nproc=2)
    return res


def quality_command(out: Path, work: Path, quick: bool) -> list[str]:
    """The ml-1m SASRec reproduction at world size 1 (fstrain picks the GPU when there is one)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_quality", "--reproduce", "--recipes", "ml-1m-sasrec",
           "--seeds", "0", "--out", str(out / "quality"), "--work", str(work / "quality")]
    return cmd + (["--epochs", "10"] if quick else [])


def check_quality(out: Path, work: Path, quick: bool) -> dict:
    cmd = quality_command(out, work, quick)
    t0 = time.perf_counter()
    proc = _run(cmd, timeout=3600)
    res = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "wall_seconds": time.perf_counter() - t0}
    if proc.returncode:
        res["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "(no stderr)"
        return res
    run = json.loads((out / "quality" / "bench_quality_reproduce.json").read_text())["runs"][0]
    res.update({k: run[k] for k in ("epochs", "ndcg@10", "hr@10", "best_ndcg@10", "best_epoch", "train_seconds",
                                    "tokens_per_second", "tokens_trained")})
    return res
