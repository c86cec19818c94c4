"""The model layout torchrec's ``TrainPipelinePEC`` needs, and a probe of where it runs.

``TrainPipelinePEC`` (torchrec >= 1.9, ``distributed/train_pipeline/pec_train_pipeline.py``) only
pipelines tables wrapped in ``torchrec.modules.pec_embedding_modules.PECEmbeddingCollection`` and
sharded row-wise by ``PECEmbeddingCollectionSharder``. :func:`build_pec_sharded_model` builds
:class:`fstrain.models.recommender.SequentialRecommender` that way (otherwise exactly as
:func:`fstrain.distributed.sharding.build_sharded_model`: same planner constraint, fused optimizer, SUM-DDP);
the wrapper changes the table's state-dict key (:data:`PEC_TABLE_PREFIX`), so checkpoints of the
two layouts are not interchangeable without :func:`to_plain_keys`.

:func:`probe_torchrec_pec` constructs the pipeline and runs steps, returning the exception it
raises; the tests use it to keep :func:`fstrain.pipelines.pec_unavailable_reason` honest.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from fstrain.data.batch import Batch
from fstrain.distributed.env import DistEnv
from fstrain.distributed.optim import OptimConfig, sparse_optimizer
from fstrain.distributed.sharding import SumDataParallelWrapper, init_table_rows
from fstrain.models.config import TABLE_NAME, Config
from fstrain.models.recommender import SequentialRecommender

#: State-dict prefix of the wrapped table (``ec.embeddings.`` in the plain layout).
PEC_TABLE_PREFIX = "ec._embedding_collection.embeddings."


def build_pec_sharded_model(config: Config, optim: OptimConfig, env: DistEnv
                            ) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """:func:`fstrain.distributed.sharding.build_sharded_model` with the item table wrapped for ``TrainPipelinePEC``.

    Args:
        config: model size.
        optim: optimizer settings.
        env: from :func:`fstrain.distributed.env.init_distributed`.

    Returns:
        ``(dmp, optimizer)``; ``dmp.module.ec`` is a ``ShardedPECEmbeddingCollection``.

    Raises:
        ConfigError: unknown sparse optimizer.
    """
    opt_cls, kwargs = sparse_optimizer(optim, env.device)  # unknown name: ConfigError before any allocation
    model = SequentialRecommender(config, device=torch.device("meta"))
    model.dense.to(env.device)
    model.ec = PECEmbeddingCollection(model.ec)
    apply_optimizer_in_backward(opt_cls, model.ec.parameters(), kwargs)
    constraints = {TABLE_NAME: ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value],
                                                    compute_kernels=["fused"])}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=env.world_size, compute_device=env.device.type),
                                       constraints=constraints, debug=False)
    sharders = [PECEmbeddingCollectionSharder()]
    pg = dist.group.WORLD
    plan = planner.collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=env.device, plan=plan,
                                   sharders=sharders, data_parallel_wrapper=SumDataParallelWrapper())
    init_table_rows(dmp, config, seed=torch.initial_seed())  # the same table as build_sharded_model
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.AdamW(params, lr=optim.dense_lr, betas=optim.betas,
                                                                                        weight_decay=optim.weight_decay))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


def to_plain_keys(state: dict) -> dict:
    """Rename the wrapped table's keys (:data:`PEC_TABLE_PREFIX`) to the plain layout's ``ec.embeddings.``."""
    return {("ec.embeddings." + k[len(PEC_TABLE_PREFIX):] if k.startswith(PEC_TABLE_PREFIX) else k): v
            for k, v in state.items()}


def probe_torchrec_pec(dmp: DistributedModelParallel, optimizer, device: torch.device,
                       batches: Iterator[Batch], num_steps: int = 2) -> BaseException | None:
    """Construct torchrec's ``TrainPipelinePEC`` on ``dmp`` and run ``num_steps`` steps.

    Collective when it gets past construction: call it on every rank.

    Returns:
        The exception it raised, or ``None`` if it ran.
    """
    try:
        from torchrec.distributed.train_pipeline.pec_train_pipeline import TrainPipelinePEC

        pipe = TrainPipelinePEC(dmp, optimizer, device)
        for _ in range(num_steps):
            pipe.progress(batches)
    except Exception as e:  # noqa: BLE001 - returned to the caller, which reports it
        return e
    return None
