"""The output's files checked one by one: each rank file (size, SHA-256, columns, steps, row
groups), the step stats and the dropped samples; the per-row content hashes compared with the input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.errors import VerifyError
from fsdata.samples import schema as S
from fsdata.shards.manifest import Manifest, ManifestError, sha256_file
from fsdata.shards.verify.recorded import out_path

_HASH_SEED = 0x5EEDF5DA7A


def _check_sha(path: Path | str, digest: str | None, check: bool) -> None:
    if check and digest is not None and fsio.is_file(path) and sha256_file(path) != digest:
        raise VerifyError(f"checksum of {path} differs from the manifest (file changed or corrupt); "
                          "rerun 'fsdata balance'")


def read_step_stats(out: Path | str, m: Manifest, check_checksums: bool = True) -> pa.Table:
    """The step stats, checked: SHA-256, exact column types, one row per (step, rank) in order.

    Raises:
        VerifyError: missing, changed or malformed.
    """
    path = out_path(out, m.step_stats_file)
    _check_sha(path, m.step_stats_sha256, check_checksums)
    try:
        t = m.read_step_stats()
    except ManifestError as e:
        raise VerifyError(str(e)) from None
    need = {"step": pa.int32(), "rank": pa.int32(), "num_samples": pa.int32(), "predicted_cost": pa.float64()}
    if "num_tokens" in t.schema.names:  # fsdata >= 0.3
        need["num_tokens"] = pa.int64()
    if t.schema.names != list(need) or any(t.schema.field(k).type != v for k, v in need.items()):
        raise VerifyError(f"{path}: columns {t.schema} differ from step int32, rank int32, num_samples int32, "
                          "predicted_cost float64[, num_tokens int64]; rerun 'fsdata balance'")
    if t.num_rows != m.num_steps * m.num_ranks or any(t.column(k).null_count for k in need):
        raise VerifyError(f"{path} has {t.num_rows} rows (or nulls), expected num_steps*num_ranks = "
                          f"{m.num_steps * m.num_ranks}; rerun 'fsdata balance'")
    steps = np.repeat(np.arange(m.num_steps), m.num_ranks)
    ranks = np.tile(np.arange(m.num_ranks), m.num_steps)
    if not (np.array_equal(t.column("step").to_numpy(), steps) and np.array_equal(t.column("rank").to_numpy(), ranks)):
        raise VerifyError(f"{path}: rows are not one per (step, rank) sorted by step then rank; rerun 'fsdata balance'")
    return t


def read_dropped(out: Path | str, m: Manifest, check_checksums: bool = True) -> np.ndarray:
    """``sample_id`` of the dropped samples, shape ``[D]`` int64 (empty without a dropped file).

    Raises:
        VerifyError: the file is changed, unreadable or lacks an integer ``sample_id`` without nulls.
    """
    if not m.dropped_file:
        return np.empty(0, np.int64)
    path = out_path(out, m.dropped_file)
    _check_sha(path, m.dropped_sha256, check_checksums)
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        t = pq.read_table(where, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise VerifyError(f"{path} is missing or unreadable ({str(e).splitlines()[0]}); "
                          "rerun 'fsdata balance'") from None
    if (S.SAMPLE_ID not in t.schema.names or not pa.types.is_integer(t.schema.field(S.SAMPLE_ID).type)
            or t.column(S.SAMPLE_ID).null_count):
        raise VerifyError(f"{path}: no integer sample_id column without nulls; rerun 'fsdata balance'")
    return t.column(S.SAMPLE_ID).to_numpy().astype(np.int64)

def row_hashes(table: pa.Table) -> np.ndarray:
    """Per-row uint64 hash of all columns of ``table`` (Polars ``hash_rows`` with a fixed seed; both sides hashed in
    one process)."""
    return pl.from_arrow(table).hash_rows(seed=_HASH_SEED).to_numpy()


def check_rank_file(out: Path | str, m: Manifest, f, check_checksums: bool, hash_content: bool):
    """One rank file against its manifest entry: present, size, SHA-256, columns, types, no nulls,
    rank column, steps in range and in order, row groups holding whole steps with step statistics,
    no empty ``item_ids``.

    Returns:
        ``(step [n] int64, lengths [n] int64, sample_id [n] int64, hashes [n] uint64 or None)``;
        ``hashes`` (:func:`row_hashes` of the input columns) only with ``hash_content``.

    Raises:
        VerifyError: the first violation, naming the rank and the file.
    """
    r, path = f.rank, out_path(out, f.path)
    if not fsio.is_file(path):
        raise VerifyError(f"rank {r}: file {path} is missing; rerun 'fsdata balance' or copy the whole OUTPUT")
    num_bytes = fsio.size(path)
    if num_bytes != f.num_bytes:
        raise VerifyError(f"rank {r}: {path} has {num_bytes} bytes, the manifest says {f.num_bytes} "
                          "(file changed or truncated)")
    if check_checksums and sha256_file(path) != f.sha256:
        raise VerifyError(f"rank {r}: checksum of {path} differs from the manifest (file changed or corrupt)")
    need = [S.SAMPLE_ID, S.ITEM_IDS, S.STEP] + ([S.RANK] if m.format_version >= 2 else [])
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        pf = pq.ParquetFile(where, filesystem=fs)
        names = pf.schema_arrow.names
        if names != m.columns:
            raise VerifyError(f"rank {r}: {path} has columns {names}, the manifest says {m.columns}")
        missing = [c for c in need if c not in names]
        if missing:
            raise VerifyError(f"rank {r}: {path} lacks columns {missing}")
        got = (pf.schema_arrow.metadata or {}).get(b"fsdata.plan_digest", b"").decode() or None
        if m.plan_digest is not None and got != m.plan_digest:
            raise VerifyError(f"rank {r}: {path} carries plan digest {got}, the manifest says {m.plan_digest} (a rank "
                              "file of another output or plan); rerun 'fsdata balance' or copy the whole OUTPUT")
        # all columns only when comparing content with the input; else the ones checked here
        t = pf.read(columns=None if hash_content else need)
    except (pa.ArrowException, OSError) as e:
        raise VerifyError(f"rank {r}: {path} is unreadable ({str(e).splitlines()[0]})") from None
    if (t.schema.field(S.STEP).type != pa.int32()
            or (m.format_version >= 2 and t.schema.field(S.RANK).type != pa.int32())):
        raise VerifyError(f"rank {r}: {path}: step/rank are not int32")
    if t.num_rows != f.num_rows:
        raise VerifyError(f"rank {r}: {t.num_rows} rows, manifest says {f.num_rows}")
    for c in (S.SAMPLE_ID, S.STEP, S.ITEM_IDS) + ((S.RANK,) if m.format_version >= 2 else ()):
        if t.column(c).null_count:
            raise VerifyError(f"rank {r}: {path}: column {c} holds nulls")
    if m.format_version >= 2:
        rk = t.column(S.RANK).to_numpy()
        if len(rk) and (rk != r).any():
            raise VerifyError(f"rank {r}: {path}: the rank column holds {int(rk[rk != r][0])}, not {r}")
    step = t.column(S.STEP).to_numpy().astype(np.int64)
    if len(step) and (step.min() < 0 or step.max() >= m.num_steps):
        raise VerifyError(f"rank {r}: steps {int(step.min())}..{int(step.max())} lie outside 0..{m.num_steps - 1}")
    if len(step) and (np.diff(step) < 0).any():
        raise VerifyError(f"rank {r}: rows are not ordered by step")
    # row groups hold whole steps, with step statistics (readers resume and cut steps with them)
    md = pf.metadata
    step_col = next(j for j in range(md.num_columns) if pf.schema.column(j).path == S.STEP)
    start = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        n = rg.num_rows
        st = rg.column(step_col).statistics
        if n and (st is None or not st.has_min_max or int(st.min) != step[start] or int(st.max) != step[start + n - 1]):
            raise VerifyError(f"rank {r}: {path} row group {g} lacks correct step statistics; rerun 'fsdata balance'")
        if g and n and start and step[start] == step[start - 1]:
            raise VerifyError(f"rank {r}: {path} row group {g} starts inside step {int(step[start])} (a step spans two "
                              "row groups); rerun 'fsdata balance'")
        start += n
    lengths = pc.list_value_length(t.column(S.ITEM_IDS)).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(lengths) and lengths.min() < 1:
        raise VerifyError(f"rank {r}: {path}: some item_ids are empty")
    hashes = None
    if hash_content:
        drop = [S.STEP] + ([S.RANK] if m.format_version >= 2 else [])
        hashes = row_hashes(t.drop_columns(drop))
    return step, lengths, t.column(S.SAMPLE_ID).to_numpy().astype(np.int64), hashes

