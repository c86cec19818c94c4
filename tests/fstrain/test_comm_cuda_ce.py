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
    from fstrain.comm import CommConfig, CopyEngineBackend, build_backend

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
