"""Execution engines of ``fsdata balance`` (docs/cluster.md).

* ``local`` (:mod:`fsdata.engines.local`): one process, threads for the rank files (the default).
* ``ray`` (:mod:`fsdata.engines.ray`): the same stages as Ray tasks on a Ray cluster (or a local
  Ray instance); the output is byte-identical to ``local`` for the same input, settings and seed.

Both are reached through one call, :func:`fsdata.balance` with ``BalanceSettings(engine=...)``.
"""

from __future__ import annotations

import os

from fsdata import fsio
from fsdata.errors import ConfigError
from fsdata.guards import check_output_apart

ENGINES = ("local", "ray")


def run(input: str | os.PathLike, output: str | os.PathLike, settings, *, timings: dict | None = None):
    """Run ``fsdata balance`` with ``settings.engine``.

    Args:
        input: the sample input (Parquet file, folder, or glob).
        output: the OUTPUT folder.
        settings: :class:`fsdata.shards.writer.BalanceSettings`.
        timings: if given, filled with seconds per stage.

    Returns:
        The written :class:`fsdata.shards.manifest.Manifest`.

    Raises:
        ConfigError: unknown engine, ``ray`` without Ray installed, or ``ray`` with ``epochs > 1``.
    """
    from fsdata.shards.writer import check_epochs  # noqa: PLC0415

    check_epochs(settings)
    if settings.engine == "local":
        from fsdata.engines.local import run as run_local

        return run_local(input, output, settings, timings=timings)
    if settings.engine == "ray":
        from fsdata.engines.ray import run as run_ray

        return run_ray(input, output, settings, timings=timings)
    raise ConfigError(f"unknown --engine '{settings.engine}'; use one of {', '.join(ENGINES)}")


def balance(input: str | os.PathLike, output: str | os.PathLike, settings, *,
            timings: dict[str, float] | None = None):
    """``fsdata balance``: plan, write and finalize, atomically, with ``settings.engine`` (``local``:
    one process; ``ray``: the same stages as Ray tasks, :mod:`fsdata.engines.ray`, docs/cluster.md);
    byte-identical output for either engine. Also reachable as :func:`fsdata.balance`.

    Args:
        input: a Parquet file, a folder of Parquet files, or a glob (the sample schema, docs/format.md);
            a local path or a :mod:`pyarrow.fs` URI (``s3://bucket/samples/``, docs/cluster.md).
        output: the OUTPUT folder (local path or URI); must not exist unless ``settings.overwrite``.
        settings: every setting (:class:`fsdata.shards.writer.BalanceSettings`).
        timings: if given, filled with seconds per stage (``read_lengths``, ``plan``, ``write_ranks``,
            ``finalize``).

    Returns:
        The written :class:`~fsdata.shards.manifest.Manifest` (``path`` = ``output``).

    Raises:
        InputError: bad input. ConfigError: impossible settings, unknown engine, or OUTPUT exists
            without overwrite.
    """
    input, output = fsio.normalize(input), fsio.normalize(output)
    check_output_apart(output, [input], output_name="OUTPUT", input_name="INPUT")
    return run(input, output, settings, timings=timings)
