"""One GPU check: ``make gpu-check`` (``python -m benchmarks.gpu_check``): under 10 minutes on one H100
for sections 1-5 and 7; section 6 trains ml-1m for 100 epochs (``--skip quality`` leaves it out).

Writes ``gpu_check.json`` and prints a table. Sections (each timed, each failure recorded, not fatal):

1. ``tests``: every CUDA-marked test (``pytest -m gpu``), counts from its JUnit XML.
2. ``contention``: bf16 GEMM TFLOP/s alone, during an SM-kernel copy (an elementwise copy
   kernel between two device buffers, what NCCL's copy kernels do) and during a copy-engine copy
   (``Tensor.copy_`` device -> pinned host, ``non_blocking`` on a side stream, i.e.
   ``cudaMemcpyAsync``) of the same bytes per iteration. The contention the method removes,
   measurable on one GPU. All timing by CUDA events.
3. ``replay``: balanced vs shuffled shards, every rank's batch of every step timed on this GPU
   (forward + backward, CUDA events, median of repeats), measured bubble of each and the
   reduction; plus ``fstrain replay --device cuda`` on the same shards (its own clock).
4. ``train``: ``fstrain train`` with world size 1 on this GPU for each pipeline (plain,
   sparse-dist, pec, prioritized): steps/s.
5. ``multi_gpu`` (2+ GPUs only): ``benchmarks.bench_alltoall`` GPU section (cuda-ce vs NCCL
   all-to-all-v, GEMM contention) and 2-rank training with ``--backend cuda-ce`` vs ``nccl``
   (exposed communication per step from ``summary.json``).
6. ``quality``: the ml-1m SASRec row of the reproduction table (:mod:`benchmarks.quality_recipes`)
   trained at world size 1 on this GPU (``benchmarks.bench_quality --reproduce --recipes
   ml-1m-sasrec``; ``--quick``: 10 epochs): NDCG@10 / HR@10, wall time and tokens/s.
7. ``shared_gpu``: whether two processes can form an ``fs_cuda_ce`` group on ONE GPU (for a
   functional test of the copy-engine path on one-GPU machines); the outcome is recorded either
   way (NCCL refuses two ranks on one device in most versions).

Without CUDA it prints one line, ``gpu_check: no CUDA device ...``, and exits with status 2.

Examples:
    python -m benchmarks.gpu_check --out gpu-check/
    python -m benchmarks.gpu_check --quick --skip tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("tests", "contention", "replay", "train", "multi_gpu", "quality", "shared_gpu")
NO_CUDA = "gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a machine with a GPU"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, **kw)


# ---------------------------------------------------------------------------- 1. tests
def check_tests(out: Path, quick: bool) -> dict:
    xml = out / "gpu-tests.xml"
    t0 = time.perf_counter()
    proc = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                timeout=240 if quick else 300)
    res = {"command": "python -m pytest -m gpu -q", "returncode": proc.returncode,
           "seconds": time.perf_counter() - t0, "tail": proc.stdout[-3000:]}
    if xml.exists():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        total, fail = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        res.update(passed=total - fail - skipped, failed=fail, skipped=skipped,
                   failures=[tc.get("classname", "") + "::" + tc.get("name", "") for tc in suite.iter("testcase")
                             if tc.find("failure") is not None or tc.find("error") is not None])
    return res


# ----------------------------------------------------------------------- 2. contention
def check_contention(quick: bool) -> dict:
    import torch

    dev = torch.device("cuda", 0)
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    copy_bytes = 256 << 20
    src = torch.empty(copy_bytes // 2, device=dev, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    side = torch.cuda.Stream(dev)
    iters = 20 if quick else 50

    def gemms(copy=None) -> tuple[float, float]:
        """TFLOP/s of ``iters`` GEMMs on the main stream while ``copy`` loops on the side stream;
        and the side stream's copy GB/s."""
        torch.cuda.synchronize()
        main = torch.cuda.current_stream(dev)
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        num_copies = 0
        if copy is not None:
            with torch.cuda.stream(side):
                c0.record(side)
                for _ in range(iters):  # enough copies queued to cover the GEMM loop
                    copy()
                    num_copies += 1
                c1.record(side)
        s0.record(main)
        for _ in range(iters):
            torch.mm(a, b)
        s1.record(main)
        torch.cuda.synchronize()
        tflops = 2 * n ** 3 * iters / (s0.elapsed_time(s1) / 1e3) / 1e12
        gbps = num_copies * copy_bytes / (c0.elapsed_time(c1) / 1e3) / 1e9 if copy is not None else 0.0
        return tflops, gbps

    def sm_copy():
        torch.mul(src, 1, out=dst)  # an elementwise kernel on the SMs: reads and writes copy_bytes

    def ce_copy():
        host.copy_(src, non_blocking=True)  # cudaMemcpyAsync device -> pinned host: a copy engine

    gemms()  # warm-up (cuBLAS heuristics, clocks)
    alone = [gemms()[0] for _ in range(3)]
    sm = [gemms(sm_copy) for _ in range(3)]
    ce = [gemms(ce_copy) for _ in range(3)]
    med = statistics.median
    res = {"gemm_n": n, "dtype": "bfloat16", "copy_bytes": copy_bytes, "iterations": iters,
           "gemm_tflops_alone": med(alone), "gemm_tflops_during_sm_copy": med(t for t, _ in sm),
           "gemm_tflops_during_copy_engine_copy": med(t for t, _ in ce),
           "sm_copy_gbps": med(g for _, g in sm), "copy_engine_copy_gbps": med(g for _, g in ce)}
    res["slowdown_sm_copy"] = 1 - res["gemm_tflops_during_sm_copy"] / res["gemm_tflops_alone"]
    res["slowdown_copy_engine_copy"] = 1 - res["gemm_tflops_during_copy_engine_copy"] / res["gemm_tflops_alone"]
    return res


