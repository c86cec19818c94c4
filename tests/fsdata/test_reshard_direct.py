"""An OUTPUT read back as INPUT in place (no scratch copy) when the rows read are a suffix of every
rank file (:mod:`fsdata.shards.as_input`): the same bytes as the copy, row windows that start at a
row group or inside one, and no scratch file written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import fsdata
from fsdata.cli import main
from fsdata.engines.routing import row_group_chunks
from fsdata.shards import as_input, writer
from fsdata.shards.manifest import Manifest
from fsdata.shards.verify import verify
from tests.fsdata.helpers import write_samples

R, B = 4, 16
#: Rows per rank-file row group in OLD: two steps of B rows (row groups end at step ends).
GROUP_ROWS = 2 * B


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    """An OUTPUT of 1500 samples (timestamps too) for R=4, B=16: 23 steps, row groups of 2 steps."""
    d = tmp_path_factory.mktemp("direct")
    inp = write_samples(d / "in.parquet", n=1500, with_timestamps=True)
    mp = pytest.MonkeyPatch()
    mp.setattr(writer, "ROW_GROUP_ROWS", GROUP_ROWS)
    try:
        fsdata.balance(inp, d / "old", fsdata.BalanceSettings(num_ranks=R, batch_size_per_rank=B, compose_window=1,
                                                              progress=False))
    finally:
        mp.undo()
    assert pq.ParquetFile(Manifest.read(d / "old").rank_file(0)).metadata.num_row_groups > 5
    return d / "old"


def _no_copy(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the OUTPUT was copied")

    monkeypatch.setattr(as_input, "output_as_input", refuse)
    monkeypatch.setattr(as_input, "write_rows", refuse)


@pytest.mark.parametrize("from_step", [None, 0, 6, 7, 22])
def test_in_place_equals_the_copy(old, tmp_path, monkeypatch, from_step):
    """Step 6 starts a row group of every rank file, step 7 falls inside one; byte-identical outputs."""
    settings = fsdata.BalanceSettings(num_ranks=3, batch_size_per_rank=8, compose_window=1, progress=False,
                                      from_step=from_step)
    monkeypatch.setattr(as_input, "READ_IN_PLACE", False)
    fsdata.balance(old, tmp_path / "copy", settings)
    monkeypatch.setattr(as_input, "READ_IN_PLACE", True)
    _no_copy(monkeypatch)
    fsdata.balance(old, tmp_path / "direct", settings)
    a, b = digests(tmp_path / "copy"), digests(tmp_path / "direct")
    assert "_manifest.json" in a and a == b
    assert verify(tmp_path / "direct", old, from_step=from_step)["checked_input"]


@pytest.mark.parametrize("step,inside", [(6, False), (7, True)])
def test_row_window_from_statistics(old, step, inside):
    """The first row of a step >= S per rank file, and the chunks that leave out the rows before it."""
    m = Manifest.read(old)
    starts = as_input.suffix_row_starts(m, step)
    for r in range(R):
        steps = pq.read_table(m.rank_file(r), columns=["step"]).column(0).to_numpy()
        assert starts[r] == int((steps < step).sum())
        assert (starts[r] % GROUP_ROWS != 0) == inside
    chunks = row_group_chunks([m.rank_file(0)], 10**6, row_starts=starts[:1], columns=["sample_id"])
    assert chunks[0].skip == starts[0] % GROUP_ROWS and chunks[0].row_groups[0] == starts[0] // GROUP_ROWS
    assert sum(c.num_rows for c in chunks) == m.files[0].num_rows - starts[0]


def test_the_source_reads_the_rows_of_the_steps_left(old, monkeypatch):
    """scan() and iter_batches() give the rank files' rows of steps >= S, without step and rank."""
    _no_copy(monkeypatch)
    m = Manifest.read(old)
    want = np.concatenate([pq.read_table(m.rank_file(r), columns=["sample_id", "step"]).to_pandas()
                           .query("step >= 7")["sample_id"].to_numpy() for r in range(R)])
    with as_input.open_output(old, 7) as view:
        src = view.source
        assert view.path == "" and src.num_rows == len(want) == view.num_samples
        assert "step" not in src.columns and "rank" not in src.columns
        assert np.array_equal(src.lengths_and_ids()[1], want)
        batches = list(src.iter_batches(5))
        assert np.array_equal(np.concatenate([b.column("sample_id").to_numpy() for b in batches]), want)
        assert "step" not in batches[0].schema.names


def test_profile_and_verify_read_in_place(old, tmp_path, monkeypatch, capsys):
    _no_copy(monkeypatch)
    assert main(["profile", str(old), "--ranks", "2", "--batch-size-per-rank", "8", "--from-step", "7",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == (23 - 7) * R * B
    assert main(["balance", str(old), str(tmp_path / "new"), "--ranks", "2", "--batch-size-per-rank", "8",
                 "--from-step", "7", "--compose-window", "1", "--no-progress"]) == 0
    assert main(["verify", str(tmp_path / "new"), "--input", str(old), "--from-step", "7"]) == 0


def test_dropped_samples_stay_dropped_in_place(old, tmp_path, monkeypatch):
    """1500 samples, 23 x 64 = 1472 written: the 28 dropped ones are not read back."""
    _no_copy(monkeypatch)
    mo = Manifest.read(old)
    assert mo.num_samples_dropped == 28
    m = fsdata.balance(old, tmp_path / "new", fsdata.BalanceSettings(num_ranks=2, batch_size_per_rank=8,
                                                                     compose_window=1, progress=False))
    assert m.num_samples_input == 1472
    dropped = set(pq.read_table(old / mo.dropped_file).column("sample_id").to_pylist())
    mn = Manifest.read(tmp_path / "new")
    written = np.concatenate([pq.read_table(mn.rank_file(r), columns=["sample_id"]).column(0).to_numpy()
                              for r in range(2)])
    assert not dropped & set(written.tolist())


def test_several_epochs_keep_the_copy(tmp_path):
    """E > 1 with S before the last epoch (first occurrences): not a suffix, copied as before."""
    inp = write_samples(tmp_path / "in.parquet", n=600)
    fsdata.balance(inp, tmp_path / "old", fsdata.BalanceSettings(num_ranks=2, batch_size_per_rank=16, epochs=2,
                                                                 compose_window=1, progress=False))
    m = Manifest.read(tmp_path / "old")
    assert as_input.suffix_row_starts(m, 3) is None and as_input.suffix_row_starts(m, None) is None
    assert as_input.suffix_row_starts(m, m.num_steps - 1) is not None
    with as_input.open_output(tmp_path / "old", 3) as view:
        assert view.path and view.source.files == [view.path]
