"""Held-out evaluation: HR@K/NDCG@K (hand-computed, torchmetrics parity), fstrain evaluate, --eval-every-steps,
--simulate-ranks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fstrain.components.evaluator import (EvalData, evaluate_model, hr_ndcg_sums, load_eval_data, mask_scores,
                                          target_ranks)
from fstrain.errors import ConfigError
from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards

MODEL = dict(embedding_dim=16, num_negatives=8, num_layers=1, num_heads=2)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _metrics(scores, targets, hist, k, mask_history, padding_id=0):
    lengths = torch.tensor([len(h) for h in hist])
    values = torch.tensor([i for h in hist for i in h], dtype=torch.int64)
    s = mask_scores(torch.tensor(scores, dtype=torch.float32), torch.tensor(targets), values, lengths,
                    mask_history=mask_history, padding_id=padding_id)
    hits, ndcg = hr_ndcg_sums(target_ranks(s, torch.tensor(targets)), k)
    return hits / len(targets), ndcg / len(targets)


def test_hand_computed_three_users_five_items():
    scores = [[9.0, 0.5, 0.9, 0.1, 0.7],   # target 2, history [1]: candidates {2,3,4} -> rank 0
              [0.0, 0.8, 0.2, 0.6, 0.4],   # target 4, history [3,4] (target never masked): {1,2,4} -> rank 1
              [0.0, 0.3, 0.5, 0.1, 0.9]]   # target 1, history [3]: {1,2,4} -> rank 2 (miss at K=2)
    targets, hist = [2, 4, 1], [[1], [3, 4], [3]]
    hr, ndcg = _metrics(scores, targets, hist, 2, True)
    assert hr == pytest.approx(2 / 3) and ndcg == pytest.approx((1 + 1 / math.log2(3)) / 3)
    # without masking: ranks 0, 2, 2 (id 0 is still padding, so user A's 9.0 never counts)
    hr, ndcg = _metrics(scores, targets, hist, 2, False)
    assert hr == pytest.approx(1 / 3) and ndcg == pytest.approx(1 / 3)
    # padding id -1: item 0 (score 9.0) is a candidate and beats user A's target
    hr, ndcg = _metrics(scores, targets, hist, 2, False, padding_id=-1)
    assert hr == pytest.approx(1 / 3) and ndcg == pytest.approx(1 / math.log2(3) / 3)


def test_ties_count_against_the_target():
    r = target_ranks(torch.zeros(2, 6), torch.tensor([0, 5]))
    assert r.tolist() == [5, 5]


def test_parity_with_torchmetrics():
    from torchmetrics.retrieval import RetrievalHitRate, RetrievalNormalizedDCG

    g = torch.Generator().manual_seed(3)
    U, N, k = 60, 40, 10
    scores = torch.randn(U, N, generator=g)
    targets = torch.randint(1, N, (U,), generator=g)
    hist = [torch.randint(1, N, (int(n),), generator=g).tolist() for n in torch.randint(1, 6, (U,), generator=g)]
    hr, ndcg = _metrics(scores.tolist(), targets.tolist(), hist, k, True)
    # torchmetrics on the candidate set (masked entries removed), one query per user
    preds, rel, idx = [], [], []
    for u in range(U):
        for i in range(N):
            if i == 0 or (i in hist[u] and i != targets[u]):
                continue
            preds.append(scores[u, i]), rel.append(i == targets[u]), idx.append(u)
    preds, rel, idx = torch.stack(preds), torch.tensor(rel), torch.tensor(idx)
    assert hr == pytest.approx(float(RetrievalHitRate(top_k=k)(preds, rel, indexes=idx)), abs=1e-6)
    assert ndcg == pytest.approx(float(RetrievalNormalizedDCG(top_k=k)(preds, rel, indexes=idx)), abs=1e-6)


def _eval_file(path, num_users=40, num_items=50, seed=0):
    rng = np.random.default_rng(seed)
    hist = [rng.integers(1, num_items, int(n)).tolist() for n in rng.integers(1, 20, num_users)]
    pq.write_table(pa.table({"user_id": pa.array(np.arange(num_users), pa.int64()),
                             "item_ids": pa.array(hist, pa.list_(pa.int64())),
                             "target_item_id": pa.array(rng.integers(1, num_items, num_users), pa.int64()),
                             "seq_len": pa.array([len(h) for h in hist], pa.int32())}), path)
    return str(path)


def test_evaluate_model_equals_per_user_brute_force(tmp_path):
    """Batched, length-sorted scoring gives each user the rank a one-user forward gives."""
    from fstrain.models import Config, SequentialRecommender

    torch.manual_seed(0)
    model = SequentialRecommender(Config(num_items=50, **MODEL))
    data = load_eval_data(_eval_file(tmp_path / "e.parquet"))
    res = evaluate_model(model, data, num_items=50, k=10, batch_size=7)
    W = model.ec.embeddings["item_table"].weight.detach()
    Wn = torch.nn.functional.normalize(W, dim=-1)  # the model scores by cosine similarity (l2_normalize)
    model.eval()
    hits = ndcg = mrr = hits50 = 0.0
    with torch.no_grad():
        for u in range(data.num_users):
            h = torch.from_numpy(data.values[data.offsets[u]:data.offsets[u + 1]])
            user = model.dense.user_vectors(W[h], torch.tensor([len(h)]))[0]
            s = (Wn @ user).numpy().astype(np.float64)
            t = int(data.target_ids[u])
            cand = [i for i in range(1, 50) if i == t or i not in set(h.tolist())]
            rank = sum(s[i] > s[t] for i in cand)
            hits += rank < 10
            hits50 += rank < 50
            ndcg += 1 / math.log2(rank + 2) if rank < 10 else 0.0
            mrr += 1 / (rank + 1)
    assert res["num_users"] == 40 and res["num_candidates"] == 49
    assert res["hr@10"] == pytest.approx(hits / 40) and res["ndcg@10"] == pytest.approx(ndcg / 40, abs=1e-9)
    assert res["hr@50"] == pytest.approx(hits50 / 40) and res["mrr"] == pytest.approx(mrr / 40, abs=1e-9)


def test_bad_eval_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_eval_data(str(tmp_path / "nope.parquet"))
    pq.write_table(pa.table({"user_id": [1]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="lacks columns"):
        load_eval_data(str(tmp_path / "x.parquet"))
    data = EvalData("e", np.array([0]), np.array([3]), np.array([0, 1]), np.array([60]))
    from fstrain.models import Config, SequentialRecommender

    with pytest.raises(ConfigError, match="num_items 50"):
        evaluate_model(SequentialRecommender(Config(num_items=50, **MODEL)), data, num_items=50)


def _train_eval_worker(shards, eval_path, ckpt, metrics, simulate):
    from fstrain.components.evaluator import evaluate_checkpoint
    from fstrain.config import from_dict
    from fstrain.train import train

    res = train(from_dict({"shards": shards, "model": MODEL, "max_steps": 3, "pipeline.name": "none",
                           "metrics": {"log_every_steps": 0, "dir": metrics},
                           "eval": {"data": eval_path, "every_steps": 2},
                           "checkpoint.dir": ckpt, "simulate_ranks": simulate}))
    again = evaluate_checkpoint(os.path.join(ckpt, "step-00000003"), eval_path) if ckpt else None
    return res.summary, again


def test_evaluate_checkpoint_end_to_end(tmp_path):
    """Train 3 steps with --eval-every-steps 2: eval.parquet has steps 2 and 3; fstrain evaluate of the final
    checkpoint (library and CLI) reproduces the step-3 metrics."""
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=3, batch_size_per_rank=12, seed=1)
    ev = _eval_file(tmp_path / "e.parquet")
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "run")
    [(summary, again)] = run_ranks(_train_eval_worker, 1, shards, ev, ckpt, metrics, False)
    assert [r["step"] for r in summary["eval"]] == [2, 3]
    table = pq.read_table(os.path.join(metrics, "eval.parquet")).to_pylist()
    assert [r["step"] for r in table] == [2, 3] and table[1]["ndcg@10"] == summary["eval"][1]["ndcg@10"]
    assert json.loads(open(os.path.join(metrics, "summary.json")).read())["eval"][1]["hr@10"] == table[1]["hr@10"]
    assert again["hr@10"] == summary["eval"][1]["hr@10"]
    assert again["ndcg@10"] == pytest.approx(summary["eval"][1]["ndcg@10"], abs=1e-9)
    out = subprocess.run([sys.executable, "-m", "fstrain.cli", "evaluate", os.path.join(ckpt, "step-00000003"), ev,
                          "--json"], capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout.splitlines()[-1])
    assert cli["ndcg@10"] == pytest.approx(again["ndcg@10"], abs=1e-9) and cli["step"] == 3
    bad = subprocess.run([sys.executable, "-m", "fstrain.cli", "evaluate", str(tmp_path), ev], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert bad.returncode == 2 and "not a complete fstrain checkpoint" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.multiproc
def test_eval_every_steps_two_ranks_equals_simulated_ranks(tmp_path):
    """2 gloo ranks (users sharded, sums all-reduced) report the metrics of 1 process training on each step's whole
    global batch with --simulate-ranks."""
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=6, seed=7)
    ev = _eval_file(tmp_path / "e.parquet")
    r0, r1 = run_ranks(_train_eval_worker, 2, shards, ev, None, str(tmp_path / "m2"), False)
    [(sim, _)] = run_ranks(_train_eval_worker, 1, shards, ev, None, str(tmp_path / "m1"), True)
    assert sim["simulate_ranks"] and [r["step"] for r in sim["eval"]] == [2, 3]
    for a, b, c in zip(r0[0]["eval"], r1[0]["eval"], sim["eval"]):
        assert a == b or {k: v for k, v in a.items() if k != "eval_seconds"} == {
            k: v for k, v in b.items() if k != "eval_seconds"}
        assert a["num_users"] == c["num_users"] == 40
        # same parameters up to float summation order: at most one user's rank may flip
        assert abs(a["hr@10"] - c["hr@10"]) <= 1 / 40 and abs(a["ndcg@10"] - c["ndcg@10"]) <= 1 / 40
    assert os.path.exists(tmp_path / "m2" / "eval.parquet")


def test_subsample_is_seeded_and_keeps_rows_intact(tmp_path):
    data = load_eval_data(_eval_file(tmp_path / "e.parquet"))
    a, b = data.subsample(10), data.subsample(10)
    assert a.num_users == 10 and np.array_equal(a.user_ids, b.user_ids) and data.subsample(None) is data
    for j, u in enumerate(a.user_ids):
        i = int(np.flatnonzero(data.user_ids == u)[0])
        assert np.array_equal(a.values[a.offsets[j]:a.offsets[j + 1]], data.values[data.offsets[i]:data.offsets[i + 1]])
        assert a.target_ids[j] == data.target_ids[i]


def test_popularity_ranking_hand_computed():
    from fstrain.components.evaluator import evaluate_popularity

    # counts: item 1 most popular, then 2, 3, 4; users: history masks their own items
    counts = np.array([0, 40, 30, 20, 10])
    data = EvalData("e", np.array([0, 1]), np.array([1, 1, 2]), np.array([0, 1, 3]), np.array([3, 4]))
    res = evaluate_popularity(data, counts, k=10)
    # user 0: history {1}, candidates {2, 3, 4} by count -> target 3 at rank 1; user 1: history {1, 2} -> 4 at rank 1
    assert res["hr@10"] == 1.0 and res["ndcg@10"] == pytest.approx(1 / math.log2(3))
    assert res["mrr"] == pytest.approx(0.5)


DATASET = os.path.join(os.path.dirname(REPO), "shared", "datasets", "ml-1m_ensfm", "sequences.txt")


@pytest.mark.slow
def test_300_ml1m_users_few_epochs_beat_popularity(tmp_path):
    """Per-user samples, the all-positions objective, a few epochs: better than the popularity ranking."""
    if not os.path.exists(DATASET):
        pytest.skip(f"{DATASET} not found: the shared datasets folder is absent")
    from fstrain.components.evaluator import evaluate_popularity, item_counts

    with open(DATASET) as f:
        lines = [next(f) for _ in range(300)]
    src = tmp_path / "ml1m-300.txt"
    src.write_text("".join(lines))
    samples, ev, shards, run = (tmp_path / n for n in ("s.parquet", "e.parquet", "shards", "run"))
    py = [sys.executable, "-m"]
    subprocess.run(py + ["fsdata", "convert", str(src), str(samples), "--format", "sequences", "--samples", "per-user",
                         "--max-seq-len", "200", "--holdout", "last", "--holdout-output", str(ev), "--no-progress"],
                   check=True, cwd=REPO, capture_output=True)
    subprocess.run(py + ["fsdata", "balance", str(samples), str(shards), "--ranks", "1", "--batch-size-per-rank", "32",
                         "--epochs", "10", "--no-progress"], check=True, cwd=REPO, capture_output=True)
    r = subprocess.run(py + ["fstrain.cli", "train", str(shards), "--eval-data", str(ev), "--eval-every-epochs", "5",
                             "--max-seq-len", "200", "--embedding-dim", "32", "--num-layers", "2", "--num-heads", "1",
                             "--sparse-lr", "0.2", "--negatives", "sample", "--pipeline", "none",
                             "--log-every-steps", "0",
                             "--json", "--no-progress"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["objective"] == "all-positions"
    assert [round(e["epoch"]) for e in summary["eval"]] == [5, 10]
    data = load_eval_data(str(ev))
    pop = evaluate_popularity(data, item_counts(str(samples), summary["eval_final"]["num_candidates"] + 1))
    assert summary["eval_final"]["ndcg@10"] > pop["ndcg@10"], (summary["eval_final"], pop)
