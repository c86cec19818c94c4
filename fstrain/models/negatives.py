"""Sampled-softmax negatives: appended to a batch's KeyedJaggedTensor, independent of the rank a sample lands on."""


import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fstrain.data.batch import Batch
from fstrain.models.dropout import mix64, token_keys
from fstrain.models.config import NEGATIVE_KEY, Config

def with_negatives(batch: Batch, num_items: int, num_negatives: int, seed: int, *, per_sample: bool = False) -> Batch:
    """Append the step's negatives to ``batch.features`` as key ``negative_item_ids``.

    Shared (default): the ids depend only on ``(seed, batch.step)``: every rank of a step draws the
    same ones, whatever the assignment of samples to ranks; they are carried by the first sample
    (lengths ``[K, 0, ..., 0]``) so the KJT keeps one stride. Per sample: sample ``s`` gets K ids
    hashed from ``(seed, step, sample_id)`` (:func:`fstrain.models.dropout.mix64`), lengths ``[K] * B``.

    Args:
        batch: a CPU batch from :class:`fstrain.data.reader.ShardReader`.
        num_items: ids are drawn uniformly from ``[0, num_items)``.
        num_negatives: K; 0: every id ``0..num_items-1`` once, shared (the full softmax).
        seed: run seed.
        per_sample: draw K ids per sample instead of K per step.

    Returns:
        A new :class:`Batch` whose KJT has keys ``item_ids, target_item_id, negative_item_ids``.
    """
    kjt = batch.features
    B = batch.num_samples
    neg_lengths = torch.zeros(B, dtype=kjt.lengths().dtype)
    if num_negatives == 0:
        neg = torch.arange(num_items, dtype=torch.int64)
        neg_lengths[0] = num_items
    elif per_sample:
        keys = token_keys(seed, batch.step, batch.sample_ids, torch.zeros(B, dtype=torch.int64))
        cols = torch.arange(num_negatives, dtype=torch.int64) * 0x9E3779B1
        neg = torch.remainder(mix64(keys[:, None] + cols[None, :]), num_items).reshape(-1)
        neg_lengths[:] = num_negatives
    else:
        g = torch.Generator().manual_seed(seed * 1_000_003 + batch.step)
        neg = torch.randint(0, num_items, (num_negatives,), generator=g, dtype=torch.int64)
        neg_lengths[0] = num_negatives
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys() + [NEGATIVE_KEY], values=torch.cat([kjt.values(), neg]),
        lengths=torch.cat([kjt.lengths(), neg_lengths]), stride=B)
    return Batch(features, batch.target_ids, batch.sample_ids, batch.step, B, batch.global_num_samples,
                 batch.global_num_tokens, batch.actions)


def attach_negatives(batch: Batch, config: "Config", seed: int) -> Batch:
    """:func:`with_negatives` with the model's settings (``num_negatives``, ``negatives``)."""
    return with_negatives(batch, config.num_items, config.num_negatives, seed,
                          per_sample=config.negatives == "sample" and config.num_negatives > 0)


