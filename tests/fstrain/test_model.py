"""The model: fast (fbgemm jagged, bucketed) attention equals the per-sample reference; the loss
normalisation makes gradients independent of how a step's samples are split over ranks; the
all-positions loss equals a hand computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fstrain.data import make_batch
from fstrain.errors import ConfigError
from fstrain.models import (MODELS, NEGATIVE_KEY, OBJECTIVES, Config, SequentialRecommender, attach_negatives,
                            length_buckets, with_negatives)


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


@pytest.mark.parametrize("model", MODELS.names())
@pytest.mark.parametrize("ratio", [1.0, 1.25, 4.0])
def test_bucketed_attention_equals_reference(ratio, model):
    lengths = [5, 1, 17, 3, 33, 16, 2, 40]
    out = []
    for attention in ("bucketed", "reference"):
        torch.manual_seed(0)
        m = SequentialRecommender(Config(num_items=40, embedding_dim=16, num_heads=2, num_layers=2, model=model,
                                         num_negatives=6, max_seq_len=64, attention=attention, bucket_ratio=ratio,
                                         dropout=0.0))
        out.append(_grads(m, _batch(lengths)))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=1e-5)
    for k in out[0][1]:
        torch.testing.assert_close(out[0][1][k], out[1][1][k], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("negatives", ["step", "sample"])
@pytest.mark.parametrize("model", MODELS.names())
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_split_batches_sum_to_whole_batch_gradients(objective, model, negatives):
    """Two 'ranks' holding any split of a step's samples give the gradients of the whole step."""
    torch.manual_seed(0)
    cfg = Config(num_items=40, embedding_dim=16, num_layers=1, num_negatives=6, dropout=0.3, objective=objective,
                 model=model, negatives=negatives)  # dropout and per-sample negatives keyed by sample: still exact
    m = SequentialRecommender(cfg)
    lengths = [4, 9, 1, 12, 7, 3]
    rng = np.random.default_rng(0)
    L = np.array(lengths)
    vals, tg = rng.integers(0, 40, L.sum()), rng.integers(0, 40, len(L))
    off = np.concatenate([[0], np.cumsum(L)])

    def sub(idx):
        v = np.concatenate([vals[off[i]:off[i + 1]] for i in idx])
        return attach_negatives(make_batch(v, L[idx], tg[idx], np.array(idx), 3, len(L), int(L.sum())), cfg, seed=1)

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
        Config(num_items=10, embedding_dim=12, num_heads=5)
    with pytest.raises(ConfigError, match="multiple of 4.*use 52"):
        Config(num_items=10, embedding_dim=50, num_heads=1)
    for bad in ({"model": "gru"}, {"objective": "pairwise"}, {"num_negatives": -1}, {"dropout": 1.0},
                {"temperature": 0.0}):
        with pytest.raises(ConfigError):
            Config(num_items=10, embedding_dim=8, **bad)
    m = SequentialRecommender(Config(num_items=40, embedding_dim=8, num_layers=1, num_negatives=6, max_seq_len=8))
    with pytest.raises(ConfigError, match="max_seq_len is 8"):
        m(_batch([9]))


