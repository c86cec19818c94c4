"""INPUT, PLAN and OUTPUT as ``pyarrow.fs`` URIs, tested against a real S3 endpoint on this machine.

A moto S3 server (``moto.server.ThreadedMotoServer``, module-scoped, on a free port) stands in for
S3; the CLI reaches it through the standard AWS environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...), which PyArrow's S3 client honours. Outputs written to S3 are compared
byte for byte with the same run on local paths.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install 'freescale[test]'")

from fsdata import fsio  # noqa: E402
from fsdata.cli import main  # noqa: E402
from fsdata.guards import overlap  # noqa: E402
from fsdata.shards import writer  # noqa: E402
from tests.fsdata.helpers import write_samples  # noqa: E402
from tests.ports import free_port  # noqa: E402

_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true"}
_BALANCE = ["--ranks", "4", "--batch-size-per-rank", "16", "--seed", "3", "--no-progress"]
_names = itertools.count()



class S3:
    """The moto endpoint: ``fs`` (a PyArrow S3FileSystem on it) and ``bucket()`` for a fresh bucket."""

    def __init__(self, port: int) -> None:
        self.endpoint = f"127.0.0.1:{port}"
        self.fs = pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", access_key="testing",
                                    secret_key="testing", region="us-east-1", allow_bucket_creation=True)

    def bucket(self) -> str:
        name = f"fsdata-test-{next(_names)}"
        self.fs.create_dir(name)
        return name

    def upload(self, local: Path, dest: str) -> None:
        """Copy a local file or folder to ``dest`` (``bucket/prefix``)."""
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for p in files:
            key = dest if local.is_file() else f"{dest}/{p.relative_to(local).as_posix()}"
            with self.fs.open_output_stream(key) as f:
                f.write(p.read_bytes())

    def digests(self, prefix: str) -> dict[str, str]:
        """SHA-256 of every object under ``prefix`` (``bucket/prefix``), by relative key."""
        infos = self.fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
        out = {}
        for i in infos:
            if i.type == pafs.FileType.File:
                with self.fs.open_input_stream(i.path) as f:
                    out[i.path[len(prefix) + 1:]] = hashlib.sha256(f.read()).hexdigest()
        return out

    def keys(self, prefix: str) -> list[str]:
        return sorted(self.digests(prefix))


def _local_digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def s3():
    """A real S3 endpoint (moto server thread) and the AWS environment variables pointing at it."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server.start()
    env = {**_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fsio._filesystem.cache_clear()
    try:
        yield S3(port)
    finally:
        fsio._filesystem.cache_clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    """Three Parquet files, timestamps, 1000 samples: 15 steps of 4 x 16 and a dropped remainder."""
    return write_samples(tmp_path_factory.mktemp("in") / "in", n=1000, num_files=3, with_timestamps=True)


@pytest.fixture(scope="module")
def local_out(samples, tmp_path_factory) -> Path:
    """The reference: the same balance on local paths."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert main(["balance", str(samples), str(out), *_BALANCE]) == 0
    return out


@pytest.fixture
def s3_input(s3, samples) -> tuple[str, str]:
    """``(bucket, URI of the input prefix)`` with ``samples`` uploaded."""
    b = s3.bucket()
    s3.upload(samples, f"{b}/in")
    return b, f"s3://{b}/in/"


def test_balance_local_engine_s3_to_s3_is_byte_identical_and_verifies(s3, s3_input, local_out, capsys):
    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 0
    want = _local_digests(local_out)
    assert "_manifest.json" in want and "_dropped.parquet" in want and len(want) == 4 + 3
    assert s3.digests(f"{b}/out") == want  # every object, byte for byte; nothing else under the prefix
    capsys.readouterr()
    assert main(["verify", f"s3://{b}/out", "--input", inp, "--no-progress"]) == 0
    assert "input fully accounted for" in capsys.readouterr().out


def test_verify_catches_a_corrupted_object(s3, s3_input, capsys):
    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 0
    key = f"{b}/out/rank-00002/part-00000.parquet"
    with s3.fs.open_input_stream(key) as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    with s3.fs.open_output_stream(key) as f:
        f.write(bytes(data))
    capsys.readouterr()
    assert main(["verify", f"s3://{b}/out", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdata: error: rank 2: checksum of s3://") and len(err.strip().splitlines()) == 1


def test_existing_output_prefix_is_refused_then_replaced_with_overwrite(s3, s3_input, local_out, capsys):
    b, inp = s3_input
    with s3.fs.open_output_stream(f"{b}/taken/notes.txt") as f:
        f.write(b"keep me")
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/taken", *_BALANCE]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert s3.keys(f"{b}/taken") == ["notes.txt"]
    assert main(["balance", inp, f"s3://{b}/taken", *_BALANCE, "--overwrite"]) == 2  # not FreeScale's: kept
    assert "did not write" in capsys.readouterr().err and s3.keys(f"{b}/taken") == ["notes.txt"]
    assert main(["balance", inp, f"s3://{b}/ours", *_BALANCE[:-3], "--seed", "9", "--no-progress"]) == 0
    assert main(["balance", inp, f"s3://{b}/ours", *_BALANCE, "--overwrite"]) == 0
    # replaced by a new version prefix and the pointer object readers follow (nothing deleted first)
    current = fsio.resolve_pointer(f"s3://{b}/ours")
    assert current.startswith(f"s3://{b}/ours/_versions/")
    assert s3.digests(current[len("s3://"):]) == _local_digests(local_out)
    assert "_manifest.json" not in s3.keys(f"{b}/ours")  # the previous output is gone once the pointer switched


@pytest.mark.parametrize("error, words", [
    (OSError(5, "Input/output error (injected)"), "input/output error (EIO)"),
    (OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied (injected)"), "ACCESS_DENIED"),
])
def test_failure_mid_write_leaves_no_manifest_and_nothing_written(s3, s3_input, monkeypatch, capsys, error, words):
    b, inp = s3_input
    real = writer.write_rank
    seen: list[list[str]] = []

    def fail_at_rank_2(rank, *args, **kwargs):
        if rank == 2:
            seen.append(s3.keys(f"{b}/out"))
            raise error
        return real(rank, *args, **kwargs)

    monkeypatch.setattr(writer, "write_rank", fail_at_rank_2)
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE, "--num-threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fsdata: error: cannot write s3://{b}/out") and words in err
    assert "nothing was written" in err and len(err.strip().splitlines()) == 1
    assert seen == [[f"rank-{r:05d}/part-00000.parquet" for r in range(2)]]  # written before the failure
    assert s3.keys(f"{b}/out") == []  # ... and deleted; no manifest, nothing left


def test_stages_on_s3_and_a_prefix_without_manifest_is_incomplete(s3, s3_input, local_out, capsys):
    b, inp = s3_input
    plan, out = f"s3://{b}/plan.parquet", f"s3://{b}/staged"
    assert main(["profile", inp, "--ranks", "4", "--batch-size-per-rank", "16", "--json"]) == 0
    assert main(["plan", inp, plan, *_BALANCE]) == 0
    assert main(["write", inp, plan, out, "--no-progress"]) == 0
    assert s3.keys(f"{b}/staged") == [f"rank-{r:05d}/part-00000.parquet" for r in range(4)]
    capsys.readouterr()
    assert main(["verify", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds rank files but no manifest" in err and "incomplete" in err and len(err.strip().splitlines()) == 1
    from fsdata.shards.manifest import Manifest, ManifestError

    with pytest.raises(ManifestError, match="incomplete OUTPUT"):  # fstrain's reader goes through Manifest.read
        Manifest.read(out)
    assert main(["finalize", out, "--plan", plan, "--no-progress"]) == 0
    assert s3.digests(f"{b}/staged") == _local_digests(local_out)
    assert main(["verify", out, "--input", inp, "--no-progress"]) == 0


def test_output_overlapping_input_is_refused_for_uris(s3, s3_input, capsys):
    b, inp = s3_input
    capsys.readouterr()
    assert main(["balance", inp, f"s3://{b}/in/out", *_BALANCE]) == 2
    assert "lies inside INPUT" in capsys.readouterr().err
    assert overlap(f"s3://{b}/in?region=us-east-1", f"s3://{b}/in/") == "is"  # the query is not the place
    assert overlap(f"s3://{b}", f"s3://{b}/in") == "contains"
    assert overlap(f"s3://{b}/inn", f"s3://{b}/in") is None
    assert overlap("/tmp/in", f"s3://{b}/in") is None
    assert s3.keys(f"{b}/in") == [f"part-{i:03d}.parquet" for i in range(3)]


def test_uri_query_names_the_endpoint(s3, s3_input, local_out, monkeypatch):
    """Without AWS_ENDPOINT_URL: ``?endpoint_override=...&scheme=http`` (FileSystem.from_uri) reaches it."""
    b, _ = s3_input
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    fsio._filesystem.cache_clear()
    q = f"?endpoint_override={s3.endpoint}&scheme=http&region=us-east-1"
    try:
        assert main(["balance", f"s3://{b}/in/{q}", f"s3://{b}/viaquery{q}", *_BALANCE]) == 0
    finally:
        fsio._filesystem.cache_clear()
    assert s3.digests(f"{b}/viaquery") == _local_digests(local_out)


def test_file_uris_behave_as_local_paths(samples, local_out, tmp_path):
    out = tmp_path / "out"
    assert main(["balance", f"file://{samples}", f"file://{out}", *_BALANCE]) == 0
    assert _local_digests(out) == _local_digests(local_out)
    assert main(["verify", f"file://{out}", "--input", f"file://{samples}", "--no-progress"]) == 0


@pytest.mark.slow
def test_ray_engine_s3_to_s3_is_byte_identical(s3, s3_input, local_out, monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'freescale[ray]'")
    from fsdata.engines import ray as ray_engine

    monkeypatch.setattr(ray_engine.chunks, "CHUNK_ROWS", 1)  # a chunk per row group, several write groups
    monkeypatch.setattr(ray_engine.write, "GROUP_ROWS", 300)
    b, inp = s3_input
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="fsray-", dir="/tmp")  # workers inherit the AWS_* variables set above
    ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False,
             log_to_driver=False,
             _temp_dir=temp_dir)
    try:
        assert main(["balance", inp, f"s3://{b}/rayout", *_BALANCE, "--engine", "ray"]) == 0
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert s3.digests(f"{b}/rayout") == _local_digests(local_out)


def test_fstrain_reads_an_s3_output_and_refuses_one_without_manifest(s3, s3_input):
    data = pytest.importorskip("fstrain.data", reason="fstrain needs torch: pip install 'freescale[train-cpu]'")
    b, inp = s3_input
    assert main(["balance", inp, f"s3://{b}/out", *_BALANCE]) == 0
    reader = data.ShardReader(f"s3://{b}/out", 1, 4)
    assert [batch.step for batch in reader] == list(range(15))
    s3.fs.delete_file(f"{b}/out/_manifest.json")
    from fstrain.errors import ShardError

    with pytest.raises(ShardError, match="holds rank files but no manifest, so it is an incomplete OUTPUT"):
        data.ShardReader(f"s3://{b}/out", 1, 4)
