"""Install check: fresh virtual environments built with docs/api.md's exact install lines.

Slow (a few minutes: PyPI downloads, warm pip cache about 2 minutes per environment), so marked
``slow``; ``make check-install`` runs this file alone. Nothing here downloads a CUDA wheel: the
environments take torch's CPU build (from PyTorch's CPU index, or where that cannot be reached, the
local wheel this machine's pip configuration finds), and the CUDA extra is only resolved
(``pip install --dry-run --report``: metadata, no wheels).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from fstrain.compat import FBGEMM_FOR_TORCH, release_line
from tests.conftest import REPO_ROOT
from tests.docs_blocks import block, commands

pytestmark = pytest.mark.slow

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Distributions that only a CUDA build pulls in.
CUDA_ONLY = re.compile(r"^(nvidia-.*|triton|fbgemm-gpu|cuda-.*)$")


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def cpu_index() -> bool:
    ok = _reachable(CPU_INDEX)
    if not ok:
        print(f"\n{CPU_INDEX} cannot be reached: installing without --extra-index-url (pip's configured "
              "find-links must hold the torch CPU wheel)")
    return ok


def _pip_args(line: str, cpu_index: bool) -> list[str]:
    """A documented ``pip install ...`` line as arguments for ``python -m pip``: ``.`` is this checkout.

    ``--no-compile`` is added: it only skips writing ``.pyc`` files (torch has thousands), which
    halves the time to install and to delete the environment; what is resolved and installed is
    the same.
    """
    args = shlex.split(line)
    assert args[:2] == ["pip", "install"], line
    out = ["install", "--no-compile"]
    for a in args[2:]:
        if a == "." or a.startswith(".["):
            a = str(REPO_ROOT) + a[1:]
        out.append(a)
    if not cpu_index and "--extra-index-url" in out:
        i = out.index("--extra-index-url")
        assert out[i + 1] == CPU_INDEX
        del out[i:i + 2]
    return out


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS", "NUMBA_CACHE_DIR")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, **kw)
    return r


def _resolve(python: str, line: str, cpu_index: bool, tmp: Path) -> dict[str, str]:
    """Dry-run a documented install line as if nothing were installed: distribution -> version."""
    report = tmp / "report.json"
    r = _run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
              *_pip_args(line, cpu_index)[2:]])
    assert r.returncode == 0, r.stderr[-3000:]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]}


def _check_pair(resolved: dict[str, str], fbgemm: str) -> None:
    torch = resolved["torch"]
    assert release_line(torch) in FBGEMM_FOR_TORCH, f"torch {torch} is not a line of fstrain/compat.py"
    assert release_line(resolved[fbgemm]) == FBGEMM_FOR_TORCH[release_line(torch)], \
        f"{fbgemm} {resolved[fbgemm]} does not belong to torch {torch}"


def test_resolution_pairs_torch_and_fbgemm(cpu_index, tmp_path):
    """Without torch installed: [train-cpu] picks the CPU torch and its fbgemm-gpu-cpu; [train-cuda]
    pairs fbgemm-gpu with torch the same way (metadata only)."""
    cpu = _resolve(sys.executable, commands("install-cpu")[0], cpu_index, tmp_path)
    if not cpu["torch"].endswith("+cpu"):
        pytest.skip(f"neither {CPU_INDEX} nor a local torch CPU wheel is available (resolved torch {cpu['torch']})")
    _check_pair(cpu, "fbgemm-gpu-cpu")
    assert not [d for d in cpu if CUDA_ONLY.match(d)], sorted(cpu)
    assert "torchrec" not in cpu  # installed with --no-deps by the next documented line
    cuda = _resolve(sys.executable, commands("install-cuda")[1], cpu_index, tmp_path)
    _check_pair(cuda, "fbgemm-gpu")
    assert "fbgemm-gpu-cpu" not in cuda


_IMPORTS = ("import sys, fsdata, fstrain.data, fstrain.train, torch, fbgemm_gpu, torchrec; "
            "print(fsdata.__file__); print(torch.__version__)")


def _fresh_install(tmp: Path, cpu_index: bool, *, torch_first: bool) -> None:
    venv = tmp / "venv"
    before = set(os.listdir(REPO_ROOT))
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    py = str(venv / "bin" / "python")
    if torch_first:  # the torch 2.13 CPU build, as the Makefile installs it (constraints.txt's pin)
        r = _run([py, "-m", "pip", "install", "--quiet", "--no-compile", "torch==2.13.0"])
        assert r.returncode == 0, r.stderr[-3000:]
        assert _run([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip().endswith("+cpu")
    else:
        planned = _resolve(py, commands("install-cpu")[0], cpu_index, tmp)
        if not planned["torch"].endswith("+cpu"):  # never fetch the CUDA build and its GBs of wheels
            pytest.skip(f"neither {CPU_INDEX} nor a local torch CPU wheel is available")
    for line in commands("install-cpu"):
        r = _run([py, "-m", "pip", *_pip_args(line, cpu_index)])
        assert r.returncode == 0, f"{line}\n{r.stderr[-3000:]}"
    r = _run([py, "-c", _IMPORTS], cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    where, torch_version = r.stdout.split()
    assert where.startswith(str(venv)) and torch_version.startswith("2.13.") and torch_version.endswith("+cpu")
    assert r.stderr == "", r.stderr[-2000:]
    # pip check: torchrec's own metadata only (docs/api.md says why), nothing else
    r = _run([py, "-m", "pip", "check"])
    lines = sorted(r.stdout.strip().splitlines())
    assert len(lines) == 2, r.stdout
    assert re.fullmatch(r"torchrec 1\.9\.2 has requirement torchmetrics==1\.0\.3, "
                        r"but you have torchmetrics 1\.9\.\S+\.", lines[0]), lines
    assert lines[1] == "torchrec 1.9.2 requires fbgemm-gpu, which is not installed.", lines
    # the example of docs/api.md, as written, with the installed package
    work = tmp / "example"
    work.mkdir()
    r = _run([py, "-c", block("example")], cwd=work)
    assert r.returncode == 0 and r.stdout.splitlines()[1].startswith("rank 0: "), r.stderr[-3000:]
    new = set(os.listdir(REPO_ROOT)) - before
    assert not {n for n in new if n == "build" or n.endswith(".egg-info")}, f"pip install . left {sorted(new)}"


@pytest.fixture
def scratch():
    d = Path(tempfile.mkdtemp(prefix="freescale-install-", dir="/tmp" if os.path.isdir("/tmp") else None))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def test_fresh_venv_on_top_of_cpu_torch(cpu_index, scratch):
    _fresh_install(scratch, cpu_index, torch_first=True)


def test_fresh_venv_without_torch(cpu_index, scratch):
    _fresh_install(scratch, cpu_index, torch_first=False)


def test_fbgemm_of_another_torch_is_refused_with_the_fix(scratch):
    """The break the pairing prevents, for real: fbgemm-gpu-cpu 1.9 (PyPI) next to this torch 2.13."""
    import torch
    if release_line(torch.__version__) != "2.13":
        pytest.skip(f"the 1.9-next-to-2.13 case needs torch 2.13, this is {torch.__version__}")
    r = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target",
              str(scratch / "fb19"), "fbgemm-gpu-cpu==1.9.0"])
    assert r.returncode == 0, r.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch / "fb19"), str(REPO_ROOT)])}
    r = subprocess.run([sys.executable, "-c", "import fbgemm_gpu"], capture_output=True, text=True, env=env,
                       timeout=300, cwd=scratch)
    assert r.returncode != 0 and "Could not load this library" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", "import fstrain.data"], capture_output=True, text=True, env=env,
                       timeout=300, cwd=scratch)
    assert r.returncode != 0, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "ImportError: fbgemm-gpu-cpu 1.9.0 is not built for torch " + torch.__version__ + " (torch 2.13 needs "
        "fbgemm-gpu-cpu 1.8.*); install the pair with pip install 'fbgemm-gpu-cpu==1.8.*' or pip install "
        "'freescale[train-cpu]' (docs/api.md)"), r.stderr[-2000:]
