"""``fsdata balance`` and its three stages: plan, write, finalize (docs/fsdata.md, docs/format.md).

Stages (the input is never held in memory whole):

1. **plan** (:func:`make_plan_table`): read ``item_ids`` lengths and ``sample_id`` (validating
   the input), cost per sample, global batches and the per-step assignment (:mod:`fsdata.balancer.plan`);
   the result is a :class:`PlanTable`: ``sample_id``, ``step``, ``rank``, ``position`` per input
   row plus the settings and predicted figures. ``fsdata plan`` stores it as Parquet
   (:func:`write_plan` / :func:`read_plan`).
2. **write** (:func:`write_ranks`): read the input once, in record batches, and gather every row
   (once per epoch) to its rank group: ranks are cut into contiguous groups whose rows take at most
   :data:`GATHER_BYTES` decoded; the first group stays in memory, the others are spilled to one
   temporary Arrow IPC file each (``--bucket-compression`` is their codec; nothing is spilled when
   the whole input fits). Then per group: one permutation into (rank, step, position) order from
   the plan (no sort), one gather per rank, and ``rank-XXXXX/part-00000.parquet`` written (threads)
   with row groups of whole steps, encoded in memory and hashed before the one write (no re-read).
   Returns one :class:`~fsdata.shards.manifest.FileEntry` per rank (with its tokens per step).
3. **finalize** (:func:`finalize`): ``_step_stats.parquet``, ``_dropped.parquet`` and
   ``_manifest.json`` from the plan and the rank files' records (written last).

:func:`balance` runs the three in one process into a temporary folder moved into place at the end.

INPUT, PLAN and OUTPUT may be :mod:`pyarrow.fs` URIs (``s3://bucket/prefix``; :mod:`fsdata.fsio`):
reads and writes then go through the URI's ``FileSystem``, the temporary spill files go to a
local temporary folder (``TMPDIR``), and OUTPUT is published as :mod:`fsdata.atomic` describes for
object stores (the manifest, written last by :func:`finalize`, is the commit marker).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from fsdata import atomic, fsio
from fsdata._version import __version__
from fsdata.samples import schema as S
from fsdata.atomic import atomic_output, output_taken
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW
from fsdata.balancer.cost import CostModel, load_cost_model
from fsdata.errors import ConfigError, InputError, setting
from fsdata.guards import check_output_apart, raise_if_environment
from fsdata.samples.io import SampleSource, open_samples
from fsdata.shards.manifest import sha256_file  # noqa: F401 (also importable from here, as before)
from fsdata.shards.manifest import write_step_stats as _write_step_stats
from fsdata.shards.manifest import DROPPED_NAME, FORMAT_VERSION, STEP_STATS_NAME, FileEntry, Manifest, rank_dir_name, rank_file_path
from fsdata.shards.manifest import MANIFEST_NAME
from fsdata.balancer.order import SHUFFLE
from fsdata.balancer.plan import DEFAULT_PARTITIONER, DEFAULT_PLAN_WINDOW, Plan, make_plan

log = logging.getLogger(__name__)
_POS = "position"
#: Target rows per Parquet row group in rank files (rounded to whole steps).
ROW_GROUP_ROWS = 16384
#: Version of the plan Parquet's layout (key ``fsdata.balancer.plan`` in its key-value metadata).
PLAN_FORMAT_VERSION = 1
PLAN_METADATA_KEY = b"fsdata.plan"
#: Key-value metadata key of the plan digest (:func:`plan_digest`), in the plan file and in every
#: rank file written from that plan: finalize refuses rank files of another plan.
PLAN_DIGEST_KEY = b"fsdata.plan_digest"
#: Key-value metadata key of the plan file's content checksum (columns and metadata).
PLAN_SHA256_KEY = b"fsdata.plan_sha256"


@dataclass(kw_only=True, slots=True)
class BalanceSettings:
    """Every setting of ``fsdata balance`` (the CLI flags; recorded in the manifest's ``settings``).

    Attributes:
        num_ranks: R (``--ranks``).
        batch_size_per_rank: B (``--batch-size-per-rank``).
        cost_model: ``--cost-model`` spec (used by :func:`balance` / :func:`make_plan_table`).
        columns: ``--columns`` mapping text, or None.
        seed: seed of the global-batch shuffle.
        strategy: ``balanced`` or ``shuffle`` (today's equal-count practice).
        batch_policy: ``fixed`` or ``cost-budget``.
        remainder: ``drop`` (recorded in ``_dropped.parquet``) or ``error``.
        partitioner: per-step method (:data:`fsdata.balancer.plan.PARTITIONERS`).
        budget: cost-budget per-rank per-step budget (None: chosen by the policy).
        num_threads: threads writing rank files (``--num-threads``; does not change the output).
        progress: show progress bars (does not change the output).
        bucket_compression: codec of the temporary Arrow IPC files the write stage spills rank
            groups to when the input's decoded rows exceed :data:`GATHER_BYTES`: None (fastest;
            temporary disk about the decoded size of the spilled rows), ``lz4`` or ``zstd`` (about
            the input's Parquet size; keeps the bytes written under twice the output's).
        overwrite: replace an existing OUTPUT atomically.
        num_workers: deprecated name of ``num_threads``: when given, it sets ``num_threads`` (with a
            ``DeprecationWarning``) and is reset to None.
        engine: ``local`` (this process) or ``ray`` (Ray tasks on a Ray cluster, docs/cluster.md);
            the output is byte-identical either way (not recorded in the manifest).
        ray_address: Ray cluster to join (``ray start`` head ``HOST:PORT``); None: the
            ``RAY_ADDRESS`` environment variable, else a Ray instance started for this run.
        epochs: E (``--epochs``), epochs written one after the other, each with its own seeded
            shuffle and composition (epoch e from :func:`fsdata.balancer.order.epoch_seed`);
            steps are numbered on across epochs. 1: the single-epoch output of fsdata 0.2.
    """

    num_ranks: int
    batch_size_per_rank: int
    cost_model: str = "hstu"
    columns: str | None = None
    seed: int = 0
    strategy: Literal["balanced", "shuffle"] = "balanced"
    batch_policy: Literal["fixed", "cost-budget"] = "fixed"
    remainder: Literal["drop", "error"] = "drop"
    partitioner: str = DEFAULT_PARTITIONER
    budget: float | None = None
    compose_window: int = DEFAULT_COMPOSE_WINDOW
    """W of :mod:`fsdata.balancer.compose` as requested (the plan records the window actually used; 1 = off)."""
    plan_window: int = DEFAULT_PLAN_WINDOW
    """K, steps planned together (``--plan-window``; :class:`fsdata.balancer.plan.PlanLayout`): bounds the
    planning memory per window (the Ray engine plans one window per task)."""
    num_threads: int = 2
    progress: bool = True
    bucket_compression: Literal["lz4", "zstd"] | None = None
    overwrite: bool = False
    engine: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    num_workers: int | None = None
    epochs: int = 1

    def __post_init__(self) -> None:
        if self.num_workers is not None:  # the old name (threads, not processes): still accepted
            warnings.warn("BalanceSettings(num_workers=) is deprecated; use num_threads=", DeprecationWarning,
                          stacklevel=3)
            self.num_threads, self.num_workers = self.num_workers, None


def input_digest(src: SampleSource) -> str:
    """Digest of an input, cheap at any size: SHA-256 over, per file in input order, its size and
    its Parquet footer (schema, row counts, row-group offsets and column statistics).

    Rewriting any file changes its footer in practice; moving the input elsewhere does not change
    the digest (paths are not part of it). Returns ``"sha256-footers:<hex>"``.

    Raises:
        InputError: a file cannot be read.
    """
    h = hashlib.sha256()
    for path in src.files:
        try:
            with fsio.open_input(path) as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                if size < 12:
                    raise OSError("shorter than a Parquet file")
                f.seek(size - 8)
                tail = f.read(8)
                footer_len = int.from_bytes(tail[:4], "little")
                if tail[4:] != b"PAR1" or footer_len + 12 > size:
                    raise OSError("no Parquet footer")
                f.seek(size - 8 - footer_len)
                footer = f.read(footer_len)
        except OSError as e:
            raise InputError(f"input file {path}: cannot read its Parquet footer ({e}); the file is corrupt or "
                             "truncated: regenerate it") from None
        h.update(size.to_bytes(8, "little"))
        h.update(len(footer).to_bytes(8, "little"))
        h.update(footer)
    return "sha256-footers:" + h.hexdigest()


def check_reserved_columns(src: SampleSource) -> None:
    """Refuse an input column named like a column fsdata adds (``step``, ``rank``).

    Raises:
        InputError: one line naming the column and how to rename it.
    """
    for name in src.columns:
        if name in S.RESERVED_COLUMNS:
            theirs = next((k for k, v in src.rename.items() if v == name), name)
            raise InputError(f"input {src.path}: column '{theirs}' would be named '{name}', a column fsdata adds to "
                             f"every rank file ({', '.join(S.RESERVED_COLUMNS)} are reserved); rename it in the "
                             f"input, or map it onto a sample-schema column with --columns (e.g. --columns "
                             f"item_ids={theirs})")


def output_schema(src: SampleSource) -> pa.Schema:
    """Schema of every rank file: contract types for contract columns, others as in the input,
    then ``step`` int32 and ``rank`` int32.

    Raises:
        InputError: an input column is named ``step`` or ``rank``.
    """
    check_reserved_columns(src)
    fs, first_path = fsio.filesystem_and_path(src.files[0])
    first = pq.read_schema(first_path, filesystem=fs)
    fields = []
    contract = {**S.REQUIRED_COLUMNS, **S.OPTIONAL_COLUMNS}
    for f in first:
        name = src.rename.get(f.name, f.name)
        fields.append(pa.field(name, contract.get(name, f.type)))
    fields.append(pa.field(S.STEP, pa.int32()))
    fields.append(pa.field(S.RANK, pa.int32()))
    return pa.schema(fields)


def _check_seq_len(batch: pa.RecordBatch, schema: pa.Schema, path: str) -> None:
    """The stored ``seq_len`` must equal ``len(item_ids)``: the plan was made from it."""
    items = batch.column(schema.get_field_index(S.ITEM_IDS))
    stored = batch.column(schema.get_field_index(S.SEQ_LEN))
    actual = pc.list_value_length(items).cast(pa.int64())
    if not pc.all(pc.equal(actual, stored.cast(pa.int64()))).as_py():
        raise InputError(f"input file {path}: column seq_len differs from len(item_ids) in some rows; "
                         "drop the seq_len column or recompute it")


# ---- the plan artifact ---------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class PlanTable:
    """The plan of one input, one entry per input row in input order (docs/fsdata.md, "Stages").

    With E epochs (``meta["epochs"]``, absent = 1) every per-row array has ``E*N`` entries: entry
    ``e*N + i`` is input row ``i`` in epoch ``e`` (``sample_id`` repeated per epoch), and epoch
    ``e``'s steps are ``e*S_e .. e*S_e + S_e - 1`` with ``S_e = meta["steps_per_epoch"]``.

    Attributes:
        sample_id: shape ``[N]`` int64 (``[E*N]`` with E epochs; likewise below).
        step: shape ``[N]`` int32; -1 for a dropped row.
        rank: shape ``[N]`` int32; -1 for a dropped row.
        position: shape ``[N]`` int32, the row's index inside its (step, rank) per-rank batch
            (0-based; rank files are ordered by step, then position); -1 for a dropped row.
        cost: shape ``[N]`` float64, the predicted cost of each row under the cost model.
        counts, loads: ``[S x R]`` per-(step, rank) counts and predicted costs, when known without
            the per-row arrays (a plan assembled from window summaries; then the per-row arrays may
            be empty); None: computed by :meth:`counts_and_loads`.
        dropped_sample_id: shape ``[D]`` int64, when the per-row arrays are not held.
        meta: settings and predicted figures (``num_ranks``, ``num_steps``, ``batch_size_per_rank``,
            ``batch_policy``, ``strategy``, ``remainder_policy``, ``seed``, ``cost_model``,
            ``predicted_bubble``, ``baseline_predicted_bubble``, ``lower_bound_bubble``,
            ``num_samples_input``, ``input_digest``, ``fsdata_version``, ``settings``).
    """

    sample_id: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    position: np.ndarray
    cost: np.ndarray
    meta: dict = field(default_factory=dict)
    counts: np.ndarray | None = None
    loads: np.ndarray | None = None
    dropped_sample_id: np.ndarray | None = None
    _counts_loads: tuple | None = field(default=None, init=False, repr=False, compare=False)
    """:meth:`counts_and_loads` once computed from the per-row arrays (they are not changed after)."""

    @property
    def num_ranks(self) -> int:
        return int(self.meta["num_ranks"])

    @property
    def num_steps(self) -> int:
        """Steps per rank over all epochs."""
        return int(self.meta["num_steps"])

    @property
    def epochs(self) -> int:
        """E, the epochs the plan holds (1 when the plan does not say)."""
        return int(self.meta.get("epochs", 1))

    @property
    def epoch_num_steps(self) -> list[int]:
        """Steps of each epoch, E ints summing to ``num_steps`` (equal under the fixed policy)."""
        if "epoch_num_steps" in self.meta:
            return [int(x) for x in self.meta["epoch_num_steps"]]
        return [int(self.meta.get("steps_per_epoch", self.num_steps))] * self.epochs

    def counts_and_loads(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-(step, rank) sample counts ``[S x R]`` int32 and predicted cost ``[S x R]`` float64.

        Costs are summed in ``position`` order inside each (step, rank) (the rank files' row
        order), as :func:`fsdata.balancer.plan.plan_one_window` sums them, so the figures are equal bit for
        bit to :attr:`fsdata.balancer.plan.Plan.loads` whichever engine planned. A plan assembled
        from window summaries (the Ray engine) carries them precomputed.
        """
        if self.counts is not None and self.loads is not None:
            return self.counts, self.loads
        if self._counts_loads is None:
            S_, R = self.num_steps, self.num_ranks
            kept = np.flatnonzero(self.step >= 0)
            flat = self.step[kept].astype(np.int64) * R + self.rank[kept]
            counts = np.bincount(flat, minlength=S_ * R)
            # each kept row's index in (step, rank, position) order: one scatter, no sort (the
            # positions of a (step, rank) batch are 0..n-1, check_plan); then the costs of every
            # (step, rank) are summed in position order, as before
            starts = np.zeros(S_ * R, dtype=np.int64)
            np.cumsum(counts[:-1], out=starts[1:])
            sorted_cost = np.empty(len(kept), dtype=np.float64)
            sorted_cost[starts[flat] + self.position[kept]] = self.cost[kept]
            sorted_flat = np.repeat(np.arange(S_ * R, dtype=np.int64), counts)
            loads = np.bincount(sorted_flat, weights=sorted_cost, minlength=S_ * R).reshape(S_, R)
            self._counts_loads = (counts.reshape(S_, R).astype(np.int32), loads)
        return self._counts_loads

    def dropped_sample_ids(self) -> np.ndarray:
        """``sample_id`` of the dropped rows (the remainder), in input order; shape ``[D]`` int64."""
        if self.dropped_sample_id is not None:
            return self.dropped_sample_id
        return self.sample_id[self.step < 0]

    def dropped_epochs(self) -> np.ndarray:
        """Epoch of each dropped row, aligned with :meth:`dropped_sample_ids`; shape ``[D]`` int32."""
        if self.dropped_sample_id is not None:
            return np.zeros(len(self.dropped_sample_id), dtype=np.int32)
        n = len(self.sample_id) // max(self.epochs, 1)
        return (np.flatnonzero(self.step < 0) // max(n, 1)).astype(np.int32)


def plan_digest(plan: PlanTable) -> str:
    """Hex SHA-256 that identifies a plan: its settings and figures (``meta``, canonical JSON), its
    per-(step, rank) counts and its dropped sample ids. Every engine computes the same digest for
    the same plan (it needs no per-row arrays); plans that differ in seed, strategy, cost model,
    input or any setting differ in it even when their per-rank counts are equal.
    """
    h = hashlib.sha256(b"fsdata-plan-digest/1\n")
    h.update(json.dumps(plan.meta, sort_keys=True, separators=(",", ":")).encode())
    counts, _ = plan.counts_and_loads()
    h.update(np.ascontiguousarray(counts, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(plan.dropped_sample_ids(), dtype="<i8").tobytes())
    return h.hexdigest()


def _plan_content_sha256(t: pa.Table, meta_json: bytes) -> str:
    """SHA-256 of a plan file's columns (values, in order) and its metadata JSON."""
    h = hashlib.sha256(meta_json)
    for name in t.column_names:
        h.update(name.encode())
        h.update(np.ascontiguousarray(t.column(name).to_numpy()).tobytes())
    return h.hexdigest()


def check_plan(plan: PlanTable, where: str) -> None:
    """Check a plan read from a file is internally consistent (one line naming what is wrong).

    Raises:
        InputError: settings of the wrong type or range, a rank or step out of range or negative
            (other than -1 for a dropped row), positions that do not number each (step, rank)
            batch 0..n-1, an empty (step, rank), or a count other than the fixed batch size.
    """
    fix = "the plan file was edited or is corrupt: rerun 'fsdata plan'"
    m = plan.meta
    for k, lo in (("num_ranks", 1), ("num_steps", 0), ("batch_size_per_rank", 1), ("num_samples_input", 0)):
        v = m.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise InputError(f"plan {where}: {k} is {v!r}, not an integer >= {lo}; {fix}")
    R, S_, N = m["num_ranks"], m["num_steps"], len(plan.sample_id)
    if N != plan.epochs * m["num_samples_input"]:  # E epochs: E*N rows
        raise InputError(f"plan {where}: {N} rows but num_samples_input {m['num_samples_input']} x epochs "
                         f"{plan.epochs}; {fix}")
    step, rank, pos = (np.asarray(a, dtype=np.int64) for a in (plan.step, plan.rank, plan.position))
    kept = step >= 0
    for name, a, hi in (("step", step, S_), ("rank", rank, R)):
        bad = np.flatnonzero((a < -1) | (a >= hi))
        if len(bad):
            raise InputError(f"plan {where}: row {int(bad[0])} has {name} {int(a[bad[0]])}, outside -1 (dropped) "
                             f"and 0..{hi - 1}; {fix}")
    bad = np.flatnonzero(kept != (rank >= 0))
    if len(bad):
        raise InputError(f"plan {where}: row {int(bad[0])} has step {int(step[bad[0]])} but rank "
                         f"{int(rank[bad[0]])} (both -1 for a dropped row, else both >= 0); {fix}")
    bad = np.flatnonzero(kept != (pos >= 0))
    if len(bad):
        raise InputError(f"plan {where}: row {int(bad[0])} has position {int(pos[bad[0]])} (-1 exactly for "
                         f"dropped rows); {fix}")
    flat = step[kept] * R + rank[kept]
    counts = np.bincount(flat, minlength=S_ * R) if S_ else np.zeros(0, np.int64)
    if len(counts) != S_ * R or (counts < 1).any():
        i = int(np.flatnonzero(counts < 1)[0]) if len(counts) == S_ * R else 0
        raise InputError(f"plan {where}: step {i // R} rank {i % R} has no rows (every step gives every rank at "
                         f"least one); {fix}")
    if m.get("batch_policy") == "fixed" and (counts != m["batch_size_per_rank"]).any():
        i = int(np.flatnonzero(counts != m["batch_size_per_rank"])[0])
        raise InputError(f"plan {where}: step {i // R} rank {i % R} has {int(counts[i])} rows, not "
                         f"batch_size_per_rank {m['batch_size_per_rank']} (batch_policy fixed); {fix}")
    order = np.lexsort((pos[kept], flat))
    f_sorted, p_sorted = flat[order], pos[kept][order]
    starts = np.concatenate([[0], np.flatnonzero(np.diff(f_sorted)) + 1]) if len(f_sorted) else np.zeros(0, int)
    first = np.repeat(starts, np.diff(np.append(starts, len(f_sorted))))
    bad = np.flatnonzero(p_sorted != np.arange(len(f_sorted)) - first)
    if len(bad):
        b = int(f_sorted[bad[0]])
        raise InputError(f"plan {where}: the positions of step {b // R} rank {b % R} are not 0..n-1 (repeated or "
                         f"missing position); {fix}")


def _positions(step: np.ndarray, rank: np.ndarray, order_key: np.ndarray) -> np.ndarray:
    """Index of each row inside its (step, rank) batch, ordered by ``order_key``; -1 when dropped."""
    pos = np.full(len(step), -1, dtype=np.int32)
    kept = np.flatnonzero(step >= 0)
    if not len(kept):
        return pos
    order = kept[np.lexsort((order_key[kept], rank[kept], step[kept]))]
    grp = step[order].astype(np.int64) * (int(rank.max()) + 1) + rank[order]
    starts = np.flatnonzero(np.concatenate([[True], grp[1:] != grp[:-1]]))
    first = np.repeat(starts, np.diff(np.append(starts, len(order))))
    pos[order] = (np.arange(len(order)) - first).astype(np.int32)
    return pos


def sample_kind(src: SampleSource) -> str | None:
    """``per-user`` or ``per-event`` when every input file says so in the Parquet key-value metadata
    ``fsdata convert`` writes (``freescale.convert``), else None (samples made elsewhere)."""
    kinds = set()
    for path in src.files:
        fs, where = fsio.filesystem_and_path(path)
        meta = pq.ParquetFile(where, filesystem=fs).metadata.metadata or {}
        try:
            kinds.add(json.loads(meta[b"freescale.convert"]).get("samples"))
        except (KeyError, ValueError, AttributeError):
            return None
    return kinds.pop() if len(kinds) == 1 else None


def _recorded_settings(settings: BalanceSettings, plan: Plan, src: SampleSource) -> dict:
    return {"samples": sample_kind(src), "partitioner": settings.partitioner, "partition_info": plan.partition_info, "budget": settings.budget,
            "input_columns_renamed": src.rename, "num_ranks": settings.num_ranks,
            "batch_size_per_rank": settings.batch_size_per_rank, "seed": settings.seed,
            "strategy": settings.strategy, "batch_policy": settings.batch_policy, "remainder": settings.remainder,
            "budget_used": plan.budget_used, "compose_window": plan.compose_window, "compose": plan.compose_info,
            "shuffle": SHUFFLE, "plan_window": plan.plan_window}


def plan_table_from_plan(src: SampleSource, plan: Plan, sample_ids: np.ndarray, costs: np.ndarray,
                         cost_model: CostModel, settings: BalanceSettings, *, num_samples: int | None = None,
                         dropped_sample_id: np.ndarray | None = None) -> PlanTable:
    """Wrap an in-memory :class:`~fsdata.balancer.plan.Plan` as a :class:`PlanTable`.

    Args:
        src: the validated input.
        plan: the plan for ``src``'s rows.
        sample_ids: shape ``[N]`` int64, in input order.
        costs: shape ``[N]`` float64, the costs the plan was made from.
        cost_model: the model ``costs`` came from.
        settings: the settings recorded with the plan.
        num_samples: N, when ``plan`` holds no per-row arrays (a plan assembled from window
            summaries by a distributed engine; ``sample_ids`` and ``costs`` are then empty and
            the table carries ``plan.counts`` / ``plan.loads``).
        dropped_sample_id: shape ``[D]`` int64, the dropped rows' ids, with ``num_samples``.
    """
    meta = {
        "plan_format_version": PLAN_FORMAT_VERSION,
        "num_ranks": plan.num_ranks, "num_steps": plan.num_steps,
        "batch_size_per_rank": plan.batch_size_per_rank, "batch_policy": settings.batch_policy,
        "strategy": settings.strategy, "remainder_policy": settings.remainder, "seed": settings.seed,
        "cost_model": cost_model.to_json(),
        "predicted_bubble": plan.predicted_bubble, "baseline_predicted_bubble": plan.baseline_bubble,
        "lower_bound_bubble": plan.lower_bound_bubble,
        "num_samples_input": int(len(plan.step) if num_samples is None else num_samples),
        "input_digest": input_digest(src),
        "fsdata_version": __version__, "settings": _recorded_settings(settings, plan, src),
        "manifest_extra": {"lower_bound_kind": "pigeonhole",
                           "lower_bound_bubble_simple": plan.lower_bound_bubble_simple,
                           "per_rank_count": plan.count_distribution()},
    }
    if num_samples is not None:  # window summaries only: no per-row arrays
        e32 = np.empty(0, dtype=np.int32)
        return PlanTable(sample_id=np.empty(0, dtype=np.int64), step=e32, rank=e32, position=e32,
                         cost=np.empty(0), meta=meta, counts=plan.counts, loads=plan.loads,
                         dropped_sample_id=np.asarray(dropped_sample_id, dtype=np.int64))
    position = plan.position if plan.position is not None else _positions(plan.step, plan.rank, plan.order_key)
    return PlanTable(sample_id=np.asarray(sample_ids, dtype=np.int64), step=plan.step.astype(np.int32, copy=False),
                     rank=plan.rank.astype(np.int32, copy=False), position=position.astype(np.int32, copy=False),
                     cost=np.asarray(costs, dtype=np.float64), meta=meta)


def plan_costs(costs: np.ndarray, settings: BalanceSettings, *, seed: int | None = None) -> Plan:
    """:func:`fsdata.balancer.plan.make_plan` under ``settings`` (the one call every engine plans with).

    Args:
        costs: shape ``[N]`` float64, per-sample cost in input order.
        settings: the balance settings (R, B, seed, strategy, policy, partitioner, composition).
        seed: the seed to plan with instead of ``settings.seed`` (an epoch's seed).
    """
    return make_plan(costs, num_ranks=settings.num_ranks, batch_size_per_rank=settings.batch_size_per_rank,
                     seed=settings.seed if seed is None else seed, strategy=settings.strategy, batch_policy=settings.batch_policy,
                     remainder=settings.remainder, partitioner=settings.partitioner, budget=settings.budget,
                     compose_window=settings.compose_window, plan_window=settings.plan_window)


def make_plan_table(src: SampleSource, settings: BalanceSettings, *,
                    timings: dict[str, float] | None = None) -> PlanTable:
    """Stage 1: read lengths, cost them, plan (:func:`fsdata.balancer.plan.make_plan`).

    ``timings``, if given, receives seconds for ``read_lengths`` and ``plan``.

    Raises:
        InputError: bad input (including a reserved column name).
        ConfigError: impossible settings or an unknown cost model.
    """
    check_reserved_columns(src)
    check_epochs(settings)
    cost_model = load_cost_model(settings.cost_model)
    t0 = time.perf_counter()
    lengths, ids = src.lengths_and_ids()
    t1 = time.perf_counter()
    costs = cost_model.cost(lengths)
    del lengths
    if settings.epochs == 1:
        plan = plan_costs(costs, settings)
        table = plan_table_from_plan(src, plan, ids, costs, cost_model, settings)
    else:
        table = _plan_epochs(src, costs, ids, cost_model, settings)
    if timings is not None:
        timings.update(read_lengths=t1 - t0, plan=time.perf_counter() - t1)
    return table


def check_epochs(settings: BalanceSettings) -> None:
    """Validate ``settings.epochs``.

    Raises:
        ConfigError: not an integer >= 1, or E > 1 with ``--engine ray`` (it plans and writes one
            epoch).
    """
    E = settings.epochs
    if isinstance(E, bool) or not isinstance(E, (int, np.integer)) or E < 1:
        raise ConfigError(f"--epochs must be an integer >= 1, got {E!r}")
    if E > 1 and settings.engine == "ray":
        raise ConfigError(f"--epochs {E} is not supported by --engine ray yet; use --engine local (the default) "
                          "for several epochs")


def _plan_epochs(src: SampleSource, costs: np.ndarray, ids: np.ndarray, cost_model: CostModel,
                 settings: BalanceSettings) -> PlanTable:
    """Plan ``settings.epochs`` epochs, one :func:`plan_costs` call per epoch with
    :func:`fsdata.balancer.order.epoch_seed`, and join them as one :class:`PlanTable` of ``E*N``
    entries (epoch e's steps shifted by the steps of the epochs before it: ``e*S`` under the fixed
    policy, where every epoch has ``S = N // (R*B)`` steps; under cost-budget each epoch has its own
    count, recorded in ``epoch_num_steps``). Planning memory is one epoch's plan at a time (itself
    planned window by window under the fixed policy); the joined table holds ``E*N`` entries.

    Run figures are over all steps: loads and counts concatenated, the proven bounds recombined
    from per-step bounds (:func:`fsdata.balancer.bubble.bound_bubble`'s formula) of the steps
    :func:`fsdata.balancer.plan.make_plan` bounds (the written steps under the fixed policy, the
    seeded global batches under cost-budget).
    """
    from fsdata.balancer import bubble  # noqa: PLC0415
    from fsdata.balancer.order import epoch_seed  # noqa: PLC0415
    from fsdata.balancer.plan import shuffled_steps  # noqa: PLC0415
    from fsdata.balancer.windows import bound_ratio as _bound_ratio, merge_infos as _merge_info  # noqa: PLC0415

    E, N = int(settings.epochs), len(costs)
    R, B = settings.num_ranks, settings.batch_size_per_rank
    step = np.full(E * N, -1, dtype=np.int32)
    rank = np.full(E * N, -1, dtype=np.int32)
    position = np.full(E * N, -1, dtype=np.int32)
    loads, counts, baseline, pinfos, cinfos = [], [], [], [], []
    bound, bound_simple, mean, un_bound, un_mean = [], [], [], [], []
    first: Plan | None = None
    epoch_steps: list[int] = []
    offset = 0
    for e in range(E):
        seed_e = epoch_seed(settings.seed, e)
        plan = plan_costs(costs, settings, seed=seed_e)
        if first is None:
            first = plan
        S = plan.num_steps
        sl = slice(e * N, (e + 1) * N)
        kept = plan.step >= 0
        step[sl] = np.where(kept, plan.step + offset, -1)
        rank[sl] = plan.rank
        position[sl] = (plan.position if plan.position is not None
                        else _positions(plan.step, plan.rank, plan.order_key))  # cost-budget
        loads.append(plan.loads)
        counts.append(plan.counts)
        baseline.append(plan.baseline_loads)
        pinfos.append(plan.partition_info)
        cinfos.append(plan.compose_info)
        if plan.position is None:  # cost-budget: make_plan bounds the seeded global batches
            g, _ = shuffled_steps(N, R, B, seed_e)
            sc = costs[g]
            del g
        else:  # the written (possibly composed) steps
            rows = np.flatnonzero(kept)
            rows = rows[np.argsort(plan.step[rows], kind="stable")]
            sc = costs[rows].reshape(S, R * B)
            del rows
        bound.append(bubble.step_proven_bound(sc, R, B))
        bound_simple.append(bubble.step_lower_bound(sc, R, B))
        mean.append(sc.sum(axis=1) / R)
        epoch_steps.append(int(S))
        offset += S
        if plan.compose_window > 1:
            g, _ = shuffled_steps(N, R, B, seed_e)
            gc = costs[g]
            un_bound.append(bubble.step_proven_bound(gc, R, B))
            un_mean.append(gc.sum(axis=1) / R)
            del g, gc
        del plan, sc, kept
    cat = np.concatenate
    compose_info = first.compose_info
    if first.compose_window > 1 and all(c is not None and "uncomposed_lower_bound_bubble" in c for c in cinfos):
        compose_info = _merge_info(cinfos)
        compose_info.update(compose_window=first.compose_info["compose_window"],
                            compose_window_requested=first.compose_info.get("compose_window_requested"),
                            uncomposed_lower_bound_bubble=_bound_ratio(cat(un_bound), cat(un_mean)))
        if "sub_window_sizes_used" in compose_info:
            compose_info["sub_window_sizes_used"] = dict(sorted(compose_info["sub_window_sizes_used"].items(),
                                                                key=lambda kv: int(kv[0])))
    joined = Plan(num_ranks=R, batch_size_per_rank=B, num_steps=offset, step=step, rank=rank,
                  order_key=np.empty(0, dtype=np.int64), dropped=np.empty(0, dtype=np.int64), loads=cat(loads),
                  counts=cat(counts), baseline_loads=cat(baseline), lower_bound_bubble=_bound_ratio(cat(bound), cat(mean)),
                  partition_info=_merge_info(pinfos), lower_bound_bubble_simple=_bound_ratio(cat(bound_simple), cat(mean)),
                  compose_window=first.compose_window, compose_info=compose_info, budget_used=first.budget_used,
                  position=position, plan_window=first.plan_window)
    table = plan_table_from_plan(src, joined, np.tile(np.asarray(ids, dtype=np.int64), E),
                                 np.tile(np.asarray(costs, dtype=np.float64), E), cost_model, settings)
    meta = table.meta
    # steps_per_epoch when every epoch has the same count (always under the fixed policy);
    # epoch_num_steps under cost-budget, whose epochs differ by a few steps
    per_epoch = {"steps_per_epoch": epoch_steps[0]} if len(set(epoch_steps)) == 1 else {}
    if settings.batch_policy == "cost-budget":
        per_epoch["epoch_num_steps"] = epoch_steps
    meta.update(num_samples_input=int(N), epochs=E, **per_epoch)
    meta["settings"]["epochs"] = E
    meta["manifest_extra"].update(epochs=E, **per_epoch)
    return table


def write_plan(path: str | os.PathLike, table: PlanTable, *, overwrite: bool = False) -> None:
    """Write a plan as Parquet (docs/fsdata.md): columns ``sample_id`` int64, ``step`` int32,
    ``rank`` int32, ``position`` int32, ``cost`` float64 in input row order; :attr:`PlanTable.meta`
    as JSON under the key-value metadata key ``fsdata.balancer.plan``. Atomic.

    Raises:
        ConfigError: ``path`` exists and ``overwrite`` is False.
    """
    t = pa.table({S.SAMPLE_ID: table.sample_id, S.STEP: table.step, S.RANK: table.rank, _POS: table.position,
                  "cost": table.cost})
    meta_json = json.dumps(table.meta).encode()
    t = t.replace_schema_metadata({PLAN_METADATA_KEY: meta_json, PLAN_DIGEST_KEY: plan_digest(table).encode(),
                                   PLAN_SHA256_KEY: _plan_content_sha256(t, meta_json).encode()})
    with atomic_output(path, overwrite=overwrite, is_dir=False) as tmp:
        fs, where = fsio.filesystem_and_path(str(tmp))
        pq.write_table(t, where, compression="zstd", filesystem=fs)


def read_plan(path: str | os.PathLike) -> PlanTable:
    """Read a plan written by :func:`write_plan`.

    Raises:
        InputError: missing, unreadable, or not an fsdata plan.
    """
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        t = pq.read_table(where, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"plan {path} is not readable ({str(e).splitlines()[0]}); write it with 'fsdata plan'") from None
    raw = (t.schema.metadata or {}).get(PLAN_METADATA_KEY)
    need = {S.SAMPLE_ID: pa.int64(), S.STEP: pa.int32(), S.RANK: pa.int32(), _POS: pa.int32(), "cost": pa.float64()}
    if raw is None or any(n not in t.schema.names or t.schema.field(n).type != ty for n, ty in need.items()):
        raise InputError(f"plan {path} is not an fsdata plan (columns {list(need)} and metadata key "
                         f"{PLAN_METADATA_KEY.decode()} expected); write it with 'fsdata plan'")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError:
        raise InputError(f"plan {path}: its {PLAN_METADATA_KEY.decode()} metadata is not JSON; rewrite it with "
                         "'fsdata plan'") from None
    if not isinstance(meta, dict) or meta.get("plan_format_version") != PLAN_FORMAT_VERSION:
        raise InputError(f"plan {path}: plan_format_version {meta.get('plan_format_version') if isinstance(meta, dict) else None!r}"
                         f" is not {PLAN_FORMAT_VERSION}; rewrite it with this fsdata's 'fsdata plan'")
    E, S_all = meta.get("epochs", 1), meta.get("num_steps")
    per = meta.get("epoch_num_steps", [meta.get("steps_per_epoch")] * E if isinstance(E, int) else None)
    if (isinstance(E, bool) or not isinstance(E, int) or E < 1 or t.num_rows % E
            or (E > 1 and (not isinstance(per, list) or len(per) != E
                           or not all(isinstance(x, int) and x > 0 for x in per) or sum(per) != S_all))):
        raise InputError(f"plan {path}: epochs {E!r} and steps per epoch {per!r} do not match its {t.num_rows} rows "
                         f"and num_steps {S_all!r}; rewrite it with 'fsdata plan'")
    recorded = (t.schema.metadata or {}).get(PLAN_SHA256_KEY)
    if recorded is not None and recorded.decode() != _plan_content_sha256(t.select(list(need)), raw):
        raise InputError(f"plan {path}: its content differs from the checksum 'fsdata plan' recorded "
                         f"({PLAN_SHA256_KEY.decode()}); the plan file was edited or is corrupt: rerun 'fsdata plan'")
    col = lambda n: t.column(n).to_numpy()  # noqa: E731
    if any(t.column(n).null_count for n in need):
        raise InputError(f"plan {path}: null values in its columns; the plan file was edited or is corrupt: "
                         "rerun 'fsdata plan'")
    plan = PlanTable(sample_id=col(S.SAMPLE_ID), step=col(S.STEP), rank=col(S.RANK), position=col(_POS),
                     cost=col("cost"), meta=meta)
    check_plan(plan, str(path))
    return plan


# ---- stage 2: write ------------------------------------------------------------------------------

#: Decoded bytes of input rows (Arrow, in memory) gathered at a time by the local engine's write
#: stage (:func:`write_ranks`): ranks are written in groups whose rows fit it; the first group
#: stays in memory, the others are spilled to one temporary Arrow IPC file each during the single
#: read of the input. Peak memory is about this plus the plan (28 bytes per input row per epoch).
GATHER_BYTES = 1024**3
_DEST = "__fsdata_destination"


def _decoded_row_bytes(src: SampleSource, schema: pa.Schema) -> float:
    """Mean decoded (Arrow) bytes per input row, from the Parquet footers only: values x width per
    fixed-width leaf column plus 4-byte list offsets, else the column's uncompressed size."""
    total = 0
    for path in src.files:
        fs, where = fsio.filesystem_and_path(path)
        md = pq.ParquetFile(where, filesystem=fs).metadata
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            for j in range(rg.num_columns):
                c = rg.column(j)
                top = src.rename.get(c.path_in_schema.split(".")[0], c.path_in_schema.split(".")[0])
                t = schema.field(top).type if top in schema.names else None
                leaf = t.value_type if t is not None and (pa.types.is_list(t) or pa.types.is_large_list(t)) else t
                width = leaf.bit_width // 8 if leaf is not None and pa.types.is_primitive(leaf) and leaf.bit_width >= 8 else 0
                total += c.num_values * width if width else c.total_uncompressed_size
                if leaf is not t:
                    total += 4 * rg.num_rows
    return (total + 16 * src.num_rows) / max(src.num_rows, 1)  # + the step, rank and destination columns


def _destinations(plan: PlanTable) -> tuple[np.ndarray, np.ndarray]:
    """Each plan entry's row index in the concatenation of the rank files (rank 0's rows, then rank
    1's, ...; inside a rank ordered by step, then position) and the first index of every rank.

    Returns:
        ``(dest [E*N] int64, -1 for a dropped entry; rank_start [R + 1] int64)``.
    """
    S_, R = plan.num_steps, plan.num_ranks
    counts, _ = plan.counts_and_loads()
    by_rank = np.ascontiguousarray(counts.T, dtype=np.int64).ravel()  # (rank, step) order
    starts = np.zeros(S_ * R + 1, dtype=np.int64)
    np.cumsum(by_rank, out=starts[1:])
    dest = np.full(len(plan.step), -1, dtype=np.int64)
    kept = plan.step >= 0
    dest[kept] = starts[plan.rank[kept].astype(np.int64) * S_ + plan.step[kept]] + plan.position[kept]
    return dest, starts[::S_] if S_ else np.zeros(R + 1, dtype=np.int64)


def _rank_groups(rank_start: np.ndarray, row_bytes: float, budget: float) -> list[tuple[int, int]]:
    """Contiguous rank ranges ``[a, b)`` whose rows take at most ``budget`` bytes (one rank at least)."""
    groups, a = [], 0
    R = len(rank_start) - 1
    while a < R:
        b = a + 1
        while b < R and (rank_start[b + 1] - rank_start[a]) * row_bytes <= budget:
            b += 1
        groups.append((a, b))
        a = b
    return groups


def _input_batches(path: str, rows: int = 65536):
    """Record batches of one input file in row order, ``rows`` rows each (PyArrow's batch reader,
    a local file memory-mapped: measured at less CPU than ``pq.read_table`` and than Polars' batches
    for list columns)."""
    fs, where = fsio.filesystem_and_path(path)
    pf = pq.ParquetFile(where, memory_map=True) if fs is None else pq.ParquetFile(where, filesystem=fs)
    yield from pf.iter_batches(batch_size=rows)


def _gather(src: SampleSource, plan: PlanTable, schema: pa.Schema, dest: np.ndarray, group_of_row: np.ndarray,
            num_groups: int, spill_dir: Path | None, progress: bool, compression: str | None) -> list[pa.Table]:
    """Read the input once: every kept row (once per epoch) with its ``step``, ``rank`` and
    destination (:func:`_destinations`); group 0's rows are returned, the others' appended to
    ``spill_dir/group-XXXXX.arrow``.

    Raises:
        InputError: a file fails to read, or its rows are not the plan's.
    """
    E = plan.epochs
    N = len(plan.sample_id) // E  # input rows; entry e*N + i is row i in epoch e
    n_in = len(schema) - 2  # input columns (schema ends with step, rank)
    ipc_schema = schema.append(pa.field(_DEST, pa.int64()))
    options = pa.ipc.IpcWriteOptions(compression=compression)
    writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
    resident: list[pa.Table] = []
    offset = 0
    bar = tqdm(total=src.num_rows, unit="row", desc="gather rows by rank", disable=not progress)
    try:
        for path in src.files:
            try:
                for batch in _input_batches(path):
                    n = batch.num_rows
                    idx = np.arange(offset, offset + n)
                    offset += n
                    sid = batch.column(schema.get_field_index(S.SAMPLE_ID)).to_numpy(zero_copy_only=False)
                    if offset > N or not np.array_equal(sid.astype(np.int64), plan.sample_id[idx]):
                        raise InputError(f"input file {path}: rows differ from the plan's sample_id order; the plan "
                                         "was made from another input: rerun 'fsdata plan' on this input")
                    if src.has_seq_len:
                        _check_seq_len(batch, schema, path)
                    cols = [batch.column(i).cast(schema.field(i).type) for i in range(n_in)]
                    for e in range(E):  # each input row once per epoch, with that epoch's place
                        eidx = idx + e * N
                        d = dest[eidx]
                        g = group_of_row[eidx]  # a dropped row (dest -1) rides along in its group, unused
                        table = pa.Table.from_arrays(
                            [*cols, pa.array(plan.step[eidx], type=pa.int32()), pa.array(plan.rank[eidx], type=pa.int32()),
                             pa.array(d, type=pa.int64())], schema=ipc_schema)
                        if num_groups == 1:
                            resident.append(table)
                            continue
                        order = np.argsort(g, kind="stable")
                        bounds = np.searchsorted(g[order], np.arange(num_groups + 1))
                        table = table.take(pa.array(order))
                        for k in range(num_groups):
                            a, b = int(bounds[k]), int(bounds[k + 1])
                            if a == b:
                                continue
                            if k == 0:
                                resident.append(table.slice(a, b - a))
                                continue
                            w = writers.get(k)
                            if w is None:
                                w = writers[k] = pa.ipc.new_file(str(spill_dir / f"group-{k:05d}.arrow"), ipc_schema,
                                                                 options=options)
                            w.write_table(table.slice(a, b - a))
                    bar.update(n)
            except (pa.ArrowException, OSError) as e:
                # a full disk or read-only spill folder is the machine's fault, not the input's
                raise_if_environment(e, spill_dir if spill_dir is not None else path)
                raise InputError(f"input file {path}: cannot read rows ({str(e).splitlines()[0]}); "
                                 "the file is corrupt or truncated: regenerate it") from None
    except BaseException:
        for w in writers.values():
            try:
                w.close()  # may fail again (disk full); the first error is the one to report
            except (pa.ArrowException, OSError):
                pass
        raise
    else:
        for w in writers.values():
            w.close()
    finally:
        bar.close()
    if offset != N:
        raise InputError(f"input {src.path} has {offset} rows but the plan has {N}; the plan was "
                         "made from another input: rerun 'fsdata plan' on this input")
    return resident


def _write_group(batches: list[pa.Table], ranks: tuple[int, int], rank_start: np.ndarray, plan: PlanTable,
                 out: Path | str, schema: pa.Schema, digest: str, num_threads: int, bar) -> list[FileEntry]:
    """Write the rank files of ``ranks`` from their rows (any order, with ``_dest``): one
    permutation into (rank, step, position) order, then one ``take`` per rank."""
    a, b = ranks
    base = int(rank_start[a])
    table = pa.concat_tables(batches).combine_chunks()
    batches.clear()
    d = table.column(_DEST).to_numpy()
    kept = np.flatnonzero(d >= 0)
    if len(kept) != rank_start[b] - base:
        raise AssertionError(f"ranks {a}..{b - 1} received {len(kept)} rows, the plan gives {rank_start[b] - base}")
    perm = np.empty(len(kept), dtype=np.int64)  # perm[i]: the table row of output row base + i
    perm[d[kept] - base] = kept
    table = table.drop_columns([_DEST])

    # Polars' gather takes about half the CPU of Arrow's take on list columns (measured); used for
    # integer and integer-list columns, which it hands back with the same values
    simple = all(pa.types.is_integer(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t))
                                            and pa.types.is_integer(t.value_type)) for t in table.schema.types)
    source = pl.from_arrow(table) if simple else table
    del table

    def one(r: int) -> FileEntry:
        idx = perm[rank_start[r] - base:rank_start[r + 1] - base]
        rows = source[idx].to_arrow() if simple else source.take(pa.array(idx))
        return write_rank(r, rows, out, schema, plan.num_steps, plan_digest=digest, sorted_rows=True)

    files = []
    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as ex:
        for info in ex.map(one, range(a, b)):
            files.append(info)
            bar.update(1)
    return files


def write_rank(rank: int, table: pa.Table, output: str | os.PathLike, schema: pa.Schema, num_steps: int, *,
               plan_digest: str | None = None, sorted_rows: bool = False) -> FileEntry:
    """Write one rank's file; the unit a distributed engine calls once per rank.

    Contract (byte-identical output for the same rows, whatever their order or chunking):

    * ``table`` holds exactly this rank's rows, in any order and chunking, with the columns of
      ``schema`` (the rank-file schema from :func:`output_schema`: input columns, ``step`` int32,
      ``rank`` int32) plus ``position`` int32 (the row's index in its (step, rank) batch, from
      the plan); extra columns are ignored.
    * Rows are sorted by (``step``, ``position``), ``position`` is dropped, and the file is
      written to ``output/rank-XXXXX/part-00000.parquet`` (the folder is created) with zstd
      compression, column statistics, and row groups of whole steps: each row group ends at the
      first step boundary at or past :data:`ROW_GROUP_ROWS` rows.
    * ``output`` may be a :mod:`pyarrow.fs` URI (``s3://...``): the file is then encoded in memory
      (its compressed size; the decoded rows are held anyway), hashed, and stored with one write
      through the URI's ``FileSystem``: the same bytes as a local file.
    * Nothing else is written; the caller collects the returned records for :func:`finalize`.

    Args:
        rank: the rank, ``0 <= rank < R``.
        table: this rank's rows (see above).
        output: the OUTPUT folder (or its temporary stand-in), a local path or a URI.
        schema: the rank-file schema.
        num_steps: S; every step ``0..S-1`` must hold at least one row.
        plan_digest: the :func:`plan_digest` of the plan the rows come from, recorded in the
            file's key-value metadata (``fsdata.plan_digest``) so finalize can refuse files of
            another plan; None records nothing.
        sorted_rows: the rows are already in (``step``, ``position``) order and ``table`` has no
            ``position`` column (the local engine's gather): written as they are, same bytes.

    Returns:
        The file's :class:`~fsdata.shards.manifest.FileEntry` (path relative to ``output``, rows, bytes, SHA-256).

    Raises:
        ValueError: rows of another rank, a missing step, or a repeated (step, position).
    """
    if sorted_rows:
        return _write_sorted_rank(rank, table, output, schema, num_steps, plan_digest=plan_digest)
    table = table.select([*schema.names, _POS])
    table = table.take(pc.sort_indices(table, sort_keys=[(S.STEP, "ascending"), (_POS, "ascending")]))
    table = table.drop_columns([_POS])
    return _write_sorted_rank(rank, table, output, schema, num_steps, plan_digest=plan_digest)


def _write_sorted_rank(rank: int, table: pa.Table, output: str | os.PathLike, schema: pa.Schema, num_steps: int, *,
                       plan_digest: str | None = None) -> FileEntry:
    """:func:`write_rank` of rows already in (``step``, ``position``) order, without ``position``:
    the file is encoded in memory, hashed, and written with one write (no re-read for the SHA-256)."""
    table = table.cast(schema)
    if plan_digest is not None:
        schema = schema.with_metadata({**(schema.metadata or {}), PLAN_DIGEST_KEY: plan_digest.encode()})
    step = table.column(S.STEP).to_numpy()
    ranks = table.column(S.RANK).to_numpy()
    if len(ranks) and (ranks != rank).any():
        raise ValueError(f"write_rank({rank}): the table holds rows of other ranks")
    counts = np.bincount(step, minlength=num_steps) if len(step) else np.zeros(num_steps, np.int64)
    if len(counts) != num_steps or (counts == 0).any():
        raise ValueError(f"write_rank({rank}): steps must cover 0..{num_steps - 1} with rows in each")
    rel = rank_file_path(rank)
    ends = np.cumsum(counts)
    tokens = _step_tokens(step, pc.list_value_length(table.column(S.ITEM_IDS)), num_steps)
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema, compression="zstd", write_statistics=True) as w:
        _write_whole_steps(w, table, ends)
    n = table.num_rows
    del table
    data = sink.getvalue()
    output = fsio.normalize(output)
    if fsio.is_remote(output):
        fsio.write_bytes(fsio.join(output, rel), data)
    else:
        out = Path(output)
        (out / rank_dir_name(rank)).mkdir(exist_ok=True)
        with open(out / rel, "wb") as f:
            f.write(memoryview(data))
    return FileEntry(rank=rank, path=rel, num_rows=n, num_bytes=data.size, sha256=hashlib.sha256(data).hexdigest(),
                     step_tokens=tokens)


