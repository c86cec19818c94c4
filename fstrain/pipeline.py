"""Deprecated: moved to :mod:`fstrain.pipelines` (a package). Re-exports the old names."""

from __future__ import annotations

import warnings

from fstrain.pipelines import *  # noqa: F401,F403
from fstrain.pipelines import __all__  # noqa: F401

warnings.warn("fstrain.pipeline is deprecated; import from fstrain.pipelines", DeprecationWarning, stacklevel=2)
