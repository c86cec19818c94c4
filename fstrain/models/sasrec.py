"""SASRec's transformer block on jagged, length-sorted histories (Kang & McAuley, ICDM 2018).

Attention pads only inside power-of-two-like length buckets (:func:`length_buckets`), like block
padding in real jagged kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fstrain.models.dropout import KeyedDropout
from fstrain.models.jagged import per_bucket
from fstrain.errors import ConfigError
from fstrain.models.config import MODELS, Config

def length_buckets(lengths: list[int], ratio: float = 1.25) -> list[tuple[int, int, int]]:
    """Contiguous buckets of length-sorted samples, each within a factor ``ratio`` of its shortest.

    Args:
        lengths: ascending history lengths (python ints).
        ratio: a bucket starting at length ``a`` takes lengths up to ``max(a * ratio, a + 8)``
            (short sequences share a bucket: a kernel call costs more than their padding).

    Returns:
        ``(first sample, end sample, padded length Lb)`` per bucket; ``Lb`` is the bucket's max.
    """
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] > max(lengths[start] * ratio, lengths[start] + 8):
            out.append((start, i, lengths[i - 1]))
            start = i
    return out


class JaggedCausalAttention(nn.Module):
    """Multi-head causal self-attention on jagged, length-sorted sequences."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        d = config.embedding_dim
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has zero gradient (softmax shift)
        self.out = nn.Linear(d, d)
        self.dropout = config.dropout
        self.reference = config.attention == "reference"

    def _sdpa(self, qkv: torch.Tensor) -> torch.Tensor:
        # qkv: [n x Lb x 3d] -> [n x Lb x d]
        n, L, three_d = qkv.shape
        H = self.num_heads
        q, k, v = qkv.view(n, L, 3, H, three_d // (3 * H)).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=0.0)
        return o.transpose(1, 2).reshape(n, L, three_d // 3)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, offsets_list: list[int],
                buckets: list[tuple[int, int, int]], lengths_list: list[int]) -> torch.Tensor:
        """Causal attention of every sequence over itself.

        Args:
            x: ``[T x d]`` float, jagged values of length-sorted sequences.
            offsets: ``[B+1]`` int64 on ``x``'s device.
            offsets_list: the same offsets as python ints (slicing without device syncs).
            buckets: from :func:`length_buckets`.
            lengths_list: sorted lengths as python ints.

        Returns:
            ``[T x d]``.
        """
        return self.out(per_bucket(self._sdpa, self.qkv(x), offsets, offsets_list, buckets, lengths_list,
                                   reference=self.reference))


@MODELS.register("sasrec")
class Block(nn.Module):
    """SASRec block: pre-LayerNorm causal attention and feed-forward, dropout on both outputs."""

    #: a LayerNorm after the last block (pre-LayerNorm blocks leave the output unnormalised)
    final_norm = True
    #: reads the shards' action column only when ``--action-column`` names it
    actions_by_default = False

    @classmethod
    def from_config(cls, config: Config) -> Block:
        """One block of ``config``'s model."""
        return cls(config)

    @classmethod
    def check_config(cls, config: Config) -> None:
        """Raises ConfigError: ``embedding_dim`` not divisible by ``num_heads``."""
        if config.embedding_dim % config.num_heads:
            raise ConfigError(f"embedding_dim {config.embedding_dim} is not divisible by num_heads {config.num_heads}")

    def __init__(self, config: Config) -> None:
        super().__init__()
        d = config.embedding_dim
        self.ln1 = nn.LayerNorm(d)
        self.attn = JaggedCausalAttention(config)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, config.ffn_multiplier * d), nn.GELU(),
                                 nn.Linear(config.ffn_multiplier * d, d))
        self.drop_attn = KeyedDropout(config.dropout, site=0)  # sites set per layer by the tower
        self.drop_ffn = KeyedDropout(config.dropout, site=0)

    def forward(self, x, offsets, offsets_list, buckets, lengths_list):
        """``x`` ``[T x d]`` -> ``[T x d]`` (arguments as :meth:`JaggedCausalAttention.forward`)."""
        x = x + self.drop_attn(self.attn(self.ln1(x), offsets, offsets_list, buckets, lengths_list))
        return x + self.drop_ffn(self.ffn(self.ln2(x)))