def _step_tokens(step: np.ndarray, lengths, num_steps: int) -> np.ndarray:
    """History tokens per step of one rank: ``sum(len(item_ids))`` over the rows of each step;
    shape ``[num_steps]`` int64 (exact: integer sums)."""
    if not len(step):
        return np.zeros(num_steps, dtype=np.int64)
    lengths = lengths.to_numpy(zero_copy_only=False) if hasattr(lengths, "to_numpy") else lengths
    # float64 sums of integers stay exact below 2**53 tokens per step
    return np.bincount(np.asarray(step, dtype=np.int64), weights=np.asarray(lengths, dtype=np.float64),
                       minlength=num_steps).astype(np.int64)


def rank_step_tokens(path: str | os.PathLike, num_steps: int) -> np.ndarray:
    """History tokens per step of a written rank file (``step`` and the ``item_ids`` lengths, read
    one row group at a time); shape ``[num_steps]`` int64.

    Raises:
        InputError: the file is unreadable.
    """
    out = np.zeros(num_steps, dtype=np.int64)
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        pf = pq.ParquetFile(where, filesystem=fs)
        for g in range(pf.metadata.num_row_groups):
            t = pf.read_row_group(g, columns=[S.STEP, S.ITEM_IDS])
            out += _step_tokens(t.column(S.STEP).to_numpy(), pc.list_value_length(t.column(S.ITEM_IDS)), num_steps)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: cannot read the rank file ({str(e).splitlines()[0]}); rerun 'fsdata write'") from None
    return out


