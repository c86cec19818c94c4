"""A SASRec/HSTU-family sequential recommender over jagged histories.

Structure (what torchrec's pipelines expect): :class:`SequentialRecommender` owns an
``EmbeddingCollection`` ``ec`` (one item table, looked up for the history, the target and the
shared negatives; sharded row-wise by :mod:`fstrain.dist`) called on ``batch.features`` (a KJT),
and a purely data-parallel :class:`DenseTower` ``dense``. ``forward(batch)`` returns
``(loss, (loss_sum, num_samples))`` like torchrec's examples, so ``TrainPipelineSparseDist`` can
drive it; ``dense`` is also callable on its own (:func:`fstrain.train.measured_step` splits the
backward there to time compute apart from waiting).

Dense tower: ``num_layers`` pre-LayerNorm transformer blocks with causal softmax self-attention
(SASRec, Kang & McAuley 2018). Linear layers run on the jagged values ``[T x d]`` (no padding);
attention pads only inside power-of-two length buckets (like block padding in real jagged
kernels), using ``torch.ops.fbgemm.jagged_to_padded_dense`` / ``dense_to_jagged``. The user vector
is the output at the last history position.

Loss: sampled softmax with ``num_negatives`` negatives shared by every sample of a step and drawn
from a generator seeded by ``(seed, step)`` (:func:`with_negatives`), accidental hits masked.
In-batch negatives are *not* used on purpose: they make a sample's loss depend on which rank it
lands on, so balancing (which moves samples between ranks inside a step) would change training.
The loss is ``sum of per-sample losses / global sample count of the step``; with gradients summed
over ranks (not averaged) this equals one rank training on the whole global batch.

Notation: ``B`` samples in the rank's batch, ``T`` history items (sum of lengths), ``d``
embedding dim, ``H`` heads, ``K`` negatives, ``Lb`` a bucket's max length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fstrain.batch import HISTORY_KEY, TARGET_KEY, Batch
from fstrain.errors import ConfigError

NEGATIVE_KEY = "negative_item_ids"
TABLE_NAME = "item_table"


@dataclass(kw_only=True, slots=True)
class Config:
    """Size and loss of the model."""

    num_items: int
    """Rows of the item table (max item id + 1)."""
    embedding_dim: int = 64
    """d: item embedding and model width."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 2
    """Attention heads (``embedding_dim`` must be divisible by it)."""
    ffn_multiplier: int = 2
    """Feed-forward hidden width = ``ffn_multiplier * embedding_dim``."""
    max_seq_len: int = 512
    """Longest history (rows of the position table); longer histories are an error."""
    num_negatives: int = 128
    """K: sampled-softmax negatives shared by the samples of a step."""
    attention: str = "bucketed"
    """``bucketed`` (fbgemm jagged<->padded per length bucket) or ``reference`` (one SDPA call
    per sample; for tests)."""
    bucket_ratio: float = 1.25
    """A length bucket holds lengths in ``[Lmin, Lmin * bucket_ratio]`` and is padded to its max:
    attention padding waste is at most ``bucket_ratio^2 - 1``, keeping a batch's cost close to the
    sum of its samples' costs (what the balancer assumes). Larger: fewer, bigger kernel calls."""

    def __post_init__(self) -> None:
        if self.num_items < 2:
            raise ConfigError(f"num_items must be >= 2, got {self.num_items}")
        if self.embedding_dim % self.num_heads:
            raise ConfigError(f"embedding_dim {self.embedding_dim} is not divisible by num_heads {self.num_heads}")
        if self.attention not in ("bucketed", "reference"):
            raise ConfigError(f"attention must be 'bucketed' or 'reference', got {self.attention!r}")
        if self.bucket_ratio < 1.0:
            raise ConfigError(f"bucket_ratio must be >= 1.0, got {self.bucket_ratio}")
        if min(self.num_layers, self.ffn_multiplier, self.max_seq_len, self.num_negatives) < 1:
            raise ConfigError("num_layers, ffn_multiplier, max_seq_len and num_negatives must be >= 1")


