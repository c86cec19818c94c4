"""fsdata: offline length profiling, cost estimation and load-balanced pre-sharding.

The sample schema and the shard format that every other part of FreeScale reads are defined in
:mod:`fsdata.schema` and :mod:`fsdata.manifest` and documented in ``docs/format.md``.

Python API (docs/fsdata.md, "Python API")::

    import fsdata
    m = fsdata.balance("samples.parquet", "shards/", fsdata.BalanceSettings(num_ranks=16, batch_size_per_rank=32))

``fsdata`` does not import torch.
"""

__version__ = "0.1.0"

from fsdata.errors import FsdataError  # noqa: E402
from fsdata.manifest import Manifest  # noqa: E402

# The function shadows the submodule of the same name on purpose: ``fsdata.balance(...)`` is the
# entry point; the module stays importable as ``from fsdata.balance import ...``.
from fsdata.balance import BalanceSettings, balance  # noqa: E402

__all__ = ["BalanceSettings", "FsdataError", "Manifest", "balance"]
