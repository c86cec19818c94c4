"""The GPU check: ``make gpu-check`` (``python -m benchmarks.gpu_check``), one prepared command for a lent GPU.

Runs on an image with Python 3.12, torch, pyarrow, numba and pytest and nothing else (no torchrec,
fbgemm-gpu, polars or ortools): the repository on ``PYTHONPATH``, its inputs in a git-ignored
folder of the repository (``gpu-check-data/``, written by ``--prepare``; written on the spot
when absent). Each section runs in its own process with a time limit (a crash or a hang in one
costs only that section), inside an overall ``--budget-seconds``; ``gpu_check.json`` and
``gpu_check.md`` (a table with date, device, command and load average) are rewritten after every
section under ``--out``. A section that cannot run here says why in one line (``needs CUDA``,
``needs torchrec``, ``needs 2+ GPUs``).

Sections (docs/comm.md, "The GPU check"):

1. ``tests``: the CUDA-marked tests (``pytest -m gpu`` on the test files that carry the mark), with
   :mod:`benchmarks.gpu_tests_plugin`: a test needing torchrec, fbgemm-gpu, polars or ortools is
   skipped with one line, not failed.
2. ``sm_free``: a GEMM's slowdown while 1-64 MB transfers move by copy engine vs an SM copy kernel
   (:mod:`benchmarks.gpu_sm_free`).
3. ``cuda_ce_ipc``: ``cuda-ce``'s all-to-all-v between two processes on the one GPU through CUDA IPC,
   equal byte for byte to a CPU reference (:mod:`benchmarks.gpu_ce_ipc`).
4. ``calibrate_replay``: calibrate + replay with the torch-only model step at NVIDIA's setting
   (Zipf 1.2 lengths, max 4096, R=16, B=32, HSTU-like layers): balanced vs shuffled slowest-rank
   ms/step, measured bubble above its null control (:mod:`benchmarks.gpu_replay`).
5. ``pipeline_cpu``: ``bench_pipeline`` on the machine's CPUs, all cores vs 2 cores alternated (the
   overlapped pipeline with a spare core per rank); torchrec from ``make gpu-check-wheels``
   (:mod:`benchmarks.gpu_pipeline_cpu`).
6. ``train``, ``multi_gpu``, ``quality``: need fstrain's torchrec runtime (:mod:`benchmarks.gpu_check_torchrec`).

``--dry-run`` (no GPU needed): every section runs its CPU side (the pytest selection and plugin,
the two-process harness with gloo on CPU, calibrate + replay on a tiny CPU setting) or says in one
line why it cannot. Without CUDA and without ``--dry-run``: one line, exit 2.

Examples:
    python -m benchmarks.gpu_check --prepare
    python -m benchmarks.gpu_check --out gpu-check-output
    python -m benchmarks.gpu_check --dry-run --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("tests", "sm_free", "cuda_ce_ipc", "calibrate_replay", "pipeline_cpu", "train", "multi_gpu", "quality")
#: Sections left out unless named with ``--only`` (the ml-1m reproduction trains for many minutes).
OPT_IN = ("quality",)
#: Per-section time limits in seconds (full, ``--quick``); the overall budget caps them further.
LIMITS = {"tests": (240, 180), "sm_free": (150, 90), "cuda_ce_ipc": (150, 120), "calibrate_replay": (300, 120),
          "pipeline_cpu": (300, 120),
          "train": (300, 180), "multi_gpu": (400, 300), "quality": (3600, 900)}
NO_CUDA = ("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a machine with a GPU, "
           "or add --dry-run to check its CPU side")
DEFAULT_DATA = REPO_ROOT / "gpu-check-data"
DEFAULT_OUT = REPO_ROOT / "gpu-check-output"
NUM_STEPS = 8  # calibrate_replay: steps of R*B samples prepared and replayed (--quick: 3)


def _env(hide_gpu: bool = False) -> dict:
    """This environment with the repository first on ``PYTHONPATH`` (``hide_gpu``: no CUDA device visible)."""
    env = dict(os.environ)
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def gpu_test_files(root: Path = REPO_ROOT / "tests") -> list[str]:
    """Test files (relative to the repository) that carry the ``gpu`` mark, sorted."""
    return sorted(str(p.relative_to(REPO_ROOT)) for p in root.rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


# ------------------------------------------------------------------------------ sections
def sec_tests(ctx: dict) -> dict:
    xml = Path(ctx["work"]) / "gpu-tests.xml"
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
           "-p", "benchmarks.gpu_tests_plugin", f"--junitxml={xml}", *files]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(ctx["dry_run"]), capture_output=True, text=True,
                          timeout=max(10, ctx["limit"] - 10))
    res = {"command": "python -m pytest -m gpu -q -rs -p benchmarks.gpu_tests_plugin FILES", "files": files,
           "returncode": proc.returncode, "tail": proc.stdout[-3000:]}
    if xml.exists():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        res.update(passed=total - failed - skipped, failed=failed, skipped=skipped,
                   failures=[f"{tc.get('classname', '')}::{tc.get('name', '')}" for tc in suite.iter("testcase")
                             if tc.find("failure") is not None or tc.find("error") is not None],
                   skip_reasons=sorted({(tc.find("skipped").get("message") or "")[:120] for tc in suite.iter("testcase")
                                        if tc.find("skipped") is not None}))
    return res


def sec_sm_free(ctx: dict) -> dict:
    if not ctx["cuda"]:
        return {"skipped": "needs CUDA"}
    import torch

    from benchmarks import gpu_sm_free

    kw: dict = dict(sizes_mb=(1, 16, 64), gemm_iters=20, repeats=2) if ctx["quick"] else {}
    return gpu_sm_free.run(torch.device("cuda", 0), **kw)


def sec_cuda_ce_ipc(ctx: dict) -> dict:
    from benchmarks import gpu_ce_ipc

    transport = "gloo" if ctx["dry_run"] or not ctx["cuda"] else "cuda-ce"
    res = gpu_ce_ipc.run(Path(ctx["work"]), transport, timeout=max(10, ctx["limit"] - 10),
                         env=_env(ctx["dry_run"]))
    if transport == "gloo":
        res["note"] = "harness only: gloo on CPU tensors (cuda-ce needs CUDA)"
    return res


def replay_settings(dry_run: bool, quick: bool) -> dict:
    """Keyword arguments of :func:`benchmarks.gpu_replay.run` (``dry_run``: a tiny CPU setting)."""
    from benchmarks.gpu_model import StepConfig

    if dry_run:
        return dict(model=StepConfig(num_items=1000, embedding_dim=16, num_layers=1, num_heads=2, num_negatives=8,
                                     max_seq_len=64, block_size=16), num_steps=2, repeats=1, calib_lengths=[4, 16, 64],
                    calib_batch_sizes=[2, 4], setting={"num_ranks": 4, "batch_size_per_rank": 4, "max_len": 64})
    lengths = [16, 128, 512, 1024, 2048, 4096]
    return dict(model=StepConfig(), num_steps=3 if quick else NUM_STEPS, repeats=2 if quick else 3,
                calib_lengths=lengths, calib_batch_sizes=[4, 16] if quick else [4, 16, 32])


def sec_calibrate_replay(ctx: dict) -> dict:
    import torch

    from benchmarks import gpu_replay

    if not ctx["cuda"] and not ctx["dry_run"]:
        return {"skipped": "needs CUDA"}
    kw = replay_settings(ctx["dry_run"], ctx["quick"])
    data = Path(ctx["work"]) / "dry-run-data" if ctx["dry_run"] else Path(ctx["data"])
    device = torch.device("cpu") if ctx["dry_run"] else torch.device("cuda", 0)
    if device.type == "cpu":
        torch.set_num_threads(1)
    # leave a quarter of the section's time (at least 30 s) after the last step starts
    deadline = time.monotonic() + ctx["limit"] - max(30.0, ctx["limit"] / 4)
    return gpu_replay.run(data, device, deadline=deadline, **kw)


def _torchrec_section(name: str):
    def section(ctx: dict) -> dict:
        from benchmarks import gpu_check_torchrec as tr

        why = tr.torchrec_missing() or (None if ctx["cuda"] and not ctx["dry_run"] else "needs CUDA")
        if why:
            return {"skipped": why}
        work, out = Path(ctx["work"]), Path(ctx["out"])
        if name == "train":
            return tr.check_train(work, ctx["quick"])
        if name == "multi_gpu":
            return tr.check_multi_gpu(work, ctx["quick"])
        return tr.check_quality(out, work, ctx["quick"])
    return section


def sec_pipeline_cpu(ctx: dict) -> dict:
    from benchmarks import gpu_pipeline_cpu

    return gpu_pipeline_cpu.run(Path(ctx["work"]), quick=ctx["quick"], limit=ctx["limit"], dry_run=ctx["dry_run"])


JOBS = {"tests": sec_tests, "sm_free": sec_sm_free, "cuda_ce_ipc": sec_cuda_ce_ipc,
        "calibrate_replay": sec_calibrate_replay, "pipeline_cpu": sec_pipeline_cpu,
        **{n: _torchrec_section(n) for n in ("train", "multi_gpu", "quality")}}


# ------------------------------------------------------------------------------- report
def _fmt(name: str, sec: dict) -> list[str]:
    """Markdown lines of one section."""
    if isinstance(sec.get("skipped"), str):
        return [f"- {name}: skipped: {sec['skipped']}"]
    if "error" in sec:
        return [f"- {name}: ERROR {sec['error']}"]
    if name == "tests" and "passed" in sec:
        return [f"- tests (pytest -m gpu): {sec['passed']} passed, {sec['failed']} failed, {sec['skipped']} skipped"
                + (f"; failed: {', '.join(sec['failures'][:5])}" if sec["failures"] else "")]
    if name == "sm_free":
        from benchmarks.gpu_sm_free import table

        return [f"- sm_free: bf16 GEMM n={sec['gemm_n']} x {sec['gemm_iters']} during back-to-back transfers", "",
                *table(sec), ""]
    if name == "cuda_ce_ipc":
        ran = all(r.get("cases") for r in sec["ranks"])
        ok = ("equal byte for byte to the CPU reference" if sec["equal"] else
              "NOT equal to the CPU reference" if ran else "did not run its cases")
        return [f"- cuda_ce_ipc ({sec['transport']}, {sec['world_size']} processes on one device): {ok}; "
                f"copy engines used: {sec['uses_copy_engines']}"
                + (f" (fallback: {sec['fallback_reason']})" if sec.get("fallback_reason") else "")
                + "".join(f"; rank {r['rank']}: {r['error']}" for r in sec["ranks"] if "error" in r)
                + "".join(f"; rank {r['rank']} received {c['bytes_received_from_peers'] / 1e6:.0f} MB in "
                          f"{c['seconds'] * 1e3:.2f} ms ({c['gb_per_second']:.1f} GB/s)"
                          for r in sec["ranks"] for c in r.get("cases", []) if c["case"].startswith("large"))]
    if name == "pipeline_cpu":
        from benchmarks.gpu_pipeline_cpu import table as pipeline_table

        return [f"- pipeline_cpu: `{sec['command']}`, 2 gloo ranks on the CPUs, runs alternated", "",
                *pipeline_table(sec), ""]
    if name == "calibrate_replay":
        cal, b, s = sec["calibration"], sec["balanced"], sec["shuffled"]
        return [f"- calibrate_replay on {sec['device']}: calibrated [c0, c1, c2] = "
                f"[{', '.join(f'{c:.3g}' for c in cal['coefficients'])}] s (relative RMS error "
                f"{cal['relative_rms_error']:.1%}); {sec['num_steps']} steps, {sec['repeats']} repeats", "",
                "| assignment | slowest-rank ms/step | measured bubble | null bubble | bubble above null | "
                "predicted bubble |", "|---|---:|---:|---:|---:|---:|",
                *(f"| {k} | {v['slowest_rank_ms_per_step']:.1f} | {v['measured_bubble']:.1%} | {v['null_bubble']:.1%} "
                  f"| {v['measured_bubble_minus_null']:.1%} | {v['predicted_bubble']:.1%} |"
                  for k, v in (("balanced", b), ("shuffled", s))), "",
                f"  shuffled / balanced slowest-rank time: {sec['slowest_rank_speedup']:.2f}x", ""]
    return [f"- {name}: " + json.dumps({k: v for k, v in sec.items() if k != "section_seconds"}, default=str)[:400]]


def report(res: dict) -> str:
    """``gpu_check.md``: header (date, device, command, load average) and every section."""
    lines = ["# GPU check", "", f"- date: {res['date']}", f"- device: {res['device']} ({res['num_gpus']} GPU(s)), "
             f"torch {res['torch']}, CUDA {res['cuda']}, host {res['host']}", f"- command: `{res['command']}`",
             f"- load average at start: {res['loadavg']}", f"- mode: {res['mode']}", ""]
    for name, sec in res["sections"].items():
        lines += _fmt(name, sec)
    return "\n".join(lines) + "\n"


def _write(out: Path, res: dict) -> None:
    for fname, text in (("gpu_check.json", json.dumps(res, indent=2, default=str)), ("gpu_check.md", report(res))):
        tmp = out / (fname + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / fname)


# ---------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results folder (gpu_check.json, gpu_check.md)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="input folder (git-ignored; --prepare writes it)")
    p.add_argument("--prepare", action="store_true", help="write the inputs to --data and exit (no GPU needed)")
    p.add_argument("--dry-run", action="store_true", help="run every section's CPU side; no GPU needed")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    p.add_argument("--only", nargs="*", default=None, choices=SECTIONS, help="run just these sections")
    p.add_argument("--budget-seconds", type=float, default=540.0,
                   help="stop starting sections past this many seconds (default 540: under a 10-minute command)")
    p.add_argument("--run-section", choices=SECTIONS, help=argparse.SUPPRESS)
    p.add_argument("--context", help=argparse.SUPPRESS)
    return p


def _run_section(name: str, ctx: dict) -> dict:
    """Run one section in a child process (``--run-section``) within ``ctx['limit']`` seconds."""
    res_file = Path(ctx["work"]) / f"section-{name}.json"
    ctx_file = Path(ctx["work"]) / f"section-{name}-context.json"
    ctx_file.write_text(json.dumps(ctx))
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--run-section", name, "--context", str(ctx_file)]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(ctx["dry_run"]), capture_output=True, text=True,
                              timeout=ctx["limit"])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {ctx['limit']:.0f} s"}
    if proc.returncode == 0 and res_file.exists():
        return json.loads(res_file.read_text())
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {"error": f"exit {proc.returncode}: {lines[-1] if lines else '(no stderr)'}"}


def _child(name: str, ctx_file: str) -> int:
    ctx = json.loads(Path(ctx_file).read_text())
    try:
        res = JOBS[name](ctx)
    except Exception as e:  # noqa: BLE001 - recorded in the section; the check goes on
        msg = str(e).strip().splitlines()
        res = {"error": f"{type(e).__name__}: {msg[0] if msg else ''}"}
    (Path(ctx["work"]) / f"section-{name}.json").write_text(json.dumps(res, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.run_section:
        return _child(a.run_section, a.context)
    if a.prepare:
        from benchmarks import gpu_replay

        path = gpu_replay.prepare(Path(a.data), 3 if a.quick else NUM_STEPS)
        print(f"gpu_check: wrote {path} ({path.stat().st_size} bytes)")
        return 0
    import torch

    if not torch.cuda.is_available() and not a.dry_run:
        print(NO_CUDA, file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not a.dry_run  # a dry run is the CPU side, GPU or not
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    names = [n for n in (a.only if a.only is not None else [s for s in SECTIONS if s not in OPT_IN])
             if n not in a.skip]
    res = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device used)",
           "num_gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "host": platform.node(),
           "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
           "command": "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
           "mode": "dry-run (CPU side only)" if a.dry_run else ("quick" if a.quick else "full"), "sections": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        for name in names:
            left = a.budget_seconds - (time.monotonic() - t0)
            if left < 20:
                res["sections"][name] = {"skipped": f"budget spent (--budget-seconds {a.budget_seconds:g})"}
                continue
            ctx = {"work": work, "out": str(out), "data": a.data, "quick": a.quick, "dry_run": a.dry_run,
                   "cuda": cuda, "limit": min(LIMITS[name][a.quick], left)}
            s0 = time.monotonic()
            res["sections"][name] = _run_section(name, ctx)
            res["sections"][name]["section_seconds"] = round(time.monotonic() - s0, 1)
            print(f"[gpu_check] {name}: {time.monotonic() - s0:.0f} s", file=sys.stderr, flush=True)
            _write(out, res)
    res["seconds"] = round(time.monotonic() - t0, 1)
    _write(out, res)
    print(report(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