def with_negatives(batch: Batch, num_items: int, num_negatives: int, seed: int) -> Batch:
    """Append the step's shared negatives to ``batch.features`` as key ``negative_item_ids``.

    The ids depend only on ``(seed, batch.step)``: every rank of a step draws the same ones, and
    they do not depend on how samples were assigned to ranks. They are carried by the first
    sample (lengths ``[K, 0, ..., 0]``) so the KJT keeps one stride.

    Args:
        batch: a CPU batch from :class:`fstrain.data.ShardReader`.
        num_items: ids are drawn uniformly from ``[0, num_items)``.
        num_negatives: K.
        seed: run seed.

    Returns:
        A new :class:`Batch` whose KJT has keys ``item_ids, target_item_id, negative_item_ids``.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch.step)
    neg = torch.randint(0, num_items, (num_negatives,), generator=g, dtype=torch.int64)
    kjt = batch.features
    B = batch.num_samples
    neg_lengths = torch.zeros(B, dtype=kjt.lengths().dtype)
    neg_lengths[0] = num_negatives
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys() + [NEGATIVE_KEY], values=torch.cat([kjt.values(), neg]),
        lengths=torch.cat([kjt.lengths(), neg_lengths]), stride=B)
    return Batch(features, batch.target_ids, batch.sample_ids, batch.step, B, batch.global_num_samples)


def make_embedding_collection(config: Config, device: torch.device | None = None) -> EmbeddingCollection:
    """The item table, shared by history, target and negatives (sharded row-wise by DMP)."""
    table = EmbeddingConfig(name=TABLE_NAME, embedding_dim=config.embedding_dim, num_embeddings=config.num_items,
                            feature_names=[HISTORY_KEY, TARGET_KEY, NEGATIVE_KEY])
    return EmbeddingCollection(tables=[table], device=device)


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
        self.reference = config.attention == "reference"

    def _sdpa(self, qkv: torch.Tensor) -> torch.Tensor:
        # qkv: [n x Lb x 3d] -> [n x Lb x d]
        n, L, three_d = qkv.shape
        H = self.num_heads
        q, k, v = qkv.view(n, L, 3, H, three_d // (3 * H)).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
        qkv = self.qkv(x)
        parts = []
        if self.reference:
            for b, L in enumerate(lengths_list):
                a = offsets_list[b]
                parts.append(self._sdpa(qkv[a:a + L].unsqueeze(0)).squeeze(0))
        else:
            for s, e, Lb in buckets:
                a, z = offsets_list[s], offsets_list[e]
                sub_off = offsets[s:e + 1] - a
                padded = torch.ops.fbgemm.jagged_to_padded_dense(qkv[a:z], [sub_off], [Lb])  # [n x Lb x 3d]
                parts.append(torch.ops.fbgemm.dense_to_jagged(self._sdpa(padded), [sub_off])[0])
        return self.out(torch.cat(parts) if len(parts) > 1 else parts[0])


class Block(nn.Module):
    """Pre-LayerNorm transformer block on jagged values."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        d = config.embedding_dim
        self.ln1 = nn.LayerNorm(d)
        self.attn = JaggedCausalAttention(config)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, config.ffn_multiplier * d), nn.GELU(),
                                 nn.Linear(config.ffn_multiplier * d, d))

    def forward(self, x, offsets, offsets_list, buckets, lengths_list):
        """``x`` ``[T x d]`` -> ``[T x d]`` (arguments as :meth:`JaggedCausalAttention.forward`)."""
        x = x + self.attn(self.ln1(x), offsets, offsets_list, buckets, lengths_list)
        return x + self.ffn(self.ln2(x))


