"""Running a per-sequence op on jagged, length-sorted sequences: padded per length bucket.

The one loop both attention kinds use (:class:`fstrain.models.sasrec.JaggedCausalAttention`,
:class:`fstrain.models.hstu.HSTUBlock`): sequences are padded only inside a length bucket
(:func:`fstrain.models.sasrec.length_buckets`) with fbgemm's ``jagged_to_padded_dense`` /
``dense_to_jagged``, or, for tests, one sequence at a time without padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def per_bucket(fn: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor, offsets: torch.Tensor,
               offsets_list: list[int], buckets: list[tuple[int, int, int]], lengths_list: list[int], *,
               reference: bool = False) -> torch.Tensor:
    """Apply ``fn`` (``[n x L x w_in]`` -> ``[n x L x w_out]``, left-aligned, zero padded) to every sequence.

    Args:
        fn: the per-sequence op; position ``j`` of its output may depend only on positions
            ``<= j`` of its input (causal), so padding after a sequence never reaches it.
        values: ``[T x w_in]`` jagged values of length-sorted sequences.
        offsets: ``[B+1]`` int64 on ``values``' device; ``offsets_list``: the same as python ints.
        buckets: ``(first sample, end sample, padded length)`` per bucket.
        lengths_list: sorted lengths as python ints.
        reference: one sequence at a time, no padding (the plain reference).

    Returns:
        ``[T x w_out]`` jagged like ``values``.
    """
    parts = []
    if reference:
        for b, L in enumerate(lengths_list):
            a = offsets_list[b]
            parts.append(fn(values[a:a + L].unsqueeze(0)).squeeze(0))
    else:
        for s, e, Lb in buckets:
            a, z = offsets_list[s], offsets_list[e]
            sub_off = offsets[s:e + 1] - a
            padded = torch.ops.fbgemm.jagged_to_padded_dense(values[a:z], [sub_off], [Lb])  # [n x Lb x w_in]
            parts.append(torch.ops.fbgemm.dense_to_jagged(fn(padded), [sub_off])[0])
    return torch.cat(parts) if len(parts) > 1 else parts[0]
