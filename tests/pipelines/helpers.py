"""Building the nightly job's nested settings in tests from flat keywords."""

from __future__ import annotations

import dataclasses

from fsdata.samples.settings import ConvertSettings
from fsdata.balancer.settings import BalanceSettings
from pipelines.nightly import NightlyConfig
from pipelines.nightly.config import JobSettings

_CONVERT = {f.name for f in dataclasses.fields(ConvertSettings)}
_JOB = {f.name for f in dataclasses.fields(JobSettings)}


def nightly_config(**kw) -> NightlyConfig:
    """``NightlyConfig`` from flat keywords (``input=..., format=..., num_ranks=..., keep_runs=...``);
    progress bars off unless ``progress=True``."""
    kw = {k: str(v) if k in ("input", "output") else v for k, v in kw.items()}
    return NightlyConfig(convert=ConvertSettings(**{k: v for k, v in kw.items() if k in _CONVERT}),
                         balance=BalanceSettings(**{"progress": False} | {k: v for k, v in kw.items()
                                                                           if k not in _CONVERT | _JOB}),
                         job=JobSettings(**{k: v for k, v in kw.items() if k in _JOB}))


def at(cfg: NightlyConfig, work, **job) -> NightlyConfig:
    """``cfg`` with its work folder (``job.output``) and any other job settings replaced."""
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, output=str(work), **job))
