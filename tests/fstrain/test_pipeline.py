"""Pipelines: every shipped schedule ends with the parameters of plain training (2 gloo ranks).

One spawn of 2 ranks (module fixture) trains the same batches with each pipeline from the same
seed and probes torchrec's ``TrainPipelinePEC`` on CPU; the tests below check its results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards

MODEL = dict(num_items=40, embedding_dim=8, num_negatives=6, num_layers=1, num_heads=2)
NUM_STEPS = 4
PIPELINED = ["sparse-dist", "prioritized", "prioritized-no-overlap"]


def _batches(shards, rank, world_size=2):
    from fstrain.data import ShardReader
    from fstrain.models import with_negatives

    return (with_negatives(b, MODEL["num_items"], MODEL["num_negatives"], 0)
            for b in ShardReader(shards, rank, world_size, num_prefetch_batches=0))


def _train(shards, config, env, build=None, max_steps=None):
    from fstrain.distributed.optim import OptimConfig
    from fstrain.distributed.sharding import build_sharded_model, local_state
    from fstrain.models import Config
    from fstrain.pipelines import PipelineConfig, make_pipeline, run_steps

    if config == "prioritized-no-overlap":
        config = PipelineConfig(name="prioritized", overlap=False)
    torch.manual_seed(0)
    dmp, opt = (build or build_sharded_model)(Config(**MODEL), OptimConfig(dense_lr=1e-2, sparse_lr=0.1), env)
    pipe = make_pipeline(config, dmp, opt, env.device)
    outs = run_steps(pipe, _batches(shards, env.rank, env.world_size), max_steps)
    pipe.flush()  # mid-run: the state a checkpoint would save
    state = local_state(dmp)
    gather = getattr(pipe, "_weight", None) is not None  # prioritized: reads are gathers from the TBE's weights
    pipe.close()
    return {"state": state, "gather": gather, "stats": [o.stats for o in outs],
            "loss": [float(o.output[0]) for o in outs],
            "class": type(pipe).__name__, "steps": [o.step for o in outs], "tokens": [o.num_tokens for o in outs],
            "true_tokens": [int(b.lengths.sum()) for b in _batches(shards, env.rank, env.world_size)]}


HANDSHAKE_TIMEOUT_SECONDS = 20.0


def _overlap_probe(shards, env, overlap: bool) -> list[dict]:
    """Where the NOL prefetch of batch N+1 runs relative to the dense forward of batch N.

    Overlapped, the prefetch (on the background thread) and the dense forward (main thread) wait
    for each other: the forward pre-hook signals "in the dense forward" and waits until the
    prefetch has seen it, so the handshake completes only if both run at the same time. No
    timing is involved; the timeout only turns a broken overlap into a failure instead of a hang.
    Inline, the prefetch must run on the main thread before the forward (no handshake).
    """
    import threading

    from fstrain.distributed.optim import OptimConfig
    from fstrain.distributed.sharding import build_sharded_model
    from fstrain.models import Config
    from fstrain.pipelines import PipelineConfig, make_pipeline, run_steps

    dmp, opt = build_sharded_model(Config(**MODEL), OptimConfig(), env)
    pipe = make_pipeline(PipelineConfig(name="prioritized", overlap=overlap), dmp, opt, env.device)
    inner = pipe._prefetch_on_stream
    in_forward, seen = threading.Event(), threading.Event()
    log: list[dict] = []

    def probed_prefetch(batch, prev, held, t0):
        record = {"event": "prefetch", "main_thread": threading.current_thread() is threading.main_thread(),
                  "fill": prev is None, "saw_forward": None}
        if overlap and prev is not None:  # submitted by a step, before its dense forward
            record["saw_forward"] = in_forward.wait(HANDSHAKE_TIMEOUT_SECONDS)
            seen.set()
        log.append(record)
        return inner(batch, prev, held, t0)

    def forward_pre_hook(*_):
        record = {"event": "forward", "saw_prefetch": None}
        if overlap:
            in_forward.set()
            record["saw_prefetch"] = seen.wait(HANDSHAKE_TIMEOUT_SECONDS)
            in_forward.clear()
            seen.clear()
        log.append(record)

    pipe._prefetch_on_stream = probed_prefetch
    hook = dmp.module.dense.register_forward_pre_hook(forward_pre_hook)
    prio: Any = pipe  # a PrioritizedPipeline
    all_to_all, calls = prio._all_to_all, []

    def counted_all_to_all(*args, **kwargs):
        calls.append(args)
        return all_to_all(*args, **kwargs)

    prio._all_to_all = counted_all_to_all
    run_steps(pipe, _batches(shards, env.rank, env.world_size), 3)  # 4 batches: each step has a next one
    log.append({"event": "summary", "all_to_alls": len(calls), "id_overflows": prio._ids.num_overflows})
    hook.remove()
    pipe.close()
    return log


def _pipeline_steps(shards, env) -> list:
    """What ``fstrain.train`` would consume: ``pipeline_steps`` items (timings as plain tuples)."""
    from fstrain.distributed.optim import OptimConfig
    from fstrain.distributed.sharding import build_sharded_model
    from fstrain.models import Config
    from fstrain.pipelines import make_pipeline, pipeline_steps

    torch.manual_seed(0)
    dmp, opt = build_sharded_model(Config(**MODEL), OptimConfig(dense_lr=1e-2, sparse_lr=0.1), env)
    pipe = make_pipeline("prioritized", dmp, opt, env.device)
    items = [(step, float(loss), n, tokens, t) for step, loss, n, tokens, t in
             pipeline_steps(pipe, _batches(shards, env.rank, env.world_size), env.rank)]
    pipe.close()
    return items


def _worker(shards, backend="gloo", names=("plain", *PIPELINED), probe=True):
    from fstrain.distributed.env import init_distributed
    from fstrain.distributed.optim import OptimConfig
    from fstrain.models import Config
    from fstrain.distributed.pec import build_pec_sharded_model, probe_torchrec_pec, to_plain_keys
    from fstrain.pipelines import PipelineConfig, PipelineUnavailableError, make_pipeline

    env = init_distributed(backend)
    out = {name: _train(shards, name, env) for name in names}
    if probe:
        for name in ("plain", "prioritized"):
            out[f"{name}@2"] = _train(shards, name, env, max_steps=2)
        out["overlap_probe"] = {mode: _overlap_probe(shards, env, mode) for mode in (True, False)}
        out["pipeline_steps"] = _pipeline_steps(shards, env)
    from fstrain.distributed.sharding import build_sharded_model, local_state

    torch.manual_seed(0)
    out["init"] = local_state(build_sharded_model(Config(**MODEL), OptimConfig(), env)[0])
    if probe:
        torch.manual_seed(0)
        dmp, opt = build_pec_sharded_model(Config(**MODEL), OptimConfig(), env)
        try:
            make_pipeline("pec", dmp, opt, env.device)
            out["pec_error"] = None
        except PipelineUnavailableError as e:
            out["pec_error"] = str(e)
        out["torchrec_pec_error"] = repr(probe_torchrec_pec(dmp, opt, env.device, _batches(shards, env.rank)))
        fb = _train(shards, PipelineConfig(name="pec", pec_fallback=True), env, build=build_pec_sharded_model)
        fb["state"] = to_plain_keys(fb["state"])
        out["pec-fallback"] = fb
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    shards = write_shards(str(tmp_path_factory.mktemp("pipe") / "s"), num_ranks=2, num_steps=NUM_STEPS,
                          batch_size_per_rank=4, seed=7, num_items=MODEL["num_items"])
    return run_ranks(_worker, 2, shards)


def _assert_equal_to_plain(rank_result: dict, name: str) -> None:
    ref, got = rank_result["plain"], rank_result[name]
    assert len(got["stats"]) == NUM_STEPS
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), msg=lambda m: f"{name} loss: {m}")
    assert ref["state"].keys() == got["state"].keys()
    for k in ref["state"]:
        torch.testing.assert_close(got["state"][k], ref["state"][k], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PIPELINED)
def test_equal_to_non_pipelined(results, name):
    """After k steps on the same batches, parameters and losses equal plain training."""
    for r in results:
        assert r[name]["class"] != "PlainPipeline"
        _assert_equal_to_plain(r, name)
        assert r[name]["steps"] == list(range(NUM_STEPS))  # outputs name the batch they trained
        assert r[name]["tokens"] == r[name]["true_tokens"]


@pytest.mark.multiproc
def test_flushed_mid_run_state_equals_non_pipelined(results):
    """After ``flush()`` the state mid-run (what a checkpoint saves) equals plain training's."""
    for r in results:
        ref, got = r["plain@2"]["state"], r["prioritized@2"]["state"]
        assert len(r["prioritized@2"]["stats"]) == 2
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
        table = "ec.embeddings.item_table.weight"
        assert not torch.equal(ref[table], r["plain"]["state"][table])  # 2 steps are not the end state


