"""The local engine's write stage (rows gathered to rank groups in one read, spilled beyond
``GATHER_BYTES``, gathered into rank order by blocks of ranks) writes the same bytes as
:func:`fsdata.shards.writer.write_rank` of each rank's rows (the Ray engine's unit), whatever the grouping, spill codec
or epochs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import fsdata
from fsdata.samples import schema as S
from fsdata.samples.io import open_samples
from fsdata.balancer.settings import BalanceSettings
from fsdata.engines import local as L
from fsdata.engines import routing
from fsdata.engines.planning import make_plan_table
from fsdata.shards import writer as W
from fsdata.shards.plan_file import plan_digest
from tests.fsdata.helpers import write_samples


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("in") / "in", n=1500, num_files=3, with_timestamps=True)


def _settings(**kw) -> BalanceSettings:
    return BalanceSettings(**{"num_ranks": 8, "batch_size_per_rank": 16, "seed": 3, "compose_window": 4,
                                "partitioner": "lpt-swap",
                                "progress": False, **kw})


@pytest.mark.parametrize("epochs,extra,block_rows", [(1, False, None), (2, False, None), (1, True, None),
                                                    (1, False, 1), (2, False, 200), (1, True, 200)])
def test_rank_files_are_write_rank_of_each_ranks_rows(samples, tmp_path, monkeypatch, epochs, extra, block_rows):
    """Also with blocks of one rank (``block_rows`` 1) and of a few ranks (200 rows: ranks hold
    ~180 rows per epoch), so a rank's rows are a slice inside a block gathered at once."""
    if block_rows is not None:
        monkeypatch.setattr(L, "GATHER_BLOCK_ROWS", block_rows)
    if extra:  # a column of another type than integers (gathered by Arrow's take, not Polars)
        files = sorted(samples.glob("*.parquet"))
        samples = tmp_path / "in"
        samples.mkdir()
        for p in files:
            t = pq.read_table(p)
            pq.write_table(t.append_column("note", pa.array([f"n{i}" for i in range(t.num_rows)])), samples / p.name)
    settings = _settings(epochs=epochs)
    out = tmp_path / "out"
    fsdata.balance(samples, out, settings)
    _assert_write_rank_of_each_ranks_rows(samples, out, settings, tmp_path / "ref")


def _assert_write_rank_of_each_ranks_rows(samples: Path, out: Path, settings: BalanceSettings, ref: Path) -> None:
    src = open_samples(samples)
    plan = make_plan_table(src, settings)
    table = pq.read_table(sorted(str(p) for p in samples.glob("*.parquet")))
    schema = W.output_schema(src)
    N = table.num_rows
    ref.mkdir()
    digest = plan_digest(plan)
    for r in range(settings.num_ranks):
        sel = np.flatnonzero(plan.rank == r)  # entries e*N + i over the epochs
        rows = table.take(pa.array(sel % N)).cast(pa.schema([schema.field(i) for i in range(table.num_columns)]))
        rows = rows.append_column(S.STEP, pa.array(plan.step[sel], pa.int32()))
        rows = rows.append_column(S.RANK, pa.array(plan.rank[sel], pa.int32()))
        rows = rows.append_column("position", pa.array(plan.position[sel], pa.int32()))
        order = np.random.default_rng(r).permutation(len(sel))  # write_rank takes rows in any order
        W.write_rank(r, rows.take(pa.array(order)), ref, schema, plan.num_steps, plan_digest=digest)
    got = _digests(out)
    for rel, sha in _digests(ref).items():
        assert got[rel] == sha, rel


