"""fsdata: offline length profiling, cost estimation and load-balanced pre-sharding.

The sample schema and the shard format that every other part of FreeScale reads are defined in
:mod:`fsdata.schema` and documented in ``docs/format.md``.
"""

from fsdata.errors import FsdataError

__all__ = ["FsdataError"]
__version__ = "0.1.0"