def _write_whole_steps(w: pq.ParquetWriter, table: pa.Table, ends: np.ndarray) -> None:
    """Write ``table`` (sorted by step; ``ends`` = cumulative rows per step) in row groups of whole
    steps: each ends at the first step end at or past :data:`ROW_GROUP_ROWS` rows."""
    start = 0
    while start < table.num_rows:
        j = int(np.searchsorted(ends, start + ROW_GROUP_ROWS, side="left"))
        stop = int(ends[min(j, len(ends) - 1)])
        w.write_table(table.slice(start, stop - start), row_group_size=stop - start)
        start = stop


_BUCKETS_PREFIX = "fsdata-buckets-"


def _clean_stale_bucket_dirs() -> list[str]:
    """Remove ``TMPDIR/fsdata-buckets-<pid>-*`` left by runs that were killed (their pid is gone)."""
    from fsdata.guards import process_alive as _pid_alive  # noqa: PLC0415

    removed = []
    for p in Path(tempfile.gettempdir()).glob(f"{_BUCKETS_PREFIX}*-*"):
        try:
            pid = int(p.name[len(_BUCKETS_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            log.warning("removed %s left by a killed run (process %d)", p, pid)
            removed.append(str(p))
    return removed


def write_ranks(src: SampleSource, plan: PlanTable, output: str | os.PathLike, settings: BalanceSettings) -> list[FileEntry]:
    """Stage 2: write every rank file of ``plan`` into the existing folder ``output`` (for a URI:
    under that prefix; spilled rank groups then go to a local temporary folder). One read of the
    input; memory about :data:`GATHER_BYTES` plus the plan (module docstring).

    Returns:
        One :class:`~fsdata.shards.manifest.FileEntry` per rank, sorted by rank.

    Raises:
        InputError: an input file fails to read midway, or the input does not match the plan.
    """
    schema = output_schema(src)
    output = fsio.normalize(output)
    remote = fsio.is_remote(output)
    out = output if remote else Path(output)
    dest, rank_start = _destinations(plan)
    groups = _rank_groups(rank_start, _decoded_row_bytes(src, schema), GATHER_BYTES)
    group_of_rank = np.zeros(plan.num_ranks, dtype=np.int32)
    for k, (a, b) in enumerate(groups):
        group_of_rank[a:b] = k
    group_of_row = group_of_rank[np.maximum(plan.rank, 0)]
    spill_dir: Path | None = None
    _clean_stale_bucket_dirs()  # a killed run's scratch in TMPDIR, whether or not this run spills
    if len(groups) > 1:
        if remote:  # object stores have no place for scratch files: the spill goes to local TMPDIR
            spill_dir = Path(tempfile.mkdtemp(prefix=f"{_BUCKETS_PREFIX}{os.getpid()}-"))
        else:
            spill_dir = out / ".buckets"
            spill_dir.mkdir()
    try:
        resident = _gather(src, plan, schema, dest, group_of_row, len(groups), spill_dir, settings.progress,
                           settings.bucket_compression)
        del dest, group_of_row
        digest = plan_digest(plan)
        files: list[FileEntry] = []
        bar = tqdm(total=plan.num_ranks, unit="rank", desc="write rank files", disable=not settings.progress)
        for k, ranks in enumerate(groups):
            if k == 0:
                batches = resident
            else:
                path = spill_dir / f"group-{k:05d}.arrow"
                with pa.OSFile(str(path), "rb") as f:
                    batches = [pa.ipc.open_file(f).read_all()]
                path.unlink()
            files += _write_group(batches, ranks, rank_start, plan, out, schema, digest, settings.num_threads, bar)
            del batches
        bar.close()
    finally:
        if spill_dir is not None:
            shutil.rmtree(spill_dir, ignore_errors=True)
    return files


def write_step_stats(path: Path | str, plan: Plan | PlanTable, num_tokens: np.ndarray | None = None) -> None:
    """``_step_stats.parquet`` of ``plan`` (the format: :func:`fsdata.shards.manifest.write_step_stats`);
    ``num_tokens`` ``[S x R]`` int64: history tokens per (step, rank) (None: no ``num_tokens`` column)."""
    if isinstance(plan, PlanTable):
        counts, loads = plan.counts_and_loads()
    else:
        counts, loads = plan.counts, plan.loads
    _write_step_stats(path, counts, loads, num_tokens)


def file_records(output: str | os.PathLike, num_ranks: int, expect_digest: str | None = None) -> list[FileEntry]:
    """Records of rank files already written under ``output`` (row count from the footer, size, SHA-256).

    Args:
        output: the folder holding the rank files.
        num_ranks: R.
        expect_digest: when given, every file's recorded plan digest must equal it.

    Raises:
        InputError: a rank file is missing or unreadable, or was written from another plan.
    """
    output = fsio.normalize(output)
    remote = fsio.is_remote(output)
    out = output if remote else Path(output)
    records = []
    for r in range(num_ranks):
        rel = rank_file_path(r)
        path = fsio.join(out, rel) if remote else out / rel
        try:
            fs, where = fsio.filesystem_and_path(str(path))
            md = pq.read_metadata(where, filesystem=fs)
            n = md.num_rows
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"{path}: cannot read the rank file ({str(e).splitlines()[0]}); rerun 'fsdata write'") from None
        if expect_digest is not None:
            got = (md.metadata or {}).get(PLAN_DIGEST_KEY)
            if got is None or got.decode() != expect_digest:
                what = "records no plan digest" if got is None else f"has plan digest {got.decode()[:12]}..."
                raise InputError(f"{path}: {what}, but the plan's is {expect_digest[:12]}...: the rank files were "
                                 "written from another plan (other seed, strategy, cost model, settings or input); "
                                 "rerun 'fsdata write' with this plan")
        records.append(FileEntry(rank=r, path=rel, num_rows=n, num_bytes=fsio.size(path), sha256=sha256_file(path)))
    return records


_OWN_ROOT_FILES = (STEP_STATS_NAME, DROPPED_NAME, MANIFEST_NAME)


def _check_only_rank_files(out: Path | str, num_ranks: int) -> None:
    """Refuse anything in ``out`` besides the plan's rank files and finalize's own root files
    (an extra ``part-00001.parquet``, another rank's folder, hidden files or folders): folder-level
    readers would read them as data.

    Raises:
        InputError: one line naming up to five such paths.
    """
    want = {rank_file_path(r) for r in range(num_ranks)} | set(_OWN_ROOT_FILES)
    if fsio.is_remote(out):
        base = fsio.resolve(out).path + "/"
        files = [fsio.resolve(u).path[len(base):] for u in fsio.walk_files(out)]
    else:
        files = []  # files and links (not followed), and empty folders with a trailing "/"
        for dirpath, dirnames, filenames in os.walk(out):
            rel = os.path.relpath(dirpath, out)
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if prefix and not dirnames and not filenames:
                files.append(prefix)
            files += [prefix + f for f in filenames]
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            files += [prefix + d for d in links]
            dirnames[:] = [d for d in dirnames if d not in links]
    own_tmp = re.compile(r"^\.(?:" + "|".join(map(re.escape, _OWN_ROOT_FILES)) + r")\.tmp-\d+$")
    extra = sorted(f for f in files if f not in want and not own_tmp.match(f))
    if extra:
        raise InputError(f"{out} holds {extra[:5]} besides the plan's {num_ranks} rank files; folder readers would "
                         "read them: remove them, or rerun 'fsdata write' into an empty OUTPUT")


def finalize(output: str | os.PathLike, plan: PlanTable, records: list[FileEntry] | None = None) -> Manifest:
    """Stage 3: write ``_step_stats.parquet``, ``_dropped.parquet`` (when rows were dropped) and,
    last, ``_manifest.json`` into ``output``, from the plan and the rank files' records.

    Args:
        output: the folder holding the rank files (OUTPUT or its temporary stand-in), a local path
            or a URI (on an object store the manifest written last is the OUTPUT's commit marker).
        plan: the plan the rank files were written from.
        records: the :func:`write_rank` results, one per rank; None: recomputed from the files.

    Returns:
        The written :class:`~fsdata.shards.manifest.Manifest`.

    Raises:
        InputError: the rank files do not match the plan (missing rank, other row counts, other
            columns), or something other than rank files lies in ``output``.
    """
    output = fsio.resolve_pointer(output)  # normalised; an object store's pointer object followed
    remote = fsio.is_remote(output)
    out = output if remote else Path(output)

    def at(name: str):
        return fsio.join(out, name) if remote else out / name

    R = plan.num_ranks
    _check_only_rank_files(out, R)
    if records is None:
        records = file_records(out, R, expect_digest=plan_digest(plan))
    records = sorted(records, key=lambda f: f.rank)
    counts, _ = plan.counts_and_loads()
    if [f.rank for f in records] != list(range(R)):
        raise InputError(f"{out}: rank file records cover ranks {[f.rank for f in records][:8]}, the plan has "
                         f"{R} ranks; rerun 'fsdata write' with this plan")
    for f in records:
        if f.num_rows != int(counts[:, f.rank].sum()):
            raise InputError(f"{at(f.path)}: {f.num_rows} rows but the plan gives rank {f.rank} "
                             f"{int(counts[:, f.rank].sum())}; rerun 'fsdata write' with this plan")
    fs, first = fsio.filesystem_and_path(str(at(records[0].path)))
    columns = pq.read_schema(first, filesystem=fs).names
    # Local: every root file goes to a temporary first and all are renamed into place only when all
    # were written, so a failing or killed re-run (full disk, file-size limit, SIGKILL) leaves the
    # previous complete output as it was. A user's output folder keeps no temporaries: they live in
    # a sibling folder that the next run removes once its process is gone; inside balance the output
    # is itself a hidden temporary and holds them. Object store: each file is one PUT (old or new).
    staged: list[tuple[Path, Path]] = []
    staging: list[Path] = []
    if not remote:
        atomic.clean_stale_tmp(out)

    def stage(name: str):
        if remote:
            return at(name)
        if out.name.startswith("."):
            tmp = out / f".{name}.tmp-{os.getpid()}"
        else:
            if not staging:
                staging.append(out.parent / f"{atomic.tmp_prefix(out)}{os.getpid()}-finalize")
                staging[0].mkdir(exist_ok=True)
            tmp = staging[0] / name
        staged.append((tmp, out / name))
        return tmp

    tokens = np.stack([f.step_tokens if f.step_tokens is not None else rank_step_tokens(at(f.path), plan.num_steps)
                       for f in records], axis=1)
    try:
        stats_path = stage(STEP_STATS_NAME)
        write_step_stats(stats_path, plan, tokens)
        meta = plan.meta
        dropped = plan.dropped_sample_ids()
        dropped_file = dropped_path = None
        if len(dropped):
            dropped_file = DROPPED_NAME
            dropped_path = stage(dropped_file)
            fs, where = fsio.filesystem_and_path(str(dropped_path))
            cols = {S.SAMPLE_ID: pa.array(dropped, type=pa.int64())}
            if plan.epochs > 1:  # the remainder is per epoch
                cols["epoch"] = pa.array(plan.dropped_epochs(), type=pa.int32())
            cols["reason"] = pa.array(["remainder"] * len(dropped))
            pq.write_table(pa.table(cols), where, compression="zstd", filesystem=fs)
        m = Manifest(
            path=str(out), format_version=FORMAT_VERSION, fsdata_version=meta["fsdata_version"],
            num_ranks=R, num_steps=plan.num_steps, batch_size_per_rank=int(meta["batch_size_per_rank"]),
            batch_policy=meta["batch_policy"], strategy=meta["strategy"],
            num_samples_input=int(meta["num_samples_input"]), num_samples_written=int(counts.sum()),
            num_samples_dropped=int(len(dropped)), remainder_policy=meta["remainder_policy"],
            dropped_file=dropped_file, cost_model=meta["cost_model"], seed=meta["seed"],
            predicted_bubble=meta["predicted_bubble"], baseline_predicted_bubble=meta["baseline_predicted_bubble"],
            lower_bound_bubble=meta["lower_bound_bubble"], columns=columns, step_stats_file=STEP_STATS_NAME,
            step_stats_sha256=sha256_file(stats_path),
            dropped_sha256=sha256_file(dropped_path) if dropped_file else None,
            input_digest=meta["input_digest"], files=records, settings=meta["settings"],
            extra={k: v for k, v in meta.get("manifest_extra", {}).items()})
        if remote:
            m.write(out)
        else:
            stage(MANIFEST_NAME).write_text(m.dumps())
            for tmp, final in staged:  # the manifest last
                os.replace(tmp, final)
            stale_dropped = out / DROPPED_NAME
            if dropped_file is None and stale_dropped.exists():  # left by a previous finalize with another plan
                stale_dropped.unlink()
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        if staging:
            shutil.rmtree(staging[0], ignore_errors=True)
    return m


def balance_local(input: str | os.PathLike, output: str | os.PathLike, settings: BalanceSettings, *,
                  timings: dict[str, float] | None = None) -> Manifest:
    """``fsdata balance`` in this process: plan, write and finalize, atomically (the ``local`` engine;
    :func:`fsdata.engines.balance` is the entry point over every engine).

    Args:
        input: a Parquet file, a folder of Parquet files, or a glob (the sample schema, docs/format.md).
        output: the OUTPUT folder; must not exist unless ``settings.overwrite``.
        settings: every setting (:class:`BalanceSettings`); ``settings.engine`` is not read here.
        timings: if given, filled with seconds per stage (``read_lengths``, ``plan``, ``write_ranks``,
            ``finalize``).

    Returns:
        The written :class:`~fsdata.shards.manifest.Manifest` (``path`` = ``output``).

    Raises:
        InputError: bad input. ConfigError: impossible settings, or OUTPUT exists without overwrite.
    """
    input, output = fsio.normalize(input), fsio.normalize(output)
    check_output_apart(output, [input], output_name="OUTPUT", input_name="INPUT")
    if output_taken(output) and not settings.overwrite:
        raise ConfigError(f"output {output} already exists and is not empty; choose a new path or pass "
                          f"{setting('overwrite', True)} to replace it")
    src = open_samples(input, settings.columns)
    stage: dict[str, float] = {}
    plan = make_plan_table(src, settings, timings=stage)
    t1 = time.perf_counter()
    with atomic_output(output, overwrite=settings.overwrite) as tmp:
        files = write_ranks(src, plan, tmp, settings)
        t2 = time.perf_counter()
        m = finalize(tmp, plan, files)
    m.path = str(output)
    if timings is not None:
        timings.update(**stage, write_ranks=t2 - t1, finalize=time.perf_counter() - t2)
    return m
