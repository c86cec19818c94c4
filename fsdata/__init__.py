"""fsdata: offline length profiling, cost estimation and load-balanced pre-sharding.

Layers, bottom to top (docs/architecture.md has the picture; no module imports from a layer above
its own, ``tests/test_architecture.py`` checks it):

* base: :mod:`fsdata._version`, :mod:`fsdata.errors`, :mod:`fsdata.atomic`, :mod:`fsdata.fsio`, :mod:`fsdata.guards`;
* :mod:`fsdata.samples`: the sample schema, reading, conversion, hold-out, synthetic data;
* :mod:`fsdata.balancer`: cost models, bounds, composition, partitioners, planning, profiling,
  ``BalanceSettings``;
* :mod:`fsdata.shards`: the shard format (plan file, rank-file writer, finalize, manifest, verify);
* :mod:`fsdata.engines`: the engines (``local``, ``ray``) that run the stages, and :func:`balance`;
* the CLI: :mod:`fsdata.cli`, :mod:`fsdata.common.cli`, :mod:`fsdata.report`.

Python API (docs/fsdata.md, "Python API")::

    import fsdata
    m = fsdata.balance("samples.parquet", "shards/", fsdata.BalanceSettings(num_ranks=16, batch_size_per_rank=32))

``fsdata`` does not import torch.
"""

from __future__ import annotations

import importlib

from fsdata._version import __version__

__all__ = ["BalanceSettings", "FsdataError", "Manifest", "Vocabulary", "__version__", "balance"]

# The public names load on first use (PEP 562), so that importing the package does not load
# pyarrow: ``fsdata.cli`` sets Arrow's allocator options (they are read when pyarrow loads) first.
_LAZY = {"balance": "fsdata.engines", "FsdataError": "fsdata.errors", "Manifest": "fsdata.shards.manifest",
         "BalanceSettings": "fsdata.balancer.settings", "Vocabulary": "fsdata.samples.vocab"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fsdata' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

