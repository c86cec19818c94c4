"""Checkpoints load without executing code from them; a truncated one is one line (issue 35)."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fstrain.components.safe_dcp import UntrustedCheckpointError, check_checkpoint_files, safe_load
from fstrain.errors import FstrainError
from tests.fstrain.shards import write_shards

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_FLAGS = ["--embedding-dim", "16", "--num-layers", "1", "--num-heads", "2", "--num-negatives", "8",
               "--pipeline", "none", "--log-every-steps", "0"]


class _Touch:
    """Unpickling this runs ``touch PATH`` (what a crafted checkpoint would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _save(path, state) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_crafted_metadata_is_refused_and_not_run(tmp_path):
    ck, flag = tmp_path / "ck", tmp_path / "PWNED"
    _save(ck, {"w": torch.ones(3)})
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(_Touch(str(flag)), f)
    with pytest.raises(UntrustedCheckpointError, match="posix.system|os.system"):
        safe_load({"w": torch.zeros(3)}, str(ck))
    assert not flag.exists()


def test_crafted_non_tensor_entry_is_refused_and_not_run(tmp_path):
    """DCP's default planner unpickles non-tensor entries with weights_only=False; ours does not."""
    ck, flag = tmp_path / "ck", tmp_path / "PWNED"
    _save(ck, {"w": torch.ones(3), "extra": _Touch(str(flag))})  # pickling runs nothing
    assert not flag.exists()
    with pytest.raises(UntrustedCheckpointError, match="entry 'extra'.*GLOBAL (posix|os).system"):
        safe_load({"w": torch.zeros(3), "extra": None}, str(ck))
    assert not flag.exists()


def test_plain_entries_load(tmp_path):
    ck = tmp_path / "ck"
    _save(ck, {"w": torch.arange(4.0), "extra": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam"}})
    state = {"w": torch.zeros(4), "extra": {"lr": None, "betas": None, "name": None}}
    safe_load(state, str(ck))
    assert state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert state["extra"] == {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam"}


def test_truncated_or_garbled_checkpoint_is_one_error(tmp_path):
    ck = tmp_path / "ck"
    _save(ck, {"w": torch.ones(1000)})
    data = [n for n in os.listdir(ck) if n.endswith(".distcp")][0]
    shutil.copytree(ck, tmp_path / "short")
    os.truncate(tmp_path / "short" / data, 100)
    with pytest.raises(FstrainError, match="is truncated"):
        check_checkpoint_files(str(tmp_path / "short"))
    shutil.copytree(ck, tmp_path / "meta")
    os.truncate(tmp_path / "meta" / ".metadata", 50)
    with pytest.raises(FstrainError, match="corrupt or truncated"):
        check_checkpoint_files(str(tmp_path / "meta"))
    os.remove(ck / data)
    with pytest.raises(FstrainError, match="is missing"):
        check_checkpoint_files(str(ck))


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fstrain.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": REPO})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(root, shards, checkpoint dir)`` after ``fstrain train --max-steps 2`` on one rank."""
    root = tmp_path_factory.mktemp("ckpt")
    shards = write_shards(str(root / "s"), num_ranks=1, num_steps=4, batch_size_per_rank=8, seed=2)
    out = _cli("train", shards, "--max-steps", "2", "--checkpoint-dir", str(root / "ck"), *MODEL_FLAGS, cwd=root)
    assert out.returncode == 0, out.stderr
    return root, shards, root / "ck"


def _one_error_line(out) -> str:
    """The one error line of a failed command (fstrain's own INFO log records, e.g. ``num_items 50
    (inferred)`` before the checkpoint is opened, are progress, not part of the error)."""
    lines = [x for x in out.stderr.splitlines() if x.strip() and not re.match(r"^[\d-]+ [\d:,]+ INFO fstrain\.", x)]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.slow
def test_cli_refuses_crafted_metadata_on_evaluate_and_resume(trained, tmp_path):
    root, shards, ck = trained
    evil, flag = tmp_path / "ck", tmp_path / "PWNED"
    shutil.copytree(ck, evil)
    with open(evil / "step-00000002" / ".metadata", "wb") as f:
        pickle.dump(_Touch(str(flag)), f)
    from tests.fstrain.test_evaluate import _eval_file

    ev = _eval_file(tmp_path / "e.parquet")
    line = _one_error_line(_cli("evaluate", str(evil / "step-00000002"), ev, cwd=tmp_path))
    assert "refusing checkpoint" in line and "could run code" in line
    line = _one_error_line(_cli("train", shards, "--resume", "--checkpoint-dir", str(evil), *MODEL_FLAGS,
                                cwd=tmp_path))
    assert "refusing checkpoint" in line
    assert not flag.exists()


@pytest.mark.slow
def test_cli_resume_works_and_truncated_checkpoint_is_one_line(trained, tmp_path):
    root, shards, ck = trained
    good = tmp_path / "good"
    shutil.copytree(ck, good)
    out = _cli("train", shards, "--resume", "--max-steps", "3", "--checkpoint-dir", str(good), *MODEL_FLAGS,
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "global step 2, step 2 of these shards" in out.stderr and (good / "step-00000003" / "fstrain.json").exists()
    short = tmp_path / "short"
    shutil.copytree(ck, short)
    data = short / "step-00000002" / "__0_0.distcp"
    os.truncate(data, os.path.getsize(data) // 2)
    line = _one_error_line(_cli("train", shards, "--resume", "--checkpoint-dir", str(short), *MODEL_FLAGS,
                                cwd=tmp_path))
    assert "is truncated" in line


@pytest.mark.slow
def test_cli_resume_on_other_shards_names_init_from_which_works(trained, tmp_path):
    root, shards, ck = trained
    other = write_shards(str(tmp_path / "other"), num_ranks=1, num_steps=3, batch_size_per_rank=8, seed=7)
    mine = tmp_path / "ck"
    shutil.copytree(ck, mine)
    line = _one_error_line(_cli("train", other, "--resume", "--checkpoint-dir", str(mine), *MODEL_FLAGS,
                                cwd=tmp_path))
    assert "other shards" in line and f"--init-from {mine}" in line
    out = _cli("train", other, "--init-from", str(mine), "--checkpoint-dir", str(tmp_path / "ck2"), "--max-steps", "1",
               "--num-items", "60", *MODEL_FLAGS, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "starting from the weights of" in out.stderr and (tmp_path / "ck2" / "step-00000001").is_dir()
    line = _one_error_line(_cli("train", other, "--init-from", str(mine), "--checkpoint-dir", str(mine / "x"),
                                *MODEL_FLAGS, cwd=tmp_path))
    assert "--checkpoint-dir" in line and "--init-from" in line
