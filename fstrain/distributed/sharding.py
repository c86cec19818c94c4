"""Process group setup and sharding: the item table row-wise over ranks, the dense tower DDP.

Gradient semantics (why the hooks below exist): torchrec sums the embedding gradients of all
ranks into the owning shard (the backward all-to-all), while stock DDP *averages* dense
gradients. The loss of every rank is already divided by the step's global sample count
(:mod:`fstrain.models.recommender`), so both parts must be *summed* over ranks for the update to equal one
rank training on the whole global batch; :class:`SumDataParallelWrapper` registers a DDP comm
hook that all-reduces with SUM and does not divide by the world size.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim import apply_optimizer_in_backward

from fstrain.models.config import TABLE_NAME, Config
from fstrain.models.recommender import SequentialRecommender
from fstrain.distributed.env import DistEnv
from fstrain.distributed.optim import OptimConfig, sparse_optimizer

logger = logging.getLogger(__name__)

def _sum_allreduce_hook(process_group, bucket):  # unannotated: DDP checks annotations at runtime
    """DDP comm hook: all-reduce SUM of a ``dist.GradBucket``, no division by world size."""
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class SumDataParallelWrapper(DefaultDataParallelWrapper):
    """DMP's DDP wrapping of the dense part with a SUM all-reduce hook."""

    def __init__(self) -> None:
        super().__init__(static_graph=False, find_unused_parameters=False)

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        super().wrap(dmp, env, device)
        ddp = dmp._dmp_wrapped_module
        if isinstance(ddp, nn.parallel.DistributedDataParallel):
            ddp.register_comm_hook(env.process_group, _sum_allreduce_hook)


def build_sharded_model(config: Config, optim: OptimConfig, env: DistEnv
                        ) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """Build the model, shard the item table ROW_WISE over all ranks, wrap the dense part in DDP.

    The table is created on the meta device and materialised shard by shard by DMP (a rank
    only allocates its rows). The planner is forced to ``ROW_WISE`` with a
    :class:`ParameterConstraints` (what torchrec's PEC pipeline requires).

    Args:
        config: model size.
        optim: optimizer settings.
        env: from :func:`init_distributed`.

    Returns:
        ``(dmp, optimizer)``: the sharded model (``dmp.module`` is the unwrapped
        :class:`SequentialRecommender`) and a ``CombinedOptimizer`` (fused sparse + dense Adam)
        whose ``step()`` updates the dense part (the sparse part updates inside the backward).

    Raises:
        ConfigError: unknown sparse optimizer.
    """
    opt_cls, kwargs = sparse_optimizer(optim, env.device)  # unknown name: ConfigError before any allocation
    model = SequentialRecommender(config, device=torch.device("meta"))
    model.dense.to(env.device)
    apply_optimizer_in_backward(opt_cls, model.ec.parameters(), kwargs)
    compute = "fused"
    topology = Topology(world_size=env.world_size, compute_device=env.device.type)
    constraints = {TABLE_NAME: ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value],
                                                    compute_kernels=[compute])}
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, debug=False)
    sharders = [EmbeddingCollectionSharder()]
    pg = dist.group.WORLD
    plan = planner.collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=env.device, plan=plan,
                                   sharders=sharders, data_parallel_wrapper=SumDataParallelWrapper())
    init_table_rows(dmp, config, seed=torch.initial_seed())
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.AdamW(params, lr=optim.dense_lr, betas=optim.betas,
                                                                       weight_decay=optim.weight_decay))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


_INIT_BLOCK_ROWS = 4096


def init_table_rows(dmp: DistributedModelParallel, config: Config, seed: int) -> None:
    """Initialise this rank's rows of the item table independently of the sharding.

    Row ``i`` gets values drawn from a generator seeded by ``(seed, i // 4096)``, uniform in
    ``+-sqrt(1 / num_items)`` (torchrec's default range), so any world size (and a single
    process) starts from the same table: runs on different world sizes are comparable.

    Args:
        dmp: the sharded model.
        config: model size (``num_items``, ``embedding_dim``).
        seed: run seed.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    bound = (1.0 / config.num_items) ** 0.5
    d = config.embedding_dim
    for name, t in dmp.state_dict().items():
        if TABLE_NAME not in name or not isinstance(t, ShardedTensor):
            continue
        for shard in t.local_shards():
            row0, col0 = shard.metadata.shard_offsets
            rows, cols = shard.tensor.shape
            out = torch.empty(rows, d)
            first, last = row0 // _INIT_BLOCK_ROWS, (row0 + rows - 1) // _INIT_BLOCK_ROWS
            for blk in range(first, last + 1):
                g = torch.Generator().manual_seed(seed * 1_000_003 + blk)
                vals = torch.rand(_INIT_BLOCK_ROWS, d, generator=g) * (2 * bound) - bound
                lo, hi = max(row0, blk * _INIT_BLOCK_ROWS), min(row0 + rows, (blk + 1) * _INIT_BLOCK_ROWS)
                out[lo - row0:hi - row0] = vals[lo - blk * _INIT_BLOCK_ROWS:hi - blk * _INIT_BLOCK_ROWS]
            with torch.no_grad():
                shard.tensor.copy_(out[:, col0:col0 + cols].to(shard.tensor.device))


def dense_parameters(dmp: DistributedModelParallel) -> list[torch.Tensor]:
    """Parameters of the dense tower (the ones synchronised by all-reduce)."""
    return list(dmp.module.dense.parameters())


def allreduce_dense_grads(dmp: DistributedModelParallel) -> None:
    """All-reduce (SUM) the dense gradients in one flat buffer (the measured step's DDP stand-in)."""
    params = [p for p in dense_parameters(dmp) if p.grad is not None]
    if dist.get_world_size() == 1 or not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    off = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n


def local_state(dmp: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """This rank's view of the parameters: its row-wise shard of the table, the full dense part.

    Returns:
        name -> CPU tensor copy (a sharded table becomes its local rows ``[rows x d]``).
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            v = torch.cat([s.tensor for s in v.local_shards()]) if v.local_shards() else torch.zeros(0)
        elif isinstance(v, DTensor):
            v = v.to_local()
        out[k] = v.detach().cpu().clone()
    return out


def aliased_shard(weight, lookup) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """This rank's shard ``[rows x d]`` of the sharded ``weight`` (a ``ShardedTensor``) if it is the
    storage ``lookup`` (a torchrec embedding lookup module) reads and updates, i.e. a parameter or
    buffer of it shares its memory: ``(shard, that tensor, storage address)`` (a reader checks the
    address is still the lookup's before it reads), else ``None``. Raises nothing."""
    shards = weight.local_shards()
    if len(shards) != 1:
        return None
    t = shards[0].tensor
    ptr = t.untyped_storage().data_ptr()
    same = [x for x in [*lookup.parameters(), *lookup.buffers()] if x.numel() and x.untyped_storage().data_ptr() == ptr]
    return (t, same[0], ptr) if t.dim() == 2 and same else None
