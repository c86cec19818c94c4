"""Shared test fixtures: paths to ../shared/datasets (skipped cleanly when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("FREESCALE_DATASETS", REPO_ROOT.parent / "shared" / "datasets"))


try:  # CI runs with HYPOTHESIS_PROFILE=ci (.ci/run): the same examples on every run, so a landing never
    # depends on which random examples were drawn; elsewhere each run draws new ones
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:
    pass


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
    except Exception:  # noqa: BLE001 - a torch that fails to load has no CUDA for the tests
        return False


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _restore_logging():
    """Undo what a command's ``configure_logging`` did (root handlers, our loggers' levels).

    A CLI run inside a test may install a root handler on that test's captured stderr
    (``basicConfig(force=True)``) and set the ``fsdata``/``fstrain``/``pipelines`` levels; left in
    place, a later test's log lines would go to a closed stream or change what it prints.
    """
    import logging

    names = ("fsdata", "fstrain", "pipelines")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for n, lv in levels.items():
        logging.getLogger(n).setLevel(lv)