@pytest.mark.parametrize("variant", ["ids beyond int32", "no statistics"])
def test_integer_columns_are_held_narrowed_only_when_the_footers_prove_they_fit(samples, tmp_path, monkeypatch,
                                                                                 variant):
    """The write stage holds and spills 64-bit integer columns as 32-bit ones when the Parquet
    statistics show every value fits (``narrow_types``), and casts them back: the rank files are
    the same bytes either way. A column with a value past int32, or an input without statistics,
    is held as it is."""
    files = sorted(samples.glob("*.parquet"))
    narrow = routing.narrow_types(routing.footers(open_samples(samples)), W.output_schema(open_samples(samples)))
    assert {S.SAMPLE_ID, S.ITEM_IDS, S.TARGET_ITEM_ID} <= set(narrow)
    assert narrow[S.ITEM_IDS] == pa.list_(pa.int32()) and narrow[S.SAMPLE_ID] == pa.int32()
    inp = tmp_path / "in"
    inp.mkdir()
    big = 2**40
    for p in files:
        t = pq.read_table(p)
        if variant == "ids beyond int32":
            i = t.schema.get_field_index(S.ITEM_IDS)
            items = t.column(i).combine_chunks()
            shifted = pa.ListArray.from_arrays(items.offsets, pc.add(items.values, big))
            t = t.set_column(i, t.schema.field(i), shifted)
            t = t.set_column(t.schema.get_field_index(S.SAMPLE_ID), S.SAMPLE_ID,
                             pc.add(t.column(S.SAMPLE_ID), big))
            pq.write_table(t, inp / p.name)
        else:
            pq.write_table(t, inp / p.name, write_statistics=False)
    got = routing.narrow_types(routing.footers(open_samples(inp)), W.output_schema(open_samples(inp)))
    if variant == "ids beyond int32":
        assert S.ITEM_IDS not in got and S.SAMPLE_ID not in got and S.TARGET_ITEM_ID in got
    else:
        assert got == {}
    monkeypatch.setattr(L, "GATHER_BYTES", 20_000)  # spilled too
    settings = _settings(epochs=2)
    out = tmp_path / "out"
    fsdata.balance(inp, out, settings)
    _assert_write_rank_of_each_ranks_rows(inp, out, settings, tmp_path / "ref")


@pytest.mark.parametrize("compression,threads", [(None, 1), ("zstd", 1), (None, 3)])
@pytest.mark.parametrize("epochs", [1, 2])
def test_spilled_rank_groups_write_the_same_bytes(samples, tmp_path, monkeypatch, compression, threads, epochs):
    """Also with 3 gather threads, each spilling its own file per group (rows arrive in any order)."""
    whole = tmp_path / "whole"
    fsdata.balance(samples, whole, _settings(epochs=epochs, num_threads=1))
    seen: list[int] = []
    groups = L._rank_groups

    def spy(*a):
        g = groups(*a)
        seen.append(len(g))
        return g

    monkeypatch.setattr(L, "_rank_groups", spy)
    monkeypatch.setattr(L, "GATHER_BYTES", 20_000)  # about 2 ranks of this input per group
    split = tmp_path / "split"
    fsdata.balance(samples, split, _settings(epochs=epochs, bucket_compression=compression, num_threads=threads))
    assert seen and 1 < seen[0] <= 8
    assert _digests(split) == _digests(whole)
    assert not (split / ".buckets").exists()


def test_rank_groups_fill_the_last_group_and_fit_the_budget():
    """The last group takes as many of the last ranks as fit half the budget; the others are cut
    from rank 0 on; every group fits the budget (or is one rank); together they cover every rank once."""
    rank_start = np.arange(11) * 10  # 10 ranks of 10 rows
    assert L.LAST_GROUP_FRACTION == 0.5
    assert L._rank_groups(rank_start, 1.0, 50) == [(0, 5), (5, 8), (8, 10)]
    assert L._rank_groups(rank_start, 1.0, 70) == [(0, 7), (7, 10)]
    assert L._rank_groups(rank_start, 1.0, 100) == [(0, 10)]
    assert L._rank_groups(rank_start, 1.0, 95) == [(0, 6), (6, 10)]
    assert L._rank_groups(rank_start, 1.0, 5) == [(r, r + 1) for r in range(10)]
    assert L._rank_groups(np.array([0, 50]), 1.0, 10) == [(0, 1)]


def test_first_and_last_rank_groups_stay_in_memory(samples, tmp_path, monkeypatch):
    """Only the middle rank groups are spilled and read back; the first and the last are written
    from memory first, and the output is the same bytes as one group's."""
    assert L._resident_groups(1) == [0] and L._resident_groups(2) == [0, 1]
    assert L._resident_groups(5) == [0, 4, 1, 2, 3]
    whole = tmp_path / "whole"
    fsdata.balance(samples, whole, _settings(num_threads=1))
    seen: list[int] = []
    groups, read_spill = L._rank_groups, L._read_spill
    spilled: list[str] = []
    monkeypatch.setattr(L, "_rank_groups", lambda *a: seen.append(len(g := groups(*a))) or g)
    monkeypatch.setattr(L, "_read_spill", lambda path: spilled.append(path.name) or read_spill(path))
    monkeypatch.setattr(L, "GATHER_BYTES", 20_000)
    split = tmp_path / "split"
    fsdata.balance(samples, split, _settings(num_threads=2))
    G = seen[0]
    assert G >= 3
    assert sorted({int(n.split("-")[1]) for n in spilled}) == list(range(1, G - 1))
    assert _digests(split) == _digests(whole)
    assert not (split / ".buckets").exists()


