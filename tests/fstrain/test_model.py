"""The model: fast (fbgemm jagged, bucketed) attention equals the per-sample reference; the loss
normalisation makes gradients independent of how a step's samples are split over ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fstrain.data import make_batch
from fstrain.errors import ConfigError
from fstrain.model import NEGATIVE_KEY, Config, SequentialRecommender, length_buckets, with_negatives


def _batch(lengths, step=0, global_n=None, seed=0, num_items=40):
    rng = np.random.default_rng(seed)
    L = np.asarray(lengths)
    b = make_batch(rng.integers(0, num_items, L.sum()), L, rng.integers(0, num_items, len(L)),
                   np.arange(len(L)), step, global_n or len(L))
    return with_negatives(b, num_items, 6, seed=1)


def _grads(model, batch):
    model.zero_grad()
    loss, (loss_sum, n) = model(batch)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_length_buckets_cover_and_bound_padding():
    lengths = sorted([1, 2, 3, 9, 10, 30, 31, 37, 100, 124, 125, 400, 512])
    buckets = length_buckets(lengths, 1.25)
    assert buckets[0][0] == 0 and buckets[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:]))
    for s, e, Lb in buckets:
        assert Lb == lengths[e - 1] and Lb <= max(lengths[s] * 1.25, lengths[s] + 8)


@pytest.mark.parametrize("ratio", [1.0, 1.25, 4.0])
def test_bucketed_attention_equals_reference(ratio):
    lengths = [5, 1, 17, 3, 33, 16, 2, 40]
    out = []
    for attention in ("bucketed", "reference"):
        torch.manual_seed(0)
        m = SequentialRecommender(Config(num_items=40, embedding_dim=16, num_heads=2, num_layers=2,
                                         num_negatives=6, max_seq_len=64, attention=attention, bucket_ratio=ratio))
        out.append(_grads(m, _batch(lengths)))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=1e-5)
    for k in out[0][1]:
        torch.testing.assert_close(out[0][1][k], out[1][1][k], atol=1e-5, rtol=1e-4)


def test_split_batches_sum_to_whole_batch_gradients():
    """Two 'ranks' holding any split of a step's samples give the gradients of the whole step."""
    torch.manual_seed(0)
    m = SequentialRecommender(Config(num_items=40, embedding_dim=16, num_layers=1, num_negatives=6))
    lengths = [4, 9, 1, 12, 7, 3]
    rng = np.random.default_rng(0)
    L = np.array(lengths)
    vals, tg = rng.integers(0, 40, L.sum()), rng.integers(0, 40, len(L))
    off = np.concatenate([[0], np.cumsum(L)])

    def sub(idx):
        v = np.concatenate([vals[off[i]:off[i + 1]] for i in idx])
        return with_negatives(make_batch(v, L[idx], tg[idx], np.array(idx), 3, len(L)), 40, 6, seed=1)

    _, whole = _grads(m, sub([0, 1, 2, 3, 4, 5]))
    _, a = _grads(m, sub([5, 0]))
    _, b = _grads(m, sub([3, 1, 4, 2]))
    for k in whole:
        torch.testing.assert_close(a[k] + b[k], whole[k], atol=1e-6, rtol=1e-5)


def test_negatives_depend_only_on_seed_and_step():
    a, b = _batch([3, 4], step=7), _batch([9], step=7, seed=5)
    c = _batch([3, 4], step=8)
    na, nb, nc = (x.features[NEGATIVE_KEY].values() for x in (a, b, c))
    assert torch.equal(na, nb) and not torch.equal(na, nc)
    assert a.features[NEGATIVE_KEY].lengths().tolist() == [6, 0]


def test_config_and_length_errors():
    with pytest.raises(ConfigError, match="divisible"):
        Config(num_items=10, embedding_dim=10, num_heads=3)
    m = SequentialRecommender(Config(num_items=40, embedding_dim=8, num_layers=1, num_negatives=6, max_seq_len=8))
    with pytest.raises(ConfigError, match="max_seq_len is 8"):
        m(_batch([9]))
