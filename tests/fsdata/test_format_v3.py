"""Format v3 (issue 20; still read since format v4): the rank files' Parquet settings (LZ4,
dictionary pages, statistics) and read compatibility with format v2 and v3 outputs (fsdata verify,
the manifest reader, fstrain)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from fsdata.errors import VerifyError
from fsdata.shards.manifest import FORMAT_VERSION, Manifest
from fsdata.shards.verify import verify
from fsdata.samples.io import open_samples
from fsdata.shards import writer
from fsdata.shards.plan_file import PLAN_DIGEST_KEY
from fsdata.shards.writer import RANK_FILE_PARQUET_OPTIONS
from fsdata.samples import schema as S
from tests.conftest import dataset_path
from tests.fsdata.helpers import write_samples

N, R, B = 600, 3, 8  # 25 steps; the input has N + 5 samples, 5 dropped


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("v3")
    inp = write_samples(d / "in.parquet", n=N + 5, with_timestamps=True)  # 5 dropped
    out = d / "out"
    assert main(["balance", str(inp), str(out), "--ranks", str(R), "--batch-size-per-rank", str(B),
                 "--no-progress"]) == 0
    return inp, out


def to_v2(inp: Path, src: Path, dst: Path, monkeypatch, version: int = 2) -> None:
    """Rewrite an OUTPUT as format_version ``version`` (2 or 3): every rank file written again by
    :func:`fsdata.shards.writer.write_rank` with that version's Parquet settings (2: zstd, 3: LZ4,
    both with dictionary pages; the bytes those releases wrote), its manifest entry (bytes,
    SHA-256) and ``format_version`` updated; nothing else differs between the versions."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "_manifest.json").read_text())
    schema = writer.output_schema(open_samples(inp))
    monkeypatch.setattr(writer, "FORMAT_VERSION", version)
    for f in m["files"]:
        pf = pq.ParquetFile(src / f["path"])
        digest = pf.schema_arrow.metadata[PLAN_DIGEST_KEY].decode()
        rec = writer.write_rank(f["rank"], pf.read(), dst, schema, m["num_steps"], plan_digest=digest,
                                sorted_rows=True)
        assert rec.path == f["path"] and rec.num_rows == f["num_rows"]
        f.update(num_bytes=rec.num_bytes, sha256=rec.sha256)
    monkeypatch.undo()
    m["format_version"] = version
    (dst / "_manifest.json").write_text(json.dumps(m, indent=2))


def test_rank_files_have_the_v3_parquet_settings(good, tmp_path, monkeypatch):
    inp, v4 = good
    out = tmp_path / "v3"
    to_v2(inp, v4, out, monkeypatch, version=3)
    m = Manifest.read(out)
    assert FORMAT_VERSION == 4 and m.format_version == 3
    assert verify(out, inp)["checked_input"]
    assert RANK_FILE_PARQUET_OPTIONS[3] == {"compression": "lz4", "use_dictionary": True, "write_statistics": True,
                                            "dictionary_pagesize_limit": 256 * 1024}
    for r in range(R):
        md = pq.ParquetFile(m.rank_file(r)).metadata
        assert md.num_row_groups >= 1
        for g in range(md.num_row_groups):
            for j in range(md.num_columns):
                c = md.row_group(g).column(j)
                if c.path_in_schema in ("step", "rank", "user_id", "item_ids.list.element"):  # dictionary pages
                    assert c.has_dictionary_page and "RLE_DICTIONARY" in c.encodings, (r, g, c.path_in_schema)
                assert c.compression == "LZ4", (r, g, c.path_in_schema, c.compression)  # PyArrow's name
                # readers need these: resume at a step (step), the item vocabulary (fstrain)
                assert c.statistics is not None and c.statistics.has_min_max, (r, g, c.path_in_schema)
    duckdb = pytest.importorskip("duckdb", reason="duckdb is in the [test] extra")
    codecs = duckdb.sql(f"SELECT DISTINCT compression FROM parquet_metadata('{out}/*/*.parquet')").fetchall()
    assert codecs == [("LZ4_RAW",)]  # the footer's codec: LZ4_RAW, not the deprecated Hadoop LZ4


