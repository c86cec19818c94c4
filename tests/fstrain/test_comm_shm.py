"""Multi-process tests: the shared-memory all-to-all-v equals gloo's, and failures never hang.

Each test spawns 2-4 CPU processes that rendezvous through a file store. Workers send back what
they measured (or the error they raised) through a queue; the parent asserts.

Deadlines: starting a rank (interpreter, torch and torchrec imports: ~14 s of CPU each) is pure
CPU work that a loaded machine can stretch several times over, so it gets its own generous
budget; the collectives get ``_RUN_TIMEOUT_SECONDS`` from the moment every rank has joined the
process group, and every collective has its own timeout (gloo ``_COLLECTIVE_TIMEOUT``, shm
``timeout_seconds``), so a real hang fails as an error, not as a slow test. A rank still running
at the deadline prints every thread's stack to stderr first; when one rank fails, the others get
``_ERROR_GRACE_SECONDS`` to report (they normally see the failure at once) before being killed.
"""

from __future__ import annotations

import faulthandler
import glob
import multiprocessing as mp
import os
import queue
import tempfile
import time
import sys
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.multiproc

_STARTUP_TIMEOUT_SECONDS = 600  # spawn + imports + rendezvous: CPU-bound, slow only under load
_RUN_TIMEOUT_SECONDS = 120  # from the moment every rank has joined its process group
_COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # gloo ops (torch's default is 30 min)
_ERROR_GRACE_SECONDS = 15

_results = None  # the worker's result queue, for `_init` to report "ready"


