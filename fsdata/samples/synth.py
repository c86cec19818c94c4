"""Real length distributions and synthetic sample files shaped like them.

Readers of the shared interaction datasets (``../shared/datasets``; see its README.md), all
Polars-based, return the number of items of every user in file order:

* ``sequences``: one user per line, ``user item1 item2 ...`` (chronological);
* ``events``: one ``user item`` pair per line, no header, lines in time order;
* ``csv``: an events CSV with a header whose first column is the user (e.g. MovieLens
  ``userId,Id,rating,timestamp``).

Two sample layouts are derived from a user with ``n`` items:

* per-user: one sample, the first ``n - 1`` items predict the last: length ``n - 1``;
* per-event: samples ``t = 1 .. n-1``, each predicting item ``t`` from its history, of length
  ``min(t, max_seq_len)`` (the usual next-item training layout, e.g. HSTU / SASRec).

:func:`write_synth_samples` writes Parquet in the sample schema (:mod:`fsdata.samples.schema`) with lengths
resampled from such a distribution, one row group at a time so memory stays flat.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.atomic import atomic_output
from fsdata.errors import ConfigError, InputError
from fsdata.samples.schema import sample_schema

FORMATS = ("sequences", "events", "csv")


def detect_format(path: str | os.PathLike, probe_lines: int = 1000) -> str:
    """Guess the format of an interaction file from its first lines (see module docstring).

    Returns:
        ``"csv"`` if the first line has a comma, ``"events"`` if every probed line has exactly two
        tokens, else ``"sequences"``.

    Raises:
        InputError: the file is missing or empty.
    """
    try:
        with open(path) as f:
            lines = [line for _, line in zip(range(probe_lines), f)]
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}; pass an existing interaction file") from None
    if not lines:
        raise InputError(f"{path} is empty; expected interaction lines")
    if "," in lines[0]:
        return "csv"
    return "events" if all(len(line.split()) == 2 for line in lines if line.strip()) else "sequences"


def user_item_counts(path: str | os.PathLike, fmt: str | None = None) -> np.ndarray:
    """Number of items (interactions) of every user, in order of first appearance.

    Args:
        path: a ``sequences``, ``events`` or ``csv`` file (module docstring).
        fmt: one of :data:`FORMATS`; None detects it with :func:`detect_format`.

    Returns:
        shape ``[U]``, int64.

    Raises:
        ConfigError: unknown ``fmt``.
        InputError: unreadable or empty file.
    """
    fmt = fmt or detect_format(path)
    if fmt == "sequences":
        df = pl.read_csv(path, has_header=False, separator="\t", quote_char=None, new_columns=["line"])
        tokens = pl.col("line").str.strip_chars().str.split(" ").list.len().cast(pl.Int64)
        return df.select(tokens - 1).to_series().to_numpy()
    if fmt in ("events", "csv"):
        if fmt == "events":
            df = pl.read_csv(path, has_header=False, separator=" ", columns=[0])
        else:
            df = pl.read_csv(path, columns=[0])
        user = df.columns[0]
        counts = df.group_by(user, maintain_order=True).len()
        return counts.get_column("len").cast(pl.Int64).to_numpy()
    raise ConfigError(f"unknown interaction format '{fmt}'; use one of {', '.join(FORMATS)}")


def per_user_lengths(item_counts: np.ndarray) -> np.ndarray:
    """Per-user sample lengths ``n - 1`` (users with a single item give no sample).

    Args:
        item_counts: shape ``[U]``, int; items per user.

    Returns:
        shape ``[<=U]``, int64.
    """
    n = np.asarray(item_counts, dtype=np.int64)
    return n[n >= 2] - 1


def per_event_lengths(item_counts: np.ndarray, max_seq_len: int = 512) -> np.ndarray:
    """Per-event sample lengths: ``min(t, max_seq_len)`` for ``t = 1 .. n-1`` of every user.

    Args:
        item_counts: shape ``[U]``, int; items per user.
        max_seq_len: history cap (most recent items kept).

    Returns:
        shape ``[sum(n - 1)]``, int64, user by user, chronological.
    """
    n = np.asarray(item_counts, dtype=np.int64)
    per_user = np.maximum(n - 1, 0)
    total = int(per_user.sum())
    starts = np.repeat(np.cumsum(per_user) - per_user, per_user)
    t = np.arange(total, dtype=np.int64) - starts + 1
    return np.minimum(t, max_seq_len)


def read_lengths(path: str | os.PathLike, layout: str = "event", max_seq_len: int = 512,
                 fmt: str | None = None) -> np.ndarray:
    """Sample lengths of a real dataset under a sample layout.

    Args:
        path: interaction file (module docstring).
        layout: ``"user"`` (one sample per user, uncapped) or ``"event"`` (one per interaction,
            history capped at ``max_seq_len``).
        max_seq_len: history cap of the per-event layout.
        fmt: file format, None to detect.

    Returns:
        shape ``[N]``, int64 lengths, all >= 1.

    Raises:
        ConfigError: unknown layout or format.
    """
    counts = user_item_counts(path, fmt)
    if layout == "user":
        return per_user_lengths(counts)
    if layout == "event":
        return per_event_lengths(counts, max_seq_len)
    raise ConfigError(f"unknown sample layout '{layout}'; use 'user' or 'event'")


def synth_lengths(n: int, source_lengths: np.ndarray, seed: int = 0) -> np.ndarray:
    """Resample ``n`` lengths from a real length distribution (i.i.d., with replacement).

    Args:
        n: number of lengths.
        source_lengths: shape ``[M]``, int; observed lengths (e.g. :func:`read_lengths`).
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        shape ``[n]``, int64; the empirical distribution of ``source_lengths``.

    Raises:
        ConfigError: empty source or a length < 1.
    """
    src = np.asarray(source_lengths, dtype=np.int64)
    if src.size == 0 or src.min() < 1:
        raise ConfigError("source_lengths must be non-empty with every length >= 1; check the dataset read")
    return np.random.default_rng(seed).choice(src, size=int(n))


def write_synth_samples(path: str | os.PathLike, num_samples: int, source_lengths: np.ndarray, seed: int = 0,
                        num_items: int = 100_000, num_users: int | None = None,
                        rows_per_group: int = 1 << 20, compression: str = "zstd") -> dict:
    """Write synthetic samples in the sample schema, one row group at a time (flat memory).

    Lengths are resampled from ``source_lengths``; item ids, target ids and user ids are uniform
    random; ``sample_id = 0 .. num_samples-1``. The file is written to a hidden temporary sibling
    and renamed on success (:func:`fsdata.atomic.atomic_output`, replacing an existing file), so it
    appears whole or not at all, also when the disk fills up midway.

    Args:
        path: output Parquet file.
        num_samples: rows to write.
        source_lengths: shape ``[M]``, int; real lengths to resample.
        seed: random seed (same seed, same file).
        num_items: item ids are drawn from ``[1, num_items]``.
        num_users: user ids from ``[0, num_users)``; default ``max(1, num_samples // 100)``.
        rows_per_group: rows per Parquet row group (and per generated batch).
        compression: Parquet codec.

    Returns:
        ``{"path", "num_samples", "num_row_groups", "num_items_total", "num_bytes"}``.

    Raises:
        ConfigError: non-positive counts.
    """
    if num_samples < 1 or num_items < 1 or rows_per_group < 1:
        raise ConfigError(f"num_samples={num_samples}, num_items={num_items}, rows_per_group={rows_per_group} "
                          "must all be >= 1")
    src = np.asarray(source_lengths, dtype=np.int64)
    num_users = num_users or max(1, num_samples // 100)
    rng = np.random.default_rng(seed)
    schema = sample_schema(with_seq_len=True)
    path = Path(path)
    total_items = 0
    groups = 0
    with atomic_output(path, overwrite=True, is_dir=False) as tmp, \
            pq.ParquetWriter(tmp, schema, compression=compression) as writer:
        for start in range(0, num_samples, rows_per_group):
            n = min(rows_per_group, num_samples - start)
            lengths = synth_lengths(n, src, seed=int(rng.integers(1 << 62)))
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            values = rng.integers(1, num_items + 1, size=int(offsets[-1]), dtype=np.int64)
            if offsets[-1] >= 2**31:
                raise ConfigError(f"a row group of {n} samples holds {offsets[-1]} items, over the 2^31 "
                                  "list offsets of list<int64>; lower rows_per_group")
            items = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
            table = pa.Table.from_arrays([
                pa.array(np.arange(start, start + n, dtype=np.int64)),
                pa.array(rng.integers(0, num_users, size=n, dtype=np.int64)),
                items,
                pa.array(rng.integers(1, num_items + 1, size=n, dtype=np.int64)),
                pa.array(lengths.astype(np.int32)),
            ], schema=schema)
            writer.write_table(table, row_group_size=n)
            total_items += int(offsets[-1])
            groups += 1
        # marks the file as FreeScale's (fsdata.atomic.check_replaceable: --overwrite replaces only such files)
        writer.add_key_value_metadata({b"freescale.synth": json.dumps(
            {"num_samples": int(num_samples), "seed": int(seed), "num_items": int(num_items)}).encode()})
    return {"path": str(path), "num_samples": int(num_samples), "num_row_groups": groups,
            "num_items_total": total_items, "num_bytes": path.stat().st_size}
