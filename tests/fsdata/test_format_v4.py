"""Format v4 (issue 39): integer-list columns (``item_ids``, ``timestamps``, integer-list feature
columns) are written with Parquet's DELTA_BINARY_PACKED encoding and no codec; every other column
keeps version 3's LZ4 and dictionary pages; statistics on every column. Rows, order, manifest keys
and root files are those of version 3 (tests/fsdata/test_format_v3.py rewrites an OUTPUT as v3 and
v2 and reads them alike)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from fsdata.shards import writer
from fsdata.shards.manifest import FORMAT_VERSION, Manifest
from fsdata.shards.verify import verify
from tests.fsdata.helpers import write_samples

N, R, B = 600, 3, 8

DELTA_COLUMNS = ("item_ids.list.element", "timestamps.list.element", "clicks.list.element")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """An OUTPUT of samples with timestamps, an integer-list feature column (``clicks``), a
    string-list one (``tags``) and a float one (``score``)."""
    d = tmp_path_factory.mktemp("v4")
    inp = write_samples(d / "plain.parquet", n=N, with_timestamps=True)
    t = pq.read_table(inp)
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, size=N)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    clicks = pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 9, size=int(lengths.sum()))))
    tags = pa.ListArray.from_arrays(offsets, pa.array([f"t{v}" for v in rng.integers(0, 5, size=int(lengths.sum()))]))
    t = t.append_column("clicks", clicks).append_column("tags", tags).append_column("score", pa.array(rng.random(N)))
    pq.write_table(t, d / "in.parquet")
    o = d / "out"
    assert main(["balance", str(d / "in.parquet"), str(o), "--ranks", str(R), "--batch-size-per-rank", str(B),
                 "--no-progress"]) == 0
    return d / "in.parquet", o


def test_rank_files_have_the_v4_parquet_settings(out):
    inp, o = out
    m = Manifest.read(o)
    assert FORMAT_VERSION == 4 and m.format_version == 4
    seen = set()
    for r in range(R):
        md = pq.ParquetFile(m.rank_file(r)).metadata
        for g in range(md.num_row_groups):
            for j in range(md.num_columns):
                c = md.row_group(g).column(j)
                seen.add(c.path_in_schema)
                where = (r, g, c.path_in_schema)
                if c.path_in_schema in DELTA_COLUMNS:
                    assert "DELTA_BINARY_PACKED" in c.encodings and not c.has_dictionary_page, where
                    assert c.compression == "UNCOMPRESSED", where
                else:  # version 3's settings, string lists included
                    assert c.compression == "LZ4", where
                    if c.path_in_schema in ("step", "rank", "user_id", "tags.list.element"):
                        assert c.has_dictionary_page and "RLE_DICTIONARY" in c.encodings, where
                assert c.statistics is not None and c.statistics.has_min_max, where
    assert set(DELTA_COLUMNS) <= seen and "tags.list.element" in seen and "score" in seen
    assert verify(o, inp)["checked_input"]
    # the rows are the input's, whatever the encoding
    got = pq.read_table(m.rank_file(0))
    src = pq.read_table(inp).to_pandas().set_index("sample_id")
    row = got.slice(0, 1).to_pylist()[0]
    assert list(src.loc[row["sample_id"], "clicks"]) == row["clicks"]
    assert list(src.loc[row["sample_id"], "item_ids"]) == row["item_ids"]


def test_every_reader_reads_v4(out):
    _, o = out
    m = Manifest.read(o)
    total = sum(pq.read_table(m.rank_file(r)).num_rows for r in range(R))
    duckdb = pytest.importorskip("duckdb", reason="duckdb is in the [test] extra")
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{o}/*/*.parquet')").fetchone()[0] == total
    encodings = {e for (e,) in duckdb.sql(f"SELECT DISTINCT encodings FROM parquet_metadata('{o}/*/*.parquet') "
                                          "WHERE path_in_schema LIKE 'item_ids%'").fetchall()}
    assert any("DELTA_BINARY_PACKED" in e for e in encodings), encodings
    pl = pytest.importorskip("polars")
    ids = pl.scan_parquet(f"{o}/*/*.parquet").select(pl.col("item_ids").list.len().sum()).collect().item()
    assert ids == sum(len(pq.read_table(m.rank_file(r), columns=["item_ids"]).column(0).combine_chunks().flatten())
                      for r in range(R))

def test_options_depend_on_the_column_types_only():
    schema = pa.schema([("sample_id", pa.int64()), ("item_ids", pa.list_(pa.int64())),
                        ("tags", pa.list_(pa.string())), ("w", pa.large_list(pa.int32())), ("step", pa.int32())])
    o = writer.rank_file_options(schema)
    assert o["column_encoding"] == {"item_ids.list.element": "DELTA_BINARY_PACKED",
                                    "w.list.element": "DELTA_BINARY_PACKED"}
    assert o["use_dictionary"] == ["sample_id", "tags.list.element", "step"]
    assert o["compression"]["item_ids.list.element"] == "none" and o["compression"]["tags.list.element"] == "lz4"
    assert writer.rank_file_options(schema, 3) == writer.RANK_FILE_PARQUET_OPTIONS[3]
    assert writer.rank_file_options(schema) is not writer.rank_file_options(schema)  # a new dict each call
