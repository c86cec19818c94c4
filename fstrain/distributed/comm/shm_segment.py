"""The shared-memory segment layout of :class:`fstrain.distributed.comm.shm.ShmBackend`.

One segment per rank in ``/dev/shm``: a 4096-byte header (magic, pid, world size, chunk bytes,
slots, aborted flag), then one ring per other rank: two counters on separate cache lines
(``write_seq``, ``read_seq``) and ``num_slots`` slots of a 64-byte header plus ``chunk_bytes``
payload (:func:`ring_bytes`, :func:`segment_bytes`).
"""

from __future__ import annotations

import mmap
import os
from datetime import timedelta

import numpy as np
import torch

from fstrain.distributed.comm.base import PeerTimeoutError, SplitMismatchError
from fstrain.distributed.comm.hierarchical import node_key


_MAGIC = 0x3130_4D48_5348_5346  # b"FSSHMH01" little-endian
_SEGMENT_HEADER_BYTES = 4096  # int64 fields: magic, pid, world_size, chunk_bytes, num_slots, aborted; sleeping
_H_MAGIC, _H_PID, _H_WORLD, _H_CHUNK, _H_SLOTS, _H_ABORTED = range(6)
_H_SLEEPING = 8  # on its own cache line: 1 while the owner may block on its doorbell (peers must ring it)
_CTRL_BYTES = 128  # write_seq at byte 0, read_seq at byte 64: one cache line each
_SLOT_HEADER_BYTES = 64  # int64 fields: op_seq, total_bytes, chunk_index, payload_bytes


def _profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def ring_bytes(chunk_bytes: int, num_slots: int) -> int:
    """Bytes of one sender's ring: counters plus ``num_slots`` (header + payload) slots."""
    return _CTRL_BYTES + num_slots * (_SLOT_HEADER_BYTES + _align(chunk_bytes))


def segment_bytes(world_size: int, chunk_bytes: int, num_slots: int) -> int:
    """Bytes of one rank's segment: a header plus one ring per other rank."""
    return _SEGMENT_HEADER_BYTES + (world_size - 1) * ring_bytes(chunk_bytes, num_slots)


def num_chunks(total_bytes: int, chunk_bytes: int) -> int:
    """Chunks of one message; an empty message still sends one header-only chunk."""
    return max(1, -(-total_bytes // chunk_bytes))


def wait_for_bell(poller, fd: int, timeout_seconds: float) -> None:
    """Block until the doorbell FIFO ``fd`` (registered in ``poller``) has a byte, or the timeout; drain it."""
    if poller.poll(max(1, int(timeout_seconds * 1000))):
        try:
            while os.read(fd, 4096):
                pass
        except BlockingIOError:
            pass


def store_get(store, timeout_seconds: float, key: str, peer: int) -> str:
    """``store``'s value of ``key``, set by rank ``peer`` during the rendezvous (a ``torch.distributed.Store``).
    Raises `PeerTimeoutError` when the key is not set within ``timeout_seconds``."""
    try:
        store.wait([key], timedelta(seconds=timeout_seconds))
    except Exception as e:  # DistStoreError / RuntimeError on timeout
        raise PeerTimeoutError(peer_rank=peer, timeout_seconds=timeout_seconds,
                               stage="rendezvous", detail=f"store key {key!r}: {e}") from e
    return store.get(key).decode()


def _ring_index(sender: int, receiver: int) -> int:
    """Index of ``sender``'s ring inside ``receiver``'s segment (no ring for itself)."""
    return sender if sender < receiver else sender - 1


def _node_id() -> str:
    return node_key()  # hostname + boot id, or $FSTRAIN_NODE_ID (fstrain.distributed.comm.hierarchical)


class _Segment:
    """One mapped segment, numpy views of its header and rings, and the rings' payload addresses
    (``payload_addr[k] + slot * stride``: where slot ``slot`` of ring ``k`` starts; valid until :meth:`close`)."""

    def __init__(self, path: str, *, create: bool, size: int, world_size: int, chunk: int, slots: int):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise SplitMismatchError(
                    f"segment {path} has {os.fstat(fd).st_size} bytes, expected {size}: ranks use "
                    "different chunk_bytes / num_slots settings"
                )
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.header = np.ndarray((16,), np.int64, buffer=self.mm, offset=0)
        rb = ring_bytes(chunk, slots)
        stride = _SLOT_HEADER_BYTES + _align(chunk)
        self.ctrl, self.slot_header, self.payload = [], [], []
        self.stride = stride
        for k in range(world_size - 1):
            base = _SEGMENT_HEADER_BYTES + k * rb
            self.ctrl.append(np.ndarray((16,), np.int64, buffer=self.mm, offset=base))
            self.slot_header.append(
                np.ndarray((slots, 4), np.int64, buffer=self.mm, offset=base + _CTRL_BYTES,
                           strides=(stride, 8))
            )
            self.payload.append(
                np.ndarray((slots, chunk), np.uint8, buffer=self.mm,
                           offset=base + _CTRL_BYTES + _SLOT_HEADER_BYTES, strides=(stride, 1))
            )
        self.payload_addr = [int(p.ctypes.data) for p in self.payload]

    def close(self) -> None:
        self.header = None
        self.ctrl = self.slot_header = self.payload = []
        self.payload_addr = []
        try:
            self.mm.close()
        except BufferError:  # a view is still referenced (e.g. by a traceback): GC unmaps it
            pass


