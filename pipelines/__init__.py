"""Jobs that compose fsdata and fstrain stages: the nightly preprocessing job and training entry points."""
