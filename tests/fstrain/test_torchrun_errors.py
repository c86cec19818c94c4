"""User errors of ``fstrain train`` under torchrun: printed once, by rank 0, as the first error line; every
worker exits 2; torchrun's ChildFailedError summary shows the line, not a worker traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fstrain.distributed import launch
from tests.fstrain.shards import write_shards

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
LINE = re.compile(r"^fstrain train: error: ")


def _torchrun(*args: str, cwd: str) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "fstrain.cli", "train", *args,
           "--backend", "gloo", "--pipeline", "none", "--embedding-dim", "16", "--num-layers", "1",
           "--num-negatives", "8", "--log-every-steps", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})


def _check_one_line(out: subprocess.CompletedProcess, expect: str) -> str:
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    ours = [x for x in text.splitlines() if LINE.match(x)]
    assert len(ours) == 1 and expect in ours[0], text  # printed once (rank 0)
    first_error = next(x for x in text.splitlines() if "error:" in x.lower() and not x.startswith(("W", "I")))
    assert first_error == ours[0], text
    summary = text[text.index("ChildFailedError"):]
    assert f"traceback : {ours[0]}" in summary, text  # torchrun's summary shows our line
    # rank 1 exits 2 too, or, when torchrun stopped it before it got as far, shows torchrun's SIGTERM
    assert set(re.findall(r"exitcode\s+: (\S+)", summary)) <= {"2", "-15"}, summary
    root = summary[summary.index("Root Cause"):]
    assert "rank      : 0" in root and f"traceback : {ours[0]}" in root, summary  # rank 0 failed first
    assert "fstrain/train.py" not in text and "fstrain/cli.py" not in text, text  # no worker traceback
    return ours[0]


@pytest.mark.multiproc
def test_a_bad_setting_is_one_line_from_rank_0(tmp_path):
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=2, batch_size_per_rank=4, num_items=50)
    out = _torchrun(shards, "--num-items", "10", "--max-steps", "2", cwd=str(tmp_path))
    _check_one_line(out, "but the model has num_items 10 (--num-items); pass --num-items")
    out = _torchrun(shards, "--max-steps", "0", cwd=str(tmp_path))  # refused by the flags' check
    _check_one_line(out, "--max-steps must be >= 1, got 0")
    out = _torchrun(shards, "--max-stepz", "2", cwd=str(tmp_path))  # a usage error of the parser
    _check_one_line(out, "unrecognized arguments: --max-stepz")


@pytest.mark.multiproc
def test_a_shard_only_rank_1_can_read_is_one_line_from_rank_0(tmp_path):
    """Rank 1's file is corrupt: the ranks agree on its message (after init), rank 0 prints it once."""
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=2, batch_size_per_rank=4, num_items=50)
    manifest = json.load(open(os.path.join(shards, "_manifest.json")))
    path = os.path.join(shards, manifest["files"][1]["path"])
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    out = _torchrun(shards, "--num-items", "50", "--max-steps", "2", cwd=str(tmp_path))
    _check_one_line(out, "rank 1: ")


def test_report_user_error_prints_on_rank_0_and_writes_the_error_file(tmp_path, monkeypatch, capsys):
    err = tmp_path / "e" / "error.json"
    monkeypatch.setenv(launch.ERROR_FILE_ENV, str(err))
    monkeypatch.setenv("RANK", "1")
    launch.report_user_error("fstrain train: error: x")
    assert capsys.readouterr().err == ""  # rank 1 stays quiet on an every-rank error
    assert json.loads(err.read_text())["message"] == "fstrain train: error: x"
    launch.report_user_error("fstrain train: error: y", rank_local=True)
    assert capsys.readouterr().err == "fstrain train: error: y\n"
    monkeypatch.setenv("RANK", "0")
    launch.report_user_error("fstrain train: error: z")
    assert capsys.readouterr().err == "fstrain train: error: z\n"
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(err))
    assert failure.message == "fstrain train: error: z" and failure.timestamp > 0  # what torchrun's summary reads


def test_parse_once_holds_a_usage_error_back_on_other_ranks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(launch.ERROR_FILE_ENV, str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "1")

    def bad():
        print("usage: fstrain train ...", file=sys.stderr)
        print("fstrain train: error: unrecognized arguments: --nope", file=sys.stderr)
        raise SystemExit(2)

    with pytest.raises(SystemExit):
        launch.parse_once(bad)
    assert capsys.readouterr().err == ""
    assert "unrecognized arguments: --nope" in json.loads((tmp_path / "error.json").read_text())["message"]
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        launch.parse_once(bad)
    assert "unrecognized arguments" in capsys.readouterr().err


def test_a_deferring_rank_rewrites_its_error_file_as_it_exits(tmp_path):
    """Rank 1 reports early but exits late: its error file's timestamp must not predate rank 0's
    (torchrun's "Root Cause" is the earliest timestamp), so it is re-written at exit."""
    err = tmp_path / "error.json"
    code = (
        "import time\n"
        "from fstrain.distributed import launch\n"
        "launch.RANK0_GRACE_SECONDS = 2.5\n"
        "def fn():\n"
        "    launch.report_user_error('fstrain train: error: x')\n"
        "    print(int(time.time()), flush=True)\n"
        "    return 2\n"
        "launch.run_recorded(fn)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO, "RANK": "1", launch.ERROR_FILE_ENV: str(err)})
    assert out.returncode == 2, out.stderr
    reported = int(out.stdout.strip())
    data = json.loads(err.read_text())
    assert data["message"] == "fstrain train: error: x" and data["timestamp"] >= reported + 2, data
