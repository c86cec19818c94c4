"""The shard format's layout: the names and paths of an OUTPUT's files, their digests, the step stats.

An ``fsdata balance`` OUTPUT holds one folder per rank (:func:`rank_dir_name`, one file each:
:func:`rank_file_path`) and three root files: the manifest (:data:`MANIFEST_NAME`, read and
written by :class:`fsdata.shards.manifest.Manifest`), the step stats (:data:`STEP_STATS_NAME`,
written by :func:`write_step_stats`) and the dropped samples (:data:`DROPPED_NAME`). The
manifest records the SHA-256 of each file (:func:`sha256_file`). :mod:`fsdata.shards.manifest`
re-exports every name here: it is the format's one import.

Versions: format_version 4 (written today) and 3 have version 2's names and columns; only the rank
files' Parquet encoding differs (:func:`fsdata.shards.writer.rank_file_options`: version 4
delta-encodes integer-list columns without a codec, version 3 writes LZ4 with dictionary pages,
version 2 zstd; a rank file of any version reads with any Parquet reader). Version 2 (still
read) names the root metadata ``_manifest.json``,
``_step_stats.parquet`` and ``_dropped.parquet`` and the rank folders ``rank-00000``; version 1
(still read) named them ``manifest.json``, ``step_stats.parquet``, ``dropped.parquet`` and
``rank=00000``. Readers take every path from the manifest, never from a glob.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from fsdata import fsio

#: Version written by this fsdata; :data:`READ_VERSIONS` are the versions it reads.
FORMAT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
MANIFEST_NAMES = {4: "_manifest.json", 3: "_manifest.json", 2: "_manifest.json", 1: "manifest.json"}
STEP_STATS_NAMES = {4: "_step_stats.parquet", 3: "_step_stats.parquet", 2: "_step_stats.parquet",
                    1: "step_stats.parquet"}
DROPPED_NAMES = {4: "_dropped.parquet", 3: "_dropped.parquet", 2: "_dropped.parquet", 1: "dropped.parquet"}
#: The root file names that this version writes.
MANIFEST_NAME = MANIFEST_NAMES[FORMAT_VERSION]
STEP_STATS_NAME = STEP_STATS_NAMES[FORMAT_VERSION]
#: Columns of the step stats, in order, with their Arrow types (docs/format.md); ``num_tokens`` is
#: written since fsdata 0.3 (:data:`STEP_STATS_OPTIONAL`: older outputs lack it and still read).
STEP_STATS_TYPES = {"step": "int32", "rank": "int32", "num_samples": "int32", "predicted_cost": "double",
                    "num_tokens": "int64"}
#: Step-stats columns an older output may lack.
STEP_STATS_OPTIONAL = ("num_tokens",)
DROPPED_NAME = DROPPED_NAMES[FORMAT_VERSION]
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: Columns of the step stats, one row per (step, rank), sorted by step then rank.
STEP_STATS_COLUMNS = ("step", "rank", "num_samples", "predicted_cost", "num_tokens")


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file (local path or URI), read in ``chunk_bytes`` chunks (the digests the
    manifest records)."""
    if fsio.is_remote(fsio.normalize(path)):
        return fsio.sha256(path, chunk_bytes)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def write_step_stats(path: str | os.PathLike, counts, loads, num_tokens=None) -> None:
    """Write the step stats (``_step_stats.parquet``): one row per (step, rank), sorted by step then
    rank: ``step`` int32, ``rank`` int32, ``num_samples`` int32, ``predicted_cost`` float64 and
    ``num_tokens`` int64 (when given).

    Args:
        path: the file to write (local path or URI).
        counts: shape ``[S x R]``, int; samples per (step, rank).
        loads: shape ``[S x R]``, float64; predicted cost per (step, rank), seconds.
        num_tokens: shape ``[S x R]``, int; the sum of the samples' history lengths (``seq_len`` =
            ``len(item_ids)``) per (step, rank); None: the column is not written (fsdata < 0.3 layout).
    """
    import numpy as np  # noqa: PLC0415 (kept out of the import of the manifest reader)
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    S_, R = loads.shape
    table = pa.table({
        "step": pa.array(np.repeat(np.arange(S_, dtype=np.int32), R)),
        "rank": pa.array(np.tile(np.arange(R, dtype=np.int32), S_)),
        "num_samples": pa.array(counts.ravel().astype(np.int32)),
        "predicted_cost": pa.array(loads.ravel()),
        **({} if num_tokens is None else {"num_tokens": pa.array(np.asarray(num_tokens).ravel().astype(np.int64))}),
    })
    fs, where = fsio.filesystem_and_path(path)
    pq.write_table(table, where, compression="zstd", filesystem=fs)


def rank_dir_name(rank: int, version: int = FORMAT_VERSION) -> str:
    """Folder of one rank's shard: ``rank-00000`` (v2 and v3; no ``=``, so no reader infers a hive
    partition) or ``rank=00000`` (v1)."""
    return f"rank={rank:05d}" if version == 1 else f"rank-{rank:05d}"


def rank_file_path(rank: int, version: int = FORMAT_VERSION) -> str:
    """Path of a rank file relative to OUTPUT: ``rank-00000/part-00000.parquet``."""
    return f"{rank_dir_name(rank, version)}/part-00000.parquet"


def is_sha256(value: Any) -> bool:
    """Whether ``value`` is a lower-case hex SHA-256 digest."""
    return isinstance(value, str) and bool(_SHA256.match(value))
