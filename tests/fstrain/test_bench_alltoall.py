"""``benchmarks.bench_alltoall``: memcpy rows beside shm and gloo, and the one-rank fixed cost."""

from __future__ import annotations

import pytest


@pytest.mark.multiproc
def test_rows_carry_memcpy_next_to_shm_and_gloo():
    from benchmarks.bench_alltoall import _cpu_worker, _spawn

    rows = _spawn(_cpu_worker, 2, [4 << 10], True, {"spin_us": 10})
    assert sorted(r["backend"] for r in rows) == ["gloo", "memcpy", "shm"]
    assert all(r["bytes_per_rank"] == 4 << 10 and r["latency_us"] > 0 for r in rows)
    one = _spawn(_cpu_worker, 1, [4 << 10], True, {})
    assert [r["backend"] for r in one] == ["shm-1rank"]
