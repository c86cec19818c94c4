"""The Engine role: one base class whose :meth:`Engine.run` does the pre-flight once and runs the
stages of ``fsdata balance``, implementations registered by name (like datatrove's executors and
:mod:`fsdata.balancer.partitioners`).

:meth:`Engine.run` (``fsdata balance``, :func:`fsdata.balance`):

1. **pre-flight**, once for every engine (:meth:`Engine.check`, :meth:`Engine.open_input`):
   what the engine supports (epochs; the settings checked themselves when made), paths (OUTPUT
   apart from INPUT, OUTPUT not taken unless ``overwrite``), the input opened and validated
   (:func:`fsdata.samples.io.open_samples`), no reserved column name
2. inside the engine's :meth:`~Engine.session`: the **plan** stage (:meth:`Engine.plan`), the
   **write** stage (:meth:`Engine.write_ranks`) into a temporary OUTPUT, **finalize**
   (:func:`fsdata.shards.finalize.finalize`) and the atomic move into place (:mod:`fsdata.atomic`).

:func:`write_from_plan` (``fsdata write``) runs the write stage of any engine from a plan file,
with the same pre-flight. Registered names (:func:`names`): ``local`` (:mod:`fsdata.engines.local`)
and ``ray`` (:mod:`fsdata.engines.ray`); both give byte-identical output.
"""

from __future__ import annotations

import contextlib
import os
import time
from abc import ABC, abstractmethod
from typing import ClassVar

from fsdata import fsio
from fsdata.atomic import atomic_output, check_replaceable, output_taken
from fsdata.balancer.cost import CostModel, cost_model_file, load_cost_model
from fsdata.balancer.settings import BalanceSettings
from fsdata.errors import ConfigError, InputError, setting
from fsdata.guards import check_output_apart
from fsdata.common.registry import Registry
from fsdata.samples.io import SampleSource, open_samples
from fsdata.shards.finalize import finalize
from fsdata.shards.as_input import OutputInput, is_output, open_output, record_lineage, reshard_settings
from fsdata.shards.manifest import FileEntry, Manifest
from fsdata.shards.plan_file import PlanTable, input_digest, read_plan
from fsdata.shards.writer import output_schema


