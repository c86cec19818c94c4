"""Deprecated: moved to :mod:`fsdata.samples.holdout` (docs/architecture.md); this alias goes in the next release."""

from fsdata._deprecated import alias

alias(__name__, "fsdata.samples.holdout")
