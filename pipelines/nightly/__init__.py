"""The nightly preprocessing job on one machine: convert, profile, balance, verify, publish.

Composition only (the logic lives in :mod:`fsdata`). Layout under the work folder ``-o/--output``::

    .nightly.lock                    # held while a run works (filelock); one run at a time
    .nightly.lock.holder             # JSON: pid, host, start time and command of the holder
    history.jsonl                    # one line per publish or rollback
    runs/<run_key>/run.json          # run key, creation time, settings, fsdata version
    runs/<run_key>/samples.parquet   # convert output (absent when --format samples)
    runs/<run_key>/profile.json
    runs/<run_key>/shards/           # fsdata balance OUTPUT (docs/format.md)
    runs/<run_key>/verify.json
    runs/<run_key>/_SUCCESS          # written last: summary and the SHA-256 of every file of the run
    runs/.<run_key>.tmp-<pid>-<id>/  # a run being built; renamed to runs/<run_key> when complete
    runs/.<run_key>.tmp-.../.input/  # the copy of the input the run reads (removed before _SUCCESS)
    latest -> runs/<run_key>         # switched atomically (symlink + rename) after verify passes

``run_key`` hashes the input files' bytes and every setting that changes the output, so a rerun
with the same inputs is a no-op -- after the published run's files are checked against their
recorded SHA-256 (a changed or truncated file is detected and the run rebuilt). The run reads a copy of
the input taken while hashing it, and is stored under the key of the bytes it read (an input
replaced mid-run cannot be published under the old input's key; cost: one extra read and a
transient copy of the input in the work folder). A run is built in a hidden folder; a failed or
killed run is removed (at once, or by the next run) and redone from the start; a killed run that
was already complete is kept. A rebuilt run replaces the previous one with one atomic exchange, so
``latest`` names a complete run at every point; ``.latest.tmp-*`` and lock-holder temporaries left
by a killed publish or rollback are removed by the next run or rollback (when it takes the lock). ``latest`` only moves
forward, to a run created no earlier than the published one and after the last rollback; ``--rollback RUN`` publishes an
older complete run on purpose. After a publish, ``--keep-runs N`` keeps the N newest runs (never the published run or
the last rollback target). A failure never touches ``latest``: trainers keep reading the previous verified output.

Usage::

    python -m pipelines.nightly --input ../shared/datasets/ml-1m_ensfm/sequences.txt --format sequences \\
        --samples per-event --max-seq-len 512 --output nightly/ --ranks 256 --batch-size-per-rank 32
    python -m pipelines.nightly --output nightly/ --rollback 3f2a9c0d1e2b4a5f

Modules: :mod:`pipelines.nightly.config` (the settings, :class:`NightlyConfig`),
:mod:`pipelines.nightly.job` (the run), :mod:`pipelines.nightly.store` (lock, runs, publish,
rollback, cleanup), :mod:`pipelines.nightly.cli` (the command line, generated from the settings).
"""

from pipelines.nightly import store  # noqa: I001 (first: job and cli use it)
from pipelines.nightly.config import JobSettings, NightlyConfig
from pipelines.nightly.job import SNAPSHOT_NAME, run_key, run_nightly, snapshot_input
from pipelines.nightly.store import (HISTORY_NAME, LOCK_NAME, RUN_INFO_NAME, SUCCESS_NAME, LockHeldError, check_run,
                                     keep_newest_runs, publish, rollback, work_lock)
from pipelines.nightly.cli import build_parser, main

__all__ = ["HISTORY_NAME", "LOCK_NAME", "RUN_INFO_NAME", "SNAPSHOT_NAME", "SUCCESS_NAME", "JobSettings",
           "LockHeldError", "NightlyConfig", "build_parser", "check_run", "keep_newest_runs", "main", "publish",
           "rollback", "run_key", "run_nightly", "snapshot_input", "store", "work_lock"]
