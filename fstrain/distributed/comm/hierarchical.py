"""Hierarchical all-to-all-v: peers on this rank's node over the intra-node transport, the rest across.

One ``all_to_all_single`` with uneven splits over a group that spans several nodes is cut in two
parts that run at the same time and write disjoint slices of the one output:

* **inter-node**: a plain all-to-all over the whole group on the inter-node backend (gloo on CPU,
  NCCL on GPU) in which every split between two ranks of the same node is zero, so only rows that
  cross nodes travel on it. It is issued first, asynchronously;
* **intra-node**: the rows between the ranks of this node on the node-local transport (shared
  memory on CPU, copy engines on GPU), a group of ``L`` ranks numbered by their order in the node;
  a node with one rank only copies its own rows.

The result equals a plain all-to-all (``torch.distributed.all_to_all_single``) of the same
inputs: every row moves exactly once, on one of the two parts (:func:`plan_route`). Rows bound
for one part are gathered into one contiguous buffer unless they already are one (the usual
case: torchrun numbers the ranks of a node consecutively, so a node's rows are one slice of the
input and of the output, used in place).

**Node membership** comes from a key every rank publishes (:func:`node_key`: hostname + kernel
boot id, or ``$FSTRAIN_NODE_ID`` when set, so tests can split one machine into several "nodes").
The process groups publish the keys in their store and every rank builds the same
:class:`NodeLayout` from the same keys; an all-reduce then checks, before the first collective,
that every rank holds the same layout and built its node-local transport (module users:
:class:`fstrain.distributed.comm.process_group.ShmProcessGroup`,
:class:`~fstrain.distributed.comm.process_group.CopyEngineProcessGroup`).

Notation: ``W`` ranks in the group, ``L`` ranks on this node, splits in rows (dim 0).
"""

from __future__ import annotations

import itertools
import os
import socket
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fstrain.distributed.comm.base import CommBackend, check_splits, is_dense

__all__ = ["NODE_ID_ENV", "HierarchicalAllToAll", "NodeLayout", "Route", "gather_rows", "is_dense", "node_key",
           "plan_route", "scatter_rows"]

#: environment variable that overrides the node key (tests: several "nodes" on one machine).
NODE_ID_ENV = "FSTRAIN_NODE_ID"


def node_key() -> str:
    """This process's node identity: ``$FSTRAIN_NODE_ID`` when set, else hostname + kernel boot id.

    The boot id tells apart two machines that share a hostname (containers, cloned images);
    processes of one machine get the same key. Read at every call (a group built later sees a
    changed override).
    """
    override = os.environ.get(NODE_ID_ENV, "").strip()
    if override:
        return f"env:{override}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Which node each rank of a group is on, seen from one rank.

    Attributes:
        node_of: ``[W]`` node index of every rank; nodes are numbered in order of their lowest rank.
        rank: this rank in the group.
    """

    node_of: tuple[int, ...]
    rank: int

    @classmethod
    def from_keys(cls, keys: Sequence[str], rank: int) -> NodeLayout:
        """Layout from every rank's :func:`node_key` (``keys[r]`` for rank ``r``)."""
        index: dict[str, int] = {}
        return cls(tuple(index.setdefault(k, len(index)) for k in keys), rank)

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def nodes(self) -> list[list[int]]:
        """Ranks of every node, ascending, nodes in order of their lowest rank."""
        return [[r for r, n in enumerate(self.node_of) if n == node] for node in range(self.num_nodes)]

    @property
    def node_index(self) -> int:
        return self.node_of[self.rank]

    @property
    def local_ranks(self) -> list[int]:
        """Ranks on this rank's node (ascending); position ``i`` is rank ``i`` of the node-local transport."""
        return [r for r, n in enumerate(self.node_of) if n == self.node_index]

    @property
    def remote_ranks(self) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n != self.node_index]

    @property
    def local_index(self) -> int:
        return self.local_ranks.index(self.rank)

    def digest(self) -> int:
        """A 31-bit checksum of ``node_of`` (equal layouts, equal digests), for the agreement all-reduce."""
        return zlib.crc32(",".join(map(str, self.node_of)).encode()) & 0x7FFF_FFFF