# --------------------------------------------------------------------------- 3. replay
def _write_shards(root: Path, ranks: int, steps: int, batch: int, max_len: int) -> dict[str, str]:
    sys.path.insert(0, str(REPO_ROOT))
    from tests.fstrain.shards import write_shards  # real fsdata format, LPT-balanced vs contiguous

    out = {}
    for strategy in ("balanced", "shuffle"):
        out[strategy] = write_shards(str(root / f"{strategy}-r{ranks}"), num_ranks=ranks, num_steps=steps,
                                     batch_size_per_rank=batch, strategy=strategy, seed=11, num_items=20000,
                                     max_len=max_len, steps_per_row_group=4)
    return out


def _event_replay(shards: str, model_kw: dict, repeats: int) -> dict:
    """Every rank's batch of every step, forward + backward on this GPU, CUDA-event timed."""
    import numpy as np
    import torch

    from fsdata.balancer.bubble import run_bubble
    from fstrain.data import ShardReader, infer_num_items, load_manifest
    from fstrain.models import with_negatives
    from fstrain.measure.replay import make_replay_model

    dev = torch.device("cuda", 0)
    manifest = load_manifest(shards)
    num_items = infer_num_items(manifest)
    model = make_replay_model(num_items, model_kw, 0, dev)
    cost = np.zeros((manifest.num_steps, manifest.num_ranks))
    for r in range(manifest.num_ranks):
        for b in ShardReader(shards, r, manifest.num_ranks):
            batch = with_negatives(b, num_items, model_kw["num_negatives"], 0).to(dev)
            times = []
            for i in range(repeats + 1):
                model.zero_grad(set_to_none=True)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                loss, _ = model(batch)
                loss.backward()
                e1.record()
                e1.synchronize()
                if i:  # the first run of each batch is a warm-up
                    times.append(e0.elapsed_time(e1) / 1e3)
            cost[b.step, r] = statistics.median(times)
    return {"measured_bubble": run_bubble(cost), "predicted_bubble": manifest.predicted_bubble,
            "mean_slowest_rank_seconds": float(cost.max(axis=1).mean()), "num_steps": int(cost.shape[0]),
            "num_ranks": int(cost.shape[1])}


def check_replay(work: Path, quick: bool) -> dict:
    model_kw = dict(embedding_dim=64, num_layers=2, num_heads=2, num_negatives=128, max_seq_len=512)
    shards = _write_shards(work / "replay", ranks=8, steps=4 if quick else 10, batch=16, max_len=512)
    res = {name: _event_replay(path, model_kw, repeats=3) for name, path in shards.items()}
    from fsdata.balancer.bubble import reduction

    res["measured_reduction"] = reduction(res["balanced"]["measured_bubble"], res["shuffle"]["measured_bubble"])
    cli = [sys.executable, "-m", "fstrain.cli", "replay", shards["balanced"], "--baseline", shards["shuffle"],
           "--device", "cuda", "--json", "--max-steps", "4" if quick else "10", "--repeats", "3"]
    proc = _run(cli, timeout=240)
    res["fstrain_replay_cli"] = {"command": " ".join(cli[1:]), "returncode": proc.returncode,
                                 "result": json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                                 else proc.stderr[-2000:]}
    return res


