"""``fsdata balance --engine ray``: byte-identical to the local engine, on a real Ray cluster.

Most tests share one in-process Ray instance (``ray.init(num_cpus=2)`` with a small object store,
module-scoped, shut down after); one test starts a two-node cluster with ``ray start`` (a head and
a second worker node) and runs the CLI against it with ``--ray-address``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'freescale[ray]'")

import fsdata  # noqa: E402
from fsdata.samples import schema as S# noqa: E402
from fsdata.cli import main  # noqa: E402
from fsdata.engines import ray as ray_engine  # noqa: E402
from fsdata.shards.verify import verify  # noqa: E402
from tests.fsdata.helpers import write_samples  # noqa: E402
from tests.ports import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _digests(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _write_row_groups(path: Path, table: pa.Table, rows_per_group: int) -> Path:
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


@pytest.fixture(scope="module")
def local_ray():
    """A real in-process Ray instance: 2 CPUs, 100 MB object store, no dashboard; stopped after."""
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="fsray-", dir="/tmp")  # short: Unix socket paths <= 107 bytes
    ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False,
             log_to_driver=False, _temp_dir=temp_dir)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1 row group and rank groups of ~300 rows, so several tasks run per stage."""
    monkeypatch.setattr(ray_engine.chunks, "CHUNK_ROWS", 1)
    monkeypatch.setattr(ray_engine.write, "GROUP_ROWS", 300)


def _both(inp, tmp_path: Path, **kw) -> tuple[Path, Path, dict]:
    settings = fsdata.BalanceSettings(progress=False, **kw)
    fsdata.balance(inp, tmp_path / "local", settings)
    timings: dict = {}
    fsdata.balance(inp, tmp_path / "ray", dataclasses.replace(settings, engine="ray"), timings=timings)
    return tmp_path / "local", tmp_path / "ray", timings


@pytest.mark.parametrize("plan_window", [1024, 3])
def test_byte_identical_multi_file_timestamps_remainder(local_ray, small_chunks, tmp_path, plan_window):
    inp = write_samples(tmp_path / "in", n=2000, num_files=3, with_timestamps=True)
    loc, ray_out, timings = _both(inp, tmp_path, num_ranks=8, batch_size_per_rank=16, seed=7, compose_window=1,
                                  plan_window=plan_window)
    a, b = _digests(loc), _digests(ray_out)
    assert "_manifest.json" in a and "_dropped.parquet" in a and len(a) == 8 + 3
    assert a == b
    assert set(timings) == {"ray_connect", "read_lengths", "plan", "write_ranks", "verify", "finalize"}
    assert verify(ray_out, inp)["num_samples_written"] == 2000 // 128 * 128


@pytest.mark.parametrize("kw", [
    {"strategy": "shuffle"},
    {"batch_policy": "cost-budget"},
    {"partitioner": "kk", "seed": 3},
    {"bucket_compression": "lz4"},
    {"compose_window": 1},
    {"compose_window": 4},
    # several plan windows: one Ray plan task each, the driver never holds the rows
    {"compose_window": 2, "plan_window": 2},
    {"compose_window": 1, "plan_window": 3, "partitioner": "auto"},
    {"strategy": "shuffle", "plan_window": 1},
])
def test_byte_identical_other_policies_and_row_groups(local_ray, small_chunks, tmp_path, kw):
    """Many row groups (one chunk each) in one file with seq_len; shuffle, cost-budget, kk."""
    t = pq.read_table(write_samples(tmp_path / "w.parquet", n=1500, seed=2))
    t = t.append_column(S.SEQ_LEN, pa.compute.list_value_length(t.column(S.ITEM_IDS)).cast(pa.int32()))
    inp = _write_row_groups(tmp_path / "in.parquet", t, rows_per_group=200)
    assert pq.ParquetFile(inp).metadata.num_row_groups == 8
    loc, ray_out, _ = _both(inp, tmp_path, num_ranks=4, batch_size_per_rank=32, **kw)
    assert _digests(loc) == _digests(ray_out)


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_compressed_pieces_byte_identical(local_ray, small_chunks, tmp_path, monkeypatch, codec):
    """Pieces stored as compressed Arrow IPC (forced: the rows here always fit the object store)."""
    monkeypatch.setattr(ray_engine.write, "STORE_FRACTION", 0.0)
    inp = write_samples(tmp_path / "in", n=1500, num_files=2, seed=4)
    loc, ray_out, _ = _both(inp, tmp_path, num_ranks=4, batch_size_per_rank=32, bucket_compression=codec)
    assert _digests(loc) == _digests(ray_out)


