"""Deprecated: moved to :mod:`fsdata.shards.verify` (docs/architecture.md); this alias goes in the next release."""

from fsdata._deprecated import alias

alias(__name__, "fsdata.shards.verify")
