"""Deprecated: moved to :mod:`fsdata.shards.writer` (the stages) and :func:`fsdata.engines.balance`
(the entry point, also :func:`fsdata.balance`); docs/architecture.md. This module goes in the next release.
"""

import warnings

warnings.warn("fsdata.balance (the module) is deprecated and will be removed in the next release; import "
              "fsdata.shards.writer, or call fsdata.balance / fsdata.engines.balance", DeprecationWarning, stacklevel=2)

from fsdata.engines import balance  # noqa: E402,F401
from fsdata.shards.writer import *  # noqa: E402,F401,F403
from fsdata.shards.writer import _POS, _check_seq_len  # noqa: E402,F401
