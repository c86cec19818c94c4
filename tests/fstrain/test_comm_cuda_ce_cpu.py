"""CPU-testable parts of the cuda-ce backend: names, flags, topology, agreement, split errors.

The copy-engine data path itself needs GPUs (tests/fstrain/test_comm_cuda_ce.py, CUDA-marked).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.fstrain.multiproc import run_ranks
from tests.fstrain.shards import write_shards


def test_one_backend_table_everywhere():
    from fstrain.distributed import backends, env as fdist
    from fsdata.common.cli import action_choices
    from fstrain.cli import build_parser
    from fstrain.distributed.comm import BACKEND_NAMES, CommConfig

    assert BACKEND_NAMES == backends.BACKEND_NAMES == ("gloo", "nccl", "shm", "cuda-ce")
    assert fdist.BACKENDS == ("auto", *BACKEND_NAMES)
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    (backend_action,) = [a for a in train._actions if "--backend" in a.option_strings]
    assert action_choices(backend_action) == fdist.BACKENDS
    for name in BACKEND_NAMES:
        CommConfig(backend=name)
    assert fdist.planned_device("cuda-ce").type == "cuda" and fdist.planned_device("shm").type == "cpu"


def test_backends_are_one_registry():
    """``--backend`` names, devices, the torch backend registered and the transport built come from
    COMM_BACKENDS; a transport registered there is a choice of CommConfig and what build_backend builds."""
    from fstrain.distributed.comm import COMM_BACKENDS, CommConfig, Transport, build_backend, register_torch_backends

    assert tuple(COMM_BACKENDS) == ("gloo", "nccl", "shm", "cuda-ce")
    assert {n: COMM_BACKENDS.get(n).device for n in COMM_BACKENDS} == {"gloo": "cpu", "nccl": "cuda", "shm": "cpu",
                                                                       "cuda-ce": "cuda"}
    built = []

    @COMM_BACKENDS.register("test-loop")
    class Loop(Transport):
        """A test transport."""

        @classmethod
        def build(cls, config, *, store, rank, world_size, group):
            built.append((rank, world_size))
            return "loop"

    try:
        cfg = CommConfig(backend="test-loop")
        assert register_torch_backends(cfg) == "test-loop"
        assert build_backend(cfg, rank=0, world_size=1) == "loop" and built == [(0, 1)]
    finally:
        COMM_BACKENDS.unregister("test-loop")
    with pytest.raises(ValueError, match="unknown comm backend 'test-loop'"):
        CommConfig(backend="test-loop")


def test_register_cuda_ce_is_its_own_process_group_backend():
    from fstrain.distributed.comm import CommConfig, register_torch_backends

    name = register_torch_backends(CommConfig(backend="cuda-ce"))
    assert name == "fs_cuda_ce"  # no longer plain "nccl": the all-to-all is ours
    assert dist.Backend.FS_CUDA_CE == "fs_cuda_ce"


def test_train_backend_cuda_ce_without_cuda_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from fstrain.cli import main

    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=2)
    assert main(["train", shards, "--backend", "cuda-ce", "--pipeline", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("fstrain train: error: --backend cuda-ce needs a CUDA device and none is visible; "
                       "use --backend gloo or shm")


def test_topology_by_device_uuid():
    from fstrain.distributed.comm.cuda_ce import copy_engine_reason

    visible = ["GPU-a", "GPU-b"]
    yes = lambda i, j: True  # noqa: E731
    assert copy_engine_reason(0, ["GPU-a", "GPU-b"], visible, yes) is None
    # per-process CUDA_VISIBLE_DEVICES: each process sees only its GPU, index 0 in both
    assert "rank 1's GPU GPU-b is not visible" in copy_engine_reason(0, ["GPU-a", "GPU-b"], ["GPU-a"], yes)
    # another node: same index, different UUID
    assert "not visible" in copy_engine_reason(0, ["GPU-a", "GPU-z"], visible, yes)
    assert "no peer access from cuda:0 to rank 1's GPU (cuda:1)" == copy_engine_reason(
        0, ["GPU-a", "GPU-b"], visible, lambda i, j: False)
    # two processes sharing one GPU need no peer access
    assert copy_engine_reason(0, ["GPU-a", "GPU-a"], visible, lambda i, j: False) is None


def test_split_mismatch_message_names_every_bad_pair():
    from fstrain.distributed.comm.cuda_ce import split_mismatch_message

    send = [[0, 8, 16], [4, 0, 0], [0, 0, 0]]
    recv = [[0, 4, 0], [8, 0, 0], [16, 0, 0]]  # recv[q][p]: q expects from p
    assert split_mismatch_message(send, recv) is None
    recv[2][0] = 24
    msg = split_mismatch_message(send, recv)
    assert msg.startswith("all-to-all split sizes disagree across ranks: rank 0 sends 16 bytes to rank 2, "
                          "which expects 24;")


def _agreement_worker(fake_ok_rank1: bool):
    """Each rank: a fake local capability; one all-reduce decides. Then a split-size exchange of
    the rows every rank holds after the metadata step, checked on every rank."""
    from fstrain.distributed.comm.cuda_ce import agree, split_mismatch_message

    dist.init_process_group("gloo")
    rank, w = dist.get_rank(), dist.get_world_size()
    agreed = agree(True if rank == 0 else fake_ok_rank1, None, torch.device("cpu"))
    send = [8 * (rank + 1)] * w
    recv = [8 * (p + 1) for p in range(w)]
    if rank == 1:
        recv[0] = 999  # rank 1 expects the wrong size from rank 0
    rows = [None] * w
    dist.all_gather_object(rows, send + recv)
    message = split_mismatch_message([r[:w] for r in rows], [r[w:] for r in rows])
    return agreed, message


@pytest.mark.multiproc
@pytest.mark.parametrize("fake_ok_rank1", [True, False])
def test_capability_and_split_errors_agree_over_gloo(fake_ok_rank1):
    out = run_ranks(_agreement_worker, 2, fake_ok_rank1)
    assert [a for a, _ in out] == [fake_ok_rank1, fake_ok_rank1]
    assert out[0][1] == out[1][1] is not None
    assert "rank 0 sends 8 bytes to rank 1, which expects 999" in out[0][1]
