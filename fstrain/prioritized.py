"""Deprecated: moved to :mod:`fstrain.pipelines.prioritized`. Re-exports the old names."""

from __future__ import annotations

import warnings

from fstrain.pipelines.prioritized import PrioritizedPipeline, _segment_counts  # noqa: F401

warnings.warn("fstrain.prioritized is deprecated; import from fstrain.pipelines.prioritized", DeprecationWarning,
              stacklevel=2)

__all__ = ["PrioritizedPipeline"]