@pytest.mark.multiproc
def test_prefetch_overlaps_dense_compute(results):
    """Overlapped, the NOL prefetch of batch N+1 runs on the background thread while batch N's
    dense forward runs (a two-way handshake); inline, each batch's one lookup runs on the main
    thread after the previous batch's backward, and a step costs two all-to-alls (ids + the
    previous gradient, rows), as many as torchrec's sparse-dist exposes; overlapped, four (two
    of them hidden)."""
    for r in results:
        (*overlapped, s_over), (*inline, s_in) = r["overlap_probe"][True], r["overlap_probe"][False]
        assert s_in["all_to_alls"] == 2 * 3 + 2 + s_in["id_overflows"], s_in  # + the first batch's (2)
        assert s_over["all_to_alls"] == 4 * 3 + 2 + s_over["id_overflows"], s_over  # + the fill's prefetch (2)
        prefetches = [e for e in overlapped if e["event"] == "prefetch" and not e["fill"]]
        forwards = [e for e in overlapped if e["event"] == "forward"]
        assert len(prefetches) == len(forwards) == 3, overlapped
        assert all(not e["main_thread"] and e["saw_forward"] for e in prefetches), overlapped
        assert all(e["saw_prefetch"] for e in forwards), overlapped
        assert [e["event"] for e in inline] == ["prefetch"] + ["forward", "prefetch"] * 3, inline
        assert all(e["main_thread"] for e in inline if e["event"] == "prefetch"), inline


