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


#: Under pytest-xdist (``make test`` runs ``pytest -n auto --dist loadgroup``) the tests of one group run one after
#: another on one worker. A module is a group (its module fixtures are built once); the modules that start Ray form
#: one group (never two Ray instances side by side), and so do the multi-process modules whose tests wait on timeouts
#: (a second multi-process test beside them would stretch those waits).
RAY_MODULES = {"tests/fsdata/test_engine_ray.py", "tests/fsdata/test_engine_ray_one_cpu.py",
               "tests/fsdata/test_reshard_ray.py", "tests/fsdata/test_object_store.py"}
MULTIPROC_MODULES = {"tests/fstrain/test_peer_failure.py", "tests/fstrain/test_torchrun_errors.py",
                     "tests/fstrain/test_comm_shm.py", "tests/fstrain/test_comm_shm_threads.py",
                     "tests/fstrain/test_comm_hierarchical.py", "tests/fstrain/test_comm_torchrec.py",
                     "tests/fstrain/test_comm_shm_cma.py"}  # the shm tests count /dev/shm/fsc-* segments: one at a time


def xdist_group(nodeid: str) -> str:
    """The group of a test id (see above): ``ray``, ``multiproc`` or the test's module path."""
    path = nodeid.split("::", 1)[0]
    return "ray" if path in RAY_MODULES else "multiproc" if path in MULTIPROC_MODULES else path


#: fsdata's Numba kernels, compiled once: a profile and the balance variants on 600 samples (``_warm_numba_cache``).
_WARM_NUMBA = """
import sys, tempfile
from pathlib import Path
from fsdata.cli import main
from tests.fsdata.helpers import write_samples
with tempfile.TemporaryDirectory(prefix="fsdata-numba-warm-") as d:
    inp = str(write_samples(Path(d) / "in.parquet", n=600, seed=2))
    common = ["--ranks", "2", "--batch-size-per-rank", "8", "--no-progress"]
    rcs = [main(["profile", inp, *common])]
    for i, extra in enumerate(([], ["--partitioner", "lpt-swap"], ["--batch-policy", "cost-budget"],
                               ["--strategy", "shuffle"])):
        rcs.append(main(["balance", inp, f"{d}/out{i}", *common, *extra]))
sys.exit(max(rcs))
"""


def _numba_cache_is_cold() -> bool:
    """No compiled fsdata kernel on disk yet (a fresh clone), where Numba caches them (``NUMBA_CACHE_DIR`` or
    ``__pycache__`` beside the sources)."""
    where = Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else REPO_ROOT / "fsdata"
    return not any(where.rglob("*.nbi"))


def pytest_sessionstart(session):
    """Under pytest-xdist, on a cold Numba cache, compile fsdata's kernels once before the workers start.

    ``@njit(cache=True)`` writes each kernel to disk when it is first compiled, but on a fresh clone every process
    that reaches a kernel before that compiles it too (about 30 CPU s for the profile and balance kernels): both
    workers and their early subprocesses did. One process compiles here first; the others load the cache.
    """
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None) or not _numba_cache_is_cold():
        return
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _WARM_NUMBA], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=600, check=False)
    if r.returncode != 0:  # the tests that balance will show why; the warm-up only saves time
        print(f"compiling the Numba kernels up front failed (exit {r.returncode}): {r.stderr[-1000:]}")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` by the groups above: pytest-xdist's own reading of ``xdist_group`` marks renames test ids,
    which pytest 9 no longer allows, so the groups are taken from the test ids here."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    config.option.loadscopereorder = False  # groups go out in collection order: the slow ones first (below)
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker under --dist loadgroup
        # groups holding a slow test first, so no worker is left alone with a long one at the end
        heavy = {xdist_group(item.nodeid) for item in items if "slow" in item.keywords}
        items.sort(key=lambda item: xdist_group(item.nodeid) not in heavy)
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
