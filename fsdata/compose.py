"""Deprecated: moved to :mod:`fsdata.balancer.compose` (docs/architecture.md); this alias goes in the next release."""

from fsdata._deprecated import alias

alias(__name__, "fsdata.balancer.compose")
