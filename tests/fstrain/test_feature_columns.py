"""Feature columns travel: a list column aligned with item_ids goes through ``fsdata balance`` unchanged, comes out
of ``ShardDataset`` as a jagged column with item_ids' offsets, and is HSTU's action input in ``fstrain train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fstrain.data import ShardDataset, ShardReader
from fstrain.errors import ConfigError, ShardError
from tests.fstrain.multiproc import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = dict(embedding_dim=16, num_negatives=8, num_layers=1, num_heads=2, model="hstu", max_seq_len=32)
NUM_ACTIONS = 3


def _action(items: np.ndarray) -> np.ndarray:
    return items % NUM_ACTIONS  # a code every position's item determines: checkable after reordering


def _samples(path, num_users=48, num_items=40, seed=0, feature=True, eval_path=None):
    rng = np.random.default_rng(seed)
    hist = [rng.integers(1, num_items, int(n)) for n in rng.integers(2, 20, num_users)]
    cols = {"sample_id": pa.array(np.arange(num_users), pa.int64()),
            "user_id": pa.array(np.arange(num_users), pa.int64()),
            "item_ids": pa.array([h.tolist() for h in hist], pa.list_(pa.int64())),
            "target_item_id": pa.array(rng.integers(1, num_items, num_users), pa.int64()),
            "seq_len": pa.array([len(h) for h in hist], pa.int32())}
    if feature:
        cols["action"] = pa.array([_action(h).tolist() for h in hist], pa.list_(pa.int64()))
        cols["rating"] = pa.array([(h * 0.5).tolist() for h in hist], pa.list_(pa.float64()))
    pq.write_table(pa.table(cols), path)
    if eval_path:  # an evaluation file (one row per user) with the same feature columns
        pq.write_table(pa.table({k: v for k, v in cols.items() if k != "sample_id"}), eval_path)
    return str(path)


def _balance(inp: str, out: str, ranks: int = 2, feature_columns=("action", "rating")) -> str:
    r = subprocess.run([sys.executable, "-m", "fsdata", "balance", inp, out, "--ranks", str(ranks),
                        "--batch-size-per-rank", "4"], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    if feature_columns:  # as fsdata convert --feature-cols records them and balance carries them
        path = os.path.join(out, "_manifest.json")
        raw = json.load(open(path))
        raw["feature_columns"] = list(feature_columns)
        json.dump(raw, open(path, "w"))
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("feat")
    return _balance(_samples(d / "in.parquet", eval_path=d / "eval.parquet"), str(d / "out")), str(d / "eval.parquet")


def test_balance_carries_feature_columns_and_dataset_exposes_them_jagged(shards):
    out, _ = shards
    total = 0
    for rank in range(2):
        ds = ShardDataset(out, rank, 2)
        assert {"action", "rating"} <= set(ds.columns)
        for st in ds:
            items, act, rating = st.columns["item_ids"], st.columns["action"], st.columns["rating"]
            assert torch.equal(act.offsets, items.offsets) and torch.equal(rating.offsets, items.offsets)
            assert torch.equal(act.values, items.values % NUM_ACTIONS)
            assert act.values.dtype == torch.int64 and rating.values.dtype == torch.float64
            assert torch.allclose(rating.values, items.values.double() * 0.5)
            total += st.batch.num_samples
    assert total == 48


def test_reader_carries_the_action_column_as_batch_actions(shards):
    out, _ = shards
    for b in ShardReader(out, 1, 2, action_column="action"):
        assert torch.equal(b.actions, b.features["item_ids"].values() % NUM_ACTIONS)
    assert all(b.actions is None for b in ShardReader(out, 1, 2))
    with pytest.raises(ShardError, match="feature column 'rating' is list<element: double>.*list of integer"):
        ShardReader(out, 0, 2, action_column="rating")
    with pytest.raises(ShardError, match="has no feature column 'nope'.*--feature-cols nope"):
        ShardReader(out, 0, 2, action_column="nope")


def test_hstu_action_input_is_summed_into_every_position():
    from fstrain.models import Config, SequentialRecommender

    torch.manual_seed(0)
    cfg = Config(num_items=20, action_column="action", num_actions=NUM_ACTIONS, dropout=0.0, **MODEL)
    dense = SequentialRecommender(cfg).dense.eval()
    assert dense.action.weight.shape == (NUM_ACTIONS, 16)
    hist, lengths = torch.randn(7, 16), torch.tensor([3, 4])
    a = dense.user_vectors(hist, lengths, torch.tensor([0, 1, 2, 0, 1, 2, 0]))
    b = dense.user_vectors(hist, lengths, torch.tensor([0, 1, 2, 0, 1, 2, 1]))  # last action of user 2 differs
    assert torch.equal(a[0], b[0]) and not torch.allclose(a[1], b[1])
    with pytest.raises(ConfigError, match="action input"):
        dense.user_vectors(hist, lengths)
    plain = SequentialRecommender(Config(num_items=20, **MODEL)).dense
    assert plain.action is None and not any("action" in n for n, _ in plain.named_parameters())


def _train(shards, ev, ckpt, model, pipeline="none"):
    from fstrain.components.evaluator import evaluate_checkpoint
    from fstrain.config import from_dict
    from fstrain.train import train

    res = train(from_dict({"shards": shards, "model": model, "max_steps": 3, "pipeline.name": pipeline,
                           "metrics.log_every_steps": 0, "eval": {"data": ev}, "checkpoint.dir": ckpt}))
    again = evaluate_checkpoint(os.path.join(ckpt, "step-00000003"), ev)
    meta = json.load(open(os.path.join(ckpt, "step-00000003", "fstrain.json")))
    return res.summary["eval_final"], again, meta["model"]


def test_train_hstu_takes_the_action_column_and_evaluate_reads_it_back(tmp_path):
    """One rank: hstu picks ``action`` from the manifest's feature columns, the
    checkpoint records it, and fstrain evaluate reads the evaluation file's action column."""
    d = tmp_path
    out = _balance(_samples(d / "in.parquet", eval_path=d / "e.parquet"), str(d / "out"), ranks=1)
    ev = str(d / "e.parquet")
    [(final, again, model)] = run_ranks(_train, 1, out, ev, str(d / "ckpt"), MODEL)
    assert model["action_column"] == "action" and model["num_actions"] == NUM_ACTIONS
    assert again["ndcg@10"] == pytest.approx(final["ndcg@10"], abs=1e-9)
    # the prioritized pipeline (the CPU default) carries the actions the same way: the same parameters
    [(piped, _, _)] = run_ranks(_train, 1, out, ev, str(d / "ckpt-p"), MODEL, "prioritized")
    assert piped["ndcg@10"] == pytest.approx(final["ndcg@10"], abs=1e-6)
    [(_, _, off)] = run_ranks(_train, 1, out, ev, str(d / "ckpt2"), {**MODEL, "action_column": "none"})
    assert off["num_actions"] is None
    [(_, _, sas)] = run_ranks(_train, 1, out, ev, str(d / "ckpt3"), {**MODEL, "model": "sasrec"})
    assert sas["num_actions"] is None  # sasrec has no action input unless asked


def test_an_evaluation_file_without_the_action_column_is_refused_before_training(tmp_path):
    from fstrain.config import from_dict
    from fstrain.train import train

    out = _balance(_samples(tmp_path / "in.parquet"), str(tmp_path / "out"), ranks=1)
    ev = _samples(tmp_path / "e.parquet", feature=False)
    with pytest.raises(ConfigError, match="lacks the action column 'action'.*--feature-cols action"):
        train(from_dict({"shards": out, "model": MODEL, "eval": {"data": ev}}))
