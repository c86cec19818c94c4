import json
import os

import pytest

from fsdata.errors import FsdataError
from pipelines import nightly
from pipelines.nightly import NightlyConfig, run_nightly
from tests.conftest import dataset_path


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


def test_publish_and_noop_rerun(tmp_path):
    cfg = NightlyConfig(input=str(_seq(tmp_path)), num_ranks=4, batch_size_per_rank=8)
    work = tmp_path / "work"
    r1 = run_nightly(cfg, work, progress=False)
    assert not r1["skipped"] and (work / "latest").is_symlink()
    assert os.path.realpath(work / "latest") == os.path.realpath(r1["run_dir"])
    assert (work / "latest" / "shards" / "_manifest.json").exists()
    mtime = (work / "latest" / "shards" / "_manifest.json").stat().st_mtime_ns
    r2 = run_nightly(cfg, work, progress=False)
    assert r2["skipped"] and r2["run_dir"] == r1["run_dir"]
    assert (work / "latest" / "shards" / "_manifest.json").stat().st_mtime_ns == mtime
    assert r2["verify"]["predicted_bubble"] < r2["verify"]["baseline_predicted_bubble"]


def test_failure_keeps_previous_latest(tmp_path, monkeypatch):
    seq = _seq(tmp_path)
    work = tmp_path / "work"
    good = run_nightly(NightlyConfig(input=str(seq), num_ranks=4, batch_size_per_rank=8), work, progress=False)

    def boom(*a, **k):
        raise FsdataError("simulated verify failure")

    monkeypatch.setattr(nightly, "verify", boom)
    with pytest.raises(FsdataError):
        run_nightly(NightlyConfig(input=str(seq), num_ranks=4, batch_size_per_rank=16), work, progress=False)
    assert os.path.realpath(work / "latest") == os.path.realpath(good["run_dir"])
    # impossible settings fail before anything is published, with the previous latest intact
    monkeypatch.undo()
    with pytest.raises(FsdataError, match="needs at least"):
        run_nightly(NightlyConfig(input=str(seq), num_ranks=4096, batch_size_per_rank=64), work, progress=False)
    assert os.path.realpath(work / "latest") == os.path.realpath(good["run_dir"])
    # after the failure, the rerun completes and publishes
    r = run_nightly(NightlyConfig(input=str(seq), num_ranks=4, batch_size_per_rank=16), work, progress=False)
    assert os.path.realpath(work / "latest") == os.path.realpath(r["run_dir"])


def test_cli_missing_input(tmp_path, capsys):
    rc = nightly.main(["--input", str(tmp_path / "none.txt"), "--work-dir", str(tmp_path / "w"), "--no-progress"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "w" / "latest").exists()


@pytest.mark.slow
def test_real_toys_per_user(tmp_path, capsys):
    src = dataset_path("s3rec_toys_and_games/Toys_and_Games.txt")
    rc = nightly.main(["--input", str(src), "--format", "sequences", "--samples", "per-user", "--work-dir",
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
    good = run_nightly(NightlyConfig(input=str(small), format="samples", num_ranks=4, batch_size_per_rank=8), work,
                       progress=False)
    big = write_samples(tmp_path / "big.parquet", n=200_000)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.nightly", "--input", str(big), "--format", "samples",
                             "--work-dir", str(work), "--ranks", "8", "--batch-size-per-rank", "4", "--no-progress"],
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
    assert (work / "latest" / "shards" / "_manifest.json").exists()
    assert not (work / ".latest.tmp").exists()
