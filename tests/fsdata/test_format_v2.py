"""Format v2 (issue 9): folder-level readers, reserved columns, v1 read compatibility, the stages
(issue 12), and verify's checks of everything a reader relies on, including a fuzz test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdata
from fsdata.samples import schema as S
from fsdata.shards.manifest import sha256_file
from fsdata.cli import main
from fsdata.errors import VerifyError
from fsdata.shards.manifest import FORMAT_VERSION, Manifest, ManifestError
from fsdata.shards.verify import verify
from tests.fsdata.helpers import write_samples

N, R, B = 300, 2, 8  # 18 steps, 12 dropped


def _balance(inp, out, *extra) -> int:
    return main(["balance", str(inp), str(out), "--ranks", str(R), "--batch-size-per-rank", str(B), "--no-progress",
                 "--partitioner", "lpt-swap", *extra])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    inp = write_samples(d / "in.parquet", n=N, with_timestamps=True)
    out = d / "out"
    assert _balance(inp, out) == 0
    return inp, out


def _copy(good, tmp_path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(good[1], dst)
    return dst


def _manifest(out: Path) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def _put_manifest(out: Path, m) -> None:
    (out / "_manifest.json").write_text(json.dumps(m, indent=2))


def _rewrite_rank_file(out: Path, rank: int, table: pa.Table) -> None:
    """Replace a rank file and update its manifest entry (checksum, bytes, rows) as a forger would."""
    path = out / f"rank-{rank:05d}" / "part-00000.parquet"
    pq.write_table(table, path, compression="zstd")
    m = _manifest(out)
    m["files"][rank].update(sha256=sha256_file(path), num_bytes=path.stat().st_size, num_rows=table.num_rows)
    _put_manifest(out, m)


def _fails(out: Path, inp=None, match: str | None = None) -> str:
    with pytest.raises(VerifyError) as e:
        verify(out, inp)
    msg = str(e.value)
    assert "\n" not in msg
    if match:
        assert match in msg, msg
    return msg


# ---- readers -------------------------------------------------------------------------------------

def test_folder_level_readers_skip_metadata_and_read_rank_as_int32(good):
    _, out = good
    n = pq.read_metadata(out / "rank-00000" / "part-00000.parquet").num_rows * R
    frames = {
        "polars": pl.scan_parquet(f"{out}/*/*.parquet").collect(),
        "pyarrow.dataset": pl.from_arrow(ds.dataset(out).to_table()),
        "pyarrow.dataset hive": pl.from_arrow(ds.dataset(out, partitioning="hive").to_table()),
        "pq.read_table": pl.from_arrow(pq.read_table(out)),
    }
    duckdb = pytest.importorskip("duckdb", reason="duckdb is in the [test] extra")
    frames["duckdb"] = duckdb.sql(f"SELECT * FROM read_parquet('{out}/*/*.parquet')").pl()
    for name, df in frames.items():
        assert df.height == n, name  # no metadata rows counted as samples
        assert df.schema[S.RANK] == pl.Int32 and df.schema[S.STEP] == pl.Int32, name
        assert sorted(df[S.RANK].unique().to_list()) == list(range(R)), name
        assert df[S.SAMPLE_ID].n_unique() == n, name


# ---- reserved columns ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["step", "rank"])
def test_reserved_input_column_is_refused(tmp_path, capsys, name):
    inp = write_samples(tmp_path / "in.parquet", n=64)
    t = pq.read_table(inp)
    pq.write_table(t.append_column(name, pa.array(np.arange(64, dtype=np.int64))), inp)
    out = tmp_path / "out"
    assert _balance(inp, out) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"'{name}'" in err and "--columns" in err and "reserved" in err
    assert not out.exists()
    assert main(["plan", str(inp), str(tmp_path / "p.parquet"), "--ranks", "2", "--batch-size-per-rank", "4",
                 "--no-progress"]) == 2
    assert not (tmp_path / "p.parquet").exists()


def test_reserved_name_mapped_onto_contract_column_is_fine(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=64)
    t = pq.read_table(inp)
    pq.write_table(t.rename_columns(["sample_id", "user_id", "step", "target_item_id"]), inp)
    out = tmp_path / "out"
    assert _balance(inp, out, "--columns", "item_ids=step") == 0
    df = pl.scan_parquet(f"{out}/*/*.parquet").collect()
    assert df.columns.count("step") == 1 and df.schema[S.ITEM_IDS] == pl.List(pl.Int64)
    verify(out, inp, column_map="item_ids=step")
    verify(out, inp)  # the mapping is recorded in the manifest's settings


# ---- v1 read compatibility -----------------------------------------------------------------------

def _to_v1(src: Path, dst: Path) -> None:
    """Rewrite a v2 OUTPUT as format_version 1 (names, rank=XXXXX folders, no rank column)."""
    m = _manifest(src)
    dst.mkdir()
    for f in m["files"]:
        r = f["rank"]
        rel = f"rank={r:05d}/part-00000.parquet"
        (dst / f"rank={r:05d}").mkdir()
        pf = pq.ParquetFile(src / f["path"])
        with pq.ParquetWriter(dst / rel, pf.schema_arrow.remove(pf.schema_arrow.get_field_index("rank")),
                              compression="zstd") as w:
            for g in range(pf.num_row_groups):
                w.write_table(pf.read_row_group(g).drop_columns(["rank"]))
        f.update(path=rel, num_bytes=(dst / rel).stat().st_size, sha256=sha256_file(dst / rel))
    shutil.copy(src / "_step_stats.parquet", dst / "step_stats.parquet")
    if m["dropped_file"]:
        shutil.copy(src / "_dropped.parquet", dst / "dropped.parquet")
        m["dropped_file"] = "dropped.parquet"
    for k in ("fsdata_version", "input_digest", "step_stats_sha256", "dropped_sha256"):
        m.pop(k)
    m.update(format_version=1, step_stats_file="step_stats.parquet", columns=m["columns"][:-1])
    (dst / "manifest.json").write_text(json.dumps(m, indent=2))


def test_v1_output_still_verifies_and_reads(good, tmp_path):
    inp, out = good
    v1 = tmp_path / "v1"
    _to_v1(out, v1)
    r = verify(v1, inp)
    assert r["format_version"] == 1 and r["checked_input"]
    m = Manifest.read(v1)
    assert m.format_version == 1 and m.rank_file(1).endswith("rank=00001/part-00000.parquet")
    (v1 / "manifest.json").rename(v1 / "_manifest.json")  # a v1 manifest under the v2 name is refused
    with pytest.raises(ManifestError, match="format_version 1"):
        Manifest.read(v1)


def test_fstrain_reads_v1_and_v2(good, tmp_path):
    pytest.importorskip("torchrec")
    from fstrain.data import ShardReader

    _, out = good
    v1 = tmp_path / "v1"
    _to_v1(out, v1)
    for d in (out, v1):
        batches = list(ShardReader(str(d), 1, R, num_prefetch_batches=0))
        assert len(batches) == N // (R * B) and all(b.num_samples == B for b in batches)
    a = [b.sample_ids.tolist() for b in ShardReader(str(out), 0, R, num_prefetch_batches=0)]
    b = [b.sample_ids.tolist() for b in ShardReader(str(v1), 0, R, num_prefetch_batches=0)]
    assert a == b


# ---- stages --------------------------------------------------------------------------------------

def test_stages_byte_identical_to_balance(good, tmp_path):
    inp, out = good
    plan = tmp_path / "plan.parquet"
    common = ["--ranks", str(R), "--batch-size-per-rank", str(B), "--partitioner", "lpt-swap", "--no-progress"]
    assert main(["plan", str(inp), str(plan), *common]) == 0
    t = pq.read_table(plan)
    assert t.schema.names[:4] == ["sample_id", "step", "rank", "position"]
    assert [t.schema.field(i).type for i in range(4)] == [pa.int64(), pa.int32(), pa.int32(), pa.int32()]
    meta = json.loads(t.schema.metadata[b"fsdata.plan"])
    assert meta["num_ranks"] == R and "predicted_bubble" in meta and meta["settings"]["seed"] == 0
    staged = tmp_path / "staged"
    assert main(["write", str(inp), str(plan), str(staged), "--no-progress"]) == 0
    assert not (staged / "_manifest.json").exists()
    assert main(["finalize", str(staged), "--plan", str(plan), "--no-progress"]) == 0
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    for n in names:
        assert (out / n).read_bytes() == (staged / n).read_bytes(), n
    # the plan's positions are the rows' order inside each (step, rank) batch
    df = pl.from_arrow(t).filter(pl.col("step") >= 0).sort("sample_id")
    back = pl.scan_parquet(f"{out}/*/*.parquet").collect().with_row_index("row")
    back = back.with_columns((pl.col("row") - pl.col("row").min().over("rank", "step")).cast(pl.Int32).alias("pos"))
    j = back.select("sample_id", "pos").join(df, on="sample_id")
    assert j.height == df.height and (j["pos"] == j["position"]).all()


def test_python_entry_point(good, tmp_path):
    inp, out = good
    m = fsdata.balance(inp, tmp_path / "py", fsdata.BalanceSettings(num_ranks=R, batch_size_per_rank=B,
                                                                    partitioner="lpt-swap", progress=False))
    assert isinstance(m, fsdata.Manifest) and m.format_version == FORMAT_VERSION == 4
    assert (tmp_path / "py" / "_manifest.json").read_bytes() == (out / "_manifest.json").read_bytes()
    assert m.fsdata_version == fsdata.__version__ and m.input_digest.startswith("sha256-footers:")
    assert m.settings["num_ranks"] == R and m.settings["strategy"] == "balanced"


def test_write_refuses_another_input(good, tmp_path, capsys):
    inp, _ = good
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), "--ranks", str(R), "--batch-size-per-rank", str(B), "--no-progress"]) == 0
    other = write_samples(tmp_path / "other.parquet", n=N, seed=5)
    assert main(["write", str(other), str(plan), str(tmp_path / "o"), "--no-progress"]) == 2
    assert "rerun 'fsdata plan'" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_write_rank_is_order_independent(good, tmp_path):
    """The per-rank writer gives the same bytes whatever the order and chunking of its rows."""
    from fsdata.shards.plan_file import read_plan
    from fsdata.shards.writer import output_schema, write_rank
    from fsdata.samples.io import open_samples

    inp, out = good
    src = open_samples(inp)
    schema = output_schema(src)
    plan_path = tmp_path / "p.parquet"
    main(["plan", str(inp), str(plan_path), "--ranks", str(R), "--batch-size-per-rank", str(B),
          "--partitioner", "lpt-swap", "--no-progress"])
    plan = read_plan(plan_path)
    rows = pq.read_table(inp).append_column("step", pa.array(plan.step)).append_column("rank", pa.array(plan.rank))
    rows = rows.append_column("position", pa.array(plan.position))
    mine = rows.filter(pa.compute.equal(rows.column("rank"), 1))
    shuffled = mine.take(pa.array(np.random.default_rng(3).permutation(mine.num_rows)))
    chunked = pa.concat_tables([shuffled.slice(0, 7), shuffled.slice(7)])
    (tmp_path / "w").mkdir()
    from fsdata.shards.plan_file import plan_digest

    rec = write_rank(1, chunked, tmp_path / "w", schema, plan.num_steps, plan_digest=plan_digest(plan))
    assert (tmp_path / "w" / rec.path).read_bytes() == (out / rec.path).read_bytes()
    assert rec.sha256 == _manifest(out)["files"][1]["sha256"]


# ---- verify: each case of issue 9 ----------------------------------------------------------------

def test_good_output_verifies(good):
    inp, out = good
    r = verify(out, inp)
    assert r["checked_input"] and r["format_version"] == FORMAT_VERSION == 4


def test_extra_part_file(good, tmp_path):
    out = _copy(good, tmp_path)
    shutil.copy(out / "rank-00000" / "part-00000.parquet", out / "rank-00000" / "part-00001.parquet")
    _fails(out, match="part-00001.parquet")


def test_extra_rank_folder(good, tmp_path):
    out = _copy(good, tmp_path)
    shutil.copytree(out / "rank-00001", out / "rank-00064")
    _fails(out, match="rank-00064")


def test_row_group_splitting_a_step(good, tmp_path):
    out = _copy(good, tmp_path)
    t = pq.read_table(out / "rank-00000" / "part-00000.parquet")
    path = out / "rank-00000" / "part-00000.parquet"
    pq.write_table(t, path, row_group_size=B * 2 + 3, compression="zstd")
    m = _manifest(out)
    m["files"][0].update(sha256=sha256_file(path), num_bytes=path.stat().st_size)
    _put_manifest(out, m)
    _fails(out, match="spans two row groups")


def test_edited_step_stats_cost(good, tmp_path):
    out = _copy(good, tmp_path)
    t = pq.read_table(out / "_step_stats.parquet")
    c = t.column("predicted_cost").to_numpy().copy()
    c[3] *= 1.5
    pq.write_table(t.set_column(3, "predicted_cost", pa.array(c)), out / "_step_stats.parquet", compression="zstd")
    _fails(out, match="checksum of")
    m = _manifest(out)
    m["step_stats_sha256"] = sha256_file(out / "_step_stats.parquet")
    _put_manifest(out, m)
    _fails(out, match="predicted_cost of step 1 rank 1")


@pytest.mark.parametrize("key,value,fragment,with_input", [
    ("baseline_predicted_bubble", 0.5, "baseline_predicted_bubble", True),
    ("lower_bound_bubble", 0.01, "lower_bound_bubble", False),
    ("lower_bound_bubble", 0.01, "lower_bound_bubble", True),
    ("predicted_bubble", 0.2, "predicted bubble", False),
    ("seed", 1, "settings.seed", False),
    ("strategy", "shuffle", "settings.strategy", False),
    ("columns", ["sample_id", "step"], "columns", False),
    ("num_samples_input", N + 1, "num_samples_input", False),
])
def test_manifest_field_not_recomputed_before(good, tmp_path, key, value, fragment, with_input):
    inp, out = good
    out = _copy(good, tmp_path)
    m = _manifest(out)
    m[key] = value
    _put_manifest(out, m)
    _fails(out, inp if with_input else None, match=fragment)


def test_seed_edited_in_both_places_caught_with_input(good, tmp_path):
    inp, _ = good
    out = _copy(good, tmp_path)
    m = _manifest(out)
    m["seed"] = m["settings"]["seed"] = 7
    _put_manifest(out, m)
    _fails(out, inp, match="seed")


def test_changed_row_content_with_updated_checksum(good, tmp_path):
    inp, _ = good
    out = _copy(good, tmp_path)
    t = pq.read_table(out / "rank-00001" / "part-00000.parquet")
    tgt = t.column(S.TARGET_ITEM_ID).to_numpy().copy()
    tgt[5] += 1
    _rewrite_rank_file(out, 1, t.set_column(t.schema.get_field_index(S.TARGET_ITEM_ID), S.TARGET_ITEM_ID,
                                            pa.array(tgt)))
    verify(out)  # nothing without the input can tell
    _fails(out, inp, match="differ in content")


@pytest.mark.parametrize("case", ["missing_dropped", "corrupt_dropped", "negative_step", "manifest_list",
                                  "file_without_sha256", "two_coefficients", "manifest_not_json"])
def test_malformed_outputs_fail_cleanly(good, tmp_path, capsys, case):
    out = _copy(good, tmp_path)
    m = _manifest(out)
    if case == "missing_dropped":
        (out / "_dropped.parquet").unlink()
    elif case == "corrupt_dropped":
        (out / "_dropped.parquet").write_bytes(b"PAR1 not really")
    elif case == "negative_step":
        t = pq.read_table(out / "rank-00000" / "part-00000.parquet")
        s = t.column(S.STEP).to_numpy().copy()
        s[0] = -1
        _rewrite_rank_file(out, 0, t.set_column(t.schema.get_field_index(S.STEP), S.STEP, pa.array(s, pa.int32())))
        m = _manifest(out)
    elif case == "manifest_list":
        m = [m]
    elif case == "file_without_sha256":
        del m["files"][1]["sha256"]
    elif case == "two_coefficients":
        m["cost_model"]["coefficients"] = [1.0, 2.0]
    if case == "manifest_not_json":
        (out / "_manifest.json").write_text("{not json")
    else:
        _put_manifest(out, m)
    assert main(["verify", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fsdata: error:") and "Traceback" not in err


# ---- fuzz ----------------------------------------------------------------------------------------

_MANIFEST_KEYS = ["format_version", "num_ranks", "num_steps", "batch_size_per_rank", "batch_policy", "strategy",
                  "num_samples_input", "num_samples_written", "num_samples_dropped", "remainder_policy",
                  "dropped_file", "cost_model", "seed", "predicted_bubble", "baseline_predicted_bubble",
                  "lower_bound_bubble", "columns", "step_stats_file", "step_stats_sha256", "dropped_sha256",
                  "input_digest", "files", "settings"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.integers(0, 3), max_size=3),
                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_DATA_FILES = ["_step_stats.parquet", "_dropped.parquet", "rank-00000/part-00000.parquet",
               "rank-00001/part-00000.parquet"]


def _mutate(out: Path, kind: str, data) -> None:
    m = _manifest(out)
    if kind == "manifest_value":
        key = data.draw(st.sampled_from(_MANIFEST_KEYS))
        value = data.draw(_VALUES.filter(lambda v: v != m[key] or type(v) is not type(m[key])))
        m[key] = value
        _put_manifest(out, m)
    elif kind == "manifest_delete":
        del m[data.draw(st.sampled_from([k for k in _MANIFEST_KEYS if k not in ("dropped_sha256",)]))]
        _put_manifest(out, m)
    elif kind == "file_entry":
        i = data.draw(st.integers(0, R - 1))
        key = data.draw(st.sampled_from(["rank", "path", "num_rows", "num_bytes", "sha256"]))
        if data.draw(st.booleans()):
            del m["files"][i][key]
        else:
            m["files"][i][key] = data.draw(_VALUES.filter(lambda v: v != m["files"][i][key]))
        _put_manifest(out, m)
    elif kind == "bytes":
        path = out / data.draw(st.sampled_from(_DATA_FILES))
        raw = bytearray(path.read_bytes())
        if data.draw(st.booleans()):
            path.write_bytes(bytes(raw[:data.draw(st.integers(0, len(raw) - 1))]))
        else:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
            path.write_bytes(bytes(raw))
    elif kind == "rows":
        r = data.draw(st.integers(0, R - 1))
        t = pq.read_table(out / f"rank-{r:05d}" / "part-00000.parquet")
        op = data.draw(st.sampled_from(["drop", "duplicate", "step", "content", "rank"]))
        i = data.draw(st.integers(0, t.num_rows - 1))
        if op == "drop":
            t = pa.concat_tables([t.slice(0, i), t.slice(i + 1)])
        elif op == "duplicate":
            t = pa.concat_tables([t.slice(0, i + 1), t.slice(i)])
        else:
            col = {"step": S.STEP, "content": S.USER_ID, "rank": S.RANK}[op]
            v = t.column(col).to_numpy().copy()
            v[i] = v[i] + data.draw(st.sampled_from([-100, -1, 1, 5]))
            t = t.set_column(t.schema.get_field_index(col), col, pa.array(v, t.schema.field(col).type))
        _rewrite_rank_file(out, r, t)
    elif kind == "extra_file":
        name = data.draw(st.sampled_from(["part-00001.parquet", "x.json", "rank-00009", "_SUCCESS", ".hidden"]))
        where = out / data.draw(st.sampled_from(["", "rank-00000"]))
        if name.startswith("rank-"):
            (where / name).mkdir()
        else:
            (where / name).write_bytes(b"x")
    elif kind == "remove":
        target = out / data.draw(st.sampled_from(_DATA_FILES + ["_manifest.json", "rank-00001"]))
        shutil.rmtree(target) if target.is_dir() else target.unlink()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(["manifest_value", "manifest_delete", "file_entry", "bytes", "rows",
                                             "extra_file", "remove"]))
def test_fuzz_mutated_outputs_fail_cleanly(good, tmp_path_factory, data, kind):
    inp, src = good
    out = tmp_path_factory.mktemp("fuzz") / "out"
    shutil.copytree(src, out)
    _mutate(out, kind, data)
    with pytest.raises(VerifyError) as e:
        verify(out, inp)
    assert "\n" not in str(e.value) and str(e.value)


# ---- the Manifest module -------------------------------------------------------------------------

def test_manifest_round_trip_and_unknown_keys_kept(good, tmp_path):
    _, out = good
    m = Manifest.read(out)
    assert m.dumps() == (out / "_manifest.json").read_text()
    raw = _manifest(out)
    raw["added_by_a_newer_fsdata"] = {"x": 1}
    back = Manifest.from_json(raw, path=str(out))
    assert back.to_json() == raw and list(back.to_json())[-1] == "added_by_a_newer_fsdata"
    (tmp_path / "o").mkdir()
    back.write(tmp_path / "o")
    assert json.loads((tmp_path / "o" / "_manifest.json").read_text()) == raw


def test_import_fsdata_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, fsdata; fsdata.balance; fsdata.Manifest; assert 'torch' not in sys.modules, 'torch imported'"
    import os

    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": root}, cwd=root)
    assert r.returncode == 0, r.stderr


def test_plan_takes_every_planning_flag_of_balance():
    from fsdata.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {name: {o for act in p._actions for o in act.option_strings} for name, p in sub.items()}
    write_only = {"--num-threads", "--bucket-compression", "--engine", "--ray-address"}
    reshard_only = {"--from-step"}  # an OUTPUT as INPUT: balance only (plan refuses an OUTPUT)
    assert flags["balance"] - write_only - reshard_only == flags["plan"]
    assert write_only <= flags["write"]


def test_finalize_refuses_files_that_do_not_match_the_plan(good, tmp_path, capsys):
    inp, _ = good
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), "--ranks", str(R), "--batch-size-per-rank", str(B), "--no-progress"]) == 0
    staged = tmp_path / "staged"
    assert main(["write", str(inp), str(plan), str(staged), "--no-progress"]) == 0
    (staged / "stray.txt").write_text("x")
    assert main(["finalize", str(staged), "--plan", str(plan)]) == 2
    assert "stray.txt" in capsys.readouterr().err and not (staged / "_manifest.json").exists()
    (staged / "stray.txt").unlink()
    f = staged / "rank-00001" / "part-00000.parquet"
    t = pq.read_table(f)
    pq.write_table(t.slice(0, t.num_rows - 1), f)
    assert main(["finalize", str(staged), "--plan", str(plan)]) == 2
    assert "rerun 'fsdata write'" in capsys.readouterr().err and not (staged / "_manifest.json").exists()


def test_verify_input_catches_a_sample_moved_out_of_its_composition_window(tmp_path):
    """Composition may regroup samples only inside a window of W global batches: a row swapped with
    an equal-length row of another window keeps every count, cost and bound, and is still caught."""
    inp = write_samples(tmp_path / "in.parquet", n=N, with_timestamps=True)
    out = tmp_path / "out"
    assert _balance(inp, out, "--compose-window", "2") == 0
    assert _manifest(out)["settings"]["compose_window"] == 2
    verify(out, inp)
    t = pq.read_table(out / "rank-00000" / "part-00000.parquet")
    step = t.column("step").to_numpy()
    lengths = np.array([len(x) for x in t.column(S.ITEM_IDS).to_pylist()])
    pair = next(((i, j) for i in np.flatnonzero(step // 2 == 0) for j in np.flatnonzero(step // 2 > 0)
                 if lengths[i] == lengths[j]), None)
    assert pair is not None, "test data: no equal-length pair across windows"
    i, j = pair
    rows = t.to_pylist()
    keep = {"step", "rank"}
    for k in rows[i]:
        if k not in keep:
            rows[i][k], rows[j][k] = rows[j][k], rows[i][k]
    _rewrite_rank_file(out, 0, pa.Table.from_pylist(rows, schema=t.schema))
    verify(out)  # without the input nothing a reader relies on changed
    _fails(out, inp, match="window of 2 steps")
