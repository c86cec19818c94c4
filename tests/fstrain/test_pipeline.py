"""Pipelines: every shipped schedule ends with the parameters of plain training (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards

MODEL = dict(num_items=40, embedding_dim=8, num_negatives=6, num_layers=1, num_heads=2)
NUM_STEPS = 4


def _batches(shards, rank, seed=0):
    from fstrain.data import ShardReader
    from fstrain.model import with_negatives

    return (with_negatives(b, MODEL["num_items"], MODEL["num_negatives"], seed)
            for b in ShardReader(shards, rank, 2, num_prefetch_batches=0))


def _train(shards, name, env):
    from fstrain.dist import OptimConfig, build_sharded_model, local_state
    from fstrain.model import Config
    from fstrain.pipeline import make_pipeline, run_steps

    torch.manual_seed(0)
    dmp, opt = build_sharded_model(Config(**MODEL), OptimConfig(dense_lr=1e-2, sparse_lr=0.1), env)
    pipe = make_pipeline(name, dmp, opt, env.device)
    outs = run_steps(pipe, _batches(shards, env.rank))
    pipe.close()
    return local_state(dmp), [o.stats for o in outs], [float(o.output[0]) for o in outs]


def _equal_worker(shards, names):
    from fstrain.dist import init_distributed

    env = init_distributed("gloo")
    return {name: _train(shards, name, env) for name in ["plain", *names]}


@pytest.mark.multiproc
def test_pipelines_equal_to_non_pipelined(tmp_path):
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=NUM_STEPS, batch_size_per_rank=4, seed=7,
                          num_items=MODEL["num_items"])
    names = ["sparse-dist", "prioritized"]
    for rank_result in run_ranks(_equal_worker, 2, shards, names):
        ref, ref_stats, ref_loss = rank_result["plain"]
        for name in names:
            state, stats, loss = rank_result[name]
            assert len(stats) == NUM_STEPS
            torch.testing.assert_close(torch.tensor(loss), torch.tensor(ref_loss), msg=lambda m: f"{name} loss: {m}")
            for k in ref:
                torch.testing.assert_close(state[k], ref[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {k}: {m}")
            print(name, stats)
