"""Tiny fsdata-format shard outputs written in code (docs/format.md), for reader and model tests.

The real writer is ``fsdata balance``; this helper writes the same layout from synthetic samples so
tests run without it, and can write the *same global batches* under different assignments.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.shards import manifest as schema  # the shard format's file names
from fsdata.balancer.partitioners import partition_steps
from fsdata.shards.plan_file import PLAN_DIGEST_KEY


def synthetic_steps(num_steps: int, global_batch: int, *, seed: int = 0, num_items: int = 50,
                    max_len: int = 24) -> list[dict]:
    """Global batches: per step a dict of numpy columns (sample_id, user_id, item_ids, target)."""
    rng = np.random.default_rng(seed)
    out, sid = [], 0
    for _ in range(num_steps):
        lengths = np.minimum(max_len, 1 + rng.lognormal(1.5, 0.8, global_batch).astype(np.int64))
        hist = [rng.integers(1, num_items, int(n)) for n in lengths]
        out.append({"sample_id": np.arange(sid, sid + global_batch), "user_id": rng.integers(0, 100, global_batch),
                    "item_ids": hist, "target_item_id": rng.integers(1, num_items, global_batch),
                    "lengths": lengths})
        sid += global_batch
    return out


def write_shards(out: str, *, num_ranks: int, num_steps: int, batch_size_per_rank: int,
                 strategy: str = "balanced", policy: str = "fixed", seed: int = 0, num_items: int = 50,
                 max_len: int = 24, steps_per_row_group: int = 2, samples: str | None = None,
                 plan_digest: str | None = None, manifest_extra: dict | None = None) -> str:
    """Write an fsdata-format OUTPUT with ``num_ranks`` rank files; returns ``out``.

    ``samples`` (``per-user`` / ``per-event``) is recorded as the manifest's ``settings.samples``
    (fstrain picks its objective from it); the step stats always carry ``num_tokens``.

    ``strategy='balanced'`` assigns with LPT on ``L^2 + 64 L``; ``'shuffle'`` cuts contiguously.
    ``policy='cost-budget'`` gives every step random per-rank counts (>= 1, same global batch).
    The global batches depend only on ``seed``, never on the strategy or policy.

    Every rank file carries a ``rank`` int32 column and ``fsdata.plan_digest`` key-value metadata
    (``plan_digest``; default: a digest of the arguments), as fsdata's writer does.
    ``manifest_extra`` keys are added to the manifest (e.g. ``plan_digest``, ``resharded_from``).
    """
    if plan_digest is None:
        key = json.dumps([num_ranks, num_steps, batch_size_per_rank, strategy, policy, seed, num_items, max_len])
        plan_digest = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    R, B = num_ranks, batch_size_per_rank
    steps = synthetic_steps(num_steps, R * B, seed=seed, num_items=num_items, max_len=max_len)
    rng = np.random.default_rng(seed + 1)
    os.makedirs(out, exist_ok=True)
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(R)]  # (step, index in step)
    stats = []
    for s, st in enumerate(steps):
        costs = st["lengths"].astype(float) ** 2 + 64 * st["lengths"]
        if policy == "cost-budget":
            cuts = np.sort(rng.choice(np.arange(1, R * B), R - 1, replace=False))
            sizes = np.diff(np.concatenate([[0], cuts, [R * B]]))
            order = np.argsort(-costs, kind="stable") if strategy == "balanced" else np.arange(R * B)
            ranks = np.empty(R * B, dtype=np.int32)
            ranks[order] = np.repeat(np.arange(R), sizes)
        else:
            ranks = partition_steps(costs[None], R, B, "lpt" if strategy == "balanced" else "shuffle")[0]
        for r in range(R):
            idx = np.flatnonzero(ranks == r)
            per_rank[r].extend((s, int(i)) for i in idx)
            stats.append((s, r, len(idx), float(costs[idx].sum()), int(st["lengths"][idx].sum())))
    files = []
    for r in range(R):
        rel = f"{schema.rank_dir_name(r)}/part-00000.parquet"
        os.makedirs(os.path.join(out, schema.rank_dir_name(r)), exist_ok=True)
        rows = per_rank[r]
        tab = pa.table({
            "sample_id": pa.array([int(steps[s]["sample_id"][i]) for s, i in rows], pa.int64()),
            "user_id": pa.array([int(steps[s]["user_id"][i]) for s, i in rows], pa.int64()),
            "item_ids": pa.array([steps[s]["item_ids"][i].tolist() for s, i in rows], pa.list_(pa.int64())),
            "target_item_id": pa.array([int(steps[s]["target_item_id"][i]) for s, i in rows], pa.int64()),
            "step": pa.array([s for s, _ in rows], pa.int32()),
            "rank": pa.array([r] * len(rows), pa.int32()),
        })
        tab = tab.replace_schema_metadata({PLAN_DIGEST_KEY: plan_digest.encode()})
        path = os.path.join(out, rel)
        with pq.ParquetWriter(path, tab.schema, compression="zstd") as w:
            step_col = tab.column("step").to_numpy()
            for lo in range(0, num_steps, steps_per_row_group):
                m = (step_col >= lo) & (step_col < lo + steps_per_row_group)
                w.write_table(tab.filter(pa.array(m)))
        files.append({"rank": r, "path": rel, "num_rows": len(rows), "num_bytes": os.path.getsize(path),
                      "sha256": ""})
    st = pa.table({"step": pa.array([x[0] for x in stats], pa.int32()),
                   "rank": pa.array([x[1] for x in stats], pa.int32()),
                   "num_samples": pa.array([x[2] for x in stats], pa.int32()),
                   "predicted_cost": pa.array([x[3] for x in stats], pa.float64()),
                   "num_tokens": pa.array([x[4] for x in stats], pa.int64())})
    pq.write_table(st, os.path.join(out, schema.STEP_STATS_NAME))
    manifest = {"format_version": schema.FORMAT_VERSION, "num_ranks": R, "num_steps": num_steps,
                "batch_size_per_rank": B, "batch_policy": policy, "strategy": strategy,
                "num_samples_input": R * B * num_steps, "num_samples_written": R * B * num_steps,
                "num_samples_dropped": 0, "remainder_policy": "drop", "dropped_file": None,
                "cost_model": {"kind": "polynomial", "name": "quadratic", "coefficients": [0.0, 64.0, 1.0]},
                "seed": seed, "predicted_bubble": 0.0, "baseline_predicted_bubble": 0.0,
                "lower_bound_bubble": 0.0,
                "columns": ["sample_id", "user_id", "item_ids", "target_item_id", "step", "rank"],
                "step_stats_file": schema.STEP_STATS_NAME, "files": files,
                "settings": {} if samples is None else {"samples": samples}, **(manifest_extra or {})}
    with open(os.path.join(out, schema.MANIFEST_NAME), "w") as f:
        json.dump(manifest, f, indent=1)
    return out
