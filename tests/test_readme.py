"""README.md's "Using it" commands run as written (on the first 300 users of MovieLens-1M, their first 128 items).

Only the dataset path is replaced (by that head of the same file) and ``.venv/bin/`` points at
the interpreter running the tests; everything else, including the folders the commands create,
is the README's text.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, dataset_path

ML1M_IN_README = "../shared/datasets/ml-1m_ensfm/sequences.txt"
#: The head of MovieLens-1M the commands run on: its first users, each cut to their first items
#: (the user id, then up to HEAD_ITEMS items; 300 x 128: 24.7k per-event samples, 3 steps at 256 x 32).
HEAD_USERS, HEAD_ITEMS = 300, 128


def readme_commands(readme: Path = REPO_ROOT / "README.md") -> list[str]:
    """The shell commands of the first code block under '## Using it', continuation lines joined."""
    text = readme.read_text()
    block = re.search(r"## Using it.*?```\n(.*?)```", text, re.S)
    assert block, "README.md has no code block under '## Using it'"
    joined = block.group(1).replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_block_is_parsed():
    cmds = readme_commands()
    assert any(c.startswith(".venv/bin/fsdata report") for c in cmds)
    assert all(c.startswith((".venv/bin/", "make ")) for c in cmds)


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    src = dataset_path("ml-1m_ensfm/sequences.txt")
    head = tmp_path / "ml1m-head.txt"
    with open(src) as f:  # each user's first HEAD_ITEMS items: the commands' work (training, replay, calibration
        # from the shards) grows with the lengths, which this test does not check
        head.write_text("".join(" ".join(next(f).split()[:HEAD_ITEMS + 1]) + "\n" for _ in range(HEAD_USERS)))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    for cmd in readme_commands():
        if cmd.startswith("make "):
            continue
        cmd = cmd.replace(ML1M_IN_README, str(head)).replace(".venv/bin/", f"{bin_dir}/")
        proc = subprocess.run(["bash", "-c", cmd],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{cmd}\n{proc.stderr[-3000:]}"
    for made in ("shards-report.html", "run/report.html", "run/step_times.parquet", "calibrated.json",
                 "calibrated-16ranks", "nightly/latest"):
        assert (tmp_path / made).exists(), made
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
