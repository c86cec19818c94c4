import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from fsdata.samples import schema as S
from fsdata.cli import main
from fsdata.errors import VerifyError
from fsdata.shards.verify import verify
from tests.conftest import REPO_ROOT, dataset_path
from tests.fsdata.helpers import write_samples


def _balance(inp, out, *extra, R=4, B=8):
    return main(["balance", str(inp), str(out), "--ranks", str(R), "--batch-size-per-rank", str(B),
                 "--no-progress", *extra])


def test_layout_invariants_and_manifest(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=1000, with_timestamps=True)
    out = tmp_path / "out"
    assert _balance(inp, out, "--cost-model", "quadratic") == 0
    m = json.loads((out / "_manifest.json").read_text())
    for key in ("format_version", "num_ranks", "num_steps", "batch_size_per_rank", "num_samples_input",
                "num_samples_written", "num_samples_dropped", "cost_model", "seed", "predicted_bubble",
                "baseline_predicted_bubble", "files"):
        assert key in m
    assert m["num_ranks"] == 4 and m["num_steps"] == 1000 // 32
    assert m["num_samples_written"] == 31 * 32 and m["num_samples_dropped"] == 1000 - 31 * 32
    assert m["cost_model"]["coefficients"] == [0.0, 64.0, 1.0]
    assert sorted(p.name for p in out.iterdir()) == sorted(["_dropped.parquet", "_manifest.json", "_step_stats.parquet"]
                                                           + [f"rank-{r:05d}" for r in range(4)])
    ids = []
    for r in range(4):
        t = pl.read_parquet(out / f"rank-{r:05d}" / "part-00000.parquet")
        assert t.columns == [S.SAMPLE_ID, S.USER_ID, S.ITEM_IDS, S.TARGET_ITEM_ID, S.TIMESTAMPS, S.STEP, S.RANK]
        assert t.schema[S.RANK] == pl.Int32 and (t[S.RANK] == r).all()
        assert t.schema[S.STEP] == pl.Int32 and t.schema[S.ITEM_IDS] == pl.List(pl.Int64)
        assert t[S.STEP].is_sorted()
        assert (t.group_by(S.STEP).len()["len"] == 8).all() and t[S.STEP].n_unique() == 31
        assert (t[S.ITEM_IDS].list.len() == t[S.TIMESTAMPS].list.len()).all()
        ids.append(t[S.SAMPLE_ID].to_numpy())
    ids = np.concatenate(ids)
    dropped = pl.read_parquet(out / "_dropped.parquet")[S.SAMPLE_ID].to_numpy()
    assert len(np.unique(ids)) == len(ids)
    assert sorted(np.concatenate([ids, dropped]).tolist()) == list(range(1000, 2000))
    # rows keep their content: compare against the input by sample_id
    src = pl.read_parquet(inp)
    back = pl.concat([pl.read_parquet(out / f"rank-{r:05d}" / "part-00000.parquet") for r in range(4)])
    joined = back.join(src, on=S.SAMPLE_ID, suffix="_in")
    assert (joined[S.ITEM_IDS] == joined[S.ITEM_IDS + "_in"]).all()
    assert m["predicted_bubble"] < m["baseline_predicted_bubble"]
    assert verify(out, inp)["checked_input"]


def test_balanced_beats_shuffle_and_shuffle_layout(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=2048)
    # --compose-window 1: no batch composition, so both strategies use the same global batches
    assert _balance(inp, tmp_path / "bal", "--cost-model", "quadratic", "--compose-window", "1", B=64) == 0
    assert _balance(inp, tmp_path / "shuf", "--cost-model", "quadratic", "--strategy", "shuffle", B=64) == 0
    mb = json.loads((tmp_path / "bal" / "_manifest.json").read_text())
    ms = json.loads((tmp_path / "shuf" / "_manifest.json").read_text())
    assert ms["predicted_bubble"] == pytest.approx(ms["baseline_predicted_bubble"])
    assert mb["baseline_predicted_bubble"] == pytest.approx(ms["baseline_predicted_bubble"])
    assert mb["predicted_bubble"] < 0.2 * ms["predicted_bubble"]
    assert mb["predicted_bubble"] <= mb["lower_bound_bubble"] + 0.01
    # same global batches: the set of samples in each step is identical
    def steps(out):
        df = pl.read_parquet(str(out / "rank-*" / "*.parquet"))
        return df.group_by(S.STEP).agg(pl.col(S.SAMPLE_ID).sort()).sort(S.STEP)
    assert steps(tmp_path / "bal").equals(steps(tmp_path / "shuf"))
    verify(tmp_path / "shuf", inp)


def test_deterministic_bytes(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=700)
    assert _balance(inp, tmp_path / "a", "--seed", "3") == 0
    assert _balance(inp, tmp_path / "b", "--seed", "3") == 0
    assert _balance(inp, tmp_path / "c", "--seed", "4") == 0
    ma, mb, mc = (json.loads((tmp_path / d / "_manifest.json").read_text()) for d in "abc")
    assert [f["sha256"] for f in ma["files"]] == [f["sha256"] for f in mb["files"]]
    assert (tmp_path / "a" / "_manifest.json").read_bytes() == (tmp_path / "b" / "_manifest.json").read_bytes()
    assert [f["sha256"] for f in ma["files"]] != [f["sha256"] for f in mc["files"]]


