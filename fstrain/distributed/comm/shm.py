"""Shared-memory all-to-all-v between the processes of one node (the CPU "SM-free" path).

Each rank owns one segment in ``/dev/shm``. It holds one bounded ring per sender: ``num_slots``
slots of ``chunk_bytes`` payload plus a 64-byte slot header, and two counters on separate cache
lines: ``write_seq`` (advanced by the sender after its memcpy) and ``read_seq`` (advanced by the
receiver after copying the chunk out). A sender memcpys a chunk straight into the receiver's
mapped ring; no socket carries data (single producer, single consumer, no locks).

One call moves every pair's message as a stream of chunks, served round-robin over peers (a large
message to one peer holds up a small one to another by at most one chunk). Every message is at
least one chunk (an empty one is header-only) whose header carries the op sequence number and the
total byte count; the receiver checks both, so desynchronised collectives and disagreeing split
sizes raise `SplitMismatchError` instead of corrupting data. A call whose messages are each one chunk
or a pull (below) runs its exchange loop compiled (`shm_fast`, the same chunks); others run it here.

Single copy (``Config.cma``, where every rank's start-up probe of ``process_vm_readv`` succeeds): a
message of at least ``cma_min_bytes`` is one header-only "pull" chunk carrying its address in the
sender; the receiver reads the rows straight from the sender's input into its output (one copy per
byte, not two), ``chunk_bytes`` per pass, then advances ``read_seq``, which the sender waits for
before returning (its input may change after that). Otherwise the rings alone (copy-in/copy-out).

Waiting spins briefly (``spin_us``), then blocks in ``poll()`` on the rank's *doorbell*, a FIFO next
to its segment, after announcing it (a flag, then one more poll): whoever advances a counter a peer may
wait on writes one byte to that peer's doorbell (the compiled path only if the peer announced), so a
sleeping rank wakes at once without burning a core when ranks outnumber cores. If
no chunk moves for ``timeout_seconds`` the call raises `PeerTimeoutError` naming the peer; a peer
whose process exited or aborted its transport is reported sooner as `PeerExitedError`.

Memory ordering: the Python path relies on x86-64's total store order to publish the payload
before the counter (the backend warns on other CPUs); the compiled path uses acquire/release atomics.

Threads: one collective at a time per transport; a call from a second thread while one runs raises
`ConcurrentCollectiveError` (serialising them would not do: every rank would have to order them
alike). Give each thread its own process group; groups share nothing and run concurrently.
``close()`` from another thread during a collective releases nothing under it: the running call
notices within ``liveness_check_seconds``, raises, and releases the segments and descriptors itself
(a descriptor closed under it could be reused by another doorbell or a gloo socket).

Segments are unlinked once every rank has mapped them: nothing is left in ``/dev/shm`` after the
processes exit, even after a crash (except a crash inside the rendezvous itself).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import math
import os
import platform
import select
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from fsdata.guards import process_alive
from fstrain.distributed.comm.base import (BackendUnavailableError, CommBackend, CommError, ConcurrentCollectiveError,
                                           PeerExitedError, PeerTimeoutError, SplitMismatchError, allocate_output,
                                           check_splits)
from fstrain.distributed.comm.shm_cma import PeerReader, agree, probe_peer, start_probe
from fstrain.distributed.comm.shm_segment import (_MAGIC, _H_MAGIC, _H_ABORTED, _profiling, segment_bytes, num_chunks,
                                                  _ring_index, _node_id, _Segment, store_get, wait_for_bell)

_memmove = ctypes.memmove
_PULL = -1  # chunk index of a header-only chunk whose last field is the message's address

logger = logging.getLogger(__name__)

class ShmBackend(CommBackend):
    """All-to-all-v through shared-memory rings between the processes of one node.

    Rendezvous goes through a ``torch.distributed.Store`` (names of the segments, node identity);
    data never does. Build one per process group. One collective at a time: a call from a second
    thread while one runs raises `ConcurrentCollectiveError`; transports of different groups can
    be used from different threads at once.
    """

    name = "shm"

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of the shared-memory transport."""

        chunk_bytes: int = 1 << 20
        """Payload bytes per ring slot (multiple of 64). Larger chunks raise bandwidth for big
        messages; smaller ones bound how long an urgent small transfer can wait behind a bulk one
        (one chunk per ring) and the memory used."""
        num_slots: int = 4
        """Slots per ring (>= 2): how many chunks a sender may run ahead of its receiver. Memory
        per rank is about ``(world_size - 1) * num_slots * chunk_bytes``."""
        timeout_seconds: float = 60.0
        """Seconds without progress before `PeerTimeoutError` (also bounds the rendezvous)."""
        shm_dir: str = field(default="/dev/shm", metadata={"flag": "--shm-dir"})
        """Directory of a memory-backed filesystem for the segments (tmpfs)."""
        spin_us: int = 50
        """Microseconds of busy polling before blocking on the doorbell. Longer spins cut latency
        on dedicated cores; shorter ones save CPU when ranks outnumber cores. (``sched_yield``
        is not used: on a loaded node it gives the core away for a whole time slice, measured
        7 ms.)"""
        liveness_check_seconds: float = 0.5
        """While stalled, how often to check whether a peer process exited or aborted."""
        cma: bool = True
        """Single copy: a receiver reads a peer's rows straight from the peer's input tensor with Linux
        cross-memory attach (``process_vm_readv``) where every rank's start-up probe succeeds, else the
        rings (two copies). False: the rings only. ``ShmBackend.data_path`` tells which one runs."""
        cma_min_bytes: int = 1 << 20
        """Messages (one sender to one receiver) of at least this many bytes take the single-copy path,
        read in pieces of ``chunk_bytes``; smaller ones go through the ring, whose sender need not wait
        for the reader (measured crossover on a 2-core VM, both compiled: between 512 KiB, rings 0.78-0.91x
        the single-copy time, and 2 MiB; with the default ``chunk_bytes`` every message is then one ring
        chunk or a pull, so every call runs compiled)."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        config: ShmBackend.Config | None = None,
        prefix: str = "fs_shm",
    ):
        """Create this rank's segment and map every peer's (a collective over the store).

        Args:
            store: a store shared by the group (e.g. the one behind ``init_process_group``).
            rank: this rank in the group.
            world_size: ``W``, number of ranks in the group.
            config: transport settings; defaults to `ShmBackend.Config()`.
            prefix: store key prefix; must be unique per group built on the same store.

        Raises:
            ValueError: a setting is out of range.
            BackendUnavailableError: ranks are on different nodes or ``shm_dir`` is unusable.
            PeerTimeoutError: a peer did not join within ``timeout_seconds``.
        """
        super().__init__(rank=rank, world_size=world_size)
        cfg = config or ShmBackend.Config()
        if cfg.chunk_bytes < 64 or cfg.chunk_bytes % 64:
            raise ValueError(f"chunk_bytes={cfg.chunk_bytes} must be a positive multiple of 64")
        if cfg.num_slots < 2:
            raise ValueError(f"num_slots={cfg.num_slots} must be at least 2")
        if cfg.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds={cfg.timeout_seconds} must be positive")
        if cfg.cma_min_bytes < 0:
            raise ValueError(f"cma_min_bytes={cfg.cma_min_bytes} must be >= 0")
        if not os.path.isdir(cfg.shm_dir):
            raise BackendUnavailableError(f"shm_dir {cfg.shm_dir} does not exist; set Config.shm_dir")
        if platform.machine().lower() not in ("x86_64", "amd64"):
            warnings.warn(
                f"shm backend relies on x86-64 store ordering; on {platform.machine()} chunks may "
                "be read before they are fully written", stacklevel=2)
        self.config = cfg
        self._op_seq = 0
        self._closed = False
        # Held by the thread running a collective; close() from another thread then only asks.
        self._busy = threading.Lock()
        self._busy_thread = ""
        self._close_requested = False
        self._sleeping = False  # announced to the peers: they ring my doorbell (shm_fast.announce_sleep)
        self._seqs = np.zeros((2, world_size), np.int64)  # shared with the compiled exchange (shm_fast)
        self._sent, self._received = self._seqs  # chunks published to each peer's ring / consumed from each
        self._peers: list[_Segment | None] = [None] * world_size
        self._peer_pids = [0] * world_size
        self._peer_bells = [-1] * world_size  # write ends of the peers' doorbell FIFOs
        self._bell = -1  # read end of this rank's doorbell
        self._own: _Segment | None = None
        self._unlinked = False
        #: single copy (process_vm_readv) in use for messages >= cma_min_bytes; else cma_reason says why not
        self.cma, self.cma_reason, self._probe, self._reader = False, None, None, None
        size = segment_bytes(world_size, cfg.chunk_bytes, cfg.num_slots)
        path = os.path.join(cfg.shm_dir, f"fsc-{uuid.uuid4().hex[:16]}-r{rank}")
        self._path = path
        seg_args = dict(size=size, world_size=world_size, chunk=cfg.chunk_bytes, slots=cfg.num_slots)
        with record_function("## shm_rendezvous ##"):
            try:
                self._own = _Segment(path, create=True, **seg_args)
                self._own.header[:6] = (_MAGIC, os.getpid(), world_size, cfg.chunk_bytes,
                                        cfg.num_slots, 0)
                os.mkfifo(path + ".bell", 0o600)
                self._bell = os.open(path + ".bell", os.O_RDWR | os.O_NONBLOCK)
                self._poller = select.poll()
                self._poller.register(self._bell, select.POLLIN)
                self._reader, self._probe, local_cma = start_probe(store, f"{prefix}/cma/{rank}", world_size,
                                                                   cfg.cma)
                store.set(f"{prefix}/seg/{rank}", f"{path}|{_node_id()}|{os.getpid()}")
                me = _node_id()
                for p in range(world_size):
                    if p == rank:
                        continue
                    peer_path, rest = store_get(store, cfg.timeout_seconds, f"{prefix}/seg/{p}", p).split("|", 1)
                    node, pid = rest.rsplit("|", 1)
                    if node != me:
                        raise BackendUnavailableError(
                            f"shm backend needs all ranks on one node: rank {rank} is on {me}, "
                            f"rank {p} on {node}; across nodes use the fs_shm process group (hierarchical: shm "
                            "inside a node, gloo across) or backend 'gloo'")
                    try:
                        self._peers[p] = _Segment(peer_path, create=False, **seg_args)
                        self._peer_bells[p] = os.open(peer_path + ".bell",
                                                      os.O_WRONLY | os.O_NONBLOCK)
                    except OSError as e:
                        if e.errno not in (errno.ENOENT, errno.ENXIO):  # ENXIO: no FIFO reader
                            raise BackendUnavailableError(
                                f"cannot map rank {p}'s segment {peer_path}: {e}") from e
                        raise PeerExitedError(peer_rank=p, detail=f"its segment {peer_path} is "
                                              f"gone ({e}); it left the rendezvous") from e
                    if int(self._peers[p].header[_H_MAGIC]) != _MAGIC:
                        raise BackendUnavailableError(f"{peer_path} is not an fstrain shm segment")
                    self._peer_pids[p] = int(pid)
                    if local_cma is None:
                        local_cma = probe_peer(int(pid), store_get(store, cfg.timeout_seconds, f"{prefix}/cma/{p}", p))
                store.set(f"{prefix}/mapped/{rank}", "cma" if local_cma is None else f"copy:{local_cma}")
                reasons = {p: store_get(store, cfg.timeout_seconds, f"{prefix}/mapped/{p}", p)
                           for p in range(world_size) if p != rank}
                self.cma, self.cma_reason = agree(rank, world_size, local_cma, reasons)
            except BaseException:
                self._unlink()
                self._abort_and_release()
                raise
            self._unlink()
        from fstrain.distributed.comm.shm_fast import announce_sleep, attach, exchange_compiled  # numba: when used

        self._exchange_compiled, self._announce_sleep = exchange_compiled, announce_sleep
        attach(self)  # every call tries the compiled loop first (shm_fast)
        logger.debug("rank %d: shm segments mapped (%d bytes each)", rank, size)

    @property
    def data_path(self) -> str:
        """``"cma"`` (single copy for messages >= ``cma_min_bytes``) or ``"copy"`` (rings only)."""
        return "cma" if self.cma else "copy"

    def _unlink(self) -> None:
        if self._unlinked:
            return
        self._unlinked = True
        for path in (self._path, self._path + ".bell"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _abort_and_release(self) -> None:
        if self._own is not None:
            self._own.header[_H_ABORTED] = 1
            for p in range(self.world_size):
                self._ring(p)  # wake waiting peers so they see the abort flag now
        self._release()

    def _ring(self, peer: int) -> None:
        """Wake ``peer`` if it waits on its doorbell (a full FIFO already means "wake up")."""
        if self._peer_bells[peer] >= 0:
            try:
                os.write(self._peer_bells[peer], b"\x01")
            except (BlockingIOError, BrokenPipeError):
                pass

    def _stall(self, op: int, waiting: list[int], last_progress: float, last_liveness: float) -> float:
        """Sleep on the doorbell (at most ``liveness_check_seconds``), then check the ``waiting`` peers are alive
        (that often; returns the last check's time). The first call only announces the sleep (peers ring a
        sleeper only, `shm_fast.announce_sleep`; cleared on progress): the caller polls once more, then blocks.
        Raises CommError (closed meanwhile), PeerExitedError."""
        cfg = self.config
        if not self._sleeping:
            self._announce_sleep(self, True)
            return last_liveness
        left_seconds = cfg.timeout_seconds - (time.monotonic() - last_progress)
        wait_for_bell(self._poller, self._bell, min(cfg.liveness_check_seconds, max(0.0, left_seconds)))
        if self._close_requested:
            raise CommError(f"rank {self.rank}: the shm transport was closed by another thread "
                            f"(process group destroyed or aborted) during collective #{op}")
        now = time.monotonic()
        if now - last_liveness < cfg.liveness_check_seconds:
            return last_liveness
        for p in waiting:
            if self._peers[p].header[_H_ABORTED]:
                raise PeerExitedError(peer_rank=p, detail="it aborted its shm transport after an error")
            if not process_alive(self._peer_pids[p]):
                raise PeerExitedError(peer_rank=p, detail=f"process {self._peer_pids[p]} exited")
        return now

    def close(self) -> None:
        """Unmap every segment and close the doorbells (idempotent, callable from any thread).

        While another thread runs a collective on this transport, nothing is released under it:
        the call raises `CommError` within ``liveness_check_seconds`` if it is waiting (it
        finishes if it is not) and releases everything on its way out.
        """
        self._close_requested = True
        if self._busy.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._busy.release()
        # The running call sees the request after at most ``liveness_check_seconds`` of waiting (no
        # doorbell write from here: the call may close that descriptor at any moment).

    def _release(self) -> None:
        """Unmap and close everything; only with ``_busy`` held, or before any call (init)."""
        if self._closed:
            return
        self._closed = True
        for seg in [self._own, *self._peers]:
            if seg is not None:
                seg.close()
        for fd in [self._bell, *self._peer_bells]:
            if fd >= 0:
                os.close(fd)
        self._bell, self._peer_bells = -1, [-1] * self.world_size
        self._own = None
        self._peers = [None] * self.world_size

    def all_to_all_v(self, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """See `CommBackend.all_to_all_v`. CPU tensors only; any dtype (moved as bytes).

        Raises:
            ValueError: bad local splits, or a CUDA tensor.
            SplitMismatchError: a peer's byte count or op sequence differs from this rank's.
            PeerTimeoutError: no chunk moved for ``timeout_seconds``.
            PeerExitedError: a peer process exited or aborted its transport.
        """
        if not self._busy.acquire(blocking=False):
            raise ConcurrentCollectiveError(
                f"rank {self.rank}: all_to_all_v called on thread "
                f"{threading.current_thread().name!r} while thread {self._busy_thread!r} runs "
                f"collective #{self._op_seq} on the same shm transport; use one process group per "
                "thread (dist.new_group)")
        try:
            self._busy_thread = threading.current_thread().name
            return self._all_to_all_v(input, output_splits, input_splits, out)
        finally:
            self._busy_thread = ""
            self._busy.release()
            if self._close_requested and self._busy.acquire(blocking=False):
                try:  # close() was called by another thread during the collective
                    self._release()
                finally:
                    self._busy.release()

    def _all_to_all_v(self, input: torch.Tensor, output_splits: Sequence[int],
                      input_splits: Sequence[int], out: torch.Tensor | None) -> torch.Tensor:
        if self._closed or self._close_requested:
            raise RuntimeError("ShmBackend is closed (by close() or after an earlier exchange error);"
                               " create a new transport / process group")
        if input.device.type != "cpu":
            raise ValueError(f"shm backend moves CPU tensors; got a tensor on {input.device}")
        check_splits(input, output_splits, input_splits, self.world_size, out, self.rank)
        output = allocate_output(input, output_splits) if out is None else out
        try:
            # record_function costs ~15 us per call even without a profiler: only when profiling.
            with record_function("## shm_all_to_all_v ##") if _profiling() else nullcontext():
                self._exchange(input.contiguous(), output, output_splits, input_splits)
        except BaseException:
            self._abort_and_release()  # peers see the abort flag and fail fast
            raise
        return output

    def _exchange(self, input: torch.Tensor, output: torch.Tensor,
                  output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        cfg, rank, world = self.config, self.rank, self.world_size
        self._op_seq += 1
        op = self._op_seq
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        if self._sleeping:  # announced in an earlier call that then made progress
            self._announce_sleep(self, False)
        for p in range(world):  # fail fast if a peer already gave up on the group
            if p != rank and self._peers[p].header[_H_ABORTED]:
                raise PeerExitedError(peer_rank=p, detail="it aborted its shm transport after an earlier error")
        if self._exchange_compiled(self, input.data_ptr(), output.data_ptr(), output_splits, input_splits,
                                   row_bytes, op):
            return
        send_off = [n * row_bytes for n in itertools.accumulate(input_splits, initial=0)]
        recv_off = [n * row_bytes for n in itertools.accumulate(output_splits, initial=0)]
        chunk, slots = cfg.chunk_bytes, cfg.num_slots
        pull_min = max(cfg.cma_min_bytes, 1) if self.cma else None  # an empty message is never pulled
        # Per-peer progress: [next chunk index, chunk count, total bytes]. A message of at least
        # ``pull_min`` bytes is one header-only "pull" chunk carrying its address: the receiver reads
        # it from this process with process_vm_readv and acknowledges by advancing its read_seq.
        sizes = {p: int(send_off[p + 1] - send_off[p]) for p in range(world) if p != rank}
        sends = {p: [0, 1 if pull_min is not None and n >= pull_min else num_chunks(n, chunk), n]
                 for p, n in sizes.items()}
        acks: dict[int, int] = {}  # peer -> its read_seq that says it has read my input (pulls)
        src_addr, dst_addr = input.data_ptr(), output.data_ptr()  # bytes move by memmove: no numpy views per call
        pulls: dict[int, list[int]] = {}  # peer -> [address in the peer, bytes read so far, ring seq]
        recvs = {p: [0, num_chunks(int(recv_off[p + 1] - recv_off[p]), chunk),
                     int(recv_off[p + 1] - recv_off[p])] for p in range(world) if p != rank}
        own, reader = cast(_Segment, self._own), cast(PeerReader, self._reader)  # a reader whenever pull_min is set
        idle_since, own_rows = None, True
        last_progress = last_liveness = time.monotonic()
        while sends or recvs or acks or own_rows:
            progressed = False
            to_ring = set()
            for p in list(sends):
                st = sends[p]
                seg, k = self._peers[p], _ring_index(rank, p)
                ctrl = seg.ctrl[k]
                while st[0] < st[1] and self._sent[p] - int(ctrl[8]) < slots:
                    seq = int(self._sent[p])
                    slot = seq % slots
                    lo = int(send_off[p]) + st[0] * chunk
                    if pull_min is not None and st[2] >= pull_min:
                        seg.slot_header[k][slot] = (op, st[2], _PULL, src_addr + lo)  # type: ignore[union-attr]
                        acks[p] = seq + 1
                    else:
                        n = min(chunk, st[2] - st[0] * chunk)
                        if n > 0:
                            _memmove(seg.payload_addr[k] + slot * seg.stride, src_addr + lo, n)  # type: ignore[union-attr]
                        seg.slot_header[k][slot] = (op, st[2], st[0], n)
                    ctrl[0] = seq + 1  # publish after the payload (x86-64 TSO)
                    self._sent[p] = seq + 1
                    st[0] += 1
                    progressed = True
                    to_ring.add(p)
                if st[0] == st[1]:
                    del sends[p]
            for p in list(recvs):
                st = recvs[p]
                k = _ring_index(p, rank)
                ctrl, hdr, ring_at = own.ctrl[k], own.slot_header[k], own.payload_addr[k]  # ring k's first slot
                if p in pulls:  # one piece of ``chunk`` bytes per pass: other peers are served between
                    pull = pulls[p]
                    n = min(chunk, st[2] - pull[1])
                    reader.pull(self._peer_pids[p], pull[0] + pull[1], dst_addr + int(recv_off[p]) + pull[1], n,
                                f"rank {rank} from rank {p} in collective #{op}")
                    pull[1] += n
                    progressed = True
                    if pull[1] == st[2]:
                        if self._peers[p].header[_H_ABORTED]:  # type: ignore[union-attr]
                            raise PeerExitedError(peer_rank=p, detail="it aborted its shm transport while "
                                                  "this rank read its input (the rows may be stale)")
                        ctrl[8] = pull[2] + 1  # acknowledge: the sender may return and reuse its input
                        self._received[p] = pull[2] + 1
                        del pulls[p], recvs[p]
                        to_ring.add(p)
                    continue
                while st[0] < st[1] and int(ctrl[0]) > self._received[p]:
                    seq = int(self._received[p])
                    slot = seq % slots
                    h_op, h_total, h_index, n = (int(v) for v in hdr[slot])
                    if h_index == _PULL and h_op == op and h_total == st[2] and st[0] == 0 and self.cma:
                        pulls[p] = [n, 0, seq]  # ``n`` holds the address; read from the next pass on
                        progressed = True
                        break
                    if h_op != op or h_total != st[2] or h_index != st[0]:
                        raise SplitMismatchError(
                            f"rank {rank} expected {st[2]} bytes ({st[2] // max(row_bytes, 1)} rows"
                            f" of {row_bytes} bytes) from rank {p} in collective #{op}, but rank {p}"
                            f" sent {h_total} bytes in collective #{h_op} (chunk {h_index}); the "
                            "ranks disagree on split sizes, row shape/dtype, or collective order",
                            peer_rank=p)
                    if n > 0:
                        lo = int(recv_off[p]) + st[0] * chunk
                        _memmove(dst_addr + lo, ring_at + slot * own.stride, n)
                    ctrl[8] = seq + 1
                    self._received[p] = seq + 1
                    st[0] += 1
                    progressed = True
                    to_ring.add(p)
                if st[0] == st[1]:
                    del recvs[p]
            for p in [p for p, seq in acks.items()  # the peer's read_seq of my ring: it has read my input
                      if int(self._peers[p].ctrl[_ring_index(rank, p)][8]) >= seq]:  # type: ignore[union-attr]
                del acks[p]  # my input may change or be freed now
                progressed = True
            for p in to_ring:
                self._ring(p)
            if own_rows and not progressed:  # my own rows: a local copy, while the peers copy
                if recv_off[rank + 1] > recv_off[rank]:
                    _memmove(dst_addr + recv_off[rank], src_addr + send_off[rank], recv_off[rank + 1] - recv_off[rank])
                own_rows, progressed = False, True
            if progressed:
                idle_since = None
                last_progress = time.monotonic()
                continue
            now = time.monotonic()
            if idle_since is None:
                idle_since = now
            if (now - idle_since) * 1e6 < cfg.spin_us:
                continue
            waiting = sorted(set(sends) | set(recvs) | set(acks))
            last_liveness = self._stall(op, waiting, last_progress, last_liveness)
            if time.monotonic() - last_progress > cfg.timeout_seconds:
                p = waiting[0]
                stage, st = (("send", sends[p]) if p in sends else ("recv", recvs[p]) if p in recvs
                             else ("read of my input (single copy)", [0, 1]))
                raise PeerTimeoutError(
                    peer_rank=p, timeout_seconds=cfg.timeout_seconds, stage=stage,
                    detail=f"chunk {st[0]} of {st[1]} of collective #{op} on rank {rank}; "
                           f"ranks still pending: {waiting}")
