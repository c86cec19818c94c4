"""The settings of ``fsdata balance`` (its flags), each declared once, as a dataclass field:

* :class:`PlanSettings`: what the plan depends on and records (R, B, seed, policies, windows, ...);
* :class:`RunSettings`: how it is run (threads, progress, spill codec, engine, overwrite);
* :class:`BalanceSettings`: both (``fsdata.BalanceSettings``, the entry point's config:
  :func:`fsdata.balance`, ``fsdata balance / plan``, the nightly job).

Each class checks its values on construction (:func:`check_plan_settings`, :func:`check_threads`),
the one place those checks live; the planner checks only what needs the data (N >= R x B). A
field's flag is ``--field-name`` unless its metadata names another (``num_ranks``: ``--ranks``).
:func:`fsdata.balancer.plan.plan_costs` is the one call every engine plans with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Literal

import numpy as np

from fsdata.balancer.policies import (DEFAULT_COMPOSE_WINDOW, DEFAULT_PARTITIONER, DEFAULT_PLAN_WINDOW, check_policies,
                                     check_window)
from fsdata.errors import ConfigError, register_settings, setting

# fsdata.balancer.plan (and compose) load numba (about 120 MiB of RSS): not imported here, so commands
# that make no plan (``fsdata convert``, whose 1 GiB bound the CLI's imports counted against) do not load it


@dataclass(kw_only=True)
class PlanSettings:
    """What a plan depends on (recorded in it: the plan file's ``fsdata.plan``, the manifest's
    ``settings``); checked on construction, so every function given one holds valid values.

    Attributes:
        num_ranks: number of ranks R (world size).
        batch_size_per_rank: samples per rank per step B.
        cost_model: per-sample cost: ``tokens``, ``quadratic``, ``verl``,
            ``hstu[:d_model=256,num_heads=4,head_dim=64,num_layers=4,causal=1]``,
            ``poly:c0=..,c1=..,c2=..`` or a calibrated ``PATH.json`` (``fstrain calibrate``).
        columns: map your column names to the sample schema: ``sample_id=id,item_ids=history,...``
            (None: the schema's names).
        seed: seed of the global-batch shuffle.
        strategy: ``balanced``, or ``shuffle``: today's equal-count practice, same layout.
        batch_policy: ``fixed``: B samples per rank per step; ``cost-budget``: variable counts,
            equal cost per step.
        remainder: ``drop`` (recorded in ``_dropped.parquet``) or ``error``.
        partitioner: per-step assignment, a name of the partitioner registry
            (:func:`fsdata.balancer.partitioners.names`): ``auto`` (lpt-swap, plus time-bounded CP-SAT
            only on steps whose gap to the proven bound is worth it), ``lpt-swap``, ``lpt-swap-cpsat``,
            ``lpt``, ``kk``, ``roundrobin``, ``shuffle``.
        budget: cost-budget per-rank per-step budget (None: chosen by the policy).
        epochs: E (``--epochs``), epochs written one after the other, each with its own seeded
            shuffle and composition (epoch e from :func:`fsdata.balancer.order.epoch_seed`);
            steps are numbered on across epochs. 1: the single-epoch output of fsdata 0.2.
        from_step: S (``--from-step``), only with an ``fsdata balance`` OUTPUT as INPUT: plan only
            the samples of its steps ``>= S`` (those not yet trained after S steps; with several
            epochs the rest of S's epoch, then the whole epochs left, ``epochs`` taken from the
            OUTPUT). None: every sample of the OUTPUT (docs/fsdata.md, "Changing the world size").

    Raises (on construction):
        ConfigError: R or B below 1, a seed outside ``0 .. 2^63-1``, a window below 1, epochs
            below 1, an unknown strategy, batch policy or remainder policy; one line naming the
            setting (the flag inside :func:`fsdata.errors.cli_terms`). The check that needs the
            data (N >= R x B) is the planner's (:func:`fsdata.balancer.policies.check_settings`).
    """

    num_ranks: int = field(metadata={"flag": "--ranks"})
    batch_size_per_rank: int
    cost_model: str = "hstu"
    columns: str | None = field(default=None, metadata={"metavar": "MAP"})
    seed: int = 0
    strategy: Literal["balanced", "shuffle"] = "balanced"
    batch_policy: Literal["fixed", "cost-budget"] = "fixed"
    remainder: Literal["drop", "error"] = "drop"
    partitioner: str = DEFAULT_PARTITIONER
    budget: float | None = None
    compose_window: int = field(default=DEFAULT_COMPOSE_WINDOW, metadata={"metavar": "W"})
    """W: regroup the samples of W consecutive random global batches so heavy samples share steps in
    multiples of R (B per rank kept); 1 = off. The plan records the window actually used
    (:mod:`fsdata.balancer.compose`, docs/balancer.md)."""
    plan_window: int = field(default=DEFAULT_PLAN_WINDOW, metadata={"metavar": "K"})
    """K, steps planned together (``--plan-window``; :class:`fsdata.balancer.plan.PlanLayout`): bounds the
    planning memory per window (the Ray engine plans one window per task)."""
    epochs: int = field(default=1, metadata={"metavar": "E"})
    from_step: int | None = field(default=None, metadata={"metavar": "S"})

    def __post_init__(self) -> None:
        check_plan_settings(self)

    @property
    def plan_settings(self) -> PlanSettings:
        """The planning settings alone (a :class:`PlanSettings`, also of a :class:`BalanceSettings`)."""
        return PlanSettings(**{f.name: getattr(self, f.name) for f in fields(PlanSettings)})


@dataclass(kw_only=True)
class RunSettings:
    """How a plan is run: settings that never change the output (not recorded in the plan; ``fsdata
    write`` takes these, the plan file the rest). Checked on construction.

    Attributes:
        num_threads: threads reading the input and writing rank files (``--num-threads``; does not
            change the output).
        progress: show progress bars (does not change the output).
        bucket_compression: codec of the temporary Arrow IPC files the write stage spills rank
            groups to when the input's rows exceed :data:`fsdata.engines.local.GATHER_BYTES` (the
            Ray engine: of its object-store pieces, when they would not fit 75% of the cluster's
            object store, :func:`fsdata.engines.ray.write.piece_compression`): ``zstd`` (the
            default; None in 0.3.0: the bytes written stay under twice the output's; at 20M
            samples 1.76x for about 4 s more than None, docs/results/bench_offline_stage.md),
            ``lz4``, or None (``none``: the fastest, temporary disk about the held size of the
            spilled rows).
        overwrite: replace an existing OUTPUT atomically.
        engine: a name of the engine registry (:func:`fsdata.engines.names`): ``local`` (this process)
            or ``ray`` (Ray tasks on a Ray cluster, docs/cluster.md);
            the output is byte-identical either way (not recorded in the manifest).
        ray_address: Ray cluster to join (``ray start`` head ``HOST:PORT``); None: the
            ``RAY_ADDRESS`` environment variable, else a Ray instance started for this run.

    Raises (on construction):
        ConfigError: a thread count outside ``1 .. 4096``.
    """

    num_threads: int = field(default=2, metadata={"metavar": "N"})
    progress: bool = True
    bucket_compression: Literal["lz4", "zstd"] | None = "zstd"
    overwrite: bool = False
    engine: str = "local"
    ray_address: str | None = field(default=None, metadata={"metavar": "HOST:PORT"})

    def __post_init__(self) -> None:
        check_threads(self.num_threads)

    @property
    def run_settings(self) -> RunSettings:
        """The run settings alone (a :class:`RunSettings`, also of a :class:`BalanceSettings`)."""
        return RunSettings(**{f.name: getattr(self, f.name) for f in fields(RunSettings)})


@dataclass(kw_only=True)
class BalanceSettings(RunSettings, PlanSettings):
    """Every setting of ``fsdata balance`` (its flags): the :class:`PlanSettings` fields (recorded
    in the plan and the manifest's ``settings``) and the :class:`RunSettings` fields; checked on
    construction (both classes' checks). :meth:`of` joins a plan's settings with run settings
    (``fsdata write``: :meth:`fsdata.shards.plan_meta.PlanMeta.balance_settings`).

    Attributes:
        num_workers: deprecated name of ``num_threads``: when given, it sets ``num_threads`` (with a
            ``DeprecationWarning``) and is reset to None.
    """

    num_workers: int | None = None

    def __post_init__(self) -> None:
        if self.num_workers is not None:  # the old name (threads, not processes): still accepted
            warnings.warn("BalanceSettings(num_workers=) is deprecated; use num_threads=", DeprecationWarning,
                          stacklevel=3)
            self.num_threads, self.num_workers = self.num_workers, None
        PlanSettings.__post_init__(self)
        RunSettings.__post_init__(self)

    @classmethod
    def of(cls, planning: PlanSettings, run: RunSettings | None = None) -> BalanceSettings:
        """The settings of ``planning`` (a plan's own) run with ``run`` (default: the defaults)."""
        run = RunSettings() if run is None else run
        return cls(**{f.name: getattr(planning, f.name) for f in fields(PlanSettings)},
                   **{f.name: getattr(run, f.name) for f in fields(RunSettings)})


register_settings(PlanSettings, "BalanceSettings")  # error messages spell each setting as its field does
register_settings(RunSettings, "BalanceSettings")


def check_plan_settings(s: PlanSettings) -> None:
    """The checks of :class:`PlanSettings` (run on construction), in this order: R, B, seed,
    composition window, plan window, epochs, policy names.

    Raises:
        ConfigError: one line naming the setting and the value.
    """
    if s.num_ranks < 1:
        raise ConfigError(f"{setting('num_ranks')} must be >= 1, got {s.num_ranks}")
    if s.batch_size_per_rank < 1:
        raise ConfigError(f"{setting('batch_size_per_rank')} must be >= 1, got {s.batch_size_per_rank}")
    check_seed(s.seed)
    check_window(s.compose_window)
    if int(s.plan_window) != s.plan_window or s.plan_window < 1:
        raise ConfigError(f"{setting('plan_window')} must be an integer >= 1 (steps planned together), "
                          f"got {s.plan_window}")
    E = s.epochs
    if isinstance(E, bool) or not isinstance(E, (int, np.integer)) or E < 1:
        raise ConfigError(f"--epochs must be an integer >= 1, got {E!r}")
    check_policies(s.strategy, s.batch_policy, s.remainder)


#: Seeds are recorded as int64 (manifest, plan, Parquet metadata): 0 <= seed < 2^63.
MAX_SEED = 2**63 - 1


def check_seed(seed: object, flag: str = "--seed") -> None:
    """Refuse a seed that is not an integer in ``0 .. 2^63-1`` (numpy's generators take no negative
    seed; the seed is recorded as int64).

    Raises:
        ConfigError: one line naming ``flag`` and the range.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{flag} must be an integer in 0..{MAX_SEED} (2^63-1), got {seed!r}")


def check_threads(num_threads: object) -> None:
    """Refuse a thread count below 1 or above 4096.

    Raises:
        ConfigError: one line naming ``--num-threads``.
    """
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) or not 1 <= num_threads <= 4096:
        raise ConfigError(f"--num-threads must be an integer in 1..4096, got {num_threads!r}")
