"""A resharded input (an OUTPUT read back, ``--from-step``): ``--engine ray`` writes the same bytes as
``--engine local`` (one in-process Ray instance, module-scoped)."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'freescale[ray]'")

import fsdata  # noqa: E402
from fsdata.errors import ConfigError  # noqa: E402
from fsdata.shards.verify import verify  # noqa: E402
from tests.fsdata.helpers import write_samples  # noqa: E402


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="fsray-", dir="/tmp")
    ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False,
             log_to_driver=False, _temp_dir=temp_dir)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("kw", [{"from_step": 5}, {"from_step": 0, "compose_window": 4}, {}])
def test_resharded_input_byte_identical(local_ray, tmp_path, kw):
    inp = write_samples(tmp_path / "in.parquet", n=1500, with_timestamps=True)
    old = tmp_path / "old"
    fsdata.balance(inp, old, fsdata.BalanceSettings(num_ranks=4, batch_size_per_rank=16, compose_window=1,
                                                   progress=False))
    settings = fsdata.BalanceSettings(num_ranks=3, batch_size_per_rank=8, progress=False,
                                      **{"compose_window": 1, **kw})
    fsdata.balance(old, tmp_path / "local", settings)
    fsdata.balance(old, tmp_path / "ray", dataclasses.replace(settings, engine="ray"))
    a, b = _digests(tmp_path / "local"), _digests(tmp_path / "ray")
    assert "_manifest.json" in a and a == b
    assert verify(tmp_path / "ray", old, from_step=kw.get("from_step"))["checked_input"]


def test_partial_epoch_reshard_is_local_only(local_ray, tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=600)
    old = tmp_path / "old"
    fsdata.balance(inp, old, fsdata.BalanceSettings(num_ranks=2, batch_size_per_rank=16, compose_window=1,
                                                   epochs=2, progress=False))
    with pytest.raises(ConfigError, match="use --engine local|use engine='local'|engine local"):
        fsdata.balance(old, tmp_path / "ray", fsdata.BalanceSettings(num_ranks=3, batch_size_per_rank=8,
                                                                     from_step=3, engine="ray", progress=False))
    assert not (tmp_path / "ray").exists()


@pytest.mark.parametrize("from_step", [None, 6, 7])
def test_in_place_ray_equals_the_local_copy(local_ray, tmp_path, monkeypatch, from_step):
    """Rank files read in place by Ray tasks, one row group per chunk (the first chunk of a file
    starting inside a row group at step 7): the bytes of the local engine reading the scratch copy."""
    import fsdata.engines.ray as ray_engine
    from fsdata.shards import as_input, writer
    from tests.fsdata.test_reshard_direct import GROUP_ROWS, digests

    inp = write_samples(tmp_path / "in.parquet", n=1500, with_timestamps=True)
    monkeypatch.setattr(writer, "ROW_GROUP_ROWS", GROUP_ROWS)
    fsdata.balance(inp, tmp_path / "old", fsdata.BalanceSettings(num_ranks=4, batch_size_per_rank=16,
                                                                 compose_window=1, progress=False))
    monkeypatch.undo()
    settings = fsdata.BalanceSettings(num_ranks=3, batch_size_per_rank=8, compose_window=1, progress=False,
                                      from_step=from_step)
    monkeypatch.setattr(as_input, "READ_IN_PLACE", False)
    fsdata.balance(tmp_path / "old", tmp_path / "copy", settings)
    monkeypatch.setattr(as_input, "READ_IN_PLACE", True)
    monkeypatch.setattr(as_input, "write_rows", lambda *a, **k: pytest.fail("the OUTPUT was copied"))
    monkeypatch.setattr(ray_engine.chunks, "CHUNK_ROWS", 1)
    fsdata.balance(tmp_path / "old", tmp_path / "ray", dataclasses.replace(settings, engine="ray"))
    a, b = digests(tmp_path / "copy"), digests(tmp_path / "ray")
    assert "_manifest.json" in a and a == b
