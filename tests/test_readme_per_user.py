"""README.md's per-user training and evaluation block runs without ``--num-items`` on a leave-one-out split in
which an item appears only as a held-out target, on a head of every dataset of ../shared/datasets: with no
``num_items`` in the manifest (the key taken out: the one the evaluation file records is used) and with the one
``fsdata convert`` + ``fsdata balance`` record in the manifest, each on some of the datasets.

The block's commands are the README's text; only the dataset path (a head of the dataset with one
held-out-only item appended), the convert line's ``--format`` for event logs (as docs/fsdata.md shows) and
``.venv/bin/`` are replaced.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO_ROOT, dataset_path
from tests.test_readme import ML1M_IN_README, readme_commands

SEQUENCE_DATASETS = ("ml-1m_ensfm/sequences.txt", "s3rec_sports_and_outdoors/Sports_and_Outdoors.txt",
                     "s3rec_toys_and_games/Toys_and_Games.txt")


def per_user_block() -> list[str]:
    """The README's per-user commands: from the ``--samples per-user`` convert through ``fstrain evaluate``."""
    cmds = readme_commands()
    first = next(i for i, c in enumerate(cmds) if "--samples per-user" in c and "fsdata convert" in c)
    last = next(i for i, c in enumerate(cmds) if "fstrain evaluate" in c)
    return cmds[first:last + 1]


def held_out_only_split(src: Path, dst: Path, num_users: int = 300) -> int:
    """The first ``num_users`` lines of ``src`` with a new item id appended to one user's history, so that the
    item exists only as that user's held-out (last) item; returns the new id."""
    with open(src) as f:
        lines = [next(f).split() for _ in range(num_users)]
    new = max(int(x) for ln in lines for x in ln[1:]) + 1
    user = next(i for i, ln in enumerate(lines) if len(ln) >= 4)
    lines[user].append(str(new))
    dst.write_text("".join(" ".join(ln) + "\n" for ln in lines))
    return new


def held_out_only_events(src: Path, dst: Path, num_lines: int, csv: bool) -> int:
    """The first ``num_lines`` event lines of ``src`` (a ``user item`` log, or the ``userId,Id,rating,timestamp``
    CSV with its header) plus one event of a new item, the last event of the first user with 3 events;
    returns the new id."""
    with open(src) as f:
        head = [next(f) for _ in range(num_lines + (1 if csv else 0))]
    rows = [ln.strip().split("," if csv else None) for ln in head[1 if csv else 0:]]
    new = max(int(r[1]) for r in rows) + 1
    users = [r[0] for r in rows]
    user = next(u for u in users if users.count(u) >= 3)
    last = max(int(r[3]) for r in rows) + 1 if csv else None
    extra = f"{user},{new},5.0,{last}\n" if csv else f"{user} {new}\n"
    dst.write_text("".join(head) + extra)
    return new


#: dataset -> the README convert line's ``--format sequences`` as docs/fsdata.md adapts it for that file
CONVERT_FORMAT = {"amazon-beauty_bert4rec/beauty.txt": "--format events",
                  "ml-latest-small/ratings.csv": "--format events --user-col userId --item-col Id --time-col timestamp"}


def test_per_user_block_is_parsed():
    cmds = per_user_block()
    assert [c.split()[0].rsplit("/", 1)[-1] for c in cmds] == ["fsdata", "fsdata", "torchrun", "fstrain"]
    assert all("--num-items" not in c for c in cmds)


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{cmd}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("dataset,recorded", [(SEQUENCE_DATASETS[0], True), (SEQUENCE_DATASETS[1], False),
                                              (SEQUENCE_DATASETS[2], True),
                                              *zip(CONVERT_FORMAT, (False, True))])
def test_readme_per_user_block_needs_no_num_items(tmp_path, dataset, recorded):
    data = tmp_path / ("head.csv" if dataset.endswith(".csv") else "head.txt")
    if dataset in CONVERT_FORMAT:
        csv = dataset.endswith(".csv")
        new = held_out_only_events(dataset_path(dataset), data, 20000 if csv else 3000, csv)
    else:
        new = held_out_only_split(dataset_path(dataset), data)
    bin_dir = Path(sys.executable).parent
    cmds = [c.replace(ML1M_IN_README, str(data)).replace(".venv/bin/", f"{bin_dir}/") for c in per_user_block()]
    cmds[0] = cmds[0].replace("--format sequences", CONVERT_FORMAT.get(dataset, "--format sequences"))
    convert, balance, train, evaluate = cmds
    _run(convert, tmp_path)
    ev = pq.read_table(tmp_path / "ml1m-eval.parquet")
    assert new in ev.column("target_item_id").to_pylist()
    train_items = pq.read_table(tmp_path / "ml1m-users.parquet").column("item_ids").combine_chunks().flatten()
    assert new not in set(train_items.to_pylist())  # only ever a held-out target
    _run(balance, tmp_path)
    manifest_path = tmp_path / "shards-train-2ranks" / "_manifest.json"
    raw = json.loads(manifest_path.read_text())
    assert raw["num_items"] == new + 1  # what fsdata convert records and fsdata balance carries
    if not recorded:  # shards of a writer that records none: the evaluation file's recorded num_items is used
        del raw["num_items"]
        manifest_path.write_text(json.dumps(raw, indent=1))
    source = "manifest" if recorded else "evaluation file metadata"
    train = re.sub(r"--max-steps \d+", "--max-steps 4", train).replace("--eval-every-steps 5", "--eval-every-steps 2")
    proc = _run(train, tmp_path)
    assert f"num_items {new + 1} ({source})" in proc.stderr, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "ckpt" / "step-00000004" / "fstrain.json").read_text())
    assert meta["model"]["num_items"] == new + 1
    out = _run(evaluate.replace("step-00000010", "step-00000004"), tmp_path)
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["num_candidates"] == new and res["num_users"] == ev.num_rows  # every id 1..new ranked
