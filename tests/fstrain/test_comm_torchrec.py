"""torchrec end to end on the fs_shm process group: a row-wise sharded EmbeddingCollection.

Row-wise EmbeddingCollection is the layout torchrec's prioritized embedding communication (PEC)
supports; its input dist (KJT splits, ids) and output dist (sequence embeddings) are
all-to-all-v calls, which must all reach the shared-memory transport and give the right rows.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from tests.fstrain.test_comm_shm import _assert_all_ok, _init, _spawn

pytestmark = pytest.mark.multiproc

_NUM_ROWS, _DIM = 100, 8


def _expected(ids: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of the table is ``i + j / 1000`` in column ``j``."""
    return ids.to(torch.float32)[:, None] + torch.arange(_DIM, dtype=torch.float32) / 1000


def _row_wise_embedding_collection(rank, world_size, init_file):
    logging.disable(logging.WARNING)  # the planner warns about hand-built topologies
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType

    from fstrain.distributed.comm import CommConfig, register_torch_backends

    _init(rank, world_size, init_file, register_torch_backends(CommConfig(backend="shm")))
    pg = dist.group.WORLD
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t0", embedding_dim=_DIM, num_embeddings=_NUM_ROWS,
                                feature_names=["f0"])],
        device=torch.device("meta"))
    sharders = [EmbeddingCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])})
    plan = planner.collective_plan(ec, sharders, pg)
    dmp = DistributedModelParallel(ec, env=ShardingEnv.from_process_group(pg),
                                   device=torch.device("cpu"), plan=plan, sharders=sharders)
    for shard in dmp.state_dict()["embeddings.t0.weight"].local_shards():
        first_row = shard.metadata.shard_offsets[0]
        rows = torch.arange(first_row, first_row + shard.tensor.shape[0])
        shard.tensor.copy_(_expected(rows))
    calls_before = pg.num_shm_all_to_all
    # Uneven per-rank batches; ids on every shard, repeated ids, one empty sample on rank 1.
    ids = torch.tensor([1, 50, 99, 3, 77, 50, 0][: 4 + rank])
    lengths = torch.tensor([2, 2] if rank == 0 else [3, 0, 2])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids, lengths=lengths)
    out = dmp(kjt)["f0"]
    assert torch.equal(out.lengths(), lengths)
    assert torch.allclose(out.values(), _expected(ids)), (out.values(), ids)
    return pg.num_shm_all_to_all - calls_before


def test_row_wise_embedding_collection_over_fs_shm():
    out = _spawn(2, _row_wise_embedding_collection)
    _assert_all_ok(out, 2)
    for _, calls in out.values():
        assert calls >= 2, f"only {calls} all-to-alls reached the shm transport"


_OBJECT_ROUNDS = 300


def _other_collectives(rank, world_size, init_file):
    """Every non-all-to-all collective of the fs_shm group (gloo underneath), called from Python
    and from C++ (DDP's parameter check), with the results gloo gives."""
    from fstrain.distributed.comm import CommConfig, register_torch_backends

    _init(rank, world_size, init_file, register_torch_backends(CommConfig(backend="shm")))
    pg = dist.group.WORLD
    w = world_size
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(w * (w + 1) // 2)))
    b = torch.arange(4.0) * (rank + 1)
    dist.broadcast(b, src=1)
    assert torch.equal(b, torch.arange(4.0) * 2)
    gathered = [torch.empty(2) for _ in range(w)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    assert all(torch.equal(g, torch.full((2,), float(r))) for r, g in enumerate(gathered))
    flat = torch.empty(2 * w)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    assert torch.equal(flat, torch.arange(w, dtype=torch.float32).repeat_interleave(2))
    out = torch.empty(2 * w)
    pg.allgather_into_tensor_coalesced([out], [torch.full((2,), float(rank))]).wait()  # coalesced path
    assert torch.equal(out, flat)
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * w))
    assert torch.equal(scattered, torch.arange(2.0 * rank, 2.0 * rank + 2) * w)
    if rank == 0:
        dist.send(torch.tensor([7.0]), dst=1)
    elif rank == 1:
        got = torch.zeros(1)
        dist.recv(got, src=0)
        assert got.item() == 7.0
    dist.barrier()
    # Back-to-back object collectives (what DMP and DDP set-up do): these hung ~1 run in 5 when
    # the trampoline entered gloo holding the GIL (fstrain/comm/process_group.py).
    for i in range(_OBJECT_ROUNDS):
        objs = [{"round": i, "rank": rank}] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        assert objs[0] == {"round": i, "rank": 0}
        everyone = [None] * w
        dist.all_gather_object(everyone, rank * i)
        assert everyone == [r * i for r in range(w)]
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))  # C++ verify + broadcast
    ddp(torch.ones(1, 3)).sum().backward()
    return type(pg).__name__


def test_other_collectives_over_fs_shm_run_on_gloo():
    out = _spawn(2, _other_collectives)
    _assert_all_ok(out, 2)
    assert {v for _, v in out.values()} == {"ShmProcessGroup"}
