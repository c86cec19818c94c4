"""Format v3 (issue 20): the rank files' Parquet settings (LZ4, dictionary pages, statistics)
and read compatibility with format v2 outputs (fsdata verify, the manifest reader, fstrain)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from fsdata.errors import VerifyError
from fsdata.shards.manifest import FORMAT_VERSION, Manifest, sha256_file
from fsdata.shards.verify import verify
from fsdata.samples.io import open_samples
from fsdata.shards import writer
from fsdata.shards.plan_file import PLAN_DIGEST_KEY
from fsdata.shards.writer import RANK_FILE_PARQUET_OPTIONS
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


def to_v2(inp: Path, src: Path, dst: Path, monkeypatch) -> None:
    """Rewrite a v3 OUTPUT as format_version 2: every rank file written again by
    :func:`fsdata.shards.writer.write_rank` with version 2's Parquet settings (zstd, dictionary
    pages; the bytes the previous release wrote), its manifest entry (bytes, SHA-256) and
    ``format_version`` updated; nothing else differs between the two versions."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "_manifest.json").read_text())
    schema = writer.output_schema(open_samples(inp))
    monkeypatch.setattr(writer, "FORMAT_VERSION", 2)
    for f in m["files"]:
        pf = pq.ParquetFile(src / f["path"])
        digest = pf.schema_arrow.metadata[PLAN_DIGEST_KEY].decode()
        rec = writer.write_rank(f["rank"], pf.read(), dst, schema, m["num_steps"], plan_digest=digest,
                                sorted_rows=True)
        assert rec.path == f["path"] and rec.num_rows == f["num_rows"]
        f.update(num_bytes=rec.num_bytes, sha256=rec.sha256)
    monkeypatch.undo()
    m["format_version"] = 2
    (dst / "_manifest.json").write_text(json.dumps(m, indent=2))


def test_rank_files_have_the_v3_parquet_settings(good):
    _, out = good
    m = Manifest.read(out)
    assert FORMAT_VERSION == 3 and m.format_version == 3
    assert RANK_FILE_PARQUET_OPTIONS[3] == {"compression": "lz4", "use_dictionary": True, "write_statistics": True,
                                            "dictionary_pagesize_limit": 256 * 1024}
    for r in range(R):
        md = pq.ParquetFile(m.rank_file(r)).metadata
        assert md.num_row_groups >= 1
        for g in range(md.num_row_groups):
            for j in range(md.num_columns):
                c = md.row_group(g).column(j)
                if c.path_in_schema in ("step", "rank", "user_id"):  # few distinct values: dictionary pages
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


def test_fstrain_reads_v2_and_v3_alike(good, tmp_path, monkeypatch):
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
