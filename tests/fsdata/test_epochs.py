"""``fsdata balance --epochs E``: E seeded epochs, steps numbered on, every sample once per epoch,
``num_tokens`` in the step stats, and ``fsdata verify`` checking all of it (docs/fsdata.md, "Epochs")."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.balancer.order import epoch_seed
from fsdata.cli import main
from fsdata.errors import VerifyError
from fsdata.shards.manifest import Manifest
from fsdata.shards.verify import verify
from tests.fsdata.helpers import write_samples

R, B, N, E = 4, 8, 1000, 3
S = N // (R * B)  # 31 steps per epoch, 8 samples dropped per epoch
FLAGS = ["--ranks", str(R), "--batch-size-per-rank", str(B), "--partitioner", "lpt-swap", "--compose-window", "4",
         "--no-progress", "-q"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("epochs")
    inp = write_samples(d / "in.parquet", n=N)
    out = d / "e3"
    assert main(["balance", str(inp), str(out), *FLAGS, "--epochs", str(E)]) == 0
    one = d / "e1"
    assert main(["balance", str(inp), str(one), *FLAGS]) == 0
    return inp, out, one


def _rows(out) -> pl.DataFrame:
    m = Manifest.read(out)
    return pl.concat([pl.read_parquet(m.rank_file(r)).with_columns(pl.col("item_ids").list.len().alias("len"))
                      for r in range(m.num_ranks)])


def _files(d) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_every_epoch_holds_every_sample_once_with_steps_numbered_on(data):
    inp, out, _ = data
    m = Manifest.read(out)
    assert (m.epochs, m.steps_per_epoch, m.num_steps) == (E, S, E * S)
    raw = json.loads((out / "_manifest.json").read_text())
    assert raw["epochs"] == E and raw["steps_per_epoch"] == S and raw["settings"]["epochs"] == E
    assert raw["num_samples_input"] == N and raw["num_samples_written"] == E * S * R * B
    assert raw["num_samples_dropped"] == E * (N - S * R * B)
    rows = _rows(out).with_columns((pl.col("step") // S).alias("epoch"))
    dropped = pl.read_parquet(out / "_dropped.parquet")
    assert dropped.columns == ["sample_id", "epoch", "reason"]
    assert dropped.schema["epoch"] == pl.Int32
    all_ids = set(pq.read_table(inp, columns=["sample_id"]).column(0).to_pylist())
    for e in range(E):
        ep = rows.filter(pl.col("epoch") == e)
        assert ep["step"].min() == e * S and ep["step"].max() == (e + 1) * S - 1
        assert ep["sample_id"].n_unique() == ep.height == S * R * B
        gone = dropped.filter(pl.col("epoch") == e)["sample_id"].to_list()
        assert len(gone) == N - S * R * B
        assert set(ep["sample_id"].to_list()) | set(gone) == all_ids
        assert not set(gone) & set(ep["sample_id"].to_list())
    # every (step, rank) holds B rows, steps 0 .. E*S-1 on every rank
    per = rows.group_by("step", "rank").len()
    assert per.height == E * S * R and (per["len"] == B).all()


def test_epochs_differ_and_epoch_zero_is_the_one_epoch_run(data):
    _, out, one = data
    rows = _rows(out)
    base = _rows(one)

    def steps_of(df, e):
        return [sorted(g["sample_id"].to_list()) for _, g in
                df.filter(pl.col("step") // S == e).sort("step").group_by("step", maintain_order=True)]

    batches = [steps_of(rows, e) for e in range(E)]
    assert batches[0] != batches[1] and batches[1] != batches[2] and batches[0] != batches[2]
    # epoch 0 uses the run's own seed: its rows are exactly the one-epoch output's, rank by rank, in order
    for r in range(R):
        a = rows.filter((pl.col("rank") == r) & (pl.col("step") < S)).select("sample_id", "step")
        b = base.filter(pl.col("rank") == r).select("sample_id", "step")
        assert a.equals(b)
    assert epoch_seed(0, 0) == 0 and epoch_seed(7, 0) == 7
    assert len({epoch_seed(0, e) for e in range(5)}) == 5 and epoch_seed(0, 1) == epoch_seed(0, 1)
    assert epoch_seed(0, 1) != epoch_seed(1, 1)


def test_deterministic_and_one_epoch_is_byte_identical_to_the_default(data, tmp_path):
    inp, out, one = data
    again = tmp_path / "again"
    assert main(["balance", str(inp), str(again), *FLAGS, "--epochs", str(E)]) == 0
    assert _files(again) == _files(out)
    explicit = tmp_path / "explicit1"
    assert main(["balance", str(inp), str(explicit), *FLAGS, "--epochs", "1"]) == 0
    assert _files(explicit) == _files(one)
    raw = json.loads((one / "_manifest.json").read_text())
    assert "epochs" not in raw and "steps_per_epoch" not in raw and "epochs" not in raw["settings"]
    assert pl.read_parquet(one / "_dropped.parquet").columns == ["sample_id", "reason"]
    other = tmp_path / "seed1"
    assert main(["balance", str(inp), str(other), *FLAGS, "--epochs", str(E), "--seed", "1"]) == 0
    assert _files(other)["rank-00000/part-00000.parquet"] != _files(out)["rank-00000/part-00000.parquet"]


def test_stages_carry_the_epochs(data, tmp_path):
    inp, out, _ = data
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), *FLAGS, "--epochs", str(E)]) == 0
    t = pq.read_table(plan)
    meta = json.loads(t.schema.metadata[b"fsdata.plan"])
    assert t.num_rows == E * N and meta["epochs"] == E and meta["steps_per_epoch"] == S
    staged = tmp_path / "staged"
    assert main(["write", str(inp), str(plan), str(staged), "--no-progress"]) == 0
    assert main(["finalize", str(staged), "--plan", str(plan), "--no-progress", "-q"]) == 0
    assert _files(staged) == _files(out)


def test_num_tokens_is_the_sum_of_history_lengths_per_step_and_rank(data):
    _, out, one = data
    for d in (out, one):
        stats = pl.read_parquet(d / "_step_stats.parquet")
        assert stats.columns == ["step", "rank", "num_samples", "predicted_cost", "num_tokens"]
        assert stats.schema["num_tokens"] == pl.Int64
        want = _rows(d).group_by("step", "rank").agg(pl.col("len").sum().cast(pl.Int64).alias("want"))
        j = stats.join(want, on=["step", "rank"])
        assert j.height == stats.height and (j["num_tokens"] == j["want"]).all()
        assert stats["num_tokens"].sum() > stats["num_samples"].sum()  # histories longer than 1 on average


def test_reader_exposes_global_token_counts_and_old_outputs_still_read(data, tmp_path):
    pytest.importorskip("torch")
    from fstrain.data import ShardReader
    from fstrain.errors import ShardError

    _, out, _ = data
    reader = ShardReader(str(out), 0, R, num_prefetch_batches=0)
    assert reader.epochs == E and reader.steps_per_epoch == S and len(reader) == E * S
    g = reader.global_token_counts
    want = _rows(out).group_by("step").agg(pl.col("len").sum()).sort("step")["len"].to_numpy()
    assert g.dtype == np.int64 and g.shape == (E * S,) and np.array_equal(g, want)
    batches = list(ShardReader(str(out), 2, R, start_step=S - 1, max_steps=3, num_prefetch_batches=0))
    assert [b.step for b in batches] == [S - 1, S, S + 1]  # across the epoch boundary
    assert [b.global_num_tokens for b in batches] == want[S - 1:S + 2].tolist()
    # an output written before the column: it still reads; the token counts raise only when asked for
    old = tmp_path / "old"
    shutil.copytree(out, old)
    stats = pq.read_table(old / "_step_stats.parquet").drop_columns(["num_tokens"])
    pq.write_table(stats, old / "_step_stats.parquet", compression="zstd")
    raw = json.loads((old / "_manifest.json").read_text())
    raw["step_stats_sha256"] = hashlib.sha256((old / "_step_stats.parquet").read_bytes()).hexdigest()
    (old / "_manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    verify(old)
    reader = ShardReader(str(old), 1, R, num_prefetch_batches=0)
    assert not reader.has_token_counts and all(b.global_num_tokens == -1 for b in reader)
    with pytest.raises(ShardError, match="num_tokens"):
        reader.global_token_counts


def test_verify_passes_and_catches_a_row_moved_between_epochs(data, tmp_path):
    inp, out, _ = data
    got = verify(out, inp)
    assert got["checked_input"] and got["epochs"] == E and got["steps_per_epoch"] == S
    bad = tmp_path / "moved"
    shutil.copytree(out, bad)
    path = bad / "rank-00000" / "part-00000.parquet"
    t = pq.read_table(path)
    lengths = pa.compute.list_value_length(t.column("item_ids")).to_numpy()
    step = t.column("step").to_numpy()
    sid = t.column("sample_id").to_numpy()
    # swap the steps of an epoch-0 row and an epoch-1 row of equal length (so every per-step count,
    # predicted cost and token count stays as recorded): only the epochs' contents change
    e0 = np.flatnonzero(step < S)
    e1 = np.flatnonzero((step >= S) & (step < 2 * S))
    x, y = next((i, j) for i in e0 for j in e1 if lengths[i] == lengths[j] and sid[i] != sid[j])
    step = step.copy()
    step[x], step[y] = step[y], step[x]
    t = t.set_column(t.schema.get_field_index("step"), "step", pa.array(step, pa.int32()))
    t = t.take(pa.compute.sort_indices(t, [("step", "ascending")]))
    pq.write_table(t, path, compression="zstd", write_statistics=True, row_group_size=t.num_rows)
    raw = json.loads((bad / "_manifest.json").read_text())
    raw["files"][0].update(num_bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (bad / "_manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    with pytest.raises(VerifyError, match=r"epoch [01] .*(more than once|lacks)"):
        verify(bad)


def test_verify_catches_epochs_edited_in_the_manifest(data, tmp_path):
    _, out, _ = data
    bad = tmp_path / "edited"
    shutil.copytree(out, bad)
    raw = json.loads((bad / "_manifest.json").read_text())
    raw["epochs"] = 2
    (bad / "_manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    with pytest.raises(VerifyError, match="steps_per_epoch"):
        verify(bad)


@pytest.mark.parametrize("extra, needle", [
    (["--epochs", "0"], "--epochs must be an integer >= 1"),
    (["--epochs", "2", "--engine", "ray"], "not supported by --engine ray"),
])
def test_impossible_epoch_settings_are_one_line(data, tmp_path, capsys, extra, needle):
    inp, _, _ = data
    out = tmp_path / "x"
    assert main(["balance", str(inp), str(out), *FLAGS, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_nightly_accepts_epochs(tmp_path):
    from pipelines import nightly

    src = write_samples(tmp_path / "s.parquet", n=300)
    work = tmp_path / "work"
    rc = nightly.main(["--input", str(src), "--format", "samples", "--output", str(work), "--ranks", "4",
                       "--batch-size-per-rank", "8", "--partitioner", "lpt-swap", "--epochs", "2", "--no-progress"])
    assert rc == 0
    m = Manifest.read(work / "latest" / "shards")
    assert m.epochs == 2 and m.steps_per_epoch == 300 // 32 and m.num_steps == 2 * (300 // 32)
    checked = json.loads((work / "latest" / "verify.json").read_text())
    assert checked["checked_input"] and checked["epochs"] == 2


def test_real_ml1m_per_user_three_epochs(tmp_path):
    """Real data: ml-1m per-user samples (6,040 users, histories up to 200), R=16 B=8, 3 epochs."""
    from tests.conftest import dataset_path

    seq = dataset_path("ml-1m_ensfm/sequences.txt")
    samples = tmp_path / "ml1m.parquet"
    assert main(["convert", str(seq), str(samples), "--format", "sequences", "--samples", "per-user",
                 "--max-seq-len", "200", "--no-progress", "-q"]) == 0
    out = tmp_path / "shards"
    assert main(["balance", str(samples), str(out), "--ranks", "16", "--batch-size-per-rank", "8", "--epochs", "3",
                 "--no-progress", "-q"]) == 0
    m = Manifest.read(out)
    S_e = 6040 // 128
    assert (m.epochs, m.steps_per_epoch, m.num_steps) == (3, S_e, 3 * S_e)
    got = verify(out, samples)
    assert got["checked_input"] and got["num_samples_written"] == 3 * S_e * 128
    assert got["num_samples_dropped"] == 3 * (6040 - S_e * 128)
    stats = pl.read_parquet(out / "_step_stats.parquet")
    lengths = pl.read_parquet(samples, columns=["item_ids"])["item_ids"].list.len().sum()
    dropped = pl.read_parquet(out / "_dropped.parquet")
    ids = pl.read_parquet(samples, columns=["sample_id", "item_ids"]).with_columns(
        pl.col("item_ids").list.len().alias("len")).drop("item_ids")
    for e in range(3):  # every epoch's tokens = all histories minus that epoch's dropped ones
        gone = ids.join(dropped.filter(pl.col("epoch") == e), on="sample_id")["len"].sum()
        tokens = stats.filter(pl.col("step") // S_e == e)["num_tokens"].sum()
        assert tokens == lengths - gone


def test_verify_catches_a_drop_recorded_in_the_wrong_epoch(data, tmp_path):
    _, out, _ = data
    bad = tmp_path / "dropped"
    shutil.copytree(out, bad)
    t = pq.read_table(bad / "_dropped.parquet")
    epoch = t.column("epoch").to_numpy().copy()
    epoch[0] = (epoch[0] + 1) % E
    t = t.set_column(1, "epoch", pa.array(epoch, pa.int32()))
    pq.write_table(t, bad / "_dropped.parquet", compression="zstd")
    raw = json.loads((bad / "_manifest.json").read_text())
    raw["dropped_sha256"] = hashlib.sha256((bad / "_dropped.parquet").read_bytes()).hexdigest()
    (bad / "_manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    with pytest.raises(VerifyError, match=r"epoch \d .*(samples written or dropped|both written and dropped)"):
        verify(bad)


def test_ray_write_of_a_multi_epoch_plan_is_one_line(data, tmp_path, capsys):
    inp, _, _ = data
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), *FLAGS, "--epochs", "2"]) == 0
    out = tmp_path / "w"
    assert main(["write", str(inp), str(plan), str(out), "--engine", "ray", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds 2 epochs" in err and "--engine local" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_cost_budget_epochs_record_their_own_step_counts(tmp_path):
    """Under cost-budget each epoch has its own step count (here 6, 6, 7, 6): recorded in
    epoch_num_steps; every epoch still holds every sample once, and verify checks it."""
    pytest.importorskip("torch")
    from fstrain.data import ShardReader

    inp = write_samples(tmp_path / "in.parquet", n=500)
    out = tmp_path / "cb"
    assert main(["balance", str(inp), str(out), "--ranks", "4", "--batch-size-per-rank", "4", "--epochs", "4",
                 "--batch-policy", "cost-budget", "--no-progress", "-q"]) == 0
    raw = json.loads((out / "_manifest.json").read_text())
    per = raw["epoch_num_steps"]
    assert raw["epochs"] == 4 and len(per) == 4 and sum(per) == raw["num_steps"] and len(set(per)) > 1
    assert "steps_per_epoch" not in raw  # the epochs differ
    m = Manifest.read(out)
    first = m.epoch_first_steps()
    assert m.epoch_num_steps == per and first.tolist() == [0, *np.cumsum(per).tolist()]
    rows = _rows(out).with_columns(pl.Series("epoch", m.epoch_of_step(_rows(out)["step"].to_numpy())))
    dropped = pl.read_parquet(out / "_dropped.parquet")
    all_ids = set(pq.read_table(inp, columns=["sample_id"]).column(0).to_pylist())
    for e in range(4):
        ep = rows.filter(pl.col("epoch") == e)
        assert ep["step"].min() == first[e] and ep["step"].max() == first[e + 1] - 1
        gone = dropped.filter(pl.col("epoch") == e)["sample_id"].to_list()
        assert ep["sample_id"].n_unique() == ep.height and set(ep["sample_id"].to_list()) | set(gone) == all_ids
    got = verify(out, inp)
    assert got["checked_input"] and got["epoch_num_steps"] == per
    assert ShardReader(str(out), 0, 4, num_prefetch_batches=0).epoch_num_steps == per
    # a manifest whose epoch step counts no longer sum to num_steps is refused
    raw["epoch_num_steps"] = [per[0] + 1, *per[1:]]
    (out / "_manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    with pytest.raises(VerifyError, match="epoch_num_steps"):
        verify(out)
