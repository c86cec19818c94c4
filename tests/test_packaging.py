"""Packaging: ranges in pyproject.toml, exact pins in constraints.txt, fsdata without torch.

The install checks that need PyPI (fresh venvs built with docs/api.md's lines, the resolution of
the extras) are in tests/test_install.py (slow); these tests guard the metadata they depend on and
run the torch-free import for real in a subprocess.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO_ROOT

#: Distributions that pull in torch or a CUDA/CPU build tied to it: never in the core install.
TORCH_RELATED = {"torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "tensordict", "torchmetrics",
                 "pyre-extensions", "iopath", "triton", "torchvision", "torchaudio", "lightning"}
#: Top-level modules that the core package `fsdata` must never import.
BLOCKED_MODULES = ("torch", "torchrec", "fbgemm_gpu", "tensordict", "torchmetrics", "fstrain")


def _project() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _requirements() -> dict[str, list[Requirement]]:
    p = _project()
    groups = {"core": p["dependencies"], **p["optional-dependencies"]}
    return {g: [Requirement(r) for r in reqs] for g, reqs in groups.items()}


def test_core_dependencies_are_torch_free_ranges():
    core = _requirements()["core"]
    names = {canonicalize_name(r.name) for r in core}
    assert {"numpy", "polars", "pyarrow", "numba", "ortools", "tqdm"} <= names
    assert not names & TORCH_RELATED, f"core (fsdata) must not need torch: {sorted(names & TORCH_RELATED)}"
    for r in core:
        ops = {s.operator for s in r.specifier}
        assert ">=" in ops, f"{r}: every core dependency needs a tested lower bound (>=)"
        assert not ops & {"==", "===", "~="}, f"{r}: pins belong in constraints.txt, pyproject holds ranges"


def test_every_requirement_is_a_range_and_pinned_in_constraints():
    pins = _constraints()
    for group, reqs in _requirements().items():
        for r in reqs:
            name = canonicalize_name(r.name)
            if name == "freescale":  # self-reference: train-cpu = freescale[train] + fbgemm-gpu-cpu
                continue
            assert not {s.operator for s in r.specifier} & {"==", "==="}, f"[{group}] {r}: exact pin in pyproject"
            assert name in pins, f"[{group}] {r} has no exact pin in constraints.txt (add `{name}==VERSION`)"
            assert r.specifier.contains(pins[name], prereleases=True), \
                f"[{group}] constraints.txt pins {name}=={pins[name]}, outside the range {r}"


def test_extras_do_not_force_an_fbgemm_build():
    reqs = _requirements()
    names = {g: {canonicalize_name(r.name) for r in rs} for g, rs in reqs.items()}
    assert "torch" in names["train"] and not {"fbgemm-gpu", "fbgemm-gpu-cpu"} & names["train"]
    assert "fbgemm-gpu-cpu" in names["train-cpu"] and "fbgemm-gpu" not in names["train-cpu"]
    assert "fbgemm-gpu" in names["train-cuda"] and "fbgemm-gpu-cpu" not in names["train-cuda"]
    for extra in ("train-cpu", "train-cuda"):  # the pair itself: tests/fstrain/test_compat.py
        assert any(r.name == "freescale" and r.extras == {"train"} for r in reqs[extra])
    assert {"ray", "test"} <= set(reqs)


def test_makefile_installs_with_the_constraints():
    mk = (REPO_ROOT / "Makefile").read_text()
    install = [ln for ln in mk.splitlines() if "pip install" in ln and "--upgrade pip" not in ln]
    assert install and all("-c $(CONSTRAINTS)" in ln for ln in install), install
    assert "CONSTRAINTS := constraints.txt" in mk and "$(STAMP): pyproject.toml $(CONSTRAINTS)" in mk
    assert any("--no-deps torchrec" in ln for ln in install) and "torchrec" in _constraints()


def test_fsdata_sources_never_import_torch():
    """Static: no import of torch & co anywhere in fsdata/, also inside functions."""
    bad = []
    for path in sorted((REPO_ROOT / "fsdata").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} {m}" for m in mods
                    if m.split(".")[0] in BLOCKED_MODULES]
    assert not bad, bad


# `sys.modules[name] = None` is how Python spells "not installed" for both `import` (ImportError)
# and `importlib.util.find_spec` (None, which polars uses to probe for torch); a meta-path hook
# that raises would also break those probes, which a real torch-free venv does not.
_BLOCK = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
"""

_BLOCKED_RUN = _BLOCK + """
import importlib, pkgutil
from pathlib import Path
import fsdata, fsdata.cli
for m in pkgutil.walk_packages(fsdata.__path__, "fsdata."):
    if m.name != "fsdata.__main__":  # runs the CLI
        importlib.import_module(m.name)
for name in getattr(fsdata, "__all__", []):
    getattr(fsdata, name)
from tests.fsdata.helpers import write_samples
write_samples(Path({inp!r}), n=300, seed=1)
rc = fsdata.cli.main(["balance", {inp!r}, {out!r}, "--ranks", "2", "--batch-size-per-rank", "8", "--no-progress"])
assert rc == 0, rc
loaded = [m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in {blocked!r}]
assert not loaded, loaded
print("ok")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_fsdata_imports_and_balances_with_torch_blocked(tmp_path):
    """Runtime: every fsdata module imports, and a real balance runs, with torch & co absent."""
    r = _run(_BLOCKED_RUN.format(blocked=BLOCKED_MODULES, inp=str(tmp_path / "in.parquet"),
                                 out=str(tmp_path / "out")))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert (tmp_path / "out").is_dir()


def test_blocking_really_blocks():
    """The block above must be able to fail: fstrain.data needs torch, so it cannot import."""
    r = _run(_BLOCK.format(blocked=("torch",)) + "import fstrain.data\n")
    assert r.returncode != 0 and "import of torch halted" in r.stderr, r.stderr[-2000:]


_ALLOCATOR_RUN = """
import os, sys
import fsdata
assert "pyarrow" not in sys.modules, "importing fsdata loaded pyarrow"
import fsdata.cli
import pyarrow as pa
print(os.environ.get("MIMALLOC_PURGE_DELAY"), pa.default_memory_pool().backend_name, fsdata.BalanceSettings.__name__)
"""


def test_cli_sets_arrows_allocator_before_pyarrow_loads():
    """Importing the package does not load pyarrow, so ``fsdata.cli`` can set mimalloc's purge
    delay (read when pyarrow loads) first; the public names still resolve; a user's value wins."""
    env = {k: v for k, v in os.environ.items() if k != "MIMALLOC_PURGE_DELAY"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _ALLOCATOR_RUN], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "-1" and r.stdout.split()[2] == "BalanceSettings", r.stdout
    r = subprocess.run([sys.executable, "-c", _ALLOCATOR_RUN], capture_output=True, text=True,
                       env={**env, "MIMALLOC_PURGE_DELAY": "10"}, timeout=300)
    assert r.returncode == 0 and r.stdout.split()[0] == "10", (r.stdout, r.stderr[-2000:])
