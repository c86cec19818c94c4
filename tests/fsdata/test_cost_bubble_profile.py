import json

import numpy as np
import pytest

from fsdata.balancer import bubble
from fsdata.cli import main
from fsdata.balancer.cost import load_cost_model
from fsdata.errors import ConfigError
from fsdata.balancer.profile import profile
from tests.fsdata.helpers import write_samples


def test_cost_models():
    L = np.array([1, 10, 100])
    assert load_cost_model("tokens").cost(L).tolist() == [1, 10, 100]
    assert load_cost_model("quadratic").cost(L).tolist() == [65, 740, 16400]
    assert load_cost_model("poly:c0=1,c2=2").cost(L).tolist() == [3, 201, 20001]
    h = load_cost_model("hstu:d_model=64,num_heads=2,head_dim=32,num_layers=1,causal=0")
    # linear: 2*L*d*4*h*dh + 2*L*h*dh*d; attention: 2*2*h*dh*L^2
    assert h.coefficients == (0.0, 2 * 64 * 4 * 64 + 2 * 64 * 64, 4 * 64)
    assert load_cost_model("hstu").coefficients[2] == load_cost_model("hstu:causal=0").coefficients[2] / 2


def test_cost_model_json_roundtrip(tmp_path):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"kind": "polynomial", "coefficients": [5e-5, 1e-6, 2e-9]}))
    m = load_cost_model(str(p))
    assert m.coefficients == (5e-5, 1e-6, 2e-9)
    assert load_cost_model(m.to_json()).coefficients == m.coefficients
    with pytest.raises(ConfigError):
        load_cost_model("hstu:bogus=1")


def test_bubble_formulas():
    c = np.array([[1.0, 1.0], [1.0, 3.0]])
    assert bubble.step_bubbles(c).tolist() == [0.0, pytest.approx(1 / 3)]
    assert bubble.run_bubble(c) == pytest.approx((0 + 1) / (1 + 3))
    # lower bound: one huge sample dominates the fair share
    costs = np.array([[100.0, 1, 1, 1]])
    assert bubble.step_lower_bound(costs, 2, 2).tolist() == [101.0]
    assert bubble.lower_bound_bubble(costs, 2, 2) == pytest.approx((101 - 51.5) / 101)
    assert bubble.reduction(0.01, 0.4) == pytest.approx(0.975)


def test_profile_flags_heavy_tail():
    L = np.array([1] * 63 + [2000])
    r = profile(L, load_cost_model("quadratic"), num_ranks=8, batch_size_per_rank=8)
    assert r["steps_beyond_fair_share"] == 1 and r["heavy_tail_warning"]
    assert "cost-budget" in r["heavy_tail_warning"] and r["lower_bound_bubble"] > 0.8
    assert any(w["change"] == "max_seq_len=256" for w in r["what_if"])
    even = profile(np.full(64, 10), load_cost_model("quadratic"), num_ranks=8, batch_size_per_rank=8)
    assert even["heavy_tail_warning"] is None and even["baseline_bubble"] == 0.0


def test_profile_cli_json_and_table(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=500)
    assert main(["profile", str(inp), "--ranks", "4", "--batch-size-per-rank", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["lengths"]["count"] == 500 and r["num_steps"] == 15
    assert 0 < r["lower_bound_bubble"] <= r["baseline_bubble"]
    assert main(["profile", str(inp), "--ranks", "4", "--batch-size-per-rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble today" in out and "p99" in out


def test_profile_real_movielens_per_user(tmp_path, capsys):
    from tests.conftest import dataset_path

    src = dataset_path("ml-1m_ensfm/sequences.txt")
    samples = tmp_path / "ml1m_user.parquet"
    assert main(["convert", str(src), str(samples), "--format", "sequences", "--samples", "per-user",
                 "--max-seq-len", "4096", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["profile", str(samples), "--ranks", "16", "--batch-size-per-rank", "16", "--cost-model",
                 "quadratic", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["lengths"]["count"] == 6040 and r["lengths"]["max"] == 2313
    # per-user MovieLens-1M at R=16, B=16 is the heavy-tail regime: the bound itself is high
    assert r["heavy_tail_warning"] and 0.3 < r["lower_bound_bubble"] < r["baseline_bubble"]
    assert any(w["change"] == "max_seq_len=512" for w in r["what_if"])
