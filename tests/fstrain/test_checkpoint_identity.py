"""Checkpoints know their shards: resume refuses other shards, accepts a reshard's lineage, and
``--init-from`` starts from a checkpoint's weights with a grown item table; the reader checks each
rank file's ``rank`` column and plan digest (issues 35, 36 item 6, 37 item 4)."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fstrain.components.checkpoint import resume_position
from fstrain.data.dataset import ShardDataset
from fstrain.data.manifest import load_manifest, plan_digest, resharded_from
from fstrain.errors import ConfigError, ShardError
from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards

MODEL = dict(embedding_dim=16, num_negatives=8, num_layers=1, num_heads=2)
META = {"step": 4, "shards_step": 4, "plan_digest": "sha256:old", "world_size": 2, "shards": "/x/old"}


def _pos(meta=META, digest="sha256:old", lineage=None, world_size=2):
    return resume_position(meta, "ck/step-00000004", shards="new", plan_digest=digest, resharded_from=lineage,
                           world_size=world_size, checkpoint_dir="ck")


def test_resume_position_same_shards_continues():
    assert _pos() == (4, 4)
    assert _pos({**META, "step": 10}) == (10, 4)  # global step continues past a reshard
    with pytest.raises(ConfigError, match="world size 2, this job has 3"):
        _pos(world_size=3)


def test_resume_position_refuses_other_shards_naming_init_from():
    with pytest.raises(ConfigError, match=r"other shards.*--init-from ck/step-00000004") as e:
        _pos(digest="sha256:new")
    assert "\n" not in str(e.value)
    no_record = {k: v for k, v in META.items() if k != "plan_digest"}
    with pytest.raises(ConfigError, match=r"does not record which shards.*--init-from ck/step-00000004"):
        _pos(no_record)
    with pytest.raises(ConfigError, match="--init-from"):  # shards without a digest, checkpoint with one
        _pos(digest=None)


def test_resume_position_follows_a_reshard_lineage_only():
    lineage = {"plan_digest": "sha256:old", "from_step": 4}
    assert _pos(digest="sha256:new", lineage=lineage, world_size=3) == (4, 0)  # any world size, new step 0
    for bad in ({"plan_digest": "sha256:old", "from_step": 3}, {"plan_digest": "sha256:other", "from_step": 4}):
        with pytest.raises(ConfigError, match="was resharded from .*--init-from"):
            _pos(digest="sha256:new", lineage=bad, world_size=3)


def test_plan_digest_prefers_the_manifest_key_and_reads_lineage(tmp_path):
    out = write_shards(str(tmp_path / "a"), num_ranks=2, num_steps=2, batch_size_per_rank=2)
    m = load_manifest(out)
    file_digest = pq.read_schema(m.rank_file(0)).metadata[b"fsdata.plan_digest"].decode()
    assert plan_digest(m) == file_digest and resharded_from(m) is None
    lineage = {"plan_digest": "sha256:abc", "from_step": 3}
    out = write_shards(str(tmp_path / "b"), num_ranks=2, num_steps=2, batch_size_per_rank=2,
                       plan_digest="sha256:abc2", manifest_extra={"plan_digest": "sha256:abc2",
                                                                  "resharded_from": lineage})
    m = load_manifest(out)
    assert plan_digest(m) == "sha256:abc2" and resharded_from(m) == lineage
    bad = write_shards(str(tmp_path / "c"), num_ranks=1, num_steps=1, batch_size_per_rank=2,
                       manifest_extra={"resharded_from": {"plan_digest": "x", "from_step": "3"}})
    with pytest.raises(ShardError, match="resharded_from must be"):
        resharded_from(load_manifest(bad))


def test_rank_file_copied_over_another_rank_is_refused(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=3, batch_size_per_rank=4)
    m = load_manifest(out)
    assert len(list(ShardDataset(out, 1, 2))) == 3
    shutil.copyfile(m.rank_file(0), m.rank_file(1))  # same rows and sizes: the counts cannot tell
    with pytest.raises(ShardError, match=r"rank 1: .* holds rows of rank 0\.\.0") as e:
        ShardDataset(out, 1, 2)
    assert "\n" not in str(e.value)


def test_rank_column_is_checked_while_reading_without_statistics(tmp_path):
    out = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=2, batch_size_per_rank=3)
    path = load_manifest(out).rank_file(1)
    t = pq.read_table(path)
    t = t.set_column(t.schema.get_field_index("rank"), "rank", pa.array([1, 0, 1, 1, 1, 1], pa.int32()))
    pq.write_table(t, path, row_group_size=3, write_statistics=["step"])  # no `rank` statistics
    with pytest.raises(ShardError, match="row group 0 holds rows of another rank"):
        list(ShardDataset(out, 1, 2, num_prefetch_batches=0))


def test_rank_file_of_another_output_is_refused(tmp_path):
    a = write_shards(str(tmp_path / "a"), num_ranks=2, num_steps=3, batch_size_per_rank=4, seed=1)
    b = write_shards(str(tmp_path / "b"), num_ranks=2, num_steps=3, batch_size_per_rank=4, seed=2)
    shutil.copyfile(load_manifest(b).rank_file(1), load_manifest(a).rank_file(1))
    with pytest.raises(ShardError, match="written from plan .* a rank file of another output"):
        ShardDataset(a, 1, 2)


def _train(shards, steps=None, **kw):
    from fstrain.config import from_dict
    from fstrain.train import train

    return train(from_dict({"shards": shards, "model": {**MODEL, **kw.pop("model", {})}, "max_steps": steps,
                            "pipeline.name": "none", "metrics.log_every_steps": 0, **kw}))


def _meta(path):
    with open(os.path.join(path, "fstrain.json")) as f:
        return json.load(f)


def _identity_worker(root):
    """One rank: train OLD 2 steps; refuse other shards; resume a reshard of OLD at step 2; --init-from."""
    from fstrain.components.checkpoint import init_from_checkpoint, load_model_weights
    from fstrain.distributed.env import init_distributed
    from fstrain.distributed.optim import OptimConfig
    from fstrain.distributed.sharding import build_sharded_model, local_state
    from fstrain.models.config import Config

    out = {}
    old, ck = os.path.join(root, "old"), os.path.join(root, "ck")
    _train(old, 2, model={"num_items": 50}, **{"checkpoint.dir": ck})
    first = os.path.join(ck, "step-00000002")
    out["old_meta"] = _meta(first)
    for name in ("other", "bad_lineage"):
        try:
            _train(os.path.join(root, name), model={"num_items": 50}, **{"checkpoint.dir": ck,
                                                                          "checkpoint.resume": True})
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    res = _train(os.path.join(root, "new"), 5, model={"num_items": 50}, **{"checkpoint.dir": ck,
                                                                            "checkpoint.resume": True})
    out["new_summary"] = {k: res.summary[k] for k in ("first_step", "end_step", "global_end_step")}
    out["new_meta"] = _meta(os.path.join(ck, "step-00000005"))
    # --init-from into a model with more items: known rows kept, new rows as a fresh model's
    big = os.path.join(root, "big")
    res = _train(big, 1, model={"num_items": 80}, **{"checkpoint.dir": os.path.join(root, "ck_big"),
                                                      "checkpoint.init_from": ck})
    out["init_summary"] = {k: res.summary[k] for k in ("first_step", "end_step")}
    out["init_meta"] = _meta(os.path.join(root, "ck_big", "step-00000001"))
    env = init_distributed("gloo")
    cfg_old = Config(**out["old_meta"]["model"])
    cfg_new = Config(**{**out["old_meta"]["model"], "num_items": 80})
    states = {}
    for name, cfg in (("old", cfg_old), ("fresh", cfg_new), ("grown", cfg_new)):
        torch.manual_seed(0)
        dmp, _ = build_sharded_model(cfg, OptimConfig(), env)
        if name == "old":
            load_model_weights(dmp, first, {})
        elif name == "grown":
            init_from_checkpoint(dmp, first, 80)
        states[name] = local_state(dmp)
    try:
        torch.manual_seed(0)
        dmp, _ = build_sharded_model(Config(**{**out["old_meta"]["model"], "num_items": 30}), OptimConfig(), env)
        init_from_checkpoint(dmp, first, 30)
        out["smaller"] = None
    except ConfigError as e:
        out["smaller"] = str(e)
    out["states"] = states
    return out


def test_resume_identity_reshard_lineage_and_init_from(tmp_path):
    root = str(tmp_path)
    write_shards(os.path.join(root, "old"), num_ranks=1, num_steps=4, batch_size_per_rank=6, seed=1)
    write_shards(os.path.join(root, "other"), num_ranks=1, num_steps=4, batch_size_per_rank=6, seed=2)
    old_digest = plan_digest(load_manifest(os.path.join(root, "old")))
    for name, step in (("bad_lineage", 1), ("new", 2)):  # what fsdata balance OLD NEW --from-step 2 records
        write_shards(os.path.join(root, name), num_ranks=1, num_steps=3, batch_size_per_rank=4, seed=3,
                     plan_digest=f"sha256:{name}", manifest_extra={
                         "plan_digest": f"sha256:{name}", "resharded_from": {"plan_digest": old_digest,
                                                                              "from_step": step}})
    write_shards(os.path.join(root, "big"), num_ranks=1, num_steps=2, batch_size_per_rank=6, seed=4, num_items=80)
    [out] = run_ranks(_identity_worker, 1, root)
    assert out["old_meta"]["plan_digest"] == old_digest and out["old_meta"]["step"] == 2
    assert out["old_meta"]["shards_step"] == 2 and out["old_meta"]["model"]["num_items"] == 50
    assert "other shards" in out["other"] and "--init-from" in out["other"]
    assert "was resharded from" in out["bad_lineage"] and "--init-from" in out["bad_lineage"]
    # NEW continues at its step 0; the global step (checkpoint name) continues from 2
    assert out["new_summary"] == {"first_step": 0, "end_step": 3, "global_end_step": 5}
    assert out["new_meta"]["plan_digest"] == "sha256:new" and out["new_meta"]["shards_step"] == 3
    assert out["init_summary"] == {"first_step": 0, "end_step": 1}
    assert out["init_meta"]["model"]["num_items"] == 80 and out["init_meta"]["init_from"].endswith("step-00000005")
    s = out["states"]
    table = next(k for k, v in s["grown"].items() if v.shape[0] == 80)
    assert torch.equal(s["grown"][table][:50], s["old"][table])
    assert torch.equal(s["grown"][table][50:], s["fresh"][table][50:])
    assert not torch.equal(s["grown"][table][:50], s["fresh"][table][:50])
    for k in s["grown"]:
        if k != table:
            assert torch.equal(s["grown"][k], s["old"][k]), k
    assert "num_items 50" in out["smaller"] and "--num-items 50" in out["smaller"]


def _train_worker(shards, steps, ck, resume):
    from fstrain.distributed.sharding import local_state

    res = _train(shards, steps, model={"num_items": 50}, **{"checkpoint.dir": ck, "checkpoint.resume": resume})
    return res.summary["first_step"], res.summary["global_end_step"], local_state(res.model)


@pytest.mark.multiproc
def test_resume_on_fewer_ranks_after_a_reshard(tmp_path):
    """OLD on 2 ranks to step 2; NEW (resharded from OLD at 2) for 1 rank resumes its checkpoint."""
    old, new, ck = str(tmp_path / "old"), str(tmp_path / "new"), str(tmp_path / "ck")
    write_shards(old, num_ranks=2, num_steps=4, batch_size_per_rank=4, seed=1)
    lineage = {"plan_digest": plan_digest(load_manifest(old)), "from_step": 2}
    write_shards(new, num_ranks=1, num_steps=2, batch_size_per_rank=8, seed=5, plan_digest="sha256:n",
                 manifest_extra={"plan_digest": "sha256:n", "resharded_from": lineage})
    run_ranks(_train_worker, 2, old, 2, ck, False)
    [(first, end, state)] = run_ranks(_train_worker, 1, new, None, ck, True)
    assert (first, end) == (0, 4)
    meta = _meta(os.path.join(ck, "step-00000004"))
    assert meta["world_size"] == 1 and meta["shards_step"] == 2 and meta["plan_digest"] == "sha256:n"


def test_step_schedule_global_period_epoch_ends_and_labels():
    """Periods run on the global step (shards step + S); epoch ends are the shards' exact boundaries."""
    from fstrain.components.schedule import StepSchedule

    s = StepSchedule(every_steps=2, step_offset=3)
    assert [k for k in range(1, 6) if s.due(k)] == [1, 3, 5]  # global steps 4, 6, 8
    assert s.label(1) == "step 1 (global step 4)" and StepSchedule(every_steps=2).label(1) == "step 1"
    assert not StepSchedule().due(4)
    e = StepSchedule.epochs([0, 3, 8, 13], 1, step_offset=7)  # a partial first epoch of 3 steps, then 5 and 5
    assert sorted(e.at_steps) == [3, 8, 13] and e.epoch(3) == 1.0 and e.epoch(5) == pytest.approx(1.4)
    assert e.epoch(13) == 3.0 and e.epoch(0) == 0.0 and e.global_step(3) == 10
    assert sorted(StepSchedule.epochs([0, 3, 8, 13], 2).at_steps) == [8]
    assert sorted(StepSchedule.epochs([0, 4, 8, 12], 1).at_steps) == [4, 8, 12]  # equal epochs: as N * spe
    by_steps = StepSchedule.evaluation([0, 3, 8, 13], every_steps=2, every_epochs=0, step_offset=7)
    assert [k for k in range(1, 9) if by_steps.due(k)] == [1, 3, 5, 7] and by_steps.epoch(5) == pytest.approx(1.4)
    assert StepSchedule.evaluation([0, 3, 8, 13], every_steps=2, every_epochs=1, step_offset=7) == e