class Engine(ABC):
    """Runs the stages of ``fsdata balance``; subclasses implement :meth:`plan` and :meth:`write_ranks`.

    Args:
        settings: every setting (:class:`~fsdata.balancer.settings.BalanceSettings`);
            ``settings.engine`` is not read (the registry picked this class by it).

    Attributes:
        name: the registered name (``--engine``).
        max_epochs: the most epochs the engine plans and writes (None: any).
        stages: the keys :meth:`run` fills ``timings`` with, in order (seconds per stage).
    """

    name: ClassVar[str] = ""
    max_epochs: ClassVar[int | None] = None
    stages: ClassVar[tuple[str, ...]] = ("read_lengths", "plan", "write_ranks", "finalize")

    def __init__(self, settings: BalanceSettings):
        self.settings = settings
        #: shape ``[N]`` bool: a resharded OUTPUT's partial first epoch (:mod:`fsdata.shards.as_input`)
        self.first_epoch_mask = None

    # ---- pre-flight, once for every engine -------------------------------------------------------

    def check(self, epochs: int | None = None, *, what: str | None = None) -> None:
        """Check what the engine supports before anything is read: the epochs (``epochs``: a plan's,
        else the settings'). The values themselves were checked when the settings were made
        (:class:`~fsdata.balancer.settings.BalanceSettings`).

        Raises:
            ConfigError: more epochs than the engine writes.
        """
        s = self.settings
        E = s.epochs if epochs is None else epochs
        if self.max_epochs is not None and E > self.max_epochs:
            if what is not None:
                raise ConfigError(f"{what} holds {E} epochs; --engine {self.name} writes one epoch only: use "
                                  "--engine local (the default)")
            raise ConfigError(f"--epochs {E} is not supported by --engine {self.name} yet; use --engine local (the "
                              "default) for several epochs")

    @staticmethod
    def check_paths(output: str | os.PathLike, inputs: list, *, input_name: str = "INPUT") -> tuple[str, list[str]]:
        """Normalise OUTPUT and the inputs (:func:`fsdata.fsio.normalize`) and refuse an OUTPUT that
        is, holds or lies inside one of them.

        Returns:
            ``(output, inputs)``, normalised.

        Raises:
            ConfigError: OUTPUT overlaps an input.
        """
        output, inputs = fsio.normalize(output), [fsio.normalize(p) for p in inputs]
        check_output_apart(output, inputs, output_name="OUTPUT", input_name=input_name)
        return output, inputs

    def open_input(self, input: str, columns: str | dict | None) -> SampleSource:
        """Open and validate the input (schema, types; :func:`fsdata.samples.io.open_samples`) and
        refuse a column named like one fsdata adds (:func:`fsdata.shards.writer.output_schema`).

        Raises:
            InputError: bad input.
        """
        src = open_samples(input, columns)
        output_schema(src)
        return src

    # ---- the stages --------------------------------------------------------------------------------

    def session(self, timings: dict[str, float]) -> contextlib.AbstractContextManager:
        """Context every stage runs in (a cluster joined once per run); none by default."""
        return contextlib.nullcontext()

    @abstractmethod
    def plan(self, src: SampleSource, cost_model: CostModel, *, timings: dict[str, float]) -> PlanTable:
        """Stage 1: the plan of ``src``; fills ``timings`` with ``read_lengths`` and ``plan`` seconds."""

    @abstractmethod
    def write_ranks(self, src: SampleSource, plan: PlanTable, output: str | os.PathLike, *,
                    timings: dict[str, float] | None = None) -> list[FileEntry]:
        """Stage 2: every rank file of ``plan`` into the existing empty folder (or URI prefix) ``output``.

        Returns:
            One :class:`~fsdata.shards.manifest.FileEntry` per rank, by rank.

        Raises:
            InputError: the input does not match the plan, or a file fails to read midway.
        """

    def run(self, input: str | os.PathLike, output: str | os.PathLike, *,
            timings: dict[str, float] | None = None) -> Manifest:
        """``fsdata balance``: pre-flight, plan, write and finalize, atomically (module docstring).

        Args:
            input: a Parquet file, a folder of Parquet files, or a glob (the sample schema,
                docs/format.md); a local path or a :mod:`pyarrow.fs` URI.
            output: the OUTPUT folder (local path or URI); must not exist (an empty local folder is
                accepted) unless ``settings.overwrite``.
            timings: if given, filled with seconds per stage (:attr:`stages`; plus ``read_output``, the
                choice of the rows read, and their copy where one is made, when ``input`` is an OUTPUT).

        An ``fsdata balance`` OUTPUT as ``input`` is read through :mod:`fsdata.shards.as_input`
        (``settings.from_step``: only its samples not yet trained); the new manifest records its
        lineage (:func:`fsdata.shards.as_input.record_lineage`).

        Returns:
            The written :class:`~fsdata.shards.manifest.Manifest` (``path`` = ``output``).

        Raises:
            InputError: bad input. ConfigError: impossible settings, or OUTPUT exists without overwrite,
                or ``from_step`` without an OUTPUT as input or outside its steps.
        """
        s = self.settings
        self.check()
        output, (input,) = self.check_paths(output, [input])
        check_output_apart(output, [cost_model_file(s.cost_model)], output_name="OUTPUT", input_name="--cost-model")
        if output_taken(output) and not s.overwrite:
            raise ConfigError(f"output {output} already exists and is not empty; choose a new path or pass "
                              f"{setting('overwrite', True)} to replace it")
        check_replaceable(output, "shards", flag=setting("overwrite", True))  # before anything is read
        if is_output(input):  # an OUTPUT read back as INPUT (fsdata.shards.as_input)
            if s.columns:
                raise ConfigError(f"{setting('columns')} does not apply to INPUT {input}, an 'fsdata balance' "
                                  "OUTPUT (its rank files use the sample schema's names): leave it out")
            t0 = time.perf_counter()
            with open_output(input, s.from_step) as view:
                copied = time.perf_counter() - t0
                self.settings = reshard_settings(s, view)
                self.first_epoch_mask = view.first_epoch_mask
                self.check(what=f"INPUT {input} from step {s.from_step}" if s.from_step is not None else None)
                try:
                    m = self._run(input, output, timings, view)
                finally:
                    self.settings = s
            if timings is not None:
                timings["read_output"] = copied
            return m
        if s.from_step is not None:
            raise ConfigError(f"{setting('from_step', s.from_step)} needs an 'fsdata balance' OUTPUT as INPUT; "
                              f"{input} is not one (it has no _manifest.json)")
        return self._run(input, output, timings, None)

    def _run(self, input: str, output: str, timings: dict[str, float] | None, view: OutputInput | None) -> Manifest:
        """:meth:`run` after the pre-flight of the paths; ``view``: the OUTPUT ``input`` names, read as INPUT."""
        s = self.settings
        src = self.open_input(input, s.columns) if view is None or view.source is None else view.source
        before = input_state(src)
        cost_model = load_cost_model(s.cost_model)
        t: dict[str, float] = {}
        with self.session(t):
            plan = self.plan(src, cost_model, timings=t)
            if view is not None:
                record_lineage(plan, view, output)
            t1 = time.perf_counter()
            with atomic_output(output, overwrite=s.overwrite) as tmp:
                files = self.write_ranks(src, plan, tmp, timings=t)
                t2 = time.perf_counter()
                t.setdefault("write_ranks", t2 - t1)
                m = finalize(tmp, plan, files)
                check_input_unchanged(src, before, input)  # else nothing is published
            t["finalize"] = time.perf_counter() - t2
        m.path = str(output)
        if timings is not None:
            timings.update({k: t[k] for k in self.stages})
        return m


