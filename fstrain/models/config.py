"""The model's settings (:class:`Config`) and the names fstrain's models, objectives and tables use."""

from __future__ import annotations

from dataclasses import dataclass

from fsdata.common.registry import Registry
from fstrain.errors import ConfigError

NEGATIVE_KEY = "negative_item_ids"
TABLE_NAME = "item_table"


#: ``Config.model``: the transformer families fstrain trains, each its block class registered under its
#: name (:class:`fstrain.models.sasrec.Block`, :class:`fstrain.models.hstu.HSTUBlock`, registered when
#: :mod:`fstrain.models` is imported); iterating it gives the names (``--model``'s choices). A block
#: class has ``from_config(config)`` (one block), ``check_config(config)`` (its own size rules, run
#: by :class:`Config`), ``final_norm`` (a LayerNorm after the last block) and ``actions_by_default``
#: (reads the shards' action column without ``--action-column``).
MODELS: Registry = Registry("model", "--model")
#: ``Config.objective`` names; ``fstrain train`` picks one from the manifest's sample kind.
OBJECTIVES = ("all-positions", "last-position")
#: ``Config.negatives``: who shares the sampled negatives.
NEGATIVE_MODES = ("step", "sample")
#: ``Config.attention``: how attention runs over jagged sequences.
ATTENTIONS = ("bucketed", "reference")
#: ``Config.action_column`` value that turns the action input off.
NO_ACTIONS = "none"
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

    num_items: int | None = None
    """Rows of the item table (max item id + 1); ``None``: read from the data (``fstrain train``
    takes the shards' max id + 1). A model cannot be built before it is known."""
    model: str = "sasrec"
    """``sasrec`` (causal softmax attention + feed-forward) or ``hstu`` (:mod:`fstrain.models.hstu`)."""
    objective: str | None = None
    """``all-positions`` (next item at every history position) or ``last-position``; ``None``:
    from the data (``fstrain train``: the manifest's sample kind, per-user: all-positions,
    per-event: last-position; a model built without data: all-positions)."""
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
    action_column: str | None = None
    """Feature column (manifest ``feature_columns``: a list of integer codes aligned with
    ``item_ids``, e.g. ``action``) whose embedding is summed into the input at every position, as
    HSTU's action input; ``None``: ``fstrain train`` takes ``action``, else the first integer
    feature column, for ``hstu``, and none for ``sasrec``; ``none``: off."""
    num_actions: int | None = None
    """Rows of the action table (largest code + 1); ``None``: read from the shards' statistics."""

    @property
    def uses_actions(self) -> bool:
        """Whether the model has an action input (an action column and its table size are set)."""
        return self.action_column not in (None, NO_ACTIONS) and self.num_actions is not None

    def __post_init__(self) -> None:
        if self.num_items is not None and self.num_items < 2:
            raise ConfigError(f"num_items must be >= 2, got {self.num_items}")
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; use one of {', '.join(MODELS)}")
        if self.objective is not None and self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.objective!r}; use one of {', '.join(OBJECTIVES)}")
        if self.embedding_dim % 4:
            up = -(-self.embedding_dim // 4) * 4
            raise ConfigError(f"embedding_dim must be a multiple of 4 (fbgemm's table-batched embeddings store rows "
                              f"in 4-float units), got {self.embedding_dim}; use {up}")
        MODELS.get(self.model).check_config(self)
        if self.attention not in ATTENTIONS:
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
        if self.num_actions is not None and self.num_actions < 1:
            raise ConfigError(f"num_actions must be >= 1, got {self.num_actions}")

    def for_data(self, manifest=None, num_items: int | None = None) -> Config:
        """A copy with ``num_items`` and ``objective`` decided: the ones set here win, else
        ``num_items`` (e.g. the shards' max id + 1) and :func:`objective_for` the manifest
        (``all-positions`` without one)."""
        from dataclasses import replace

        objective = self.objective or (objective_for(manifest) if manifest is not None else "all-positions")
        return replace(self, num_items=self.num_items if self.num_items is not None else num_items,
                       objective=objective)

    @property
    def head_dims(self) -> tuple[int, int]:
        """``hstu``: ``(attention_dim, linear_dim)`` per head, defaults resolved."""
        d = self.embedding_dim // self.num_heads
        return self.attention_dim or d, self.linear_dim or d


def objective_for(manifest) -> str:
    """The objective the field trains the manifest's samples with (:data:`OBJECTIVE_FOR_SAMPLES`):
    ``all-positions`` for ``per-user`` samples, else ``last-position`` (per-event, or samples made
    without ``fsdata convert``, whose kind the manifest cannot say).

    Args:
        manifest: a :class:`fsdata.shards.manifest.Manifest` (its ``settings["samples"]``).
    """
    kind = (manifest.settings or {}).get("samples")
    return OBJECTIVE_FOR_SAMPLES.get(kind, "last-position")
