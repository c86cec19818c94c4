"""The HSTU layer on jagged, length-sorted sequences: a drop-in for :class:`fstrain.models.sasrec.Block`.

HSTU (Hierarchical Sequential Transduction Unit) is the layer of Zhai et al., ICML 2024,
"Actions Speak Louder than Words: Trillion-Parameter Sequential Transducers for Generative
Recommendations" (https://arxiv.org/abs/2402.17152), eqs. (1)-(3). This module follows the public
reference ``generative_recommenders/research/modeling/sequential/hstu.py`` of
meta-recsys/generative-recommenders (GR below): ``SequentialTransductionUnitJagged`` with
``linear_config="uvqk"``, ``linear_activation="silu"``, ``normalization="rel_bias"`` and the
position part of ``RelativeBucketedTimeAndPositionBasedBias`` (our samples carry no timestamps).
Per layer, on a sequence ``x`` ``[L x d]``::

    U, V, Q, K = split(silu(layer_norm(x) @ W_uvqk))           # no bias, as GR
    A[h] = silu(Q[h] K[h]^T + rab) / N  masked causally          # pointwise, no softmax
    y = x + W_o(dropout(layer_norm(concat_h A[h] V[h]) * U)) + b_o

Both layer norms have no learned scale or shift (``eps`` 1e-6), as GR's ``F.layer_norm`` calls.
Dropout sits on the gated output before the output linear, where GR applies it.

Normalisation ``N``: GR pads every batch to its fixed maximum sequence length ``n`` and divides the
pointwise scores by that ``n`` (``F.silu(qk_attn) / n`` in ``_hstu_attention_maybe_from_cache``).
We divide by the block's ``max_seq_len``, the same arithmetic, and never by a batch's or a length
bucket's padded length: a sample's output then does not depend on which samples share its batch or
bucket, which the balancer needs (it moves samples between ranks inside a step).

Relative position bias ``rab[i, j] = w[i - j]`` for ``j <= i``: GR stores ``2 * max_seq_len - 1``
weights indexed by ``j - i``; under the causal mask only ``i - j`` in ``[0, max_seq_len)`` is ever
used, so we store exactly those ``max_seq_len`` weights (GR's init: normal, std 0.02).

Notation: ``T`` tokens (sum of lengths), ``d`` embedding dim, ``H`` heads, ``dqk`` attention dim
and ``dv`` linear dim per head, ``Lb`` a length bucket's padded length, ``N`` ``max_seq_len``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fstrain.models.dropout import KeyedDropout
from fstrain.errors import ConfigError
from fstrain.models.config import MODELS
from fstrain.models.jagged import per_bucket

LAYER_NORM_EPS = 1e-6


class RelativePositionBias(nn.Module):
    """Learned causal relative position bias ``rab[i, j] = weight[i - j]`` (GR's position part).

    Args:
        max_seq_len: N, the longest sequence; ``weight`` is ``[N]`` float32.
    """

    def __init__(self, max_seq_len: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_seq_len).normal_(mean=0.0, std=0.02))

    def forward(self, length: int) -> torch.Tensor:
        """``[length x length]`` bias; entries above the diagonal (masked later) repeat ``weight[0]``.

        Args:
            length: L <= N.
        """
        pos = torch.arange(length, device=self.weight.device)
        return self.weight[(pos[:, None] - pos[None, :]).clamp(min=0)]


@MODELS.register("hstu")
class HSTUBlock(nn.Module):
    """One HSTU layer on jagged values ``[T x d]`` -> ``[T x d]`` (see the module docstring).

    Args:
        embedding_dim: d, the model width.
        num_heads: H.
        attention_dim: dqk, query/key width per head.
        linear_dim: dv, value/gate width per head.
        max_seq_len: N, the longest history; also the attention normaliser.
        dropout: probability on the gated output before the output linear (GR's
            ``linear_dropout_rate``; its ML-1M recipe uses 0.2).
        reference: run attention one sample at a time without padding (for tests), instead of
            per length bucket through fbgemm jagged<->padded ops.

    Parameters: ``uvqk.weight`` ``[2H(dv+dqk) x d]``, ``out.weight`` ``[d x H*dv]``, ``out.bias``
    ``[d]``, ``rab.weight`` ``[N]``.

    Raises:
        ConfigError: a size is < 1 or ``dropout`` is outside ``[0, 1)``.
    """

    #: no LayerNorm after the last layer (each layer normalises its input)
    final_norm = False
    #: reads the shards' action column (``action``, else the first integer-list feature column) unless
    #: ``--action-column none``
    actions_by_default = True

    @classmethod
    def from_config(cls, config) -> HSTUBlock:
        """One layer of ``config``'s (a :class:`fstrain.models.config.Config`) model."""
        dqk, dv = config.head_dims
        return cls(embedding_dim=config.embedding_dim, num_heads=config.num_heads, attention_dim=dqk,
                   linear_dim=dv, max_seq_len=config.max_seq_len, dropout=config.dropout,
                   reference=config.attention == "reference")

    @classmethod
    def check_config(cls, config) -> None:
        """HSTU's sizes are checked when a layer is built (any ``num_heads`` divides its head widths)."""

    def __init__(self, *, embedding_dim: int, num_heads: int, attention_dim: int, linear_dim: int,
                 max_seq_len: int, dropout: float = 0.0, reference: bool = False) -> None:
        super().__init__()
        if min(embedding_dim, num_heads, attention_dim, linear_dim, max_seq_len) < 1:
            raise ConfigError(f"HSTU sizes must be >= 1: embedding_dim {embedding_dim}, num_heads {num_heads}, "
                              f"attention_dim {attention_dim}, linear_dim {linear_dim}, max_seq_len {max_seq_len}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"HSTU dropout must be in [0, 1), got {dropout}")
        self.embedding_dim = embedding_dim
        self.num_heads = num_heads
        self.attention_dim = attention_dim
        self.linear_dim = linear_dim
        self.max_seq_len = max_seq_len
        self.dropout = dropout
        self.reference = reference
        H = num_heads
        self.uvqk = nn.Linear(embedding_dim, 2 * H * (linear_dim + attention_dim), bias=False)
        nn.init.normal_(self.uvqk.weight, mean=0.0, std=0.02)
        self.out = nn.Linear(H * linear_dim, embedding_dim)
        nn.init.xavier_uniform_(self.out.weight)
        self.rab = RelativePositionBias(max_seq_len)
        self.drop = KeyedDropout(dropout, site=0)  # site set per layer by the tower

    def split_uvqk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``U, V, Q, K`` of ``x`` ``[T x d]``: ``[T x H*dv]`` twice, then ``[T x H*dqk]`` twice."""
        h = F.silu(self.uvqk(F.layer_norm(x, (self.embedding_dim,), eps=LAYER_NORM_EPS)))
        Hv, Hk = self.num_heads * self.linear_dim, self.num_heads * self.attention_dim
        return torch.split(h, [Hv, Hv, Hk, Hk], dim=-1)

    def _attention(self, qkv: torch.Tensor) -> torch.Tensor:
        # qkv: [n x L x H(2dqk+dv)] (q, k, v concatenated, left-aligned, zero padded) -> [n x L x H*dv]
        n, L, _ = qkv.shape
        H, dk, dv = self.num_heads, self.attention_dim, self.linear_dim
        q, k, v = torch.split(qkv, [H * dk, H * dk, H * dv], dim=-1)
        scores = torch.einsum("bihd,bjhd->bhij", q.reshape(n, L, H, dk), k.reshape(n, L, H, dk))
        scores = F.silu(scores + self.rab(L)) / self.max_seq_len
        # Causal mask; with left-aligned padding it also hides every padded key from real queries.
        causal = torch.ones(L, L, dtype=torch.bool, device=qkv.device).tril()
        scores = torch.where(causal, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
        return torch.einsum("bhij,bjhd->bihd", scores, v.reshape(n, L, H, dv)).reshape(n, L, H * dv)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, offsets_list: list[int],
                buckets: list[tuple[int, int, int]], lengths_list: list[int]) -> torch.Tensor:
        """The layer on every sequence (arguments as :meth:`fstrain.models.sasrec.Block.forward`).

        Args:
            x: ``[T x d]`` float, jagged values of length-sorted sequences.
            offsets: ``[B+1]`` int64 on ``x``'s device.
            offsets_list: the same offsets as python ints.
            buckets: ``(first sample, end sample, Lb)`` from :func:`fstrain.models.sasrec.length_buckets`.
            lengths_list: ascending lengths as python ints.

        Returns:
            ``[T x d]``, same dtype as ``x``.

        Raises:
            ConfigError: a sequence is longer than ``max_seq_len``.
        """
        if lengths_list and lengths_list[-1] > self.max_seq_len:
            raise ConfigError(f"a history has {lengths_list[-1]} items but the HSTU block's max_seq_len is "
                              f"{self.max_seq_len}; raise --max-seq-len or cap lengths in fsdata convert")
        u, v, q, k = self.split_uvqk(x)
        qkv = torch.cat([q, k, v], dim=-1)
        attn = per_bucket(self._attention, qkv, offsets, offsets_list, buckets, lengths_list, reference=self.reference)
        gated = F.layer_norm(attn, (attn.shape[-1],), eps=LAYER_NORM_EPS) * u
        return x + self.out(self.drop(gated))


def hstu_reference(block: HSTUBlock, x_list: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layer computed naively, one sample, head and query position at a time (for tests).

    Uses ``block``'s parameters but none of its methods or fbgemm: per query position ``i``,
    ``a_i = sum_{j <= i} silu(q_i . k_j + w[i - j]) / N * v_j`` over the unpadded sequence.

    Args:
        block: the :class:`HSTUBlock` whose parameters to use (its dropout is not applied).
        x_list: per sample ``[L_i x d]`` float, ``1 <= L_i <= max_seq_len``.

    Returns:
        per sample ``[L_i x d]``.
    """
    H, dk, dv, N = block.num_heads, block.attention_dim, block.linear_dim, block.max_seq_len
    w = block.rab.weight
    outs = []
    for x in x_list:
        L, d = x.shape
        mu = x.mean(-1, keepdim=True)
        normed = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + LAYER_NORM_EPS)
        h = F.silu(normed @ block.uvqk.weight.T)
        Hv, Hk = H * dv, H * dk
        u, v, q, k = h[:, :Hv], h[:, Hv:2 * Hv], h[:, 2 * Hv:2 * Hv + Hk], h[:, 2 * Hv + Hk:]
        rows = []
        for i in range(L):
            heads = []
            for hd in range(H):
                qi = q[i, hd * dk:(hd + 1) * dk]
                acc = torch.zeros(dv, dtype=x.dtype)
                for j in range(i + 1):
                    s = torch.dot(qi, k[j, hd * dk:(hd + 1) * dk]) + w[i - j]
                    acc = acc + F.silu(s) / N * v[j, hd * dv:(hd + 1) * dv]
                heads.append(acc)
            rows.append(torch.cat(heads))
        a = torch.stack(rows)
        mu = a.mean(-1, keepdim=True)
        a = (a - mu) / torch.sqrt(((a - mu) ** 2).mean(-1, keepdim=True) + LAYER_NORM_EPS)
        outs.append(x + (a * u) @ block.out.weight.T + block.out.bias)
    return outs
