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

    assert gpu_check.SECTIONS == ("tests", "contention", "replay", "train", "multi_gpu", "shared_gpu")
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--skip", "nope"])
    assert e.value.code == 2