def test_v2_output_still_verifies_and_reads(good, tmp_path, monkeypatch):
    inp, out = good
    v2 = tmp_path / "v2"
    to_v2(inp, out, v2, monkeypatch)
    some = pq.ParquetFile(v2 / "rank-00000" / "part-00000.parquet").metadata.row_group(0).column(2)
    assert some.compression == "ZSTD" and some.has_dictionary_page  # really the v2 encoding
    r = verify(v2, inp)
    assert r["format_version"] == 2 and r["checked_input"]
    a, b = Manifest.read(v2), Manifest.read(out)
    assert a.format_version == 2 and a.rank_file(1) == str(v2 / "rank-00001" / "part-00000.parquet")
    for rank in range(R):  # same rows, either encoding
        assert pq.read_table(a.rank_file(rank)).equals(pq.read_table(b.rank_file(rank)))
    assert main(["verify", str(v2), "--input", str(inp)]) == 0
    # a v2 file's bytes are still checked against the manifest's SHA-256
    f = v2 / "rank-00002" / "part-00000.parquet"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="rank-00002"):
        verify(v2)


@pytest.mark.parametrize("version", [2, 3])
def test_fstrain_reads_older_versions_alike(good, tmp_path, monkeypatch, version):
    pytest.importorskip("torchrec")
    from fstrain.data import ShardReader
    from fstrain.data.manifest import infer_num_items, load_manifest

    inp, out = good
    v2 = tmp_path / "v2"
    to_v2(inp, out, v2, monkeypatch)
    assert infer_num_items(load_manifest(str(v2))) == infer_num_items(load_manifest(str(out)))
    for rank in range(R):
        a = list(ShardReader(str(out), rank, R, num_prefetch_batches=0))
        b = list(ShardReader(str(v2), rank, R, num_prefetch_batches=0))
        assert len(a) == len(b) == N // (R * B)
        assert [x.sample_ids.tolist() for x in a] == [x.sample_ids.tolist() for x in b]
    # resuming at a step reads row-group statistics of either encoding
    k = N // (R * B) - 3
    tail = [x.sample_ids.tolist() for x in ShardReader(str(v2), 1, R, start_step=k, num_prefetch_batches=0)]
    assert tail == [x.sample_ids.tolist() for x in ShardReader(str(out), 1, R, num_prefetch_batches=0)][k:]


