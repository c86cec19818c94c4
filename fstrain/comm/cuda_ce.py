"""Copy-engine all-to-all-v between the GPUs of one node (SM-free data movement). UNTESTED.

This module has never run: the machines it was written on have no GPU. It is guarded (nothing
touches CUDA until a `CopyEngineBackend` is built) and its tests are marked ``gpu``.

How it works, per call (all on one dedicated side stream, joined back to the caller's stream):

1. **Metadata.** Each rank writes the bytes it sends to every peer (``W`` int64) into the head of
   its symmetric-memory buffer (``torch.distributed._symmetric_memory``: one buffer per rank,
   mapped into every peer GPU's address space), ``barrier()``, reads the ``W x W`` byte matrix
   from all peers and copies it to the host (one small sync). Every rank now knows every pair's
   size, checks its own receive sizes, and computes the same number of rounds.
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
symmetric memory; not done yet), and the metadata read is a tiny copy plus a host sync.

Fallback: when the ranks span several nodes, peer access is missing, or symmetric memory cannot
be set up, every call goes to NCCL's ``all_to_all_single`` (SM kernels) with a warning at build.
"""

from __future__ import annotations

import logging
import math
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from fstrain.comm.base import (
    BackendUnavailableError,
    CommBackend,
    SplitMismatchError,
    allocate_output,
    check_splits,
)

logger = logging.getLogger(__name__)

__all__ = ["CopyEngineBackend", "plan_rounds"]

_META_BYTES = 4096  # head of the buffer: W int64 byte counts (W <= 512)


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
        group: an NCCL process group whose ranks each drive one GPU (the current device).
        config: transport settings.

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
                 config: CopyEngineBackend.Config | None = None):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("backend 'cuda-ce' needs CUDA; use 'shm' or 'gloo' on CPU")
        self.group = group or dist.group.WORLD
        super().__init__(rank=dist.get_rank(self.group), world_size=dist.get_world_size(self.group))
        self.config = cfg = config or CopyEngineBackend.Config()
        if self.world_size * 8 > _META_BYTES:
            raise ValueError(f"cuda-ce supports at most {_META_BYTES // 8} ranks per group")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device, priority=cfg.stream_priority)
        self.region_bytes = (cfg.buffer_bytes // self.world_size) // 256 * 256
        self._hdl = None
        reason = "force_nccl is set" if cfg.force_nccl else self._copy_engine_blocker()
        if reason is None:
            try:
                from torch.distributed import _symmetric_memory as symm_mem

                self._buf = symm_mem.empty(_META_BYTES + self.world_size * self.region_bytes,
                                           dtype=torch.uint8, device=self.device)
                self._hdl = symm_mem.rendezvous(self._buf, self.group)
            except Exception as e:  # missing driver support, old torch, ...
                reason = f"symmetric memory rendezvous failed: {e}"
        self.uses_copy_engines = reason is None
        if reason is not None:
            warnings.warn(f"cuda-ce falls back to NCCL kernels: {reason}", stacklevel=2)

    def _copy_engine_blocker(self) -> str | None:
        """Why the copy-engine path cannot run (collective over the group), or None."""
        mine = (socket.gethostname(), self.device.index)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        hosts = {h for h, _ in everyone}
        if len(hosts) > 1:
            return f"ranks span {len(hosts)} nodes"
        me = self.device.index
        no_p2p = [d for _, d in everyone if d != me and not torch.cuda.can_device_access_peer(me, d)]
        local_ok = torch.tensor([0 if no_p2p else 1], device=self.device)
        dist.all_reduce(local_ok, op=dist.ReduceOp.MIN, group=self.group)
        if not int(local_ok.item()):
            return "some GPU pairs have no peer access"
        return None

    def all_to_all_v(
        self,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `CommBackend.all_to_all_v`. CUDA tensors on the current device.

        The result is ready on the caller's current stream (it waits on the side stream).

        Raises:
            ValueError: bad local splits or a tensor on another device.
            SplitMismatchError: a peer sends a different byte count than ``output_splits`` says.
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
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream), record_function("## cuda_ce_all_to_all_v ##"):
            self._exchange(input, output, output_splits, input_splits)
        caller.wait_stream(self.stream)
        input.record_stream(self.stream)
        output.record_stream(self.stream)
        return output

    def _exchange(self, input: torch.Tensor, output: torch.Tensor,
                  output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        hdl, rank, w, cfg = self._hdl, self.rank, self.world_size, self.config
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        send_bytes = [int(s) * row_bytes for s in input_splits]
        recv_bytes = [int(s) * row_bytes for s in output_splits]
        send_off = [0, *torch.tensor(send_bytes).cumsum(0).tolist()]
        recv_off = [0, *torch.tensor(recv_bytes).cumsum(0).tolist()]
        src = input.reshape(-1).view(torch.uint8)
        dst = output.reshape(-1).view(torch.uint8)
        with record_function("## cuda_ce_meta ##"):
            hdl.get_buffer(rank, (w,), torch.int64).copy_(
                torch.tensor(send_bytes, dtype=torch.int64), non_blocking=False)
            hdl.barrier(channel=0, timeout_ms=cfg.barrier_timeout_ms)
            meta = torch.empty((w, w), dtype=torch.int64, device=self.device)
            for p in range(w):
                meta[p].copy_(hdl.get_buffer(p, (w,), torch.int64))
            matrix = meta.cpu().tolist()  # syncs the side stream only
        got = [matrix[p][rank] for p in range(w)]
        if got != recv_bytes:
            raise SplitMismatchError(
                f"rank {rank} expects {recv_bytes} bytes from ranks 0..{w - 1} but they send {got};"
                " the ranks disagree on split sizes or row shape/dtype")
        dst[recv_off[rank]:recv_off[rank + 1]].copy_(src[send_off[rank]:send_off[rank + 1]])
        region = self.region_bytes
        num_rounds = plan_rounds(matrix, region)
        if num_rounds == 0:  # no later barrier: keep peers from overwriting unread metadata
            hdl.barrier(channel=0, timeout_ms=cfg.barrier_timeout_ms)
        for rnd in range(num_rounds):
            base = rnd * region
            with record_function("## cuda_ce_stage ##"):
                for q in range(w):
                    n = max(0, min(region, send_bytes[q] - base))
                    if q != rank and n:
                        lo = _META_BYTES + q * region
                        self._buf[lo:lo + n].copy_(src[send_off[q] + base:send_off[q] + base + n])
                hdl.barrier(channel=0, timeout_ms=cfg.barrier_timeout_ms)
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
                hdl.barrier(channel=0, timeout_ms=cfg.barrier_timeout_ms)
