"""The torch <-> fbgemm pairing: one table, the extras of pyproject.toml, and the check at import."""

from __future__ import annotations

import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from fstrain import compat
from tests.conftest import REPO_ROOT


def test_extras_pin_a_pair_of_the_table():
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for extra, dist in (("train-cpu", "fbgemm-gpu-cpu"), ("train-cuda", "fbgemm-gpu")):
        reqs = {Requirement(r).name: Requirement(r).specifier for r in extras[extra]}
        torch_ok = [line for line in compat.FBGEMM_FOR_TORCH if Version(f"{line}.0") in reqs["torch"]
                    and Version(f"{line}.99") in reqs["torch"]]
        assert len(torch_ok) == 1, f"[{extra}] must allow exactly one torch line of the table: {reqs['torch']}"
        for line, fb in compat.FBGEMM_FOR_TORCH.items():  # no other torch line slips in
            if line != torch_ok[0]:
                assert Version(f"{line}.0") not in reqs["torch"]
        want = compat.FBGEMM_FOR_TORCH[torch_ok[0]]
        assert Version(f"{want}.0") in reqs[dist] and Version(f"{want}.99") in reqs[dist]
        major, minor = map(int, want.split("."))
        assert Version(f"{major}.{minor + 1}.0") not in reqs[dist], \
            f"[{extra}] {dist} must stop before {major}.{minor + 1}"


def test_installed_pair_matches():
    """This environment (constraints.txt) holds a pair of the table, so the import-time check passes."""
    torch_version, fbgemm = compat.installed_pair()
    assert torch_version is not None and fbgemm, "fstrain tests need torch and an fbgemm build"
    compat.check_fbgemm_matches_torch()


def test_wrong_pair_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(compat, "installed_pair", lambda: ("2.13.0+cpu", [("fbgemm-gpu-cpu", "1.9.0")]))
    with pytest.raises(ImportError, match=r"^fbgemm-gpu-cpu 1\.9\.0 is not built for torch 2\.13\.0\+cpu .*"
                                          r"pip install 'fbgemm-gpu-cpu==1\.8\.\*'"):
        compat.check_fbgemm_matches_torch()
    monkeypatch.setattr(compat, "installed_pair", lambda: ("2.99.0", [("fbgemm-gpu", "1.9.0")]))
    compat.check_fbgemm_matches_torch()  # a torch line the table does not know: not judged