def test_directory_input_and_column_map(tmp_path):
    inp = write_samples(tmp_path / "in", n=600, num_files=3)
    renamed = tmp_path / "renamed.parquet"
    pl.read_parquet(str(inp / "*.parquet")).rename({S.ITEM_IDS: "history", S.SAMPLE_ID: "id"}).write_parquet(renamed)
    assert _balance(inp, tmp_path / "o1") == 0
    assert _balance(renamed, tmp_path / "o2", "--columns", "item_ids=history,sample_id=id") == 0
    m1 = json.loads((tmp_path / "o1" / "_manifest.json").read_text())
    m2 = json.loads((tmp_path / "o2" / "_manifest.json").read_text())
    assert m1["predicted_bubble"] == m2["predicted_bubble"]
    assert S.ITEM_IDS in m2["columns"] and "history" not in m2["columns"]
    verify(tmp_path / "o2", renamed, column_map="item_ids=history,sample_id=id")


def test_remainder_error_policy(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=100)
    assert _balance(inp, tmp_path / "o", "--remainder", "error") == 2
    assert "--remainder drop" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_existing_output_refused_then_replaced(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=256)
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    assert _balance(inp, out) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "keep").exists()
    assert _balance(inp, out, "--overwrite") == 2  # a folder FreeScale did not write is never replaced
    assert "did not write" in capsys.readouterr().err and (out / "keep").read_text() == "x"
    (out / "keep").unlink()
    assert _balance(inp, out) == 0  # an empty folder is free
    assert _balance(inp, out, "--seed", "5", "--overwrite") == 0  # an OUTPUT FreeScale wrote is replaced
    assert (out / "_manifest.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_verify_catches_tampering(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=512)
    out = tmp_path / "o"
    assert _balance(inp, out) == 0
    f = out / "rank-00001" / "part-00000.parquet"
    t = pq.read_table(f)
    pq.write_table(t.slice(0, t.num_rows - 8), f)  # drop a step's rows from one rank
    with pytest.raises(VerifyError, match="checksum|bytes"):
        verify(out)
    with pytest.raises(VerifyError, match="bytes|rows"):
        verify(out, check_checksums=False)


def test_verify_catches_lost_sample(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=512)
    out = tmp_path / "o"
    assert _balance(inp, out) == 0
    bigger = write_samples(tmp_path / "bigger.parquet", n=513)
    with pytest.raises(VerifyError, match="1 input samples missing"):
        verify(out, bigger)
    rc = main(["verify", str(out), "--input", str(bigger)])
    assert rc == 2


def test_killed_midway_leaves_no_output(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=200_000)
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "fsdata", "balance", str(inp), str(out), "--ranks", "8",
                             "--batch-size-per-rank", "4", "--no-progress"], env=env, cwd=tmp_path)
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(".o.tmp-") for p in tmp_path.iterdir()):
        time.sleep(0.005)
    assert proc.poll() is None, "balance finished before it could be killed midway"
    assert any(p.name.startswith(".o.tmp-") for p in tmp_path.iterdir()), "balance never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    # the next run cleans the dead run's temporary and succeeds
    assert _balance(inp, out, R=8, B=4) == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow
def test_real_ml1m_256_ranks(tmp_path):
    """Issue 2 acceptance: ml-1m per-event (max 512), R=256, B=32, quadratic cost."""
    src = dataset_path("ml-1m_ensfm/sequences.txt")
    samples = tmp_path / "ml1m.parquet"
    assert main(["convert", str(src), str(samples), "--format", "sequences", "--samples", "per-event",
                 "--max-seq-len", "512", "--no-progress"]) == 0
    out = tmp_path / "shards"
    assert main(["balance", str(samples), str(out), "--ranks", "256", "--batch-size-per-rank", "32",
                 "--cost-model", "quadratic", "--no-progress"]) == 0
    r = verify(out, samples)
    assert r["num_ranks"] == 256 and r["num_samples_written"] + r["num_samples_dropped"] == 994_169
    assert r["baseline_predicted_bubble"] > 0.35 and r["predicted_bubble"] < 0.005


def test_cost_budget_policy_end_to_end(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=3000)
    out = tmp_path / "o"
    assert _balance(inp, out, "--batch-policy", "cost-budget", "--cost-model", "quadratic", R=8, B=4) == 0
    m = json.loads((out / "_manifest.json").read_text())
    assert m["batch_policy"] == "cost-budget"
    stats = pl.read_parquet(out / "_step_stats.parquet")
    assert stats.height == m["num_steps"] * 8 and stats["num_samples"].min() >= 1
    assert stats["num_samples"].n_unique() > 1  # variable per-rank counts
    assert stats["num_samples"].sum() == m["num_samples_written"]
    for r in range(8):
        t = pl.read_parquet(out / f"rank-{r:05d}" / "part-00000.parquet")
        assert t[S.STEP].is_sorted()
        got = t.group_by(S.STEP).len().sort(S.STEP)["len"].to_list()
        assert got == stats.filter(pl.col("rank") == r).sort("step")["num_samples"].to_list()
    assert m["predicted_bubble"] < m["baseline_predicted_bubble"]
    assert verify(out, inp)["checked_input"]


def test_synth_cli(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 5 6 7 8 9\n2 5 6\n3 1 2 3 4 5 6 7 8 9 10 11\n")
    out = tmp_path / "syn.parquet"
    assert main(["synth", str(out), "--num-samples", "500", "--lengths-from", str(src), "--layout", "user"]) == 0
    df = pl.read_parquet(out)
    assert df.height == 500 and set(df[S.ITEM_IDS].list.len().unique().to_list()) <= {1, 4, 10}
    assert main(["synth", str(out), "--num-samples", "5", "--lengths-from", str(src)]) == 2