def test_counts_and_loads_sum_costs_in_position_order(samples):
    plan = make_plan_table(open_samples(samples), _settings(batch_policy="cost-budget"))
    counts, loads = plan.counts_and_loads()
    S_, R = plan.num_steps, plan.num_ranks
    kept = np.flatnonzero(plan.step >= 0)
    kept = kept[np.lexsort((plan.position[kept], plan.rank[kept], plan.step[kept]))]
    flat = plan.step[kept].astype(np.int64) * R + plan.rank[kept]
    want = np.bincount(flat, weights=plan.cost[kept], minlength=S_ * R).reshape(S_, R)
    assert np.array_equal(loads, want)  # bit for bit: the same summation order
    assert np.array_equal(counts, np.bincount(flat, minlength=S_ * R).reshape(S_, R))
    assert plan.counts_and_loads()[1] is loads  # computed once


def test_gather_threads_over_row_group_units_write_the_same_bytes(samples, tmp_path, monkeypatch):
    """One input file of 15 row groups read as 8 units by 2 and by 3 gather threads, spilled or
    not: the same bytes as one thread reading the whole file."""
    one = tmp_path / "in" / "part.parquet"
    one.parent.mkdir()
    pq.write_table(pq.read_table(sorted(samples.glob("*.parquet"))), one, row_group_size=100)
    ref = tmp_path / "ref"
    fsdata.balance(one.parent, ref, _settings(num_threads=1))
    units = L._read_units(open_samples(one.parent))
    monkeypatch.setattr(L, "GATHER_UNIT_ROWS", 200)
    units_small, rows = L._read_units(open_samples(one.parent))
    assert len(units[0]) == 1 and len(units_small) == 8 and rows == 1500
    assert [u.offset for u in units_small] == list(range(0, 1500, 200))
    for threads, budget in [(2, None), (3, 20_000)]:
        if budget is not None:
            monkeypatch.setattr(L, "GATHER_BYTES", budget)
        out = tmp_path / f"t{threads}"
        fsdata.balance(one.parent, out, _settings(num_threads=threads))
        assert _digests(out) == _digests(ref)


def test_gather_threads_take_the_next_unit_when_free(samples, tmp_path, monkeypatch):
    """Gather threads take units from one queue (largest first), not a fixed split: with one thread
    slowed, the other reads most units, each unit is read once, and the bytes stay the same. (An
    OUTPUT read as INPUT has a long and a short unit per rank file: a ``units[t::T]`` split gave one
    thread 16.8M of 20M rows.)"""
    import threading
    import time

    one = tmp_path / "in" / "part.parquet"
    one.parent.mkdir()
    pq.write_table(pq.read_table(sorted(samples.glob("*.parquet"))), one, row_group_size=100)
    ref = tmp_path / "ref"
    fsdata.balance(one.parent, ref, _settings(num_threads=1))
    monkeypatch.setattr(L, "GATHER_UNIT_ROWS", 100)  # 15 units
    reads: list[tuple[str, int]] = []
    slow: list[str] = []
    batches = L.chunk_batches

    def chunk_batches(unit, size):
        me = threading.current_thread().name
        if not slow:
            slow.append(me)  # the first thread to read is slowed
        if me == slow[0]:
            time.sleep(0.3)
        reads.append((me, unit.offset))
        yield from batches(unit, size)

    monkeypatch.setattr(L, "chunk_batches", chunk_batches)
    out = tmp_path / "out"
    fsdata.balance(one.parent, out, _settings(num_threads=2))
    assert sorted(o for _, o in reads) == list(range(0, 1500, 100))  # every unit once
    slowed = sum(1 for name, _ in reads if name == slow[0])
    assert slowed < len(reads) - slowed  # a static split would give each thread 7 or 8 units
    assert _digests(out) == _digests(ref)
