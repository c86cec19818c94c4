import json
import os
from pathlib import Path

import pytest

from fsdata.errors import FsdataError
from pipelines import nightly
from pipelines.nightly import run_nightly
from tests.conftest import dataset_path
from tests.pipelines.helpers import at, nightly_config


def _seq(tmp_path, users=300):
    import numpy as np

    rng = np.random.default_rng(0)
    lines = []
    for u in range(users):
        n = int(np.clip(rng.lognormal(2.5, 1.0), 2, 400))
        lines.append(" ".join(map(str, [u, *rng.integers(1, 1000, size=n)])))
    p = tmp_path / "seq.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def _manifest_path(shards):
    """Format v2 names the manifest _manifest.json, v1 manifest.json."""
    return next((shards / n for n in ("_manifest.json", "manifest.json") if (shards / n).exists()),
                shards / "_manifest.json")


def test_publish_and_noop_rerun(tmp_path):
    cfg = nightly_config(input=str(_seq(tmp_path)), num_ranks=4, batch_size_per_rank=8)
    work = tmp_path / "work"
    r1 = run_nightly(at(cfg, work))
    assert not r1["skipped"] and (work / "latest").is_symlink()
    assert os.path.realpath(work / "latest") == os.path.realpath(r1["run_dir"])
    manifest = _manifest_path(work / "latest" / "shards")
    mtime = manifest.stat().st_mtime_ns
    r2 = run_nightly(at(cfg, work))
    assert r2["skipped"] and r2["run_dir"] == r1["run_dir"]
    assert manifest.stat().st_mtime_ns == mtime
    assert r2["verify"]["predicted_bubble"] < r2["verify"]["baseline_predicted_bubble"]


def test_failure_keeps_previous_latest(tmp_path, monkeypatch):
    seq = _seq(tmp_path)
    work = tmp_path / "work"
    good = run_nightly(at(nightly_config(input=str(seq), num_ranks=4, batch_size_per_rank=8), work))

    def boom(*a, **k):
        raise FsdataError("simulated verify failure")

    monkeypatch.setattr(nightly.job, "verify", boom)
    with pytest.raises(FsdataError):
        run_nightly(at(nightly_config(input=str(seq), num_ranks=4, batch_size_per_rank=16), work))
    assert os.path.realpath(work / "latest") == os.path.realpath(good["run_dir"])
    # impossible settings fail before anything is published, with the previous latest intact
    monkeypatch.undo()
    with pytest.raises(FsdataError, match="needs at least"):
        run_nightly(at(nightly_config(input=str(seq), num_ranks=4096, batch_size_per_rank=64), work))
    assert os.path.realpath(work / "latest") == os.path.realpath(good["run_dir"])
    # after the failure, the rerun completes and publishes
    r = run_nightly(at(nightly_config(input=str(seq), num_ranks=4, batch_size_per_rank=16), work))
    assert os.path.realpath(work / "latest") == os.path.realpath(r["run_dir"])


