"""Run a function in several gloo processes on a free port and collect their return values.

The ranks are forked from a forkserver that imported torch, torchrec and fstrain once per pytest process
(about 5 CPU seconds per rank saved, since a spawned rank imports them again); each rank then takes the
caller's current environment and working directory, as a spawned process would.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

from tests.ports import free_port


#: Imported once by the forkserver the ranks are forked from (what every rank's function needs).
PRELOAD = ["torch", "torch.distributed", "torchrec", "fstrain.train", "tests.fstrain.multiproc"]


def _context() -> str:
    """The start method of the ranks: ``forkserver``, preloading :data:`PRELOAD` (set before its server starts)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args, env: dict, cwd: str) -> None:
    os.environ.clear()  # the caller's environment of now, not the forkserver's of when it started
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    # a rank the parent terminates (because another rank failed) prints where its threads were
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # The result is on disk: leave without interpreter finalization. Under load, C++ static
    # destructors at exit occasionally abort ("terminate called without an active exception",
    # SIGABRT while garbage-collecting) after both ranks reported ok; that teardown is not what
    # these tests check, and the abort made CI flaky.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args) -> list:
    """Run ``fn(*args)`` on ``world_size`` processes (env set for torch.distributed).

    Returns the per-rank return values; raises ``RuntimeError`` with the first rank's error.
    """
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_entry, args=(world_size, free_port(), d, fn, args, dict(os.environ), os.getcwd()),
                               nprocs=world_size, start_method=_context(), join=True)
        except mp.ProcessExitedException as e:  # a rank died: say what the others reported
            others = []
            for r in range(world_size):
                path = os.path.join(d, f"{r}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        status, value = pickle.load(f)
                    others.append(f"rank {r}: {status}" + (f"\n{value}" if status == "error" else ""))
            raise RuntimeError(f"{e}; results of the other ranks: {others or 'none written'}") from e
        results = []
        for r in range(world_size):
            with open(os.path.join(d, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    for status, value in results:
        if status == "error":
            raise RuntimeError(value)
    return [v for _, v in results]
