"""The nightly job's settings: one nested dataclass, :class:`NightlyConfig` (``convert``, ``balance``,
``job``), in the manner of torchtitan's ``JobConfig``.

Each setting is declared once, as a dataclass field with its docstring: ``convert`` is
:class:`fsdata.samples.settings.ConvertSettings`, ``balance`` is ``fsdata balance``'s
:class:`~fsdata.balancer.settings.BalanceSettings`, ``job`` is :class:`JobSettings`. The command line
(:mod:`pipelines.nightly.cli`) is generated from the fields (:func:`fsdata.common.cli.add_settings_flags`),
a YAML file given with ``--config`` holds the same three sections, and ``--print-config`` prints
the resolved settings in that form. :func:`key_settings` names the settings that enter the run key:
those that change the output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fsdata.errors import ConfigError
from fsdata.samples.settings import ConvertSettings
from fsdata.balancer.settings import BalanceSettings


@dataclass(kw_only=True, slots=True)
class JobSettings:
    """Where the nightly runs live and how the job treats them."""

    output: str | None = field(default=None, metadata={"flag": ("-o", "--output")})
    """Work folder of runs/, latest and the lock (must not hold the input); required."""
    keep_runs: int = 3
    """After a publish, keep this many newest runs; the published run and the last rollback target
    are always kept."""
    rollback: str | None = None
    """Publish the complete run ROLLBACK (a key under runs/) even though it is older than latest,
    then stop; no other setting is needed."""
    lock_timeout_seconds: float = field(default=0.0, metadata={"flag": "--lock-timeout"})
    """Wait this long for a concurrent run holding the lock (0: fail at once)."""
    extra: dict | None = None
    """Anything else that should enter the run key (e.g. a dataset version tag)."""

    def __post_init__(self) -> None:
        if self.keep_runs < 1:  # checked when made, as every settings class (fsdata.balancer.settings)
            raise ConfigError(f"--keep-runs must be >= 1, got {self.keep_runs}")


@dataclass(kw_only=True, slots=True)
class NightlyConfig:
    """Every setting of one nightly run."""

    convert: ConvertSettings = field(default_factory=ConvertSettings)
    """How the input becomes samples (skipped for ``format="samples"``)."""
    balance: BalanceSettings
    """``fsdata balance``'s settings (``num_ranks`` and ``batch_size_per_rank`` have no default)."""
    job: JobSettings = field(default_factory=JobSettings)
    """The work folder and its runs."""


#: Fields with no flag of their own: ``progress`` is ``--progress/--no-progress`` (every CLI has it);
#: a run is built in a fresh folder, so ``overwrite`` means nothing; ``num_workers`` is a removed spelling.
NO_FLAG = {"balance": ("progress", "overwrite", "num_workers")}
#: Balance settings that do not change the output (threads, codec of temporary files, where it
#: runs, progress bars): not part of the run key, so a rerun on another engine is the same run.
NOT_IN_KEY = {"num_threads", "progress", "bucket_compression", "overwrite", "engine", "ray_address", "num_workers"}
SECTIONS = {"convert": ConvertSettings, "balance": BalanceSettings, "job": JobSettings}


#: Convert settings added after runs had keys: left out of the key at their default, so those runs keep it.
NEW_CONVERT_DEFAULTS = {"remap_ids": False, "vocab": None, "feature_cols": None, "bad_lines": "error"}


#: Balance settings added after run keys existed, left out of the key at these defaults (existing
#: runs keep their key): ``from_step`` applies to an OUTPUT as input only.
NEW_BALANCE_DEFAULTS = {"from_step": None}


def key_settings(cfg: NightlyConfig) -> dict:
    """The settings that change a run's output, flat (the names of the flat settings before they
    were nested, so an existing run keeps its key): every convert setting but ``input`` (the run
    key hashes the input's bytes instead), the balance settings outside :data:`NOT_IN_KEY`, and
    ``job.extra``.

    Returns:
        ``{name: value}``, JSON-serialisable.
    """
    convert = {k: v for k, v in asdict(cfg.convert).items()
               if k != "input" and not (k in NEW_CONVERT_DEFAULTS and v == NEW_CONVERT_DEFAULTS[k])}
    if cfg.convert.format != "events":  # unused columns: the key they had when their defaults were "0" and "1"
        convert["user_col"] = "0" if convert["user_col"] is None else convert["user_col"]
        convert["item_col"] = "1" if convert["item_col"] is None else convert["item_col"]
    balance = {k: v for k, v in asdict(cfg.balance).items() if k not in NOT_IN_KEY and k != "num_workers"
               and not (k in NEW_BALANCE_DEFAULTS and v == NEW_BALANCE_DEFAULTS[k])}
    return {**convert, **balance, "extra": cfg.job.extra}