# ---------------------------------------------------------------------------- 4. train
def _train(shards: str, pipeline: str, backend: str, metrics: Path, steps: int, nproc: int = 1) -> dict:
    args = ["train", shards, "--pipeline", pipeline, "--backend", backend, "--max-steps", str(steps),
            "--log-every-steps", "0", "--metrics-dir", str(metrics), "--embedding-dim", "64", "--json"]
    if nproc == 1:
        cmd = [sys.executable, "-m", "fstrain.cli", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "fstrain.cli",
               *args]
    t0 = time.perf_counter()
    proc = _run(cmd, timeout=240)
    wall = time.perf_counter() - t0
    out = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "wall_seconds": wall}
    if proc.returncode == 0:
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        out["summary"] = summary
        st = metrics / "step_times.parquet"
        if st.exists():
            import numpy as np
            import pyarrow.parquet as pq

            t = pq.read_table(st)
            step = t.column("step").to_numpy()
            parts = {k: t.column(k).to_numpy() for k in ("compute_seconds", "wait_seconds", "sync_seconds")}
            steps = np.unique(step)
            total = [max(sum(parts[k][step == s_][i] for k in parts) for i in range(int((step == s_).sum())))
                     for s_ in steps]  # slowest rank's step time
            out["mean_step_seconds"] = float(np.mean(total))
            out["steps_per_second"] = 1.0 / out["mean_step_seconds"] if out["mean_step_seconds"] > 0 else None
            out["mean_exposed_comm_seconds"] = float(np.mean([parts["sync_seconds"][step == s_].max()
                                                              for s_ in steps]))
    else:
        out["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "(no stderr)"
    return out


def check_train(work: Path, quick: bool) -> dict:
    shards = _write_shards(work / "train1", ranks=1, steps=30 if quick else 100, batch=32, max_len=128)["balanced"]
    return {p: _train(shards, p, "nccl", work / f"m-{p}", steps=30 if quick else 100)
            for p in ("plain", "sparse-dist", "pec", "prioritized")}


# ------------------------------------------------------------------------ 5. multi GPU
def check_multi_gpu(work: Path, quick: bool) -> dict:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"not measured: needs 2+ GPUs, this machine has {n}"}
    res = {}
    bench = [sys.executable, "-m", "benchmarks.bench_alltoall", "--out", str(work / "alltoall"), "--ranks", "2"]
    if quick:
        bench.append("--quick")
    proc = _run(bench, timeout=300)
    res["bench_alltoall"] = {"command": " ".join(bench[1:]), "returncode": proc.returncode,
                             "tail": proc.stdout[-4000:] if proc.returncode == 0 else proc.stderr[-3000:]}
    shards = _write_shards(work / "train2", ranks=2, steps=40, batch=32, max_len=128)["balanced"]
    for backend in ("nccl", "cuda-ce"):
        res[f"train_{backend}"] = _train(shards, "prioritized", backend, work / f"m2-{backend}", 40, nproc=2)
    return res


# -------------------------------------------------------------------------- 6. quality
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


