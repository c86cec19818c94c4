"""Copy-engine all-to-all-v between the GPUs of one node (SM-free data movement). NOT RUN ON A GPU YET.

This module has never run: the machines it was written on have no GPU. It is guarded (nothing
touches CUDA until a `CopyEngineBackend` is built) and its tests are marked ``gpu``. The parts
that do not need a GPU (split-matrix check, capability agreement, topology by UUID with a
fake device table) are tested on CPU (``tests/fstrain/test_comm_cuda_ce_cpu.py``).

How it works, per call (all on one dedicated side stream, joined back to the caller's stream):

1. **Metadata.** The split sizes are on the host (torchrec passes them as lists). Each rank copies
   the bytes it sends to and expects from every peer (``2W`` int64, from pinned host memory,
   non-blocking) into the head of its symmetric-memory buffer (``torch.distributed._symmetric_memory``:
   one buffer per rank, mapped into every peer GPU's address space; two slots used alternately),
   ``barrier()`` on channel 1, reads every peer's row and copies the ``W x 2W`` matrix to pinned
   host memory. All of this runs on a high-priority *metadata stream that never waits for the
   caller's stream*, so the one host wait per call (an event on that stream) waits for the
   peers to reach the same call, not for the compute kernels queued before it. Every rank then
   checks the whole matrix (:func:`split_mismatch_message`): a mismatch raises the same
   `SplitMismatchError` on every rank, before any data moves and before any data barrier.
2. **Rounds.** The staging area is cut into ``W`` regions of ``region_bytes``. Per round, each
   rank copies the next ``region_bytes`` of its message for peer ``q`` into region ``q`` of its
   own buffer, ``barrier()``, then *pulls* its part from every peer's region ``rank`` with
   ``tensor.copy_`` between the peer's buffer and its output, ``barrier()`` (so the next round may
   overwrite). A copy between tensors on different GPUs with peer access is a
   ``cudaMemcpyAsync`` peer transfer, which the driver executes on a copy engine: no SM runs it.
3. **Chunking.** Pulls are issued as ``chunk_bytes`` pieces, round-robin over peers, so the copy
   engines (shared with host-device copies and priority-blind) never hold one huge transfer in
   front of an urgent one.

SM use that remains: ``barrier()`` is a one-block kernel, the staging copy of the input into the
symmetric buffer is a device-to-device copy (avoidable if the caller allocates its input in
symmetric memory; not done yet), and the metadata read is a tiny copy.

Fallback, agreed by all ranks: each rank decides locally whether it can use copy engines
(:func:`copy_engine_reason`: every peer's GPU, identified by its UUID, is visible here and
reachable by peer access; symmetric memory can be allocated), then one all-reduce (MIN) of that
flag (:func:`agree`) decides for everyone, so no rank falls back to NCCL while its peers wait
in a copy-engine barrier. A second flag after the symmetric-memory rendezvous covers a
rendezvous that fails on one rank. Across nodes every call goes to NCCL (hierarchical
copy-engine-inside / NCCL-across is not built yet).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from fstrain.distributed.comm.base import (BackendUnavailableError, CommBackend, SplitMismatchError, allocate_output,
                                           check_splits)

logger = logging.getLogger(__name__)

__all__ = ["CopyEngineBackend", "agree", "copy_engine_reason", "plan_rounds", "split_mismatch_message"]

_META_BYTES = 4096  # head of the buffer: 2 slots x 2W int64 byte counts (W <= 128)
_MAX_RANKS = _META_BYTES // (2 * 2 * 8)
_DATA_CHANNEL, _META_CHANNEL = 0, 1


def split_mismatch_message(send_bytes: Sequence[Sequence[int]], recv_bytes: Sequence[Sequence[int]]) -> str | None:
    """The error every rank raises when the ranks disagree on an all-to-all's sizes, or ``None``.

    Computed from the whole matrix, which every rank holds after the metadata exchange, so every
    rank produces the same message.

    Args:
        send_bytes: ``W x W``; ``[p][q]`` bytes rank ``p`` sends to rank ``q``.
        recv_bytes: ``W x W``; ``[q][p]`` bytes rank ``q`` expects from rank ``p``.

    Returns:
        One line naming every disagreeing pair, or ``None`` when all agree.
    """
    w = len(send_bytes)
    bad = [(p, q, send_bytes[p][q], recv_bytes[q][p]) for p in range(w) for q in range(w)
           if send_bytes[p][q] != recv_bytes[q][p]]
    if not bad:
        return None
    pairs = "; ".join(f"rank {p} sends {s} bytes to rank {q}, which expects {r}" for p, q, s, r in bad[:8])
    more = f" (and {len(bad) - 8} more pairs)" if len(bad) > 8 else ""
    return (f"all-to-all split sizes disagree across ranks: {pairs}{more}; the ranks disagree on split sizes "
            "or on the row shape/dtype")


def agree(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """One all-reduce (MIN) of a capability flag: ``True`` only if every rank of ``group`` is ``ok``.

    Args:
        ok: this rank's flag.
        group: the process group (any backend; the flag tensor lives on ``device``).
        device: where the flag tensor lives (``cuda`` for NCCL, ``cpu`` for gloo).
    """
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(int(flag.item()))


def copy_engine_reason(my_index: int, peer_uuids: Sequence[str], visible_uuids: Sequence[str],
                       can_access_peer=None) -> str | None:
    """Why this rank cannot reach every peer's GPU over copy engines (``None``: it can).

    Topology by device UUID, not hostname + index: a peer's GPU counts as local when its UUID is
    among this process's visible devices (so per-process ``CUDA_VISIBLE_DEVICES`` and
    containers are handled), and it must be reachable by peer access. Two ranks on the same GPU
    (same UUID) need no peer access.

    Args:
        my_index: this rank's device index (in this process's numbering).
        peer_uuids: the UUID of every rank's GPU (``[r]`` for rank ``r``).
        visible_uuids: UUIDs of this process's visible devices (``[i]`` for ``cuda:i``).
        can_access_peer: ``(i, j) -> bool``; default ``torch.cuda.can_device_access_peer``.
    """
    can_access_peer = can_access_peer or torch.cuda.can_device_access_peer
    index_of = {u: i for i, u in enumerate(visible_uuids)}
    for r, u in enumerate(peer_uuids):
        j = index_of.get(u)
        if j is None:
            return (f"rank {r}'s GPU {u} is not visible to this process (another node, or CUDA_VISIBLE_DEVICES "
                    "hides it)")
        if j != my_index and not can_access_peer(my_index, j):
            return f"no peer access from cuda:{my_index} to rank {r}'s GPU (cuda:{j})"
    return None


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def plan_rounds(bytes_matrix: Sequence[Sequence[int]], region_bytes: int) -> int:
    """Rounds needed so every pair's message fits ``region_bytes`` per round.

    Args:
        bytes_matrix: ``W x W``; entry ``[p][q]`` is the bytes rank ``p`` sends to rank ``q``.
        region_bytes: staging bytes per peer per round (> 0).

    Returns:
        ``max_{p != q} ceil(bytes[p][q] / region_bytes)`` (0 when nothing crosses ranks).
    """
    w = len(bytes_matrix)
    return max((math.ceil(bytes_matrix[p][q] / region_bytes)
                for p in range(w) for q in range(w) if p != q), default=0)


class CopyEngineBackend(CommBackend):
    """All-to-all-v over copy engines inside one NVLink/PCIe node, NCCL otherwise.

    Args:
        group: an NCCL process group (or the ``fs_cuda_ce`` group of
            :class:`fstrain.distributed.comm.process_group.CopyEngineProcessGroup`) whose ranks each drive
            one GPU (the current device).
        config: transport settings.
        peer_uuids: the UUID of every rank's GPU, when the caller already has them (the process
            group exchanges them through its store); default: gathered over ``group``.

    Raises:
        BackendUnavailableError: CUDA is not available, or the group is not usable at all.
    """

    name = "cuda-ce"

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of the copy-engine transport."""

        buffer_bytes: int = 256 << 20
        """Symmetric staging buffer per rank, bytes; ``buffer_bytes // world_size`` per peer per
        round. Larger means fewer rounds (barriers) for big messages."""
        chunk_bytes: int = 4 << 20
        """Largest single peer copy, bytes: bounds how long an urgent copy can queue behind this
        exchange on a copy engine."""
        stream_priority: int = 0
        """CUDA priority of the side stream (lower is more urgent; -1 for embedding traffic that
        gates the next step)."""
        barrier_timeout_ms: int = 60_000
        """Timeout of each symmetric-memory barrier, milliseconds (0 = wait forever)."""
        force_nccl: bool = False
        """Skip the copy-engine path and use NCCL kernels (for A/B comparisons)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 config: CopyEngineBackend.Config | None = None, peer_uuids: Sequence[str] | None = None):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("backend 'cuda-ce' needs CUDA; use 'shm' or 'gloo' on CPU")
        self.group = group or dist.group.WORLD
        super().__init__(rank=dist.get_rank(self.group), world_size=dist.get_world_size(self.group))
        self.config = cfg = config or CopyEngineBackend.Config()
        if self.world_size > _MAX_RANKS:
            raise ValueError(f"cuda-ce supports at most {_MAX_RANKS} ranks per group")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device, priority=cfg.stream_priority)
        # metadata: its own high-priority stream that never waits for the caller's stream
        self.meta_stream = torch.cuda.Stream(device=self.device, priority=-1)
        w = self.world_size
        self._meta_in = torch.empty(2 * w, dtype=torch.int64, pin_memory=True)
        self._meta_out = torch.empty(w, 2 * w, dtype=torch.int64, pin_memory=True)
        self._meta_dev = torch.empty(w, 2 * w, dtype=torch.int64, device=self.device)
        self._calls = 0
        self.region_bytes = (cfg.buffer_bytes // self.world_size) // 256 * 256
        self._hdl = None
        self._buf = None
        reason = "force_nccl is set" if cfg.force_nccl else self._local_blocker(peer_uuids)
        if reason is None:  # local part that can fail: the allocation
            try:
                from torch.distributed import _symmetric_memory as symm_mem

                self._buf = symm_mem.empty(_META_BYTES + self.world_size * self.region_bytes,
                                           dtype=torch.uint8, device=self.device)
            except Exception as e:  # noqa: BLE001 - missing driver support, old torch, ...
                reason = f"symmetric memory allocation failed: {e}"
        if not agree(reason is None, self.group, self.device):  # every rank takes the same path
            reason = reason or "another rank cannot use copy engines (see its warning)"
        elif reason is None:
            try:
                from torch.distributed import _symmetric_memory as symm_mem

                self._hdl = symm_mem.rendezvous(self._buf, self.group)
            except Exception as e:  # noqa: BLE001
                reason = f"symmetric memory rendezvous failed: {e}"
            if not agree(reason is None, self.group, self.device):
                reason = reason or "symmetric memory rendezvous failed on another rank"
        self.uses_copy_engines = reason is None
        self.fallback_reason = reason
        if reason is not None:
            self._hdl = self._buf = None
            warnings.warn(f"cuda-ce falls back to NCCL kernels: {reason}", stacklevel=2)

    def _local_blocker(self, peer_uuids: Sequence[str] | None) -> str | None:
        """Why this rank cannot use copy engines (local decision; :func:`agree` makes it global)."""
        if peer_uuids is None:
            peer_uuids = [None] * self.world_size
            dist.all_gather_object(peer_uuids, _device_uuid(self.device.index), group=self.group)
        visible = [_device_uuid(i) for i in range(torch.cuda.device_count())]
        return copy_engine_reason(self.device.index, list(peer_uuids), visible)

    def all_to_all_v(
        self,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `CommBackend.all_to_all_v`. CUDA tensors on the current device.

        The result is ready on the caller's current stream (it waits on the side stream). The
        host waits once per call, for the peers' split metadata only (module doc, step 1).

        Raises:
            ValueError: bad local splits or a tensor on another device.
            SplitMismatchError: the ranks disagree on sizes; raised on every rank, same message.
        """
        check_splits(input, output_splits, input_splits, self.world_size, out, self.rank)
        if input.device != self.device:
            raise ValueError(f"input is on {input.device}; this rank drives {self.device}")
        output = allocate_output(input, output_splits) if out is None else out
        input = input.contiguous()
        if not self.uses_copy_engines:
            with record_function("## nccl_all_to_all_v ##"):
                dist.all_to_all_single(output, input, list(output_splits), list(input_splits),
                                       group=self.group)
            return output
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        send_bytes = [int(s) * row_bytes for s in input_splits]
        recv_bytes = [int(s) * row_bytes for s in output_splits]
        with record_function("## cuda_ce_meta ##"):
            matrix = self._exchange_meta(send_bytes, recv_bytes)
        w = self.world_size
        message = split_mismatch_message([row[:w] for row in matrix], [row[w:] for row in matrix])
        if message is not None:
            raise SplitMismatchError(message)
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream), record_function("## cuda_ce_all_to_all_v ##"):
            self._exchange(input, output, send_bytes, recv_bytes, [row[:w] for row in matrix])
        caller.wait_stream(self.stream)
        input.record_stream(self.stream)
        output.record_stream(self.stream)
        return output

    def _exchange_meta(self, send_bytes: list[int], recv_bytes: list[int]) -> list[list[int]]:
        """Every rank's ``send_bytes + recv_bytes`` row (``W x 2W``), via symmetric memory on the
        metadata stream (never ordered after the caller's stream)."""
        hdl, w = self._hdl, self.world_size
        slot = (self._calls % 2) * 2 * w  # alternate slots: a slow peer may still read the last call's
        self._calls += 1
        self._meta_in.copy_(torch.tensor(send_bytes + recv_bytes, dtype=torch.int64))
        with torch.cuda.stream(self.meta_stream):
            hdl.get_buffer(self.rank, (2 * w,), torch.int64, slot).copy_(self._meta_in, non_blocking=True)
            hdl.barrier(channel=_META_CHANNEL, timeout_ms=self.config.barrier_timeout_ms)
            for p in range(w):
                self._meta_dev[p].copy_(hdl.get_buffer(p, (2 * w,), torch.int64, slot))
            self._meta_out.copy_(self._meta_dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.meta_stream)
        done.synchronize()  # the one host wait: peers' metadata, not the compute queue
        return self._meta_out.tolist()

    def _exchange(self, input: torch.Tensor, output: torch.Tensor, send_bytes: list[int], recv_bytes: list[int],
                  matrix: list[list[int]]) -> None:
        hdl, rank, w, cfg = self._hdl, self.rank, self.world_size, self.config
        send_off = [0, *torch.tensor(send_bytes).cumsum(0).tolist()]
        recv_off = [0, *torch.tensor(recv_bytes).cumsum(0).tolist()]
        src = input.reshape(-1).view(torch.uint8)
        dst = output.reshape(-1).view(torch.uint8)
        dst[recv_off[rank]:recv_off[rank + 1]].copy_(src[send_off[rank]:send_off[rank + 1]])
        region = self.region_bytes
        num_rounds = plan_rounds(matrix, region)  # the same on every rank: the same matrix
        for rnd in range(num_rounds):
            base = rnd * region
            with record_function("## cuda_ce_stage ##"):
                for q in range(w):
                    n = max(0, min(region, send_bytes[q] - base))
                    if q != rank and n:
                        lo = _META_BYTES + q * region
                        self._buf[lo:lo + n].copy_(src[send_off[q] + base:send_off[q] + base + n])
                hdl.barrier(channel=_DATA_CHANNEL, timeout_ms=cfg.barrier_timeout_ms)
            with record_function("## cuda_ce_pull ##"):
                # (peer, offset inside this round, bytes) pieces, interleaved over peers.
                pieces = []
                for step in range(1, w):
                    p = (rank - step) % w
                    n = max(0, min(region, recv_bytes[p] - base))
                    pieces.append([(p, o, min(cfg.chunk_bytes, n - o))
                                   for o in range(0, n, cfg.chunk_bytes)])
                for wave in range(max((len(x) for x in pieces), default=0)):
                    for per_peer in pieces:
                        if wave < len(per_peer):
                            p, o, n = per_peer[wave]
                            remote = hdl.get_buffer(p, (n,), torch.uint8,
                                                    _META_BYTES + rank * region + o)
                            at = recv_off[p] + base + o
                            dst[at:at + n].copy_(remote)
                hdl.barrier(channel=_DATA_CHANNEL, timeout_ms=cfg.barrier_timeout_ms)
