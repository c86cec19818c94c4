"""The nightly job never publishes mislabelled or incomplete runs (issue 19, items 4, 5, 13):
the run key names the bytes read, ``latest`` names a complete run at every kill point, stale
temporaries are cleaned, and ``--rollback`` takes complete published-style runs only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fsdata.shards.verify import verify
from pipelines import nightly
from pipelines.nightly import check_run, run_key, run_nightly
from tests.pipelines.helpers import at, nightly_config
from tests.fsdata.helpers import write_samples

FAST = dict(format="samples", num_ranks=4, batch_size_per_rank=8, partitioner="lpt-swap")


def _latest(work: Path) -> Path:
    return Path(os.path.realpath(work / "latest"))


def _hidden(work: Path) -> list[str]:
    return sorted([p.name for p in (work / "runs").iterdir() if p.name.startswith(".")] +
                  [p.name for p in work.iterdir() if p.name.startswith(".") and ".tmp" in p.name])


def test_input_replaced_mid_run_is_published_under_the_key_of_the_bytes_read(tmp_path, monkeypatch):
    a = write_samples(tmp_path / "a.parquet", n=400, seed=1)
    b_bytes = write_samples(tmp_path / "b.parquet", n=400, seed=2).read_bytes()
    a_bytes = a.read_bytes()
    cfg = nightly_config(input=str(a), **FAST)
    key_a = run_key(cfg)
    real = nightly.job.balance

    def replace_input_then_balance(*args, **kwargs):
        a.write_bytes(b_bytes)  # the input is replaced while the run works
        return real(*args, **kwargs)

    monkeypatch.setattr(nightly.job, "balance", replace_input_then_balance)
    r = run_nightly(at(cfg, tmp_path / "work"))
    monkeypatch.undo()
    a.write_bytes(a_bytes)
    assert r["run_key"] == key_a and r["published"]  # built from the copy taken when it was hashed: A
    verify(_latest(tmp_path / "work") / "shards", str(a), progress=False)  # the published bytes are A's
    assert not (Path(r["run_dir"]) / nightly.SNAPSHOT_NAME).exists()


def test_input_replaced_after_hashing_is_keyed_by_what_was_read(tmp_path, monkeypatch):
    a = write_samples(tmp_path / "a.parquet", n=400, seed=1)
    b = write_samples(tmp_path / "b.parquet", n=400, seed=2)
    a_bytes = a.read_bytes()
    cfg = nightly_config(input=str(a), **FAST)
    key_a = run_key(cfg)
    real = nightly.store.clean_unfinished

    def replace_after_hashing(*args, **kwargs):
        a.write_bytes(b.read_bytes())
        return real(*args, **kwargs)

    monkeypatch.setattr(nightly.store, "clean_unfinished", replace_after_hashing)
    r = run_nightly(at(cfg, tmp_path / "work"))
    monkeypatch.undo()
    key_b = run_key(cfg)  # a.parquet now holds B's bytes
    assert r["run_key"] == key_b != key_a  # B's bytes, B's key: never published as A
    a.write_bytes(a_bytes)
    r2 = run_nightly(at(cfg, tmp_path / "work"))
    assert not r2["skipped"] and r2["run_key"] == key_a  # A is built, not "up to date" with B's output
    verify(_latest(tmp_path / "work") / "shards", str(a), progress=False)


_KILL = r"""
import os, sys
from pathlib import Path
from pipelines import nightly
from tests.pipelines.helpers import at, nightly_config
point, inp, work, ranks = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
real_replace, real_exchange = os.replace, nightly.store.exchange
def die():
    os._exit(9)
def replace(src, dst):
    s, d = Path(src).name, Path(dst).name
    if point == "stage-rename" and s.startswith(".") and ".tmp-" in s and len(d) == 16:
        die()
    if point == "publish" and d == "latest":
        die()
    if point == "fallback-between" and ".old-" in d:
        real_replace(src, dst)
        die()
    return real_replace(src, dst)
os.replace = replace
def exchange(a, b):
    if point == "before-exchange":
        die()
    if point == "fallback-between":
        return False
    done = real_exchange(a, b)
    if point == "after-exchange":
        die()
    return done
nightly.store.exchange = exchange
nightly.run_nightly(at(nightly_config(input=inp, format="samples", num_ranks=ranks, batch_size_per_rank=8,
                                      partitioner="lpt-swap"), work))