def test_pieces_compressed_only_when_they_would_not_fit_the_object_store():
    codec = ray_engine.write.piece_compression
    assert codec("zstd", 1e9, 8e9) is None  # fits: compressing would only cost CPU
    assert codec("zstd", 7e9, 8e9) == "zstd"  # past 75% of the store: compressed, Ray spills less
    assert codec("lz4", 1e9, None) == "lz4"  # store size unknown: as asked
    assert codec(None, 7e9, 8e9) is None


def test_one_group_one_chunk(local_ray, tmp_path):
    """Default chunk/group sizes on a tiny input: one chunk, one rank group per CPU."""
    inp = write_samples(tmp_path / "in.parquet", n=700, seed=5)
    loc, ray_out, _ = _both(inp, tmp_path, num_ranks=2, batch_size_per_rank=8)
    assert _digests(loc) == _digests(ray_out)


def test_extra_columns_and_column_map(local_ray, small_chunks, tmp_path):
    """Input columns named differently (--columns) and a column outside the schema are carried."""
    t = pq.read_table(write_samples(tmp_path / "w.parquet", n=900, seed=4))
    t = t.rename_columns(["id", "user_id", "history", "target_item_id"])
    t = t.append_column("label", pa.array(np.arange(900) % 2, type=pa.int8()))
    inp = _write_row_groups(tmp_path / "in.parquet", t, rows_per_group=256)
    loc, ray_out, _ = _both(inp, tmp_path, num_ranks=3, batch_size_per_rank=10, columns="sample_id=id,item_ids=history")
    assert _digests(loc) == _digests(ray_out)
    assert "label" in pq.read_schema(ray_out / "rank-00000" / "part-00000.parquet").names


def _err(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("breakage", ["duplicate_id", "duplicate_id_across_chunks", "empty_history", "null_target",
                                      "seq_len_wrong"])
def test_bad_input_same_error_line_no_output(local_ray, small_chunks, tmp_path, capsys, breakage):
    t = pq.read_table(write_samples(tmp_path / "w.parquet", n=600, seed=1))
    if breakage == "duplicate_id":
        ids = t.column(S.SAMPLE_ID).to_numpy().copy()
        ids[500] = ids[3]
        t = t.set_column(0, S.SAMPLE_ID, pa.array(ids))
    elif breakage == "duplicate_id_across_chunks":  # every chunk's ids increase; rows 199 and 200 repeat one
        ids = np.arange(600, dtype=np.int64)
        ids[200:] -= 1
        t = t.set_column(0, S.SAMPLE_ID, pa.array(ids))
    elif breakage == "empty_history":
        items = t.column(S.ITEM_IDS).to_pylist()
        items[450] = []
        t = t.set_column(2, S.ITEM_IDS, pa.array(items, type=pa.list_(pa.int64())))
    elif breakage == "null_target":
        tg = t.column(S.TARGET_ITEM_ID).to_pylist()
        tg[420] = None
        t = t.set_column(3, S.TARGET_ITEM_ID, pa.array(tg, type=pa.int64()))
    else:
        seq = pa.compute.list_value_length(t.column(S.ITEM_IDS)).cast(pa.int32()).to_numpy().copy()
        seq[599] += 1
        t = t.append_column(S.SEQ_LEN, pa.array(seq))
    inp = _write_row_groups(tmp_path / "in.parquet", t, rows_per_group=200)
    before = inp.read_bytes()
    common = [str(inp), "--ranks", "4", "--batch-size-per-rank", "8", "--no-progress"]
    rc_l, err_l = _err(capsys, ["balance", common[0], str(tmp_path / "loc"), *common[1:]])
    rc_r, err_r = _err(capsys, ["balance", common[0], str(tmp_path / "ray"), *common[1:], "--engine", "ray"])
    assert rc_l == rc_r == 2
    assert err_r == err_l and err_r.startswith("fsdata: error: ") and "\n" not in err_r
    assert "Traceback" not in err_r and "Ray" not in err_r
    assert not (tmp_path / "ray").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ray")]
    assert inp.read_bytes() == before


def test_unordered_unique_ids_byte_identical(local_ray, small_chunks, tmp_path):
    """Ids in no order (the duplicate check then routes them to hashed buckets) balance as locally."""
    t = pq.read_table(write_samples(tmp_path / "w.parquet", n=600, seed=2))
    ids = np.random.default_rng(0).permutation(10_000)[:600].astype(np.int64)
    inp = _write_row_groups(tmp_path / "in.parquet", t.set_column(0, S.SAMPLE_ID, pa.array(ids)), rows_per_group=200)
    loc, ray_out, _ = _both(inp, tmp_path, num_ranks=4, batch_size_per_rank=8, seed=3)
    assert _digests(loc) == _digests(ray_out)


def test_existing_output_refused(local_ray, tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=300)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")  # an empty folder would be accepted, as by the local engine
    rc, err = _err(capsys, ["balance", str(inp), str(tmp_path / "out"), "--ranks", "2", "--batch-size-per-rank",
                            "4", "--engine", "ray", "--no-progress"])
    assert rc == 2 and "already exists" in err and "--overwrite" in err


def test_group_bounds_cover_ranks():
    b = ray_engine.group_bounds(256, 1_000_000, 2, group_rows=100_000)
    assert b[0] == 0 and b[-1] == 256 and len(b) == 11 and (np.diff(b) >= 1).all()
    assert len(ray_engine.group_bounds(3, 10, 8)) == 4  # never more groups than ranks
    assert len(ray_engine.group_bounds(64, 10, 1)) == 2


@pytest.mark.parametrize(("given", "env", "joined"), [(None, None, "local"), (None, "127.0.0.2:6390", "127.0.0.2:6390"),
                                                     ("127.0.0.1:7000", "127.0.0.2:6390", "127.0.0.1:7000")])
def test_session_without_an_address_starts_its_own_instance(local_ray, monkeypatch, given, env, joined):
    """No ``--ray-address`` and no ``RAY_ADDRESS``: a new local instance ("local"), never Ray's
    default of joining the last cluster started on this machine (another job's). The session ends
    only the processes it started: the module's running instance is left alone."""
    import psutil

    from fsdata.engines.ray import session

    others = session._our_processes()
    assert others, "the module's Ray instance has processes"
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the module's instance stays up
    monkeypatch.setattr(ray, "init", lambda address=None, **kw: seen.append(address))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    with session.ray_session(given):
        pass
    assert seen == [joined]
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in others)


