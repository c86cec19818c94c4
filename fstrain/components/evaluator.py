"""Held-out evaluation: HR@K and NDCG@K over the full item vocabulary (docs/fstrain.md, "Evaluation").

Protocol (leave-one-out, as SASRec/BERT4Rec; the evaluation file comes from
``fsdata convert --holdout last --holdout-output EVAL.parquet``, docs/format.md): for every
held-out user the model encodes the history, scores **every** item id ``0 .. num_items-1`` with
the dot product against the item table (the training loss's logit), and the held-out item's rank
among the candidates gives

* ``HR@K``   = mean over users of ``[rank < K]``,
* ``NDCG@K`` = mean over users of ``[rank < K] / log2(rank + 2)`` (one relevant item, so the
  ideal DCG is 1; Järvelin & Kekäläinen 2002),
* ``MRR``    = mean over users of ``1 / (rank + 1)`` (over the full ranking, no cutoff),

reported for K = 10 and 50 (and any other ``k`` asked for),
with ``rank`` 0-based. SASRec's original protocol ranks the target among 100 sampled negatives;
we rank against the full vocabulary (no sampling noise, and sampled metrics can disagree with
full ones: Krichene & Rendle, KDD 2020), so our numbers are lower than sampled ones.

Candidates excluded: the padding id (``padding_id``, default 0: item ids start at 1 in the
SASRec/BERT4Rec datasets; id 0 is never an item), and, with ``mask_history`` (default), the items
of the user's (capped) history other than the target itself. Masking follows SASRec's and
BERT4Rec's negatives, which never include items the user interacted with; a next-item model gives
the user's own recent items high scores, which would otherwise push rarely repeated targets down.
Ties count against the target (``rank = #(score > s_t) + #(score == s_t) - 1``), so a constant
model scores ``HR@K = 0`` rather than 1.

Distributed: :class:`Evaluator` splits the users over ranks (equal batch counts, every batch
non-empty, because the item-table lookup is a collective on a row-wise sharded table), and
all-reduces the sums; every rank returns the same result.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fsdata.samples import schema
from fstrain.data.batch import HISTORY_KEY, TARGET_KEY
from fstrain.components.ranking import DEFAULT_K, REPORTED_KS, hr_ndcg_sums, mask_scores, mrr_sum, target_ranks
from fstrain.components.schedule import StepSchedule
from fstrain.errors import ConfigError
from fstrain.models.config import NEGATIVE_KEY

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class EvaluateConfig:
    """``fstrain evaluate``: HR@K and NDCG@K of a checkpoint (:func:`evaluate_checkpoint`)."""

    k: int = DEFAULT_K
    """Cutoff K of HR@K and NDCG@K."""
    batch_size: int = 256
    """Users per scoring batch."""
    mask_history: bool = True
    """Mask the user's history items out of the candidates, as SASRec's negatives
    (``--no-mask-history``: keep them among the candidates)."""
    padding_id: int = 0
    """Item id excluded from the candidates (-1: none)."""
    max_users: int | None = None
    """Evaluate a fixed seeded sample of this many users (``None``: all)."""
    backend: str = "auto"
    """Process-group backend when run under torchrun."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.batch_size < 1:
            raise ConfigError(f"--k and --batch-size must be >= 1, got {self.k} and {self.batch_size}")

