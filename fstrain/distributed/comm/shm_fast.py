"""The compiled exchange of :class:`fstrain.distributed.comm.shm.ShmBackend` (numba, no GIL held).

With single copy on (the default where the kernel allows it) every message is either smaller than
``cma_min_bytes`` (one ring chunk: copy in, publish, copy out, acknowledge) or a single-copy *pull*
(a header-only chunk with the sender's address; the receiver reads the rows with
``process_vm_readv`` in pieces of ``chunk_bytes`` and acknowledges; the sender waits for that).
Without single copy, a call whose messages all fit one ring slot is the same minus the pulls. For
those calls the whole exchange loop is one compiled function, :func:`exchange_step`, that moves
bytes and counters by address, spins up to ``spin_us`` and rings the doorbells of peers that
announced they may sleep (:func:`announce_sleep`); Python keeps sleeping, liveness checks and error
messages (:func:`exchange_compiled`). Any other call (a message of several ring chunks) returns
to the Python loop in ``shm.py`` before anything is published. Between ranks in step a call makes
no system call.

Why: that loop was 28-35 us of a 54 us two-rank 1 KB call (one rank alone: 20 us) and 80-100 us of
a 4 MB call whose copies take 400-500 us, its Python running cold after the copies evicted it
(docs/results/bench_alltoall.md).

The wire format is the rings' (:mod:`fstrain.distributed.comm.shm_segment`): slot header
``(op_seq, total_bytes, chunk_index, payload_bytes)``, chunk index -1 and the address in the last
field for a pull, so a peer on the Python path reads and writes the same chunks. Counters move with
acquire loads and release stores (LLVM atomics): the payload is visible before the counter on any
CPU, not only under x86-64's store order.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fstrain.distributed.comm.base import PeerExitedError, PeerTimeoutError, SplitMismatchError

# Per-peer values, one row per rank (the own rank's row unused): the peer's ring for my chunks
# (its ``write_seq`` at +0 and ``read_seq`` at +64; slot 0's header; slot 0's payload), my ring for
# the peer's chunks (same three), the peer's segment header (its aborted flag), its pid, the write end
# of its doorbell FIFO and the address of its sleeping flag.
(SEND_CTRL, SEND_HDR, SEND_PAYLOAD, RECV_CTRL, RECV_HDR, RECV_PAYLOAD, PEER_HEADER, PEER_PID, PEER_BELL,
 PEER_SLEEPING) = range(10)
# Per-call state rows: published, received, doorbell owed, awaited read_seq of a pull sent (0: none),
# pull source address, pull bytes read, pull ring seq + 1 (0: no pull yet); row 7 col 0: progress flag.
_PUBLISHED, _RECEIVED, _RING, _ACK, _PULL_ADDR, _PULL_DONE, _PULL_SEQ, _PROGRESS = range(8)
# Scratch words (``iov``): the two iovecs of process_vm_readv, own rows copied (1), a timespec, the doorbell byte.
_IOV_OWN_DONE, _IOV_TS, _IOV_BYTE = 4, 5, 7
# C functions called by address (``fns``): process_vm_readv, write, clock_gettime.
_FN_READV, _FN_WRITE, _FN_CLOCK = range(3)
_READ_SEQ = 64  # byte offset of read_seq from write_seq (one cache line each)
_ABORTED_AT = 8 * 5  # byte offset of the aborted flag in a segment header (shm_segment._H_ABORTED)
_SLEEPING_AT = 8 * 8  # byte offset of the sleeping flag (shm_segment._H_SLEEPING)
_PULL = -1
_CLOCK_MONOTONIC = 1  # Linux
NO_PULLS = 1 << 62  # pull threshold when single copy is off


def _libc_address(name: str) -> int:
    try:
        return ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def readv_address() -> int:
    """Address of libc's ``process_vm_readv`` (0 where absent: then nothing is pulled)."""
    return _libc_address("process_vm_readv")


@intrinsic
def _load_acquire(typingctx, addr):
    def codegen(context, builder, signature, args):
        return builder.load_atomic(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "acquire", 8)
    return types.int64(types.intp), codegen


@intrinsic
def _store_release(typingctx, addr, value):
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "release", 8)
        return context.get_dummy_value()
    return types.void(types.intp, types.int64), codegen


@intrinsic
def _load(typingctx, addr):
    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), align=8)
    return types.int64(types.intp), codegen


