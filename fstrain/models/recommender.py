"""SASRec and HSTU sequential recommenders over jagged histories, with the field's objectives.

Structure (what torchrec's pipelines expect): :class:`SequentialRecommender` owns an
``EmbeddingCollection`` ``ec`` (one item table, looked up for the history, the target and the
shared negatives; sharded row-wise by :mod:`fstrain.distributed.sharding`) called on ``batch.features`` (a KJT),
and a purely data-parallel :class:`DenseTower` ``dense``. ``forward(batch)`` returns
``(loss, (loss_sum, num_supervised))`` like torchrec's examples, so ``TrainPipelineSparseDist``
can drive it; ``dense`` is also callable on its own (:func:`fstrain.pipelines.loop.measured_step` splits
the backward there to time compute apart from waiting).

Models (``Config.model``), both on the jagged values ``[T x d]`` (no padding outside attention):

* ``sasrec``: ``num_layers`` pre-LayerNorm transformer blocks with causal softmax self-attention
  and dropout (Kang & McAuley, ICDM 2018; the input is ``sqrt(d) * item + position`` then dropout,
  as generative-recommenders' ``LearnablePositionalEmbeddingInputFeaturesPreprocessor``).
  Attention pads only inside power-of-two-like length buckets (like block padding in real jagged
  kernels), using ``torch.ops.fbgemm.jagged_to_padded_dense`` / ``dense_to_jagged``.
* ``hstu``: ``num_layers`` HSTU layers (Zhai et al., ICML 2024, :mod:`fstrain.models.hstu`): pointwise
  SiLU attention normalised by the sequence length bound, U gating, relative position bias, no
  feed-forward; same input embedding.

Action input (``Config.action_column``, off by default for ``sasrec``): an embedding of each
history position's action code (a feature column aligned with ``item_ids``) summed into the input,
``sqrt(d) * item + position + action``, as HSTU conditions on the actions beside the items
(generative-recommenders' ``ActionEncoder``); the sequence length is unchanged.

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
by ``(seed, step, sample_id, position)`` (:mod:`fstrain.models.dropout`), so that holds with dropout too.

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

from fstrain.data.batch import HISTORY_KEY, TARGET_KEY, Batch
from fstrain.models.dropout import DropoutKeys, KeyedDropout, token_keys
from fstrain.errors import ConfigError
from fstrain.models.config import MODELS, NEGATIVE_KEY, TABLE_NAME, Config
from fstrain.models.sasrec import length_buckets  # registers "sasrec" in MODELS
from fstrain.models.hstu import HSTUBlock  # noqa: F401 (registers "hstu" in MODELS)


def make_embedding_collection(config: Config, device: torch.device | None = None) -> EmbeddingCollection:
    """The item table, shared by history, target and negatives (sharded row-wise by DMP)."""
    if config.num_items is None:
        raise ConfigError("the model's num_items is not set; pass --num-items, or Config.for_data(num_items=...) "
                          "(fstrain train reads it from the shards)")
    table = EmbeddingConfig(name=TABLE_NAME, embedding_dim=config.embedding_dim, num_embeddings=config.num_items,
                            feature_names=[HISTORY_KEY, TARGET_KEY, NEGATIVE_KEY])
    return EmbeddingCollection(tables=[table], device=device)


def _make_block(config: Config) -> nn.Module:
    return MODELS.get(config.model).from_config(config)  # the registered block of the family


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
        # action input (Config.action_column): one embedding per action code, summed into every position's input,
        # as generative-recommenders' HSTU encodes actions beside items; none without a feature column
        self.action = None
        if config.uses_actions:
            self.action = nn.Embedding(config.num_actions, config.embedding_dim)
            nn.init.trunc_normal_(self.action.weight, std=math.sqrt(1.0 / config.embedding_dim))
        self.blocks = nn.ModuleList(_make_block(config) for _ in range(config.num_layers))
        self.drop = KeyedDropout(config.dropout, site=0)
        self.dropout_keys = DropoutKeys()  # masks keyed by (seed, step, sample, position): rank-independent
        self.seed = 0  # the run seed in the dropout keys (fstrain.train sets it)
        for site, m in enumerate(m for m in self.modules() if isinstance(m, KeyedDropout)):
            m.site, m.source = site, self.dropout_keys
        # generative-recommenders: SASRec ends with a LayerNorm, HSTU does not
        self.ln_final = nn.LayerNorm(config.embedding_dim) if MODELS.get(config.model).final_norm else nn.Identity()

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
                      step: int | None = None, actions: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs at every history position, in the layout's sorted token order.

        The input at a position is ``sqrt(d) * item + position`` (+ ``action`` embedding of its
        action code when the model has an action input, :attr:`Config.action_column`).

        Args:
            hist: ``[T x d]`` float: history embeddings, jagged in input order.
            lay: from :meth:`layout`.
            actions: ``[T]`` int64 action codes in input order (needed iff the model has an action input).
            sample_ids: ``[B]`` int64 global sample ids (input order) and ``step``: key the dropout
                masks (:mod:`fstrain.models.dropout`) so a sample's masks do not depend on its rank;
                None: ``torch.nn.functional.dropout``.
            step: the global step (with ``sample_ids``).

        Returns:
            ``[T x d]`` float (sorted token order: row ``j`` is input token ``lay.token_index[j]``).

        Raises:
            ConfigError: the model has an action input but ``actions`` is None.
        """
        cfg = self.config
        self.dropout_keys.keys = None
        if self.training and cfg.dropout > 0 and sample_ids is not None and step is not None:
            sorted_ids = sample_ids.to(hist.device).index_select(0, lay.perm)
            per_token = torch.repeat_interleave(sorted_ids, torch.tensor(lay.lengths_list, device=hist.device))
            self.dropout_keys.keys = token_keys(self.seed, step, per_token, lay.positions)
        x = hist.index_select(0, lay.token_index) * math.sqrt(cfg.embedding_dim) + self.pos(lay.positions)
        if self.action is not None:
            if actions is None:
                raise ConfigError(f"the model has an action input ({cfg.action_column!r}) but the batch carries no "
                                  f"{cfg.action_column} values; pass --action-column none to train without it")
            x = x + self.action(actions.to(hist.device).index_select(0, lay.token_index))
        x = self.drop(x)
        with record_function("## dense_blocks ##"):
            for blk in self.blocks:
                x = blk(x, lay.offsets, lay.offsets_list, lay.buckets, lay.lengths_list)
        return self.ln_final(x)

    def encode(self, hist: torch.Tensor, lengths: torch.Tensor,
               actions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """User vectors: the output at each history's last position.

        Args:
            hist: ``[T x d]`` float: history embeddings, jagged by ``lengths``.
            lengths: ``[B]`` int64, each in ``1..max_seq_len``.
            actions: ``[T]`` int64 action codes (models with an action input).

        Returns:
            ``(user, perm)``: ``user`` ``[B x d]`` in length-sorted order, ``perm`` ``[B]`` int64
            (``user[i]`` belongs to input sample ``perm[i]``).

        Raises:
            ConfigError: a history is longer than ``max_seq_len``.
        """
        lay = self.layout(lengths, hist.device)
        out = self.encode_tokens(hist, lay, actions=actions)
        return out.index_select(0, lay.offsets[1:] - 1), lay.perm

    def user_vectors(self, hist: torch.Tensor, lengths: torch.Tensor,
                     actions: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`encode` in input order: ``[B x d]`` float (evaluation, :mod:`fstrain.components.evaluator`)."""
        user, perm = self.encode(hist, lengths, actions)
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
                sample_ids: torch.Tensor | None = None, step: int | None = None,
                hist_actions: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
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
            hist_actions: ``[T]`` int64 action codes of the history (models with an action input).

        Returns:
            ``(loss, (loss_sum, num_supervised))``: ``loss`` = sum of per-position cross-entropies
            / the global supervised count (scalar, differentiable); ``loss_sum`` detached;
            ``num_supervised`` = P as a tensor (B or T).

        Raises:
            ConfigError: a history is longer than ``max_seq_len``; ``all-positions`` without ``hist_ids``.
        """
        lay = self.layout(lengths, hist.device)
        out = self.encode_tokens(hist, lay, sample_ids=sample_ids, step=step, actions=hist_actions)
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
                per = self._softmax_loss(out, label_emb, label_ids, neg_emb, neg_ids, owner,
                                         lay if per_sample else None)
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
    ``sample_ids`` and ``step``, and the action input's ``hist_actions``; one place for every step function."""
    return {"hist_ids": batch.features[HISTORY_KEY].values(), "global_num_tokens": batch.global_num_tokens,
            "sample_ids": batch.sample_ids, "step": batch.step, "hist_actions": batch.actions}
