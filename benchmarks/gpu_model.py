"""A torch-only model step for the GPU check: plain ``nn.Embedding`` + jagged HSTU-like layers, no torchrec.

The lent GPU image has torch but neither torchrec nor fbgemm-gpu, so fstrain's model
(:class:`fstrain.models.recommender.SequentialRecommender`, a torchrec ``EmbeddingCollection``
and fbgemm's jagged ops) cannot be imported there. This step does the same kind of work per
sample, quadratic in the history length ``L``, on a jagged batch (no padding to a common length):

* item lookup ``nn.Embedding(num_items, d)`` of the rank's histories concatenated (``[T]`` int64
  -> ``[T x d]``), plus a learned position embedding;
* ``num_layers`` HSTU-like layers (Zhai et al., ICML 2024, "Actions Speak Louder than Words",
  section 3.1): ``U, V, Q, K = split(SiLU(Linear(x)))``, pointwise attention
  ``A = SiLU(Q K^T) / L_max`` under a causal mask inside each history, output
  ``x + Linear(LayerNorm(A V) * U)`` (no relative attention bias, no dropout). The linear parts run
  on the ``[T x d]`` tokens; the attention is block-sparse: each history is cut into blocks of
  ``block_size`` positions and every (query block, key block) pair of the same history with key
  block <= query block is one batched matrix product (the tiling jagged attention kernels use);
* a sampled-softmax loss of each position against the next item of its history and
  ``num_negatives`` shared uniform negatives.

One forward and one backward per rank's batch, with a number of kernels that does not depend on
the lengths; the work is ``T`` tokens through the linear layers plus
``sum_i n_i (n_i + 1) / 2`` block pairs (``n_i = ceil(L_i / block_size)``), i.e. per sample a
constant, a linear and a quadratic term in ``L``: the form the cost model fits. (An earlier step
padded micro-batches of similar lengths: on an H200 its time followed the number of micro-batches,
about 12 ms each, with correlation 0.98 over 96 rank-steps, not ``sum L^2``; docs/results/gpu_check.md.)
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
        block_size: positions per attention block (the tile of the block-sparse attention).
    """

    num_items: int = 100_000
    embedding_dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_negatives: int = 128
    max_seq_len: int = 4096
    block_size: int = 64

    def to_json(self) -> dict:
        return asdict(self)


