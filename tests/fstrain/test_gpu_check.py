"""benchmarks.gpu_check: on a machine without CUDA, one clear line and status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_gpu_check_without_cuda_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", "/nonexistent/never-written"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a machine with a GPU"]


def test_gpu_check_sections_and_help():
    from benchmarks import gpu_check

    assert gpu_check.SECTIONS == ("tests", "contention", "replay", "train", "multi_gpu", "quality", "shared_gpu")
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--skip", "nope"])
    assert e.value.code == 2


def test_gpu_check_quality_trains_the_ml1m_sasrec_row(tmp_path):
    from benchmarks import gpu_check
    from benchmarks.quality_convergence import main as bench_main

    cmd = gpu_check.quality_command(tmp_path / "out", tmp_path / "work", quick=False)
    assert cmd[1:5] == ["-m", "benchmarks.bench_quality", "--reproduce", "--recipes"]
    assert cmd[5] == "ml-1m-sasrec" and "--epochs" not in cmd  # the recipe's 100 epochs
    assert gpu_check.quality_command(tmp_path, tmp_path, quick=True)[-2:] == ["--epochs", "10"]
    with pytest.raises(SystemExit) as e:  # the flags exist: --help parses them all
        bench_main([*cmd[3:], "--help"])
    assert e.value.code == 0