def test_checkpointer_saves_on_its_period_and_at_the_end(monkeypatch):
    """The checkpoint schedule lives in the component: due on the global step, flushed first, named by the
    global step with the shards' step recorded; the end-of-run save only when the period did not save."""
    import fstrain.components.checkpoint as C

    saved, events = [], []
    monkeypatch.setattr(C, "save_checkpoint", lambda dmp, opt, d, step, rank, world, extra: saved.append(
        (d, step, extra["shards_step"], extra["shards"])) or d)
    ck = C.Checkpointer("ck", 2, step_offset=3, rank=0, world_size=1, extra={"shards": "s"})
    assert ck.periodic and not C.Checkpointer("ck").periodic and not C.Checkpointer(None, 2).periodic
    did = [ck.after_step(None, None, k, flush=lambda k=k: events.append(k)) for k in range(1, 5)]
    assert did == [True, False, True, False] and events == [1, 3]  # global steps 4 and 6
    assert saved == [("ck", 4, 1, "s"), ("ck", 6, 3, "s")]
    ck.finish(None, None, 3, start=0)  # step 3 was just saved by the period
    ck.finish(None, None, 4, start=0)
    ck.finish(None, None, 4, start=4)  # nothing trained
    assert saved[2:] == [("ck", 7, 4, "s")]
    off = C.Checkpointer(None, 2)
    assert not off.after_step(None, None, 2) and off.finish(None, None, 2, start=0) is None and len(saved) == 3


