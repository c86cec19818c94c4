"""docs/api.md matches pyproject.toml, and its example runs exactly as written."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO_ROOT
from tests.docs_blocks import block, commands, extras_table


def _declared() -> dict[str, list[str]]:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        p = tomllib.load(f)["project"]
    out = {"core": p["dependencies"], **p["optional-dependencies"]}
    # the self-reference freescale[train] is written [train] in the table
    return {g: [f"[{','.join(sorted(Requirement(r).extras))}]" if Requirement(r).name == "freescale" else r
                for r in reqs] for g, reqs in out.items()}


def test_extras_table_matches_pyproject():
    table, declared = extras_table(), _declared()
    assert set(table) == set(declared), f"extras in docs/api.md {sorted(table)} != pyproject {sorted(declared)}"
    for extra, reqs in declared.items():
        assert table[extra] == reqs, f"[{extra}]: docs/api.md lists {table[extra]}, pyproject.toml {reqs}"


def test_install_blocks_name_the_documented_pieces():
    cpu, cuda = commands("install-cpu"), commands("install-cuda")
    assert cpu[0] == "pip install '.[train-cpu]' --extra-index-url https://download.pytorch.org/whl/cpu"
    assert cpu[1] == cuda[-1] == "pip install --no-deps torchrec==1.9.2"
    pin = [ln for ln in (REPO_ROOT / "constraints.txt").read_text().splitlines() if ln.startswith("torchrec==")]
    assert pin == ["torchrec==1.9.2"], "the documented torchrec must be the tested one (constraints.txt)"
    assert "'.[train-cuda]'" in cuda[1] and commands("install-core") == ["pip install ."]


@pytest.mark.slow  # a real convert, balance and 230 training steps (about 20-40 s on 2 cores)
def test_example_runs_as_written(tmp_path):
    code = block("example")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].endswith("%") and " x 2 ranks, predicted bubble " in lines[0], r.stdout
    assert lines[1].startswith("rank 0: ") and "last loss" in lines[1], r.stdout
    assert (tmp_path / "freescale-example" / "shards" / "_manifest.json").exists()
    assert r.stderr == "", r.stderr[-3000:]  # quiet: no library noise on the way
