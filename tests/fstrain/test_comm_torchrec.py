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

    from fstrain.comm import CommConfig, register_torch_backends

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
