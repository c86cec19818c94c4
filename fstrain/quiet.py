"""Known library noise, filtered so every ``fstrain`` run prints only what a user can act on.

Each ``fstrain train`` / ``evaluate`` run used to print a screen of lines from the libraries under
it that no fstrain user can act on: torchrec's planner warns that the topology was built directly
and about its storage reservation, torch and torchrec warn (``FutureWarning``) about DDP's
``broadcast_buffers`` and ``ShardedTensor`` (torchrec's row-wise tables are ShardedTensors), and
torch.fx logs a tracing notice once per process. :func:`silence_known_noise` drops exactly those
(matched by logger and message prefix, or by warning category and message), and nothing else:
fstrain's own warnings and every other library message pass. The entry points call it unless
``-v`` is given; ``import fstrain`` drops the fx notice only (:data:`IMPORT_NOISE`), which comes
from torchrec's KeyedJaggedTensor on the first batch of any program.
"""

from __future__ import annotations

import logging
import warnings

#: logger name -> message prefixes dropped on ``import fstrain``.
IMPORT_NOISE: dict[str, tuple[str, ...]] = {
    # torchrec's KeyedJaggedTensor calls torch.fx's is_fx_tracing(), which logs this on the first
    # batch of every process (torch 2.13); the call is torchrec's, not ours or the user's.
    "torch.fx._symbolic_trace": ("is_fx_tracing will return true for both fx.symbolic_trace and torch.export",),
}

#: logger name -> message prefixes dropped by the entry points (torchrec 1.9).
LOG_NOISE: dict[str, tuple[str, ...]] = {
    **IMPORT_NOISE,
    # fstrain builds the planner's Topology for the sharding plan only (world size, device type)
    "torchrec.distributed.planner.types": ("The topology was constructed directly rather than via TopologyFactory",),
    # the plan is forced (ROW_WISE, fused); the storage estimate is not used to pick it
    "torchrec.distributed.planner.storage_reservations": ("There is a known issue with TorchRec's dense tensor size",),
}

#: (category, message regex matched at the start) of warnings dropped by the entry points.
WARNING_NOISE: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"HeuristicalStorageReservation is known to cause issues"),
    (FutureWarning, r"`broadcast_buffers` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)


class KnownNoiseFilter(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__("fstrain.quiet")
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a record whose arguments do not fit its format: not ours to judge
            message = str(record.msg)
        return not message.startswith(self.prefixes)


def _install(table: dict[str, tuple[str, ...]]) -> None:
    for name, prefixes in table.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownNoiseFilter) and f.prefixes == prefixes for f in logger.filters):
            logger.addFilter(KnownNoiseFilter(prefixes))


def silence_import_noise() -> None:
    """Drop :data:`IMPORT_NOISE` (called by ``import fstrain``)."""
    _install(IMPORT_NOISE)


def silence_known_noise() -> None:
    """Drop every known library line: :data:`LOG_NOISE` and :data:`WARNING_NOISE` (the entry points, without ``-v``)."""
    _install(LOG_NOISE)
    for category, message in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)


def show_all_noise() -> None:
    """Undo both filters (``-v``): every library line shows."""
    for name in LOG_NOISE:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, KnownNoiseFilter)]:
            logger.removeFilter(f)
    warnings.filters[:] = [f for f in warnings.filters
                           if not any(f[0] == "ignore" and f[2] is c and f[1] is not None and f[1].pattern == m
                                      for c, m in WARNING_NOISE)]


__all__ = ["IMPORT_NOISE", "LOG_NOISE", "WARNING_NOISE", "KnownNoiseFilter", "show_all_noise", "silence_import_noise",
           "silence_known_noise"]
