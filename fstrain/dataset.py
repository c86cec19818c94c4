"""``ShardDataset`` lives in :mod:`fstrain.data` (``fstrain.data.ShardDataset``); this module re-exports it.

See :class:`fstrain.data.ShardDataset` for the column types it yields.
"""

from fstrain.data import JaggedColumn, ShardDataset, ShardStep, column_value  # noqa: F401

__all__ = ["JaggedColumn", "ShardDataset", "ShardStep", "column_value"]
