"""Pipeline choice -> model builder -> pipeline, decided before the model is built (CPU parts).

The GPU path (``--pipeline pec`` training through torchrec's ``TrainPipelinePEC``) is CUDA-marked.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from tests.fstrain.shards import write_shards
from tests.importgraph import assert_no_cycle

MODEL = dict(embedding_dim=8, num_negatives=4, num_layers=1, num_heads=1)


def test_auto_is_pec_only_where_it_runs(monkeypatch):
    import fstrain.pipelines as P

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert P.resolve_pipeline_name("auto", cpu) == "prioritized"
    for name in ("plain", "sparse-dist", "prioritized"):
        assert P.resolve_pipeline_name(name, cpu) == name
    monkeypatch.setattr(P, "pec_runs_on", lambda device: device.type == "cuda")  # a machine with CUDA
    assert P.resolve_pipeline_name("auto", cuda) == "pec"
    assert P.resolve_pipeline_name("pec", cuda) == "pec"
    assert P.resolve_pipeline_name("auto", cpu) == "prioritized"


def test_prefetch_core_check_counts_cores_ranks_and_threads(monkeypatch):
    import os

    import fstrain.pipelines as P

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # this project's 2-core machine
        assert P.prefetch_core_check(torch.device("cpu")) == (
            False, "2 CPU cores for 2 ranks x (1 torch threads + 1 prefetch thread) = 4")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
        assert P.prefetch_core_check(torch.device("cpu"))[0]
        torch.set_num_threads(8)  # 2 x (8 + 1) = 18 > 16
        assert not P.prefetch_core_check(torch.device("cpu"))[0]
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")  # unreadable: the world size (1, not initialised)
        assert P.prefetch_core_check(torch.device("cpu"))[1].startswith("16 CPU cores for 1 ranks x (8 torch")
        assert P.prefetch_core_check(torch.device("cuda", 0)) == (True, "the dense compute runs on the GPU")
    finally:
        torch.set_num_threads(threads)


def test_overlapped_prioritized_without_a_spare_core_says_inline_is_faster(monkeypatch, caplog):
    import os

    import fstrain.pipelines as P

    built = []
    monkeypatch.setattr(P.PrioritizedPipeline, "from_config", classmethod(lambda cls, config, *a: built.append(config)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level("WARNING", logger="fstrain.pipelines"):
        P.make_pipeline(P.PipelineConfig(name="prioritized"), None, None, torch.device("cpu"))
    assert "no spare CPU core for its prefetch thread (2 CPU cores for 2 ranks" in caplog.text
    assert "--no-pipeline-overlap" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fstrain.pipelines"):  # inline, or cores to spare: nothing to say
        P.make_pipeline(P.PipelineConfig(name="prioritized", overlap=False), None, None, torch.device("cpu"))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
        P.make_pipeline(P.PipelineConfig(name="prioritized"), None, None, torch.device("cpu"))
    assert caplog.text == "" and len(built) == 3


def test_pec_without_cuda_is_an_error_or_an_explicit_fallback():
    import fstrain.pipelines as P

    with pytest.raises(P.PipelineUnavailableError, match=r"^--pipeline pec runs torchrec's TrainPipelinePEC, which "
                                                         r"needs a CUDA device \(this rank has cpu\); use --pipeline "
                                                         r"prioritized"):
        P.resolve_pipeline_name("pec", torch.device("cpu"))
    assert P.resolve_pipeline_name("pec", torch.device("cpu"), pec_fallback=True) == "prioritized"
    with pytest.raises(P.PipelineError, match="unknown pipeline 'x'"):
        P.resolve_pipeline_name("x", torch.device("cpu"))


def test_pec_selects_the_pec_builder():
    from fstrain.distributed.sharding import build_sharded_model
    from fstrain.distributed.pec import build_pec_sharded_model
    from fstrain.pipelines import model_builder

    assert model_builder("pec") is build_pec_sharded_model
    for name in ("plain", "sparse-dist", "prioritized"):
        assert model_builder(name) is build_sharded_model


def test_cli_pipeline_pec_on_cpu_is_one_line_before_init(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    import torch.distributed as dist

    from fstrain.cli import main

    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=2)
    assert main(["train", shards, "--pipeline", "pec"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fstrain train: error: --pipeline pec runs torchrec's "
                                               "TrainPipelinePEC, which needs a CUDA device"), err
    assert not dist.is_initialized()


def test_train_builds_the_pec_model_when_pec_is_chosen(tmp_path, monkeypatch):
    """With pec chosen (CUDA simulated for the choice), train() builds the PEC-wrapped table and
    hands it to the PEC pipeline, which on CPU says why torchrec's cannot run."""
    import torch.distributed as dist

    import fstrain.distributed.pec
    import fstrain.pipelines as P
    from fstrain.config import from_dict
    from fstrain.train import train

    built = []
    real = fstrain.distributed.pec.build_pec_sharded_model

    def spy(*args, **kwargs):
        built.append("pec")
        return real(*args, **kwargs)

    monkeypatch.setattr(fstrain.distributed.pec, "build_pec_sharded_model", spy)
    monkeypatch.setattr(P, "pec_runs_on", lambda device: True)
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=2)
    try:
        with pytest.raises(P.PipelineUnavailableError, match="TrainPipelinePEC needs CUDA"):
            train(from_dict({"shards": shards, "model": MODEL, "pipeline.name": "pec", "comm.backend": "gloo",
                             "metrics.log_every_steps": 0}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert built == ["pec"]


def test_no_import_cycle_in_fstrain():
    """Imports between fstrain modules, lazy ones inside functions included, form no cycle."""
    root = pathlib.Path(__file__).resolve().parents[2] / "fstrain"
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fstrain"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("fstrain")}
        graph[mod] = deps
    known = set(graph)
    # explicit edges (a package's __init__ re-exporting its submodules is the usual pattern, not a cycle)
    edges = {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}
    assert_no_cycle(edges)


def test_removed_shim_paths_are_gone():
    """The re-export modules of earlier releases are removed: fstrain.pipeline -> fstrain.pipelines,
    fstrain.prioritized -> fstrain.pipelines.prioritized, fstrain.pipeline_timing ->
    fstrain.pipelines.timing, fstrain.dataset -> fstrain.data."""
    import fstrain

    root = pathlib.Path(fstrain.__file__).parent
    for old in ("pipeline", "prioritized", "pipeline_timing", "dataset"):
        assert not (root / f"{old}.py").exists(), old


@pytest.mark.gpu
def test_train_with_pec_pipeline_on_one_gpu(tmp_path):
    """``--pipeline pec`` on CUDA: torchrec's TrainPipelinePEC drives the PEC-wrapped model."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import torch.distributed as dist

    from fstrain.config import from_dict
    from fstrain.train import train

    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=6, batch_size_per_rank=4)
    try:
        res = train(from_dict({"shards": shards, "model": MODEL, "pipeline.name": "pec", "comm.backend": "nccl",
                               "metrics.log_every_steps": 0}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection

    assert isinstance(res.model.module.ec, ShardedPECEmbeddingCollection)
    assert res.summary["num_steps"] >= 1


def test_backend_auto_is_resolved_once_at_startup(tmp_path, monkeypatch):
    """``--backend auto`` is decided by one call (at the start of train); the process group, the device
    plan and the transports take the concrete name, and refuse an unresolved one."""
    import torch.distributed as dist

    import fstrain.distributed.comm as comm
    import fstrain.distributed.comm.transports as transports
    from fstrain.config import from_dict
    from fstrain.train import train

    calls = []
    real = transports.resolve_backend
    monkeypatch.setattr(transports, "resolve_backend", lambda name, **kw: calls.append(name) or real(name, **kw))
    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=2)
    try:
        train(from_dict({"shards": shards, "model": MODEL, "comm.backend": "auto", "pipeline.name": "none",
                         "metrics.log_every_steps": 0}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    concrete = "nccl" if torch.cuda.is_available() else "gloo"
    assert calls[0] == "auto" and set(calls[1:]) == {concrete}, calls  # decided once; later code has the name
    assert comm.CommConfig(backend="auto").resolved().backend == concrete
    with pytest.raises(ValueError, match="decided once, at startup"):
        comm.register_torch_backends(comm.CommConfig(backend="auto"))


def test_no_pipeline_is_the_loop_pipeline_and_train_has_one_loop_shape():
    """``--pipeline none`` is a pipeline like the others (the loop's own step, measured or plain):
    make_pipeline builds it, and train.py drives every pipeline through one loop, with no step of its own."""
    import inspect

    import fstrain.train
    from fstrain.pipelines import (LoopPipeline, PipelineConfig, PipelineError, PlainPipeline, make_pipeline,
                                   pipeline_for_run, resolve_pipeline_name)
    from fstrain.pipelines.loop import plain_step

    assert resolve_pipeline_name("none", torch.device("cpu")) == "none"
    for mode, timed in (("measured", True), ("plain", False)):
        pipe = pipeline_for_run(PipelineConfig(name="none", step_mode=mode), None, None, torch.device("cpu"))
        assert isinstance(pipe, LoopPipeline) and pipe.step_mode == mode and pipe.records_timings is timed
    with pytest.raises(PipelineError, match="pipeline_for_run builds it"):
        make_pipeline("none", None, None, torch.device("cpu"))
    assert "plain_step" in inspect.getsource(PlainPipeline._progress) and callable(plain_step)
    source = inspect.getsource(fstrain.train)
    assert not hasattr(fstrain.train, "measured_step") and not hasattr(fstrain.train, "train_step")
    for gone in ("step_mode", "if pipe:", " if pipe_name else "):
        assert gone not in source, gone
    assert source.count("pipe.steps(") == 1
