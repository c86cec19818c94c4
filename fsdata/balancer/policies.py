"""The planning settings: policy names, defaults and the checks every engine runs before planning.

The names a planning setting takes (``--strategy``, ``--batch-policy``, ``--remainder``) and the
defaults of ``--partitioner`` and ``--plan-window`` are declared here once; the partitioner names
themselves are the registry's (:func:`fsdata.balancer.partitioners.names`).
"""

from __future__ import annotations

from fsdata.errors import ConfigError, InputError, in_cli, setting

STRATEGIES = ("balanced", "shuffle")
BATCH_POLICIES = ("fixed", "cost-budget")
REMAINDER_POLICIES = ("drop", "error")
#: ``auto``: lpt-swap, plus CP-SAT refinement of the worst steps when B is small (where it helps).
DEFAULT_PARTITIONER = "auto"
#: Steps per plan window (``--plan-window``; rounded up to a multiple of the composition window).
#: Memory of planning one window: about 80 bytes x K x R x B (K=1024, R=256, B=32: ~0.7 GB).
DEFAULT_PLAN_WINDOW = 1024
#: Default composition window, a constant (docs/balancer.md, "Composition": the trade-off between bubble and
#: departure from the random order; provisional until the training-quality table of issue 10). Used by
#: :mod:`fsdata.balancer.compose`; defined here so the settings load without numba.
DEFAULT_COMPOSE_WINDOW = 256


def check_settings(num_samples: int, num_ranks: int, batch_size_per_rank: int) -> None:
    """The one planning check that needs the data: at least one step's samples (N >= R x B). R and
    B themselves are checked when the settings are made (:class:`fsdata.balancer.settings.PlanSettings`).

    Raises:
        InputError: fewer samples than one step (``R*B``).
    """
    if num_samples < num_ranks * batch_size_per_rank:
        r, b = setting("num_ranks"), setting("batch_size_per_rank")
        given = (" " if in_cli() else ", ").join([setting("num_ranks", num_ranks, owner=None),
                                                  setting("batch_size_per_rank", batch_size_per_rank, owner=None)])
        raise InputError(f"{given} needs at least {num_ranks * batch_size_per_rank} samples for one step; the "
                         f"input has {num_samples}: lower {r} or {b}")


def check_window(compose_window: int) -> None:
    """Raises ConfigError unless ``compose_window >= 1`` (an integer)."""
    if int(compose_window) != compose_window or compose_window < 1:
        raise ConfigError(f"{setting('compose_window')} must be an integer >= 1 (1 = no composition), "
                          f"got {compose_window}")


def check_policies(strategy: str, batch_policy: str, remainder: str) -> None:
    """Raises ConfigError naming the flag when a policy name is unknown."""
    for value, allowed, flag in ((strategy, STRATEGIES, "--strategy"), (batch_policy, BATCH_POLICIES, "--batch-policy"),
                                 (remainder, REMAINDER_POLICIES, "--remainder")):
        if value not in allowed:
            raise ConfigError(f"unknown {flag} '{value}'; use one of {', '.join(allowed)}")



def check_partitioner(name: str) -> None:
    """Raises ConfigError naming the setting when ``name`` is not a registered partitioner.

    The names are the registry's (:func:`fsdata.balancer.partitioners.names`), read at call time:
    a partitioner registered before planning is accepted.
    """
    from fsdata.balancer.partitioners import names  # noqa: PLC0415 (the registry fills as partitioners are imported)

    known = names()
    if name not in known:
        raise ConfigError(f"unknown {setting('partitioner')} '{name}'; use one of {', '.join(known)}")