def test_cli_missing_input(tmp_path, capsys):
    rc = nightly.main(["--input", str(tmp_path / "none.txt"), "--output", str(tmp_path / "w"), "--ranks", "2",
                       "--batch-size-per-rank", "2", "--no-progress"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "w" / "latest").exists()


@pytest.mark.slow
def test_real_toys_per_user(tmp_path, capsys):
    src = dataset_path("s3rec_toys_and_games/Toys_and_Games.txt")
    rc = nightly.main(["--input", str(src), "--format", "sequences", "--samples", "per-user", "--output",
                       str(tmp_path / "w"), "--ranks", "8", "--batch-size-per-rank", "32", "--no-progress", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["verify"]["checked_input"] and r["verify"]["num_samples_written"] > 19000


def test_killed_run_leaves_latest_intact(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO_ROOT
    from tests.fsdata.helpers import write_samples

    work = tmp_path / "work"
    small = write_samples(tmp_path / "small.parquet", n=512)
    good = run_nightly(at(nightly_config(input=str(small), format="samples", num_ranks=4, batch_size_per_rank=8), work))
    big = write_samples(tmp_path / "big.parquet", n=200_000)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.nightly", "--input", str(big), "--format", "samples",
                             "--output", str(work), "--ranks", "8", "--batch-size-per-rank", "4", "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    started = False
    while time.time() < deadline and not started:
        started = any(p.name.startswith(".shards.tmp-") for p in (work / "runs").glob("*/.shards.tmp-*"))
        time.sleep(0.005)
    assert started and proc.poll() is None, "the nightly run did not reach the balance stage in time"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.realpath(work / "latest") == os.path.realpath(good["run_dir"])
    assert _manifest_path(work / "latest" / "shards").exists()
    assert not (work / ".latest.tmp").exists()
    # the killed run's half-built folder is removed by the next run, which then completes
    r = run_nightly(at(nightly_config(input=str(small), format="samples", num_ranks=4, batch_size_per_rank=4), work))
    assert r["published"] and not [p for p in (work / "runs").iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------------------------
# lock, forward-only latest, checksum recheck, cleanup of failed runs, --keep-runs, flags

FAST = dict(num_ranks=4, batch_size_per_rank=8, partitioner="lpt-swap")


def _latest_key(work):
    return os.path.basename(os.path.realpath(work / "latest"))


def test_concurrent_run_blocked_with_holder_named(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    work = tmp_path / "work"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipelines.nightly import work_lock\n"
         f"with work_lock({str(work)!r}):\n    print('held', flush=True); time.sleep(60)"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = nightly.main(["--input", str(_seq(tmp_path)), "--output", str(work), "--ranks", "4",
                           "--batch-size-per-rank", "8", "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert "another nightly run holds" in err and f"pid {holder.pid}" in err and socket.gethostname() in err
        assert not (work / "runs").exists() and not (work / "latest").exists()
    finally:
        holder.kill()
        holder.wait()
    # the lock dies with its holder: the next run goes through
    r = run_nightly(at(nightly_config(input=str(_seq(tmp_path)), **FAST), work))
    assert r["published"]


def test_older_runs_command_does_not_move_latest_back(tmp_path, capsys):
    seq = str(_seq(tmp_path))
    work = tmp_path / "work"
    a = run_nightly(at(nightly_config(input=seq, seed=0, **FAST), work))
    b = run_nightly(at(nightly_config(input=seq, seed=1, **FAST), work))
    assert _latest_key(work) == b["run_key"] != a["run_key"]
    again = run_nightly(at(nightly_config(input=seq, seed=0, **FAST), work))
    assert again["skipped"] and not again["published"] and f"--rollback {a['run_key']}" in again["not_published_reason"]
    assert _latest_key(work) == b["run_key"]
    # the same through the command line: one line says why, exit 0
    rc = nightly.main(["--input", seq, "--output", str(work), "--ranks", "4", "--batch-size-per-rank", "8",
                       "--partitioner", "lpt-swap", "--seed", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "not published" in out and _latest_key(work) == b["run_key"]
    # an explicit rollback moves it back, and B's command then does not move it forward again
    assert nightly.main(["--output", str(work), "--rollback", a["run_key"]]) == 0
    assert _latest_key(work) == a["run_key"]
    again_b = run_nightly(at(nightly_config(input=seq, seed=1, **FAST), work))
    assert not again_b["published"] and "rolled back" in again_b["not_published_reason"]
    assert _latest_key(work) == a["run_key"]
    # a new run (created after the rollback) is published
    c = run_nightly(at(nightly_config(input=seq, seed=2, **FAST), work))
    assert c["published"] and _latest_key(work) == c["run_key"]


def test_rollback_unknown_run_is_one_line(tmp_path, capsys):
    work = tmp_path / "work"
    run_nightly(at(nightly_config(input=str(_seq(tmp_path)), **FAST), work))
    assert nightly.main(["--output", str(work), "--rollback", "0123456789abcdef"]) == 2
    err = capsys.readouterr().err
    assert "no complete run" in err and len(err.strip().splitlines()) == 1


def test_truncated_published_shard_is_detected_and_rebuilt(tmp_path):
    import pyarrow.parquet as pq

    work = tmp_path / "work"
    cfg = nightly_config(input=str(_seq(tmp_path)), **FAST)
    r1 = run_nightly(at(cfg, work))
    m = json.loads(_manifest_path(work / "latest" / "shards").read_text())
    shard = work / "latest" / "shards" / m["files"][0]["path"]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(1024)
    assert nightly.check_run(r1["run_dir"]) is not None  # what "up to date" now re-checks
    r2 = run_nightly(at(cfg, work))
    assert r2["rebuilt"] and not r2["skipped"] and r2["published"] and r2["run_key"] == r1["run_key"]
    assert shard.stat().st_size == size and pq.ParquetFile(shard).metadata.num_rows == m["files"][0]["num_rows"]
    assert nightly.check_run(r2["run_dir"]) is None
    # an edited manifest or sample file is caught too (their digests are in _SUCCESS)
    samples = work / "latest" / "samples.parquet"
    samples.write_bytes(samples.read_bytes()[:-10])
    assert "changed since it was verified" in nightly.check_run(r2["run_dir"])


def test_failed_unpublished_run_is_cleaned_and_redone(tmp_path, monkeypatch):
    work = tmp_path / "work"
    cfg = nightly_config(input=str(_seq(tmp_path)), **FAST)
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise FsdataError("simulated verify failure")

    monkeypatch.setattr(nightly.job, "verify", boom)
    with pytest.raises(FsdataError, match="simulated"):
        run_nightly(at(cfg, work))
    assert calls and list((work / "runs").iterdir()) == []  # nothing of the failed run is left
    # a killed run's leftovers (a half-built folder, an old-layout folder without _SUCCESS) go too
    (work / "runs" / ".deadbeef00000000.tmp-999999-abcdef12").mkdir()
    (work / "runs" / "deadbeef00000000").mkdir()
    (work / "runs" / "deadbeef00000000" / "run.json").write_text('{"run_key": "deadbeef00000000"}')
    # ... but never what is not the job's: a user's folder, a key-named folder without the job's marker
    (work / "runs" / "myproject").mkdir()
    (work / "runs" / "myproject" / "notes.txt").write_text("keep")
    (work / "runs" / "0123456789abcdef").mkdir()
    monkeypatch.undo()
    r = run_nightly(at(cfg, work))
    assert r["published"] and not r["skipped"]
    assert sorted(p.name for p in (work / "runs").iterdir()) == sorted([r["run_key"], "myproject", "0123456789abcdef"])
    assert (work / "runs" / "myproject" / "notes.txt").read_text() == "keep"


def test_keep_runs_removes_old_runs_but_never_the_published_or_rollback_target(tmp_path):
    seq = str(_seq(tmp_path))
    work = tmp_path / "work"
    keys = [run_nightly(at(nightly_config(input=seq, seed=s, **FAST), work, keep_runs=2))["run_key"]
            for s in range(3)]
    assert sorted(p.name for p in (work / "runs").iterdir()) == sorted(keys[1:])
    nightly.rollback(work, keys[1])
    r = run_nightly(at(nightly_config(input=seq, seed=3, **FAST), work, keep_runs=1))
    left = sorted(p.name for p in (work / "runs").iterdir())
    assert left == sorted([r["run_key"], keys[1]])  # newest published + the last rollback target
    with pytest.raises(FsdataError, match="--keep-runs must be >= 1"):
        run_nightly(at(nightly_config(input=seq, **FAST), work, keep_runs=0))


def test_work_dir_inside_or_containing_the_input_is_refused(tmp_path, capsys):
    from tests.fsdata.helpers import write_samples

    data = write_samples(tmp_path / "data", n=256, num_files=2)
    before = sorted((p.name, p.stat().st_size) for p in data.iterdir())
    for work in (data, data / "nightly", tmp_path):
        rc = nightly.main(["--input", str(data), "--format", "samples", "--output", str(work), "--ranks", "4",
                           "--batch-size-per-rank", "8", "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and "--output" in err and "outside the input" in err, err
    assert sorted((p.name, p.stat().st_size) for p in data.iterdir()) == before


def test_columns_and_balance_flags_reach_the_output(tmp_path):
    import pyarrow.parquet as pq

    from tests.fsdata.helpers import write_samples

    src = write_samples(tmp_path / "s.parquet", n=300)
    t = pq.read_table(src).rename_columns(["id", "user_id", "history", "target_item_id"])
    pq.write_table(t, tmp_path / "mine.parquet")
    work = tmp_path / "work"
    rc = nightly.main(["--input", str(tmp_path / "mine.parquet"), "--format", "samples", "--columns",
                       "sample_id=id,item_ids=history", "--output", str(work), "--ranks", "4",
                       "--batch-size-per-rank", "8", "--partitioner", "lpt-swap", "--remainder", "drop",
                       "--num-threads", "1", "--no-progress"])
    assert rc == 0
    m = json.loads(_manifest_path(work / "latest" / "shards").read_text())
    assert m["num_samples_input"] == 300 and m["num_samples_dropped"] == 300 % 32


def test_composition_warning_and_report_reach_the_run(tmp_path, capsys):
    """--compose-window flows into the manifest through fsdata.balance; the run holds report.html;
    a result above 10% prints balance's warning with the remedy."""
    seq = _seq(tmp_path, users=400)
    work = tmp_path / "work"
    rc = nightly.main(["--input", str(seq), "--output", str(work), "--ranks", "8", "--batch-size-per-rank", "2",
                       "--compose-window", "1", "--partitioner", "lpt-swap", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    m = json.loads(_manifest_path(work / "latest" / "shards").read_text())
    assert m["settings"]["compose_window"] == 1 and m["lower_bound_kind"] == "pigeonhole"
    page = work / "latest" / "report.html"
    text = page.read_text()
    assert text.count("<img ") == 4 and "fsdata report: nightly run " in text
    assert ".tmp-" not in text  # written in the staging folder, named as published
    verified = json.loads((work / "latest" / "verify.json").read_text())
    assert verified["predicted_bubble"] > 0.10  # heavy tail at B=2 without composition (50.8% when written)
    assert "warning:" in out and "--compose-window" in out and verified["warning"]
    r = run_nightly(at(nightly_config(input=str(seq), num_ranks=8, batch_size_per_rank=2, partitioner="lpt-swap",
                                      compose_window=64), tmp_path / "work2"))
    m2 = json.loads(_manifest_path(Path(r["run_dir"]) / "shards").read_text())
    assert m2["settings"]["compose_window"] >= 1 and m2["settings"]["compose"]["algorithm"] != "none"
    assert r["verify"]["predicted_bubble"] < 0.10 and not r["verify"]["warning"]  # 2.8% when written
