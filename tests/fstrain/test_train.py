"""2-process gloo training: equal-gradients invariant, measured == plain step, checkpoint/resume."""

from __future__ import annotations

import os

import pytest
import torch

from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards

MODEL = dict(embedding_dim=16, num_negatives=8, num_layers=1, num_heads=2)


def _params(shards, steps, mode="measured", **kw):
    from fstrain.dist import local_state
    from fstrain.train import TrainConfig, train

    res = train(TrainConfig(shards=shards, model=MODEL, max_steps=steps, step_mode=mode, log_every_steps=0, **kw))
    return local_state(res.model), res.summary


def _invariant_worker(root):
    balanced, _ = _params(os.path.join(root, "balanced"), 3)
    shuffle, _ = _params(os.path.join(root, "shuffle"), 3, mode="plain")
    budget, summary = _params(os.path.join(root, "budget"), 3)
    return balanced, shuffle, budget, summary


def _assert_same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.multiproc
def test_balanced_equals_shuffle_and_cost_budget(tmp_path):
    """Balancing moves samples between ranks inside a step only: same parameters after k steps."""
    for name, strategy, policy in [("balanced", "balanced", "fixed"), ("shuffle", "shuffle", "fixed"),
                                   ("budget", "balanced", "cost-budget")]:
        write_shards(str(tmp_path / name), num_ranks=2, num_steps=3, batch_size_per_rank=6, strategy=strategy,
                     policy=policy, seed=3)
    results = run_ranks(_invariant_worker, 2, str(tmp_path))
    for balanced, shuffle, budget, summary in results:
        assert any(v.abs().sum() > 0 for v in balanced.values())
        _assert_same(balanced, shuffle)
        _assert_same(balanced, budget)
        assert summary["num_steps"] == 3 and summary["num_ranks"] == 2
        assert 0.0 <= summary["measured_bubble"] < 1.0


def _resume_worker(shards, ckpt):
    straight, _ = _params(shards, 4)
    _params(shards, 2, checkpoint_dir=ckpt)
    resumed, summary = _params(shards, 4, checkpoint_dir=ckpt, resume=True)
    return straight, resumed, summary


@pytest.mark.multiproc
def test_checkpoint_resume_equals_straight_run(tmp_path):
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=4, batch_size_per_rank=4, seed=5)
    ckpt = str(tmp_path / "ckpt")
    for straight, resumed, summary in run_ranks(_resume_worker, 2, shards, ckpt):
        assert summary["first_step"] == 2 and summary["end_step"] == 4
        _assert_same(straight, resumed)
    assert sorted(os.listdir(ckpt)) == ["step-00000002", "step-00000004"]