def block_layout(lengths: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """Where each history's positions sit in blocks of ``block_size``, and which block pairs attend.

    Args:
        lengths: ``[B]`` int64 history lengths (>= 1), concatenated in this order into ``T = sum L`` tokens.
        block_size: positions per block.

    Returns:
        ``blk_tok`` ``[NB x block_size]`` int64: the token of each block slot, ``T`` (a zero row) past
        the history's end; ``tok_blk`` ``[T]`` int64: each token's slot in the flattened blocks;
        ``pair_q``, ``pair_k`` ``[P]`` int64: the off-diagonal pairs (key block before query block,
        same history); ``NB = sum ceil(L / block_size)``, ``P = sum n (n - 1) / 2``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(lengths)])
    nb = -(-lengths // block_size)
    boff = np.concatenate([[0], np.cumsum(nb)])
    sid = np.repeat(np.arange(len(lengths)), nb)
    local = (np.arange(boff[-1]) - boff[sid])[:, None] * block_size + np.arange(block_size)[None, :]
    blk_tok = np.where(local < lengths[sid][:, None], off[sid][:, None] + local, off[-1])
    tok_blk = np.repeat(boff[:-1] * block_size - off[:-1], lengths) + np.arange(off[-1])
    pq, pk = [], []
    for n, b0 in zip(nb, boff[:-1]):
        if n > 1:
            r, c = np.tril_indices(int(n), -1)
            pq.append(r + b0)
            pk.append(c + b0)
    pair_q, pair_k = ((np.concatenate(x) if x else np.zeros(0)).astype(np.int64) for x in (pq, pk))
    return {"blk_tok": blk_tok.astype(np.int64), "tok_blk": tok_blk.astype(np.int64),
            "pair_q": pair_q, "pair_k": pair_k}


class HSTULikeLayer(nn.Module):
    """One HSTU-like layer on jagged tokens ``[T x d]`` with block-sparse causal attention."""

    causal: torch.Tensor  # [block_size x block_size] bool, lower triangle

    def __init__(self, d: int, heads: int, max_seq_len: int, block_size: int) -> None:
        super().__init__()
        self.heads, self.scale, self.block_size = heads, 1.0 / max_seq_len, block_size
        self.uvqk = nn.Linear(d, 4 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("causal", torch.ones(block_size, block_size, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor, layout: dict[str, torch.Tensor]) -> torch.Tensor:
        """``x`` ``[T x d]``; ``layout``: :func:`block_layout`'s arrays as tensors on ``x``'s device."""
        t, d = x.shape
        h, bs = self.heads, self.block_size
        u, v, q, k = F.silu(self.uvqk(x)).chunk(4, dim=-1)
        nb = layout["blk_tok"].shape[0]

        def blocks(z):  # [T x d] -> [NB x H x bs x d/H]; slots past a history's end read a zero row
            z = torch.cat([z, z.new_zeros(1, d)])[layout["blk_tok"]]
            return z.view(nb, bs, h, d // h).transpose(1, 2)

        qb, kb, vb = blocks(q), blocks(k), blocks(v)
        # diagonal pairs: causal inside the block (zero keys past the end add SiLU(0) = 0)
        a = (F.silu(qb @ kb.transpose(-1, -2)) * self.scale).masked_fill(~self.causal, 0.0)
        o = a @ vb  # [NB x H x bs x d/H]
        pq, pk = layout["pair_q"], layout["pair_k"]
        if pq.numel():  # earlier key blocks of the same history: no mask
            a = F.silu(qb[pq] @ kb[pk].transpose(-1, -2)) * self.scale  # [P x H x bs x bs]
            o = o.index_add(0, pq, (a @ vb[pk]).to(o.dtype))
        y = o.transpose(1, 2).reshape(nb * bs, d)[layout["tok_blk"]]  # [T x d]
        return x + self.out(self.norm(y) * u)


class TorchOnlyStep(nn.Module):
    """Embedding + jagged HSTU-like layers + sampled softmax; :meth:`forward_backward` runs one rank's batch."""

    def __init__(self, config: StepConfig) -> None:
        super().__init__()
        self.config = c = config
        if c.embedding_dim % c.num_heads:
            raise ValueError(f"embedding_dim {c.embedding_dim} is not divisible by num_heads {c.num_heads}")
        self.items = nn.Embedding(c.num_items, c.embedding_dim)
        self.pos = nn.Embedding(c.max_seq_len, c.embedding_dim)
        self.layers = nn.ModuleList(HSTULikeLayer(c.embedding_dim, c.num_heads, c.max_seq_len, c.block_size)
                                    for _ in range(c.num_layers))

    def _loss(self, batch: dict) -> torch.Tensor:
        ids = batch["ids"]
        x = self.items(ids) * math.sqrt(self.config.embedding_dim) + self.pos(batch["pos"])
        for layer in self.layers:
            x = layer(x, batch["layout"])
        src = batch["next_src"]  # positions with a next item in their history
        x = F.normalize(x[src], dim=-1)
        pos_logit = (x * F.normalize(self.items(ids[src + 1]), dim=-1)).sum(-1, keepdim=True)
        neg_logit = x @ F.normalize(self.items(batch["negatives"]), dim=-1).T
        logits = torch.cat([pos_logit, neg_logit], dim=-1) / 0.05
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=ids.device)
        return F.cross_entropy(logits.float(), target, reduction="sum")

    def forward_backward(self, batch: dict) -> None:
        """Forward + backward of one rank's batch (gradients accumulate; caller zeroes them).

        Args:
            batch: from :func:`make_batch`: ``lengths`` (numpy ``[B]`` int64), ``ids`` (``[T]`` int64
                on the device, the histories concatenated), ``pos`` (``[T]`` int64 positions),
                ``next_src`` (``[T - B]`` int64 tokens that have a next item), ``negatives``
                (``[K]`` int64), ``layout`` (:func:`block_layout` on the device).
        """
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if batch["ids"].is_cuda else _null()
        with autocast:
            loss = self._loss(batch)
        loss.backward()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_batch(model: TorchOnlyStep, lengths: np.ndarray, seed: int, device: torch.device) -> dict:
    """Random item ids for histories of ``lengths`` (each clipped to 2..max_seq_len), jagged, on ``device``.

    Returns:
        the ``batch`` dict :meth:`TorchOnlyStep.forward_backward` takes.
    """
    c = model.config
    lengths = np.maximum(2, np.minimum(np.asarray(lengths, dtype=np.int64), c.max_seq_len))
    g = torch.Generator().manual_seed(seed)
    t = int(lengths.sum())
    ids = torch.randint(0, c.num_items, (t,), generator=g)
    starts = np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    pos = np.arange(t) - starts
    next_src = np.flatnonzero(pos < np.repeat(lengths - 1, lengths))
    negatives = torch.randint(0, c.num_items, (c.num_negatives,), generator=g)
    layout = {k: torch.from_numpy(v).to(device) for k, v in block_layout(lengths, c.block_size).items()}
    return {"lengths": lengths, "ids": ids.to(device), "pos": torch.from_numpy(pos).to(device),
            "next_src": torch.from_numpy(next_src).to(device), "negatives": negatives.to(device), "layout": layout}


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