class DenseTower(nn.Module):
    """Data-parallel part: positions, transformer blocks, sampled-softmax loss."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.pos = nn.Embedding(config.max_seq_len, config.embedding_dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_final = nn.LayerNorm(config.embedding_dim)

    def encode(self, hist: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """User vectors: the final-LayerNorm output at each history's last position.

        Args:
            hist: ``[T x d]`` float: history embeddings, jagged by ``lengths``.
            lengths: ``[B]`` int64, each in ``1..max_seq_len``.

        Returns:
            ``(user, perm)``: ``user`` ``[B x d]`` in length-sorted order, ``perm`` ``[B]`` int64
            (``user[i]`` belongs to input sample ``perm[i]``).

        Raises:
            ConfigError: a history is longer than ``max_seq_len``.
        """
        cfg = self.config
        lengths_cpu = lengths.cpu()
        B = len(lengths_cpu)
        if B and int(lengths_cpu.max()) > cfg.max_seq_len:
            raise ConfigError(f"a history has {int(lengths_cpu.max())} items but max_seq_len is {cfg.max_seq_len}; "
                              f"pass --max-seq-len {int(lengths_cpu.max())} or cap lengths in fsdata convert")
        with record_function("## dense_sort_jagged ##"):
            perm = torch.argsort(lengths_cpu, stable=True)
            sorted_len = lengths_cpu[perm]
            offsets_cpu = torch.zeros(B + 1, dtype=torch.int64)
            torch.cumsum(lengths_cpu, 0, out=offsets_cpu[1:])
            new_offsets = torch.zeros(B + 1, dtype=torch.int64)
            torch.cumsum(sorted_len, 0, out=new_offsets[1:])
            shift = torch.repeat_interleave(offsets_cpu[:-1][perm] - new_offsets[:-1], sorted_len)
            token_index = (torch.arange(int(new_offsets[-1])) + shift).to(hist.device)
            positions = (torch.arange(int(new_offsets[-1])) - torch.repeat_interleave(new_offsets[:-1], sorted_len))
            lengths_list = sorted_len.tolist()
            buckets = length_buckets(lengths_list, cfg.bucket_ratio)
            perm_dev = perm.to(hist.device)
            offsets_list = new_offsets.tolist()
            offsets_dev = new_offsets.to(hist.device)
        x = hist.index_select(0, token_index) * math.sqrt(cfg.embedding_dim) + self.pos(positions.to(hist.device))
        with record_function("## dense_blocks ##"):
            for blk in self.blocks:
                x = blk(x, offsets_dev, offsets_list, buckets, lengths_list)
        return self.ln_final(x.index_select(0, offsets_dev[1:] - 1)), perm_dev

    def user_vectors(self, hist: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` in input order: ``[B x d]`` float (evaluation, :mod:`fstrain.evaluate`)."""
        user, perm = self.encode(hist, lengths)
        return torch.empty_like(user).index_copy_(0, perm, user)

    def forward(self, hist: torch.Tensor, lengths: torch.Tensor, target_emb: torch.Tensor, neg_emb: torch.Tensor,
                target_ids: torch.Tensor, neg_ids: torch.Tensor, global_num_samples: int
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Loss of one rank's batch.

        Args:
            hist: ``[T x d]`` float: history embeddings, jagged by ``lengths``.
            lengths: ``[B]`` int64, each in ``1..max_seq_len``.
            target_emb: ``[B x d]`` float.
            neg_emb: ``[K x d]`` float: the step's shared negatives.
            target_ids: ``[B]`` int64.
            neg_ids: ``[K]`` int64.
            global_num_samples: samples of this step over all ranks (normaliser).

        Returns:
            ``(loss, (loss_sum, num_samples))``: ``loss`` = sum of per-sample cross-entropies /
            ``global_num_samples`` (scalar, differentiable); ``loss_sum`` detached; ``num_samples``
            = B as a tensor.

        Raises:
            ConfigError: a history is longer than ``max_seq_len``.
        """
        user, perm_dev = self.encode(hist, lengths)
        B = user.shape[0]
        with record_function("## dense_loss ##"):
            t = target_emb.index_select(0, perm_dev)
            pos_logit = (user * t).sum(-1, keepdim=True)  # [B x 1]
            neg_logit = user @ neg_emb.t()  # [B x K]
            hit = target_ids.index_select(0, perm_dev)[:, None] == neg_ids[None, :]
            neg_logit = neg_logit.masked_fill(hit, float("-inf"))
            logits = torch.cat([pos_logit, neg_logit], dim=1)
            per_sample = torch.logsumexp(logits, dim=1) - pos_logit.squeeze(1)
            loss_sum = per_sample.sum()
        return loss_sum / global_num_samples, (loss_sum.detach(), torch.tensor(B))


class SequentialRecommender(nn.Module):
    """Item ``EmbeddingCollection`` (sparse, row-wise sharded) + :class:`DenseTower` (data-parallel).

    Args:
        config: model size.
        device: device of the embedding table (``torch.device("meta")`` before DMP sharding).
    """

    def __init__(self, config: Config, device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        self.ec = make_embedding_collection(config, device)
        self.dense = DenseTower(config)

    def sparse_forward(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Look up history, target and negative embeddings.

        Returns:
            ``hist [T x d]``, ``target_emb [B x d]``, ``neg_emb [K x d]`` (rows of the item table).
        """
        with record_function("## sparse_forward ##"):
            emb = self.ec(features)
            return emb[HISTORY_KEY].values(), emb[TARGET_KEY].values(), emb[NEGATIVE_KEY].values()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Loss of ``batch`` (its KJT must carry negatives: :func:`with_negatives`).

        Returns:
            ``(loss, (loss_sum, num_samples))`` as :meth:`DenseTower.forward`.
        """
        hist, tgt, neg = self.sparse_forward(batch.features)
        f = batch.features
        return self.dense(hist, f[HISTORY_KEY].lengths(), tgt, neg, batch.target_ids,
                          f[NEGATIVE_KEY].values(), batch.global_num_samples)
