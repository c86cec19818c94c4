"""GPU tests of the copy-engine backend: equal to NCCL's all_to_all_single. Skipped without CUDA.

Never run where this was written (no GPU); see docs/comm.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.fstrain.test_comm_shm import _assert_all_ok, _spawn

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]


def _ce_equals_nccl(rank, world_size, init_file):
    from fstrain.distributed.comm import CommConfig, CopyEngineBackend, build_backend

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, device_id=torch.device("cuda", rank))
    # A small staging buffer forces several rounds; small chunks force interleaved pulls.
    cfg = CopyEngineBackend.Config(buffer_bytes=world_size * (1 << 20), chunk_bytes=256 << 10)
    comm = build_backend(CommConfig(backend="cuda-ce", cuda_ce=cfg))
    g = torch.Generator().manual_seed(7)
    for rows_max, dtype, trailing in ((50, torch.float32, (8,)), (20_000, torch.bfloat16, (128,)),
                                      (5, torch.int64, ())):
        m = torch.randint(0, rows_max, (world_size, world_size), generator=g)
        m[0, -1] = 0  # an empty pair
        in_splits, out_splits = m[rank].tolist(), m[:, rank].tolist()
        x = (torch.randn(sum(in_splits), *trailing, device="cuda") * 100).to(dtype) + rank
        ref = torch.empty(sum(out_splits), *trailing, dtype=dtype, device="cuda")
        dist.all_to_all_single(ref, x, out_splits, in_splits)
        got = comm.all_to_all_v(x, out_splits, in_splits)
        torch.cuda.synchronize()
        assert torch.equal(got, ref), f"cuda-ce differs from NCCL ({dtype}, rows < {rows_max})"
    return comm.uses_copy_engines


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copy_engine_all_to_all_v_equals_nccl():
    world_size = min(4, torch.cuda.device_count())
    out = _spawn(world_size, _ce_equals_nccl)
    _assert_all_ok(out, world_size)
    assert all(value for _, value in out.values()), "copy-engine path fell back to NCCL"


def _process_group_equals_nccl(rank, world_size, init_file):
    """The fs_cuda_ce process group: dist.all_to_all_single on it equals NCCL's, and a split
    mismatch is raised on every rank with the same message."""
    from fstrain.distributed.comm import CommConfig, SplitMismatchError, register_torch_backends

    torch.cuda.set_device(rank)
    name = register_torch_backends(CommConfig(backend="cuda-ce"))
    dist.init_process_group(name, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    nccl = dist.new_group(backend="nccl")
    g = torch.Generator().manual_seed(3)
    m = torch.randint(0, 300, (world_size, world_size), generator=g)
    in_splits, out_splits = m[rank].tolist(), m[:, rank].tolist()
    x = torch.randn(sum(in_splits), 16, device="cuda") + rank
    ref = torch.empty(sum(out_splits), 16, device="cuda")
    dist.all_to_all_single(ref, x, out_splits, in_splits, group=nccl)
    got = torch.empty_like(ref)
    dist.all_to_all_single(got, x, out_splits, in_splits)
    torch.cuda.synchronize()
    assert torch.equal(got, ref)
    pg = dist.group.WORLD
    bad = list(out_splits)
    if rank == 1:
        bad[0] += 1
    try:
        dist.all_to_all_single(torch.empty(sum(bad), 16, device="cuda"), x, bad, in_splits)
        message = None
    except SplitMismatchError as e:
        message = str(e)
    return pg.copy_engines_agreed, pg.num_copy_engine_all_to_all, message


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_ce_process_group_equals_nccl_and_agrees_on_split_errors():
    world_size = min(4, torch.cuda.device_count())
    out = _spawn(world_size, _process_group_equals_nccl)
    _assert_all_ok(out, world_size)
    values = [v for _, v in out.values()]
    assert all(agreed and n >= 1 for agreed, n, _ in values), values
    messages = {msg for _, _, msg in values}
    assert len(messages) == 1 and None not in messages, messages  # every rank, the same message


def _train_worker(shards, backend):
    from fstrain.distributed.sharding import local_state
    from fstrain.config import from_dict
    from fstrain.train import train

    res = train(from_dict({"shards": shards,
                           "model": dict(embedding_dim=16, num_negatives=8, num_layers=1, num_heads=2),
                           "max_steps": 4, "pipeline.name": "prioritized", "comm.backend": backend,
                           "metrics.log_every_steps": 0}))
    return local_state(res.model)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_train_backend_cuda_ce_equals_nccl(tmp_path):
    from tests.fstrain.multiproc import run_ranks
    from tests.fstrain.shards import write_shards

    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=4, batch_size_per_rank=4, seed=5)
    ce = run_ranks(_train_worker, 2, shards, "cuda-ce")
    ref = run_ranks(_train_worker, 2, shards, "nccl")
    for a, b in zip(ce, ref):
        for k in b:
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)


def _hierarchical_equals_nccl(rank, world_size, init_file):
    """fs_cuda_ce over 2 "nodes" (FSTRAIN_NODE_ID): copy engines inside a node, NCCL across, equal to NCCL."""
    import os

    from fstrain.distributed.comm import CommConfig, register_torch_backends
    from fstrain.distributed.comm.hierarchical import NODE_ID_ENV

    os.environ[NODE_ID_ENV] = f"node{rank * 2 // world_size}"  # 4 GPUs: 2 x 2; 2 GPUs: 2 x 1
    torch.cuda.set_device(rank)
    name = register_torch_backends(CommConfig(backend="cuda-ce"))
    dist.init_process_group(name, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    pg = dist.group.WORLD
    assert pg.layout.num_nodes == 2
    nccl = dist.new_group(backend="nccl")
    g = torch.Generator().manual_seed(11)
    for rows_max, dtype, trailing in ((60, torch.float32, (8,)), (3_000, torch.bfloat16, (64,)), (4, torch.int64, ())):
        m = torch.randint(0, rows_max, (world_size, world_size), generator=g)
        m[0, -1] = 0
        in_splits, out_splits = m[rank].tolist(), m[:, rank].tolist()
        x = (torch.randn(sum(in_splits), *trailing, device="cuda") * 100).to(dtype) + rank
        ref = torch.empty(sum(out_splits), *trailing, dtype=dtype, device="cuda")
        dist.all_to_all_single(ref, x, out_splits, in_splits, group=nccl)
        got = torch.empty_like(ref)
        dist.all_to_all_single(got, x, out_splits, in_splits)
        torch.cuda.synchronize()
        assert torch.equal(got, ref), f"hierarchical cuda-ce differs from NCCL ({dtype})"
    local = pg._transport
    return (pg.num_hierarchical_all_to_all, pg.hierarchical.inter_rows > 0,
            None if local is None else local.uses_copy_engines)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_ce_hierarchical_on_two_nodes_equals_nccl():
    world_size = 4 if torch.cuda.device_count() >= 4 else 2
    out = _spawn(world_size, _hierarchical_equals_nccl)
    _assert_all_ok(out, world_size)
    for calls, crossed, copy_engines in (v for _, v in out.values()):
        assert calls == 3 and crossed
        assert copy_engines is (True if world_size == 4 else None)  # 2 GPUs: one per "node", no local peer
