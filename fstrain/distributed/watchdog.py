"""Hung and dead peer safety for training: every rank exits within the collective timeout, in one line.

Why a watchdog and not only the backends' own timeouts: a gloo collective waits its process
group's timeout (600 s by default) and then raises a multi-line ``RuntimeError``; an NCCL kernel
waits on the device; a dead peer gives each survivor a traceback. None of them says *which*
rank stopped. :class:`CollectiveWatchdog` adds, on every backend:

* a heartbeat: a daemon thread increments this rank's counter in the job's TCP store every
  ``heartbeat_seconds`` (its own store client with a short timeout). A rank stopped by SIGSTOP,
  killed, or wedged in the kernel stops beating; a rank that is merely slow keeps beating.
* progress marks: the training loop calls :meth:`CollectiveWatchdog.step` once per step; when
  no mark came for ``timeout_seconds`` the watchdog thread names the collective the main thread
  is blocked in (read from its Python stack: the innermost ``torch.distributed`` /
  ``fstrain.distributed.comm`` / torchrec ``comm_ops`` frame), finds the ranks whose heartbeat stopped, prints
  one line and ends the process (``os._exit``: a thread blocked inside a collective cannot be
  interrupted, and the interpreter's shutdown would wait for it).
* :meth:`CollectiveWatchdog.diagnose` turns an exception raised by a collective (a peer's
  socket closed, shm ``PeerExitedError``, a backend timeout) into the same one line.

Line format (one line, on stderr; shown here on two)::

    fstrain train: error: rank 1 stopped responding (no heartbeat for 6.0 s);
    rank 0 waited 10.0 s in all_reduce at step 12 (--collective-timeout-seconds 10)

The store lives in rank 0's process (or torchrun's agent): when that process stops, the store
does not answer and the line says so ("rank 0 (the store host) ...").
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import threading
import time
from types import FrameType, TracebackType

import torch.distributed as dist

from fstrain.errors import FstrainError

logger = logging.getLogger(__name__)

#: exit status of a rank that gives up on a stopped or dead peer.
PEER_FAILURE_EXIT_CODE = 3

_HB_PREFIX = "fstrain/heartbeat/"

# (file fragment, label): frames that name the collective a thread is blocked in, innermost first
_COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py",
                     "torchrec/distributed/comm_ops.py", "torchrec/distributed/dist_data.py",
                     "fstrain/distributed/comm/",
                     "torch/distributed/c10d_logger.py")
_SKIP_FUNCS = {"wrapper", "_wrapper", "__call__", "wait", "_check_single_tensor", "_check_tensor_list"}


class PeerFailureError(FstrainError):
    """A peer rank stopped responding or exited; the message is the one line to print."""


def collective_in_frames(frames: list[tuple[str, str]]) -> str | None:
    """Name of the innermost collective in a stack, or ``None``.

    Args:
        frames: ``(filename, function name)`` pairs, outermost first.

    Returns:
        The function name of the innermost frame from ``torch.distributed``, torchrec's comm ops
        or :mod:`fstrain.distributed.comm` (decorator wrappers skipped), e.g. ``all_reduce``,
        ``all_to_all_single``, ``alltoall_pooled``, ``all_to_all_v``.
    """
    hits = [func for filename, func in frames
            if any(f in filename.replace(os.sep, "/") for f in _COLLECTIVE_FILES)
            and func.rsplit(".", 1)[-1] not in _SKIP_FUNCS]
    for func in reversed(hits):  # innermost public function first: all_reduce, all_to_all_single, ...
        if not func.rsplit(".", 1)[-1].startswith("_"):
            return func
    return hits[-1] if hits else None  # e.g. KJTAllToAllTensorsAwaitable._wait_impl


def _name(code) -> str:
    return getattr(code, "co_qualname", code.co_name)  # "Class.method" (Python >= 3.11)


def _frames_of(frame: FrameType | None) -> list[tuple[str, str]]:
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, _name(frame.f_code)))
        frame = frame.f_back
    return out[::-1]


def _frames_of_traceback(tb: TracebackType | None) -> list[tuple[str, str]]:
    out = []
    while tb is not None:
        out.append((tb.tb_frame.f_code.co_filename, _name(tb.tb_frame.f_code)))
        tb = tb.tb_next
    return out


def _first_sentence(error: BaseException) -> str:
    """``Type: first sentence`` of an exception, without gloo's ``[file.cc:line]`` prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    text = text.split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def culprit_text(stale: list[int], unreachable: bool, store_host: int = 0) -> str:
    """The part of the line that names the stopped ranks.

    Args:
        stale: ranks whose heartbeat stopped.
        unreachable: the store did not answer (its host process is stopped or gone) and no
            rank was seen stale before.
        store_host: rank whose process hosts the store.
    """
    if unreachable:
        return f"rank {store_host} (the store host) stopped responding or exited (the store does not answer)"
    if not stale:
        return "no rank's heartbeat stopped (a peer is alive but did not reach the same collective)"
    ranks = ", ".join(map(str, stale))
    return f"rank{'s' if len(stale) > 1 else ''} {ranks} stopped responding or exited (no heartbeat)"