def _schedule_worker(root, ev):
    """OLD to step 3, checkpoint every 2; NEW (resharded at 3) resumed with checkpoint, eval and log every 2."""
    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    for name in ("fstrain.train", "fstrain.components.evaluator"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    ck = os.path.join(root, "ck")
    _train(os.path.join(root, "old"), 3, model={"num_items": 50}, **{"checkpoint.dir": ck,
                                                                     "checkpoint.every_steps": 2})
    before = sorted(os.listdir(ck))
    res = _train(os.path.join(root, "new"), model={"num_items": 50},
                 **{"checkpoint.dir": ck, "checkpoint.every_steps": 2, "checkpoint.resume": True,
                    "eval.data": ev, "eval.every_steps": 2, "metrics.log_every_steps": 2})
    metas = {n: _meta(os.path.join(ck, n)) for n in sorted(os.listdir(ck)) if n not in before}
    return before, {n: (m["step"], m["shards_step"]) for n, m in metas.items()}, res.summary, lines


def test_resume_after_a_reshard_schedules_on_the_global_step_and_logs_both(tmp_path):
    """After a reshard at S=3, NEW's shards step starts at 0 and the global step continues: checkpoints,
    evaluations and log lines fall on the global steps an uninterrupted run would use (every 2), and the
    log lines and evaluation records name both steps."""
    from tests.fstrain.test_evaluate import _eval_file

    root = str(tmp_path)
    write_shards(os.path.join(root, "old"), num_ranks=1, num_steps=6, batch_size_per_rank=6, seed=1)
    lineage = {"plan_digest": plan_digest(load_manifest(os.path.join(root, "old"))), "from_step": 3}
    write_shards(os.path.join(root, "new"), num_ranks=1, num_steps=4, batch_size_per_rank=6, seed=3,
                 plan_digest="sha256:n", manifest_extra={"plan_digest": "sha256:n", "resharded_from": lineage})
    ev = _eval_file(tmp_path / "e.parquet")
    [(before, saved, summary, lines)] = run_ranks(_schedule_worker, 1, root, ev)
    assert before == ["step-00000002", "step-00000003"]
    # shards steps 1 and 3 are global steps 4 and 6 (the period); the end, shards step 4, is global step 7
    assert saved == {"step-00000004": (4, 1), "step-00000006": (6, 3), "step-00000007": (7, 4)}
    assert (summary["first_step"], summary["end_step"], summary["global_end_step"]) == (0, 4, 7)
    assert [(r["step"], r["global_step"]) for r in summary["eval"]] == [(1, 4), (3, 6), (4, 7)]
    assert any("global step 3, step 0 of these shards (resharded at global step 3" in x for x in lines), lines
    assert [x.split(" loss")[0] for x in lines if " loss " in x] == ["step 1 (global step 4)", "step 3 (global step 6)"]
    assert any(x.startswith("eval step 3 (global step 6)") for x in lines), lines
    assert any("steps 0..3 of these shards (global steps 3..6)" in x for x in lines), lines
