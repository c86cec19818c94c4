"""``benchmarks.bench_rank_file_encoding`` re-encodes an OUTPUT's rank files per format version:
the rows round-trip, each version's bytes are those of ``fsdata.shards.writer.write_rank`` with
that version, and the JSON holds a row per version (no timing is asserted)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import bench_rank_file_encoding as bench
from fsdata.cli import main
from fsdata.shards.manifest import Manifest
from tests.fsdata.helpers import write_samples


def test_versions_encode_the_same_rows(tmp_path):
    inp = write_samples(tmp_path / "in.parquet", n=400, with_timestamps=True)
    out = tmp_path / "out"
    assert main(["balance", str(inp), str(out), "--ranks", "2", "--batch-size-per-rank", "8", "--no-progress"]) == 0
    assert bench.main([str(out), "--versions", "3,4", "--files", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_rank_file_encoding.json").read_text())["results"]
    assert rows[0]["rank_files"] == 2 and set(rows[0]["versions"]) == {"3", "4"}
    assert rows[0]["versions"]["3"]["bytes_ratio"] == 1.0
    # version 4 re-encoded here has the settings and row groups of the file fsdata balance wrote
    m = Manifest.read(out)
    table = pq.read_table(m.rank_file(0))

    def layout(md):
        return [(md.row_group(g).num_rows, md.row_group(g).column(j).path_in_schema,
                 md.row_group(g).column(j).compression, md.row_group(g).column(j).encodings)
                for g in range(md.num_row_groups) for j in range(md.num_columns)]

    written = pq.ParquetFile(m.rank_file(0)).metadata
    assert layout(pq.ParquetFile(pa.BufferReader(bench._encode(table, 4))).metadata) == layout(written)
    assert layout(pq.ParquetFile(pa.BufferReader(bench._encode(table, 3))).metadata) != layout(written)
