"""Deprecated: moved to :mod:`fsdata.samples.schema` (docs/architecture.md); this alias goes in the next release.

The shard-format names it used to carry (``FORMAT_VERSION``, ``MANIFEST_NAME``, ``STEP_STATS_NAME``,
``DROPPED_NAME``, ``rank_dir_name``) now live in :mod:`fsdata.shards.manifest`.
"""

import warnings

warnings.warn("fsdata.schema is deprecated and will be removed in the next release; import fsdata.samples.schema "
              "(and the shard file names from fsdata.shards.manifest) instead", DeprecationWarning, stacklevel=2)

from fsdata.samples.schema import *  # noqa: E402,F401,F403
from fsdata.shards.manifest import DROPPED_NAME, FORMAT_VERSION, MANIFEST_NAME, STEP_STATS_NAME, rank_dir_name  # noqa: E402,F401
