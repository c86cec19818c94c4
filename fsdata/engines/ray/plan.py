"""The Ray engine's plan stage.

* **windowed** (fixed policy, or the shuffle strategy; :func:`plan_windowed`): lengths tasks route
  (position, cost, row) to plan windows and ``sample_id`` values to duplicate buckets, one task
  per window plans it (:func:`fsdata.balancer.plan.plan_one_window`, the function the local engine
  calls per window), the driver combines the window summaries: the central part holds one window's
  worth, never N rows.
* **central** (cost-budget, which plans the run as one sequence; :func:`plan_central`): lengths
  tasks per chunk, then the local engine's planning call on the gathered costs (O(N) on the driver).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from fsdata.balancer.cost import CostModel, load_cost_model
from fsdata.balancer.order import shuffled_positions
from fsdata.balancer.plan import (Plan, check_settings, combine_windows, plan_costs, plan_layout,
                                  plan_one_window)
from fsdata.balancer.settings import BalanceSettings
from fsdata.engines.ray.chunks import Chunk, check_lengths, lengths_task, open_chunk
from fsdata.engines.ray.session import get
from fsdata.errors import ConfigError, InputError, setting
from fsdata.samples import schema as S
from fsdata.samples.io import SampleSource, check_input_counts, sorted_unique
from fsdata.shards.plan_file import PlanTable, plan_table_from_plan

#: Rows per duplicate-``sample_id`` bucket task (ids are routed to buckets by a hash of the id).
ID_BUCKET_ROWS = 4_000_000


def _small_ints(values: np.ndarray, bound: int) -> np.ndarray:
    """``values`` (all in ``0 .. bound-1``) as int16 when ``bound`` fits: NumPy's stable sort of
    16-bit integers is a radix sort, O(n), against a merge sort of int64 (same order)."""
    return values.astype(np.int16) if bound <= np.iinfo(np.int16).max else values


def _id_bucket(ids: np.ndarray, num_buckets: int) -> np.ndarray:
    """Bucket of each ``sample_id`` (SplitMix64 of the id, modulo ``num_buckets``): equal ids meet."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(num_buckets)).astype(np.int64)


def _windowed_lengths_task(chunk: Chunk, rename: dict[str, str], has_seq_len: bool, has_timestamps: bool,
                           cost_model, layout, seed: int) -> list:
    """Lengths, costs and shuffled positions of one chunk, routed to plan windows (a Ray task with
    ``num_returns = 1 + num_windows``).

    Returns:
        ``[stats, *window_pieces]``: ``stats`` holds the validation counts (``nulls``,
        ``num_empty``, ``tlen_mismatch``), ``node``, the dropped rows (``dropped_rows``,
        ``dropped_ids``: positions past the last whole step), and whether the chunk's ``sample_id``
        values are strictly increasing (``ids_increasing``) with the first and last (``id_first``,
        ``id_last``; None for an empty chunk); window piece ``w``: ``(positions int64, costs
        float64, rows int64)`` of the chunk's rows in plan window ``w``.
    """
    part = lengths_task(chunk, rename, has_seq_len, has_timestamps)
    lengths, ids = part["lengths"], part["ids"]
    rows = chunk.offset + np.arange(len(ids), dtype=np.int64)
    costs = cost_model.cost(lengths)  # the driver's CostModel (a calibrated JSON need not exist on the node)
    pos = shuffled_positions(rows, layout.num_samples, seed)
    dropped = pos >= layout.num_steps * layout.per_step
    stats = {"nulls": part["nulls"], "num_empty": int((lengths == 0).sum()), "tlen_mismatch": part["tlen_mismatch"],
             "node": part["node"], "dropped_rows": rows[dropped], "dropped_ids": ids[dropped],
             "ids_increasing": bool(len(ids) < 2 or np.all(ids[1:] > ids[:-1])),
             "id_first": int(ids[0]) if len(ids) else None, "id_last": int(ids[-1]) if len(ids) else None}
    win = layout.window_of(pos)
    order = np.argsort(_small_ints(win, layout.num_windows), kind="stable")
    cuts = np.searchsorted(win[order], np.arange(layout.num_windows + 1), side="left")
    windows = [(pos[o], costs[o], rows[o]) for o in (order[cuts[w]:cuts[w + 1]] for w in range(layout.num_windows))]
    return [stats, *windows]


