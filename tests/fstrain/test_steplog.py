"""Per-step loss in the metrics files and TensorBoard event files (read back with EventAccumulator)."""

from __future__ import annotations

import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fstrain.components.metrics import StepTiming, read_step_times, step_losses, summarize, write_step_times
from fstrain.components.steplog import StepLog
from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards


def _events(folder) -> tuple[dict, set]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    return scalars, set(acc.Tags()["histograms"])


def _timing(step, rank, n, c, w):
    return StepTiming(step=step, rank=rank, num_samples=n, num_tokens=10 * n, sparse_forward_seconds=0.001,
                      compute_seconds=c, wait_seconds=w, sync_seconds=0.002)


def test_steplog_single_rank_writes_loss_timings_and_eval(tmp_path):
    log = StepLog(0, 1, str(tmp_path / "tb"))
    timings = [_timing(s, 0, 4, 0.01 * (s + 1), 0.0) for s in range(3)]
    for s, t in enumerate(timings):
        log.add(s, torch.tensor(8.0 - s), 4, t)
    log.window(2, samples_per_second=100.0, tokens_per_second=1000.0)
    log.log_eval(3, {"hr@10": 0.25, "ndcg@10": 0.125, "note": "text is skipped"})
    log.finish()
    assert [t.loss for t in timings] == [2.0, 7.0 / 4, 6.0 / 4]
    scalars, hists = _events(tmp_path / "tb")
    assert scalars["train/loss"] == [(0, 2.0), (1, 1.75), (2, 1.5)]
    assert scalars["train/samples_per_second"] == [(2, 100.0)]
    assert scalars["eval/hr@10"] == [(3, 0.25)] and "eval/note" not in scalars
    assert [v for _, v in scalars["rank_compute_seconds/rank_00000"]] == pytest.approx([0.01, 0.02, 0.03])
    assert [v for _, v in scalars["step/exposed_comm_seconds_mean"]] == pytest.approx([0.003] * 3)
    assert {"compute_seconds_over_ranks", "straggler_wait_seconds_over_ranks"} <= hists


def test_step_times_loss_column_and_old_files(tmp_path):
    recs = [_timing(0, 0, 2, 0.1, 0.0), _timing(0, 1, 6, 0.2, 0.0)]
    recs[0].loss, recs[1].loss = 1.0, 3.0
    write_step_times(recs, str(tmp_path / "st.parquet"))
    back = read_step_times(str(tmp_path / "st.parquet"))
    assert [r.loss for r in back] == [1.0, 3.0]
    steps, loss = step_losses(back)
    assert steps.tolist() == [0] and loss[0] == pytest.approx((2 * 1.0 + 6 * 3.0) / 8)
    assert summarize(back)["loss_last_step"] == pytest.approx(2.5)
    old = pq.read_table(str(tmp_path / "st.parquet")).drop_columns(["loss"])  # a file from before `loss`
    pq.write_table(old, str(tmp_path / "old.parquet"))
    assert all(math.isnan(r.loss) for r in read_step_times(str(tmp_path / "old.parquet")))
    assert "loss_last_step" not in summarize(read_step_times(str(tmp_path / "old.parquet")))


def _tb_worker(shards, metrics, tb, pipeline):
    from fstrain.config import from_dict
    from fstrain.train import train

    cfg = from_dict({"shards": shards, "model": dict(embedding_dim=16, num_negatives=8, num_layers=1, num_heads=2),
                     "max_steps": 3, "metrics": {"log_every_steps": 2, "dir": metrics, "tensorboard_dir": tb},
                     "pipeline.name": pipeline or "none"})
    return train(cfg).summary


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", [None, "prioritized"])
def test_train_two_ranks_writes_tensorboard_and_loss(tmp_path, pipeline):
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=4, batch_size_per_rank=6)
    metrics, tb = str(tmp_path / "m"), str(tmp_path / "tb")
    summaries = run_ranks(_tb_worker, 2, shards, metrics, tb, pipeline)
    times = read_step_times(os.path.join(metrics, "step_times.parquet"))
    assert len(times) == 6 and all(np.isfinite(t.loss) and t.loss > 0 for t in times)
    steps, loss = step_losses(times)
    assert steps.tolist() == [0, 1, 2] and summaries[0]["loss_last_step"] == pytest.approx(loss[-1])
    scalars, hists = _events(tb)
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], loss, rtol=1e-5)
    assert [s for s, _ in scalars["train/samples_per_second"]] == [2]
    for tag in ("step/compute_seconds_max", "step/straggler_wait_seconds_mean", "step/exposed_comm_seconds_max",
                "step/measured_bubble", "rank_compute_seconds/rank_00001", "rank_straggler_wait_seconds/rank_00000"):
        assert len(scalars[tag]) == 3, tag
    assert "compute_seconds_over_ranks" in hists
    assert len([f for f in os.listdir(tb) if f.startswith("events.out.tfevents")]) == 1  # rank 0 only


def test_steplog_copies_pending_losses_in_bounded_chunks(tmp_path, monkeypatch):
    import fstrain.components.steplog as sl

    monkeypatch.setattr(sl, "MAX_PENDING_STEPS", 2)
    log = StepLog(0, 1, str(tmp_path / "tb"))
    timings = [_timing(s, 0, 2, 0.01, 0.0) for s in range(5)]
    for s, t in enumerate(timings):
        log.add(s, torch.tensor(float(s)), 2, t)
        assert len(log._pending) < 2
    log.finish()
    assert [t.loss for t in timings] == [0.0, 0.5, 1.0, 1.5, 2.0]
    scalars, _ = _events(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2, 3, 4]
