"""``--engine ray`` on a 1-CPU Ray cluster and at ``--ranks 1`` (one rank group), and nothing of
ours left running after the job (issue 19, item 10). One Ray start for the module."""

from __future__ import annotations

import hashlib
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'freescale[ray]'")
psutil = pytest.importorskip("psutil")

import fsdata  # noqa: E402
from fsdata.engines import ray as ray_engine  # noqa: E402
from tests.fsdata.helpers import write_samples  # noqa: E402


def _digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _ray_children() -> set[int]:
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(p.cmdline()).lower():
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def test_one_cpu_cluster_and_one_rank_are_byte_identical_and_leave_nothing_running(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    inp = write_samples(tmp_path / "in", n=600, num_files=2, with_timestamps=True)
    cases = {"r4": dict(num_ranks=4, batch_size_per_rank=16), "r1": dict(num_ranks=1, batch_size_per_rank=16)}
    for name, kw in cases.items():
        fsdata.balance(inp, tmp_path / f"local-{name}", fsdata.BalanceSettings(progress=False, seed=5, **kw))
    before = _ray_children()
    with ray_engine.ray_session(None, num_cpus=1, object_store_memory=80 * 1024**2) as r:
        assert int(r.cluster_resources()["CPU"]) == 1
        assert _ray_children() - before  # the session's raylet, GCS, ... are ours
        for name, kw in cases.items():  # both write with a single rank group
            fsdata.balance(inp, tmp_path / f"ray-{name}",
                           fsdata.BalanceSettings(progress=False, seed=5, engine="ray", **kw))
    assert not ray.is_initialized()
    deadline = time.time() + 10
    while _ray_children() - before and time.time() < deadline:
        time.sleep(0.2)
    assert not (_ray_children() - before)
    for name in cases:
        assert _digests(tmp_path / f"ray-{name}") == _digests(tmp_path / f"local-{name}")
