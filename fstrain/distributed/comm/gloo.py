"""Reference backend: all-to-all-v through a torch.distributed process group (gloo or NCCL).

This is the plain implementation every faster transport is checked against: ``"gloo"`` on CPU
(what the tests compare the shared-memory backend with), ``"nccl"`` on GPU (SM kernels, works
across nodes, and the fallback of the copy-engine backend).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from fstrain.distributed.comm.base import CommBackend, allocate_output, check_splits

__all__ = ["TorchDistBackend"]


class TorchDistBackend(CommBackend):
    """`CommBackend` over ``dist.all_to_all_single`` on a given process group.

    Args:
        group: the process group (gloo for CPU tensors, NCCL for CUDA tensors); ``None`` means
            the default group.
        name: config name reported by the backend (``"gloo"`` or ``"nccl"``).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, name: str = "gloo"):
        self.group = group
        self.name = name
        super().__init__(rank=dist.get_rank(group), world_size=dist.get_world_size(group))

    def all_to_all_v(
        self,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `CommBackend.all_to_all_v`; errors of the process group propagate unchanged."""
        check_splits(input, output_splits, input_splits, self.world_size, out, self.rank)
        output = allocate_output(input, output_splits) if out is None else out
        with record_function(f"## {self.name}_all_to_all_v ##"):
            dist.all_to_all_single(
                output,
                input.contiguous(),
                [int(s) for s in output_splits],
                [int(s) for s in input_splits],
                group=self.group,
            )
        return output
