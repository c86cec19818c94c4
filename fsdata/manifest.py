"""Deprecated: moved to :mod:`fsdata.shards.manifest` (docs/architecture.md); this alias goes in the next release."""

from fsdata._deprecated import alias

alias(__name__, "fsdata.shards.manifest")