class CollectiveWatchdog:
    """Heartbeat + progress watchdog of one rank (see the module doc).

    Args:
        rank: this rank.
        world_size: ranks in the job.
        timeout_seconds: no progress mark for this long -> diagnose, print one line, exit.
        heartbeat_seconds: heartbeat period (stale after 3 periods without a change).
        store: a store shared by the ranks; default: a new TCP store client on
            ``MASTER_ADDR:MASTER_PORT`` with a short timeout.
        exit_on_timeout: end the process on timeout (``False``: only log, for tests).
        prog: prefix of the printed line.
    """

    def __init__(self, rank: int, world_size: int, timeout_seconds: float, *, heartbeat_seconds: float = 1.0,
                 store: dist.Store | None = None, exit_on_timeout: bool = True, prog: str = "fstrain train") -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        self.rank, self.world_size, self.timeout_seconds = rank, world_size, float(timeout_seconds)
        self.heartbeat_seconds = min(heartbeat_seconds, self.timeout_seconds / 4)
        self.exit_on_timeout, self.prog = exit_on_timeout, prog
        self._store = store
        self._store_timeout = max(1.0, min(5.0, self.timeout_seconds / 2))
        self._main = threading.main_thread()
        self._step = -1
        self._last_mark = time.monotonic()
        self._beats = 0
        self._lock = threading.Lock()
        self._t_start = self._last_read = time.monotonic()
        self._seen: dict[int, str] = {}
        self._last_change: dict[int, float] = {}
        self._stop = threading.Event()
        self._diagnosing = False
        self.fired: str | None = None
        self._thread = threading.Thread(target=self._run, name="fstrain-watchdog", daemon=True)

    # ----------------------------------------------------------------- public
    def start(self) -> CollectiveWatchdog:
        """Start the heartbeat/watchdog thread (returns self)."""
        if self._store is None:
            self._store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                        int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=datetime.timedelta(seconds=self._store_timeout),
                                        wait_for_workers=False)
        self._beat()
        self._thread.start()
        return self

    def step(self, step: int) -> None:
        """Progress mark: the training loop reached ``step`` (resets the timeout)."""
        self._step = step
        self._last_mark = time.monotonic()

    def mark(self) -> None:
        """Progress mark without a new step (e.g. after a long checkpoint)."""
        self._last_mark = time.monotonic()

    def stop(self) -> None:
        """Stop the thread (call before tearing down the process group)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._store_timeout)

    def diagnose(self, error: BaseException | None = None, waited_seconds: float | None = None, *,
                 stale: tuple[list[int], bool] | None = None) -> str:
        """The one line for a peer failure (blocks up to ~3 heartbeat periods to see who stopped).

        Args:
            error: the exception a collective raised (its traceback names the collective), or
                ``None`` when the main thread is still blocked (its stack names it).
            waited_seconds: how long this rank has waited (timeout case).
            stale: a :meth:`_stale_ranks` result already taken (else taken here).
        """
        if error is not None:
            frames = _frames_of_traceback(error.__traceback__)
        else:
            frames = _frames_of(sys._current_frames().get(self._main.ident))
        collective = collective_in_frames(frames) or "a collective"
        stale, unreachable = stale if stale is not None else self._stale_ranks()
        where = f"rank {self.rank} was in {collective} at step {max(self._step, 0)}"
        if waited_seconds is not None:
            where = (f"rank {self.rank} waited {waited_seconds:.1f} s in {collective} at step {max(self._step, 0)} "
                     f"(--collective-timeout-seconds {self.timeout_seconds:g})")
        cause = f" ({_first_sentence(error)})" if error is not None else ""
        return f"{culprit_text(stale, unreachable)}; {where}{cause}"

    def peer_failure(self, error: BaseException) -> str | None:
        """:meth:`diagnose` for an exception if it came from a collective or a peer stopped, else ``None``.

        ``None`` means the error is this rank's own (not raised inside a collective, every peer
        alive): the caller re-raises it unchanged.
        """
        from fstrain.distributed.comm.base import CommError

        self._diagnosing = True  # the watchdog thread must not read this thread's stack meanwhile
        in_collective = isinstance(error, CommError) or collective_in_frames(
            _frames_of_traceback(error.__traceback__)) is not None
        stale, unreachable = self._stale_ranks()
        if not in_collective and not stale and not unreachable:
            return None
        line = self.diagnose(error, stale=(stale, unreachable))
        self.linger_as_store_host()
        return line

    def linger_as_store_host(self) -> None:
        """On rank 0 (the TCP store lives in its process), stay up 3.5 heartbeat periods before the
        caller exits, so peers diagnosing the same failure can still read the heartbeats and name
        the rank that stopped, not the store host (seen under load: rank 0 exited first and rank 2
        of 3 blamed it for rank 1's SIGKILL). No-op elsewhere and in a world of 2."""
        if self.rank == 0 and self.world_size > 2:
            deadline = time.monotonic() + 3.5 * self.heartbeat_seconds
            while time.monotonic() < deadline:
                self._beat()
                time.sleep(self.heartbeat_seconds / 2)

    # --------------------------------------------------------------- internals
    def _key(self, rank: int) -> str:
        return f"{_HB_PREFIX}{rank}"

    def _beat(self) -> bool:
        self._beats += 1
        try:
            self._store.set(self._key(self.rank), f"{self._beats} {self._step}")
            return True
        except Exception:  # noqa: BLE001 - the store host is gone or stopped
            return False

    def _read_beats(self) -> dict[int, str] | None:
        try:
            keys = [self._key(r) for r in range(self.world_size)]
            vals = self._store.multi_get(keys) if hasattr(self._store, "multi_get") else [
                self._store.get(k) for k in keys]
            return {r: v.decode() for r, v in enumerate(vals)}
        except Exception:  # noqa: BLE001
            return None

    def _observe(self) -> bool:
        """Read every rank's heartbeat and note when each last changed; ``False``: the store is silent."""
        beats = self._read_beats()
        with self._lock:
            now = time.monotonic()
            if beats is None:
                return False
            for r, v in beats.items():
                if self._seen.get(r) != v:
                    self._seen[r] = v
                    self._last_change[r] = now
            self._last_read = now
            return True

    def _stale_ranks(self) -> tuple[list[int], bool]:
        """Ranks whose heartbeat has not changed for 2.5 periods, watched for up to 3 periods (this
        rank keeps beating meanwhile); ``unreachable``: the store went silent. Ranks seen stale
        before the store went silent are still named (the store host may exit after them)."""
        deadline = time.monotonic() + 3 * self.heartbeat_seconds
        unreachable = False
        while True:
            self._beat()  # peers diagnosing at the same time must see this rank alive
            if not self._observe():
                unreachable = True
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(self.heartbeat_seconds / 2)
        with self._lock:
            ref = self._last_read
            stale = sorted(r for r in range(self.world_size)
                           if r != self.rank
                           and ref - self._last_change.get(r, self._t_start) > 2.5 * self.heartbeat_seconds)
        return stale, unreachable and not stale

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            self._beat()
            self._observe()
            waited = time.monotonic() - self._last_mark
            if waited > self.timeout_seconds and self.fired is None and not self._diagnosing:
                line = self.diagnose(waited_seconds=waited)
                self.fired = line
                if self.exit_on_timeout:
                    print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)
                    self.linger_as_store_host()
                    os._exit(PEER_FAILURE_EXIT_CODE)
                logger.error("%s", line)


class PeerGuard:
    """Holds the :class:`CollectiveWatchdog` of a run once the process group exists (none on one rank)."""

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self.watchdog = None
        self.stepping = False  # set by fstrain.train once the first step starts

    def start(self, env) -> None:
        if env.world_size > 1 and self.timeout_seconds > 0 and "MASTER_PORT" in os.environ:
            self.watchdog = CollectiveWatchdog(env.rank, env.world_size, self.timeout_seconds).start()

    def step(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.step(step)

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()


__all__ = ["PEER_FAILURE_EXIT_CODE", "CollectiveWatchdog", "PeerFailureError", "PeerGuard", "collective_in_frames",
           "culprit_text"]