def _one_rank(item_ids: pa.ListArray, steps: int) -> tuple[pa.Table, pa.Schema]:
    """A rank's rows in the rank-file schema: ``item_ids`` cut into ``steps`` equal steps."""
    n = len(item_ids)
    schema = pa.schema([(S.SAMPLE_ID, pa.int64()), (S.USER_ID, pa.int64()), (S.ITEM_IDS, pa.list_(pa.int64())),
                        (S.TARGET_ITEM_ID, pa.int64()), (S.STEP, pa.int32()), (S.RANK, pa.int32())])
    ids = np.arange(n, dtype=np.int64)
    table = pa.Table.from_arrays([pa.array(ids), pa.array(ids % 97), item_ids, pa.array(ids % 89),
                                  pa.array(np.repeat(np.arange(steps, dtype=np.int32), n // steps)),
                                  pa.array(np.zeros(n, dtype=np.int32))], schema=schema)
    return table, schema


def _write(tmp_path: Path, name: str, table: pa.Table, schema: pa.Schema, steps: int) -> bytes:
    (tmp_path / name).mkdir()
    rec = writer.write_rank(0, table, tmp_path / name, schema, steps, sorted_rows=True)
    return (tmp_path / name / rec.path).read_bytes()


def _dictionary_page_bytes(data: bytes, column: str) -> list[int]:
    """Bytes of each row group's dictionary page of ``column`` (footer offsets)."""
    md = pq.ParquetFile(pa.BufferReader(data)).metadata
    out = []
    for g in range(md.num_row_groups):
        c = next(md.row_group(g).column(j) for j in range(md.num_columns)
                 if md.row_group(g).column(j).path_in_schema.startswith(column))
        assert c.has_dictionary_page
        out.append(c.data_page_offset - c.dictionary_page_offset)
    return out


def _pyarrow_default_dictionary_limit(monkeypatch) -> None:
    """Write version 3 rank files with PyArrow's default dictionary limit (1 MiB) for this test."""
    monkeypatch.setitem(RANK_FILE_PARQUET_OPTIONS, 3, {k: v for k, v in RANK_FILE_PARQUET_OPTIONS[3].items()
                                                       if k != "dictionary_pagesize_limit"})


def test_dictionary_pages_stop_at_256_kib(tmp_path, monkeypatch):
    """A row group with more distinct item ids than fit 256 KiB: its dictionary page stops there
    and the rest of the column chunk is written as plain pages (Parquet's fallback); the rows
    read back unchanged. With PyArrow's 1 MiB default the same page is larger (control)."""
    monkeypatch.setattr(writer, "FORMAT_VERSION", 3)  # version 4 writes item_ids without a dictionary
    assert writer.DICTIONARY_PAGE_BYTES == 256 * 1024
    rng = np.random.default_rng(0)
    steps, rows, per_row = 2, 8000, 10  # 80,000 ids per row group, nearly all distinct
    values = rng.integers(-(2**62), 2**62, size=steps * rows * per_row, dtype=np.int64)  # incompressible
    offsets = np.arange(0, len(values) + 1, per_row, dtype=np.int32)
    table, schema = _one_rank(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)), steps)
    capped = _write(tmp_path, "capped", table, schema, steps)
    # the writer checks the limit between batches of values, so a page may pass it by a few KiB
    assert all(0 < b <= writer.DICTIONARY_PAGE_BYTES + 16 * 1024 for b in _dictionary_page_bytes(capped, S.ITEM_IDS))
    assert pq.read_table(pa.BufferReader(capped)).equals(table)
    _pyarrow_default_dictionary_limit(monkeypatch)
    default = _write(tmp_path, "default", table, schema, steps)
    assert all(b > 2 * writer.DICTIONARY_PAGE_BYTES for b in _dictionary_page_bytes(default, S.ITEM_IDS))


@pytest.mark.slow
@pytest.mark.parametrize("rel,fmt", [("ml-1m_ensfm/sequences.txt", "sequences"),
                                     ("amazon-beauty_bert4rec/beauty.txt", "events"),
                                     ("s3rec_toys_and_games/Toys_and_Games.txt", "sequences"),
                                     ("s3rec_sports_and_outdoors/Sports_and_Outdoors.txt", "sequences")])
def test_real_vocabularies_keep_the_bytes_of_a_1_mib_dictionary(tmp_path, monkeypatch, rel, fmt):
    """The real datasets here (ml-1m: 3.7K items; Amazon Beauty, Toys and Games: 12K; Sports and
    Outdoors: 18K, the largest) give the same rank-file bytes with the 256 KiB dictionary limit as
    with PyArrow's 1 MiB default: every row group keeps its whole dictionary. Rows are drawn at
    random from all users, as balance mixes them, so a row group sees most of the vocabulary.
    (Version 3's item_ids; version 4 delta-encodes them.)"""
    monkeypatch.setattr(writer, "FORMAT_VERSION", 3)
    src = dataset_path(rel)
    samples = tmp_path / "samples.parquet"
    assert main(["convert", str(src), str(samples), "--format", fmt, "--samples", "per-event",
                 "--max-seq-len", "64", "--no-progress"]) == 0
    items = pq.read_table(samples, columns=[S.ITEM_IDS]).column(S.ITEM_IDS).combine_chunks()
    steps, rows = 3, writer.ROW_GROUP_ROWS
    pick = np.random.default_rng(1).choice(len(items), size=steps * rows, replace=False)
    table, schema = _one_rank(items.take(pa.array(pick)), steps)
    first = table.slice(0, rows).column(S.ITEM_IDS).combine_chunks().flatten().to_numpy()
    distinct = len(np.unique(first))  # the first row group's vocabulary
    assert distinct > 3000
    capped = _write(tmp_path, "capped", table, schema, steps)
    _pyarrow_default_dictionary_limit(monkeypatch)
    assert _write(tmp_path, "default", table, schema, steps) == capped, distinct