def _id_buckets_task(chunk: Chunk, rename: dict[str, str], num_id_buckets: int) -> list:
    """The chunk's ``sample_id`` values routed to duplicate buckets (a Ray task with
    ``num_returns = num_id_buckets``; run only when the ids are not increasing over the input).

    Returns:
        Per bucket ``b``, int64 ``[n_b]``: the chunk's ids in bucket ``b`` (:func:`_id_bucket`).
    """
    theirs = {v: k for k, v in rename.items()}
    try:
        ids = (open_chunk(chunk).read_row_groups(list(chunk.row_groups), columns=[theirs.get(S.SAMPLE_ID, S.SAMPLE_ID)])
               .slice(chunk.skip).column(0).cast(pa.int64()).fill_null(0).to_numpy())
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"input {chunk.path}: cannot read ({str(e).splitlines()[0]}); "
                         "the file is corrupt or not Parquet: regenerate it") from None
    bucket = _id_bucket(ids, num_id_buckets)
    border = np.argsort(bucket, kind="stable")
    bcuts = np.searchsorted(bucket[border], np.arange(num_id_buckets + 1), side="left")
    out = [ids[border[bcuts[b]:bcuts[b + 1]]] for b in range(num_id_buckets)]
    return out if num_id_buckets > 1 else out[0]


def _ids_increasing(stats: list[dict]) -> bool:
    """The input's ``sample_id`` values are strictly increasing (chunk by chunk, in input order), so
    none repeats (the local engine's shortcut, :func:`fsdata.samples.io.check_lengths_and_ids`)."""
    last = None
    for st in stats:
        if st["id_first"] is None:
            continue
        if not st["ids_increasing"] or (last is not None and st["id_first"] <= last):
            return False
        last = st["id_last"]
    return True


def _duplicates_task(*pieces: np.ndarray) -> int:
    """Repeated ``sample_id`` values in one bucket (runs as a Ray task): ``n - distinct``."""
    ids = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
    return int(sorted_unique(ids)[1]) if len(ids) else 0


def _plan_window_task(window: int, layout, seed: int, strategy: str, partitioner: str, chunk_starts: np.ndarray,
                      *pieces: tuple) -> list:
    """Plan one window of steps from its samples (a Ray task with ``num_returns = 1 + num_chunks``):
    :func:`fsdata.balancer.plan.plan_one_window`, the function the local engine calls per window.

    Args:
        window: w.
        layout: the run's :class:`~fsdata.balancer.plan.PlanLayout`.
        seed, strategy, partitioner: the run's settings.
        chunk_starts: shape ``[C+1]``, first input row of every chunk, then N.
        pieces: ``(positions, costs, rows)`` of the window's rows from every chunk.

    Returns:
        ``[summary, *chunk_pieces]``: the :meth:`~fsdata.balancer.plan.WindowPlan.summary` and, per
        chunk, ``(rows, step, rank, position)`` of the chunk's rows in this window.
    """
    pos = np.concatenate([p[0] for p in pieces])
    costs = np.concatenate([p[1] for p in pieces])
    rows = np.concatenate([p[2] for p in pieces])
    del pieces
    p0, p1 = layout.window_positions(window)
    if len(pos) != p1 - p0 or (len(pos) and (pos.min() != p0 or pos.max() != p1 - 1)):
        raise AssertionError(f"plan window {window}: positions are not exactly {p0}..{p1 - 1}")
    order = np.full(len(pos), -1, dtype=np.int64)  # positions are a permutation of p0..p1-1: no sort
    order[pos - p0] = np.arange(len(pos), dtype=np.int64)
    if (order < 0).any():  # a repeated position leaves another one empty
        raise AssertionError(f"plan window {window}: positions are not exactly {p0}..{p1 - 1}")
    wp = plan_one_window(costs[order], rows[order], window, layout, seed=seed, strategy=strategy,
                         partitioner=partitioner)
    del pos, costs, rows, order
    chunk_of = np.searchsorted(chunk_starts, wp.rows, side="right") - 1
    o = np.argsort(_small_ints(chunk_of, len(chunk_starts)), kind="stable")
    cuts = np.searchsorted(chunk_of[o], np.arange(len(chunk_starts)), side="left")
    out = [(wp.rows[i], wp.step[i], wp.rank[i], wp.position[i]) for i in (o[cuts[c]:cuts[c + 1]]
                                                                       for c in range(len(chunk_starts) - 1))]
    return [wp.summary(), *out]