@pytest.mark.multiproc
def test_pipeline_steps_feed_train_metrics(results):
    """``pipeline_steps`` gives train() the step, loss, counts and a StepTiming of each batch (its
    ``num_samples``: the batch's samples, fewer than the supervised positions of all-positions)."""
    for rank, r in enumerate(results):
        items, ref = r["pipeline_steps"], r["plain"]
        assert [i[0] for i in items] == list(range(NUM_STEPS))
        torch.testing.assert_close(torch.tensor([i[1] for i in items]), torch.tensor(ref["loss"]))
        assert [i[3] for i in items] == ref["true_tokens"]
        for step, _, n, tokens, t in items:
            assert (t.step, t.rank, t.num_tokens) == (step, rank, tokens) and n > 0
            # num_samples counts histories; n the loss's supervised positions (all of them here)
            assert 0 < t.num_samples < n == tokens
            assert t.compute_seconds > 0 and t.wait_seconds > 0 and t.sync_seconds >= 0


@pytest.mark.multiproc
def test_training_moved_the_parameters(results):
    """Guards the equality test: k steps changed this rank's table rows and every dense tensor."""
    for r in results:
        init, trained = r["init"], r["plain"]["state"]
        assert init.keys() == trained.keys()
        changed = {k for k in init if not torch.equal(init[k], trained[k])}
        assert "ec.embeddings.item_table.weight" in changed
        assert len(changed) == len(init), sorted(set(init) - changed)


@pytest.mark.multiproc
def test_prioritized_splits_rows_and_reports_times(results):
    for r in results:
        stats = r["prioritized"]["stats"]
        assert stats[0].num_rows_after_update == 0 and stats[0].num_rows_ahead > 0  # no predecessor: all ahead
        assert all(s.num_rows_after_update > 0 for s in stats[1:])  # tiny vocabulary: batches share rows
        assert sum(s.num_rows_ahead for s in stats[1:]) > 0
        assert "background_prefetch" in stats[1].phase_seconds
        parts = ("ids", "held_update", "lookup", "replies")
        assert all(f"background_prefetch.{p}" in stats[1].phase_seconds for p in parts)
        assert r["prioritized"]["gather"] and r["prioritized-no-overlap"]["gather"]  # the local shard aliases the TBE
        assert "prefetch_inline" in r["prioritized-no-overlap"]["stats"][1].phase_seconds
        for name in ["plain", *PIPELINED]:
            for s in r[name]["stats"]:
                assert 0 < s.compute_seconds <= s.step_seconds and s.straggler_wait_seconds > 0
                assert s.exposed_comm_seconds == pytest.approx(
                    s.step_seconds - s.compute_seconds - s.straggler_wait_seconds)


