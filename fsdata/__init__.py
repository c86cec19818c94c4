"""fsdata: offline length profiling, cost estimation and load-balanced pre-sharding.

Layers, bottom to top (docs/architecture.md has the picture; no module imports from a layer above
its own, ``tests/test_architecture.py`` checks it):

* base: :mod:`fsdata.errors`, :mod:`fsdata.atomic`, :mod:`fsdata.guards`;
* :mod:`fsdata.samples`: the sample schema, reading, conversion, hold-out, synthetic data;
* :mod:`fsdata.balancer`: cost models, bounds, composition, partitioners, planning, profiling;
* :mod:`fsdata.shards`: the shard format (manifest, step stats), its writer and verify;
* :mod:`fsdata.engines`: local and Ray execution of the writer, and :func:`balance`;
* the CLI: :mod:`fsdata.cli`, :mod:`fsdata.cliutil`, :mod:`fsdata.report`.

Python API (docs/fsdata.md, "Python API")::

    import fsdata
    m = fsdata.balance("samples.parquet", "shards/", fsdata.BalanceSettings(num_ranks=16, batch_size_per_rank=32))

``fsdata`` does not import torch.
"""

import sys
import types

__version__ = "0.3.0"

from fsdata.engines import balance  # noqa: E402
from fsdata.errors import FsdataError  # noqa: E402
from fsdata.shards.manifest import Manifest  # noqa: E402
from fsdata.shards.writer import BalanceSettings  # noqa: E402

__all__ = ["BalanceSettings", "FsdataError", "Manifest", "balance"]


class _Package(types.ModuleType):
    """``fsdata.balance`` stays the function after the deprecated module of the same name
    (``from fsdata.balance import BalanceSettings``) is imported: the import system would otherwise
    set the package attribute to that module."""

    def __setattr__(self, name: str, value) -> None:
        if name == "balance" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