# ----------------------------------------------------------------------- 7. shared GPU
_SHARED_GPU_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from fstrain.distributed.comm import CommConfig, register_torch_backends
rank = int(sys.argv[1]); init = sys.argv[2]
torch.cuda.set_device(0)
name = register_torch_backends(CommConfig(backend="cuda-ce"))
dist.init_process_group(name, init_method=f"file://{init}", rank=rank, world_size=2)
pg = dist.group.WORLD
x = torch.arange(8, device="cuda", dtype=torch.float32) + 100 * rank
out = torch.empty(8, device="cuda")
dist.all_to_all_single(out, x, [4, 4], [4, 4])
torch.cuda.synchronize()
want = torch.cat([torch.arange(4) + 4 * rank, torch.arange(4) + 4 * rank + 100]).float()
print("OK" if torch.equal(out.cpu(), want) else f"WRONG {out.tolist()}", pg.copy_engines_agreed, pg.fallback_reason)
"""


def check_shared_gpu(work: Path) -> dict:
    init = work / "shared-gpu-init"
    init.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", _SHARED_GPU_SCRIPT, str(r), str(init)], cwd=REPO_ROOT,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out = {}
    for r, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=120)
            out[f"rank{r}"] = {"returncode": p.returncode, "stdout": so.strip()[-500:],
                               "stderr_last_line": se.strip().splitlines()[-1] if se.strip() else ""}
        except subprocess.TimeoutExpired:
            p.kill()
            out[f"rank{r}"] = {"returncode": None, "stdout": "", "stderr_last_line": "timed out after 120 s"}
    out["works"] = all(v.get("returncode") == 0 and v["stdout"].startswith("OK") for v in out.values())
    return out


# ----------------------------------------------------------------------------- main
def _table(res: dict) -> str:
    lines = [f"gpu_check on {res['device']} ({res['num_gpus']} GPU(s)), {res['seconds']:.0f} s"]
    t = res["sections"].get("tests", {})
    if "passed" in t:
        lines.append(f"  tests (pytest -m gpu): {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped")
    c = res["sections"].get("contention", {})
    if "gemm_tflops_alone" in c:
        lines.append(f"  GEMM bf16 n={c['gemm_n']}: alone {c['gemm_tflops_alone']:.0f} TFLOP/s; during SM copy "
                     f"{c['gemm_tflops_during_sm_copy']:.0f} ({c['slowdown_sm_copy']:.1%} slower, copy "
                     f"{c['sm_copy_gbps']:.0f} GB/s); during copy-engine copy "
                     f"{c['gemm_tflops_during_copy_engine_copy']:.0f} ({c['slowdown_copy_engine_copy']:.1%} slower, "
                     f"copy {c['copy_engine_copy_gbps']:.0f} GB/s)")
    r = res["sections"].get("replay", {})
    if "measured_reduction" in r:
        lines.append(f"  replay (CUDA events): bubble balanced {r['balanced']['measured_bubble']:.2%}, shuffled "
                     f"{r['shuffle']['measured_bubble']:.2%}, reduction {r['measured_reduction']:.1%}")
    for p, v in res["sections"].get("train", {}).items():
        if isinstance(v, dict):
            sps = v.get("steps_per_second")
            lines.append(f"  train world 1 --pipeline {p}: " + (f"{sps:.1f} steps/s" if sps else
                                                                  f"failed: {v.get('error', v.get('returncode'))}"))
    m = res["sections"].get("multi_gpu", {})
    for k, v in m.items():
        if k.startswith("train_") and isinstance(v, dict):
            lines.append(f"  train world 2 --backend {k[6:]}: exposed comm "
                         f"{v.get('mean_exposed_comm_seconds', float('nan')) * 1e3:.2f} ms/step, "
                         f"{v.get('steps_per_second') or 0:.1f} steps/s")
    if "skipped" in m:
        lines.append(f"  multi-GPU: {m['skipped']}")
    q = res["sections"].get("quality", {})
    if "ndcg@10" in q:
        lines.append(f"  ml-1m SASRec, world 1, {q['epochs']} epochs: NDCG@10 {q['ndcg@10']:.4f} HR@10 {q['hr@10']:.4f} "
                     f"(best {q['best_ndcg@10']:.4f} at epoch {q['best_epoch']:g}), train {q['train_seconds']:.0f} s, "
                     f"{q['tokens_per_second']:,.0f} tokens/s")
    s = res["sections"].get("shared_gpu", {})
    if "works" in s:
        lines.append(f"  two processes on one GPU (fs_cuda_ce): {'works' if s['works'] else 'does not work'}"
                     + ("" if s["works"] else f" ({s.get('rank0', {}).get('stderr_last_line', '')[:160]})"))
    for name, sec in res["sections"].items():
        if isinstance(sec, dict) and "error" in sec and name != "train":
            lines.append(f"  {name}: ERROR {sec['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "gpu-check-output"), help="folder for gpu_check.json")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "quick": a.quick, "sections": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        jobs = {"tests": lambda: check_tests(out, a.quick), "contention": lambda: check_contention(a.quick),
                "replay": lambda: check_replay(work, a.quick), "train": lambda: check_train(work, a.quick),
                "multi_gpu": lambda: check_multi_gpu(work, a.quick), "quality": lambda: check_quality(out, work, a.quick),
                "shared_gpu": lambda: check_shared_gpu(work)}
        for name, job in jobs.items():
            if name in a.skip:
                continue
            s0 = time.perf_counter()
            try:
                res["sections"][name] = job()
            except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
                res["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
            res["sections"][name]["section_seconds"] = time.perf_counter() - s0
            print(f"[gpu_check] {name}: {time.perf_counter() - s0:.0f} s", file=sys.stderr, flush=True)
    res["seconds"] = time.perf_counter() - t0
    with open(out / "gpu_check.json", "w") as f:
        json.dump(res, f, indent=2, default=str)
    table = _table(res)
    (out / "gpu_check.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