def _worker(rank, world_size, init_file, fn, args, results):
    global _results
    _results = results
    try:
        out = fn(rank, world_size, init_file, *args)
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - report everything, the parent decides
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world_size, fn, *args):
    """Run ``fn(rank, world_size, init_file, *args)`` in ``world_size`` processes.

    Returns:
        dict rank -> ("ok", value) or ("error", (type name, message, traceback)); a rank that
        died without reporting is missing.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out, ready, failed_at = {}, set(), None
        deadline, phase = time.monotonic() + _STARTUP_TIMEOUT_SECONDS, "startup"
        while len(out) < world_size:
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + _ERROR_GRACE_SECONDS):
                missing = sorted(set(range(world_size)) - set(out))
                print(f"_spawn: ranks {missing} did not report ({phase} deadline, or "
                      f"{_ERROR_GRACE_SECONDS} s after another rank failed); killed",
                      file=sys.stderr)
                break
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            if status == "ready":  # joined the process group
                ready.add(rank)
                if len(ready) == world_size:
                    deadline, phase = now + _RUN_TIMEOUT_SECONDS, "run"
                continue
            out[rank] = (status, value)
            if status == "error" and failed_at is None:
                failed_at = now
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def _assert_all_ok(out, world_size):
    assert sorted(out) == list(range(world_size)), f"ranks missing: {out}"
    for rank, (status, value) in out.items():
        assert status == "ok", f"rank {rank} failed:\n{value[2] if status == 'error' else value}"


def _init(rank, world_size, init_file, backend):
    """Join the default group; from then on the rank has ``_RUN_TIMEOUT_SECONDS`` to finish."""
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=_COLLECTIVE_TIMEOUT)
    # A rank that hangs shows where (every thread) before the parent kills it.
    faulthandler.dump_traceback_later(_RUN_TIMEOUT_SECONDS - 5, file=sys.stderr)
    if _results is not None:
        _results.put((rank, "ready", None))


# --------------------------------------------------------------------------------------------
# Equality with gloo


def _cases(world_size, large_rows):
    """(name, split matrix [W x W] as lists, trailing shape, dtype); same on every rank."""
    g = torch.Generator().manual_seed(1234 + world_size)
    w = world_size
    cases = []
    for i in range(3):
        m = torch.randint(0, 40, (w, w), generator=g)
        cases.append((f"random{i}", m.tolist(), (5,), torch.float32))
    m = torch.randint(0, 9, (w, w), generator=g)
    m[0, :] = 0  # rank 0 sends nothing
    m[:, w - 1] = 0  # the last rank receives nothing
    m[1 % w, 0] = 0
    cases.append(("empty_splits", m.tolist(), (3,), torch.int64))
    cases.append(("all_empty", [[0] * w for _ in range(w)], (4,), torch.float32))
    cases.append(("tiny_1d", torch.randint(0, 3, (w, w), generator=g).tolist(), (), torch.int64))
    cases.append(("bf16", torch.randint(0, 70, (w, w), generator=g).tolist(), (16,), torch.bfloat16))
    big = torch.randint(large_rows // 2, large_rows, (w, w), generator=g)
    cases.append(("large", big.tolist(), (64,), torch.float32))
    # Rank 0 sends rank 1 64 KB (4 ring chunks of 4 ranks' 16 KiB, under the single-copy threshold),
    # all else is small: ranks 0 and 1 run the Python ring loop while ranks 2 and 3 run the compiled one.
    mixed = torch.randint(0, 40, (w, w), generator=g)
    mixed[0, 1] = 2_000
    cases.append(("mixed_paths", mixed.tolist(), (8,), torch.float32))
    return cases


# Per group size: chunk bytes (small ones force many ring wrap-arounds) and rows of the "large"
# case. 2 ranks send ~37-75 MB per rank in 64 KiB chunks through 2-slot rings ("tens of MB").
_EQUALITY_SETUPS = {2: (1 << 16, 100_000), 3: (1 << 20, 8_000), 4: (1 << 14, 5_000)}


def _check_group(rank, world_size, group, gloo, cfg):
    import fstrain.distributed.comm.shm_fast as shm_fast
    from fstrain.distributed.comm import CommConfig, build_backend

    direct = build_backend(CommConfig(backend="shm", shm=cfg), group=group)
    checked, max_bytes, compiled_steps = [], 0, {}
    step = shm_fast.exchange_step

    def counted(*a):  # cases the compiled step moved (exchange_compiled looks it up per call)
        left = step(*a)
        if left >= 0:  # not "several ring chunks: the Python loop's call"
            compiled_steps[name] = compiled_steps.get(name, 0) + 1
        return left

    shm_fast.exchange_step = counted
    for name, m, trailing, dtype in _cases(world_size, _EQUALITY_SETUPS[world_size][1]):
        in_splits = m[rank]
        out_splits = [m[p][rank] for p in range(world_size)]
        x = torch.randn(sum(in_splits), *trailing).mul(1000).to(dtype) + rank
        ref = torch.empty(sum(out_splits), *trailing, dtype=dtype)
        dist.all_to_all_single(ref, x, out_splits, in_splits, group=gloo)
        got = torch.full_like(ref, -7)
        dist.all_to_all_single(got, x, out_splits, in_splits, group=group)  # the fs_shm group
        assert torch.equal(got, ref), f"W={world_size} {name}: process group differs from gloo"
        got2 = direct.all_to_all_v(x, out_splits, in_splits)
        assert torch.equal(got2, ref), f"W={world_size} {name}: ShmBackend differs from gloo"
        checked.append(name)
        max_bytes = max(max_bytes, x.numel() * x.element_size())
    shm_fast.exchange_step = step
    # Equal splits through the functional collective (the path torch.compile'd torchrec takes).
    import torch.distributed._functional_collectives as fc

    x = torch.arange(world_size * 6, dtype=torch.float32) + 100 * rank
    y = fc.wait_tensor(fc.all_to_all_single(x, None, None, group))
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x, group=gloo)
    assert torch.equal(y, ref), f"W={world_size}: functional all_to_all_single differs from gloo"
    # torchrec's pooled-embedding all-to-all (forward and backward) over the fs_shm group.
    from torchrec.distributed.comm_ops import alltoall_pooled

    batch_per_rank, dim_sum_per_rank = [3, 5, 0, 4][:world_size], [4, 6, 1, 8][:world_size]
    pooled = {}
    for name, g in (("shm", group), ("gloo", gloo)):
        torch.manual_seed(rank)
        emb = torch.randn(sum(batch_per_rank), dim_sum_per_rank[rank], requires_grad=True)
        y = alltoall_pooled(emb, batch_per_rank, dim_sum_per_rank, group=g).wait()
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        pooled[name] = (y.detach(), emb.grad)
    assert pooled["shm"][0].shape == (batch_per_rank[rank], sum(dim_sum_per_rank))
    assert torch.equal(pooled["shm"][0], pooled["gloo"][0]), "torchrec alltoall_pooled forward"
    assert torch.equal(pooled["shm"][1], pooled["gloo"][1]), "torchrec alltoall_pooled backward"
    # Other collectives are delegated to gloo on the same group.
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    assert t.item() == world_size * (world_size + 1) / 2
    dist.barrier(group=group)
    direct.close()
    return {"checked": checked, "shm_calls": group.num_shm_all_to_all, "max_bytes": max_bytes,
            "compiled": sorted(compiled_steps), "cma": direct.cma}


def _equal_to_gloo(rank, world_size, init_file):
    """Default group fs_shm over 4 ranks, then fs_shm subgroups of 2, 3 and 4 ranks."""
    from fstrain.distributed.comm import CommConfig, register_torch_backends
    from fstrain.distributed.comm.process_group import ShmProcessGroup
    from fstrain.distributed.comm.shm import ShmBackend

    _init(rank, world_size, init_file, register_torch_backends(CommConfig(backend="shm")))
    assert isinstance(dist.group.WORLD, ShmProcessGroup)
    results = {}
    for w, (chunk_bytes, _) in _EQUALITY_SETUPS.items():
        cfg = ShmBackend.Config(chunk_bytes=chunk_bytes, num_slots=2, timeout_seconds=30, cma_min_bytes=256 << 10)
        register_torch_backends(CommConfig(backend="shm", shm=cfg))  # config of the next group
        group = dist.new_group(list(range(w)), backend="fs_shm")  # every rank calls new_group
        gloo = dist.new_group(list(range(w)), backend="gloo")
        if rank < w:
            assert group.transport.config.chunk_bytes == chunk_bytes
            results[w] = _check_group(rank, w, group, gloo, cfg)
    return results


def test_shm_all_to_all_v_equals_gloo_on_2_3_4_ranks():
    before = set(glob.glob("/dev/shm/fsc-*"))
    out = _spawn(4, _equal_to_gloo)
    _assert_all_ok(out, 4)
    for rank, (_, res) in out.items():
        assert sorted(res) == [w for w in (2, 3, 4) if rank < w]
        for w, r in res.items():
            assert len(r["checked"]) == 9
            # 9 cases + functional + torchrec forward and backward: all went through shm.
            assert r["shm_calls"] == 12, r
            assert {"random0", "all_empty", "tiny_1d"} <= set(r["compiled"])
            assert ("large" in r["compiled"]) == r["cma"]  # pulled in place, else ring chunks in Python
            assert ("mixed_paths" in r["compiled"]) == (w < 4 or rank >= 2), (w, rank, r)
    assert max(out[r][1][2]["max_bytes"] for r in (0, 1)) > 30e6  # "tens of MB"
    assert set(glob.glob("/dev/shm/fsc-*")) == before, "shared-memory segments left behind"


# --------------------------------------------------------------------------------------------
# Failures: crashed, hung, absent and disagreeing peers raise within the timeout


def _try(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller checks which error it was
        return (type(e).__name__, getattr(e, "peer_rank", None), str(e), time.monotonic() - t0)
    return None


def _failures(rank, world_size, init_file, scenarios):
    from fstrain.distributed.comm import ShmBackend

    _init(rank, world_size, init_file, "gloo")
    store = dist.distributed_c10d._get_default_store()
    cfg = ShmBackend.Config(timeout_seconds=2.0, liveness_check_seconds=0.2)
    results = {}
    for scenario in scenarios:
        dist.barrier()  # gloo: scenarios do not overlap
        if scenario == "absent":  # rank 1 never joins this rendezvous
            if rank == 0:
                results[scenario] = _try(lambda: ShmBackend(store, prefix="absent", rank=0,
                                                            world_size=2, config=cfg))
            continue
        w = world_size if scenario == "crash" else 2
        if rank >= w:
            continue
        comm = ShmBackend(store, prefix=scenario, rank=rank, world_size=w, config=cfg)
        if scenario == "crash" and rank == w - 1:
            os._exit(3)  # dies after the rendezvous, before the exchange
        if scenario == "hang" and rank == 1:
            time.sleep(3.0)  # longer than rank 0's timeout: rank 0 gives up and aborts
        even = [3] * w
        splits = [3, 4] if scenario == "mismatch" and rank == 0 else even  # rank 1 expects 3
        xs = torch.ones(sum(splits), 4) * rank
        results[scenario] = _try(lambda: comm.all_to_all_v(xs, even, splits))
        comm.close()
    return results


def test_absent_mismatched_hung_and_crashed_peers_raise_within_the_timeout():
    # Ranks 0 and 1 run the 2-rank scenarios while rank 2 waits; then all 3 run "crash", where
    # rank 2 exits after the rendezvous.
    out = _spawn(3, _failures, ["absent", "mismatch", "hang", "crash"])
    assert sorted(out) == [0, 1], out  # the crashed rank never reported
    for rank in (0, 1):
        assert out[rank][0] == "ok", out[rank][1]
    r0, r1 = out[0][1], out[1][1]
    err, peer, msg, seconds = r0["absent"]
    assert err == "PeerTimeoutError" and peer == 1 and "rendezvous" in msg, r0
    assert seconds < 10
    assert r0["mismatch"] is None  # rank 0 got the 3 rows it expected
    err, peer, msg, _ = r1["mismatch"]
    assert err == "SplitMismatchError" and peer == 0, r1
    assert "expected 48 bytes" in msg and "sent 64 bytes" in msg
    err, peer, msg, seconds = r0["hang"]
    assert err == "PeerTimeoutError" and peer == 1 and "2.0 s" in msg, r0
    assert 1.9 < seconds < 5.0
    # Rank 1 arrives after rank 0 gave up: it sees rank 0's abort flag instead of waiting.
    err, peer, msg, seconds = r1["hang"]
    assert err == "PeerExitedError" and peer == 0 and "aborted" in msg, r1
    assert seconds < 1.0
    for res in (r0, r1):
        err, peer, msg, seconds = res["crash"]
        assert err == "PeerExitedError" and peer == 2 and "peer rank 2" in msg, res
        assert seconds < 2.0, f"took {seconds:.2f} s; the liveness check should beat the timeout"


# --------------------------------------------------------------------------------------------
# Doorbells: a rank blocked on its doorbell is woken by a late peer, whichever path each runs


_LATE_SECONDS = 0.3  # far beyond spin_us: the waiting rank announces its sleep and blocks
_SENTINEL_SECONDS = 8.0  # poll() timeout: a wake-up that never comes costs this much


def _late_peers(rank, world_size, init_file):
    import fstrain.distributed.comm.shm_fast as shm_fast
    from fstrain.distributed.comm import ShmBackend

    _init(rank, world_size, init_file, "gloo")
    store = dist.distributed_c10d._get_default_store()
    comms = {pulls: ShmBackend(store, prefix=f"late{pulls}", rank=rank, world_size=world_size, config=ShmBackend.Config(
        chunk_bytes=1 << 16, cma_min_bytes=256 << 10 if pulls else 1 << 40, timeout_seconds=60,
        liveness_check_seconds=_SENTINEL_SECONDS)) for pulls in (False, True)}
    step, compiled = shm_fast.exchange_step, []

    def counted(*a):
        left = step(*a)
        compiled.append(left >= 0)  # not "several ring chunks: the Python loop's call"
        return left

    shm_fast.exchange_step = counted
    # Rows rank p sends rank r (128-byte rows): one ring chunk each (compiled); a pull each (compiled:
    # the sender sleeps until the reader's acknowledgement); ranks 0 and 1 sending each other 4 ring
    # chunks (their Python loop) while rank 2 sends and receives one chunk (compiled).
    cases = {"chunk": [[4] * 3] * 3, "pull": [[8192] * 3] * 3, "mixed": [[4, 2048, 4], [2048, 4, 4], [4, 4, 4]]}
    timings = {}
    for name, m in cases.items():
        comm = comms[name == "pull"]
        inputs = [torch.arange(sum(m[p]) * 32, dtype=torch.float32).reshape(-1, 32) + 1e6 * p for p in range(3)]
        expect = torch.cat([inputs[p][sum(m[p][:rank]):sum(m[p][:rank + 1])] for p in range(3)])
        for late in range(3):
            dist.barrier()
            if rank == late:
                time.sleep(_LATE_SECONDS)
            del compiled[:]
            t0 = time.monotonic()
            y = comm.all_to_all_v(inputs[rank], [m[p][rank] for p in range(3)], m[rank])
            timings[(name, late)] = (time.monotonic() - t0, any(compiled))
            assert torch.equal(y, expect), (name, late)
    shm_fast.exchange_step = step
    for comm in comms.values():
        comm.close()
    return {"timings": timings, "cma": comms[True].cma}


def test_a_rank_blocked_on_its_doorbell_is_woken_by_a_late_peer():
    """The waiting ranks spin ``spin_us``, announce their sleep, poll once more and block in ``poll()``
    (``liveness_check_seconds`` = 8 s); the late rank's publish (or acknowledgement of a pull) must ring
    them, on the compiled path (which rings only an announced sleeper) and on the Python loop, in either
    direction between the two. A missed wake-up shows as an 8 s call."""
    out = _spawn(3, _late_peers)
    _assert_all_ok(out, 3)
    for rank in range(3):
        t = out[rank][1]["timings"]
        for (name, late), (seconds, compiled) in t.items():
            if rank != late:  # a waiting rank: it waited for the late one, then was woken
                assert 0.05 < seconds < _SENTINEL_SECONDS / 2, (rank, name, late, t)  # waited (>> spin_us), then woken
            expected = {"chunk": True, "pull": out[rank][1]["cma"], "mixed": rank == 2}[name]  # pulls: single copy
            assert compiled == expected, (rank, name, t)
