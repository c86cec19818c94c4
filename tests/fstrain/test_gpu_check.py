"""benchmarks.gpu_check: its CPU side, on an image without torchrec, fbgemm-gpu, polars or ortools.

The lent GPU image has torch, pyarrow, numba and pytest only; ``BLOCKER`` (a ``sitecustomize`` on
``PYTHONPATH``, so every subprocess gets it too) hides every other installed package (those four,
and hypothesis, psutil, tqdm, yaml, ...) from every meta-path finder, so ``import`` and
``importlib.util.find_spec`` behave as where they are not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MISSING = ("torchrec", "fbgemm_gpu", "polars", "ortools")
#: What the GPU image has besides the standard library: torch and its requirements, pyarrow, numba
#: (and llvmlite), pytest (and its requirements). Everything else installed here is hidden too.
IMAGE = ("torch", "torchgen", "functorch", "triton", "nvidia", "numpy", "filelock", "typing_extensions", "sympy",
         "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "setuptools", "pkg_resources", "pyarrow", "numba",
         "llvmlite", "pytest", "py", "pluggy", "iniconfig", "packaging", "pygments")
BLOCKER = f'''
import sys

_KEEP = set({IMAGE!r}) | {{"fsdata", "fstrain", "pipelines", "benchmarks", "tests", "sitecustomize", "conftest"}}
_PRIVATE = ("_pytest", "_sysconfigdata", "_distutils_hack", "_cython", "_virtualenv")


def _hidden(name):
    top = name.split(".")[0]
    return not (top in _KEEP or top in sys.stdlib_module_names or top.startswith(_PRIVATE) or top.startswith("test_"))


class _Hide:
    """Wraps a meta-path finder: what the GPU image lacks is not found, as where it is not installed."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if _hidden(name):
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

