"""Execution engines of ``fsdata balance`` (docs/cluster.md), registered by name like partitioners
(:mod:`fsdata.engines.base`: the :class:`~fsdata.engines.base.Engine` role, its pre-flight and the
registry).

* ``local`` (:mod:`fsdata.engines.local`): one process, threads for the rank files (the default).
* ``ray`` (:mod:`fsdata.engines.ray`): the same stages as Ray tasks on a Ray cluster (or a local
  Ray instance); the output is byte-identical to ``local`` for the same input, settings and seed.

Every command reaches an engine through the registry: :func:`balance` (``fsdata balance``, the
nightly job, :func:`fsdata.balance`) with ``BalanceSettings(engine=...)``, and
:func:`~fsdata.engines.base.write_from_plan` (``fsdata write --engine ...``).
"""

from __future__ import annotations

import os

from fsdata.balancer.settings import BalanceSettings
from fsdata.engines import local as _local  # noqa: F401 (registers "local")
from fsdata.engines import ray as _ray  # noqa: F401 (registers "ray"; Ray is imported when a run starts)
from fsdata.engines.base import Engine, get_engine, names, register, write_from_plan
from fsdata.shards.manifest import Manifest

__all__ = ["Engine", "balance", "get_engine", "names", "register", "write_from_plan"]


def balance(input: str | os.PathLike, output: str | os.PathLike, settings: BalanceSettings, *,
            timings: dict[str, float] | None = None) -> Manifest:
    """``fsdata balance``: plan, write and finalize, atomically, with ``settings.engine`` (``local``:
    one process; ``ray``: the same stages as Ray tasks, :mod:`fsdata.engines.ray`, docs/cluster.md);
    byte-identical output for either engine. Also reachable as :func:`fsdata.balance`.

    Args:
        input: a Parquet file, a folder of Parquet files, or a glob (the sample schema, docs/format.md);
            a local path or a :mod:`pyarrow.fs` URI (``s3://bucket/samples/``, docs/cluster.md); or an
            ``fsdata balance`` OUTPUT (``settings.from_step``: its samples not yet trained; docs/fsdata.md,
            "Changing the world size").
        output: the OUTPUT folder (local path or URI); must not exist (an empty local folder is
            accepted) unless ``settings.overwrite``.
        settings: every setting (:class:`fsdata.balancer.settings.BalanceSettings`).
        timings: if given, filled with seconds per stage (``read_lengths``, ``plan``, ``write_ranks``,
            ``finalize``; the Ray engine adds ``ray_connect`` and ``verify``; an OUTPUT as ``input``
            adds ``read_output``, choosing the rows read and copying them where they are copied,
            :mod:`fsdata.shards.as_input`).

    Returns:
        The written :class:`~fsdata.shards.manifest.Manifest` (``path`` = ``output``).

    Raises:
        InputError: bad input. ConfigError: impossible settings, unknown engine, Ray missing or
            unreachable, or OUTPUT exists without overwrite.
    """
    return get_engine(settings).run(input, output, timings=timings)