def input_state(src: SampleSource) -> tuple:
    """What identifies the input's bytes now: per file its modification time (ns; an object's
    ``mtime`` where the store reports one) and the input digest (sizes and Parquet footers,
    :func:`fsdata.shards.plan_file.input_digest`). Read at the start and at the end of a run."""
    times = []
    for path in src.files:
        try:
            if fsio.is_remote(path):
                r = fsio.resolve(path)
                mtime = r.fs.get_file_info(r.path).mtime
                times.append(None if mtime is None else mtime.timestamp())
            else:
                times.append(os.stat(path).st_mtime_ns)
        except OSError:
            times.append(None)
    return tuple(times), input_digest(src)


def check_input_unchanged(src: SampleSource, before: tuple, input: str) -> None:
    """Raise InputError when the input changed while the run read it (:func:`input_state` differs)."""
    try:
        now = input_state(src)
    except InputError:
        now = None
    if now != before:
        raise InputError(f"input {input} changed while this run read it (a file's size, modification time or Parquet "
                         "footer differs from the start); nothing was published: rerun once the input is complete")


#: The engines by name (``--engine NAME``): the one list of engine choices.
ENGINES: Registry[Engine] = Registry("engine", lambda: setting("engine"))


def register(name: str):
    """Class decorator: register an :class:`Engine` under ``name`` (``--engine NAME``).

    Raises:
        ValueError: ``name`` is registered already.
    """
    return ENGINES.register(name)


def names() -> tuple[str, ...]:
    """The registered engine names, in registration order."""
    return ENGINES.names()


def get_engine(settings: BalanceSettings) -> Engine:
    """The engine ``settings.engine`` names, built with ``settings``.

    Raises:
        ConfigError: an unknown name (``ray`` without Ray installed fails when it first runs).
    """
    return ENGINES.get(settings.engine)(settings)


def write_from_plan(input: str | os.PathLike, plan: str | os.PathLike, output: str | os.PathLike, *,
                    overwrite: bool = False, **settings) -> list[FileEntry]:
    """``fsdata write``: the rank files of a plan file, with the engine ``settings["engine"]``
    (default ``local``), atomically.

    Args:
        input: the input the plan was made from.
        plan: the plan file (:func:`fsdata.shards.plan_file.write_plan`).
        output: the OUTPUT folder; must not exist unless ``overwrite``.
        overwrite: replace an existing OUTPUT.
        settings: :class:`~fsdata.balancer.settings.RunSettings` fields, which do not change the
            output (``engine``, ``ray_address``, ``num_threads``, ``progress``,
            ``bucket_compression``); the planning settings are the plan's own
            (:meth:`fsdata.shards.plan_meta.PlanMeta.balance_settings`).

    Returns:
        One :class:`~fsdata.shards.manifest.FileEntry` per rank, by rank.

    Raises:
        InputError: bad input or plan, or an input other than the plan's. ConfigError: OUTPUT
            overlaps INPUT or PLAN, exists without overwrite, or the engine cannot write the plan.
    """
    output, (input, plan) = Engine.check_paths(output, [input, plan], input_name="INPUT or PLAN")
    if overwrite:
        check_replaceable(output, "shards", flag=setting("overwrite_arg", True))
    table = read_plan(plan)
    engine = get_engine(table.meta.balance_settings(**settings))
    engine.check(table.epochs, what=f"plan {plan}")
    src = engine.open_input(input, table.meta.settings.get("input_columns_renamed") or None)
    if input_digest(src) != table.meta.input_digest:
        raise InputError(f"input {input} is not the input plan {plan} was made from (input digests differ); "
                         "rerun 'fsdata plan' on this input")
    before = input_state(src)
    with engine.session({}), atomic_output(output, overwrite=overwrite) as tmp:
        files = engine.write_ranks(src, table, tmp)
        check_input_unchanged(src, before, input)
    return files