sys.exit(0)
"""


def _run_killed(point: str, inp: Path, work: Path, ranks: int, cwd: Path) -> int:
    import fsdata

    root = str(Path(fsdata.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _KILL, point, str(inp), str(work), str(ranks)], cwd=cwd, env=env,
                          capture_output=True).returncode


def _complete(run: Path) -> bool:
    return run.is_dir() and (run / nightly.SUCCESS_NAME).exists() and (run / "shards" / "_manifest.json").exists()


@pytest.mark.parametrize("point, rebuild", [
    ("stage-rename", False), ("publish", False),
    ("before-exchange", True), ("after-exchange", True), ("fallback-between", True),
])
def test_latest_names_a_complete_run_at_every_kill_point(tmp_path, point, rebuild):
    inp = write_samples(tmp_path / "in.parquet", n=512)
    work = tmp_path / "work"
    good = run_nightly(at(nightly_config(input=str(inp), **FAST), work))
    ranks = 4
    if rebuild:  # a published run whose files changed: the next run with its settings rebuilds it in place
        profile = Path(good["run_dir"]) / "profile.json"
        profile.write_text(profile.read_text() + " ")
        assert check_run(good["run_dir"]) is not None
    else:
        ranks = 2  # other settings: a new run, then a publish
    assert _run_killed(point, inp, work, ranks, tmp_path) == 9
    if point == "fallback-between":
        # two renames without an atomic exchange: killed between them, the previous run lies aside ...
        assert not Path(good["run_dir"]).exists()
        nightly.store.clean_unfinished(work / "runs", None)  # ... and the next run puts it back first
        assert _complete(Path(good["run_dir"]))
    assert _complete(_latest(work)), f"latest does not name a complete run after a kill at {point}"
    r = run_nightly(at(nightly_config(input=str(inp), **{**FAST, "num_ranks": ranks}), work))
    assert r["published"] and _latest(work) == Path(r["run_dir"]).resolve() and check_run(r["run_dir"]) is None
    assert _hidden(work) == []  # stale .tmp/.old runs and .latest.tmp-PID are cleaned
    verify(_latest(work) / "shards", str(inp), progress=False)


def test_killed_complete_run_is_kept_not_rebuilt(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=512)
    work = tmp_path / "work"
    assert _run_killed("stage-rename", inp, work, 4, tmp_path) == 9
    r = run_nightly(at(nightly_config(input=str(inp), **FAST), work))
    assert r["skipped"] and r["published"]  # the complete staging folder was moved in, not rebuilt


def test_rollback_refuses_a_staging_folder(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=512)
    work = tmp_path / "work"
    good = run_nightly(at(nightly_config(input=str(inp), **FAST), work))
    key = good["run_key"]
    stage = work / "runs" / f".{key}.tmp-999999-abcdef12"
    shutil.copytree(good["run_dir"], stage)  # what a run killed before its rename leaves
    capsys.readouterr()
    assert nightly.main(["--output", str(work), "--rollback", stage.name]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a run key" in err and len(err.splitlines()) == 1
    assert nightly.main(["--output", str(work), "--rollback", key]) == 0
    assert pq.read_metadata(_latest(work) / "shards" / "rank-00000" / "part-00000.parquet").num_rows > 0


def test_rollback_removes_what_a_killed_run_or_rollback_left(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=512)
    work = tmp_path / "work"
    good = run_nightly(at(nightly_config(input=str(inp), **FAST), work))
    os.symlink("runs/gone", work / ".latest.tmp-999999")  # killed between the symlink and its rename
    (work / f".{nightly.store.HOLDER_NAME}.tmp-999998").write_text("{}")  # killed while writing the holder
    assert nightly.main(["--output", str(work), "--rollback", good["run_key"]]) == 0
    assert _hidden(work) == []
    assert sorted(p.name for p in work.iterdir()) == [".nightly.lock", "history.jsonl", "latest", "runs"]


def test_a_publish_whose_history_record_a_kill_cut_off_is_recorded_by_the_next_run(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=512)
    work = tmp_path / "work"
    first = run_nightly(at(nightly_config(input=str(inp), **FAST), work))
    cfg = at(nightly_config(input=str(inp), **(FAST | {"num_ranks": 2})), work)
    second = run_nightly(cfg)
    assert second["published"] and second["run_key"] != first["run_key"]
    history = work / "history.jsonl"
    lines = history.read_text().splitlines()
    history.write_text("\n".join(lines[:-1]) + "\n")  # killed after publishing latest, before its record
    again = run_nightly(cfg)
    assert again["skipped"] and again["published"]
    last = json.loads(history.read_text().splitlines()[-1])
    assert last["run_key"] == second["run_key"] and not last["rollback"]