@dataclass(slots=True)
class EvalData:
    """An evaluation file in memory (docs/format.md, "Evaluation file").

    Attributes:
        path: the file.
        user_ids: ``[U]`` int64.
        values: ``[T]`` int64 histories concatenated (chronological).
        offsets: ``[U+1]`` int64 into ``values``.
        target_ids: ``[U]`` int64.
        actions: ``[T]`` int64 action codes aligned with ``values`` (a model's action input), or None.
    """

    path: str
    user_ids: np.ndarray
    values: np.ndarray
    offsets: np.ndarray
    target_ids: np.ndarray
    actions: np.ndarray | None = None

    @property
    def num_users(self) -> int:
        """U."""
        return len(self.target_ids)

    def subsample(self, max_users: int | None, seed: int = 0) -> "EvalData":
        """At most ``max_users`` users, drawn without replacement by a generator seeded with ``seed``
        (kept in file order), so every run evaluates the same users; ``None`` or enough users: self.

        SASRec evaluates 10,000 sampled users when a dataset has more (its ``evaluate``).
        """
        if max_users is None or max_users >= self.num_users:
            return self
        if max_users < 1:
            raise ConfigError(f"--eval-max-users must be >= 1, got {max_users}")
        keep = np.sort(np.random.default_rng(seed).choice(self.num_users, max_users, replace=False))
        lengths = self.offsets[keep + 1] - self.offsets[keep]
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate([self.values[self.offsets[i]:self.offsets[i + 1]] for i in keep])
        actions = (None if self.actions is None else
                   np.concatenate([self.actions[self.offsets[i]:self.offsets[i + 1]] for i in keep]))
        return EvalData(self.path, self.user_ids[keep], values, offsets, self.target_ids[keep], actions)

    def max_item_id(self) -> int:
        """Largest id in histories and targets."""
        return int(max(self.values.max(initial=-1), self.target_ids.max(initial=-1)))


def load_eval_data(path: str, action_column: str | None = None) -> EvalData:
    """Read and validate an evaluation file.

    Args:
        path: the file.
        action_column: also read this feature column (list of integer codes aligned with
            ``item_ids``) as :attr:`EvalData.actions`, for a model with an action input.

    Raises:
        ConfigError: missing or unreadable file, missing columns, no rows, an empty history,
            negative ids, or an action column that is missing or not aligned.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"evaluation file {path} not found; write one with "
                          "`fsdata convert ... --holdout last --holdout-output EVAL.parquet`")
    try:
        t = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"evaluation file {path} is not readable Parquet ({str(e).splitlines()[0]}); "
                          "re-create it with fsdata convert --holdout last") from None
    missing = [c for c in (schema.USER_ID, schema.ITEM_IDS, schema.TARGET_ITEM_ID) if c not in t.column_names]
    if missing:
        raise ConfigError(f"evaluation file {path} lacks columns {missing}; expected user_id, item_ids, "
                          "target_item_id (fsdata convert --holdout last writes them)")
    if t.num_rows == 0:
        raise ConfigError(f"evaluation file {path} has no rows; no user had an item to hold out")
    hist = t.column(schema.ITEM_IDS).combine_chunks()
    if hist.null_count or t.column(schema.TARGET_ITEM_ID).null_count:
        raise ConfigError(f"evaluation file {path} has null histories or targets; re-create it")
    lengths = hist.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    if (lengths < 1).any():
        raise ConfigError(f"evaluation file {path}: user row {int(np.argmin(lengths))} has an empty history; "
                          "every evaluated user needs at least one history item")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = hist.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    targets = t.column(schema.TARGET_ITEM_ID).to_numpy().astype(np.int64)
    if values.min(initial=0) < 0 or targets.min(initial=0) < 0:
        raise ConfigError(f"evaluation file {path} has negative item ids; ids must be in 0..num_items-1")
    actions = None
    if action_column is not None:
        if action_column not in t.column_names:
            raise ConfigError(f"evaluation file {path} lacks the action column {action_column!r} the model reads; "
                              f"convert it with fsdata convert --feature-cols {action_column}")
        acol = t.column(action_column).combine_chunks()
        if (not pa.types.is_list(acol.type) or not pa.types.is_integer(acol.type.value_type)
                or not np.array_equal(acol.value_lengths().to_numpy(zero_copy_only=False), lengths)):
            raise ConfigError(f"evaluation file {path}: {action_column} is not a list of integer codes aligned with "
                              "item_ids; re-create it with fsdata convert --feature-cols")
        actions = acol.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return EvalData(path, t.column(schema.USER_ID).to_numpy().astype(np.int64), values, offsets, targets, actions)


def _split(num_users: int, world_size: int, rank: int, batch_size: int) -> list[np.ndarray]:
    """This rank's user batches: the same count on every rank, none empty."""
    if num_users < world_size:
        raise ConfigError(f"the evaluation file has {num_users} users but the job has {world_size} ranks; "
                          "evaluate with fewer ranks or a larger file")
    part = np.array_split(np.arange(num_users), world_size)[rank]
    largest = math.ceil(num_users / world_size)
    num_batches = math.ceil(largest / batch_size)
    return [b for b in np.array_split(part, num_batches)]