def test_unknown_engine_is_one_line_error(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=100)
    with pytest.raises(fsdata.FsdataError, match="^unknown engine 'spark'"):  # Python: the setting's name
        fsdata.balance(inp, tmp_path / "o", fsdata.BalanceSettings(num_ranks=2, batch_size_per_rank=2,
                                                                    engine="spark", progress=False))


def _stop_cluster(temp_dir: str) -> None:
    """End the processes of the cluster started with ``temp_dir`` (and their children), by pid:
    every Ray daemon and worker carries its session folder, under ``temp_dir``, on its command
    line. (``ray stop`` would end every Ray process on the machine.)"""
    import psutil

    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(temp_dir in a for a in (p.info["cmdline"] or [])):
            procs.append(p)
            procs.extend(p.children(recursive=True))
    procs = list({p.pid: p for p in procs if p.pid != os.getpid()}.values())
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=15)



@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_two_node_cluster_via_ray_address(tmp_path):
    """``ray start --head`` plus a second node (``ray start --address``), then the CLI with
    ``--ray-address``; both nodes are stopped after (``ray stop`` with this cluster's temp dir)."""
    if ray.is_initialized():
        ray.shutdown()
    inp = write_samples(tmp_path / "in", n=1200, num_files=2, with_timestamps=True)
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="fsrc-", dir="/tmp")
    port = free_port()
    addr = f"127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    common = ["--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats",
              "--min-worker-port=0", "--max-worker-port=0"]
    try:
        subprocess.run([str(ray_bin), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                        "--include-dashboard=false", f"--temp-dir={temp_dir}", *common],
                       env=env, check=True, capture_output=True, timeout=180)
        subprocess.run([str(ray_bin), "start", f"--address={addr}", "--node-ip-address=127.0.0.1",
                        f"--temp-dir={temp_dir}", *common],
                       env=env, check=True, capture_output=True, timeout=180)
        out = tmp_path / "ray"
        r = subprocess.run([sys.executable, "-m", "fsdata", "balance", str(inp), str(out), "--ranks", "4",
                            "--batch-size-per-rank", "16", "--engine", "ray", "--ray-address", addr,
                            "--no-progress", "--json", "-v"], env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "tasks ran on 2 Ray nodes" in r.stderr, r.stderr[-2000:]
        probe = subprocess.run([sys.executable, "-c", "import ray; ray.init(address='" + addr + "', "
                                "log_to_driver=False); print(len([n for n in ray.nodes() if n['Alive']]))"],
                               env=env, capture_output=True, text=True, timeout=120)
        assert probe.stdout.strip().splitlines()[-1] == "2", probe.stderr[-2000:]
        fsdata.balance(inp, tmp_path / "local", fsdata.BalanceSettings(num_ranks=4, batch_size_per_rank=16,
                                                                       progress=False))
        m_ray, m_local = (json.loads((o / "_manifest.json").read_text()) for o in (out, tmp_path / "local"))
        assert m_ray == m_local
        assert _digests(out) == _digests(tmp_path / "local")
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_stages_write_with_ray_engine(local_ray, small_chunks, tmp_path, capsys):
    """``fsdata plan`` + ``fsdata write --engine ray`` + ``fsdata finalize`` = ``fsdata balance``."""
    inp = write_samples(tmp_path / "in", n=1100, num_files=2, seed=9)
    flags = ["--ranks", "4", "--batch-size-per-rank", "16", "--no-progress"]
    assert main(["balance", str(inp), str(tmp_path / "local"), *flags]) == 0
    assert main(["plan", str(inp), str(tmp_path / "plan.parquet"), *flags]) == 0
    assert main(["write", str(inp), str(tmp_path / "plan.parquet"), str(tmp_path / "staged"), "--engine", "ray",
                 "--no-progress"]) == 0
    assert main(["finalize", str(tmp_path / "staged"), "--plan", str(tmp_path / "plan.parquet")]) == 0
    capsys.readouterr()
    assert _digests(tmp_path / "staged") == _digests(tmp_path / "local")


def test_nightly_engine_ray_publishes_the_local_bytes(local_ray, small_chunks, tmp_path):
    """`python -m pipelines.nightly --engine ray`: the published shards equal the local engine's,
    and the engine is not part of the run key (same input and settings: the same run)."""
    from pipelines import nightly

    samples = write_samples(tmp_path / "s.parquet", n=900, seed=4)
    common = ["--input", str(samples), "--format", "samples", "--ranks", "4", "--batch-size-per-rank", "8",
              "--compose-window", "4", "--no-progress", "--json"]
    assert nightly.main(common + ["--output", str(tmp_path / "local")]) == 0
    assert nightly.main(common + ["--output", str(tmp_path / "ray"), "--engine", "ray"]) == 0
    local = os.path.realpath(tmp_path / "local" / "latest")
    on_ray = os.path.realpath(tmp_path / "ray" / "latest")
    assert os.path.basename(local) == os.path.basename(on_ray)  # same run key
    assert _digests(Path(local) / "shards") == _digests(Path(on_ray) / "shards")


def test_windowed_plan_holds_no_rows_on_the_driver(local_ray, small_chunks, tmp_path):
    """The Ray plan stage returns only window summaries to the driver (no per-row arrays), runs
    one plan task per window, and its figures equal the local engine's plan, bit for bit."""
    from fsdata.samples.io import open_samples
    from fsdata.engines.planning import make_plan_table

    inp = write_samples(tmp_path / "in", n=1500, num_files=2, seed=4)
    settings = fsdata.BalanceSettings(num_ranks=4, batch_size_per_rank=16, compose_window=2, plan_window=4,
                                      progress=False)
    src = open_samples(inp)
    chunks = ray_engine.make_chunks(src.files)
    table, chunk_plans, _ = ray_engine.plan_windowed(ray, src, settings, chunks, num_cpus=2)
    assert len(table.sample_id) == len(table.step) == len(table.cost) == 0
    num_windows = -(-(1500 // 64) // 4)
    assert len(chunk_plans) == len(chunks) and all(len(c) == num_windows for c in chunk_plans) and num_windows == 6
    local = make_plan_table(src, settings)
    counts, loads = local.counts_and_loads()
    assert np.array_equal(table.counts, counts) and np.array_equal(table.loads, loads)
    assert table.meta == local.meta
    assert np.array_equal(table.dropped_sample_ids(), local.dropped_sample_ids())


def test_cli_ranks_1_is_one_rank_group(local_ray, tmp_path):
    """``--ranks 1``: one write group (Ray stores a one-value task result as the value itself)."""
    inp = write_samples(tmp_path / "in.parquet", n=400)
    args = ["--ranks", "1", "--batch-size-per-rank", "16", "--seed", "2", "--no-progress"]
    assert main(["balance", str(inp), str(tmp_path / "local"), *args]) == 0
    assert main(["balance", str(inp), str(tmp_path / "ray"), *args, "--engine", "ray"]) == 0
    assert _digests(tmp_path / "ray") == _digests(tmp_path / "local")
