"""Where ``num_items`` comes from: ``--num-items``, the manifest, the evaluation file's metadata, or inferred over
the shards *and* the evaluation file; mismatches between evaluation data and model are found before any step."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fstrain.config import from_dict
from fstrain.data.manifest import (check_eval_ids, eval_file_num_items, infer_num_items, load_manifest,
                                   resolve_num_items)
from fstrain.errors import ConfigError, ShardError
from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards

MODEL = dict(embedding_dim=16, num_negatives=8, num_layers=1, num_heads=2)


def _record(shards: str, **keys) -> str:
    """Add keys to the shards' ``_manifest.json`` (as ``fsdata balance`` writes them after the known keys)."""
    path = os.path.join(shards, "_manifest.json")
    raw = json.load(open(path))
    raw.update(keys)
    with open(path, "w") as f:
        json.dump(raw, f, indent=1)
    return shards


def eval_file(path, targets, *, holdout: dict | None = None, convert: dict | None = None, num_items: int = 50):
    """An evaluation file with the given targets (histories of ids < ``num_items``), optional metadata."""
    rng = np.random.default_rng(0)
    hist = [rng.integers(1, num_items, 3).tolist() for _ in targets]
    t = pa.table({"user_id": pa.array(np.arange(len(targets)), pa.int64()),
                  "item_ids": pa.array(hist, pa.list_(pa.int64())),
                  "target_item_id": pa.array(targets, pa.int64()),
                  "seq_len": pa.array([len(h) for h in hist], pa.int32())})
    meta = {}
    if holdout is not None:
        meta[b"freescale.holdout"] = json.dumps(holdout).encode()
    if convert is not None:
        meta[b"freescale.convert"] = json.dumps(convert).encode()
    pq.write_table(t.replace_schema_metadata(meta or None), path)
    return str(path)


def test_manifest_then_eval_metadata_then_inferred_over_shards_and_eval_file(tmp_path):
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=8, num_items=50)
    m = load_manifest(shards)
    seen = infer_num_items(m)
    assert seen <= 50
    plain = eval_file(tmp_path / "plain.parquet", [3] * 5 + [77])  # 77: an item only ever held out
    assert resolve_num_items(m) == (seen, "inferred")
    assert resolve_num_items(m, plain) == (78, "inferred")  # the root cause of the README failure
    held = eval_file(tmp_path / "h.parquet", [3, 4], holdout={"num_items": 120}, convert={"num_items": 90})
    conv = eval_file(tmp_path / "c.parquet", [3, 4], convert={"num_items": 90, "samples": "per-user"})
    assert eval_file_num_items(held) == 120 and eval_file_num_items(conv) == 90
    assert eval_file_num_items(plain) is None
    assert resolve_num_items(m, held) == (120, "evaluation file metadata")
    _record(shards, num_items=200)
    assert resolve_num_items(load_manifest(shards), held) == (200, "manifest")


def test_malformed_recorded_num_items_is_one_error_line(tmp_path):
    shards = _record(write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=8),
                     num_items="many")
    with pytest.raises(ShardError, match="num_items must be an integer >= 2, got 'many'"):
        resolve_num_items(load_manifest(shards))
    bad = eval_file(tmp_path / "b.parquet", [3], holdout={"num_items": 1})
    with pytest.raises(ShardError, match="freescale.holdout num_items must be an integer >= 2"):
        eval_file_num_items(bad)


def test_check_eval_ids_names_both_numbers_and_the_fix(tmp_path):
    ev = eval_file(tmp_path / "e.parquet", [3, 60])
    check_eval_ids(ev, 61, "manifest")
    with pytest.raises(ConfigError, match=r"has item id 60 but the model has num_items 60 \(manifest\).*"
                                          r"--num-items 61") as e:
        check_eval_ids(ev, 60, "manifest")
    assert "\n" not in str(e.value)


