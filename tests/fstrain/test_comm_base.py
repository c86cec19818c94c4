"""Single-process tests of fstrain.distributed.comm: split checks, ring layout, configs, errors."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist

from fstrain.distributed.comm import (CommConfig, PeerTimeoutError, ShmBackend, SplitMismatchError,
                                      register_torch_backends)
from fstrain.distributed.comm.base import allocate_output, check_splits, even_splits
from fstrain.distributed.comm.cuda_ce import plan_rounds
from fstrain.distributed.comm.shm_segment import _ring_index, num_chunks, ring_bytes, segment_bytes


def test_check_splits_rejects_bad_lengths_counts_and_sums():
    x = torch.zeros(5, 3)
    check_splits(x, [1, 4], [2, 3], 2)  # valid
    with pytest.raises(ValueError, match="3 entries; the group has 2"):
        check_splits(x, [1, 2, 2], [2, 3], 2)
    with pytest.raises(ValueError, match="negative"):
        check_splits(x, [1, 4], [-1, 6], 2)
    with pytest.raises(ValueError, match="add up to 4 rows but input has 5"):
        check_splits(x, [1, 4], [1, 3], 2)
    with pytest.raises(ValueError, match="dtype"):
        check_splits(x, [1, 4], [2, 3], 2, output=torch.zeros(5, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="output has 4 rows"):
        check_splits(x, [1, 4], [2, 3], 2, output=torch.zeros(4, 3))
    with pytest.raises(SplitMismatchError, match="sends itself 2 rows"):
        check_splits(x, [1, 4], [2, 3], 2, rank=0)
    with pytest.raises(ValueError, match="rows have shape"):
        check_splits(x, [1, 4], [2, 3], 2, output=torch.zeros(5, 2))


def test_even_splits_and_allocate_output():
    assert even_splits(12, 4) == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="13 rows do not divide evenly over 4"):
        even_splits(13, 4)
    out = allocate_output(torch.zeros(2, 7, dtype=torch.bfloat16), [3, 0, 1])
    assert out.shape == (4, 7) and out.dtype == torch.bfloat16


def test_ring_layout_is_disjoint_and_chunk_counts():
    # Every sender gets its own ring in the receiver's segment, none for the receiver itself.
    for world in (2, 3, 8):
        for receiver in range(world):
            idx = [_ring_index(s, receiver) for s in range(world) if s != receiver]
            assert sorted(idx) == list(range(world - 1))
    assert segment_bytes(4, 1024, 2) == 4096 + 3 * ring_bytes(1024, 2)
    assert ring_bytes(1000, 3) == 128 + 3 * (64 + 1024)  # payload aligned to 64 bytes
    assert num_chunks(0, 64) == 1  # empty messages still send a header-only chunk
    assert num_chunks(64, 64) == 1 and num_chunks(65, 64) == 2


def test_plan_rounds_takes_the_largest_cross_rank_message():
    m = [[10**9, 5, 0], [300, 0, 0], [0, 0, 0]]  # the diagonal never crosses ranks
    assert plan_rounds(m, 100) == 3
    assert plan_rounds([[7]], 100) == 0


def test_comm_config_validates_backend_name_and_registers():
    with pytest.raises(ValueError, match="unknown comm backend 'mpi'"):
        CommConfig(backend="mpi")
    assert register_torch_backends(CommConfig(backend="gloo")) == "gloo"
    assert register_torch_backends(CommConfig(backend="shm")) == "fs_shm"
    assert "fs_shm" in dist.Backend.backend_list


def test_shm_config_validation():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="multiple of 64"):
        ShmBackend(store, rank=0, world_size=1, config=ShmBackend.Config(chunk_bytes=100))
    with pytest.raises(ValueError, match="num_slots=1"):
        ShmBackend(store, rank=0, world_size=1, config=ShmBackend.Config(num_slots=1))


def test_shm_single_rank_copies_and_leaves_no_segment(tmp_path):
    before = set(glob.glob("/dev/shm/fsc-*"))
    cfg = ShmBackend.Config(shm_dir=str(tmp_path))
    with ShmBackend(dist.HashStore(), rank=0, world_size=1, config=cfg) as comm:
        assert os.listdir(tmp_path) == []  # unlinked right after the rendezvous
        x = torch.randn(6, 4)
        out = comm.all_to_all_v(x, [6], [6])
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
        with pytest.raises(ValueError, match="add up to 6 rows but input has 5"):
            comm.all_to_all_v(x[:5], [5], [6])
    assert set(glob.glob("/dev/shm/fsc-*")) == before


def test_peer_timeout_error_names_rank_and_timeout():
    e = PeerTimeoutError(peer_rank=3, timeout_seconds=2.5, stage="recv", detail="chunk 0 of 4")
    assert e.peer_rank == 3 and "peer rank 3" in str(e) and "2.5 s" in str(e)
    assert isinstance(e, TimeoutError)


def test_process_group_override_is_reached_through_the_c10d_dispatcher():
    # A 1-rank fs_shm group called the way torchrec's compiled path calls it (functional op ->
    # C++ ProcessGroup -> PyProcessGroup trampoline -> Python override): the result is right,
    # the call is counted, and a typed transport error keeps its type through the C++ layer.
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _register_process_group, _unregister_process_group

    from fstrain.distributed.comm.process_group import ShmProcessGroup

    pg = ShmProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=5))
    _register_process_group("fs_shm_unit", pg)
    try:
        x = torch.arange(6.0)
        y = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_to_all_single(x, [6], [6], "fs_shm_unit"))
        assert torch.equal(y, x) and pg.num_shm_all_to_all == 1
        assert pg.name() == "fs_shm"
        with pytest.raises(SplitMismatchError, match="sends itself 6 rows"):
            torch.ops._c10d_functional.all_to_all_single(x, [5], [6], "fs_shm_unit")
    finally:
        _unregister_process_group("fs_shm_unit")
        pg.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA guard")
def test_cuda_ce_without_cuda_raises_a_clear_error():
    from fstrain.distributed.comm import BackendUnavailableError, CopyEngineBackend

    with pytest.raises(BackendUnavailableError, match="needs CUDA; use 'shm' or 'gloo'"):
        CopyEngineBackend(None)
