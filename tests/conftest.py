"""Shared test fixtures: paths to ../shared/datasets (skipped cleanly when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("FREESCALE_DATASETS", REPO_ROOT.parent / "shared" / "datasets"))


def dataset_path(rel: str) -> Path:
    """Path of a file under ../shared/datasets, or skip the test with a clear message."""
    p = DATASETS / rel
    if not p.exists():
        pytest.skip(f"real dataset {p} not present (../shared/datasets is absent on this machine)")
    return p


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