@pytest.mark.parametrize("l2_normalize,temperature", [(True, 0.05), (False, 1.0)])
def test_all_positions_loss_equals_hand_computation(l2_normalize, temperature):
    """Two short sequences: every history position predicts the next item, the last one the target,
    against the step's shared negatives (accidental hits masked); sum / global positions."""
    torch.manual_seed(0)
    cfg = Config(num_items=12, embedding_dim=8, num_heads=2, num_layers=1, num_negatives=4, dropout=0.0,
                 temperature=temperature, l2_normalize=l2_normalize)
    m = SequentialRecommender(cfg)
    hist, lengths, targets = np.array([3, 5, 7, 2, 9]), np.array([3, 2]), np.array([4, 5])
    b = with_negatives(make_batch(hist, lengths, targets, np.arange(2), 0, 2, 11), 12, 4, seed=3)
    loss, (loss_sum, n) = m(b)
    table = dict(m.ec.named_parameters())["embeddings.item_table.weight"].detach()
    neg_ids = b.features[NEGATIVE_KEY].values()
    expected = 0.0
    for seq, tgt in (([3, 5, 7], 4), ([2, 9], 5)):
        out = m.dense.encode_tokens(  # the encoder is tested against its reference above; here: the loss
            table[torch.tensor(seq)], m.dense.layout(torch.tensor([len(seq)]), torch.device("cpu")))
        labels = seq[1:] + [tgt]
        for i, lab in enumerate(labels):
            u, pos, negs = out[i], table[lab], table[neg_ids]
            if l2_normalize:
                u, pos, negs = F.normalize(u, dim=-1), F.normalize(pos, dim=-1), F.normalize(negs, dim=-1)
            logits = [float(u @ pos) / temperature] + [float(u @ negs[k]) / temperature
                                                       for k in range(len(neg_ids)) if int(neg_ids[k]) != lab]
            expected += float(torch.logsumexp(torch.tensor(logits), 0)) - logits[0]
    assert int(n) == 5
    assert float(loss_sum) == pytest.approx(expected, rel=1e-5)
    assert float(loss) == pytest.approx(expected / 11, rel=1e-5)  # the step's global positions, not this batch's


def test_last_position_objective_supervises_only_the_target():
    torch.manual_seed(0)
    m = SequentialRecommender(Config(num_items=12, embedding_dim=8, num_layers=1, num_negatives=4, dropout=0.0,
                                     objective="last-position"))
    b = with_negatives(make_batch(np.array([3, 5, 7, 2, 9]), np.array([3, 2]), np.array([4, 5]), np.arange(2), 0, 2),
                       12, 4, seed=3)
    loss, (loss_sum, n) = m(b)
    assert int(n) == 2 and float(loss) == pytest.approx(float(loss_sum) / 2)


def test_full_softmax_uses_every_item():
    b = with_negatives(make_batch(np.array([3, 5]), np.array([2]), np.array([4]), np.arange(1), 0, 1), 12, 0, seed=3)
    assert b.features[NEGATIVE_KEY].values().tolist() == list(range(12))
    torch.manual_seed(0)
    m = SequentialRecommender(Config(num_items=12, embedding_dim=8, num_layers=1, num_negatives=0, dropout=0.0))
    loss, (loss_sum, n) = m(b)
    # full softmax: positives are masked among the catalogue and counted once, so loss >= 0 and finite
    assert torch.isfinite(loss) and float(loss_sum) > 0 and int(n) == 2


def test_keyed_dropout_masks_depend_on_sample_not_on_batch():
    from fstrain.models.dropout import KeyedDropout, DropoutKeys, token_keys

    d = KeyedDropout(0.5, site=3)
    d.source = DropoutKeys()
    x = torch.ones(6, 64)
    d.source.keys = token_keys(7, 11, torch.tensor([5, 5, 5, 9, 9, 2]), torch.tensor([0, 1, 2, 0, 1, 0]))
    full = d(x)
    d.source.keys = token_keys(7, 11, torch.tensor([9, 9]), torch.tensor([0, 1]))
    torch.testing.assert_close(d(x[:2]), full[3:5])  # sample 9 alone: the same masks
    kept = (full > 0).float().mean().item()
    assert 0.4 < kept < 0.6 and set(full.unique().tolist()) <= {0.0, 2.0}
    d.source.keys = token_keys(7, 12, torch.tensor([5, 5, 5, 9, 9, 2]), torch.tensor([0, 1, 2, 0, 1, 0]))
    assert not torch.equal(d(x), full)  # another step: other masks
    d.eval()
    assert torch.equal(d(x), x)


