"""The prioritized pipeline's fused messages: few all-to-alls per step, each carrying several parts.

Two messages replace five separate all-to-alls of the background job (counts, ids, masks, NOL
rows, deferred gradient):

* :class:`IdExchange` (requester -> owner): per peer a fixed-capacity slot of ids with a two-word
  header (the true count, and the sender's largest count to any peer), followed by the rows'
  held gradient of the previous step. Every receive size is known in advance, so counts and ids
  travel in one call. The capacity is the same on every rank: every rank reads every sender's
  largest count from the headers, so all ranks see the same global maximum, grow the capacity
  the same way and agree whether an overflow round (the ids past the capacity, one more
  all-to-all with exact sizes) is needed. It starts at 0 (the first exchange always overflows)
  and grows to ``ceil(growth x`` the largest count seen ``)``.
* :func:`pack_replies` / :func:`unpack_replies` (owner -> requester): per peer the OL flags of
  the ids it requested, the keep flags of the ids it requested in the previous batch, and the
  current rows of *all* requested ids (the OL ones are replaced after the update), as one buffer
  of the rows' dtype (flags as 0/1, exact in every float type).

``a2a(x, send, recv)`` is the caller's uneven all-to-all of the rows of ``x`` (``send[r]`` rows to
rank r, ``recv[r]`` from r), e.g. :meth:`fstrain.pipelines.prioritized.PrioritizedPipeline._all_to_all`
bound to a process group; each function here issues it once (twice on an id overflow).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["IdExchange", "pack_replies", "segment_counts", "unpack_replies"]

AllToAll = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]

_HEADER = 2  # int64 words per peer: [count, sender's largest count to any peer]
_WORD = 8  # bytes per int64


def segment_counts(flags: torch.Tensor, counts: list[int]) -> list[int]:
    """Number of True ``flags`` in each consecutive segment of sizes ``counts``."""
    return [int(s.sum()) for s in torch.split(flags, counts)] if flags.numel() else [0] * len(counts)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.clone().view(dtype)  # clone: a fresh, aligned buffer whatever the slice's offset


class IdExchange:
    """Counts, ids and the held gradient rows to their owners in one all-to-all (see the module doc).

    Args:
        world_size: ranks in the group (``R``).
        growth: capacity headroom over the largest per-peer count seen (>= 1).

    Attributes:
        capacity: id slots per peer (int64 each), the same on every rank.
        num_exchanges, num_overflows: calls made, and those that needed the overflow round.
    """

    def __init__(self, world_size: int, growth: float = 1.25) -> None:
        self.world_size = world_size
        self.growth = growth
        self.capacity = 0
        self.num_exchanges = 0
        self.num_overflows = 0

    def exchange(self, a2a: AllToAll, ids: torch.Tensor, owner: torch.Tensor, grad: torch.Tensor,
                 grad_send: list[int], grad_recv: list[int]) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """Send ``ids`` to their owners and ``grad`` rows to theirs (collective on ``a2a``'s group).

        Args:
            ids: ``[U]`` int64, grouped by owner in rank order (sorted unique ids under row-wise sharding).
            owner: ``[U]`` int64, the owning rank of each id (CPU).
            grad: ``[G x d]`` float rows, ``grad_send[r]`` of them for rank r (``G`` may be 0, ``d`` not);
                ``grad_recv[r]`` rows come from rank r (the caller knows both from earlier exchanges).

        Returns:
            ``(send, recv, recv_ids, recv_grad)``: ids sent to / received from each rank (lists of
            ``R`` ints), the received ids ``[sum(recv)]`` (int64, on ``ids``' device, grouped by
            sender) and gradient rows ``[sum(grad_recv) x d]`` (``grad``'s dtype).
        """
        R, C, dev = self.world_size, self.capacity, ids.device
        send_t = torch.bincount(owner, minlength=R)
        send = send_t.tolist()
        slots = torch.zeros(R, _HEADER + C, dtype=torch.int64)
        slots[:, 0] = send_t
        slots[:, 1] = max(send)
        starts = torch.cumsum(send_t, 0) - send_t
        pos = torch.arange(owner.numel()) - starts[owner]
        fits = pos < C
        ids_cpu = ids.cpu()
        slots[owner[fits], _HEADER + pos[fits]] = ids_cpu[fits]
        slots = slots.to(dev)
        d = grad.shape[1]
        row_bytes = d * grad.element_size()
        gparts = torch.split(grad, grad_send)
        buf = torch.cat([p for r in range(R) for p in (_as_bytes(slots[r]), _as_bytes(gparts[r]))])
        slot_bytes = _WORD * (_HEADER + C)
        got = a2a(buf, [slot_bytes + row_bytes * g for g in grad_send],
                  [slot_bytes + row_bytes * g for g in grad_recv])
        segs = torch.split(got, [slot_bytes + row_bytes * g for g in grad_recv])
        recv_slots = [_from_bytes(s[:slot_bytes], torch.int64) for s in segs]
        recv = [int(s[0]) for s in recv_slots]
        global_max = max(int(s[1]) for s in recv_slots)  # the same on every rank
        recv_grad = torch.cat([_from_bytes(s[slot_bytes:], grad.dtype) for s in segs]).view(-1, d)
        parts = [s[_HEADER:_HEADER + min(n, C)] for s, n in zip(recv_slots, recv)]
        self.num_exchanges += 1
        if global_max > C:  # every rank takes this branch together
            self.num_overflows += 1
            over = ids_cpu[~fits].to(dev)
            got_over = torch.split(a2a(over, [max(0, n - C) for n in send], [max(0, n - C) for n in recv]),
                                   [max(0, n - C) for n in recv])
            parts = [p for r in range(R) for p in (parts[r], got_over[r])]
            self.capacity = math.ceil(self.growth * global_max)
        recv_ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=dev)
        return send, recv, recv_ids, recv_grad


def pack_replies(recv_ol: torch.Tensor, recv: list[int], keep: torch.Tensor | None, keep_recv: list[int] | None,
                 rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The owner's reply to each requester as one buffer: ``(buffer, send sizes)`` for ``a2a``.

    Args:
        recv_ol: ``[M]`` bool, OL flag of each id received (``recv[r]`` from rank r).
        keep: ``[M_prev]`` bool, keep flag of each id received in the previous batch (``keep_recv[r]``
            from rank r), or ``None`` when there is no previous batch.
        rows: ``[M x d]`` current rows of every received id.
    """
    R = len(recv)
    keep_recv = keep_recv or [0] * R
    flags = torch.split(recv_ol.to(rows.dtype), recv)
    keeps = torch.split(keep.to(rows.dtype), keep_recv) if keep is not None else [rows.new_zeros(0)] * R
    segs = torch.split(rows, recv)
    d = rows.shape[1]
    buf = torch.cat([p for r in range(R) for p in (flags[r].to(rows.device), keeps[r].to(rows.device),
                                                      segs[r].reshape(-1))])
    return buf, [recv[r] * (1 + d) + keep_recv[r] for r in range(R)]


def unpack_replies(a2a: AllToAll, buf: torch.Tensor, send_sizes: list[int], sent: list[int],
                   keep_sent: list[int] | None, d: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Exchange the replies (one call of ``a2a``) and split them on the requester.

    Args:
        buf, send_sizes: :func:`pack_replies`'s result on this rank.
        sent: ids this rank sent to each owner; ``keep_sent``: the same for the previous batch
            (``None`` without one).

    Returns:
        ``(ol_mask [U] bool, keep [U_prev] bool or None, rows [U x d])``, on the CPU for the masks
        and on ``buf``'s device for the rows.
    """
    R = len(sent)
    ks = keep_sent or [0] * R
    got = a2a(buf, send_sizes, [sent[r] * (1 + d) + ks[r] for r in range(R)])
    parts = torch.split(got, [n for r in range(R) for n in (sent[r], ks[r], sent[r] * d)])
    ol = torch.cat([parts[3 * r] for r in range(R)]).cpu() > 0.5
    keep = torch.cat([parts[3 * r + 1] for r in range(R)]).cpu() > 0.5 if keep_sent is not None else None
    rows = torch.cat([parts[3 * r + 2] for r in range(R)]).view(-1, d)
    return ol, keep, rows
