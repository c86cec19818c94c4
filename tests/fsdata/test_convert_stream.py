"""fsdata convert streams its input (issue 19, item 12): the streamed paths give today's bytes, name lines across
blocks, refuse an absurd line in one line, and keep memory bounded."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

import fsdata.samples.convert as C
import fsdata.samples.events as E
from fsdata.cli import main
from fsdata.samples import schema as S
from tests.conftest import dataset_path

REPO = Path(__file__).resolve().parents[2]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _count_merges(monkeypatch) -> list:
    """Per merge: ``[files merged, steps yielded]``."""
    calls = []
    real = E._merge_by_first

    def spy(files):
        calls.append([len(files), 0])
        for users in real(files):
            calls[-1][1] += 1
            yield users

    monkeypatch.setattr(E, "_merge_by_first", spy)
    return calls


@pytest.mark.parametrize("rel,kw", [
    ("amazon-beauty_bert4rec/beauty.txt", dict(samples="per-event", max_seq_len=50, holdout="last")),
    ("ml-latest-small/ratings.csv", dict(samples="per-event", max_seq_len=20, user_col="userId", item_col="Id",
                                         time_col="timestamp", holdout="last")),
    ("ml-latest-small/ratings.csv", dict(samples="per-user", user_col="userId", item_col="Id")),
])
def test_events_buckets_give_the_in_memory_bytes(tmp_path, monkeypatch, rel, kw):
    src = dataset_path(rel)
    outs = {}
    monkeypatch.setattr(E, "_MERGE_EVENTS_PER_GROUP", 200)  # many row groups, so many merge steps
    for name, per_bucket in (("memory", 10**9), ("buckets", 5000)):
        out, ev = tmp_path / f"{name}.parquet", tmp_path / f"{name}.eval.parquet"
        extra = {"holdout_output": ev} if kw.get("holdout") else {}
        merges = _count_merges(monkeypatch)
        s = C.convert(src, out, fmt="events", progress=False, events_per_bucket=per_bucket, **kw, **extra)
        assert (len(merges) == 1 and merges[0][0] > 10 and merges[0][1] > 10) if name == "buckets" else not merges
        outs[name] = (_sha(out), _sha(ev) if extra else None, s)
    assert outs["buckets"] == outs["memory"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the buckets are gone


def test_events_parquet_buckets_keep_file_order_per_user(tmp_path):
    # users' events interleaved over the file; no time column: file order within each user
    rng = np.random.default_rng(0)
    users = rng.integers(0, 300, 20_000)
    src = tmp_path / "ev.parquet"
    pl.DataFrame({"u": users, "i": np.arange(20_000)}).write_parquet(src, row_group_size=1000)
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    for out, per_bucket in ((a, 10**9), (b, 100)):
        C.convert(src, out, fmt="events", samples="per-user", user_col="u", item_col="i", progress=False,
                  events_per_bucket=per_bucket, users_per_chunk=7)
    assert _sha(a) == _sha(b)
    df = pl.read_parquet(b)
    first = {}
    for u in users.tolist():
        first.setdefault(u, len(first))
    assert df[S.USER_ID].to_list() == sorted(first, key=first.get)
    for u, hist, tgt in df.select(S.USER_ID, S.ITEM_IDS, S.TARGET_ITEM_ID).rows()[:50]:
        mine = np.flatnonzero(users == u).tolist()
        assert hist == mine[:-1][-512:] and tgt == mine[-1]


@pytest.mark.parametrize("text,fragment", [
    ("u,i\n1,2\n1,3\n2,4.5\n", "line 4, column 'i': 4.5 is not a whole number"),
    ("u,i\n1,2\n1,3\n2,\n", "null values in {'item_id': 1}, first at line 4, column 'i'"),
    ("u,i\n1,2\n1,3\n-2,4\n", "line 4, column 'u': id -2 is negative"),
    ("u,i\n1,2\n1,99999999999999999999\n", "line 3, column 'i'"),
])
def test_events_errors_are_the_same_through_buckets(tmp_path, capsys, monkeypatch, text, fragment):
    src = tmp_path / "ev.csv"
    src.write_text(text)
    errs = []
    for per_bucket in ("1000000000", "1"):
        monkeypatch.setattr(C, "EVENTS_PER_BUCKET", int(per_bucket))
        rc = main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "events", "--user-col", "u",
                   "--item-col", "i", "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and fragment in err, err
        errs.append(err)
    assert errs[0] == errs[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev.csv"]


def test_sequences_blocks_give_the_same_bytes(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    lines = [" ".join(map(str, [u, *rng.integers(0, 1000, rng.integers(1, 40))])) for u in range(400)]
    lines[5] = "\ufeff" + lines[5]
    lines[7:7] = ["", "   "]
    src = tmp_path / "seq.txt"
    src.write_text("\r\n".join(lines))  # CRLF, blank lines, no final newline
    outs = []
    for block in (C.BLOCK_BYTES, 211, 4096):
        monkeypatch.setattr(C, "BLOCK_BYTES", block)
        out = tmp_path / f"o{block}.parquet"
        s = C.convert(src, out, fmt="sequences", samples="per-event", max_seq_len=5, progress=False,
                      users_per_chunk=333)
        outs.append(_sha(out))
        assert s.num_users == 400
    assert len(set(outs)) == 1


@pytest.mark.parametrize("bad,fragment", [
    ("12 4 x9\n", "line 1202: token 'x9' is not an integer"),
    ("12 4 -9\n", "non-blank line 1201 has a negative id"),
])
def test_sequences_errors_name_the_line_across_blocks(tmp_path, capsys, monkeypatch, bad, fragment):
    src = tmp_path / "seq.txt"
    src.write_text("1 2 3\n" * 600 + "\n" + "1 2 3\n" * 600 + bad + "1 2 3\n" * 10)
    monkeypatch.setattr(C, "BLOCK_BYTES", 100)
    rc = main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "sequences", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and fragment in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seq.txt"]


@pytest.mark.parametrize("block", [10**6, 64])
def test_sequences_absurd_line_is_one_error_line(tmp_path, capsys, monkeypatch, block):
    src = tmp_path / "seq.txt"
    src.write_text("1 2 3\n\n" + "7 " + "5 " * 3000 + "\n8 1 2\n")
    monkeypatch.setattr(C, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(C, "BLOCK_BYTES", block)
    rc = main(["convert", str(src), str(tmp_path / "o.parquet"), "--format", "sequences", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "line 3 is longer than" in err and "--format events" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seq.txt"]


def test_pieces_bound_history_items_and_keep_the_rows(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 " + " ".join(map(str, range(2, 400))) + "\n2 5 6 7\n3 9\n")
    whole, cut = tmp_path / "whole.parquet", tmp_path / "cut.parquet"
    a = C.convert(src, whole, fmt="sequences", samples="per-event", max_seq_len=50, progress=False)
    b = C.convert(src, cut, fmt="sequences", samples="per-event", max_seq_len=50, progress=False,
                  max_items_per_piece=500)
    assert a == b
    assert pl.read_parquet(whole).equals(pl.read_parquet(cut))
    f = pq.ParquetFile(cut)
    assert pq.ParquetFile(whole).num_row_groups == 1 and f.num_row_groups > 30
    for g in range(f.num_row_groups):
        assert sum(f.read_row_group(g, columns=[S.SEQ_LEN])[S.SEQ_LEN].to_pylist()) <= 500


def test_spool_of_a_killed_run_is_removed(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 2 3\n")
    left = tmp_path / ".o.parquet.tmp-999999999-spool"  # no such process
    (left / "buckets").mkdir(parents=True)
    C.convert(src, tmp_path / "o.parquet", fmt="sequences", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.parquet", "seq.txt"]


def _sparse_events(path: Path, size_bytes: int) -> None:
    rng = np.random.default_rng(3)
    with open(path, "wb") as f:
        while f.tell() < size_bytes:
            k = 1_000_000
            pl.DataFrame({"u": rng.integers(0, size_bytes // 150, k), "i": rng.integers(0, 10**6, k)}).write_csv(
                f, include_header=False, separator=" ")


@pytest.mark.slow
def test_events_convert_memory_is_bounded(tmp_path):
    """A 150 MB sparse events log (users spread over the file) converts in under 1 GiB peak RSS (the child's
    ``ru_maxrss``; before streaming, a 0.22 GB log of this kind took 3.5 GiB). A memory bound, not a timing."""
    src = tmp_path / "events.txt"
    _sparse_events(src, 150_000_000)
    out = tmp_path / "o.parquet"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # VmHWM of the converting process's own address space: ru_maxrss would also count the pytest
    # process, whose pages a vfork()ed child borrows until its exec
    code = ("import sys; from fsdata.cli import main; rc = main(sys.argv[1:]); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "convert", str(src), str(out), "--format", "events",
                        "--samples", "per-user", "--no-progress"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    peak_mib = int(r.stdout.split()[-1]) / 1024
    assert peak_mib < 1024, f"peak RSS {peak_mib:.0f} MiB"
    n = pl.scan_parquet(out).select(pl.len()).collect().item()
    assert n > 0.9 * (150_000_000 // 150)


def test_events_parquet_reader_does_not_cache_what_it_read(tmp_path):
    """Reading an events Parquet input batch by batch keeps Arrow's allocations near one batch: with
    PyArrow's default ``pre_buffer`` the bytes of every row group read stay cached until the file is
    closed (apache/arrow#39808), so a 0.71 GB events Parquet reached 1.1 GiB peak RSS in the spool
    stage (0.58 GiB without)."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    n, group = 4_000_000, 100_000  # 40 row groups of random (incompressible) int64: ~96 MB of file
    path = tmp_path / "events.parquet"
    pq.write_table(pa.table({"user": rng.integers(0, 10**9, n), "item": rng.integers(0, 10**9, n),
                             "timestamp": rng.integers(0, 10**9, n)}), path, row_group_size=group)
    src = E._open_events(path, user_col="user", item_col="item", time_col="timestamp", sep=None, has_header=None)
    base, peak, rows = pa.total_allocated_bytes(), 0, 0
    for df in E._read_batches(src):
        rows += df.height
        peak = max(peak, pa.total_allocated_bytes() - base)
        del df
    assert rows == n
    one_batch = E._READ_ROWS * 3 * 8  # decoded bytes of one batch
    assert path.stat().st_size > 8 * one_batch  # caching what was read would exceed the bound below
    assert peak < 3 * one_batch, f"{peak / 2**20:.1f} MiB held while reading (one batch: {one_batch / 2**20:.1f} MiB)"