def test_per_sample_negatives_depend_on_sample_and_step_only():
    cfg = Config(num_items=50, embedding_dim=8, num_negatives=5, negatives="sample")
    whole = attach_negatives(make_batch(np.array([1, 2, 3]), np.array([2, 1]), np.array([4, 5]), np.array([10, 11]),
                                        7, 3), cfg, seed=2)
    alone = attach_negatives(make_batch(np.array([3]), np.array([1]), np.array([5]), np.array([11]), 7, 3), cfg, seed=2)
    neg = whole.features[NEGATIVE_KEY]
    assert neg.lengths().tolist() == [5, 5]
    assert torch.equal(neg.values()[5:], alone.features[NEGATIVE_KEY].values())
    assert not torch.equal(neg.values()[:5], neg.values()[5:])
    assert int(neg.values().min()) >= 0 and int(neg.values().max()) < 50


def test_per_sample_negative_logits_jagged_equal_the_gather():
    """The padded batched matmul gives every token the logits of the plain per-token gather."""
    from fstrain.models import DenseTower

    torch.manual_seed(0)
    tower = DenseTower(Config(num_items=40, embedding_dim=8, num_layers=1, negatives="sample", num_negatives=5))
    lengths = torch.tensor([3, 1, 7, 2])
    lay = tower.layout(lengths, torch.device("cpu"))
    user = torch.randn(int(lengths.sum()), 8, requires_grad=True)
    neg = torch.randn(4, 5, 8, requires_grad=True)
    owner = torch.repeat_interleave(lay.perm, torch.tensor(lay.lengths_list))
    fast = DenseTower._per_sample_logits_jagged(user, neg, lay)
    ref = DenseTower._per_sample_logits(user, neg, owner)
    torch.testing.assert_close(fast, ref)
    g_fast = torch.autograd.grad(fast.square().sum(), (user, neg))
    g_ref = torch.autograd.grad(ref.square().sum(), (user, neg))
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("p", [0.2, 0.5, 0.1, 1e-7, 0.9999])
def test_keyed_dropout_cpu_kernel_has_the_bits_of_the_tensor_expression(p):
    """The Numba keep mask used on CPU equals the int64 tensor expression (used on other devices)
    bit for bit, for several sites, widths and drop probabilities."""
    from fstrain.models import dropout as D

    g = torch.Generator().manual_seed(0)
    keys = D.token_keys(7, 11, torch.randint(0, 10**6, (2000,), generator=g),
                        torch.randint(0, 200, (2000,), generator=g))
    for site, width in [(0, 52), (3, 64), (123456, 7)]:
        cols = torch.arange(width, dtype=torch.int64) * D._GOLDEN + D._i64(site * D._M1)
        u = D._shr(D.mix64(keys[:, None] + cols[None, :]), 40).to(torch.float32) * (1.0 / (1 << 24))
        want = u >= p
        got = D.keep_mask(keys, width, site, p)
        assert got.dtype == torch.bool and got.shape == (2000, width)
        assert torch.equal(got, want)
        assert abs(want.float().mean().item() - (1 - p)) < 0.01


def test_a_model_family_is_one_registered_block_class():
    """``--model`` names, their checks and the block the tower builds come from the MODELS registry:
    a family registered there is a choice, is checked by its own rule and is what the tower stacks."""
    from fstrain.models.hstu import HSTUBlock
    from fstrain.models.sasrec import Block

    assert MODELS.names() == ("sasrec", "hstu") and MODELS.get("sasrec") is Block and MODELS.get("hstu") is HSTUBlock
    with pytest.raises(ConfigError, match="not divisible by num_heads 3"):
        Config(embedding_dim=64, num_heads=3)
    Config(model="hstu", embedding_dim=64, num_heads=3)  # HSTU's head widths need no divisibility

    @MODELS.register("tiny-test")
    class Tiny(Block):
        """A test family: SASRec's block without the final LayerNorm."""

        final_norm = False

    try:
        assert "tiny-test" in list(MODELS)
        m = SequentialRecommender(Config(num_items=40, embedding_dim=16, num_heads=2, num_layers=2, model="tiny-test",
                                         num_negatives=6, max_seq_len=64))
        assert all(type(b) is Tiny for b in m.dense.blocks) and isinstance(m.dense.ln_final, torch.nn.Identity)
    finally:
        MODELS.unregister("tiny-test")
    with pytest.raises(ConfigError, match="unknown model 'tiny-test'; use one of sasrec, hstu"):
        Config(model="tiny-test")
