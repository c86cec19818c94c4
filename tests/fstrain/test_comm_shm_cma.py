"""The shared-memory all-to-all's single-copy path (``process_vm_readv``) and its fallback to the rings.

Single-process tests exercise the reader, the start-up probe and the agreement; the ``multiproc``
ones run 3 ranks (the harness of ``test_comm_shm``) and compare every path with gloo's
``all_to_all_single``, bit for bit.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fstrain.distributed.comm import ShmBackend
from fstrain.distributed.comm import shm_cma
from fstrain.distributed.comm.base import CommError
from fstrain.distributed.comm.shm_cma import CmaProbe, PeerReader, agree, probe_peer
from tests.fstrain.test_comm_shm import _assert_all_ok, _init, _spawn


def _refuse(err=errno.EPERM):
    """Make every process_vm_readv fail with ``err``, as under a stricter container (seccomp, Yama)."""

    def fake(*_args):
        ctypes.set_errno(err)
        return -1

    return fake


def test_peer_reader_copies_bytes_and_reports_the_kernels_refusal(monkeypatch):
    src = np.arange(3000, dtype=np.int64)
    dst = np.zeros_like(src)
    PeerReader().read(os.getpid(), src.ctypes.data, dst.ctypes.data, src.nbytes)
    assert np.array_equal(src, dst)
    monkeypatch.setattr(shm_cma, "_readv", _refuse())
    with pytest.raises(OSError, match="Operation not permitted") as e:
        PeerReader().read(os.getpid(), src.ctypes.data, dst.ctypes.data, 8)
    assert e.value.errno == errno.EPERM
    with pytest.raises(CommError, match="rank 1 from rank 0.*cma=False"):
        PeerReader().pull(os.getpid(), src.ctypes.data, dst.ctypes.data, 8, "rank 1 from rank 0")


def test_probe_reads_the_peers_nonce_or_says_why_not(monkeypatch):
    probe = CmaProbe()
    assert probe_peer(os.getpid(), probe.describe()) is None
    other = CmaProbe().describe().split(":")[1]
    wrong = probe.describe().split(":")[0] + ":" + other
    assert "other bytes" in probe_peer(os.getpid(), wrong)
    assert probe_peer(os.getpid(), "off") is None  # a peer that cannot use it reports why itself
    assert "failed" in probe_peer(2**22 + 7, probe.describe())  # no such process (pid_max <= 2**22)
    monkeypatch.setattr(shm_cma, "_readv", _refuse(errno.ENOSYS))
    assert "Function not implemented" in probe_peer(os.getpid(), probe.describe())


def test_agreement_needs_every_rank():
    assert agree(0, 3, None, {1: "cma", 2: "cma"}) == (True, None)
    used, reason = agree(0, 3, None, {1: "cma", 2: "copy:process_vm_readv from pid 9 failed: EPERM"})
    assert not used and reason == "rank 2: process_vm_readv from pid 9 failed: EPERM"
    assert agree(1, 2, "disabled", {0: "cma"}) == (False, "rank 1: disabled")
    assert agree(0, 1, "one rank: no peer to read from", {}) == (False, "one rank: no peer to read from")


def test_config_and_one_rank_report_the_data_path():
    with pytest.raises(ValueError, match="cma_min_bytes=-1"):
        ShmBackend(dist.HashStore(), rank=0, world_size=1, config=ShmBackend.Config(cma_min_bytes=-1))
    with ShmBackend(dist.HashStore(), rank=0, world_size=1) as comm:
        assert comm.data_path == "copy" and "one rank" in comm.cma_reason
        x = torch.randn(5, 3)
        assert torch.equal(comm.all_to_all_v(x, [5], [5]), x)


# --------------------------------------------------------------------------------------------
# 3 processes: every path equals gloo


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool, torch.complex64]


def _cases(w):
    """(name, split matrix, trailing shape, dtype); the same on every rank."""
    g = torch.Generator().manual_seed(77)
    cases = []
    for i, dtype in enumerate(_DTYPES):
        m = torch.randint(0, 300, (w, w), generator=g)
        m[i % w, (i + 1) % w] = 0  # an empty split in every case
        cases.append((f"{dtype}", m.tolist(), (7,), dtype))
    m = torch.randint(0, 5, (w, w), generator=g)
    m[0, :] = 0  # rank 0 sends nothing
    m[:, w - 1] = 0  # the last rank receives nothing
    cases.append(("empty_rows", m.tolist(), (3,), torch.float32))
    cases.append(("all_empty", [[0] * w for _ in range(w)], (4,), torch.float32))
    cases.append(("1d", torch.randint(0, 5000, (w, w), generator=g).tolist(), (), torch.int64))
    big = torch.randint(20_000, 40_000, (w, w), generator=g)  # 5-10 MB per message: many 1 MiB pieces
    big[1, 2] = 3  # a small message among big ones (ring) next to pulls
    cases.append(("large_mixed", big.tolist(), (64,), torch.float32))
    return cases


def _data(rank, m, trailing, dtype):
    x = torch.randn(sum(m[rank]), *trailing).mul(100) + rank
    return x.to(dtype) if not dtype.is_complex else torch.complex(x, -x).to(dtype)


def _paths(rank, world_size, init_file):
    _init(rank, world_size, init_file, "gloo")
    store = dist.distributed_c10d._get_default_store()
    setups = {
        "pull_everything": dict(cma_min_bytes=0, chunk_bytes=1 << 20),
        "default": {},
        "small_pieces": dict(cma_min_bytes=4096, chunk_bytes=1 << 14, num_slots=2),
        "off": dict(cma=False, chunk_bytes=1 << 16, num_slots=2),
        "off_on_rank_1": dict(cma=rank != 1),  # one rank refuses: every rank uses the rings
        "eperm_on_rank_2": {},  # rank 2's probe fails as under seccomp / Yama
    }
    report = {}
    for name, kw in setups.items():
        saved = shm_cma._readv
        if name == "eperm_on_rank_2" and rank == 2:
            shm_cma._readv = _refuse()
        try:
            comm = ShmBackend(store, prefix=f"cma/{name}", rank=rank, world_size=world_size,
                              config=ShmBackend.Config(timeout_seconds=30, **kw))
        finally:
            shm_cma._readv = saved
        for case, m, trailing, dtype in _cases(world_size):
            in_splits, out_splits = m[rank], [m[p][rank] for p in range(world_size)]
            x = _data(rank, m, trailing, dtype)
            ref = torch.empty(sum(out_splits), *trailing, dtype=dtype)
            dist.all_to_all_single(ref, x, out_splits, in_splits)
            for rnd in range(2):
                got = comm.all_to_all_v(x, out_splits, in_splits)
                assert torch.equal(got, ref), f"{name} {case} round {rnd}: differs from gloo"
            out = torch.full_like(ref, 3)
            comm.all_to_all_v(x, out_splits, in_splits, out=out)
            assert torch.equal(out, ref), f"{name} {case} (out=): differs from gloo"
        report[name] = (comm.data_path, comm.cma_reason)
        comm.close()
    # A peer sending more bytes than expected through a pull: the receiver raises, the sender
    # (waiting for the read) fails at once on its abort flag instead of hanging.
    comm = ShmBackend(store, prefix="cma/mismatch", rank=rank, world_size=world_size,
                      config=ShmBackend.Config(cma_min_bytes=0, timeout_seconds=20, liveness_check_seconds=0.2))
    even = [300] * world_size
    splits = [300, 400, 300] if rank == 0 else even  # rank 1 expects 300 rows from rank 0
    try:
        comm.all_to_all_v(torch.ones(sum(splits), 8), even, splits)
        report["mismatch"] = None
    except CommError as e:
        report["mismatch"] = (type(e).__name__, getattr(e, "peer_rank", None), str(e))
    comm.close()
    # A sender returns only once its pulled rows are read: rows overwritten right after its call returns
    # must not reach the reader (rank 0 pulls nothing and receives empty messages, so it is done at once
    # unless it waits for rank 1's acknowledgement).
    comm = ShmBackend(store, prefix="cma/wait", rank=rank, world_size=world_size,
                      config=ShmBackend.Config(timeout_seconds=30))
    rows = 1 << 17  # 32 MiB of float32 x 64, read in 32 pieces
    m = [[0] * world_size for _ in range(world_size)]
    m[0][1] = rows
    want = torch.arange(rows * 64, dtype=torch.float32).view(rows, 64)
    report["reader_saw_the_rows"] = []
    for _ in range(3):
        x = want.clone() if rank == 0 else torch.empty(0, 64)
        got = comm.all_to_all_v(x, [m[p][rank] for p in range(world_size)], m[rank])
        x.fill_(-1.0)
        if rank == 1:
            report["reader_saw_the_rows"].append(bool(torch.equal(got, want)))
    comm.close()
    return report


@pytest.mark.multiproc
def test_single_copy_and_fallbacks_equal_gloo_on_3_ranks():
    before = set(glob.glob("/dev/shm/fsc-*"))
    out = _spawn(3, _paths)
    _assert_all_ok(out, 3)
    for rank, (_, report) in out.items():
        for name in ("pull_everything", "default", "small_pieces"):
            assert report[name] == ("cma", None), (rank, report)
        assert report["off"] == ("copy", f"rank {rank}: disabled (ShmBackend.Config.cma=False)")
        path, reason = report["off_on_rank_1"]
        assert path == "copy" and reason.startswith("rank 1: disabled"), (rank, report)
        path, reason = report["eperm_on_rank_2"]
        assert path == "copy" and reason.startswith("rank 2: process_vm_readv") and "not permitted" in reason
    err, peer, msg = out[1][1]["mismatch"]
    assert err == "SplitMismatchError" and peer == 0 and "expected 9600 bytes" in msg and "12800" in msg
    err, peer, _ = out[0][1]["mismatch"]
    assert err == "PeerExitedError" and peer == 1
    assert out[1][1]["reader_saw_the_rows"] == [True] * 3
    assert set(glob.glob("/dev/shm/fsc-*")) == before, "shared-memory segments left behind"
