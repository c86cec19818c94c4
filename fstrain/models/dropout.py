"""Dropout whose mask depends on the sample, not on the rank that holds it.

Balancing moves a step's samples between ranks. With ``torch.nn.Dropout`` every rank draws its
masks from its own generator, so the same sample gets another mask on another rank and one rank
training on the global batch (``fstrain train --simulate-ranks``) no longer equals R ranks. Here
each element's keep/drop decision is a hash of ``(seed, step, sample_id, position in the history,
dropout site, feature index)``: the same on any rank, in any batch order, on any device.

The hash is SplitMix64's finalizer (Steele, Lea & Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) in wrapping int64 arithmetic; the top 24 bits give a uniform in
``[0, 1)``. Elements are kept when ``u >= p`` and scaled by ``1 / (1 - p)``, as ``nn.Dropout``.

On CPU the keep mask is one pass of a Numba kernel (:func:`_keep_mask`: the same bits as the
tensor expression, tested; about 18% of a ml-1m SASRec step went to that expression's
temporaries); on other devices, the tensor expression.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit
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


@njit(cache=True)
def _keep_mask(keys, width, col0, golden, m1, m2, threshold):  # pragma: no cover - compiled
    """``keep[t, c] = (mix64(keys[t] + c * golden + col0) >> 40) >= threshold``, uint64 wrapping
    arithmetic (the bits of :func:`mix64` on int64); shape ``[T x width]`` bool."""
    out = np.empty((keys.shape[0], width), dtype=np.bool_)
    s30, s27, s31, s40 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
    for t in range(keys.shape[0]):
        k = keys[t]
        for c in range(width):
            x = k + np.uint64(c) * golden + col0
            x = (x ^ (x >> s30)) * m1
            x = (x ^ (x >> s27)) * m2
            x = x ^ (x >> s31)
            out[t, c] = (x >> s40) >= threshold
    return out


def keep_mask(keys: torch.Tensor, width: int, site: int, p: float) -> torch.Tensor:
    """The keep decisions of :class:`KeyedDropout` for token rows of ``width`` features.

    Args:
        keys: ``[T]`` int64 token keys (:func:`token_keys`).
        width: w, the features per token.
        site: the dropout site.
        p: the drop probability.

    Returns:
        ``[T x w]`` bool, on ``keys``' device: the element is kept when its uniform
        ``u = (mix64(key + c * golden + site * M1) >> 40) / 2**24`` is ``>= p`` (compared in
        float32, as the tensor expression does).
    """
    if keys.device.type == "cpu":
        u64 = keys.contiguous().numpy().view(np.uint64)
        # u >= float32(p), u = h / 2**24 with h an integer < 2**24: h >= float32(p) * 2**24 (exact)
        threshold = float(np.float32(p)) * float(1 << 24)
        return torch.from_numpy(_keep_mask(u64, int(width), np.uint64(_i64(site * _M1) & ((1 << 64) - 1)),
                                           np.uint64(_GOLDEN & ((1 << 64) - 1)), np.uint64(_M1 & ((1 << 64) - 1)),
                                           np.uint64(_M2 & ((1 << 64) - 1)), threshold))
    cols = torch.arange(width, device=keys.device, dtype=torch.int64) * _GOLDEN + _i64(site * _M1)
    u = _shr(mix64(keys[:, None] + cols[None, :]), 40).to(torch.float32) * (1.0 / (1 << 24))
    return u >= p


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
        keep = keep_mask(keys.to(x.device), x.shape[1], self.site, self.p)
        return x * (keep.to(x.dtype) / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
