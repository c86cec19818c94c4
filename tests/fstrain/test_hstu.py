"""The HSTU layer: the bucketed jagged block equals a naive per-sample reference (forward and
gradients), a sample's output ignores its batch mates, attention is causal, and the ``hstu`` cost
model counts the layer's matmul FLOPs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fsdata.balancer.cost import load_cost_model
from fstrain.errors import ConfigError
from fstrain.models.hstu import HSTUBlock, hstu_reference
from fstrain.models import length_buckets

D, H, DQK, DV, N = 8, 2, 4, 3, 40


def _block(reference=False, seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(embedding_dim=D, num_heads=H, attention_dim=DQK, linear_dim=DV, max_seq_len=N)
    blk = HSTUBlock(**{**args, **kw}, reference=reference)
    with torch.no_grad():  # non-zero bias and a visible position bias
        blk.out.bias.normal_()
        blk.rab.weight.normal_()
    return blk


def _jagged(lengths, seed=0):
    """Length-sorted jagged input: values ``[T x d]`` float32 and Block's other arguments."""
    lengths = sorted(lengths)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), D, generator=g)
    offsets_list = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return x, (torch.tensor(offsets_list), offsets_list, length_buckets(lengths), lengths)


def _run(block, x, args):
    return block(x, *args)


MIXES = [[1], [1, 1, 1], [5, 5, 5, 5], [1, 2, 3, 9, 10, 30], [1, 7, 12, 13, 25, 31]]


@pytest.mark.parametrize("lengths", MIXES)
def test_bucketed_block_equals_naive_reference_forward_and_gradients(lengths):
    blk = _block()
    x, args = _jagged(lengths)
    x.requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = _run(blk, x, args)
    y_ref = torch.cat(hstu_reference(blk, list(torch.split(x_ref, args[3]))))
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    (gx, *gp) = torch.autograd.grad((y * g).sum(), [x, *blk.parameters()])
    (gx_ref, *gp_ref) = torch.autograd.grad((y_ref * g).sum(), [x_ref, *blk.parameters()])
    torch.testing.assert_close(gx, gx_ref)
    for (name, _), a, b in zip(blk.named_parameters(), gp, gp_ref):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    # reference=True (one sample at a time through the block's own attention) agrees as well
    ref_blk = _block(reference=True)
    ref_blk.load_state_dict(blk.state_dict())
    torch.testing.assert_close(_run(ref_blk, x, args), y)


def test_mixes_cover_several_buckets():
    assert len(length_buckets(sorted(MIXES[3]))) >= 3 and len(length_buckets(sorted(MIXES[4]))) >= 2


def test_sample_output_does_not_depend_on_batch_mates():
    blk = _block()
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(9, D, generator=g)
    alone_x, alone_args = _jagged([9])
    alone = _run(blk, sample, alone_args)
    for mates in ([7], [8, 10], [1, 2, 30, 31], [9, 9, 9]):
        lengths = sorted(mates + [9])
        x, args = _jagged(lengths, seed=2)
        i = lengths.index(9)  # put the sample in the first slot of length 9
        a = args[1][i]
        x = torch.cat([x[:a], sample, x[a + 9:]])
        y = _run(blk, x, args)
        torch.testing.assert_close(y[a:a + 9], alone, rtol=1e-6, atol=1e-6)


def test_causal_later_items_do_not_change_earlier_outputs():
    blk = _block()
    x, args = _jagged([3, 12, 20])
    y = _run(blk, x, args)
    a, t = args[1][1], 5  # sample 1 (length 12), change its item 5
    x2 = x.clone()
    x2[a + t] += torch.randn(D, generator=torch.Generator().manual_seed(3))  # not constant: layer norm
    y2 = _run(blk, x2, args)
    torch.testing.assert_close(y2[:a + t], y[:a + t], rtol=0, atol=0)  # earlier samples too
    assert (y2[a + t:a + 12] - y[a + t:a + 12]).abs().amax(-1).min() > 1e-6  # every later position
    torch.testing.assert_close(y2[a + 12:], y[a + 12:], rtol=0, atol=0)  # other samples


def test_parameter_names_and_count():
    blk = HSTUBlock(embedding_dim=50, num_heads=2, attention_dim=25, linear_dim=25, max_seq_len=200)
    shapes = {k: tuple(p.shape) for k, p in blk.named_parameters()}
    assert shapes == {"uvqk.weight": (2 * 2 * (25 + 25), 50), "out.weight": (50, 50), "out.bias": (50,),
                      "rab.weight": (200,)}
    assert sum(p.numel() for p in blk.parameters()) == 50 * 200 + 50 * 50 + 50 + 200


def test_too_long_and_bad_sizes_raise():
    blk = _block(max_seq_len=4)
    x, args = _jagged([2, 5])
    with pytest.raises(ConfigError, match="max_seq_len is 4"):
        _run(blk, x, args)
    with pytest.raises(ConfigError):
        HSTUBlock(embedding_dim=8, num_heads=0, attention_dim=4, linear_dim=4, max_seq_len=8)
    with pytest.raises(ConfigError):
        HSTUBlock(embedding_dim=8, num_heads=1, attention_dim=4, linear_dim=4, max_seq_len=8, dropout=1.0)


@pytest.mark.parametrize("L", [2, 7, 33])  # at L=1 einsum contracts by multiply, not counted
def test_hstu_cost_model_counts_the_layer_matmul_flops(L):
    """One sample, no padding: counted matmul FLOPs equal ``hstu`` with ``causal=0`` (the block
    computes the full ``L x L`` score matrix and masks it); ``causal=1`` counts half of it."""
    d, h, dh = 16, 2, 8
    blk = HSTUBlock(embedding_dim=d, num_heads=h, attention_dim=dh, linear_dim=dh, max_seq_len=64, reference=True)
    x = torch.randn(L, d)
    with FlopCounterMode(display=False) as counter:
        blk(x, torch.tensor([0, L]), [0, L], [(0, 1, L)], [L])
    spec = f"hstu:d_model={d},num_heads={h},head_dim={dh},num_layers=1"
    c0, c1, c2 = load_cost_model(spec + ",causal=0").coefficients
    assert counter.get_total_flops() == c0 + c1 * L + c2 * L * L
    assert load_cost_model(spec + ",causal=1").coefficients == (c0, c1, c2 / 2)