@dataclass(frozen=True, slots=True)
class Route:
    """How one rank's all-to-all-v splits into its intra-node and inter-node parts.

    Attributes:
        local_ranks: ``[L]`` ranks of this node (the intra-node transport's rank order).
        remote_ranks: the other ranks, ascending.
        intra_input_splits: ``[L]`` rows sent to each rank of this node.
        intra_output_splits: ``[L]`` rows received from each rank of this node.
        inter_input_splits: ``[W]`` rows sent over the inter-node backend (0 for ranks of this node).
        inter_output_splits: ``[W]`` rows received over it (0 for ranks of this node).
        send_offsets: ``[W + 1]`` row offset of each destination's rows in the input.
        recv_offsets: ``[W + 1]`` row offset of each source's rows in the output.
    """

    local_ranks: list[int]
    remote_ranks: list[int]
    intra_input_splits: list[int]
    intra_output_splits: list[int]
    inter_input_splits: list[int]
    inter_output_splits: list[int]
    send_offsets: list[int]
    recv_offsets: list[int]


def plan_route(layout: NodeLayout, input_splits: Sequence[int], output_splits: Sequence[int]) -> Route:
    """Split an all-to-all-v's splits into the node-local and the cross-node part.

    Args:
        layout: the group's node layout, seen from this rank.
        input_splits: ``[W]`` rows this rank sends to each rank.
        output_splits: ``[W]`` rows this rank receives from each rank.

    Returns:
        the :class:`Route`; every row is on exactly one part, so ``sum(intra) + sum(inter)`` equals
        the total on both sides.
    """
    local, remote = layout.local_ranks, layout.remote_ranks
    mine = set(local)
    ins, outs = [int(s) for s in input_splits], [int(s) for s in output_splits]
    return Route(
        local_ranks=local, remote_ranks=remote,
        intra_input_splits=[ins[r] for r in local], intra_output_splits=[outs[r] for r in local],
        inter_input_splits=[0 if r in mine else s for r, s in enumerate(ins)],
        inter_output_splits=[0 if r in mine else s for r, s in enumerate(outs)],
        send_offsets=list(itertools.accumulate(ins, initial=0)),
        recv_offsets=list(itertools.accumulate(outs, initial=0)))


def _one_run(ranks: Sequence[int]) -> bool:
    """Whether ``ranks`` (ascending) are consecutive, i.e. their rows form one slice."""
    return not ranks or ranks[-1] - ranks[0] == len(ranks) - 1


def gather_rows(tensor: torch.Tensor, offsets: Sequence[int], ranks: Sequence[int]) -> torch.Tensor:
    """The rows of ``ranks`` (ascending) from ``tensor``, concatenated in rank order.

    Args:
        tensor: ``[N x D...]``, rows of rank ``p`` at ``[offsets[p], offsets[p + 1])``.
        offsets: ``[W + 1]`` row offsets.
        ranks: which ranks' rows, ascending.

    Returns:
        ``[sum of their rows x D...]``: a view of ``tensor`` when the ranks are consecutive, else a copy.
    """
    if not ranks:
        return tensor[:0]
    if _one_run(ranks):
        return tensor[offsets[ranks[0]]:offsets[ranks[-1] + 1]]
    return torch.cat([tensor[offsets[r]:offsets[r + 1]] for r in ranks])


def scatter_rows(buffer: torch.Tensor, output: torch.Tensor, offsets: Sequence[int], ranks: Sequence[int]) -> None:
    """Inverse of :func:`gather_rows`: copy ``buffer``'s rows to the rows of ``ranks`` in ``output``.

    Nothing is copied when ``buffer`` already is that slice of ``output`` (same storage and offset).
    """
    if not ranks:
        return
    if _one_run(ranks):
        target = output[offsets[ranks[0]]:offsets[ranks[-1] + 1]]
        if target.numel() and target.data_ptr() != buffer.data_ptr():
            target.copy_(buffer)
        return
    at = 0
    for r in ranks:
        n = offsets[r + 1] - offsets[r]
        output[offsets[r]:offsets[r] + n].copy_(buffer[at:at + n])
        at += n