sys.meta_path[:] = [_Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


def _image_env(tmp_path: Path) -> dict:
    """Environment of a torch-only image: the blocker first on PYTHONPATH, then the repository."""
    site = tmp_path / "image-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the image has no pytest plugins (hypothesis' is one here)
    return env


def test_blocker_hides_the_four_packages(tmp_path):
    code = ("import importlib, importlib.util\nfor m in %r:\n    assert importlib.util.find_spec(m) is None, m\n"
            "    try:\n        importlib.import_module(m)\n        print('IMPORTED', m)\n"
            "    except ModuleNotFoundError as e:\n        print(e)\n"
            "import torch, pyarrow, numba, pytest, fsdata\n"
            "for m in ('hypothesis', 'psutil', 'tqdm'):\n"
            "    assert importlib.util.find_spec(m) is None, m\n" % (MISSING,))
    proc = subprocess.run([sys.executable, "-c", code], env=_image_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED" not in proc.stdout and proc.stdout.count("No module named") == 4


def test_gpu_check_without_cuda_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", "/nonexistent/never-written"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stdout == ""
    from benchmarks.gpu_check import NO_CUDA

    assert proc.stderr.strip().splitlines() == [NO_CUDA]
    assert "--dry-run" in NO_CUDA


def test_gpu_check_sections_and_flags(tmp_path, capsys):
    from benchmarks import gpu_check

    assert gpu_check.SECTIONS == ("tests", "sm_free", "cuda_ce_ipc", "calibrate_replay", "pipeline_cpu", "train",
                                  "multi_gpu", "quality")
    assert set(gpu_check.LIMITS) == set(gpu_check.SECTIONS) == set(gpu_check.JOBS)
    for bad in (["--skip", "nope"], ["--only", "contention"], ["--budget-seconds", "x"]):
        with pytest.raises(SystemExit) as e:
            gpu_check.main(bad)
        assert e.value.code == 2
    # a spent budget: every section says so in one line, and the results are still written
    assert gpu_check.main(["--dry-run", "--budget-seconds", "0", "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert list(res["sections"]) == [s for s in gpu_check.SECTIONS if s not in gpu_check.OPT_IN]
    assert all(v == {"skipped": "budget spent (--budget-seconds 0)"} for v in res["sections"].values())
    md = (tmp_path / "o" / "gpu_check.md").read_text()
    assert "- date: " in md and "- device: " in md and "- load average at start: " in md
    assert "- tests: skipped: budget spent (--budget-seconds 0)" in md
    assert md in capsys.readouterr().out


def test_gpu_test_files_are_the_marked_ones():
    from benchmarks.gpu_check import gpu_test_files

    files = gpu_test_files()
    assert "tests/fstrain/test_comm_cuda_ce.py" in files and "tests/fstrain/test_gpu_check.py" in files
    assert "tests/fstrain/test_comm_shm.py" not in files


def test_plugin_skips_what_needs_a_missing_package_and_fails_the_rest(tmp_path):
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_needs_torchrec.py").write_text("import torchrec\n\ndef test_a():\n    pass\n")
    (tests / "test_inner.py").write_text(textwrap.dedent("""
        def test_needs_polars():
            import polars  # noqa: F401

        def test_broken():
            import no_such_package_here  # noqa: F401

        def test_ok():
            pass
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
                           "benchmarks.gpu_tests_plugin", str(tests)], env=_image_env(tmp_path), capture_output=True,
                          text=True, timeout=180, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out  # test_broken still fails
    assert "1 failed, 1 passed, 2 skipped" in out, out
    assert "needs torchrec (not on this image)" in out and "needs polars (not on this image)" in out


def test_missing_package_names_only_the_four():
    from benchmarks.gpu_tests_plugin import missing_package

    assert missing_package("ModuleNotFoundError: No module named 'torchrec.distributed'") == "torchrec"
    assert missing_package("No module named 'fbgemm_gpu'") == "fbgemm_gpu"
    assert missing_package("No module named 'scipy'") is None
    assert missing_package("") is None


def test_all_to_all_reference_and_byte_compare():
    from benchmarks.gpu_ce_ipc import CASES, case_inputs, reference, same_bytes

    for i, (name, *_r) in enumerate(CASES[:3]):
        m, inputs = case_inputs(3, i)
        assert [x.shape[0] for x in inputs] == [sum(row) for row in m]
        for q in range(3):
            want = torch.cat([inputs[p][sum(m[p][:q]):sum(m[p][:q + 1])] for p in range(3)])
            assert same_bytes(reference(m, inputs, q), want)
        assert (m[0][2] == 0) == name.startswith("empty")
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bytes(nan, nan.clone())  # NaN-safe: bytes, not values
    assert not same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bytes(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_sm_free_copy_plan():
    from benchmarks.gpu_sm_free import copies_needed, graph_plan

    assert copies_needed(100.0, 1.0) == 130 and copies_needed(1.0, 10.0) == 1
    assert graph_plan(5000, 2048) == (2048, 3) and graph_plan(10) == (10, 1)
    with pytest.raises(ValueError):
        copies_needed(1.0, 0.0)


def test_calibration_fit_recovers_a_known_model():
    from benchmarks.gpu_replay import fit

    rng = np.random.default_rng(0)
    batches = [rng.integers(1, 500, int(n)) for n in rng.integers(2, 40, 30)]
    c = (2e-5, 3e-7, 4e-10)
    t = [1e-3 + c[0] * len(L) + c[1] * L.sum() + c[2] * (L.astype(float) ** 2).sum() for L in batches]
    f = fit(batches, np.array(t))
    np.testing.assert_allclose(f["coefficients"], c, rtol=1e-6)
    assert f["batch_overhead_seconds"] == pytest.approx(1e-3) and f["relative_rms_error"] < 1e-9


def test_prepared_data_and_assignments(tmp_path):
    from benchmarks import gpu_replay

    path = gpu_replay.prepare(tmp_path / "data", 3)
    lengths, setting = gpu_replay.load(tmp_path / "data")
    assert path.name == "samples.npz" and lengths.shape == (3, 16 * 32)
    assert setting["zipf_a"] == 1.2 and setting["max_len"] == 4096 and setting["num_steps"] == 3
    assert lengths.min() >= 1 and lengths.max() <= 4096 and (lengths == 4096).any()
    plans = gpu_replay.assign(lengths, 16, 32, (1e-5, 1e-7, 1e-9))
    costs = 1e-5 + lengths * (1e-7 + 1e-9 * lengths.astype(float))
    for ranks in plans.values():
        assert all((np.bincount(row, minlength=16) == 32).all() for row in ranks)
    from fsdata.balancer.bubble import run_bubble

    def bubble(ranks):
        return run_bubble(np.array([[costs[s][ranks[s] == r].sum() for r in range(16)] for s in range(3)]))

    assert bubble(plans["balanced"]) < bubble(plans["shuffled"]) / 5


def _dense_layer_reference(layer, x, lengths):
    """One HSTU-like layer run history by history with a dense causal mask (the jagged step's meaning)."""
    import torch.nn.functional as F

    outs, start = [], 0
    for n in lengths:
        xi = x[start:start + n]
        start += n
        u, v, q, k = F.silu(layer.uvqk(xi)).chunk(4, dim=-1)
        h, d = layer.heads, xi.shape[1]
        qh, kh, vh = (t.view(n, h, d // h).transpose(0, 1) for t in (q, k, v))  # [H x L x d/H]
        a = (F.silu(qh @ kh.transpose(-1, -2)) * layer.scale).tril()
        y = (a @ vh).transpose(0, 1).reshape(n, d)
        outs.append(xi + layer.out(layer.norm(y) * u))
    return torch.cat(outs)


def test_block_sparse_attention_equals_dense_causal_attention_per_history():
    from benchmarks.gpu_model import HSTULikeLayer, block_layout

    torch.manual_seed(0)
    layer = HSTULikeLayer(8, 2, 64, block_size=4).double()
    lengths = np.array([1, 4, 5, 13, 2, 8])  # inside one block, exactly one, one past, several, ...
    x = torch.randn(int(lengths.sum()), 8, dtype=torch.float64, requires_grad=True)
    lay = {k: torch.from_numpy(v) for k, v in block_layout(lengths, 4).items()}
    assert lay["blk_tok"].shape == (1 + 1 + 2 + 4 + 1 + 2, 4) and len(lay["pair_q"]) == 1 + 6 + 1
    got, want = layer(x, lay), _dense_layer_reference(layer, x, lengths.tolist())
    assert torch.allclose(got, want, atol=1e-12)
    g1, = torch.autograd.grad(got.square().sum(), x)
    g2, = torch.autograd.grad(want.square().sum(), x)
    assert torch.allclose(g1, g2, atol=1e-12)


def test_torch_only_step_gradients_and_batch_fields():
    from benchmarks.gpu_model import StepConfig, TorchOnlyStep, make_batch, time_step

    torch.manual_seed(0)
    m = TorchOnlyStep(StepConfig(num_items=50, embedding_dim=8, num_layers=1, num_heads=2, num_negatives=4,
                                 max_seq_len=32, block_size=8))
    lengths = np.array([32, 1, 5, 40, 32, 7])
    batch = make_batch(m, lengths, 0, torch.device("cpu"))
    assert batch["lengths"].tolist() == [32, 2, 5, 32, 32, 7]  # 1 -> 2 (one position to predict), 40 -> max
    assert batch["ids"].shape == (110,) and batch["next_src"].shape == (110 - 6,)
    assert batch["pos"][32:34].tolist() == [0, 1] and int(batch["pos"].max()) == 31
    assert time_step(m, batch, torch.device("cpu")) > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_torch_only_step_runs_the_same_kernels_whatever_the_lengths():
    """The step's work grows with the lengths, its kernel count does not (the padded micro-batch
    step measured on an H200 took ~12 ms per micro-batch, so its time followed their number)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.gpu_model import StepConfig, TorchOnlyStep, make_batch

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    m = TorchOnlyStep(StepConfig(num_items=100, embedding_dim=8, num_layers=2, num_heads=2, num_negatives=4,
                                 max_seq_len=256, block_size=8))
    counts = []
    for lengths in ([256] * 2, [2, 3, 5, 9, 17, 33, 65, 129, 256], [20] * 30):
        batch = make_batch(m, np.array(lengths), 0, torch.device("cpu"))
        with Count() as c:
            m.forward_backward(batch)
        counts.append(c.n)
    assert counts[0] == counts[1] == counts[2] > 0, counts


def test_torch_only_step_work_has_the_cost_model_form():
    """Block pairs per rank-step of the replay data: sum n(n+1)/2 with n = ceil(L / block), within
    block rounding of sum L^2 / (2 block^2) (the quadratic term the balancer equalizes)."""
    from benchmarks.gpu_model import StepConfig, block_layout
    from benchmarks.gpu_replay import SETTING, zipf_lengths

    bs = StepConfig().block_size
    lengths = np.maximum(2, zipf_lengths(16 * 32 * 4, SETTING["zipf_a"], SETTING["max_len"], 0)).reshape(-1, 32)
    for rank_batch in lengths:
        lay = block_layout(rank_batch, bs)
        n = -(-rank_batch // bs)
        pairs = len(lay["pair_q"]) + len(lay["blk_tok"])
        assert pairs == int((n * (n + 1) // 2).sum())
        sq = float((rank_batch.astype(float) ** 2).sum()) / (2 * bs * bs)
        assert sq <= pairs <= sq + float((1.5 * rank_batch / bs + 1).sum())
        assert sorted(lay["tok_blk"].tolist()) == sorted(set(lay["tok_blk"].tolist()))  # one slot per token


@pytest.mark.gpu
def test_torch_only_step_on_cuda():
    from benchmarks.gpu_model import StepConfig, TorchOnlyStep, make_batch, time_step

    dev = torch.device("cuda", 0)
    m = TorchOnlyStep(StepConfig(num_items=1000, embedding_dim=32, num_layers=2, num_heads=2, max_seq_len=512)).to(dev)
    batch = make_batch(m, np.array([512, 3, 100, 512]), 0, dev)
    assert time_step(m, batch, dev) > 0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_quality_command_trains_the_ml1m_sasrec_row(tmp_path):
    from benchmarks.gpu_check_torchrec import quality_command

    cmd = quality_command(tmp_path / "out", tmp_path / "work", quick=False)
    assert cmd[1:5] == ["-m", "benchmarks.bench_quality", "--reproduce", "--recipes"]
    assert cmd[5] == "ml-1m-sasrec" and "--epochs" not in cmd  # the recipe's 100 epochs
    assert quality_command(tmp_path, tmp_path, quick=True)[-2:] == ["--epochs", "10"]


def test_make_gpu_check_runs_without_a_virtual_environment_when_torch_is_there(tmp_path):
    out = tmp_path / "o"
    proc = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}", "VENV=" + str(tmp_path / "venv"),
                           f"GPU_CHECK_ARGS=--dry-run --budget-seconds 0 --out {out}"], cwd=REPO,
                          env=_image_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "venv").exists()  # no virtual environment built
    assert proc.stdout.startswith("PYTHONPATH=. ") and (out / "gpu_check.json").exists()


def test_prepare_writes_the_git_ignored_data_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--prepare", "--quick", "--data",
                           str(tmp_path / "d")], env=_image_env(tmp_path), capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: wrote ") and (tmp_path / "d" / "samples.npz").exists()
    ignored = subprocess.run(["git", "check-ignore", "-q", "gpu-check-data/samples.npz"], cwd=REPO)
    assert ignored.returncode == 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_dry_run_on_an_image_without_torchrec(tmp_path):
    """Every section runs its CPU side or skips with one line; nothing imports the four packages."""
    out = tmp_path / "out"  # (a dry run hides the GPU from its sections on a GPU machine too)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)],
                          env=_image_env(tmp_path), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "gpu_check.json").read_text())
    s = res["sections"]
    assert res["mode"].startswith("dry-run") and res["device"].startswith("cpu")
    assert s["tests"]["failed"] == 0 and s["tests"]["skipped"] >= 1 and "error" not in s["tests"]
    assert s["sm_free"]["skipped"] == "needs CUDA"
    assert s["cuda_ce_ipc"]["equal"] is True and s["cuda_ce_ipc"]["transport"] == "gloo"
    assert {c["case"] for r in s["cuda_ce_ipc"]["ranks"] for c in r["cases"]} == {
        "small-f32", "empty-pair-i64", "multi-round-bf16"}
    cr = s["calibrate_replay"]
    assert set(cr) >= {"calibration", "balanced", "shuffled", "slowest_rank_speedup"}, cr
    for k in ("balanced", "shuffled"):
        assert cr[k]["slowest_rank_ms_per_step"] > 0 and len(cr[k]["compute_seconds"]) == 2
    for name in ("train", "multi_gpu"):
        assert s[name]["skipped"] == "needs torchrec (not installed here)"
    assert s["pipeline_cpu"]["skipped"].startswith("dry run")
    assert "quality" not in s  # opt-in (--only quality)
    md = (out / "gpu_check.md").read_text()
    assert md.count("skipped: ") == 4 and "equal byte for byte to the CPU reference" in md


def test_replay_takes_turns_and_stops_at_the_deadline():
    from benchmarks import gpu_replay
    from benchmarks.gpu_model import StepConfig, TorchOnlyStep

    torch.manual_seed(0)
    m = TorchOnlyStep(StepConfig(num_items=50, embedding_dim=8, num_layers=1, num_heads=2, num_negatives=4,
                                 max_seq_len=16))
    lengths = gpu_replay.zipf_lengths(3 * 8, 1.2, 16, 0).reshape(3, 8)
    plans = gpu_replay.assign(lengths, 2, 4, (1e-5, 1e-7, 1e-9))
    cpu = torch.device("cpu")
    cut = gpu_replay.replay(m, cpu, lengths, plans, 2, (1e-5, 1e-7, 1e-9), repeats=1, deadline=0.0)
    assert {k: v["num_steps"] for k, v in cut.items()} == {"balanced": 1, "shuffled": 1}  # one step, both
    full = gpu_replay.replay(m, cpu, lengths, plans, 2, (1e-5, 1e-7, 1e-9), repeats=1)
    assert full["shuffled"]["num_steps"] == 3 and np.array(full["shuffled"]["compute_seconds"]).shape == (3, 2)
    assert 0 <= full["balanced"]["predicted_bubble"] <= full["shuffled"]["predicted_bubble"]


def test_report_of_a_gpu_shaped_result():
    """The report renders what each section returns on a GPU (shapes as the sections build them)."""
    from benchmarks.gpu_check import _fmt, report

    row = {"size_mb": 1, "variant": "sm_kernel", "gemm_tflops_alone": 600.0, "gemm_tflops_during": 420.0,
           "slowdown": 0.3, "gemm_alone_spread": 0.02, "gemm_time_increase": 0.43, "copy_gbps_alone": 1500.0,
           "copy_gbps_during": 900.0, "copies": 4096, "launch": "graph", "covered": True}
    rep = {"slowest_rank_ms_per_step": 30.0, "mean_rank_ms_per_step": 25.0, "measured_bubble": 0.05,
           "null_bubble": 0.01, "measured_bubble_minus_null": 0.04, "null_slowest_rank_ms_per_step": 20.0,
           "predicted_bubble": 0.02, "num_steps": 8, "compute_seconds": [[0.03, 0.02]]}
    res = {"date": "2026-01-01 00:00 UTC", "device": "NVIDIA H100 80GB HBM3", "num_gpus": 1, "torch": "2.11.0",
           "cuda": "13.0", "host": "h", "command": "python -m benchmarks.gpu_check", "loadavg": "0.1 0.1 0.1",
           "mode": "full", "sections": {
               "tests": {"passed": 1, "failed": 1, "skipped": 6, "failures": ["a::b"], "skip_reasons": []},
               "sm_free": {"gemm_n": 8192, "gemm_iters": 40, "rows": [row, {"size_mb": 64, "variant": "x",
                                                                          "error": "RuntimeError: y"}]},
               "cuda_ce_ipc": {"transport": "cuda-ce", "world_size": 2, "equal": False, "uses_copy_engines": False,
                               "fallback_reason": "symmetric memory rendezvous failed: z",
                               "ranks": [{"rank": 0, "cases": []}, {"rank": 1, "returncode": 1, "error": "E"}]},

               "calibrate_replay": {"device": "NVIDIA H100 80GB HBM3", "num_steps": 8, "repeats": 3,
                                    "calibration": {"coefficients": [1e-5, 1e-7, 1e-10], "relative_rms_error": 0.04},
                                    "balanced": rep, "shuffled": {**rep, "slowest_rank_ms_per_step": 45.0},
                                    "slowest_rank_speedup": 1.5},
               "train": {"skipped": "needs torchrec (not installed here)"},
               "multi_gpu": {"error": "timed out after 400 s"}}}
    md = report(res)
    assert "- device: NVIDIA H100 80GB HBM3 (1 GPU(s)), torch 2.11.0, CUDA 13.0" in md
    assert "1 passed, 1 failed, 6 skipped; failed: a::b" in md
    assert "| 1 | sm_kernel | 600 | 420 | 30.0% | 2.0% | 1500 | 900 | yes |" in md and "error: RuntimeError: y" in md
    assert "did not run its cases; copy engines used: False (fallback: symmetric memory rendezvous failed: z)" in md
    assert "| shuffled | 45.0 | 5.0% | 1.0% | 4.0% | 2.0% |" in md and "1.50x" in md
    assert "- train: skipped: needs torchrec (not installed here)" in md
    ok = {"transport": "cuda-ce", "world_size": 2, "equal": True, "uses_copy_engines": True, "fallback_reason": None,
          "ranks": [{"rank": 0, "cases": [{"case": "large-bf16", "equal": True, "bytes_received_from_peers": 40_960_000,
                                           "seconds": 0.002, "gb_per_second": 20.48}]}]}
    line = "\n".join(_fmt("cuda_ce_ipc", ok))
    assert "equal byte for byte to the CPU reference; copy engines used: True" in line
    assert line.endswith("; rank 0 received 41 MB in 2.00 ms (20.5 GB/s)")
    assert "- multi_gpu: ERROR timed out after 400 s" in md


def _bench_result(plain, sd, inline, prio, exposed=(10.0, 12.0, 9.0)):
    p = {"plain": {"step_ms": plain}, "sparse-dist": {"step_ms": sd, "exposed_comm_ms": exposed[0]},
         "prioritized-no-overlap": {"step_ms": inline, "exposed_comm_ms": exposed[1]},
         "prioritized": {"step_ms": prio, "exposed_comm_ms": exposed[2]}}
    return {"pipelines": p, "machine": {"torchrec": "1.6.1"}}


def test_pipeline_cpu_summary_and_table():
    """The pipeline_cpu section's ratios (against the better of plain and sparse-dist) and its rows."""
    from benchmarks.gpu_pipeline_cpu import summarize, table

    r = summarize(_bench_result(60.0, 50.0, 55.0, 45.0))
    assert r["better_stock_ms"] == 50.0 and r["prioritized_over_better_stock"] == pytest.approx(0.9)
    assert r["inline_over_better_stock"] == pytest.approx(1.1)
    assert r["inline_over_prioritized"] == pytest.approx(55 / 45)
    assert r["inline_exposed_over_sparse_dist"] == pytest.approx(1.2)
    assert r["prioritized_exposed_over_sparse_dist"] == pytest.approx(0.9)
    with pytest.raises(KeyError):
        summarize({"pipelines": {"plain": {"step_ms": 1.0}}})
    rows = table({"runs": [{"cores": "all", "load_average_1m_before": 0.25, **r},
                           {"cores": "2cores", "error": "exit 1: boom"}]})
    assert rows[2] == "| 1 | all | 0.25 | 0.90x | 1.10x | 1.22x | 0.90x | 1.20x |"
    assert rows[3].startswith("| 2 | 2cores | | exit 1: boom |")


def test_pipeline_cpu_says_how_to_get_torchrec(tmp_path, monkeypatch):
    """Without torchrec and without wheels the section is skipped with the command that fixes it;
    a dry run never runs the benchmark."""
    from benchmarks import gpu_check_torchrec, gpu_pipeline_cpu

    monkeypatch.setattr(gpu_check_torchrec, "torchrec_missing", lambda: "needs torchrec (not installed here)")
    monkeypatch.setattr(gpu_pipeline_cpu, "WHEELS", tmp_path / "gpu-check-wheels")
    extra, why = gpu_pipeline_cpu.torchrec_path(tmp_path)
    assert extra is None and "make gpu-check-wheels" in why
    assert gpu_pipeline_cpu.run(tmp_path, quick=True, limit=60, dry_run=True)["skipped"].startswith("dry run")
    (tmp_path / "gpu-check-wheels").mkdir()
    (tmp_path / "gpu-check-wheels" / "broken-0.0-py3-none-any.whl").write_bytes(b"not a zip")
    extra, why = gpu_pipeline_cpu.torchrec_path(tmp_path)
    assert extra is None and "did not install" in why

