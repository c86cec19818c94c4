"""The small-message path of :class:`fstrain.distributed.comm.shm.ShmBackend`, compiled with numba.

When every message of a call (to and from each peer) fits one ring slot and stays below the
single-copy threshold, the exchange is one chunk per peer each way: copy the rows into the peer's
ring, publish, copy the peer's rows out of this rank's ring, acknowledge. That loop used to run
in Python, 28-35 us of a 54 us two-rank 1 KB call (one rank alone: 20 us; docs/results/bench_alltoall.md),
most of it spent polling and waiting for the peer's Python. Here it is one compiled function
(:func:`small_exchange_step`, no GIL held) that moves bytes and counters by address; Python keeps
the checks, the doorbells, sleeping and the error messages (:func:`exchange_small`).

The wire format is the rings' (:mod:`fstrain.distributed.comm.shm_segment`): one chunk per
message with slot header ``(op_seq, total_bytes, 0, payload_bytes)``, so a peer on the Python
path (a larger message elsewhere in the group) reads and writes the same chunks. Counters move
with acquire loads and release stores (LLVM atomics), so the payload is visible before the
counter on any CPU, not only under x86-64's store order.
"""

from __future__ import annotations

import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fstrain.distributed.comm.base import PeerTimeoutError, SplitMismatchError

# Per-peer addresses, one row per rank (the own rank's row unused): the peer's ring for my chunks
# (its ``write_seq`` at +0 and ``read_seq`` at +64; slot 0's header; slot 0's payload) and my ring
# for the peer's chunks (same three).
SEND_CTRL, SEND_HDR, SEND_PAYLOAD, RECV_CTRL, RECV_HDR, RECV_PAYLOAD = range(6)
_READ_SEQ = 64  # byte offset of read_seq from write_seq (one cache line each)
POLLS_PER_CALL = 256  # polls of every pending ring per compiled call before Python checks the clock


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
def _memcpy(typingctx, dst, src, nbytes):
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p), args[2], 1)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp, types.intp), codegen


@njit(cache=True, nogil=True)
def small_exchange_step(rings, seqs, splits, state, rank, op, src, dst, row_bytes, slots, stride, first,
                        max_polls):  # pragma: no cover - compiled; run through exchange_small
    """Publish, poll and copy one all-to-all-v of single-chunk messages, up to ``max_polls`` polls.

    Args:
        rings: ``[W x 6]`` int64 addresses (the columns above; row ``rank`` unused).
        seqs: ``[2 x W]`` int64 chunks published to each peer's ring / consumed from each peer (persist).
        splits: ``[2 x W]`` int64 rows sent to / received from each rank.
        state: ``[3 x W]`` int64 per call: published, received, doorbell owed (Python clears it).
        rank, op: this rank and the collective's sequence number.
        src, dst: addresses of the contiguous input and output.
        row_bytes: bytes per row; slots, stride: ring slots and bytes from one slot to the next.
        first: 1 on the call's first step (zeroes ``state``, copies the own rows after publishing).
        max_polls: passes over the pending rings before returning.

    Returns:
        Messages still pending (0: done), or ``-(p + 1)`` when peer ``p``'s chunk header disagrees
        with this rank's op or byte count (nothing was copied from it).
    """
    world = splits.shape[1]
    if first:
        state[:] = 0
    polls = 0
    while True:
        pending = 0
        s_off = 0
        r_off = 0
        for p in range(world):
            n_send = splits[0, p] * row_bytes
            n_recv = splits[1, p] * row_bytes
            if p != rank:
                if state[0, p] == 0:
                    ctrl = rings[p, SEND_CTRL]
                    seq = seqs[0, p]
                    if seq - _load_acquire(ctrl + _READ_SEQ) < slots:
                        at = (seq % slots) * stride
                        if n_send > 0:
                            _memcpy(rings[p, SEND_PAYLOAD] + at, src + s_off, n_send)
                        hdr = rings[p, SEND_HDR] + at
                        _store(hdr, op)
                        _store(hdr + 8, n_send)
                        _store(hdr + 16, 0)
                        _store(hdr + 24, n_send)
                        _store_release(ctrl, seq + 1)
                        seqs[0, p] = seq + 1
                        state[0, p] = 1
                        state[2, p] = 1
                    else:
                        pending += 1
                if state[1, p] == 0:
                    ctrl = rings[p, RECV_CTRL]
                    seq = seqs[1, p]
                    if _load_acquire(ctrl) > seq:
                        at = (seq % slots) * stride
                        hdr = rings[p, RECV_HDR] + at
                        if _load(hdr) != op or _load(hdr + 8) != n_recv or _load(hdr + 16) != 0:
                            return -(p + 1)
                        if n_recv > 0:
                            _memcpy(dst + r_off, rings[p, RECV_PAYLOAD] + at, n_recv)
                        _store_release(ctrl + _READ_SEQ, seq + 1)
                        seqs[1, p] = seq + 1
                        state[1, p] = 1
                        state[2, p] = 1
                    else:
                        pending += 1
            elif first and n_send > 0:
                _memcpy(dst + r_off, src + s_off, n_send)
            s_off += n_send
            r_off += n_recv
        first = 0
        polls += 1
        if pending == 0 or polls >= max_polls:
            return pending