def _receive_buffer(output: torch.Tensor, offsets: Sequence[int], ranks: Sequence[int]) -> torch.Tensor:
    """Where the rows of ``ranks`` are received: the slice of ``output`` itself when it is one, else new."""
    if _one_run(ranks) and is_dense(output):
        return gather_rows(output, offsets, ranks)
    rows = sum(offsets[r + 1] - offsets[r] for r in ranks)
    return torch.empty((rows, *output.shape[1:]), dtype=output.dtype, device=output.device)


#: ``(output, input, output_splits, input_splits) -> Work``: an asynchronous all-to-all over the whole group.
InterNodeAllToAll = Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], object]


class HierarchicalAllToAll:
    """One all-to-all-v over a multi-node group as a node-local and a cross-node part (module doc).

    Args:
        layout: the group's node layout (identical on every rank; the process group checks it).
        intra: the node-local transport over ``layout.local_ranks`` (rank ``i`` of it is
            ``local_ranks[i]``), or ``None`` when this node has one rank.
        inter: issues the cross-node all-to-all over the whole group and returns a ``Work``
            (``wait()`` makes the result usable: host-complete on gloo, stream-ordered on NCCL).

    Attributes:
        num_calls: all-to-alls run.
        intra_rows, inter_rows: rows this rank received over each part (own rows count as intra).
    """

    def __init__(self, layout: NodeLayout, intra: CommBackend | None, inter: InterNodeAllToAll):
        if intra is not None and (intra.world_size, intra.rank) != (len(layout.local_ranks), layout.local_index):
            raise ValueError(f"the intra-node transport is rank {intra.rank} of {intra.world_size}; the layout "
                             f"puts this rank at {layout.local_index} of {len(layout.local_ranks)}")
        if intra is None and len(layout.local_ranks) > 1:
            raise ValueError(f"{len(layout.local_ranks)} ranks on this node need an intra-node transport")
        self.layout = layout
        self.intra = intra
        self.inter = inter
        self.num_calls = 0
        self.intra_rows = 0
        self.inter_rows = 0

    def __call__(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                 input_splits: Sequence[int]) -> torch.Tensor:
        """``output`` <- the all-to-all-v of ``input`` (semantics of ``all_to_all_single``).

        Args:
            output: ``[sum(output_splits) x D...]``, ``input``'s dtype and device (any strides).
            input: ``[sum(input_splits) x D...]``.
            output_splits: ``[W]`` rows received from each rank.
            input_splits: ``[W]`` rows sent to each rank.

        Returns:
            ``output``.

        Raises:
            ValueError: local splits do not match the tensors.
            CommError: from either part (split mismatch, peer timeout or exit).
        """
        layout = self.layout
        if not is_dense(output):  # e.g. a column slice: receive contiguously, then copy
            output.copy_(self(torch.empty(output.shape, dtype=output.dtype, device=output.device), input,
                              output_splits, input_splits))
            return output
        check_splits(input, output_splits, input_splits, layout.world_size, output, layout.rank)
        route = plan_route(layout, input_splits, output_splits)
        input = input.contiguous()
        # cross-node part first, asynchronously: it overlaps the node-local part below
        inter_in = gather_rows(input, route.send_offsets, route.remote_ranks).contiguous()
        inter_out = _receive_buffer(output, route.recv_offsets, route.remote_ranks)
        work = self.inter(inter_out, inter_in, route.inter_output_splits, route.inter_input_splits)
        intra_in = gather_rows(input, route.send_offsets, route.local_ranks).contiguous()
        intra_out = _receive_buffer(output, route.recv_offsets, route.local_ranks)
        if self.intra is None:  # alone on the node: only the own rows
            intra_out.copy_(intra_in)
        else:
            self.intra.all_to_all_v(intra_in, route.intra_output_splits, route.intra_input_splits, out=intra_out)
        scatter_rows(intra_out, output, route.recv_offsets, route.local_ranks)
        work.wait()
        scatter_rows(inter_out, output, route.recv_offsets, route.remote_ranks)
        self.num_calls += 1
        self.intra_rows += sum(route.intra_output_splits)
        self.inter_rows += sum(route.inter_output_splits)
        return output

    def close(self) -> None:
        if self.intra is not None:
            self.intra.close()