@intrinsic
def _store(typingctx, addr, value):
    def codegen(context, builder, signature, args):
        builder.store(args[1], builder.inttoptr(args[0], ir.IntType(64).as_pointer()), align=8)
        return context.get_dummy_value()
    return types.void(types.intp, types.int64), codegen


@intrinsic
def _readv(typingctx, fn, pid, local_iov, remote_iov):
    """``process_vm_readv(pid, local_iov, 1, remote_iov, 1, 0)`` through its address ``fn`` (so numba
    can cache the compiled step: no ctypes object in it)."""
    def codegen(context, builder, signature, args):
        i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i64, [ir.IntType(32), i8p, i64, i8p, i64, i64])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        one, zero = ir.Constant(i64, 1), ir.Constant(i64, 0)
        return builder.call(target, [builder.trunc(args[1], ir.IntType(32)), builder.inttoptr(args[2], i8p), one,
                                     builder.inttoptr(args[3], i8p), one, zero])
    return types.int64(types.intp, types.int64, types.intp, types.intp), codegen


@intrinsic
def _fence(typingctx):
    """A sequentially consistent fence (x86-64: ``mfence``): my flag or counter store is visible before my next load."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _write1(typingctx, fn, fd, buf):
    """``write(fd, buf, 1)`` through its address ``fn`` (the result is ignored: a full FIFO already wakes)."""
    def codegen(context, builder, signature, args):
        i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i64, [ir.IntType(32), i8p, i64])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        fd = builder.trunc(args[1], ir.IntType(32))
        builder.call(target, [fd, builder.inttoptr(args[2], i8p), ir.Constant(i64, 1)])
        return context.get_dummy_value()
    return types.void(types.intp, types.int64, types.intp), codegen


@intrinsic
def _clock_gettime(typingctx, fn, ts):
    """``clock_gettime(CLOCK_MONOTONIC, ts)`` through its address ``fn`` (vDSO: tens of ns)."""
    def codegen(context, builder, signature, args):
        i32, i8p = ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i32, [i32, i8p])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(target, [ir.Constant(i32, _CLOCK_MONOTONIC), builder.inttoptr(args[1], i8p)])
        return context.get_dummy_value()
    return types.void(types.intp, types.intp), codegen


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p), args[2], 1)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp, types.intp), codegen


@njit(cache=True, inline="always")
def _advance(counter, seqs, state, side, p, seq):  # pragma: no cover - compiled
    """Release-store ``seq + 1`` at address ``counter`` (my write_seq in ``p``'s ring, side 0, or my read_seq
    of ``p``'s ring, side 1), record it in ``seqs[side, p]``, mark the message done and owe ``p`` a doorbell."""
    _store_release(counter, seq + 1)
    seqs[side, p] = seq + 1
    state[side, p] = 1  # _PUBLISHED (side 0) or _RECEIVED (side 1)
    state[_RING, p] = 1


@njit(cache=True, inline="always")
def _now_ns(fns, iov):  # pragma: no cover - compiled
    _clock_gettime(fns[_FN_CLOCK], iov.ctypes.data + 8 * _IOV_TS)
    return iov[_IOV_TS] * 1_000_000_000 + iov[_IOV_TS + 1]


@njit(cache=True, nogil=True)
def set_flag(addr, value):  # pragma: no cover - compiled
    """Store ``value`` at ``addr`` (int64), then a full fence: the store is visible before any later load."""
    _store_release(addr, value)
    _fence()


@njit(cache=True, nogil=True)
def exchange_step(rings, seqs, splits, state, iov, rank, op, src, dst, row_bytes, slots, stride, chunk, pull_min,
                  fns, first, spin_ns):  # pragma: no cover - compiled; run through exchange_compiled
    """Publish, poll, copy and pull one all-to-all-v, until done or ``spin_ns`` without progress.

    Order within a call: every message is published first (and a sleeping peer's doorbell rung), then
    the peers' chunks are copied out and their rows pulled; this rank's own rows are copied in the
    first pass that finds nothing else to do, so a peer waiting for my acknowledgement is served first.
    A doorbell is written only when the peer has announced it may sleep (its flag, read after a full
    fence that follows my counter store; it sets the flag, fences, then polls once more: one of the two
    sees the other's store).

    Args:
        rings: ``[W x 10]`` int64 per-peer addresses, pid and doorbell (the columns above; row ``rank`` unused).
        seqs: ``[2 x W]`` int64 chunks published to each peer's ring / consumed from each peer (persist).
        splits: ``[2 x W]`` int64 rows sent to / received from each rank.
        state: ``[8 x W]`` int64 per call (the rows above; Python clears the progress flag).
        iov: ``[8]`` int64 scratch (two iovecs, the own-rows flag, a timespec, the doorbell byte).
        rank, op: this rank and the collective's sequence number.
        src, dst: addresses of the contiguous input and output.
        row_bytes: bytes per row; slots, stride, chunk: ring slots, bytes between slots, payload per slot.
        pull_min: messages of at least this many bytes are pulled (``NO_PULLS``: single copy off).
        fns: ``[3]`` int64 addresses of ``process_vm_readv``, ``write`` and ``clock_gettime`` (:func:`attach`).
        first: 1 on the call's first step (checks the sizes, zeroes ``state``).
        spin_ns: nanoseconds without progress before returning (0: one pass).

    Returns:
        Messages still pending (0: done); ``-(p + 1)``: peer ``p``'s chunk header disagrees with this
        rank's op or byte count; ``-(W + p + 1)``: a read of ``p``'s rows failed (Python retries it to
        raise the error); ``-(2W + p + 1)``: ``p`` aborted while its rows were read; ``-(3W + 1)`` (first
        step only, nothing published): a message needs several ring chunks, the Python loop's job.
    """
    world = splits.shape[1]
    if first:
        for p in range(world):
            for n in (splits[0, p] * row_bytes, splits[1, p] * row_bytes):
                if p != rank and chunk < n < pull_min:
                    return -(3 * world + 1)
        state[:] = 0
        iov[_IOV_OWN_DONE] = 0
    idle_since = -1
    polls = 0
    while True:
        pending = 0
        progressed = False
        s_off = 0
        r_off = 0
        own_src = 0
        own_dst = 0
        own_n = 0
        for p in range(world):
            n_send = splits[0, p] * row_bytes
            n_recv = splits[1, p] * row_bytes
            if p == rank:
                own_src, own_dst, own_n = src + s_off, dst + r_off, n_send
            else:
                if state[_PUBLISHED, p] == 0:
                    ctrl = rings[p, SEND_CTRL]
                    seq = seqs[0, p]
                    if seq - _load_acquire(ctrl + _READ_SEQ) < slots:
                        at = (seq % slots) * stride
                        hdr = rings[p, SEND_HDR] + at
                        _store(hdr, op)
                        _store(hdr + 8, n_send)
                        if n_send >= pull_min:
                            _store(hdr + 16, _PULL)
                            _store(hdr + 24, src + s_off)
                            state[_ACK, p] = seq + 1
                            pending += 1  # done only when the peer has read it (its read_seq passes seq)
                        else:
                            if n_send > 0:
                                _memcpy(rings[p, SEND_PAYLOAD] + at, src + s_off, n_send)
                            _store(hdr + 16, 0)
                            _store(hdr + 24, n_send)
                        _advance(ctrl, seqs, state, _PUBLISHED, p, seq)
                        progressed = True
                    else:
                        pending += 1
                elif state[_ACK, p] != 0:
                    if _load_acquire(rings[p, SEND_CTRL] + _READ_SEQ) >= state[_ACK, p]:
                        state[_ACK, p] = 0  # the peer has read my input: it may change now
                        progressed = True
                    else:
                        pending += 1
                if state[_RECEIVED, p] == 0 and not first:  # the first pass only publishes
                    if state[_PULL_SEQ, p] == 0:
                        ctrl = rings[p, RECV_CTRL]
                        seq = seqs[1, p]
                        if _load_acquire(ctrl) > seq:
                            at = (seq % slots) * stride
                            hdr = rings[p, RECV_HDR] + at
                            index = _load(hdr + 16)
                            if _load(hdr) != op or _load(hdr + 8) != n_recv or index != (
                                    _PULL if n_recv >= pull_min else 0):
                                return -(p + 1)
                            if index == _PULL:
                                state[_PULL_ADDR, p] = _load(hdr + 24)
                                state[_PULL_SEQ, p] = seq + 1
                                pending += 1
                            else:
                                if n_recv > 0:
                                    _memcpy(dst + r_off, rings[p, RECV_PAYLOAD] + at, n_recv)
                                _advance(ctrl + _READ_SEQ, seqs, state, _RECEIVED, p, seq)
                            progressed = True
                        else:
                            pending += 1
                    else:  # one piece of ``chunk`` bytes per pass: other peers are served between
                        done = state[_PULL_DONE, p]
                        if done < n_recv:
                            n = min(chunk, n_recv - done)
                            iov[0] = dst + r_off + done
                            iov[1] = n
                            iov[2] = state[_PULL_ADDR, p] + done
                            iov[3] = n
                            got = _readv(fns[_FN_READV], rings[p, PEER_PID], iov.ctypes.data, iov.ctypes.data + 16)
                            if got <= 0:
                                return -(world + p + 1)
                            done += got
                            state[_PULL_DONE, p] = done
                            progressed = True
                        if done < n_recv:
                            pending += 1
                        elif _load_acquire(rings[p, PEER_HEADER] + _ABORTED_AT) != 0:
                            return -(2 * world + p + 1)
                        else:
                            ack = rings[p, RECV_CTRL] + _READ_SEQ  # the sender may return and reuse its input
                            _advance(ack, seqs, state, _RECEIVED, p, state[_PULL_SEQ, p] - 1)
                elif state[_RECEIVED, p] == 0:
                    pending += 1
            s_off += n_send
            r_off += n_recv
        if progressed:  # ring the peers I published to or acknowledged, where they may sleep
            _fence()
            for p in range(world):
                if state[_RING, p] != 0:
                    state[_RING, p] = 0
                    if _load_acquire(rings[p, PEER_SLEEPING]) != 0:
                        _write1(fns[_FN_WRITE], rings[p, PEER_BELL], iov.ctypes.data + 8 * _IOV_BYTE)
        if iov[_IOV_OWN_DONE] == 0:
            if not progressed or pending == 0:  # my own rows: a local copy, while the peers copy
                if own_n > 0:
                    _memcpy(own_dst, own_src, own_n)
                iov[_IOV_OWN_DONE] = 1
                progressed = True
            else:
                pending += 1
        first = 0
        if progressed:
            state[_PROGRESS, 0] = 1
            idle_since = -1
            polls = 0
        elif pending > 0:
            if spin_ns <= 0:
                return pending
            polls += 1
            if polls % 32 == 0:  # the clock every 32 idle passes
                now = _now_ns(fns, iov)
                if idle_since < 0:
                    idle_since = now
                elif now - idle_since >= spin_ns:
                    return pending
        if pending == 0:
            return 0


def ring_addresses(own, peers, rank: int, pids, bells) -> np.ndarray:
    """``[W x 10]`` int64: the addresses, pids and doorbells :func:`exchange_step` reads (``own``/``peers``:
    mapped :class:`~fstrain.distributed.comm.shm_segment._Segment` s, ``peers[rank]`` None; ``pids`` and
    ``bells``, the write ends of the peers' doorbell FIFOs, per rank)."""
    from fstrain.distributed.comm.shm_segment import _ring_index

    rings = np.zeros((len(peers), 10), np.int64)
    for p, seg in enumerate(peers):
        if p == rank:
            continue
        k, j = _ring_index(rank, p), _ring_index(p, rank)
        rings[p] = (seg.ctrl[k].ctypes.data, seg.slot_header[k].ctypes.data, seg.payload_addr[k],
                    own.ctrl[j].ctypes.data, own.slot_header[j].ctypes.data, own.payload_addr[j],
                    seg.header.ctypes.data, pids[p], bells[p], seg.header.ctypes.data + _SLEEPING_AT)
    return rings


def attach(b) -> None:
    """Give backend ``b`` (a ``ShmBackend`` whose segments are mapped) what :func:`exchange_compiled`
    reads and compile the step (or load it from numba's cache)."""
    w = b.world_size
    b._fast_rings = ring_addresses(b._own, b._peers, b.rank, b._peer_pids, b._peer_bells)
    b._fast_splits, b._fast_state = np.zeros((2, w), np.int64), np.zeros((8, w), np.int64)
    b._fast_iov = np.zeros(8, np.int64)
    b._fast_fns = np.array([readv_address(), _libc_address("write"), _libc_address("clock_gettime")], np.int64)
    b._pull_min = max(b.config.cma_min_bytes, 1) if b.cma and b._fast_fns[_FN_READV] else NO_PULLS
    b._sleeping_at = b._own.header.ctypes.data + _SLEEPING_AT
    b._sleeping = False
    z = np.zeros((2, 1), np.int64)
    exchange_step(np.zeros((1, 10), np.int64), z, z.copy(), np.zeros((8, 1), np.int64), b._fast_iov,
                  0, 0, 0, 0, 1, 2, 128, 64, NO_PULLS, b._fast_fns, 1, 0)
    set_flag(b._sleeping_at, 0)


def announce_sleep(b, sleeping: bool) -> None:
    """Set backend ``b``'s sleeping flag (peers on the compiled path ring its doorbell only while it is set).

    Protocol (as a futex waiter's): set the flag, fence, poll the rings once more, only then block on
    the doorbell; clear it after waking or on progress. A peer stores its counter, fences, then reads
    the flag: either it sees the flag and rings, or my poll after the fence sees its counter."""
    b._sleeping = sleeping
    set_flag(b._sleeping_at, 1 if sleeping else 0)


def exchange_compiled(b, src: int, dst: int, output_splits, input_splits, row_bytes: int, op: int) -> bool:
    """One all-to-all-v on backend ``b`` (a ``ShmBackend``) by :func:`exchange_step` (see the module doc).

    Returns:
        False (nothing sent) when a message needs several ring chunks: the Python loop's call.

    Raises:
        SplitMismatchError: a peer's chunk is from another collective or has another byte count.
        CommError: a single-copy read failed. PeerTimeoutError, PeerExitedError: as ``ShmBackend.all_to_all_v``.
    """
    cfg, rank, world = b.config, b.rank, b.world_size
    splits, state = b._fast_splits, b._fast_state
    splits[0] = input_splits
    splits[1] = output_splits
    first, spin_ns = 1, int(cfg.spin_us * 1000)
    last_progress = last_liveness = time.monotonic()
    while True:
        left = exchange_step(b._fast_rings, b._seqs, splits, state, b._fast_iov, rank, op, src, dst, row_bytes,
                             cfg.num_slots, b._own.stride, cfg.chunk_bytes, b._pull_min, b._fast_fns, first,
                             0 if b._sleeping else spin_ns)  # announced: one pass, then block
        if left < 0:
            if first and left == -(3 * world + 1):
                return False
            _raise_or_repeat_read(b, -left - 1, splits, state, dst, row_bytes, op)
        first = 0
        if state[_PROGRESS, 0]:
            state[_PROGRESS, 0] = 0
            last_progress = time.monotonic()
            if b._sleeping:
                announce_sleep(b, False)
        if left == 0:
            return True
        waiting = [p for p in range(world)  # spun for spin_us without progress: sleep on the doorbell
                   if p != rank and not (state[_PUBLISHED, p] and state[_RECEIVED, p] and not state[_ACK, p])]
        last_liveness = b._stall(op, waiting, last_progress, last_liveness)
        if time.monotonic() - last_progress > cfg.timeout_seconds:
            p = waiting[0]
            stage = ("send" if not state[_PUBLISHED, p] else "recv" if not state[_RECEIVED, p]
                     else "read of my input (single copy)")
            raise PeerTimeoutError(peer_rank=p, timeout_seconds=cfg.timeout_seconds, stage=stage,
                                   detail=f"collective #{op} on rank {rank}; ranks still pending: {waiting}")


def _raise_or_repeat_read(b, code: int, splits: np.ndarray, state: np.ndarray, dst: int, row_bytes: int,
                          op: int) -> None:
    """Raise the error :func:`exchange_step` returned as ``-(code + 1)``; a failed single-copy read is
    repeated by the Python reader, which raises its error (or, if it now succeeds, the exchange goes on)."""
    rank, world = b.rank, b.world_size
    kind, p = divmod(code, world)
    if kind == 0:
        k = p if p < rank else p - 1
        h_op, h_total, h_index, _ = (int(v) for v in b._own.slot_header[k][int(b._seqs[1, p]) % b.config.num_slots])
        raise SplitMismatchError(
            f"rank {rank} expected {int(splits[1, p]) * row_bytes} bytes ({int(splits[1, p])} rows of "
            f"{row_bytes} bytes) from rank {p} in collective #{op}, but rank {p} sent {h_total} bytes in "
            f"collective #{h_op} (chunk {h_index}); the ranks disagree on split sizes, row shape/dtype, "
            "or collective order", peer_rank=p)
    if kind == 2:
        raise PeerExitedError(peer_rank=p, detail="it aborted its shm transport while this rank read its "
                              "input (the rows may be stale)")
    done = int(state[_PULL_DONE, p])
    r_off = int(splits[1, :p].sum()) * row_bytes
    n = min(b.config.chunk_bytes, int(splits[1, p]) * row_bytes - done)
    b._reader.pull(b._peer_pids[p], int(state[_PULL_ADDR, p]) + done, dst + r_off + done, n,
                   f"rank {rank} from rank {p} in collective #{op}")
    state[_PULL_DONE, p] = done + n
