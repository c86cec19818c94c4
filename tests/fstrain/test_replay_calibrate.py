"""Replay and calibrate on tiny data; the NNLS fit; the calibrated JSON read by fsdata."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fsdata.balancer.bubble import run_bubble
from fsdata.balancer.cost import load_cost_model
from fstrain.measure.calibrate import CalibrateConfig, calibrate, fit_batch_times, nnls
from fstrain.cli import main
from fstrain.errors import ConfigError
from fstrain.measure.replay import ReplayConfig, TimingConfig, replay
from tests.fstrain.shards import write_shards

TINY = dict(embedding_dim=8, num_layers=1, num_heads=1, num_negatives=4, max_seq_len=64)


def test_nnls_matches_known_nonnegative_solution():
    rng = np.random.default_rng(0)
    a = rng.random((30, 4))
    x = np.array([0.5, 0.0, 2.0, 1e-3])
    np.testing.assert_allclose(nnls(a, a @ x), x, atol=1e-9)
    # an unconstrained fit would make the last coefficient negative
    b = a @ np.array([1.0, 1.0, 1.0, 0.0]) - 0.5 * a[:, 3]
    assert (nnls(a, b) >= 0).all()


def test_fit_batch_times_recovers_polynomial():
    rng = np.random.default_rng(1)
    batches = [rng.integers(1, 512, rng.integers(1, 40)) for _ in range(40)]
    t = np.array([2e-3 + 1e-5 * len(L) + 3e-7 * L.sum() + 4e-9 * (L.astype(float) ** 2).sum() for L in batches])
    fit = fit_batch_times(batches, t)
    np.testing.assert_allclose(fit.coefficients, [1e-5, 3e-7, 4e-9], rtol=1e-6)
    assert fit.batch_overhead_seconds == pytest.approx(2e-3) and fit.max_relative_error < 1e-8


def test_calibrate_writes_a_cost_model_fsdata_reads(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "-o", str(out), "--lengths", "4,16,64", "--batch-sizes", "2,8", "--mixed", "2",
                 "--repeats", "1", "--warmup", "1", "--embedding-dim", "8", "--num-layers", "1", "--num-heads", "1",
                 "--num-negatives", "4", "--max-seq-len", "64", "--progress"]) == 0
    err = capsys.readouterr().err  # --progress: the bar (stderr) counts every timed batch, 3 x 2 grid + 2 mixed
    assert "calibrate: 100%" in err and "8/8" in err, err
    obj = json.loads(out.read_text())
    assert obj["kind"] == "polynomial" and len(obj["coefficients"]) == 3
    assert obj["fit"]["num_measurements"] == 3 * 2 + 2
    model = load_cost_model(str(out))
    assert model.coefficients == tuple(obj["coefficients"])
    assert model.cost(np.array([64]))[0] > model.cost(np.array([4]))[0]


@pytest.mark.parametrize("objective", ["all-positions", "last-position"])
def test_calibrate_hstu_fits_a_cost_model(objective):
    res = calibrate(CalibrateConfig(lengths="4,256", batch_sizes="2,8", mixed=0,
                                    timing=TimingConfig(repeats=3, warmup=1)),
                    model={**TINY, "model": "hstu", "objective": objective, "max_seq_len": 256})
    assert len(res["coefficients"]) == 3 and res["fit"]["num_measurements"] == 4


def test_calibrate_rejects_lengths_above_max_seq_len():
    with pytest.raises(ConfigError, match="exceeds max_seq_len 64"):
        calibrate(CalibrateConfig(lengths="8,128", batch_sizes="2", timing=TimingConfig(repeats=1)), model=TINY)


@pytest.mark.parametrize("model,samples", [("sasrec", None), ("hstu", "per-user"), ("hstu", "per-event")])
def test_replay_reports_measured_and_predicted(tmp_path, model, samples):
    out = write_shards(str(tmp_path / "s"), num_ranks=3, num_steps=4, batch_size_per_rank=3, samples=samples)
    res = replay(out, ReplayConfig(max_steps=2, timing=TimingConfig(warmup=1, repeats=2)),
                 model={**TINY, "model": model})
    assert res["num_ranks"] == 3 and res["num_steps"] == 2
    assert np.asarray(res["compute_seconds"]).shape == (2, 3) and (np.asarray(res["compute_seconds"]) > 0).all()
    assert 0.0 <= res["measured_bubble"] < 1.0 and 0.0 <= res["predicted_bubble"] < 1.0
    with pytest.raises(ConfigError, match="statistic"):
        ReplayConfig(statistic="mean")


def test_replay_null_control_times_rank0_batch_as_every_rank(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=3, num_steps=3, batch_size_per_rank=3)
    res = replay(out, ReplayConfig(max_steps=2, timing=TimingConfig(warmup=1, repeats=2)), model=TINY)
    C, N = np.asarray(res["compute_seconds"]), np.asarray(res["null_compute_seconds"])
    assert N.shape == C.shape == (2, 3) and (N > 0).all()
    assert res["null_bubble"] == pytest.approx(run_bubble(N)) and 0.0 <= res["null_bubble"] < 1.0
    assert res["measured_bubble_minus_null"] == pytest.approx(res["measured_bubble"] - res["null_bubble"])
    assert res["slowest_rank_seconds_per_step"] == pytest.approx(C.max(axis=1).mean())
    assert res["null_slowest_rank_seconds_per_step"] == pytest.approx(N.max(axis=1).mean())
    assert len(res["null_step_bubble"]) == 2
    off = replay(out, ReplayConfig(max_steps=1, null_control=False, timing=TimingConfig(warmup=0, repeats=1)),
                 model=TINY)
    assert "null_bubble" not in off and "slowest_rank_seconds_per_step" in off


def test_replay_cli_json(tmp_path, capsys):
    bal = write_shards(str(tmp_path / "b"), num_ranks=2, num_steps=3, batch_size_per_rank=4)
    shuf = write_shards(str(tmp_path / "u"), num_ranks=2, num_steps=3, batch_size_per_rank=4, strategy="shuffle")
    assert main(["replay", bal, "--baseline", shuf, "--max-steps", "2", "--repeats", "1", "--warmup", "0",
                 "--json", "--output", str(tmp_path / "r.json"), "--embedding-dim", "8", "--num-layers", "1",
                 "--num-heads", "1", "--num-negatives", "4"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("measured_bubble", "predicted_bubble", "num_ranks", "num_steps", "measured_reduction",
                "null_bubble", "measured_bubble_minus_null", "slowest_rank_seconds_per_step",
                "slowest_rank_reduction", "measured_reduction_minus_null"):
        assert key in obj
    for key in ("null_bubble", "measured_bubble_minus_null", "slowest_rank_seconds_per_step"):
        assert key in obj["baseline"]
    assert "null_compute_seconds" not in obj  # per-step arrays only in --out
    assert main(["replay", bal, "--baseline", shuf, "--max-steps", "1", "--repeats", "1", "--warmup", "0",
                 "--embedding-dim", "8", "--num-layers", "1", "--num-heads", "1", "--num-negatives", "4"]) == 0
    text = capsys.readouterr().out
    assert "null ctrl" in text and "minus null" in text and "slowest rank" in text and "ms/step" in text
    assert obj["num_ranks"] == 2 and obj["num_steps"] == 2
    assert len(json.loads((tmp_path / "r.json").read_text())["compute_seconds"]) == 2


@pytest.mark.parametrize("argv, needle", [
    (["replay", "{missing}"], "manifest.json not found"),
    (["replay", "{shards}", "--max-steps", "0"], "--max-steps must be >= 1"),
    (["train", "{shards}", "--num-items", "2"], "but the model has num_items 2 (--num-items)"),
    (["train", "{shards}", "--resume"], "--resume needs --checkpoint-dir"),
    (["calibrate", "-o", "{tmp}/c.json", "--lengths", "a,b"], "--lengths must be comma-separated integers"),
])
def test_cli_errors_are_one_line_with_nonzero_exit(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=2, batch_size_per_rank=2)
    argv = [a.format(missing=str(tmp_path / "nope"), shards=shards, tmp=str(tmp_path)) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's parser.error
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) >= 1 and needle in err[-1] and "Traceback" not in "\n".join(err)


def test_calibrate_from_real_shard_batches(tmp_path):
    from fstrain.measure.calibrate import shard_batches

    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=4, strategy="shuffle")
    batches = shard_batches(shards, 2)
    assert len(batches) == 2 * 2 and all(len(L) == 4 for L in batches)
    cfg = CalibrateConfig(lengths="4,64", batch_sizes="2,16", mixed=0, timing=TimingConfig(repeats=2, warmup=1))
    res = calibrate(cfg, model=TINY, extra_batches=batches)
    assert res["fit"]["num_measurements"] == 4 + 4
    res = calibrate(CalibrateConfig(lengths="4,64", batch_sizes="2,16", mixed=0, from_shards=shards, shard_steps=2,
                                    timing=TimingConfig(repeats=1, warmup=0)), model=TINY)
    assert res["fit"]["num_measurements"] == 4 + 4  # --from-shards: the same batches, read by calibrate


def test_command_settings_take_their_defaults_from_one_place_and_check_themselves():
    """The defaults the CLI shows are the dataclasses' (replay: 4 steps x 3 repeats; calibrate: 5
    repeats), which the functions take; a bad value is refused on construction, naming the flag."""
    import inspect

    assert ReplayConfig().max_steps == 4 and ReplayConfig().timing.repeats == 3
    assert CalibrateConfig().timing.repeats == 5
    assert CalibrateConfig().length_grid == (4, 16, 48, 96, 160, 256, 384, 512)
    for fn in (replay, calibrate):
        assert inspect.signature(fn).parameters["config"].default is None  # None: the dataclass's defaults
    for make, needle in ((lambda: ReplayConfig(max_steps=0), "--max-steps must be >= 1, got 0"),
                         (lambda: TimingConfig(repeats=0), "--repeats must be >= 1, got 0"),
                         (lambda: TimingConfig(warmup=-1), "--warmup must be >= 0, got -1"),
                         (lambda: CalibrateConfig(lengths="4,x"), "--lengths must be comma-separated integers"),
                         (lambda: CalibrateConfig(batch_sizes="0"), "--batch-sizes needs positive integers"),
                         (lambda: CalibrateConfig(shard_steps=0), "--shard-steps must be >= 1, got 0")):
        with pytest.raises(ConfigError, match=needle):
            make()
