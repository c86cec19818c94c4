"""``fsdata balance``: write pre-balanced, pre-sharded Parquet (docs/format.md) atomically.

Stages (the input is never held in memory whole):

1. lengths: read ``item_ids`` lengths and ``sample_id`` (validating the input), cost per sample;
2. plan: global batches and the per-step assignment (:mod:`fsdata.plan`), from costs only;
3. bucket: stream the input in record batches and append each row to its rank's Arrow IPC bucket
   in a temporary folder (one sequential pass over the input);
4. finalize: per rank (in parallel threads), read its bucket, sort by (step, position), write
   ``rank=XXXXX/part-00000.parquet`` with row groups of whole steps, and checksum it;
5. manifest, ``step_stats.parquet``, ``dropped.parquet``; then the folder is moved into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from fsdata import schema as S
from fsdata.atomic import atomic_output
from fsdata.cost import CostModel
from fsdata.errors import InputError
from fsdata.io import SampleSource
from fsdata.plan import Plan

_KEY = "__order_key"
#: Target rows per Parquet row group in rank files (rounded to whole steps).
ROW_GROUP_ROWS = 16384


@dataclass(kw_only=True, slots=True)
class BalanceSettings:
    """Settings recorded in the manifest (everything the output depends on)."""

    num_ranks: int
    batch_size_per_rank: int
    seed: int = 0
    strategy: str = "balanced"
    batch_policy: str = "fixed"
    remainder: str = "drop"
    partitioner: str = "auto"
    budget: float | None = None
    compose_window: int = 1
    """W of :mod:`fsdata.compose` as requested (the plan records the window actually used)."""
    num_workers: int = 2
    progress: bool = True
    bucket_compression: str | None = None
    """Codec of the temporary per-rank Arrow IPC buckets: None (fastest; needs temporary disk space
    about the decoded size of the input), ``lz4`` or ``zstd`` (less disk, more CPU)."""


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _output_schema(src: SampleSource) -> pa.Schema:
    """Contract types for contract columns, others as in the input, plus ``step``."""
    first = pq.read_schema(src.files[0])
    fields = []
    contract = {**S.REQUIRED_COLUMNS, **S.OPTIONAL_COLUMNS}
    for f in first:
        name = src.rename.get(f.name, f.name)
        fields.append(pa.field(name, contract.get(name, f.type)))
    fields.append(pa.field(S.STEP, pa.int32()))
    return pa.schema(fields)


def _check_seq_len(batch: pa.RecordBatch, schema: pa.Schema, path: str) -> None:
    """The stored ``seq_len`` must equal ``len(item_ids)``: the plan was made from it."""
    items = batch.column(schema.get_field_index(S.ITEM_IDS))
    stored = batch.column(schema.get_field_index(S.SEQ_LEN))
    actual = pc.list_value_length(items).cast(pa.int64())
    if not pc.all(pc.equal(actual, stored.cast(pa.int64()))).as_py():
        raise InputError(f"input file {path}: column seq_len differs from len(item_ids) in some rows; "
                         "drop the seq_len column or recompute it")


def _bucket(src: SampleSource, plan: Plan, schema: pa.Schema, bucket_dir: Path, progress: bool,
            compression: str | None = None) -> None:
    R = plan.num_ranks
    options = pa.ipc.IpcWriteOptions(compression=compression)
    ipc_schema = schema.append(pa.field(_KEY, pa.int64()))
    writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
    offset = 0
    bar = tqdm(total=src.num_rows, unit="row", desc="bucket by rank", disable=not progress)
    try:
        for path in src.files:
            try:
                pf = pq.ParquetFile(path)
                batches = pf.iter_batches(batch_size=32768)
                for batch in batches:
                    n = batch.num_rows
                    idx = np.arange(offset, offset + n)
                    offset += n
                    rank = plan.rank[idx]
                    keep = rank >= 0
                    order = np.argsort(rank, kind="stable")
                    order = order[keep[order]]
                    if not len(order):
                        bar.update(n)
                        continue
                    cols = [batch.column(i).cast(schema.field(i).type) for i in range(batch.num_columns)]
                    if src.has_seq_len:
                        _check_seq_len(batch, schema, path)
                    cols.append(pa.array(plan.step[idx], type=pa.int32()))
                    cols.append(pa.array(plan.order_key[idx], type=pa.int64()))
                    table = pa.RecordBatch.from_arrays(cols, schema=ipc_schema).take(pa.array(order))
                    sorted_ranks = rank[order]
                    bounds = np.flatnonzero(np.diff(sorted_ranks)) + 1
                    starts = np.concatenate([[0], bounds])
                    ends = np.concatenate([bounds, [len(order)]])
                    for a, b in zip(starts, ends):
                        r = int(sorted_ranks[a])
                        w = writers.get(r)
                        if w is None:
                            w = writers[r] = pa.ipc.new_file(str(bucket_dir / f"{r:05d}.arrow"), ipc_schema,
                                                             options=options)
                        w.write_batch(table.slice(a, b - a))
                    bar.update(n)
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"input file {path}: cannot read rows ({str(e).splitlines()[0]}); "
                                 "the file is corrupt or truncated: regenerate it") from None
    finally:
        for w in writers.values():
            w.close()
        bar.close()
    if len(writers) != R:
        raise AssertionError(f"only {len(writers)} of {R} ranks received rows")


def _finalize_rank(r: int, plan: Plan, bucket_dir: Path, out_dir: Path) -> dict:
    with pa.memory_map(str(bucket_dir / f"{r:05d}.arrow")) as source:
        table = pa.ipc.open_file(source).read_all()
    table = table.take(pc.sort_indices(table, sort_keys=[(_KEY, "ascending")])).drop_columns([_KEY])
    counts = plan.counts[:, r].astype(np.int64)
    assert table.num_rows == int(counts.sum())
    rank_dir = out_dir / S.rank_dir_name(r)
    rank_dir.mkdir()
    rel = f"{S.rank_dir_name(r)}/part-00000.parquet"
    ends = np.cumsum(counts)
    with pq.ParquetWriter(str(out_dir / rel), table.schema, compression="zstd", write_statistics=True) as w:
        start = 0
        while start < table.num_rows:
            # whole steps per row group: the first step end at or past start + ROW_GROUP_ROWS
            j = int(np.searchsorted(ends, start + ROW_GROUP_ROWS, side="left"))
            stop = int(ends[min(j, len(ends) - 1)])
            w.write_table(table.slice(start, stop - start), row_group_size=stop - start)
            start = stop
    del table
    path = out_dir / rel
    return {"rank": r, "path": rel, "num_rows": int(counts.sum()), "num_bytes": path.stat().st_size,
            "sha256": sha256_file(path)}


def write_step_stats(path: Path, plan: Plan) -> None:
    """``step_stats.parquet``: one row per (step, rank) with counts and predicted cost."""
    S_, R = plan.loads.shape
    table = pa.table({
        "step": pa.array(np.repeat(np.arange(S_, dtype=np.int32), R)),
        "rank": pa.array(np.tile(np.arange(R, dtype=np.int32), S_)),
        "num_samples": pa.array(plan.counts.ravel().astype(np.int32)),
        "predicted_cost": pa.array(plan.loads.ravel()),
    })
    pq.write_table(table, str(path), compression="zstd")


def write_balanced(src: SampleSource, output: str | os.PathLike, plan: Plan, sample_ids: np.ndarray,
                   cost_model: CostModel, settings: BalanceSettings, *, overwrite: bool = False,
                   timings: dict[str, float] | None = None) -> dict:
    """Stream the input into the shard layout and write the manifest, atomically.

    Args:
        src: the validated input.
        output: OUTPUT folder (must not exist unless ``overwrite``).
        plan: the plan for ``src``'s rows.
        sample_ids: shape ``[N]`` int64, ``sample_id`` of each input row (for the drop record).
        cost_model: the model the plan's costs came from.
        settings: recorded in the manifest.
        overwrite: replace an existing OUTPUT atomically.
        timings: if given, filled with seconds per stage (``bucket``, ``write_ranks``, ``finish``).

    Returns:
        The manifest (dict).

    Raises:
        ConfigError: OUTPUT exists and ``overwrite`` is False.
        InputError: an input file fails to read midway.
    """
    schema = _output_schema(src)
    with atomic_output(output, overwrite=overwrite) as tmp:
        bucket_dir = tmp / ".buckets"
        bucket_dir.mkdir()
        t0 = time.perf_counter()
        _bucket(src, plan, schema, bucket_dir, settings.progress, settings.bucket_compression)
        t1 = time.perf_counter()
        files: list[dict] = []
        bar = tqdm(total=plan.num_ranks, unit="rank", desc="write rank files", disable=not settings.progress)
        with ThreadPoolExecutor(max_workers=max(1, settings.num_workers)) as ex:
            for info in ex.map(lambda r: _finalize_rank(r, plan, bucket_dir, tmp), range(plan.num_ranks)):
                files.append(info)
                bar.update(1)
        bar.close()
        shutil.rmtree(bucket_dir)
        t2 = time.perf_counter()
        write_step_stats(tmp / S.STEP_STATS_NAME, plan)
        dropped_file = None
        if len(plan.dropped):
            dropped_file = S.DROPPED_NAME
            pq.write_table(pa.table({S.SAMPLE_ID: pa.array(sample_ids[plan.dropped], type=pa.int64()),
                                     "reason": pa.array(["remainder"] * len(plan.dropped))}),
                           str(tmp / dropped_file), compression="zstd")
        manifest = {
            "format_version": S.FORMAT_VERSION,
            "num_ranks": plan.num_ranks,
            "num_steps": plan.num_steps,
            "batch_size_per_rank": plan.batch_size_per_rank,
            "batch_policy": settings.batch_policy,
            "strategy": settings.strategy,
            "num_samples_input": int(len(plan.step)),
            "num_samples_written": int(plan.counts.sum()),
            "num_samples_dropped": int(len(plan.dropped)),
            "remainder_policy": settings.remainder,
            "dropped_file": dropped_file,
            "cost_model": cost_model.to_json(),
            "seed": settings.seed,
            "predicted_bubble": plan.predicted_bubble,
            "baseline_predicted_bubble": plan.baseline_bubble,
            "lower_bound_bubble": plan.lower_bound_bubble,
            "lower_bound_kind": "pigeonhole",
            "lower_bound_bubble_simple": plan.lower_bound_bubble_simple,
            "per_rank_count": plan.count_distribution(),
            "columns": schema.names,
            "step_stats_file": S.STEP_STATS_NAME,
            "files": files,
            "settings": {"partitioner": settings.partitioner, "partition_info": plan.partition_info,
                         "budget": settings.budget, "budget_used": plan.budget_used,
                         "compose_window": plan.compose_window, "compose": plan.compose_info,
                         "input_columns_renamed": src.rename},
        }
        (tmp / S.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    if timings is not None:
        timings.update(bucket=t1 - t0, write_ranks=t2 - t1, finish=time.perf_counter() - t2)
    return manifest
