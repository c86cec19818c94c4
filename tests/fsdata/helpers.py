"""Small generated inputs for fsdata tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.samples import schema as S


def heavy_tailed_lengths(n: int, seed: int = 0, max_len: int = 512) -> np.ndarray:
    """Lognormal lengths (median ~20, long tail), clipped to [1, max_len]; int64 [n]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=3.0, sigma=1.1, size=n).astype(np.int64), 1, max_len)


def write_samples(path: Path, n: int = 1000, seed: int = 0, with_timestamps: bool = False,
                  num_files: int = 1, id_offset: int = 1000) -> Path:
    """Write ``n`` valid samples (sample schema) as one file or ``num_files`` files in a folder."""
    rng = np.random.default_rng(seed)
    lengths = heavy_tailed_lengths(n, seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = rng.integers(1, 5000, size=offsets[-1])
    cols = {
        S.SAMPLE_ID: pa.array(np.arange(id_offset, id_offset + n, dtype=np.int64)),
        S.USER_ID: pa.array(rng.integers(0, 200, size=n)),
        S.ITEM_IDS: pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values)),
        S.TARGET_ITEM_ID: pa.array(rng.integers(1, 5000, size=n)),
    }
    if with_timestamps:
        cols[S.TIMESTAMPS] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                      pa.array(np.arange(offsets[-1], dtype=np.int64)))
    table = pa.table(cols)
    if num_files == 1:
        pq.write_table(table, path)
        return path
    path.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, n, num_files + 1).astype(int)
    for i in range(num_files):
        pq.write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]), path / f"part-{i:03d}.parquet")
    return path
