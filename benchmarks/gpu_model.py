"""A torch-only model step for the GPU check: plain ``nn.Embedding`` + HSTU-like layers, no torchrec.

The lent GPU image has torch but neither torchrec nor fbgemm-gpu, so fstrain's model
(:class:`fstrain.models.recommender.SequentialRecommender`, a torchrec ``EmbeddingCollection``
and fbgemm's jagged ops) cannot be imported there. This step does the same kind of work per
sample, quadratic in the history length ``L``:

* item lookup ``nn.Embedding(num_items, d)`` of the history (``[T]`` int64 -> ``[T x d]``), plus a
  learned position embedding;
* ``num_layers`` HSTU-like layers (Zhai et al., ICML 2024, "Actions Speak Louder than Words",
  section 3.1): ``U, V, Q, K = split(SiLU(Linear(x)))``, pointwise attention
  ``A = SiLU(Q K^T) / L_max`` under a causal mask, output ``x + Linear(LayerNorm(A V) * U)``
  (no relative attention bias, no dropout);
* a sampled-softmax loss of each position against the next item and ``num_negatives`` shared
  uniform negatives.

Samples are padded only inside a micro-batch of similar lengths (sorted; a micro-batch's longest
history is at most ``pad_growth`` times its shortest, and it holds at most ``max_tokens_sq`` of
``sum L_pad^2``); each micro-batch runs forward + backward at once, so memory stays bounded at
``L = 4096`` while the work stays close to the jagged ``sum L^2`` (padded ``L^2`` work at most
``pad_growth^2`` times it). Without the growth bound, a first H100 run padded a rank's short
histories to its longest: its step time followed the padded work (correlation 0.97 over 128
rank-steps) and not ``sum L^2`` (0.10), so ``sum L^2``-balanced ranks differed 1.8x.
bf16 autocast on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class StepConfig:
    """Model settings of the torch-only step.

    Attributes:
        num_items: item table rows.
        embedding_dim: ``d``.
        num_layers: HSTU-like layers.
        num_heads: attention heads (``d`` divisible by it).
        num_negatives: shared uniform negatives per step.
        max_seq_len: longest history (position table rows; the ``L_max`` of the attention scale).
        max_tokens_sq: micro-batch bound on ``sum`` of padded ``L^2`` (memory, not work).
        pad_growth: longest / shortest history in a micro-batch, at most (bounds the padding).
    """

    num_items: int = 100_000
    embedding_dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_negatives: int = 128
    max_seq_len: int = 4096
    max_tokens_sq: int = 8 * 4096 * 4096
    pad_growth: float = 1.25

    def to_json(self) -> dict:
        return asdict(self)


class HSTULikeLayer(nn.Module):
    """One HSTU-like layer on a padded micro-batch ``[b x Lp x d]``."""

    def __init__(self, d: int, heads: int, max_seq_len: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, 1.0 / max_seq_len
        self.uvqk = nn.Linear(d, 4 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, lp, d = x.shape
        u, v, q, k = F.silu(self.uvqk(x)).chunk(4, dim=-1)
        h = self.heads

        def split(t):
            return t.view(b, lp, h, d // h).transpose(1, 2)  # [b x H x Lp x d/H]

        # [b x H x Lp x Lp]; masked_fill keeps only the bool mask for backward (a float mask would
        # promote the scores to float32 and double the largest activations)
        a = (F.silu(split(q) @ split(k).transpose(-1, -2)) * self.scale).masked_fill(~mask, 0.0)
        y = (a @ split(v)).transpose(1, 2).reshape(b, lp, d)
        return x + self.out(self.norm(y) * u)


class TorchOnlyStep(nn.Module):
    """Embedding + HSTU-like layers + sampled softmax; :meth:`forward_backward` runs one rank's batch."""

    def __init__(self, config: StepConfig) -> None:
        super().__init__()
        self.config = c = config
        if c.embedding_dim % c.num_heads:
            raise ValueError(f"embedding_dim {c.embedding_dim} is not divisible by num_heads {c.num_heads}")
        self.items = nn.Embedding(c.num_items, c.embedding_dim)
        self.pos = nn.Embedding(c.max_seq_len, c.embedding_dim)
        self.layers = nn.ModuleList(HSTULikeLayer(c.embedding_dim, c.num_heads, c.max_seq_len)
                                    for _ in range(c.num_layers))

    def micro_batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Sample indices per micro-batch (>= 1 sample each): sorted by length, ``sum(Lpad^2) <= max_tokens_sq``
        and longest <= ``pad_growth`` x shortest."""
        order = np.argsort(np.asarray(lengths), kind="stable")
        out, cur = [], []
        for i in order:
            lp = int(lengths[i])
            if cur and ((len(cur) + 1) * lp * lp > self.config.max_tokens_sq
                        or lp > self.config.pad_growth * int(lengths[cur[0]])):
                out.append(np.array(cur))
                cur = []
            cur.append(int(i))
        if cur:
            out.append(np.array(cur))
        return out

    def _loss(self, ids: torch.Tensor, lengths: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        b, lp = ids.shape
        dev = ids.device
        pos = torch.arange(lp, device=dev)
        valid = pos[None, :] < lengths[:, None]  # [b x Lp]
        x = self.items(ids) * math.sqrt(self.config.embedding_dim) + self.pos(pos)[None]
        mask = (pos[:, None] >= pos[None, :])[None, None]  # causal, bool
        for layer in self.layers:
            x = layer(x, mask)
        x = F.normalize(x[:, :-1], dim=-1)  # position i predicts item i + 1
        label = ids[:, 1:]
        pos_logit = (x * F.normalize(self.items(label), dim=-1)).sum(-1, keepdim=True)
        neg_logit = x @ F.normalize(self.items(negatives), dim=-1).T
        logits = torch.cat([pos_logit, neg_logit], dim=-1) / 0.05
        per_pos = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                  torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long, device=dev),
                                  reduction="none").view(b, lp - 1)
        return (per_pos * valid[:, 1:]).sum()

    def forward_backward(self, batch: dict) -> None:
        """Forward + backward of one rank's batch (gradients accumulate; caller zeroes them).

        Args:
            batch: from :func:`make_batch`: ``lengths`` (numpy ``[B]`` int64), ``ids`` (``[T]`` int64
                on the device, the histories concatenated), ``negatives`` (``[K]`` int64 on the device),
                ``micro`` (padded ``(ids [b x Lp], lengths [b])`` per micro-batch, built once).
        """
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if batch["ids"].is_cuda else _null()
        for ids, lengths in batch["micro"]:
            with autocast:
                loss = self._loss(ids, lengths, batch["negatives"])
            loss.backward()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_batch(model: TorchOnlyStep, lengths: np.ndarray, seed: int, device: torch.device) -> dict:
    """Random item ids for samples of ``lengths`` (each >= 2), padded per micro-batch, on ``device``.

    Returns:
        the ``batch`` dict :meth:`TorchOnlyStep.forward_backward` takes.
    """
    c = model.config
    lengths = np.maximum(2, np.minimum(np.asarray(lengths, dtype=np.int64), c.max_seq_len))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.num_items, (int(lengths.sum()),), generator=g)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    micro = []
    for idx in model.micro_batches(lengths):
        lp = int(lengths[idx].max())
        pad = torch.zeros(len(idx), lp, dtype=torch.long)
        for row, i in enumerate(idx):
            pad[row, :lengths[i]] = ids[offsets[i]:offsets[i + 1]]
        micro.append((pad.to(device), torch.as_tensor(lengths[idx]).to(device)))
    negatives = torch.randint(0, c.num_items, (c.num_negatives,), generator=g).to(device)
    return {"lengths": lengths, "ids": ids.to(device), "negatives": negatives, "micro": micro}


def time_step(model: TorchOnlyStep, batch: dict, device: torch.device) -> float:
    """Seconds of one forward + backward (CUDA events on CUDA, ``perf_counter`` on CPU)."""
    import time

    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        model.forward_backward(batch)
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3
    t0 = time.perf_counter()
    model.forward_backward(batch)
    return time.perf_counter() - t0
