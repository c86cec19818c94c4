"""The `CommBackend` interface for the embedding all-to-all, its errors and split checks.

Notation used in shapes: ``N_in = sum(input_splits)`` rows sent, ``N_out = sum(output_splits)``
rows received, ``D...`` the trailing dimensions (embedding dim, possibly none), ``W`` the world
size of the group.

Semantics follow ``torch.distributed.all_to_all_single``: rank ``r`` sends rows
``[sum(input_splits[:p]), sum(input_splits[:p + 1]))`` of its input to rank ``p``, and places the
rows it receives from rank ``p`` at ``[sum(output_splits[:p]), sum(output_splits[:p + 1]))`` of
its output. ``input_splits[p]`` on rank ``r`` must equal ``output_splits[r]`` on rank ``p``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

__all__ = [
    "BackendUnavailableError",
    "CommBackend",
    "CommError",
    "ConcurrentCollectiveError",
    "PeerExitedError",
    "PeerTimeoutError",
    "SplitMismatchError",
    "allocate_output",
    "check_splits",
    "even_splits",
    "is_dense",
]


class CommError(RuntimeError):
    """Base class of every error raised by `fstrain.distributed.comm` during an exchange."""


class BackendUnavailableError(CommError):
    """The requested backend cannot run here (no CUDA, ranks on several nodes, ...)."""


class PeerTimeoutError(CommError, TimeoutError):
    """A peer made no progress within the timeout.

    Attributes:
        peer_rank: rank in the group that was waited on (the first one still pending).
        timeout_seconds: the timeout that expired.
        stage: what was being waited for (``"rendezvous"``, ``"send"``, ``"recv"``).
    """

    def __init__(self, *, peer_rank: int, timeout_seconds: float, stage: str, detail: str = ""):
        self.peer_rank = peer_rank
        self.timeout_seconds = timeout_seconds
        self.stage = stage
        msg = (
            f"peer rank {peer_rank} made no progress for {timeout_seconds:.1f} s during {stage}"
            f"{': ' + detail if detail else ''}. The peer is stuck, crashed, or called a different"
            " collective; check its log, or raise timeout_seconds if it is only slow."
        )
        super().__init__(msg)


class PeerExitedError(CommError):
    """A peer process exited (or aborted its transport) before the exchange finished.

    Attributes:
        peer_rank: rank in the group whose process is gone.
    """

    def __init__(self, *, peer_rank: int, detail: str):
        self.peer_rank = peer_rank
        super().__init__(
            f"peer rank {peer_rank} is gone ({detail}); the exchange cannot complete. "
            "Look at that rank's log for the original failure."
        )


class ConcurrentCollectiveError(CommError):
    """A transport was called from a second thread while a collective was running on it.

    A transport (one per process group) runs one collective at a time, like a process group's
    stream; two threads that share one would also have to issue their collectives in the same
    order on every rank, which nothing can guarantee. Give each thread its own group
    (``dist.new_group``). The running collective is not disturbed.
    """


class SplitMismatchError(CommError, ValueError):
    """Two ranks disagree on how many rows one sends the other, or on the row size.

    Attributes:
        peer_rank: the rank whose message did not match, or None for a local inconsistency.
    """

    def __init__(self, message: str, *, peer_rank: int | None = None):
        self.peer_rank = peer_rank
        super().__init__(message)


def even_splits(num_rows: int, world_size: int) -> list[int]:
    """Equal splits, as `all_to_all_single` uses when no split sizes are given.

    Args:
        num_rows: rows of the tensor (dim 0).
        world_size: number of ranks ``W``.

    Returns:
        ``W`` equal row counts.

    Raises:
        ValueError: ``num_rows`` is not divisible by ``world_size``.
    """
    if num_rows % world_size:
        raise ValueError(
            f"no split sizes given and {num_rows} rows do not divide evenly over "
            f"{world_size} ranks; pass explicit split sizes"
        )
    return [num_rows // world_size] * world_size


def check_splits(
    input: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    world_size: int,
    output: torch.Tensor | None = None,
    rank: int | None = None,
) -> None:
    """Validate local split sizes against the tensors (cheap, no communication).

    Args:
        input: shape [N_in x D...], any dtype.
        output_splits: ``W`` non-negative row counts received from each rank.
        input_splits: ``W`` non-negative row counts sent to each rank.
        world_size: ``W``.
        output: optional preallocated output, shape [N_out x D...], same dtype as ``input``.
        rank: this rank; when given, the rows it sends itself must equal the rows it receives
            from itself.

    Raises:
        ValueError: a list has the wrong length, a count is negative, the counts do not add up to
            the rows of the tensors, or ``output`` has the wrong dtype / trailing shape.
        SplitMismatchError: the rows sent to and received from ``rank`` itself differ.
    """
    for what, splits in (("output_splits", output_splits), ("input_splits", input_splits)):
        if len(splits) != world_size:
            raise ValueError(f"{what} has {len(splits)} entries; the group has {world_size} ranks")
        if any(int(s) < 0 for s in splits):
            raise ValueError(f"{what} has a negative count: {list(splits)}")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (rows), got a 0-d tensor")
    if sum(input_splits) != input.shape[0]:
        raise ValueError(
            f"input_splits add up to {sum(input_splits)} rows but input has {input.shape[0]} rows"
        )
    if rank is not None and int(input_splits[rank]) != int(output_splits[rank]):
        raise SplitMismatchError(
            f"rank {rank} sends itself {input_splits[rank]} rows (input_splits[{rank}]) but "
            f"expects {output_splits[rank]} (output_splits[{rank}]); they must be equal"
        )
    if output is not None:
        if output.dtype != input.dtype:
            raise ValueError(f"output dtype {output.dtype} differs from input dtype {input.dtype}")
        if tuple(output.shape[1:]) != tuple(input.shape[1:]):
            raise ValueError(
                f"output rows have shape {tuple(output.shape[1:])}, input rows "
                f"{tuple(input.shape[1:])}"
            )
        if output.shape[0] != sum(output_splits):
            raise ValueError(
                f"output_splits add up to {sum(output_splits)} rows but output has "
                f"{output.shape[0]} rows"
            )
        if not is_dense(output):
            raise ValueError("output must be contiguous (canonical row-major strides)")


def is_dense(t: torch.Tensor) -> bool:
    """Row-major with the canonical strides. Stricter than ``is_contiguous()``, which ignores the
    strides of size-1 dimensions: a one-row column slice is "contiguous" yet its bytes are not
    one run (``view(torch.uint8)`` refuses it)."""
    expected, step = [], 1
    for n in reversed(t.shape):
        expected.append(step)
        step *= n
    return list(t.stride()) == expected[::-1]


def allocate_output(input: torch.Tensor, output_splits: Sequence[int]) -> torch.Tensor:
    """Empty output for an all-to-all-v: shape [sum(output_splits) x D...], input's dtype/device."""
    return torch.empty(
        (int(sum(output_splits)), *input.shape[1:]), dtype=input.dtype, device=input.device
    )


