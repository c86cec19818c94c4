"""Ranking metrics of the held-out evaluation (protocol: :mod:`fstrain.components.evaluator`):
the 0-based rank of each target among its scored candidates, and the sums of HR@K, NDCG@K and MRR
over users; tensors on any device.
"""

from __future__ import annotations

import torch

DEFAULT_K = 10
#: Cutoffs always reported (generative-recommenders reports HR/NDCG@10 and @50, and MRR).
REPORTED_KS = (10, 50)


def target_ranks(scores: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """0-based rank of each target among its row's scores (ties count against the target).

    Args:
        scores: ``[U x N]`` float; excluded candidates set to ``-inf``.
        target_ids: ``[U]`` int64 in ``0..N-1`` (their scores must be finite).

    Returns:
        ``[U]`` int64: ``#(score > s_t) + #(score == s_t) - 1``.
    """
    t = scores.gather(1, target_ids[:, None])
    return (scores > t).sum(1) + (scores == t).sum(1) - 1


def mrr_sum(ranks: torch.Tensor) -> float:
    """Sum over users of ``1 / (rank + 1)`` for 0-based ``ranks`` ``[U]`` int64 (mean reciprocal rank's numerator)."""
    return float((1.0 / (ranks.to(torch.float64) + 1.0)).sum())


def hr_ndcg_sums(ranks: torch.Tensor, k: int = DEFAULT_K) -> tuple[float, float]:
    """Sums over users of ``HR@k`` and ``NDCG@k`` terms for 0-based ``ranks`` ``[U]`` int64."""
    hit = ranks < k
    ndcg = torch.where(hit, 1.0 / torch.log2(ranks.to(torch.float64) + 2.0), torch.zeros((), dtype=torch.float64))
    return float(hit.sum()), float(ndcg.sum())


def mask_scores(scores: torch.Tensor, target_ids: torch.Tensor, hist_values: torch.Tensor, hist_lengths: torch.Tensor,
                *, mask_history: bool, padding_id: int) -> torch.Tensor:
    """Exclude candidates in place (:mod:`fstrain.components.evaluator`): the padding id and, optionally, history items.

    Args:
        scores: ``[U x N]`` float, modified in place.
        target_ids: ``[U]`` int64.
        hist_values: ``[T]`` int64 history items of the ``U`` users, concatenated.
        hist_lengths: ``[U]`` int64.
        mask_history: set history items (other than the target) to ``-inf``.
        padding_id: candidate id to exclude (negative: none).

    Returns:
        ``scores``.
    """
    rows = torch.arange(len(target_ids), device=scores.device)
    keep = scores[rows, target_ids].clone()
    if padding_id >= 0:
        scores[:, padding_id] = float("-inf")
    if mask_history and hist_values.numel():
        users = torch.repeat_interleave(rows, hist_lengths.to(scores.device))
        scores[users, hist_values.to(scores.device)] = float("-inf")
    scores[rows, target_ids] = keep
    return scores
