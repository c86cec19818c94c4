"""Counts read from a manifest are checked against the files before memory is sized by them
(docs/fstrain.md, "What is checked"): a forged ``fixed``-policy manifest without step stats."""

from __future__ import annotations

import json
import os

import pytest

from fstrain.data.dataset import ShardDataset
from fstrain.data.manifest import load_manifest, load_step_counts
from fstrain.errors import ShardError
from tests.fstrain.shards import write_shards

FORGED = 10**12


def _forged(tmp_path, edit, num_ranks=2) -> str:
    """A fixed-policy OUTPUT (4 steps x B 3) without ``_step_stats.parquet``, its manifest edited."""
    out = write_shards(str(tmp_path / "s"), num_ranks=num_ranks, num_steps=4, batch_size_per_rank=3)
    os.remove(os.path.join(out, "_step_stats.parquet"))
    path = os.path.join(out, "_manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(m)
    with open(path, "w") as f:
        json.dump(m, f)
    return out


def _steps_and_rows(m: dict) -> None:
    m["num_steps"] = FORGED
    for f in m["files"]:
        f["num_rows"] = 3 * FORGED


def _rows_only(m: dict) -> None:
    for f in m["files"]:
        f["num_rows"] = 3 * FORGED


def test_untouched_fixed_output_without_step_stats_still_reads(tmp_path):
    out = _forged(tmp_path, lambda m: None)
    assert load_step_counts(load_manifest(out)).tolist() == [[3, 3]] * 4
    assert len(ShardDataset(out, 1, 2)) == 4


@pytest.mark.parametrize("edit, words", [
    (_steps_and_rows, "rank 0: .*part-00000.parquet has 12 rows but the manifest of .* says num_steps 1000000000000 "
                      "x batch_size_per_rank 3 = 3000000000000; the manifest does not describe its files"),
    (_rows_only, "rank 0 has num_rows 3000000000000 but batch_policy fixed needs num_steps 4 x batch_size_per_rank "
                 "3 = 12"),
])
def test_forged_counts_are_refused_before_allocating(tmp_path, edit, words):
    out = _forged(tmp_path, edit)
    with pytest.raises(ShardError, match=words) as e:
        ShardDataset(out, 0, 2)  # a [10**12 x 2] int64 array would be 14.6 TiB: a MemoryError, not this
    assert "\n" not in str(e.value)
    with pytest.raises(ShardError, match=words):
        load_step_counts(load_manifest(out))


def test_forged_counts_are_one_line_from_fstrain_train(tmp_path, capsys):
    import torch.distributed as dist

    from fstrain.cli import main

    out = _forged(tmp_path, _steps_and_rows, num_ranks=1)
    capsys.readouterr()
    assert main(["train", out, "--no-progress", "--metrics-dir", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 12 rows" in err[0] and "does not describe its files" in err[0], err
    assert not dist.is_initialized()
