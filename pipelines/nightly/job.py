"""The nightly job: convert, profile, balance, verify and publish one run (composition only; the
logic lives in :mod:`fsdata`, the run store in :mod:`pipelines.nightly.store`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from fsdata import __version__ as fsdata_version
from fsdata.balancer.compose import DEFAULT_COMPOSE_WINDOW
from fsdata.balancer.cost import load_cost_model
from fsdata.balancer.plan import DEFAULT_PARTITIONER, DEFAULT_PLAN_WINDOW, high_bubble_warning
from fsdata.balancer.profile import profile
from fsdata.engines import balance
from fsdata.errors import ConfigError, FsdataError
from fsdata.guards import check_output_apart
from fsdata.samples.convert import convert
from fsdata.samples.io import list_parquet_files, open_samples
from fsdata.shards.manifest import sha256_file
from fsdata.shards.verify import verify
from fsdata.shards.writer import BalanceSettings
from pipelines.nightly import store

log = logging.getLogger("pipelines.nightly")

@dataclass(kw_only=True, slots=True)
class NightlyConfig:
    """Settings of one nightly run (all of them enter the run key)."""

    input: str
    """Raw log (``--format sequences|events``) or sample Parquet (``--format samples``)."""
    format: str = "sequences"
    samples: str = "per-event"
    max_seq_len: int = 512
    user_col: str = "0"
    item_col: str = "1"
    time_col: str | None = None
    sep: str | None = None
    has_header: bool | None = None
    columns: str | None = None
    """``--columns`` mapping of a ``--format samples`` input onto the sample schema."""
    num_ranks: int = 256
    batch_size_per_rank: int = 32
    cost_model: str = "hstu"
    seed: int = 0
    strategy: str = "balanced"
    batch_policy: str = "fixed"
    budget: float | None = None
    partitioner: str = DEFAULT_PARTITIONER
    remainder: str = "drop"
    compose_window: int = DEFAULT_COMPOSE_WINDOW
    """``--compose-window`` W of ``fsdata balance`` (docs/balancer.md, "Composition"); 1 = off."""
    plan_window: int = DEFAULT_PLAN_WINDOW
    """``--plan-window`` K of ``fsdata balance`` (steps planned together)."""
    epochs: int = 1
    """``--epochs`` E of ``fsdata balance`` (E epochs, each with its own seeded shuffle and composition)."""
    extra: dict | None = None
    """Anything else a caller wants in the key (e.g. a dataset version tag)."""


def _input_digest(path: str) -> str:
    p = Path(path)
    files = [str(p)] if p.is_file() else list_parquet_files(path)
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def run_key(cfg: NightlyConfig, input_digest: str | None = None) -> str:
    """Hex key of a run: SHA-256 of the input bytes, the settings and the fsdata version (16 chars).

    Args:
        cfg: the settings.
        input_digest: the digest of the bytes the run read (:func:`snapshot_input`); default:
            hash ``cfg.input`` now.
    """
    if input_digest is None:
        if not Path(cfg.input).exists():
            raise FsdataError(f"input {cfg.input} does not exist; pass the nightly log or sample files")
        input_digest = _input_digest(cfg.input)
    h = hashlib.sha256()
    h.update(input_digest.encode())
    h.update(json.dumps({**asdict(cfg), "input": None, "fsdata": fsdata_version}, sort_keys=True).encode())
    return h.hexdigest()[:16]


SNAPSHOT_NAME = ".input"


def snapshot_input(path: str, dest: Path, chunk_bytes: int = 1 << 22) -> tuple[str, str]:
    """Copy the input into ``dest`` while hashing the bytes copied; the run reads the copy.

    So the run key names exactly the bytes the run read, even when the input is replaced while the
    job runs. File names are kept (a text log's extension picks its separator); the files of a
    folder input are numbered so their order is kept.

    Returns:
        ``(path to read, input digest)``: the digest equals :func:`_input_digest` of an unchanged input.

    Raises:
        FsdataError: the input does not exist or holds no Parquet file.
    """
    p = Path(path)
    if not p.exists():
        raise FsdataError(f"input {path} does not exist; pass the nightly log or sample files")
    files = [str(p)] if p.is_file() else list_parquet_files(path)
    dest.mkdir()
    h = hashlib.sha256()
    for i, f in enumerate(files):
        name = os.path.basename(f)
        target = dest / (name if p.is_file() else f"{i:06d}-{name}")
        fh = hashlib.sha256()
        with open(f, "rb") as src, open(target, "wb") as out:
            while block := src.read(chunk_bytes):
                fh.update(block)
                out.write(block)
        h.update(name.encode())
        h.update(fh.hexdigest().encode())
    return (str(dest / os.path.basename(files[0])) if p.is_file() else str(dest)), h.hexdigest()


def _validate(cfg: NightlyConfig) -> None:
    if cfg.format not in ("sequences", "events", "samples"):
        raise ConfigError(f"unknown --format '{cfg.format}'; use sequences, events or samples")
    if cfg.columns and cfg.format != "samples":
        raise ConfigError("--columns maps the columns of a sample Parquet input; it needs --format samples "
                          "(convert already writes the sample schema)")


def _build(cfg: NightlyConfig, stage: Path, key: str, created_ns: int, *, progress: bool, num_threads: int,
           bucket_compression: str | None, engine: str = "local", ray_address: str | None = None,
           read_from: str | None = None) -> dict:
    """Run convert, profile, balance and verify into ``stage``; write ``_SUCCESS`` last.

    ``read_from`` is the input snapshot to read (:func:`snapshot_input`; default ``cfg.input``);
    it is removed before ``_SUCCESS`` is written."""
    info = {"run_key": key, "created_unix_ns": created_ns, "created_at": store._iso(created_ns),
            "built_at": store._iso(store._now_ns()), "host": socket.gethostname(), "fsdata_version": fsdata_version,
            "input": os.path.abspath(cfg.input), "config": asdict(cfg)}
    (stage / store.RUN_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    source = read_from or cfg.input
    samples = source
    if cfg.format != "samples":
        samples = str(stage / "samples.parquet")
        log.info("convert %s -> %s", cfg.input, samples)
        convert(source, samples, fmt=cfg.format, samples=cfg.samples, max_seq_len=cfg.max_seq_len,
                user_col=cfg.user_col, item_col=cfg.item_col, time_col=cfg.time_col, sep=cfg.sep,
                has_header=cfg.has_header, progress=progress)
    columns = cfg.columns if cfg.format == "samples" else None
    cost_model = load_cost_model(cfg.cost_model)
    lengths, _ = open_samples(samples, columns).lengths_and_ids()
    report = profile(lengths, cost_model, num_ranks=cfg.num_ranks, batch_size_per_rank=cfg.batch_size_per_rank,
                     seed=cfg.seed, compose_window=cfg.compose_window)
    (stage / "profile.json").write_text(json.dumps(report, indent=2))
    del lengths
    settings = BalanceSettings(num_ranks=cfg.num_ranks, batch_size_per_rank=cfg.batch_size_per_rank,
                               cost_model=cfg.cost_model, columns=columns, seed=cfg.seed, strategy=cfg.strategy,
                               batch_policy=cfg.batch_policy, remainder=cfg.remainder, partitioner=cfg.partitioner,
                               budget=cfg.budget, compose_window=cfg.compose_window, plan_window=cfg.plan_window,
                               epochs=cfg.epochs, num_threads=num_threads,
                               bucket_compression=bucket_compression, progress=progress,
                               engine=engine, ray_address=ray_address)
    manifest = balance(samples, stage / "shards", settings)  # the same entry point as `fsdata balance`
    checked = verify(stage / "shards", samples, column_map=columns, progress=progress)
    checked["warning"] = high_bubble_warning(manifest.to_json())
    if checked["warning"]:
        log.warning(checked["warning"])
    (stage / "verify.json").write_text(json.dumps(checked, indent=2))
    _write_report(stage, key, samples, columns)
    if read_from is not None:
        store._remove(stage / SNAPSHOT_NAME)
    summary = {"profile": report, "verify": checked}
    tmp_done = stage / f".{store.SUCCESS_NAME}.tmp"
    tmp_done.write_text(json.dumps({**summary, "files": store._file_digests(stage)}))
    os.replace(tmp_done, stage / store.SUCCESS_NAME)
    return summary


def _write_report(stage: Path, key: str, samples: str, columns: str | None) -> None:
    """``report.html`` (and its PNGs) next to the run's shards (:func:`fsdata.report.write_report`);
    skipped with a warning when the plotting extra is not installed (the run itself is complete)."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        log.warning("report skipped: matplotlib is not installed (pip install 'freescale[report]')")
        return
    from fsdata.report import write_report  # noqa: PLC0415

    write_report(stage / "shards", stage / "report.html", input_path=samples, column_map=columns,
                 label=f"nightly run {key}")


def run_nightly(cfg: NightlyConfig, work_dir: str | os.PathLike, *, progress: bool = True, keep_runs: int = 3,
                num_threads: int = 2, bucket_compression: str | None = None,
                lock_timeout_seconds: float = 0.0, engine: str = "local",
                ray_address: str | None = None) -> dict:
    """Run (or skip) the nightly job under the work folder's lock.

    Args:
        cfg: the job's settings.
        work_dir: folder holding ``runs/``, ``latest`` and the lock.
        progress: show progress bars.
        keep_runs: after a publish keep this many newest runs (>= 1; the published run and the last
            rollback target are always kept).
        num_threads: threads writing rank files (does not change the output).
        bucket_compression: codec of balance's temporary buckets (does not change the output).
        lock_timeout_seconds: wait this long for a concurrent run (0: fail at once).
        engine: ``local`` or ``ray`` (``fsdata balance --engine``, docs/cluster.md): where balance
            runs; the output is byte-identical, so the engine is not part of the run key.
        ray_address: the Ray cluster for ``engine="ray"`` (None: ``RAY_ADDRESS`` or a local instance).

    Returns:
        Dict with ``run_dir``, ``run_key``, ``skipped`` (already complete and intact), ``rebuilt``
        (a complete run whose files changed was built again), ``published`` (``latest`` points at
        this run), ``not_published_reason`` (when an older run stays unpublished), ``profile``,
        ``verify``, ``removed_runs`` and ``seconds``.

    Raises:
        LockHeldError: another run holds the lock.
        ConfigError: impossible settings, ``keep_runs < 1``, or a work folder (``--output``) overlapping
            the input.
        FsdataError: any stage's user error; ``latest`` is left as it was and the failed run removed.
    """
    t0 = time.perf_counter()
    _validate(cfg)
    if keep_runs < 1:
        raise ConfigError(f"--keep-runs must be >= 1, got {keep_runs}")
    check_output_apart(work_dir, [cfg.input], output_name="--output", input_name="--input")
    work = Path(work_dir)
    with store.work_lock(work, lock_timeout_seconds):
        key = run_key(cfg)
        runs = work / "runs"
        run_dir = runs / key
        store._clean_stale_work_tmp(work)
        published = store._published_run(work)
        removed = store._clean_unfinished(runs, published)
        published = store._published_run(work)  # a run put back by the cleanup
        skipped = rebuilt = False
        problem = store.check_run(run_dir) if (run_dir / store.SUCCESS_NAME).exists() else "absent"
        if problem is None:
            skipped = True
            log.info("run %s is complete and its files match their checksums; nothing to build", key)
        else:
            if problem != "absent":
                rebuilt = True
                log.warning("run %s was complete but %s; building it again", key, problem)
            known = [h["created_unix_ns"] for h in store._history(work) if h["run_key"] == key and "created_unix_ns" in h]
            created = store._created_ns(run_dir) or (min(known) if known else store._now_ns())
            runs.mkdir(parents=True, exist_ok=True)
            stage = runs / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            stage.mkdir()
            try:
                # the run reads a copy of the input made while hashing it: the key names the bytes read
                read_from, digest = snapshot_input(cfg.input, stage / SNAPSHOT_NAME)
                read_key = run_key(cfg, digest)
                if read_key != key:
                    log.warning("input %s changed after it was hashed; this run is built from the bytes it read "
                                "(run %s, not %s)", cfg.input, read_key, key)
                    key, run_dir = read_key, runs / read_key
                    known = [h["created_unix_ns"] for h in store._history(work)
                             if h["run_key"] == key and "created_unix_ns" in h]
                    created = store._created_ns(run_dir) or (min(known) if known else store._now_ns())
                _build(cfg, stage, key, created, progress=progress, num_threads=num_threads,
                       bucket_compression=bucket_compression, engine=engine, ray_address=ray_address,
                       read_from=read_from)
                store._swap_in(stage, run_dir)
            except BaseException:
                store._remove(stage)
                raise
        done = json.loads((run_dir / store.SUCCESS_NAME).read_text())
        created = store._created_ns(run_dir) or 0
        floor, why = store._forward_floor(work)
        is_published = published is not None and published.resolve() == run_dir.resolve()
        reason = None
        if is_published or created >= floor:
            store.publish(work, run_dir)
            if not is_published:
                store._append_history(work, {"run_key": key, "created_unix_ns": created, "published_unix_ns": store._now_ns(),
                                       "rollback": False})
            is_published = True
            removed += store.keep_newest_runs(work, keep_runs)
        else:
            reason = (f"run {key} (created {store._iso(created)}) is older than the output trainers read: {why}; "
                      f"latest stays; pass --rollback {key} to publish it")
            log.warning("%s", reason)
    return {"run_dir": str(run_dir), "run_key": key, "skipped": skipped, "rebuilt": rebuilt,
            "published": is_published, "not_published_reason": reason,
            "profile": done.get("profile"), "verify": done.get("verify"), "removed_runs": removed,
            "seconds": time.perf_counter() - t0}