@pytest.mark.multiproc
def test_torchrec_pec_does_not_run_on_cpu(results):
    """torchrec 1.9.2's TrainPipelinePEC needs CUDA events; ours says so and falls back when asked.

    If this fails because torchrec now runs on CPU, add ``pec`` to the equality test.
    """
    for r in results:
        assert "needs a CUDA device" in r["pec_error"]  # resolve_pipeline_name's: the one decision
        assert "Tried to instantiate dummy base class Event" in r["torchrec_pec_error"]
        assert r["pec-fallback"]["class"] == "PrioritizedPipeline"
        _assert_equal_to_plain(r, "pec-fallback")


def test_unknown_pipeline_name_is_a_config_error():
    from fstrain.errors import ConfigError
    from fstrain.pipelines import PipelineConfig

    with pytest.raises(ConfigError, match="unknown pipeline 'pecc'; use one of plain, sparse-dist, pec"):
        PipelineConfig(name="pecc")


def test_segment_counts():
    from fstrain.pipelines.prioritized import _segment_counts

    flags = torch.tensor([True, False, True, True, False])
    assert _segment_counts(flags, [2, 0, 3]) == [1, 0, 2]
    assert _segment_counts(torch.zeros(0, dtype=torch.bool), [0, 0]) == [0, 0]


def _pec_gpu_worker(shards):
    from fstrain.distributed.pec import build_pec_sharded_model, to_plain_keys

    out = _worker(shards, backend="nccl", names=("plain",), probe=False)
    from fstrain.distributed.env import DistEnv
    import torch.distributed as dist

    env = DistEnv(dist.get_rank(), dist.get_world_size(), dist.get_rank(), torch.device("cuda", dist.get_rank()),
                  "nccl")
    pec = _train(shards, "pec", env, build=build_pec_sharded_model)
    pec["state"] = to_plain_keys(pec["state"])
    out["pec"] = pec
    return out


@pytest.mark.gpu
@pytest.mark.multiproc
def test_pec_equal_to_non_pipelined_on_gpu(tmp_path):
    """torchrec's TrainPipelinePEC on 2 GPUs (NCCL) equals plain training. Not run here: no GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=NUM_STEPS, batch_size_per_rank=4, seed=7,
                          num_items=MODEL["num_items"])
    for r in run_ranks(_pec_gpu_worker, 2, shards):
        assert r["pec"]["class"] == "PECPipeline"
        _assert_equal_to_plain(r, "pec")


_SHM_HANG_SECONDS = 90


def _shm_worker(shards):
    """``prioritized`` over ``--backend shm``: the background exchange runs on a second fs_shm group
    while the main thread uses the default fs_shm group (docs/comm.md, threads). Several runs in a
    row, each with its own pair of groups. A rank that hangs dumps its threads' stacks and exits."""
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(_SHM_HANG_SECONDS, exit=True, file=sys.stderr)
    try:
        out = _worker(shards, backend="shm", names=("plain", "prioritized"), probe=False)
        from fstrain.distributed.env import DistEnv
        import torch.distributed as dist

        env = DistEnv(dist.get_rank(), dist.get_world_size(), dist.get_rank(), torch.device("cpu"), "shm")
        out["prioritized-again"] = [_train(shards, "prioritized", env)["loss"] for _ in range(3)]
        out["default_group"] = type(dist.group.WORLD).__name__
        return out
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.multiproc
def test_prioritized_over_shm_equal_to_non_pipelined(tmp_path):
    """The prioritized pipeline on fs_shm groups (main + background thread) equals plain training."""
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=NUM_STEPS, batch_size_per_rank=4, seed=7,
                          num_items=MODEL["num_items"])
    for r in run_ranks(_shm_worker, 2, shards):
        assert r["default_group"] == "ShmProcessGroup"
        _assert_equal_to_plain(r, "prioritized")
        for loss in r["prioritized-again"]:
            assert loss == r["prioritized"]["loss"]
