"""The plan file of ``fsdata plan`` / ``fsdata write`` (docs/fsdata.md, "Stages"): :class:`PlanTable`,
one entry per input row (``sample_id``, ``step``, ``rank``, ``position``, ``cost``) plus the
settings and predicted figures, stored as Parquet (:func:`write_plan` / :func:`read_plan`) and
identified by :func:`plan_digest`, which every rank file written from it records.

:func:`plan_table_from_plan` wraps an in-memory :class:`~fsdata.balancer.plan.Plan` (what every
engine's plan stage makes) with the metadata the manifest records; :func:`input_digest`
identifies the input a plan was made from.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata._version import __version__
from fsdata.atomic import atomic_output
from fsdata.balancer.cost import CostModel
from fsdata.balancer.order import SHUFFLE
from fsdata.balancer.plan import Plan
from fsdata.balancer.settings import PlanSettings
from fsdata.errors import InputError
from fsdata.shards.plan_meta import PlanMeta
from fsdata.samples import schema as S
from fsdata.samples.io import SampleSource
from fsdata.samples.vocab import carried_keys

#: Column of a plan (and of the rows an engine routes to a rank): the row's index in its (step, rank) batch.
POSITION = "position"
#: Version of the plan Parquet's layout (key ``fsdata.plan`` in its key-value metadata).
PLAN_METADATA_KEY = b"fsdata.plan"
#: Key-value metadata key of the plan digest (:func:`plan_digest`), in the plan file and in every
#: rank file written from that plan: finalize refuses rank files of another plan.
PLAN_DIGEST_KEY = b"fsdata.plan_digest"
#: Key-value metadata key of the plan file's content checksum (columns and metadata).
PLAN_SHA256_KEY = b"fsdata.plan_sha256"



def input_digest(src: SampleSource) -> str:
    """Digest of an input, cheap at any size: SHA-256 over, per file in input order, its size and
    its Parquet footer (schema, row counts, row-group offsets and column statistics).

    Rewriting any file changes its footer in practice; moving the input elsewhere does not change
    the digest (paths are not part of it). Returns ``"sha256-footers:<hex>"``.

    A source read from other files (an OUTPUT read as INPUT, :mod:`fsdata.shards.as_input`) is
    identified by those (``src.digest_files``, its rank files) and the rows chosen from them
    (``src.selection``, hashed after the footers), whether they are read in place or copied.

    Raises:
        InputError: a file cannot be read.
    """
    h = hashlib.sha256()
    for path in src.files if src.digest_files is None else src.digest_files:
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
    if src.selection:
        h.update(src.selection.encode())
    return "sha256-footers:" + h.hexdigest()



@dataclass(kw_only=True, slots=True)
class PlanTable:
    """The plan of one input, one entry per input row in input order (docs/fsdata.md, "Stages").

    With E epochs (``meta.epochs``, None = 1) every per-row array has ``E*N`` entries: entry
    ``e*N + i`` is input row ``i`` in epoch ``e`` (``sample_id`` repeated per epoch), and epoch
    ``e``'s steps follow epoch ``e-1``'s (:attr:`epoch_num_steps`).

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
        meta: settings and predicted figures (:class:`fsdata.shards.plan_meta.PlanMeta`).
    """

    sample_id: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    position: np.ndarray
    cost: np.ndarray
    meta: PlanMeta
    counts: np.ndarray | None = None
    loads: np.ndarray | None = None
    dropped_sample_id: np.ndarray | None = None
    _counts_loads: tuple | None = field(default=None, init=False, repr=False, compare=False)
    """:meth:`counts_and_loads` once computed from the per-row arrays (they are not changed after)."""

    @property
    def num_ranks(self) -> int:
        return int(self.meta.num_ranks)

    @property
    def num_steps(self) -> int:
        """Steps per rank over all epochs."""
        return int(self.meta.num_steps)

    @property
    def epochs(self) -> int:
        """E, the epochs the plan holds (1 when the plan does not say)."""
        return self.meta.num_epochs

    @property
    def epoch_num_steps(self) -> list[int]:
        """Steps of each epoch, E ints summing to ``num_steps`` (equal under the fixed policy)."""
        return self.meta.steps_of_epochs

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
        return self.sample_id[self.step == -1]  # -2: not in this output (before a reshard's partial epoch)

    def dropped_epochs(self) -> np.ndarray:
        """Epoch of each dropped row, aligned with :meth:`dropped_sample_ids`; shape ``[D]`` int32."""
        if self.dropped_sample_id is not None:
            return np.zeros(len(self.dropped_sample_id), dtype=np.int32)
        n = len(self.sample_id) // max(self.epochs, 1)
        return (np.flatnonzero(self.step == -1) // max(n, 1)).astype(np.int32)


def plan_digest(plan: PlanTable) -> str:
    """Hex SHA-256 that identifies a plan: its settings and figures (``meta``, canonical JSON), its
    per-(step, rank) counts and its dropped sample ids. Every engine computes the same digest for
    the same plan (it needs no per-row arrays); plans that differ in seed, strategy, cost model,
    input or any setting differ in it even when their per-rank counts are equal.
    """
    h = hashlib.sha256(b"fsdata-plan-digest/1\n")
    h.update(json.dumps(plan.meta.to_dict(), sort_keys=True, separators=(",", ":")).encode())
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
    m = plan.meta  # its fields' types and ranges: PlanMeta.from_dict
    R, S_, N = m.num_ranks, m.num_steps, len(plan.sample_id)
    if S_ * R > N:  # every (step, rank) holds a row: checked before anything is allocated by these counts
        raise InputError(f"plan {where}: num_steps {S_} x num_ranks {R} exceeds its {N} rows (every step gives every "
                         f"rank at least one); {fix}")
    if N != plan.epochs * m.num_samples_input:  # E epochs: E*N rows
        raise InputError(f"plan {where}: {N} rows but num_samples_input {m.num_samples_input} x epochs "
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
    if m.batch_policy == "fixed" and (counts != m.batch_size_per_rank).any():
        i = int(np.flatnonzero(counts != m.batch_size_per_rank)[0])
        raise InputError(f"plan {where}: step {i // R} rank {i % R} has {int(counts[i])} rows, not "
                         f"batch_size_per_rank {m.batch_size_per_rank} (batch_policy fixed); {fix}")
    order = np.lexsort((pos[kept], flat))
    f_sorted, p_sorted = flat[order], pos[kept][order]
    starts = np.concatenate([[0], np.flatnonzero(np.diff(f_sorted)) + 1]) if len(f_sorted) else np.zeros(0, int)
    first = np.repeat(starts, np.diff(np.append(starts, len(f_sorted))))
    bad = np.flatnonzero(p_sorted != np.arange(len(f_sorted)) - first)
    if len(bad):
        b = int(f_sorted[bad[0]])
        raise InputError(f"plan {where}: the positions of step {b // R} rank {b % R} are not 0..n-1 (repeated or "
                         f"missing position); {fix}")


def plan_positions(step: np.ndarray, rank: np.ndarray, order_key: np.ndarray) -> np.ndarray:
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


def _recorded_settings(settings: PlanSettings, plan: Plan, src: SampleSource) -> dict:
    return {"samples": sample_kind(src), "partitioner": settings.partitioner, "partition_info": plan.partition_info,
            "budget": settings.budget,
            "input_columns_renamed": src.rename, "num_ranks": settings.num_ranks,
            "batch_size_per_rank": settings.batch_size_per_rank, "seed": settings.seed,
            "strategy": settings.strategy, "batch_policy": settings.batch_policy, "remainder": settings.remainder,
            "budget_used": plan.budget_used, "compose_window": plan.compose_window, "compose": plan.compose_info,
            "shuffle": SHUFFLE, "plan_window": plan.plan_window}


def plan_table_from_plan(src: SampleSource, plan: Plan, sample_ids: np.ndarray, costs: np.ndarray,
                         cost_model: CostModel, settings: PlanSettings, *, num_samples: int | None = None,
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
    meta = PlanMeta(
        num_ranks=plan.num_ranks, num_steps=plan.num_steps,
        batch_size_per_rank=plan.batch_size_per_rank, batch_policy=settings.batch_policy,
        strategy=settings.strategy, remainder_policy=settings.remainder, seed=settings.seed,
        cost_model=cost_model.to_json(),
        predicted_bubble=plan.predicted_bubble, baseline_predicted_bubble=plan.baseline_bubble,
        lower_bound_bubble=plan.lower_bound_bubble,
        num_samples_input=int(len(plan.step) if num_samples is None else num_samples),
        input_digest=input_digest(src),
        fsdata_version=__version__, settings=_recorded_settings(settings, plan, src),
        carried=carried_keys(src.files, fsio.read_parquet_metadata),
        manifest_extra={"lower_bound_kind": "pigeonhole",
                        "lower_bound_bubble_simple": plan.lower_bound_bubble_simple,
                        "per_rank_count": plan.count_distribution()},
    )
    if num_samples is not None:  # window summaries only: no per-row arrays
        e32 = np.empty(0, dtype=np.int32)
        return PlanTable(sample_id=np.empty(0, dtype=np.int64), step=e32, rank=e32, position=e32,
                         cost=np.empty(0), meta=meta, counts=plan.counts, loads=plan.loads,
                         dropped_sample_id=np.asarray(dropped_sample_id, dtype=np.int64))
    position = plan.position if plan.position is not None else plan_positions(plan.step, plan.rank, plan.order_key)
    return PlanTable(sample_id=np.asarray(sample_ids, dtype=np.int64), step=plan.step.astype(np.int32, copy=False),
                     rank=plan.rank.astype(np.int32, copy=False), position=position.astype(np.int32, copy=False),
                     cost=np.asarray(costs, dtype=np.float64), meta=meta)


def write_plan(path: str | os.PathLike, table: PlanTable, *, overwrite: bool = False) -> None:
    """Write a plan as Parquet (docs/fsdata.md): columns ``sample_id`` int64, ``step`` int32,
    ``rank`` int32, ``position`` int32, ``cost`` float64 in input row order; :attr:`PlanTable.meta`
    as JSON under the key-value metadata key ``fsdata.plan``. Atomic.

    Raises:
        ConfigError: ``path`` exists and ``overwrite`` is False.
    """
    t = pa.table({S.SAMPLE_ID: table.sample_id, S.STEP: table.step, S.RANK: table.rank, POSITION: table.position,
                  "cost": table.cost})
    meta_json = json.dumps(table.meta.to_dict()).encode()
    t = t.replace_schema_metadata({PLAN_METADATA_KEY: meta_json, PLAN_DIGEST_KEY: plan_digest(table).encode(),
                                   PLAN_SHA256_KEY: _plan_content_sha256(t, meta_json).encode()})
    with atomic_output(path, overwrite=overwrite, is_dir=False, kind="plan") as tmp:
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
        raise InputError(f"plan {path} is not readable ({str(e).splitlines()[0]}); "
                         "write it with 'fsdata plan'") from None
    raw = (t.schema.metadata or {}).get(PLAN_METADATA_KEY)
    need = {S.SAMPLE_ID: pa.int64(), S.STEP: pa.int32(), S.RANK: pa.int32(), POSITION: pa.int32(), "cost": pa.float64()}
    if raw is None or any(n not in t.schema.names or t.schema.field(n).type != ty for n, ty in need.items()):
        raise InputError(f"plan {path} is not an fsdata plan (columns {list(need)} and metadata key "
                         f"{PLAN_METADATA_KEY.decode()} expected); write it with 'fsdata plan'")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError:
        raise InputError(f"plan {path}: its {PLAN_METADATA_KEY.decode()} metadata is not JSON; rewrite it with "
                         "'fsdata plan'") from None
    meta = PlanMeta.from_dict(meta, str(path), num_rows=t.num_rows)
    recorded = (t.schema.metadata or {}).get(PLAN_SHA256_KEY)
    if recorded is not None and recorded.decode() != _plan_content_sha256(t.select(list(need)), raw):
        raise InputError(f"plan {path}: its content differs from the checksum 'fsdata plan' recorded "
                         f"({PLAN_SHA256_KEY.decode()}); the plan file was edited or is corrupt: rerun 'fsdata plan'")
    col = lambda n: t.column(n).to_numpy()  # noqa: E731
    if any(t.column(n).null_count for n in need):
        raise InputError(f"plan {path}: null values in its columns; the plan file was edited or is corrupt: "
                         "rerun 'fsdata plan'")
    plan = PlanTable(sample_id=col(S.SAMPLE_ID), step=col(S.STEP), rank=col(S.RANK), position=col(POSITION),
                     cost=col("cost"), meta=meta)
    check_plan(plan, str(path))
    return plan

