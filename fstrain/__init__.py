"""fstrain: a lean torchrec runtime that trains on fsdata's pre-balanced shards."""

__version__ = "0.2.0"