def ring_addresses(own, peers, rank: int) -> np.ndarray:
    """``[W x 6]`` int64: the addresses :func:`small_exchange_step` reads (``own``/``peers``: mapped
    :class:`~fstrain.distributed.comm.shm_segment._Segment` s; ``peers[rank]`` is None)."""
    from fstrain.distributed.comm.shm_segment import _ring_index

    rings = np.zeros((len(peers), 6), np.int64)
    for p, seg in enumerate(peers):
        if p == rank:
            continue
        k, j = _ring_index(rank, p), _ring_index(p, rank)
        rings[p] = (seg.ctrl[k].ctypes.data, seg.slot_header[k].ctypes.data, seg.payload_addr[k],
                    own.ctrl[j].ctypes.data, own.slot_header[j].ctypes.data, own.payload_addr[j])
    return rings


def attach(b) -> int:
    """Give backend ``b`` (a ``ShmBackend`` whose segments are mapped) what :func:`exchange_small` reads,
    compile the step, and return the byte bound of the path: a call whose messages are all smaller
    fits one ring slot each and is below the single-copy threshold (``cma_min_bytes`` where in use)."""
    cfg, w = b.config, b.world_size
    b._fast_rings = ring_addresses(b._own, b._peers, b.rank)
    b._fast_splits, b._fast_state = np.zeros((2, w), np.int64), np.zeros((3, w), np.int64)
    warm_up()
    return min(cfg.chunk_bytes + 1, max(cfg.cma_min_bytes, 1)) if b.cma else cfg.chunk_bytes + 1


def warm_up() -> None:
    """Compile (or load from numba's cache) :func:`small_exchange_step` now, not in a first collective."""
    z = np.zeros((1, 6), np.int64)
    small_exchange_step(z, np.zeros((2, 1), np.int64), np.zeros((2, 1), np.int64), np.zeros((3, 1), np.int64),
                        0, 0, 0, 0, 1, 2, 64, 1, 1)


def exchange_small(b, src: int, dst: int, output_splits, input_splits, row_bytes: int, op: int) -> None:
    """One all-to-all-v of single-chunk messages on backend ``b`` (a ``ShmBackend``); see the module doc.

    Raises:
        SplitMismatchError: a peer's chunk is from another collective or has another byte count.
        PeerTimeoutError, PeerExitedError, CommError: as ``ShmBackend.all_to_all_v``.
    """
    cfg, rank, world = b.config, b.rank, b.world_size
    splits, state = b._fast_splits, b._fast_state
    splits[0] = input_splits
    splits[1] = output_splits
    first, idle_since = 1, None
    last_progress = last_liveness = time.monotonic()
    while True:
        left = small_exchange_step(b._fast_rings, b._seqs, splits, state, rank, op, src, dst, row_bytes,
                                   cfg.num_slots, b._own.stride, first, POLLS_PER_CALL)
        first = 0
        if left < 0:
            p = -left - 1
            k = (p if p < rank else p - 1)
            h_op, h_total, h_index, _ = (int(v) for v in b._own.slot_header[k][int(b._seqs[1, p]) % cfg.num_slots])
            raise SplitMismatchError(
                f"rank {rank} expected {int(splits[1, p]) * row_bytes} bytes ({int(splits[1, p])} rows of "
                f"{row_bytes} bytes) from rank {p} in collective #{op}, but rank {p} sent {h_total} bytes in "
                f"collective #{h_op} (chunk {h_index}); the ranks disagree on split sizes, row shape/dtype, "
                "or collective order", peer_rank=p)
        owed = np.flatnonzero(state[2])
        if len(owed):
            state[2] = 0
            for p in owed:
                b._ring(int(p))
            idle_since, last_progress = None, time.monotonic()
        if left == 0:
            return
        now = time.monotonic()
        if idle_since is None:
            idle_since = now
        if (now - idle_since) * 1e6 < cfg.spin_us:
            continue
        waiting = [p for p in range(world) if p != rank and not (state[0, p] and state[1, p])]
        last_liveness = b._stall(op, waiting, last_progress, last_liveness)
        if time.monotonic() - last_progress > cfg.timeout_seconds:
            p = waiting[0]
            raise PeerTimeoutError(peer_rank=p, timeout_seconds=cfg.timeout_seconds,
                                   stage="send" if not state[0, p] else "recv",
                                   detail=f"chunk 0 of 1 of collective #{op} on rank {rank}; "
                                          f"ranks still pending: {waiting}")
