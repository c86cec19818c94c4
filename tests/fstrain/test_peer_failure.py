"""Hung and dead peers: every other rank exits within --collective-timeout-seconds, in one line.

Each test launches ``python -m fstrain.cli train`` once per rank (the environment torchrun would
set, without torchrun's agent, which would kill the survivors itself), waits until training
runs, then stops (SIGSTOP) or kills (SIGKILL) one rank and checks what the others print.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.ports import free_port
from tests.fstrain.shards import write_shards

TIMEOUT_SECONDS = 8
MODEL_FLAGS = ["--embedding-dim", "8", "--num-layers", "1", "--num-heads", "1", "--num-negatives", "4",
               "--max-seq-len", "16"]


def _launch(shards: str, world_size: int, backend: str, log_dir) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "fstrain.cli", "train", shards, "--backend", backend, "--pipeline", "none",
               "--log-every-steps", "1", "--collective-timeout-seconds", str(TIMEOUT_SECONDS), *MODEL_FLAGS]
        err = open(log_dir / f"rank{rank}.err", "w+")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True))
        procs[-1].err_file = err  # type: ignore[attr-defined]
    return procs


def _stderr(p: subprocess.Popen) -> str:
    p.err_file.seek(0)  # type: ignore[attr-defined]
    return p.err_file.read()  # type: ignore[attr-defined]


def _wait_training(procs, deadline_seconds: float = 240.0) -> None:
    """Until rank 0 has logged two steps (every rank is inside the step loop)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_seconds:
        if len(re.findall(r"step \d+ loss", _stderr(procs[0]))) >= 2:
            return
        if any(p.poll() is not None for p in procs):
            pytest.fail("a rank ended before training ran:\n" + "\n".join(_stderr(p)[-2000:] for p in procs))
        time.sleep(0.2)
    pytest.fail("training did not start in time:\n" + _stderr(procs[0])[-2000:])


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("fstrain train: error:")]


def _cleanup(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()
        p.err_file.close()  # type: ignore[attr-defined]


def _check_one_line(text: str, culprit: int) -> str:
    lines = _error_lines(text)
    assert len(lines) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    line = lines[0]
    assert re.search(rf"\branks? (?:\d+, )*{culprit}\b", line), line
    assert re.search(r"at step \d+", line), line
    assert re.search(r" in \w+", line), line
    return line


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_stopped_peer_makes_the_other_rank_exit_within_the_timeout(tmp_path, backend):
    shards = write_shards(str(tmp_path / "s"), num_ranks=2, num_steps=4000, batch_size_per_rank=2, seed=1,
                          max_len=8, steps_per_row_group=50)
    procs = _launch(shards, 2, backend, tmp_path)
    try:
        _wait_training(procs)
        os.kill(procs[1].pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        rc = procs[0].wait(timeout=TIMEOUT_SECONDS + 40)
        elapsed = time.monotonic() - t_stop
        text = _stderr(procs[0])
        assert rc == 3, text[-3000:]
        line = _check_one_line(text, culprit=1)
        assert "stopped responding" in line
        # the timeout plus the heartbeat check (3 periods) and slack for a loaded machine
        assert elapsed < TIMEOUT_SECONDS + 25, (elapsed, line)
    finally:
        _cleanup(procs)


@pytest.mark.multiproc
def test_killed_peer_every_survivor_prints_one_line(tmp_path):
    shards = write_shards(str(tmp_path / "s"), num_ranks=3, num_steps=4000, batch_size_per_rank=2, seed=2,
                          max_len=8, steps_per_row_group=50)
    procs = _launch(shards, 3, "gloo", tmp_path)
    try:
        _wait_training(procs)
        os.kill(procs[1].pid, signal.SIGKILL)
        for r in (0, 2):
            rc = procs[r].wait(timeout=TIMEOUT_SECONDS + 40)
            text = _stderr(procs[r])
            assert rc == 3, text[-3000:]
            _check_one_line(text, culprit=1)
    finally:
        _cleanup(procs)


# ---------------------------------------------------------------- in-process parts of the watchdog
def test_collective_in_frames_prefers_the_innermost_public_collective():
    from fstrain.distributed.watchdog import collective_in_frames

    frames = [("/x/fstrain/train.py", "_train"), ("/v/torchrec/distributed/dist_data.py", "Awaitable._wait_impl"),
              ("/v/torch/distributed/c10d_logger.py", "wrapper"),
              ("/v/torch/distributed/distributed_c10d.py", "all_to_all_single")]
    assert collective_in_frames(frames) == "all_to_all_single"
    assert collective_in_frames(frames[:2]) == "Awaitable._wait_impl"
    assert collective_in_frames(frames[:1]) is None


def test_culprit_text_and_first_sentence():
    from fstrain.distributed.watchdog import _first_sentence, culprit_text

    assert culprit_text([2], False).startswith("rank 2 stopped responding")
    assert culprit_text([1, 3], False).startswith("ranks 1, 3 stopped")
    assert "rank 0 (the store host)" in culprit_text([], True)
    err = RuntimeError("[/a/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6018: Connection reset by peer. "
                       "This is typically caused by a remote peer\nmore")
    assert _first_sentence(err) == "RuntimeError: Read error [127.0.0.1]:6018: Connection reset by peer"


def test_watchdog_names_the_rank_whose_heartbeat_stopped():
    """Two watchdogs on one store; rank 1's heartbeat thread stops (as under SIGSTOP); rank 0 stops
    making progress: rank 0's watchdog fires within the timeout and names rank 1."""
    import torch.distributed as dist

    from fstrain.distributed.watchdog import CollectiveWatchdog

    store = dist.HashStore()
    w0 = CollectiveWatchdog(0, 2, 1.0, heartbeat_seconds=0.1, store=store, exit_on_timeout=False).start()
    w1 = CollectiveWatchdog(1, 2, 60.0, heartbeat_seconds=0.1, store=store, exit_on_timeout=False).start()
    try:
        w0.step(5)
        time.sleep(0.3)
        w1.stop()  # rank 1 is "stopped": no more heartbeats
        t0 = time.monotonic()
        while w0.fired is None and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert w0.fired is not None
        assert w0.fired.startswith("rank 1 stopped responding"), w0.fired
        assert "at step 5" in w0.fired and "--collective-timeout-seconds 1" in w0.fired
    finally:
        w0.stop()
        w1.stop()


def test_watchdog_leaves_a_rank_s_own_errors_alone():
    import torch.distributed as dist

    from fstrain.distributed.watchdog import CollectiveWatchdog

    store = dist.HashStore()
    ws = [CollectiveWatchdog(r, 2, 60.0, heartbeat_seconds=0.05, store=store, exit_on_timeout=False).start()
          for r in range(2)]
    try:
        try:
            raise RuntimeError("shape mismatch in my own code")
        except RuntimeError as e:
            assert ws[0].peer_failure(e) is None
    finally:
        for w in ws:
            w.stop()


def test_collective_timeout_flag_is_validated(tmp_path, capsys):
    from fstrain.cli import main

    shards = write_shards(str(tmp_path / "s"), num_ranks=1, num_steps=2, batch_size_per_rank=2)
    assert main(["train", shards, "--collective-timeout-seconds", "0"]) == 2
    assert "--collective-timeout-seconds must be > 0, got 0.0" in capsys.readouterr().err
