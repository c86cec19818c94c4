"""The local engine: plan, write and finalize in this process (:func:`fsdata.balance.balance`)."""

from __future__ import annotations

import dataclasses
import os


def run(input: str | os.PathLike, output: str | os.PathLike, settings, *, timings: dict | None = None):
    """``fsdata balance`` in one process; see :func:`fsdata.balance.balance`."""
    from fsdata.balance import balance

    return balance(input, output, dataclasses.replace(settings, engine="local"), timings=timings)
