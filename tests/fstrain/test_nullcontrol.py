"""The null control of ``fstrain train`` (fstrain/components/nullcontrol.py) and its summary figures."""

from __future__ import annotations

import pytest

from fstrain.components.metrics import StepTiming, describe_bubble, summarize
from fstrain.components.nullcontrol import control_schedule


def _rec(step: int, rank: int, compute: float) -> StepTiming:
    return StepTiming(step=step, rank=rank, num_samples=4, num_tokens=9, sparse_forward_seconds=0.0,
                      compute_seconds=compute, wait_seconds=0.0, sync_seconds=0.0)


@pytest.mark.parametrize("total,k,expected", [
    (10, 3, {1: 1, 4: 1, 7: 1}), (3, 5, {1: 3, 2: 2}), (1, 2, {0: 2}), (0, 4, {}), (5, 0, {})])
def test_control_schedule_spreads_the_controls_after_the_warm_up_step(total, k, expected):
    sched = control_schedule(total, k)
    assert sched == expected
    assert sum(sched.values()) == (k if total > 0 else 0)


def test_summary_puts_the_null_control_beside_the_measured_bubble():
    train = [_rec(0, 0, 0.010), _rec(0, 1, 0.020), _rec(1, 0, 0.010), _rec(1, 1, 0.010)]
    null = [_rec(0, 0, 0.010), _rec(0, 1, 0.011), _rec(1, 0, 0.010), _rec(1, 1, 0.010)]
    s = summarize(train, 0.0001, null)
    assert s["measured_bubble"] == pytest.approx(0.005 / 0.030)  # (0.005 + 0) / (0.020 + 0.010)
    assert s["null_bubble"] == pytest.approx(0.0005 / 0.021)
    assert s["measured_bubble_minus_null"] == pytest.approx(s["measured_bubble"] - s["null_bubble"])
    assert s["null_control_steps"] == 2
    assert s["slowest_rank_ms_per_step"] == pytest.approx(15.0)
    assert s["null_slowest_rank_ms_per_step"] == pytest.approx(10.5)
    line = describe_bubble(s)
    assert "measured bubble 16.67%" in line and "null control 2.38% over 2 control steps" in line
    assert "predicted 0.01%" in line and "slowest rank 15.00 ms/step" in line
    assert "above it 14.29%" in line
    noisy = summarize(train, None, [_rec(0, 0, 0.01), _rec(0, 1, 0.03)])
    assert "within the noise" in describe_bubble(noisy) and "predicted" not in describe_bubble(noisy)
    assert "null_bubble" not in summarize(train, None, [])
    assert "null control" not in describe_bubble(summarize(train))


def test_negative_null_control_steps_is_one_config_error():
    from fstrain.config import from_dict
    from fstrain.errors import ConfigError

    with pytest.raises(ConfigError, match="--null-control-steps must be >= 0, got -1"):
        from_dict({"shards": "s", "metrics.null_control_steps": -1}).check()
    from_dict({"shards": "s", "metrics.null_control_steps": 0}).check()
