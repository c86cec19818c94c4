"""fs_shm process groups used from several threads (the prioritized pipeline's layout).

The prioritized pipeline runs its row exchange on a background thread over a second process
group while the main thread uses the default one. Over ``--backend shm`` both are fs_shm groups,
so their transports must run concurrently; one transport called from two threads at once must
fail clearly (`ConcurrentCollectiveError`) instead of mixing the two collectives' rings, op
numbers and doorbell, and a group closed from another thread must not pull file descriptors
from under a running collective (their numbers get reused by other groups' doorbells and gloo
sockets). One spawn of 2 ranks runs the three scenarios.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.fstrain.test_comm_shm import _assert_all_ok, _init, _spawn

pytestmark = pytest.mark.multiproc

_NUM_ITERS = 300


def _exchange_checked(group, rank, world_size, gen, big):
    """One uneven all-to-all whose received rows are checked (row value = sender rank)."""
    m = torch.randint(0, 20_000 if big else 300, (world_size, world_size), generator=gen)
    in_splits, out_splits = m[rank].tolist(), m[:, rank].tolist()
    x = torch.full((sum(in_splits), 2), float(rank))
    y = torch.full((sum(out_splits), 2), -1.0)
    dist.all_to_all_single(y, x, out_splits, in_splits, group=group)
    expected = torch.repeat_interleave(torch.arange(world_size, dtype=torch.float32),
                                       torch.tensor(out_splits))
    assert torch.equal(y[:, 0], expected) and torch.equal(y[:, 1], expected)


def _drive(group, rank, world_size, seed, done, errors):
    try:
        gen = torch.Generator().manual_seed(seed)  # same sequence on every rank
        for i in range(_NUM_ITERS):
            _exchange_checked(group, rank, world_size, gen, big=i % 10 == 0)
        done.append(seed)
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        errors.append(f"{type(e).__name__}: {e}")


def _in_thread(fn):
    """Start ``fn() -> result`` on a thread; returns (thread, box) with ``box`` = [result or error]."""
    box = []

    def run():
        t0 = time.monotonic()
        try:
            box.append(("ok", fn(), time.monotonic() - t0))
        except BaseException as e:  # noqa: BLE001
            box.append((type(e).__name__, str(e), time.monotonic() - t0))

    th = threading.Thread(target=run, name="side")
    th.start()
    return th, box


def _threads(rank, world_size, init_file):
    from fstrain.distributed.comm import CommConfig, ConcurrentCollectiveError, register_torch_backends
    from fstrain.distributed.comm.shm import ShmBackend

    # Small chunks and 2-slot rings: every big exchange wraps its rings many times.
    cfg = ShmBackend.Config(chunk_bytes=1 << 12, num_slots=2, timeout_seconds=10,
                            liveness_check_seconds=0.2)
    _init(rank, world_size, init_file, register_torch_backends(CommConfig(backend="shm", shm=cfg)))
    g1, g2, g3 = (dist.new_group(backend="fs_shm") for _ in range(3))
    out = {}

    # 1. Two groups from two threads while the main thread uses a third (and gloo on the world).
    done, errors = [], []
    threads = [threading.Thread(target=_drive, args=(g, rank, world_size, s, done, errors))
               for s, g in ((1, g1), (2, g2))]
    for th in threads:
        th.start()
    _drive(dist.group.WORLD, rank, world_size, 3, done, errors)
    for th in threads:
        th.join()
    dist.all_reduce(torch.ones(1))
    out["concurrent_groups"] = (sorted(done), errors)

    # 2. One group from two threads: the second call is refused, the running one completes.
    dist.barrier()
    x = torch.full((4, 3), float(rank))
    if rank == 0:
        th, box = _in_thread(lambda: dist.all_to_all_single(torch.empty(4, 3), x, group=g3))
        time.sleep(0.5)  # the side thread now waits in g3 for rank 1
        t0 = time.monotonic()
        try:
            dist.all_to_all_single(torch.empty(4, 3), x, group=g3)
            refused = None
        except ConcurrentCollectiveError as e:
            refused = (str(e), time.monotonic() - t0)
        th.join()
        out["same_group"] = (refused, box[0][0])
    else:
        time.sleep(1.5)  # rank 0's side thread waits meanwhile
        dist.all_to_all_single(torch.empty(4, 3), x, group=g3)
    dist.barrier()
    y = torch.empty(4, 3)
    dist.all_to_all_single(y, x, group=g3)  # the group is still in step
    out["same_group_after"] = y[:, 0].tolist()

    # 3. Closing a group while another thread runs a collective on it.
    dist.barrier()
    if rank == 0:
        th, box = _in_thread(lambda: dist.all_to_all_single(torch.empty(4, 3), x, group=g2))
        time.sleep(0.5)  # rank 1 never joins this collective
        g2.transport.close()  # what destroy_process_group / abort do
        th.join(timeout=15)
        out["close_during"] = box[0] if box else ("still running",)
    dist.barrier()
    if rank == 1:  # rank 0's transport aborted: rank 1 is told at once
        t0 = time.monotonic()
        try:
            dist.all_to_all_single(torch.empty(4, 3), x, group=g2)
            out["after_close"] = None
        except Exception as e:  # noqa: BLE001
            out["after_close"] = (type(e).__name__, time.monotonic() - t0)
    dist.barrier()
    return out


def test_shm_groups_from_several_threads():
    out = _spawn(2, _threads)
    _assert_all_ok(out, 2)
    for rank, (_, res) in out.items():
        done, errors = res["concurrent_groups"]
        assert errors == [] and done == [1, 2, 3], (rank, errors)
        assert res["same_group_after"] == [0.0, 0.0, 1.0, 1.0]
    r0, r1 = out[0][1], out[1][1]
    refused, side_status = r0["same_group"]
    assert refused is not None, "a second thread entered a running collective on the same group"
    msg, seconds = refused
    # refused at once, far below the 10 s transport timeout (slack for a loaded 2-core machine)
    assert "same shm transport" in msg and "'side'" in msg and seconds < 3.0, msg
    assert side_status == "ok", "the refused call disturbed the running collective"
    err, msg, seconds = r0["close_during"]
    assert err == "CommError" and "closed by another thread" in msg, (err, msg)
    assert seconds < 5.0  # noticed within about liveness_check_seconds, not the 10 s timeout
    err, seconds = r1["after_close"]
    assert err == "PeerExitedError" and seconds < 5.0, r1["after_close"]  # not the 10 s timeout