class CommBackend(abc.ABC):
    """One transport for the embedding all-to-all with uneven splits (all-to-all-v).

    Implementations: `fstrain.distributed.comm.gloo.TorchDistBackend` (``"gloo"``/``"nccl"``, the
    reference), `fstrain.distributed.comm.shm.ShmBackend` (``"shm"``, CPU shared memory) and
    `fstrain.distributed.comm.cuda_ce.CopyEngineBackend` (``"cuda-ce"``, GPU copy engines). Every rank of the
    group must call `all_to_all_v` in the same order (it is a collective).
    """

    #: config name of the backend (``"gloo"``, ``"nccl"``, ``"shm"``, ``"cuda-ce"``).
    name: str = ""

    def __init__(self, *, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size} ranks")
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    def all_to_all_v(
        self,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exchange rows of ``input`` with every rank of the group (uneven splits).

        Args:
            input: shape [N_in x D...] (or [N_in] for the 1-D case), any dtype; rows for rank
                ``p`` are contiguous, in rank order.
            output_splits: ``W`` row counts to receive from each rank.
            input_splits: ``W`` row counts to send to each rank; ``sum == N_in``.
            out: optional contiguous output, shape [N_out x D...], same dtype and device.

        Returns:
            shape [N_out x D...], ``input``'s dtype, rows from rank ``p`` at offset
            ``sum(output_splits[:p])``. It is ``out`` when given.

        Raises:
            ValueError: local split sizes do not match the tensors.
            SplitMismatchError: a peer sends a different number of bytes than expected.
            PeerTimeoutError: a peer made no progress within the timeout.
            PeerExitedError: a peer process exited or aborted.
        """

    def close(self) -> None:
        """Release transport resources (idempotent). The backend is unusable afterwards."""

    def __enter__(self) -> CommBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
