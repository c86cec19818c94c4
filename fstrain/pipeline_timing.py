"""Deprecated: moved to :mod:`fstrain.pipelines.timing`. Re-exports the old names."""

from __future__ import annotations

import warnings

from fstrain.pipelines.timing import ComputeTimer, TimedOptimizer

warnings.warn("fstrain.pipeline_timing is deprecated; import from fstrain.pipelines.timing", DeprecationWarning,
              stacklevel=2)

__all__ = ["ComputeTimer", "TimedOptimizer"]
