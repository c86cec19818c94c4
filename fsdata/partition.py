"""Deprecated: moved to :mod:`fsdata.balancer.partition` (the reference algorithms) and
:mod:`fsdata.balancer.partitioners` (the Partitioner role, ``partition_steps``); docs/architecture.md.
This module goes in the next release.
"""

import warnings

warnings.warn("fsdata.partition is deprecated and will be removed in the next release; import "
              "fsdata.balancer.partition or fsdata.balancer.partitioners instead", DeprecationWarning, stacklevel=2)

from fsdata.balancer.partition import *  # noqa: E402,F401,F403
from fsdata.balancer.partitioners import PartitionerConfig, partition_steps, partition_steps_chunked  # noqa: E402,F401
from fsdata.balancer.partitioners import from_config as Partitioner  # noqa: E402,F401 (Partitioner(config) as before)
