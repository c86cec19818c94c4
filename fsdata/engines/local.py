"""The local engine: plan, write and finalize in this process (:func:`fsdata.shards.writer.balance_local`)."""

from __future__ import annotations

import os

from fsdata.shards.writer import balance_local


def run(input: str | os.PathLike, output: str | os.PathLike, settings, *, timings: dict | None = None):
    """``fsdata balance`` in one process; see :func:`fsdata.shards.writer.balance_local`."""
    return balance_local(input, output, settings, timings=timings)