def test_train_refuses_a_mismatch_before_building_anything(tmp_path, monkeypatch):
    """A manifest's num_items below an evaluation id, or below a shard id, fails in the cheap checks: no process
    group is ever created (init_distributed would raise here)."""
    from fstrain import train as train_mod

    def no_init(**kw):
        raise AssertionError("init_distributed reached")

    monkeypatch.setattr(train_mod, "init_distributed", no_init)
    shards = _record(write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=8,
                                  num_items=50), num_items=50)
    ev = eval_file(tmp_path / "e.parquet", [3, 70])
    cfg = from_dict({"shards": shards, "model": MODEL, "eval": {"data": ev}})
    with pytest.raises(ConfigError, match=r"item id 70 but the model has num_items 50 \(manifest\)"):
        train_mod.train(cfg)
    _record(shards, num_items=10)
    with pytest.raises(ConfigError, match=r"has item id \d+ but the model has num_items 10 \(manifest\)"):
        train_mod.train(from_dict({"shards": shards, "model": MODEL}))
    # --num-items wins over the manifest, and is checked the same way
    with pytest.raises(ConfigError, match=r"num_items 60 \(--num-items\)"):
        train_mod.train(from_dict({"shards": shards, "model": {**MODEL, "num_items": 60}, "eval": {"data": ev}}))


def _train_eval(shards, ev, ckpt):
    from fstrain.components.evaluator import evaluate_checkpoint
    from fstrain.train import train

    res = train(from_dict({"shards": shards, "model": MODEL, "max_steps": 2, "pipeline.name": "none",
                           "metrics.log_every_steps": 0, "eval": {"data": ev}, "checkpoint.dir": ckpt}))
    return res.summary["eval_final"]["num_candidates"], evaluate_checkpoint(os.path.join(ckpt, "step-00000002"), ev)


def test_train_and_evaluate_without_num_items_on_an_item_only_held_out(tmp_path):
    """No metadata anywhere: the table gets a row for the held-out-only item 77, and fstrain evaluate reads the
    checkpoint's num_items."""
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=8, num_items=50)
    ev = eval_file(tmp_path / "e.parquet", [3] * 5 + [77])
    [(candidates, again)] = run_ranks(_train_eval, 1, shards, ev, str(tmp_path / "ckpt"))
    assert candidates == 77 and again["num_candidates"] == 77  # ids 0..77 minus padding


def test_evaluate_takes_num_items_from_the_checkpoints_shards_when_not_recorded(tmp_path):
    from fstrain.data.manifest import recorded_num_items_of

    shards = _record(write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=8),
                     num_items=300)
    ev = eval_file(tmp_path / "e.parquet", [3], holdout={"num_items": 80})
    assert recorded_num_items_of(shards, ev) == 300
    assert recorded_num_items_of(str(tmp_path / "gone"), ev) == 80
    assert recorded_num_items_of(None, eval_file(tmp_path / "p.parquet", [3])) is None


def test_a_history_longer_than_max_seq_len_is_refused_before_init(tmp_path, monkeypatch):
    """Else every rank would fail in its first step (printing the line once per rank under torchrun)."""
    from fstrain import train as train_mod
    from fstrain.data.manifest import max_history_length
    from tests.fstrain.test_feature_columns import _balance, _samples

    out = _balance(_samples(tmp_path / "in.parquet"), str(tmp_path / "out"), ranks=1, feature_columns=())
    longest = max_history_length(load_manifest(out))
    lengths = pq.read_table(tmp_path / "in.parquet", columns=["seq_len"]).column("seq_len").to_pylist()
    assert longest == max(lengths)
    assert max_history_length(load_manifest(write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=1,
                                                         batch_size_per_rank=4))) is None  # no seq_len column

    def no_init(**kw):
        raise AssertionError("init_distributed reached")

    monkeypatch.setattr(train_mod, "init_distributed", no_init)
    with pytest.raises(ConfigError, match=f"has a history of {longest} items but max_seq_len is 8; "
                                          f"pass --max-seq-len {longest}"):
        train_mod.train(from_dict({"shards": out, "model": {**MODEL, "max_seq_len": 8}}))
