"""SASRec and HSTU sequential recommenders over jagged histories, with the field's objectives.

Structure (what torchrec's pipelines expect): :class:`SequentialRecommender` owns an
``EmbeddingCollection`` ``ec`` (one item table, looked up for the history, the target and the
shared negatives; sharded row-wise by :mod:`fstrain.dist`) called on ``batch.features`` (a KJT),
and a purely data-parallel :class:`DenseTower` ``dense``. ``forward(batch)`` returns
``(loss, (loss_sum, num_supervised))`` like torchrec's examples, so ``TrainPipelineSparseDist``
can drive it; ``dense`` is also callable on its own (:func:`fstrain.train.measured_step` splits
the backward there to time compute apart from waiting).

Models (``Config.model``), both on the jagged values ``[T x d]`` (no padding outside attention):

* ``sasrec``: ``num_layers`` pre-LayerNorm transformer blocks with causal softmax self-attention
  and dropout (Kang & McAuley, ICDM 2018; the input is ``sqrt(d) * item + position`` then dropout,
  as generative-recommenders' ``LearnablePositionalEmbeddingInputFeaturesPreprocessor``).
  Attention pads only inside power-of-two-like length buckets (like block padding in real jagged
  kernels), using ``torch.ops.fbgemm.jagged_to_padded_dense`` / ``dense_to_jagged``.
* ``hstu``: ``num_layers`` HSTU layers (Zhai et al., ICML 2024, :mod:`fstrain.hstu`): pointwise
  SiLU attention normalised by the sequence length bound, U gating, relative position bias, no
  feed-forward; same input embedding.

Objectives (``Config.objective``):

* ``all-positions`` (per-user samples, the field's recipe: SASRec, S3-Rec, generative-recommenders'
  ``train_fn``): causal attention, the output at history position ``i`` predicts
  ``item_ids[i + 1]`` and the last position predicts ``target_item_id``; every history position is
  supervised.
* ``last-position`` (per-event samples): only the last position, predicting ``target_item_id``.

Loss: sampled softmax over the label and ``num_negatives`` uniform negatives shared by every sample
of a step, drawn from a generator seeded by ``(seed, step)`` (:func:`with_negatives`), accidental
hits masked; ``num_negatives = 0`` is the full softmax over the catalogue. Logits are dot products
divided by ``temperature``, of L2-normalised vectors when ``l2_normalize`` (generative-recommenders'
``L2NormEmbeddingPostprocessor`` + ``SampledSoftmaxLoss``). In-batch negatives are *not* used on
purpose: they make a sample's loss depend on which rank it lands on, so balancing (which moves
samples between ranks inside a step) would change training. The loss is ``sum of per-position
losses / the step's global count of supervised positions`` (``global_num_tokens`` for
``all-positions``, ``global_num_samples`` for ``last-position``); with gradients summed over ranks
(not averaged) this equals one rank training on the whole global batch; dropout masks are keyed
by ``(seed, step, sample_id, position)`` (:mod:`fstrain.dropout`), so that holds with dropout too.

Notation: ``B`` samples in the rank's batch, ``T`` history items (sum of lengths), ``P``
supervised positions (``T`` or ``B``), ``d`` embedding dim, ``H`` heads, ``K`` negatives (``N``,
the catalogue, for the full softmax), ``Lb`` a bucket's max length.
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
from fstrain.dropout import DropoutKeys, KeyedDropout, mix64, token_keys
from fstrain.errors import ConfigError
from fstrain.jagged import per_bucket

NEGATIVE_KEY = "negative_item_ids"
TABLE_NAME = "item_table"


#: ``Config.model`` names: the transformer families fstrain trains.
MODELS = ("sasrec", "hstu")
#: ``Config.objective`` names; ``fstrain train`` picks one from the manifest's sample kind.
OBJECTIVES = ("all-positions", "last-position")
#: ``Config.negatives``: who shares the sampled negatives.
NEGATIVE_MODES = ("step", "sample")
#: The objective the field trains each ``fsdata convert --samples`` kind with.
OBJECTIVE_FOR_SAMPLES = {"per-user": "all-positions", "per-event": "last-position"}


@dataclass(kw_only=True, slots=True)
class Config:
    """Size, family and loss of the model.

    Defaults follow generative-recommenders' ML-1M recipe
    (``configs/ml-1m/sasrec-sampled-softmax-n128-final.gin``): dropout 0.2, 128 sampled
    negatives, temperature 0.05, L2-normalised embeddings; the size (d 64, 2 blocks, 2 heads) is
    fstrain's.
    """

    num_items: int
    """Rows of the item table (max item id + 1)."""
    model: str = "sasrec"
    """``sasrec`` (causal softmax attention + feed-forward) or ``hstu`` (:mod:`fstrain.hstu`)."""
    objective: str = "all-positions"
    """``all-positions`` (next item at every history position) or ``last-position``."""
    embedding_dim: int = 64
    """d: item embedding and model width."""
    num_layers: int = 2
    """Transformer (or HSTU) blocks."""
    num_heads: int = 2
    """Attention heads (``embedding_dim`` must be divisible by it for ``sasrec``)."""
    ffn_multiplier: int = 2
    """``sasrec``: feed-forward hidden width = ``ffn_multiplier * embedding_dim``."""
    attention_dim: int | None = None
    """``hstu``: per-head query/key width (``None``: ``embedding_dim // num_heads``)."""
    linear_dim: int | None = None
    """``hstu``: per-head value/gate width (``None``: ``embedding_dim // num_heads``)."""
    max_seq_len: int = 512
    """Longest history (rows of the position table); longer histories are an error."""
    dropout: float = 0.2
    """Dropout rate on the input embeddings, attention and block outputs (0: none)."""
    num_negatives: int = 128
    """K: sampled-softmax negatives (per step or per sample, ``negatives``); 0: full softmax over the catalogue."""
    negatives: str = "step"
    """``step``: K negatives shared by every sample of a step, drawn from ``(seed, step)``;
    ``sample``: K negatives per sample, drawn from ``(seed, step, sample_id)`` (B times more
    distinct negatives per step, still independent of the rank a sample lands on)."""
    temperature: float = 0.05
    """Logits are similarities divided by this (generative-recommenders: 0.05 with L2 norm)."""
    l2_normalize: bool = True
    """L2-normalise user outputs and item embeddings before the dot product (cosine similarity)."""
    attention: str = "bucketed"
    """``bucketed`` (fbgemm jagged<->padded per length bucket) or ``reference`` (one call per
    sample; for tests)."""
    bucket_ratio: float = 1.25
    """A length bucket holds lengths in ``[Lmin, Lmin * bucket_ratio]`` and is padded to its max:
    attention padding waste is at most ``bucket_ratio^2 - 1``, keeping a batch's cost close to the
    sum of its samples' costs (what the balancer assumes). Larger: fewer, bigger kernel calls."""

    def __post_init__(self) -> None:
        if self.num_items < 2:
            raise ConfigError(f"num_items must be >= 2, got {self.num_items}")
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; use one of {', '.join(MODELS)}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.objective!r}; use one of {', '.join(OBJECTIVES)}")
        if self.embedding_dim % 4:
            up = -(-self.embedding_dim // 4) * 4
            raise ConfigError(f"embedding_dim must be a multiple of 4 (fbgemm's table-batched embeddings store rows "
                              f"in 4-float units), got {self.embedding_dim}; use {up}")
        if self.model == "sasrec" and self.embedding_dim % self.num_heads:
            raise ConfigError(f"embedding_dim {self.embedding_dim} is not divisible by num_heads {self.num_heads}")
        if self.attention not in ("bucketed", "reference"):
            raise ConfigError(f"attention must be 'bucketed' or 'reference', got {self.attention!r}")
        if self.bucket_ratio < 1.0:
            raise ConfigError(f"bucket_ratio must be >= 1.0, got {self.bucket_ratio}")
        if min(self.num_layers, self.ffn_multiplier, self.max_seq_len, self.num_heads) < 1:
            raise ConfigError("num_layers, ffn_multiplier, max_seq_len and num_heads must be >= 1")
        if self.negatives not in NEGATIVE_MODES:
            raise ConfigError(f"unknown negatives mode {self.negatives!r}; use one of {', '.join(NEGATIVE_MODES)}")
        if self.num_negatives < 0:
            raise ConfigError(f"num_negatives must be >= 0 (0: full softmax), got {self.num_negatives}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")

    @property
    def head_dims(self) -> tuple[int, int]:
        """``hstu``: ``(attention_dim, linear_dim)`` per head, defaults resolved."""
        d = self.embedding_dim // self.num_heads
        return self.attention_dim or d, self.linear_dim or d


def with_negatives(batch: Batch, num_items: int, num_negatives: int, seed: int, *, per_sample: bool = False) -> Batch:
    """Append the step's negatives to ``batch.features`` as key ``negative_item_ids``.

    Shared (default): the ids depend only on ``(seed, batch.step)``: every rank of a step draws the
    same ones, whatever the assignment of samples to ranks; they are carried by the first sample
    (lengths ``[K, 0, ..., 0]``) so the KJT keeps one stride. Per sample: sample ``s`` gets K ids
    hashed from ``(seed, step, sample_id)`` (:func:`fstrain.dropout.mix64`), lengths ``[K] * B``.

    Args:
        batch: a CPU batch from :class:`fstrain.data.ShardReader`.
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
                 batch.global_num_tokens)


def attach_negatives(batch: Batch, config: "Config", seed: int) -> Batch:
    """:func:`with_negatives` with the model's settings (``num_negatives``, ``negatives``)."""
    return with_negatives(batch, config.num_items, config.num_negatives, seed,
                          per_sample=config.negatives == "sample" and config.num_negatives > 0)


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


class Block(nn.Module):
    """SASRec block: pre-LayerNorm causal attention and feed-forward, dropout on both outputs."""

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


def _make_block(config: Config) -> nn.Module:
    if config.model == "sasrec":
        return Block(config)
    from fstrain.hstu import HSTUBlock  # noqa: PLC0415

    dqk, dv = config.head_dims
    return HSTUBlock(embedding_dim=config.embedding_dim, num_heads=config.num_heads, attention_dim=dqk,
                     linear_dim=dv, max_seq_len=config.max_seq_len, dropout=config.dropout,
                     reference=config.attention == "reference")


@dataclass(slots=True)
class JaggedLayout:
    """How a rank's histories are reordered for attention (longest-last, bucketed).

    Attributes:
        perm: ``[B]`` int64: sorted sample ``i`` is input sample ``perm[i]``.
        token_index: ``[T]`` int64: sorted token ``j`` is input token ``token_index[j]``.
        positions: ``[T]`` int64: position of each sorted token inside its history.
        offsets: ``[B+1]`` int64, sorted offsets (python list in ``offsets_list``).
        lengths_list: sorted lengths (python ints).
        buckets: :func:`length_buckets` of the sorted lengths.
    """

    perm: torch.Tensor
    token_index: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor
    offsets_list: list[int]
    lengths_list: list[int]
    buckets: list[tuple[int, int, int]]


class DenseTower(nn.Module):
    """Data-parallel part: positions, SASRec or HSTU blocks, the loss."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.pos = nn.Embedding(config.max_seq_len, config.embedding_dim)
        # generative-recommenders' LearnablePositionalEmbeddingInputFeaturesPreprocessor: std sqrt(1/d), so
        # positions do not drown the sqrt(d)-scaled item embeddings at init (N(0, 1) would, by ~7x at d 50)
        nn.init.trunc_normal_(self.pos.weight, std=math.sqrt(1.0 / config.embedding_dim))
        self.blocks = nn.ModuleList(_make_block(config) for _ in range(config.num_layers))
        self.drop = KeyedDropout(config.dropout, site=0)
        self.dropout_keys = DropoutKeys()  # masks keyed by (seed, step, sample, position): rank-independent
        self.seed = 0  # the run seed in the dropout keys (fstrain.train sets it)
        for site, m in enumerate(m for m in self.modules() if isinstance(m, KeyedDropout)):
            m.site, m.source = site, self.dropout_keys
        # generative-recommenders: SASRec ends with a LayerNorm, HSTU does not
        self.ln_final = nn.LayerNorm(config.embedding_dim) if config.model == "sasrec" else nn.Identity()

    def layout(self, lengths: torch.Tensor, device: torch.device) -> JaggedLayout:
        """The sorted, bucketed layout of ``lengths`` (``[B]`` int64, each in ``1..max_seq_len``).

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
            T = int(new_offsets[-1])
            token_index = torch.arange(T) + shift
            positions = torch.arange(T) - torch.repeat_interleave(new_offsets[:-1], sorted_len)
            lengths_list = sorted_len.tolist()
            return JaggedLayout(perm=perm.to(device), token_index=token_index.to(device),
                                positions=positions.to(device), offsets=new_offsets.to(device),
                                offsets_list=new_offsets.tolist(), lengths_list=lengths_list,
                                buckets=length_buckets(lengths_list, cfg.bucket_ratio))

    def encode_tokens(self, hist: torch.Tensor, lay: JaggedLayout, *, sample_ids: torch.Tensor | None = None,
                      step: int | None = None) -> torch.Tensor:
        """Outputs at every history position, in the layout's sorted token order.

        Args:
            hist: ``[T x d]`` float: history embeddings, jagged in input order.
            lay: from :meth:`layout`.
            sample_ids: ``[B]`` int64 global sample ids (input order) and ``step``: key the dropout
                masks (:mod:`fstrain.dropout`) so a sample's masks do not depend on its rank;
                None: ``torch.nn.functional.dropout``.
            step: the global step (with ``sample_ids``).

        Returns:
            ``[T x d]`` float (sorted token order: row ``j`` is input token ``lay.token_index[j]``).
        """
        cfg = self.config
        self.dropout_keys.keys = None
        if self.training and cfg.dropout > 0 and sample_ids is not None and step is not None:
            sorted_ids = sample_ids.to(hist.device).index_select(0, lay.perm)
            per_token = torch.repeat_interleave(sorted_ids, torch.tensor(lay.lengths_list, device=hist.device))
            self.dropout_keys.keys = token_keys(self.seed, step, per_token, lay.positions)
        x = hist.index_select(0, lay.token_index) * math.sqrt(cfg.embedding_dim) + self.pos(lay.positions)
        x = self.drop(x)
        with record_function("## dense_blocks ##"):
            for blk in self.blocks:
                x = blk(x, lay.offsets, lay.offsets_list, lay.buckets, lay.lengths_list)
        return self.ln_final(x)

    def encode(self, hist: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """User vectors: the output at each history's last position.

        Args:
            hist: ``[T x d]`` float: history embeddings, jagged by ``lengths``.
            lengths: ``[B]`` int64, each in ``1..max_seq_len``.

        Returns:
            ``(user, perm)``: ``user`` ``[B x d]`` in length-sorted order, ``perm`` ``[B]`` int64
            (``user[i]`` belongs to input sample ``perm[i]``).

        Raises:
            ConfigError: a history is longer than ``max_seq_len``.
        """
        lay = self.layout(lengths, hist.device)
        out = self.encode_tokens(hist, lay)
        return out.index_select(0, lay.offsets[1:] - 1), lay.perm

    def user_vectors(self, hist: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` in input order: ``[B x d]`` float (evaluation, :mod:`fstrain.evaluate`)."""
        user, perm = self.encode(hist, lengths)
        return torch.empty_like(user).index_copy_(0, perm, user)

    def scores(self, user: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Ranking scores ``[U x N]`` float of users ``[U x d]`` against items ``[N x d]``: the loss's
        logits (cosine similarity when ``l2_normalize``; the temperature does not change ranks)."""
        if self.config.l2_normalize:
            user, items = F.normalize(user, dim=-1), F.normalize(items, dim=-1)
        return user @ items.t()

    def _softmax_loss(self, user: torch.Tensor, label_emb: torch.Tensor, label_ids: torch.Tensor,
                      neg_emb: torch.Tensor, neg_ids: torch.Tensor, owner: torch.Tensor | None = None,
                      lay: JaggedLayout | None = None) -> torch.Tensor:
        """Per-position sampled-softmax cross-entropy ``[P]`` (module docstring).

        ``owner`` ``[P]`` int64: with per-sample negatives (``neg_emb`` ``[B*K x d]``), the input
        sample index of each position; None: ``neg_emb`` ``[K x d]`` is shared. ``lay``: the
        positions are every token in ``lay``'s sorted order (the all-positions objective), so their
        logits are one padded batched matmul instead of a gather of ``[P x K x d]``.
        """
        cfg = self.config
        if cfg.l2_normalize:
            user, label_emb, neg_emb = (F.normalize(t, dim=-1) for t in (user, label_emb, neg_emb))
        pos_logit = (user * label_emb).sum(-1, keepdim=True)  # [P x 1]
        if owner is None:
            neg_logit = user @ neg_emb.t()  # [P x K]
            hit = label_ids[:, None] == neg_ids[None, :]
        else:
            K = cfg.num_negatives
            neg = neg_emb.view(-1, K, neg_emb.shape[-1])
            neg_logit = (self._per_sample_logits(user, neg, owner) if lay is None
                         else self._per_sample_logits_jagged(user, neg, lay))
            hit = label_ids[:, None] == neg_ids.view(-1, K).index_select(0, owner)
        neg_logit = neg_logit.masked_fill(hit, float("-inf"))
        logits = torch.cat([pos_logit, neg_logit], dim=1) / cfg.temperature
        return torch.logsumexp(logits, dim=1) - logits[:, 0]

    @staticmethod
    def _per_sample_logits(user: torch.Tensor, neg: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """``[P x K]`` logits of positions ``user`` ``[P x d]`` against their sample's negatives
        ``neg`` ``[B x K x d]``, in chunks (the gathered ``[P x K x d]`` never exists whole)."""
        out = []
        for a in range(0, user.shape[0], 4096):
            o = owner[a:a + 4096]
            out.append(torch.bmm(neg.index_select(0, o), user[a:a + 4096].unsqueeze(2)).squeeze(2))
        return torch.cat(out)

    @staticmethod
    def _per_sample_logits_jagged(user: torch.Tensor, neg: torch.Tensor, lay: JaggedLayout) -> torch.Tensor:
        """:meth:`_per_sample_logits` for every token of ``lay`` (``user`` ``[T x d]`` in its sorted
        order): the tokens padded to ``[B x Lmax x d]``, one ``bmm`` with the sorted samples'
        negatives ``[B x d x K]``, back to jagged ``[T x K]``."""
        lmax = lay.lengths_list[-1] if lay.lengths_list else 0
        padded = torch.ops.fbgemm.jagged_to_padded_dense(user, [lay.offsets], [lmax])  # [B x Lmax x d]
        logits = torch.bmm(padded, neg.index_select(0, lay.perm).transpose(1, 2))  # [B x Lmax x K]
        return torch.ops.fbgemm.dense_to_jagged(logits, [lay.offsets])[0]

    def forward(self, hist: torch.Tensor, lengths: torch.Tensor, target_emb: torch.Tensor, neg_emb: torch.Tensor,
                target_ids: torch.Tensor, neg_ids: torch.Tensor, global_num_samples: int, *,
                hist_ids: torch.Tensor | None = None, global_num_tokens: int = -1,
                sample_ids: torch.Tensor | None = None, step: int | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Loss of one rank's batch.

        Args:
            hist: ``[T x d]`` float: history embeddings, jagged by ``lengths``.
            lengths: ``[B]`` int64, each in ``1..max_seq_len``.
            target_emb: ``[B x d]`` float.
            neg_emb: ``[K x d]`` float: the step's shared negatives (``[B*K x d]``, sample by
                sample in input order, with ``negatives="sample"``).
            target_ids: ``[B]`` int64.
            neg_ids: ``[K]`` (or ``[B*K]``) int64.
            global_num_samples: samples of this step over all ranks (``last-position`` normaliser).
            hist_ids: ``[T]`` int64 history item ids (``all-positions``: the labels).
            global_num_tokens: history items of this step over all ranks (``all-positions``
                normaliser; -1: this batch's own count, exact for world size 1).
            sample_ids, step: key the dropout masks (:meth:`encode_tokens`).

        Returns:
            ``(loss, (loss_sum, num_supervised))``: ``loss`` = sum of per-position cross-entropies
            / the global supervised count (scalar, differentiable); ``loss_sum`` detached;
            ``num_supervised`` = P as a tensor (B or T).

        Raises:
            ConfigError: a history is longer than ``max_seq_len``; ``all-positions`` without ``hist_ids``.
        """
        lay = self.layout(lengths, hist.device)
        out = self.encode_tokens(hist, lay, sample_ids=sample_ids, step=step)
        per_sample = self.config.negatives == "sample" and self.config.num_negatives > 0
        with record_function("## dense_loss ##"):
            if self.config.objective == "last-position":
                user = out.index_select(0, lay.offsets[1:] - 1)
                per = self._softmax_loss(user, target_emb.index_select(0, lay.perm),
                                         target_ids.index_select(0, lay.perm), neg_emb, neg_ids,
                                         lay.perm if per_sample else None)
                norm = global_num_samples
            else:
                if hist_ids is None:
                    raise ConfigError("the all-positions objective needs the history ids (hist_ids)")
                T, B = hist.shape[0], target_emb.shape[0]
                # label of input token t: token t+1 of the same history, or the target for the last one
                src = torch.arange(1, T + 1, device=hist.device)
                ends = torch.cumsum(lengths.to(hist.device), 0) - 1
                src[ends] = T + torch.arange(B, device=hist.device)
                src = src.index_select(0, lay.token_index)
                label_emb = torch.cat([hist, target_emb]).index_select(0, src)
                label_ids = torch.cat([hist_ids.to(hist.device), target_ids]).index_select(0, src)
                owner = None
                if per_sample:  # input sample index of each sorted token
                    owner = torch.repeat_interleave(lay.perm, torch.tensor(lay.lengths_list, device=hist.device))
                per = self._softmax_loss(out, label_emb, label_ids, neg_emb, neg_ids, owner, lay if per_sample else None)
                norm = global_num_tokens if global_num_tokens >= 0 else T
            loss_sum = per.sum()
        return loss_sum / max(norm, 1), (loss_sum.detach(), torch.tensor(per.shape[0]))


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
            ``(loss, (loss_sum, num_supervised))`` as :meth:`DenseTower.forward`.
        """
        hist, tgt, neg = self.sparse_forward(batch.features)
        f = batch.features
        return self.dense(hist, f[HISTORY_KEY].lengths(), tgt, neg, batch.target_ids, f[NEGATIVE_KEY].values(),
                          batch.global_num_samples, **objective_inputs(batch))


def objective_inputs(batch: Batch) -> dict:
    """The keyword arguments of :meth:`DenseTower.forward` beyond the lookups, from ``batch``: the
    ``all-positions`` objective's ``hist_ids`` and ``global_num_tokens``, and the dropout keys'
    ``sample_ids`` and ``step``; one place for every step function."""
    return {"hist_ids": batch.features[HISTORY_KEY].values(), "global_num_tokens": batch.global_num_tokens,
            "sample_ids": batch.sample_ids, "step": batch.step}
