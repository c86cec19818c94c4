"""The process-group backend names (``fstrain train --backend``, :class:`fstrain.distributed.comm.CommConfig`):
re-exported from the registry they come from, :mod:`fstrain.distributed.comm.transports` (its
docstring has the table of names, devices and what carries the collectives).
"""

from __future__ import annotations

from fstrain.distributed.comm.transports import (AUTO, BACKEND_CHOICES, BACKEND_DEVICES, BACKEND_NAMES, COMM_BACKENDS,
                                                 resolve_backend)

__all__ = ["AUTO", "BACKEND_CHOICES", "BACKEND_DEVICES", "BACKEND_NAMES", "COMM_BACKENDS", "resolve_backend"]
