"""The plan's typed metadata (fsdata.shards.plan_meta): one place reads, writes and checks it; the
plan file's JSON keeps its key order; unknown keys survive; bad values are one line each."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from fsdata.errors import InputError
from fsdata.shards.plan_file import plan_digest, read_plan
from fsdata.shards.plan_meta import PLAN_FORMAT_VERSION, PlanMeta
from tests.fsdata.helpers import write_samples


def _meta(**kw) -> dict:
    d = dict(plan_format_version=PLAN_FORMAT_VERSION, num_ranks=2, num_steps=3, batch_size_per_rank=4,
             batch_policy="fixed", strategy="balanced", remainder_policy="drop", seed=0,
             cost_model={"kind": "polynomial", "name": "quadratic", "coefficients": [0, 0, 1]},
             predicted_bubble=0.1, baseline_predicted_bubble=0.3, lower_bound_bubble=None, num_samples_input=24,
             input_digest="sha256:x", fsdata_version="0", settings={"seed": 0}, carried={},
             manifest_extra={"lower_bound_kind": "pigeonhole"})
    d.update(kw)
    return d


def test_round_trip_keeps_order_values_and_unknown_keys():
    raw = _meta(epochs=2, steps_per_epoch=3, num_steps=6, future_key={"a": 1})
    raw["num_samples_input"] = 12
    m = PlanMeta.from_dict(json.loads(json.dumps(raw)), "p", num_rows=24)
    assert m.num_epochs == 2 and m.steps_of_epochs == [3, 3] and m.other == {"future_key": {"a": 1}}
    assert list(m.to_dict()) == list(raw) and m.to_dict() == raw


def test_set_epochs_records_where_the_format_says():
    m = PlanMeta.from_dict(_meta(), "p", num_rows=24)
    assert "epochs" not in m.to_dict() and m.steps_of_epochs == [3]
    m.set_epochs(2, [3, 2], per_epoch_list=False)
    assert m.to_dict()["epoch_num_steps"] == [3, 2] and "steps_per_epoch" not in m.to_dict()
    assert m.settings["epochs"] == 2 and m.manifest_extra["epoch_num_steps"] == [3, 2]
    m.set_epochs(2, [3, 3], per_epoch_list=True)  # cost-budget: both
    assert m.steps_per_epoch == 3 and m.epoch_num_steps == [3, 3] and m.steps_of_epochs == [3, 3]


@pytest.mark.parametrize("edit, words", [
    ({"plan_format_version": 0}, "plan_format_version 0 is not"),
    ({"num_ranks": "2"}, "num_ranks is '2', not an integer >= 1"),
    ({"num_steps": -1}, "num_steps is -1, not an integer >= 0"),
    ({"seed": True}, "seed is True, not an integer >= 0"),
    ({"strategy": 3}, "strategy is 3, not a JSON str"),
    ({"settings": None}, "settings is None, not a JSON dict"),
    ({"predicted_bubble": "0.1"}, "predicted_bubble is '0.1', not a number"),
    ({"epochs": 5}, "epochs 5 and steps per epoch"),
])
def test_bad_values_are_one_line(edit, words):
    with pytest.raises(InputError) as e:
        PlanMeta.from_dict(_meta(**edit), "plan.parquet", num_rows=24)
    assert words in str(e.value) and "\n" not in str(e.value) and "plan.parquet" in str(e.value)


def test_a_written_plan_reads_back_as_the_same_meta_and_digest(tmp_path):
    from fsdata.cli import main

    inp = write_samples(tmp_path / "in.parquet", n=200, seed=1)
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), "--ranks", "2", "--batch-size-per-rank", "4", "--epochs", "2",
                 "--no-progress"]) == 0
    raw = json.loads(pq.read_schema(plan).metadata[b"fsdata.plan"])
    t = read_plan(plan)
    assert isinstance(t.meta, PlanMeta) and t.meta.to_dict() == raw and list(t.meta.to_dict()) == list(raw)
    assert pq.read_schema(plan).metadata[b"fsdata.plan_digest"].decode() == plan_digest(t)


def test_write_takes_the_plans_own_planning_settings(tmp_path, monkeypatch):
    """``fsdata write`` builds its settings from the plan (not defaults), plus the run's own fields."""
    from fsdata.cli import main
    from fsdata.engines import base

    inp = write_samples(tmp_path / "in.parquet", n=200, seed=1)
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(inp), str(plan), "--ranks", "2", "--batch-size-per-rank", "4", "--seed", "7",
                 "--partitioner", "lpt", "--cost-model", "quadratic", "--epochs", "2", "--no-progress"]) == 0
    seen = []
    real = base.get_engine
    monkeypatch.setattr(base, "get_engine", lambda s: seen.append(s) or real(s))
    assert main(["write", str(inp), str(plan), str(tmp_path / "out"), "--num-threads", "1", "--no-progress"]) == 0
    s = seen[0]
    assert (s.num_ranks, s.batch_size_per_rank, s.seed, s.partitioner, s.cost_model, s.epochs) == \
        (2, 4, 7, "lpt", "quadratic", 2)
    assert s.num_threads == 1 and s.progress is False
    assert read_plan(plan).meta.balance_settings(num_threads=1).plan_window == s.plan_window
