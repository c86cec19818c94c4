"""``BalanceSettings``: every setting of ``fsdata balance`` (its flags), declared once.

The entry point's config (:func:`fsdata.balance`, ``fsdata balance / plan / write``, the nightly
job); the engines (:mod:`fsdata.engines`), the plan file and verify read it. :func:`plan_costs` is
the one call every engine plans with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from fsdata.balancer.policies import DEFAULT_COMPOSE_WINDOW, DEFAULT_PARTITIONER, DEFAULT_PLAN_WINDOW
from fsdata.errors import ConfigError

if TYPE_CHECKING:
    from fsdata.balancer.plan import Plan

# fsdata.balancer.plan (and compose) load numba (about 120 MiB of RSS): imported where a plan is made, so
# commands that make none (``fsdata convert``, whose 1 GiB bound the CLI's imports counted against) do not load it


@dataclass(kw_only=True, slots=True)
class BalanceSettings:
    """Every setting of ``fsdata balance`` (the CLI flags; recorded in the manifest's ``settings``).

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
        num_workers: deprecated name of ``num_threads``: when given, it sets ``num_threads`` (with a
            ``DeprecationWarning``) and is reset to None.
        engine: a name of the engine registry (:func:`fsdata.engines.names`): ``local`` (this process)
            or ``ray`` (Ray tasks on a Ray cluster, docs/cluster.md);
            the output is byte-identical either way (not recorded in the manifest).
        ray_address: Ray cluster to join (``ray start`` head ``HOST:PORT``); None: the
            ``RAY_ADDRESS`` environment variable, else a Ray instance started for this run.
        epochs: E (``--epochs``), epochs written one after the other, each with its own seeded
            shuffle and composition (epoch e from :func:`fsdata.balancer.order.epoch_seed`);
            steps are numbered on across epochs. 1: the single-epoch output of fsdata 0.2.
        from_step: S (``--from-step``), only with an ``fsdata balance`` OUTPUT as INPUT: plan only
            the samples of its steps ``>= S`` (those not yet trained after S steps; with several
            epochs the rest of S's epoch, then the whole epochs left, ``epochs`` taken from the
            OUTPUT). None: every sample of the OUTPUT (docs/fsdata.md, "Changing the world size").
    """

    num_ranks: int
    batch_size_per_rank: int
    cost_model: str = "hstu"
    columns: str | None = None
    seed: int = 0
    strategy: Literal["balanced", "shuffle"] = "balanced"
    batch_policy: Literal["fixed", "cost-budget"] = "fixed"
    remainder: Literal["drop", "error"] = "drop"
    partitioner: str = DEFAULT_PARTITIONER
    budget: float | None = None
    compose_window: int = DEFAULT_COMPOSE_WINDOW
    """W: regroup the samples of W consecutive random global batches so heavy samples share steps in
    multiples of R (B per rank kept); 1 = off. The plan records the window actually used
    (:mod:`fsdata.balancer.compose`, docs/balancer.md)."""
    plan_window: int = DEFAULT_PLAN_WINDOW
    """K, steps planned together (``--plan-window``; :class:`fsdata.balancer.plan.PlanLayout`): bounds the
    planning memory per window (the Ray engine plans one window per task)."""
    num_threads: int = 2
    progress: bool = True
    bucket_compression: Literal["lz4", "zstd"] | None = "zstd"
    overwrite: bool = False
    engine: str = "local"
    ray_address: str | None = None
    num_workers: int | None = None
    epochs: int = 1
    from_step: int | None = None

    def __post_init__(self) -> None:
        if self.num_workers is not None:  # the old name (threads, not processes): still accepted
            warnings.warn("BalanceSettings(num_workers=) is deprecated; use num_threads=", DeprecationWarning,
                          stacklevel=3)
            self.num_threads, self.num_workers = self.num_workers, None



def plan_costs(costs: np.ndarray, settings: BalanceSettings, *, seed: int | None = None) -> Plan:
    """:func:`fsdata.balancer.plan.make_plan` under ``settings`` (the one call every engine plans with).

    Args:
        costs: shape ``[N]`` float64, per-sample cost in input order.
        settings: the balance settings (R, B, seed, strategy, policy, partitioner, composition).
        seed: the seed to plan with instead of ``settings.seed`` (an epoch's seed).
    """
    from fsdata.balancer.plan import make_plan

    return make_plan(costs, num_ranks=settings.num_ranks, batch_size_per_rank=settings.batch_size_per_rank,
                     seed=settings.seed if seed is None else seed, strategy=settings.strategy,
                     batch_policy=settings.batch_policy,
                     remainder=settings.remainder, partitioner=settings.partitioner, budget=settings.budget,
                     compose_window=settings.compose_window, plan_window=settings.plan_window)



def check_epochs(settings: BalanceSettings) -> None:
    """Validate ``settings.epochs`` (an engine may support fewer: :meth:`fsdata.engines.base.Engine.check`).

    Also the other integer settings read before any input: ``seed`` (:func:`check_seed`) and
    ``num_threads`` (:func:`check_threads`).

    Raises:
        ConfigError: not an integer >= 1; a seed or thread count out of range.
    """
    E = settings.epochs
    if isinstance(E, bool) or not isinstance(E, (int, np.integer)) or E < 1:
        raise ConfigError(f"--epochs must be an integer >= 1, got {E!r}")
    check_seed(settings.seed)
    check_threads(settings.num_threads)


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


def check_ranks_and_batch(num_ranks: int, batch_size_per_rank: int) -> None:
    """Refuse ``R < 1`` or ``B < 1`` before the input is read (the rest of
    :func:`fsdata.balancer.plan.check_settings` needs the input's row count).

    Raises:
        ConfigError: one line naming the setting.
    """
    if num_ranks < 1 or batch_size_per_rank < 1:
        from fsdata.balancer.plan import check_settings

        check_settings(num_ranks * max(batch_size_per_rank, 1), num_ranks, batch_size_per_rank)
