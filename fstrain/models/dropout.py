"""Dropout whose mask depends on the sample, not on the rank that holds it.

Balancing moves a step's samples between ranks. With ``torch.nn.Dropout`` every rank draws its
masks from its own generator, so the same sample gets another mask on another rank and one rank
training on the global batch (``fstrain train --simulate-ranks``) no longer equals R ranks. Here
each element's keep/drop decision is a hash of ``(seed, step, sample_id, position in the history,
dropout site, feature index)``: the same on any rank, in any batch order, on any device.

The hash is SplitMix64's finalizer (Steele, Lea & Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) in wrapping int64 arithmetic; the top 24 bits give a uniform in
``[0, 1)``. Elements are kept when ``u >= p`` and scaled by ``1 / (1 - p)``, as ``nn.Dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def _i64(v: int) -> int:
    """A Python int wrapped to int64's range (two's complement)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer of int64 ``x`` (any shape), wrapping arithmetic."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def token_keys(seed: int, step: int, sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-token dropout keys.

    Args:
        seed: the run seed.
        step: the global step.
        sample_ids: ``[T]`` int64, the sample of each token.
        positions: ``[T]`` int64, each token's position in its history.

    Returns:
        ``[T]`` int64 keys.
    """
    base = mix64(torch.tensor(_i64(seed * 1_000_003 + step), dtype=torch.int64) * _GOLDEN)
    return mix64(mix64(sample_ids.to(torch.int64) * _GOLDEN + base) + positions.to(torch.int64) * _GOLDEN)


class DropoutKeys:
    """The current forward's token keys, shared by a tower and its :class:`KeyedDropout` modules.

    Attributes:
        keys: ``[T]`` int64 (:func:`token_keys`), rows in the order the blocks see the tokens; None:
            no keys this forward (plain ``F.dropout`` then).
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None


class KeyedDropout(nn.Module):
    """Dropout on ``[T x w]`` token rows with masks from :attr:`DropoutKeys.keys` (module docstring).

    Args:
        p: drop probability.
        site: distinct per dropout location in the model (mixed into the hash).
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        self.p = float(p)
        self.site = int(site)
        self.source: DropoutKeys | None = None  # set by the owning tower

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T x w]`` float -> same shape."""
        if not self.training or self.p == 0.0:
            return x
        keys = self.source.keys if self.source is not None else None
        if keys is None or keys.shape[0] != x.shape[0]:
            return F.dropout(x, self.p, True)
        cols = torch.arange(x.shape[1], device=x.device, dtype=torch.int64) * _GOLDEN + _i64(self.site * _M1)
        u = _shr(mix64(keys.to(x.device)[:, None] + cols[None, :]), 40).to(torch.float32) * (1.0 / (1 << 24))
        return x * ((u >= self.p).to(x.dtype) / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