def plan_windowed(ray, src: SampleSource, settings: BalanceSettings, chunks: list[Chunk], num_cpus: int,
                  timings: dict | None = None, *, cost_model: CostModel | None = None):
    """Stage 1 on Ray without a central copy of the rows: lengths tasks route (position, cost, row)
    to plan windows, one task per window plans it, the driver combines the window summaries.

    Args:
        ray: the joined Ray module.
        src: the validated input (its row count from the footers).
        settings: :class:`~fsdata.balancer.settings.BalanceSettings` (fixed policy or shuffle strategy).
        chunks: the input's chunks.
        num_cpus: the cluster's CPUs (sizes the duplicate-id buckets).
        timings: if given, filled with ``read_lengths`` and ``plan`` seconds.
        cost_model: the loaded ``settings.cost_model`` (None: loaded here).

    Returns:
        ``(table, chunk_plans, nodes)``: a :class:`~fsdata.shards.plan_file.PlanTable` holding the
        run's counts, loads, dropped ids and figures but no per-row arrays; per chunk, the object
        refs of its plan pieces (one per window); the Ray node ids that ran tasks.

    Raises:
        InputError: the local engine's input errors, word for word. ConfigError: impossible settings.
    """
    t0 = time.perf_counter()
    N, R, B = src.num_rows, settings.num_ranks, settings.batch_size_per_rank
    layout = plan_layout(N, R, B, compose=settings.strategy == "balanced" and settings.batch_policy == "fixed",
                         compose_window=settings.compose_window, plan_window=settings.plan_window)
    nw = layout.num_windows
    lengths_fn = ray.remote(num_cpus=1, num_returns=1 + nw)(_windowed_lengths_task)
    cost_model = cost_model or load_cost_model(settings.cost_model)
    outs = [lengths_fn.remote(c, src.rename, src.has_seq_len, src.has_timestamps, cost_model, layout,
                              settings.seed) for c in chunks]
    stats = get(ray, [o[0] for o in outs])
    nulls = {c: 0 for c in src.columns}
    for st in stats:
        for c, k in st["nulls"].items():
            nulls[c] = nulls.get(c, 0) + k
    dups = [0]
    if not _ids_increasing(stats):  # ids in any order: equal ids meet in hashed buckets
        nb = max(num_cpus, -(-N // ID_BUCKET_ROWS))
        ids_fn = ray.remote(num_cpus=1, num_returns=nb)(_id_buckets_task)
        routed = [ids_fn.remote(c, src.rename, nb) for c in chunks]
        routed = [[r] if nb == 1 else r for r in routed]
        dup_fn = ray.remote(num_cpus=1)(_duplicates_task)
        dups = get(ray, [dup_fn.remote(*[r[b] for r in routed]) for b in range(nb)])
        del routed
    check_input_counts(src.path, nulls=nulls, num_empty=sum(st["num_empty"] for st in stats),
                       timestamp_mismatches=sum(st["tlen_mismatch"] for st in stats), num_duplicate_ids=sum(dups))
    dropped_rows = np.concatenate([st["dropped_rows"] for st in stats])
    dropped_ids = np.concatenate([st["dropped_ids"] for st in stats])
    nodes = {st["node"] for st in stats}
    del stats
    if len(dropped_rows) and settings.remainder == "error":
        raise ConfigError(f"{len(dropped_rows)} samples do not fill a whole step of {R}x{B}; pass "
                          f"{setting('remainder', 'drop')} to record and drop them, or change "
                          f"{setting('num_ranks')}/{setting('batch_size_per_rank')}")
    t1 = time.perf_counter()
    chunk_starts = np.array([c.offset for c in chunks] + [N], dtype=np.int64)
    plan_fn = ray.remote(num_cpus=1, num_returns=1 + len(chunks))(_plan_window_task)
    planned = [plan_fn.remote(w, layout, settings.seed, settings.strategy, settings.partitioner, chunk_starts,
                              *[o[1 + w] for o in outs]) for w in range(nw)]
    del outs
    windows = get(ray, [p[0] for p in planned])
    chunk_plans = [[p[1 + c] for p in planned] for c in range(len(chunks))]
    del planned
    totals = combine_windows(windows, layout, settings.compose_window)
    del windows
    o = np.argsort(dropped_rows, kind="stable")
    plan = Plan(num_ranks=R, batch_size_per_rank=B, num_steps=layout.num_steps, step=np.empty(0, np.int32),
                rank=np.empty(0, np.int32), order_key=np.empty(0, np.int64), dropped=dropped_rows[o],
                loads=totals.loads, counts=totals.counts, baseline_loads=totals.baseline_loads,
                lower_bound_bubble=totals.lower_bound_bubble, partition_info=totals.partition_info,
                lower_bound_bubble_simple=totals.lower_bound_bubble_simple, compose_window=layout.compose_window,
                compose_info=totals.compose_info, plan_window=layout.plan_window)
    if plan.counts.min() == 0:
        raise AssertionError("plan left a rank without samples in a step")
    table = plan_table_from_plan(src, plan, np.empty(0, np.int64), np.empty(0), cost_model,
                                 settings, num_samples=N, dropped_sample_id=dropped_ids[o])
    if timings is not None:
        timings.update(read_lengths=t1 - t0, plan=time.perf_counter() - t1)
    return table, chunk_plans, nodes



def plan_central(ray, src: SampleSource, settings: BalanceSettings, chunks: list[Chunk], cost_model: CostModel,
                 timings: dict | None = None) -> tuple[PlanTable, set]:
    """Stage 1 on Ray for cost-budget (one sequence over the run): lengths tasks per chunk, then
    :func:`fsdata.balancer.plan.plan_costs` on the driver, as the local engine plans (O(N)).

    Returns:
        ``(table, nodes)``: the :class:`~fsdata.shards.plan_file.PlanTable` with per-row arrays,
        and the Ray node ids that ran tasks.

    Raises:
        InputError: the local engine's input errors, word for word. ConfigError: impossible settings.
    """
    t0 = time.perf_counter()
    lengths_fn = ray.remote(num_cpus=1)(lengths_task)
    parts = get(ray, [lengths_fn.remote(c, src.rename, src.has_seq_len, src.has_timestamps) for c in chunks])
    lengths, ids = check_lengths(src, parts)
    nodes = {p["node"] for p in parts}
    del parts
    t1 = time.perf_counter()
    costs = cost_model.cost(lengths)
    del lengths
    plan = plan_costs(costs, settings)  # the local engine's planning call
    table = plan_table_from_plan(src, plan, ids, costs, cost_model, settings)
    if timings is not None:
        timings.update(read_lengths=t1 - t0, plan=time.perf_counter() - t1)
    return table, nodes


def plan(ray, src: SampleSource, settings: BalanceSettings, chunks: list[Chunk], cost_model: CostModel,
         timings: dict | None = None) -> tuple[PlanTable, list | None, set]:
    """Stage 1 on Ray: :func:`plan_windowed` for the fixed policy or the shuffle strategy, else
    :func:`plan_central`.

    Returns:
        ``(table, chunk_plans, nodes)``; ``chunk_plans`` is None for a central plan.
    """
    windowed = settings.batch_policy == "fixed" or settings.strategy == "shuffle"
    if windowed:
        try:
            check_settings(src.num_rows, settings.num_ranks, settings.batch_size_per_rank)
        except InputError:
            windowed = False  # the central path raises the input's own errors first, as the local engine does
    if windowed:
        num_cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        return plan_windowed(ray, src, settings, chunks, num_cpus, timings, cost_model=cost_model)
    table, nodes = plan_central(ray, src, settings, chunks, cost_model, timings)
    return table, None, nodes