def _kjt(hist_values: torch.Tensor, hist_lengths: torch.Tensor, targets: torch.Tensor,
         extra_ids: torch.Tensor) -> KeyedJaggedTensor:
    B = len(hist_lengths)
    neg_lengths = torch.zeros(B, dtype=torch.int64)
    neg_lengths[0] = len(extra_ids)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[HISTORY_KEY, TARGET_KEY, NEGATIVE_KEY], values=torch.cat([hist_values, targets, extra_ids]),
        lengths=torch.cat([hist_lengths, torch.ones(B, dtype=torch.int64), neg_lengths]), stride=B)


@torch.no_grad()
def evaluate_model(model, data: EvalData, *, num_items: int, k: int = DEFAULT_K, batch_size: int = 256,
                   mask_history: bool = True, padding_id: int = 0, device: torch.device | None = None,
                   rank: int = 0, world_size: int = 1) -> dict:
    """HR@k and NDCG@k of ``model`` on ``data`` (module docstring for the protocol).

    Args:
        model: a :class:`fstrain.models.recommender.SequentialRecommender` (plain, or ``dmp.module`` of a
            sharded one: every rank must call this together).
        data: from :func:`load_eval_data`.
        num_items: N, rows of the item table (candidates ``0..N-1``).
        k: cutoff K.
        batch_size: users encoded per batch.
        mask_history: exclude history items other than the target from the candidates.
        padding_id: excluded candidate id (negative: none).
        device: where the model lives (default: CPU).
        rank, world_size: this process's share of the users (sums are all-reduced when > 1).

    Returns:
        ``{"hr@K", "ndcg@K" for K in {k, 10, 50}, "mrr", "num_users", "num_candidates", "k",
        "mask_history", "eval_seconds"}``.

    Raises:
        ConfigError: an id is outside ``0..num_items-1``, a target is the padding id, or a
            history is longer than the model's ``max_seq_len``.
    """
    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    if data.max_item_id() >= num_items:
        raise ConfigError(f"evaluation file {data.path} has item id {data.max_item_id()} but the model has "
                          f"num_items {num_items}; evaluate a model trained on the same id space")
    if padding_id >= 0 and (data.target_ids == padding_id).any():
        raise ConfigError(f"evaluation file {data.path} has target item id {padding_id}, which is excluded as "
                          "padding; pass --padding-id -1 if id 0 is a real item")
    was_training = model.training
    model.eval()
    all_ids = torch.arange(num_items, dtype=torch.int64)
    ks = sorted({k, *REPORTED_KS})
    sums = np.zeros(2 * len(ks) + 1, dtype=np.float64)  # hr@k..., ndcg@k..., mrr
    n_users = 0
    items = None
    for idx in _split(data.num_users, world_size, rank, batch_size):
        lengths = torch.from_numpy(data.offsets[idx + 1] - data.offsets[idx])
        values = torch.from_numpy(np.concatenate([data.values[data.offsets[i]:data.offsets[i + 1]] for i in idx]))
        targets = torch.from_numpy(data.target_ids[idx])
        kjt = _kjt(values, lengths, targets, all_ids if items is None else all_ids[:0]).to(device)
        hist, _, cand = model.sparse_forward(kjt)
        if items is None:
            items = cand  # [N x d]: the whole table, looked up once per evaluation
        actions = (None if data.actions is None else torch.from_numpy(
            np.concatenate([data.actions[data.offsets[i]:data.offsets[i + 1]] for i in idx])).to(device))
        user = model.dense.user_vectors(hist, kjt[HISTORY_KEY].lengths(), actions)  # [b x d]
        scores = model.dense.scores(user, items).to(torch.float32)  # [b x N]
        mask_scores(scores, targets.to(device), values, lengths, mask_history=mask_history, padding_id=padding_id)
        ranks = target_ranks(scores, targets.to(device))
        for i, kk in enumerate(ks):
            sums[i], sums[len(ks) + i] = np.add((sums[i], sums[len(ks) + i]), hr_ndcg_sums(ranks, kk))
        sums[-1] += mrr_sum(ranks)
        n_users += len(idx)
    if world_size > 1:
        t = torch.tensor([*sums, float(n_users)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        sums, n_users = t[:-1].cpu().numpy(), int(t[-1])
    model.train(was_training)
    candidates = num_items - (1 if 0 <= padding_id < num_items else 0)
    out = {}
    for i, kk in enumerate(ks):
        out[f"hr@{kk}"] = float(sums[i]) / n_users
        out[f"ndcg@{kk}"] = float(sums[len(ks) + i]) / n_users
    out["mrr"] = float(sums[-1]) / n_users
    return {**out, "num_users": n_users, "num_candidates": candidates, "k": k, "mask_history": mask_history,
            "eval_seconds": time.perf_counter() - t0}


def item_counts(samples_path: str, num_items: int | None = None) -> np.ndarray:
    """Interactions per item in a training-sample file (``item_ids`` and ``target_item_id``).

    Per-user samples count every interaction once; per-event samples repeat a history in every
    later sample, so count their targets only for a popularity ranking.

    Args:
        samples_path: an ``fsdata convert`` output.
        num_items: length of the result (default: max id + 1).

    Returns:
        ``[N]`` int64 counts.

    Raises:
        ConfigError: the file lacks ``item_ids`` / ``target_item_id``.
    """
    t = pq.read_table(samples_path, columns=[schema.ITEM_IDS, schema.TARGET_ITEM_ID])
    targets = t.column(schema.TARGET_ITEM_ID).to_numpy().astype(np.int64)
    hist = t.column(schema.ITEM_IDS).combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    ids = np.concatenate([hist, targets])
    n = int(max(num_items or 0, ids.max(initial=-1) + 1))
    return np.bincount(ids, minlength=n).astype(np.int64)


def evaluate_popularity(data: EvalData, counts: np.ndarray, *, k: int = DEFAULT_K, mask_history: bool = True,
                        padding_id: int = 0, batch_size: int = 1024) -> dict:
    """The popularity ranking (every user scores items by training interaction count) under the
    protocol of :func:`evaluate_model`: the baseline a trained model must beat.

    Args:
        data: from :func:`load_eval_data`.
        counts: ``[N]`` interactions per item (:func:`item_counts`); ties count against the target.
        k, mask_history, padding_id, batch_size: as :func:`evaluate_model`.

    Returns:
        ``{"hr@K", "ndcg@K", "mrr", "num_users", ...}`` as :func:`evaluate_model`.
    """
    t0 = time.perf_counter()
    num_items = len(counts)
    if data.max_item_id() >= num_items:
        raise ConfigError(f"evaluation file {data.path} has item id {data.max_item_id()} beyond the counts' "
                          f"{num_items} items")
    ks = sorted({k, *REPORTED_KS})
    sums = np.zeros(2 * len(ks) + 1, dtype=np.float64)
    base = torch.from_numpy(counts.astype(np.float32))
    for a in range(0, data.num_users, batch_size):
        idx = np.arange(a, min(a + batch_size, data.num_users))
        lengths = torch.from_numpy(data.offsets[idx + 1] - data.offsets[idx])
        values = torch.from_numpy(data.values[data.offsets[idx[0]]:data.offsets[idx[-1] + 1]])
        targets = torch.from_numpy(data.target_ids[idx])
        scores = base.repeat(len(idx), 1)
        mask_scores(scores, targets, values, lengths, mask_history=mask_history, padding_id=padding_id)
        ranks = target_ranks(scores, targets)
        for i, kk in enumerate(ks):
            sums[i], sums[len(ks) + i] = np.add((sums[i], sums[len(ks) + i]), hr_ndcg_sums(ranks, kk))
        sums[-1] += mrr_sum(ranks)
    n = data.num_users
    out = {f"hr@{kk}": float(sums[i]) / n for i, kk in enumerate(ks)}
    out |= {f"ndcg@{kk}": float(sums[len(ks) + i]) / n for i, kk in enumerate(ks)}
    return {**out, "mrr": float(sums[-1]) / n, "num_users": n, "k": k, "mask_history": mask_history,
            "eval_seconds": time.perf_counter() - t0}


class Evaluator:
    """Periodic held-out evaluation during :func:`fstrain.train.train` (``--eval-every-steps``).

    Call :meth:`maybe_run` after every step and :meth:`finish` at the end; rank 0 keeps the
    records (one per evaluation), which ``train`` writes to ``metrics_dir/eval.parquet`` and the
    summary's ``eval`` list.

    Args:
        path: the evaluation file.
        schedule: when to evaluate besides the end (:class:`fstrain.components.schedule.StepSchedule`:
            a period on the global step, epoch ends; records carry ``step`` of the shards,
            ``global_step`` and ``epoch`` of the shards from it); default: only at the end.
        num_items: model's table rows.
        rank, world_size, device: the job's.
        k, batch_size, mask_history, padding_id: as :func:`evaluate_model`.
        max_users: evaluate a fixed seeded sample of this many users (:meth:`EvalData.subsample`).
        action_column: the model's action input column, read from the evaluation file too.
    """

    def __init__(self, path: str, *, schedule: StepSchedule = StepSchedule(), num_items: int, rank: int,
                 world_size: int,
                 device: torch.device, k: int = DEFAULT_K, batch_size: int = 256, mask_history: bool = True,
                 padding_id: int = 0, max_users: int | None = None, action_column: str | None = None) -> None:
        if schedule.every_steps < 0:
            raise ConfigError(f"--eval-every-steps must be >= 0, got {schedule.every_steps}")
        self.data = load_eval_data(path, action_column).subsample(max_users)
        if self.data.max_item_id() >= num_items:
            raise ConfigError(f"evaluation file {path} has item id {self.data.max_item_id()} but the model has "
                              f"num_items {num_items}; pass --num-items {self.data.max_item_id() + 1}")
        _split(self.data.num_users, world_size, rank, batch_size)  # too few users for the ranks: fail now
        self.schedule = schedule
        self.kw = dict(num_items=num_items, k=k, batch_size=batch_size, mask_history=mask_history,
                       padding_id=padding_id, device=device, rank=rank, world_size=world_size)
        self.records: list[dict] = []
        self.last_step = -1

    def run(self, model, step: int) -> dict:
        """Evaluate now (every rank together) and record the result for ``step`` steps done."""
        epoch = self.schedule.epoch(step)
        res = {"step": step, "global_step": self.schedule.global_step(step), "epoch": epoch,
               **evaluate_model(model, self.data, **self.kw)}
        self.records.append(res)
        self.last_step = step
        k = self.kw["k"]
        if self.kw["rank"] == 0:
            logger.info("eval %s%s HR@%d %.4f NDCG@%d %.4f HR@50 %.4f NDCG@50 %.4f MRR %.4f (%d users, %.1fs)",
                        self.schedule.label(step), "" if epoch is None else f" (epoch {epoch:g})", k, res[f"hr@{k}"],
                        k, res[f"ndcg@{k}"], res["hr@50"], res["ndcg@50"], res["mrr"], res["num_users"],
                        res["eval_seconds"])
        return res

    def due(self, step: int) -> bool:
        """Whether the schedule evaluates after ``step`` steps of the shards (not twice at one step)."""
        return step != self.last_step and self.schedule.due(step)

    def maybe_run(self, model, step: int) -> dict | None:
        """Evaluate when :meth:`due`."""
        return self.run(model, step) if self.due(step) else None

    def after_step(self, model, step: int, flush=None) -> dict | None:
        """The training loop's call after each step: when :meth:`due`, ``flush()`` (a pipeline's
        deferred update, so the parameters are this step's) and evaluate; else None."""
        if not self.due(step):
            return None
        if flush is not None:
            flush()
        return self.run(model, step)

    def best(self, metric: str | None = None) -> dict | None:
        """The record with the highest ``metric`` (default ``ndcg@K``; the first one on ties), or None."""
        metric = metric or f"ndcg@{self.kw['k']}"
        return max(self.records, key=lambda r: r[metric], default=None)

    def finish(self, model, step: int) -> dict | None:
        """Evaluate at the end unless ``step`` was just evaluated."""
        return None if step == self.last_step else self.run(model, step)

    def write(self, path: str) -> None:
        """Write the records as Parquet (one row per evaluation)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self.records), path)


def evaluate_checkpoint(checkpoint: str, eval_path: str, config: EvaluateConfig | None = None, *,
                        model: dict | None = None) -> dict:
    """Evaluate a ``fstrain train`` checkpoint on an evaluation file (``fstrain evaluate``).

    The model is rebuilt exactly as in training (:func:`fstrain.distributed.sharding.build_sharded_model`, the
    job's world size: 1 without torchrun) and its weights loaded with
    torch.distributed.checkpoint, which reshards the table when the world size differs.

    Args:
        checkpoint: a ``ckpt/step-XXXXXXXX`` folder.
        eval_path: evaluation file.
        model: :class:`fstrain.models.config.Config` keyword arguments; default: the ones recorded in the
            checkpoint's ``fstrain.json`` (checkpoints written before that was recorded need them).
        config: :class:`EvaluateConfig` (default: its defaults); ``backend`` as
            :func:`fstrain.distributed.env.init_distributed`, ``max_users`` as :meth:`EvalData.subsample`.

    Returns:
        :func:`evaluate_model`'s dict plus ``checkpoint`` and ``step``.

    Raises:
        FstrainError / ConfigError: not a checkpoint, no model config, or a bad evaluation file.
    """
    from dataclasses import replace

    from fstrain.components.checkpoint import load_model_weights, read_checkpoint_meta
    from fstrain.data.manifest import recorded_num_items_of
    from fstrain.distributed.backends import resolve_backend
    from fstrain.distributed.env import init_distributed
    from fstrain.distributed.optim import OptimConfig
    from fstrain.distributed.sharding import build_sharded_model
    from fstrain.models.config import Config

    config = config or EvaluateConfig()
    config = replace(config, backend=resolve_backend(config.backend))  # auto decided once, here
    meta = read_checkpoint_meta(checkpoint)
    kw = dict(meta.get("model") or {})
    kw.update(model or {})
    if "num_items" not in kw and (n := recorded_num_items_of(meta.get("shards"), eval_path)) is not None:
        kw["num_items"] = n
    if "num_items" not in kw:
        raise ConfigError(f"{checkpoint} does not record its model config; pass the training model flags "
                          "(--num-items, --embedding-dim, --num-layers, --num-heads, --max-seq-len)")
    cfg = Config(**kw)
    data = load_eval_data(eval_path, cfg.action_column if cfg.uses_actions else None).subsample(config.max_users)
    if data.max_item_id() >= kw["num_items"]:  # before any process group or model exists
        raise ConfigError(f"evaluation file {eval_path} has item id {data.max_item_id()} but {checkpoint} has "
                          f"num_items {kw['num_items']}; evaluate it on held-out data of the conversion it was "
                          "trained on")
    env = init_distributed(config.backend)
    torch.manual_seed(0)  # the initial table is overwritten by the checkpoint
    dmp, _ = build_sharded_model(cfg, OptimConfig(), env)
    load_model_weights(dmp, checkpoint, kw)
    res = evaluate_model(dmp.module, data, num_items=cfg.num_items, k=config.k, batch_size=config.batch_size,
                         mask_history=config.mask_history, padding_id=config.padding_id, device=env.device,
                         rank=env.rank, world_size=env.world_size)
    return {"checkpoint": checkpoint, "step": meta.get("step"), **res}
