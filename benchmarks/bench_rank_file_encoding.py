"""Rank-file encoding per format version: ``python -m benchmarks.bench_rank_file_encoding OUTPUT...``.

Reads the rank files of one or more ``fsdata balance`` OUTPUTs (the first ``--files`` of each,
whatever format wrote them) into memory, then, per format version in ``--versions``, encodes every
file again with :func:`fsdata.shards.writer.rank_file_options` for that version (the row groups of
:func:`fsdata.shards.writer.write_rank`: whole steps of about ``ROW_GROUP_ROWS`` rows) and decodes
the result with ``pyarrow.parquet.read_table``, all in memory, one thread. Reports per OUTPUT and
version: encode CPU seconds (the minimum of ``--repeats``, ``time.process_time``), decode CPU
seconds (minimum of ``--repeats``), bytes, and each as a ratio to the first version. The
1-minute load average is recorded before each OUTPUT. Writes ``--out/bench_rank_file_encoding.json``.

This times the encoder alone; the whole ``fsdata balance`` is timed by
:mod:`benchmarks.bench_offline_stage` (``bench_engines --engines copy,local``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata.shards.manifest import Manifest
from fsdata.shards.writer import _write_whole_steps, rank_file_options


def _encode(table: pa.Table, version: int) -> pa.Buffer:
    """``table`` (one rank's rows, step-sorted) as a rank file of ``version``, in memory, in the row
    groups :func:`fsdata.shards.writer.write_rank` cuts."""
    sink = pa.BufferOutputStream()
    steps = table.column("step").to_numpy()
    ends = np.cumsum(np.bincount(steps - steps.min())) if len(steps) else np.zeros(0, dtype=np.int64)
    with pq.ParquetWriter(sink, table.schema, **rank_file_options(table.schema, version)) as w:
        _write_whole_steps(w, table, ends)
    return sink.getvalue()


def _min_cpu(fn, repeats: int) -> tuple[float, list]:
    best, out = float("inf"), []
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def bench(output: str, versions: list[int], files: int, repeats: int) -> dict:
    """One OUTPUT's rows encoded and decoded per version (module docstring)."""
    m = Manifest.read(output)
    tables = [pq.read_table(m.rank_file(r)) for r in range(min(files, m.num_ranks))]
    row: dict = {"output": output, "rank_files": len(tables), "rows": sum(t.num_rows for t in tables),
                 "load_average_1m_before": os.getloadavg()[0], "versions": {}}
    for v in versions:
        enc, bufs = _min_cpu(lambda v=v: [_encode(t, v) for t in tables], repeats)
        dec, back = _min_cpu(lambda bufs=bufs: [pq.read_table(pa.BufferReader(b)) for b in bufs], repeats)
        assert all(a.equals(b) for a, b in zip(back, tables, strict=True)), "rows changed by the encoding"
        row["versions"][str(v)] = {"encode_cpu_seconds": enc, "decode_cpu_seconds": dec,
                                   "bytes": sum(b.size for b in bufs)}
    base = row["versions"][str(versions[0])]
    for r in row["versions"].values():
        r.update(encode_ratio=r["encode_cpu_seconds"] / base["encode_cpu_seconds"],
                 decode_ratio=r["decode_cpu_seconds"] / base["decode_cpu_seconds"],
                 bytes_ratio=r["bytes"] / base["bytes"])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_rank_file_encoding",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("outputs", nargs="+", help="fsdata balance OUTPUT folders (their rank files are re-encoded)")
    p.add_argument("--versions", default="3,4", help="format versions to encode, the first is the base (default 3,4)")
    p.add_argument("--files", type=int, default=4, help="rank files read per OUTPUT (default 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=".", help="folder for bench_rank_file_encoding.json")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    versions = [int(v) for v in a.versions.split(",")]
    rows = []
    print(f"{'output':40s} {'ver':>3s} {'encode CPU s':>12s} {'decode CPU s':>12s} {'MB':>9s} "
          f"{'encode':>7s} {'decode':>7s} {'bytes':>6s}  load")
    for o in a.outputs:
        r = bench(o, versions, a.files, a.repeats)
        rows.append(r)
        for v, x in r["versions"].items():
            print(f"{Path(o).name[:40]:40s} {v:>3s} {x['encode_cpu_seconds']:12.2f} {x['decode_cpu_seconds']:12.2f} "
                  f"{x['bytes'] / 1e6:9.1f} {x['encode_ratio']:6.2f}x {x['decode_ratio']:6.2f}x "
                  f"{x['bytes_ratio']:5.2f}x  {r['load_average_1m_before']:.2f}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rank_file_encoding.json").write_text(json.dumps({"versions": versions, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
