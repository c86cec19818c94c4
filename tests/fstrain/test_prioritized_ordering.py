"""The prioritized pipeline's collective ordering gate (two threads, two communicators).

On NCCL the main thread's and the background thread's collectives must be issued in the same
order on every rank. Tested on CPU with gloo and the gate switched on: every collective the
pipeline issues is recorded (thread, group, op) on each rank over many steps; the sequence is
the documented one, identical on both ranks, and training is bit-identical to the ungated run.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from fstrain.pipelines.ordering import CollectiveOrderGate, needs_ordered_collectives
from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards

MODEL = dict(num_items=40, embedding_dim=8, num_negatives=6, num_layers=1, num_heads=2)
NUM_STEPS = 10
RECORDED = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor",
            "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "barrier", "send", "recv",
            "isend", "irecv", "batch_isend_irecv")


def test_gate_holds_main_thread_collectives_until_submitted_jobs_returned():
    release, order = threading.Event(), []

    def job():
        release.wait(10)
        order.append("job")

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        gate = CollectiveOrderGate(enabled=True)
        gate.submit(pool, job)
        threading.Timer(0.2, release.set).start()
        gate.before_collective()  # must not return before the job did
        order.append("main collective")
        assert order == ["job", "main collective"] and gate.num_waits == 1
        gate.before_collective()  # nothing outstanding: returns at once
        off = CollectiveOrderGate(enabled=False)
        blocker = threading.Event()
        fut = off.submit(pool, blocker.wait, 10)
        off.before_collective()  # disabled: does not wait
        assert not fut.done()
        blocker.set()


def test_gate_is_on_for_nccl_backends_only():
    assert needs_ordered_collectives("nccl") and needs_ordered_collectives("fs_cuda_ce")
    assert not needs_ordered_collectives("gloo") and not needs_ordered_collectives("fs_shm")


def _expected_sequence(num_steps: int, overflows: list[bool]) -> list[tuple[str, str, str]]:
    """The documented issue order (fstrain.pipelines.prioritized, class doc) for ``num_steps`` batches.

    ``overflows[i]``: whether prefetch i needed the id overflow round (one more all-to-all).
    """
    a2a, ar = "all_to_all_single", "all_reduce"

    def prefetch(i):  # counts + ids + held gradient; [overflow ids]; flags + rows
        return [("bg", "background", a2a)] * (3 if overflows[i] else 2)

    seq = prefetch(0)  # fill: prefetch of batch 0
    for step in range(num_steps):
        last = step == num_steps - 1
        seq.append(("main", "default", a2a))  # fetch_ol
        if not last:
            seq += prefetch(step + 1)
        seq += [("main", "straggler", ar), ("main", "default", ar), ("main", "default", a2a)]  # ..., sparse update
        if last and num_steps > 1:
            seq.append(("bg", "background", a2a))  # flush: the held gradient of the step before
    return seq


def _train(shards, env, ordered: bool, record: bool):
    import torch.distributed as dist

    from fstrain.data import ShardReader
    from fstrain.distributed.optim import OptimConfig
    from fstrain.distributed.sharding import build_sharded_model, local_state
    from fstrain.models import Config, with_negatives
    from fstrain.pipelines import PipelineConfig, make_pipeline, run_steps

    torch.manual_seed(0)
    dmp, opt = build_sharded_model(Config(**MODEL), OptimConfig(dense_lr=1e-2, sparse_lr=0.1), env)
    pipe = make_pipeline(PipelineConfig(name="prioritized", ordered_collectives=ordered), dmp, opt, env.device)
    log: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    # every collective torch.distributed offers, so a new one (of any kind) shows up in the sequence
    originals = {name: getattr(dist, name) for name in RECORDED}

    def label(group) -> str:
        if group is None or group is dist.group.WORLD:
            return "default"
        return {id(pipe._group): "background", id(pipe._straggler_group): "straggler"}.get(id(group), "other")

    def recorded(name):
        def call(*args, **kwargs):
            thread = "main" if threading.current_thread() is threading.main_thread() else "bg"
            with lock:
                log.append((thread, label(kwargs.get("group")), name))
            return originals[name](*args, **kwargs)
        return call

    from fstrain.pipelines.prioritized import PrioritizedPipeline

    assert isinstance(pipe, PrioritizedPipeline)
    overflows: list[bool] = []
    exchange = pipe._ids.exchange

    def recorded_exchange(*args, **kwargs):
        before = pipe._ids.num_overflows
        out = exchange(*args, **kwargs)
        overflows.append(pipe._ids.num_overflows > before)
        return out

    pipe._ids.exchange = recorded_exchange  # type: ignore[method-assign]
    if record:
        for name in originals:
            setattr(dist, name, recorded(name))
    try:
        batches = (with_negatives(b, MODEL["num_items"], MODEL["num_negatives"], 0)
                   for b in ShardReader(shards, env.rank, env.world_size, num_prefetch_batches=0))
        outs = run_steps(pipe, batches)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    pipe.flush()
    state = local_state(dmp)
    enabled, waits = pipe.gate.enabled, pipe.gate.num_waits
    pipe.close()
    return {"loss": [float(o.output[0]) for o in outs], "state": state, "log": log, "gate": enabled,
            "waits": waits, "overflows": overflows, "capacity": pipe._ids.capacity}


def _worker(shards):
    from fstrain.distributed.env import init_distributed

    env = init_distributed("gloo")
    out = {"ordered": _train(shards, env, ordered=True, record=True),
           "default": _train(shards, env, ordered=None, record=False)}
    return out


@pytest.mark.multiproc
def test_ordered_collectives_identical_on_every_rank_and_training_bit_identical(tmp_path):
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=NUM_STEPS, batch_size_per_rank=4, seed=11,
                          num_items=MODEL["num_items"])
    results = run_ranks(_worker, 2, shards)
    for rank, r in enumerate(results):
        overflows = r["ordered"]["overflows"]
        assert len(overflows) == NUM_STEPS and overflows[0]  # one prefetch per batch; capacity 0 at first
        assert sum(overflows) <= 2, overflows  # then the shared capacity holds (headroom over the largest count)
        assert overflows == results[0]["ordered"]["overflows"]  # every rank decides the same
        expected = _expected_sequence(NUM_STEPS, overflows)
        # 4 all-to-alls per step once the capacity holds (fetch_ol, 2 for the prefetch, sparse update)
        assert sum(e[2] == "all_to_all_single" for e in expected) <= 4 * NUM_STEPS + 1 + sum(overflows)
        assert r["ordered"]["gate"] is True and r["default"]["gate"] is False  # gloo: off unless asked
        assert r["ordered"]["log"] == expected, f"rank {rank}: issue order differs from the documented one"
        assert len(r["ordered"]["loss"]) == NUM_STEPS
        assert r["ordered"]["loss"] == r["default"]["loss"], "gated training differs from ungated"
        for k, v in r["default"]["state"].items():
            assert torch.equal(r["ordered"]["state"][k], v), f"rank {rank}: {k} differs (gated vs ungated)"
    assert results[0]["ordered"]["log"] == results[1]["ordered"]["log"]
