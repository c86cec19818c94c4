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
from dataclasses import asdict, replace
from pathlib import Path

from fsdata._version import __version__ as fsdata_version
from fsdata.balancer.cost import cost_model_file, load_cost_model
from fsdata.balancer.plan import high_bubble_warning
from fsdata.balancer.profile import profile
from fsdata.engines import balance
from fsdata.errors import ConfigError, FsdataError
from fsdata.guards import check_output_apart
from fsdata.samples.convert import convert
from fsdata.samples.io import list_parquet_files, open_samples
from fsdata.samples.vocab import VOCAB_SUFFIX, vocab_digest
from fsdata.shards.manifest import sha256_file
from fsdata.shards.verify import verify
from pipelines.nightly import store
from pipelines.nightly.config import NightlyConfig, key_settings

log = logging.getLogger("pipelines.nightly")


def _input_digest(path: str) -> str:
    p = Path(path)
    files = [str(p)] if p.is_file() else list_parquet_files(path)
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def run_key(cfg: NightlyConfig, input_digest: str | None = None, vocab_digest: str | None = None) -> str:
    """Hex key of a run: SHA-256 of the input bytes, the settings that change the output
    (:func:`~pipelines.nightly.config.key_settings`) and the fsdata version (16 chars).

    Args:
        cfg: the settings.
        input_digest: the digest of the bytes the run read (:func:`snapshot_input`); default:
            hash ``cfg.convert.input`` now.
        vocab_digest: the digest of the vocabulary the run extends (:func:`chained_vocab`); None (no
            vocabulary) leaves the key as before vocabularies existed.

    Raises:
        FsdataError: the input does not exist.
    """
    path = cfg.convert.input
    if input_digest is None:
        if not path or not Path(path).exists():
            raise FsdataError(f"input {path} does not exist; pass the nightly log or sample files")
        input_digest = _input_digest(path)
    h = hashlib.sha256()
    h.update(input_digest.encode())
    h.update(json.dumps({**key_settings(cfg), "input": None, "fsdata": fsdata_version}, sort_keys=True).encode())
    if vocab_digest is not None:
        h.update(vocab_digest.encode())
    return h.hexdigest()[:16]


#: The samples file of a run (its vocabulary, with mapped ids, is ``samples.parquet.vocab/`` beside it).
SAMPLES_NAME = "samples.parquet"


def chained_vocab(cfg: NightlyConfig, work: Path) -> tuple[str | None, str | None]:
    """The vocabulary a run extends, so one vocabulary lives on across runs: ``--vocab`` when given, else
    the published run's ``samples.parquet.vocab`` (when it has one).

    Returns:
        ``(folder or None, its content digest or None)``.
    """
    if cfg.convert.format == "samples":
        return None, None
    folder = cfg.convert.vocab
    if folder is None:
        published = store.published_run(work)
        cand = None if published is None else published / (SAMPLES_NAME + VOCAB_SUFFIX)
        folder = str(cand) if cand is not None and cand.is_dir() else None
    return (folder, vocab_digest(folder)) if folder else (None, None)


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
    if not cfg.job.output:
        raise ConfigError("--output (job.output) is required: the work folder of the runs")
    if not cfg.convert.input:
        raise ConfigError("--input (convert.input) is required (unless --rollback RUN)")
    if cfg.convert.format not in ("sequences", "events", "samples"):
        raise ConfigError(f"unknown --format '{cfg.convert.format}'; use sequences, events or samples")
    if cfg.balance.columns and cfg.convert.format != "samples":
        raise ConfigError("--columns maps the columns of a sample Parquet input; it needs --format samples "
                          "(convert already writes the sample schema)")


def _build(cfg: NightlyConfig, stage: Path, key: str, created_ns: int, *, read_from: str | None = None,
           vocab: str | None = None) -> dict:
    """Run convert, profile, balance and verify into ``stage``; write ``_SUCCESS`` last.

    ``read_from`` is the input snapshot to read (:func:`snapshot_input`; default ``cfg.convert.input``);
    it is removed before ``_SUCCESS`` is written. ``vocab``: the vocabulary convert extends (:func:`chained_vocab`)."""
    conv, bal, progress = cfg.convert, cfg.balance, cfg.balance.progress
    info = {"run_key": key, "created_unix_ns": created_ns, "created_at": store.iso(created_ns),
            "built_at": store.iso(store.now_ns()), "host": socket.gethostname(), "fsdata_version": fsdata_version,
            "input": os.path.abspath(conv.input), "config": asdict(cfg)}
    (stage / store.RUN_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    source = read_from or conv.input
    samples = source
    if conv.format != "samples":
        samples = str(stage / SAMPLES_NAME)
        log.info("convert %s -> %s", conv.input, samples)
        convert(source, samples, replace(conv, vocab=vocab), progress=progress)
    columns = bal.columns if conv.format == "samples" else None
    cost_model = load_cost_model(bal.cost_model)
    lengths, _ = open_samples(samples, columns).lengths_and_ids()
    report = profile(lengths, cost_model, num_ranks=bal.num_ranks, batch_size_per_rank=bal.batch_size_per_rank,
                     seed=bal.seed, compose_window=bal.compose_window)
    (stage / "profile.json").write_text(json.dumps(report, indent=2))
    del lengths
    settings = replace(bal, columns=columns, overwrite=False)
    manifest = balance(samples, stage / "shards", settings)  # the same entry point as `fsdata balance`
    checked = verify(stage / "shards", samples, column_map=columns, progress=progress)
    checked["warning"] = high_bubble_warning(manifest.to_json())
    if checked["warning"]:
        log.warning(checked["warning"])
    (stage / "verify.json").write_text(json.dumps(checked, indent=2))
    _write_report(stage, key, samples, columns)
    if read_from is not None:
        store.remove(stage / SNAPSHOT_NAME)
    summary = {"profile": report, "verify": checked}
    tmp_done = stage / f".{store.SUCCESS_NAME}.tmp"
    tmp_done.write_text(json.dumps({**summary, "files": store.file_digests(stage)}))
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


def run_nightly(cfg: NightlyConfig) -> dict:
    """Run (or skip) the nightly job under the work folder's lock.

    Args:
        cfg: the job's settings: ``cfg.job.output`` the folder holding ``runs/``, ``latest`` and
            the lock; ``cfg.job.keep_runs`` runs kept after a publish (>= 1; the published run and
            the last rollback target are always kept); ``cfg.job.lock_timeout_seconds`` the wait for
            a concurrent run (0: fail at once); ``cfg.balance.engine`` where balance runs (the output
            is byte-identical, so the engine is not part of the run key); ``cfg.balance.progress``
            progress bars.

    Returns:
        Dict with ``run_dir``, ``run_key``, ``skipped`` (already complete and intact), ``rebuilt``
        (a complete run whose files changed was built again), ``published`` (``latest`` points at
        this run), ``not_published_reason`` (when an older run stays unpublished), ``profile``,
        ``verify``, ``removed_runs`` and ``seconds``.

    Raises:
        LockHeldError: another run holds the lock.
        ConfigError: impossible settings, no input or work folder, ``keep_runs < 1``, or a work
            folder (``--output``) overlapping the input.
        FsdataError: any stage's user error; ``latest`` is left as it was and the failed run removed.
    """
    t0 = time.perf_counter()
    _validate(cfg)
    check_output_apart(cfg.job.output, [cfg.convert.input], output_name="--output", input_name="--input")
    check_output_apart(cfg.job.output, [cost_model_file(cfg.balance.cost_model)], output_name="--output",
                       input_name="--cost-model")
    work = Path(cfg.job.output)
    with store.work_lock(work, cfg.job.lock_timeout_seconds):
        vocab, vdigest = chained_vocab(cfg, work)
        key = run_key(cfg, vocab_digest=vdigest)
        runs = work / "runs"
        run_dir = runs / key
        published = store.published_run(work)
        removed = store.clean_unfinished(runs, published)
        published = store.published_run(work)  # a run put back by the cleanup
        skipped = rebuilt = False
        problem = store.check_run(run_dir) if (run_dir / store.SUCCESS_NAME).exists() else "absent"
        if problem is None:
            skipped = True
            log.info("run %s is complete and its files match their checksums; nothing to build", key)
        else:
            if problem != "absent":
                rebuilt = True
                log.warning("run %s was complete but %s; building it again", key, problem)
            known = [h["created_unix_ns"] for h in store.history(work)
                     if h["run_key"] == key and "created_unix_ns" in h]
            created = store.created_ns(run_dir) or (min(known) if known else store.now_ns())
            runs.mkdir(parents=True, exist_ok=True)
            stage = runs / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            stage.mkdir()
            try:
                # the run reads a copy of the input made while hashing it: the key names the bytes read
                read_from, digest = snapshot_input(cfg.convert.input, stage / SNAPSHOT_NAME)
                read_key = run_key(cfg, digest, vdigest)
                if read_key != key:
                    log.warning("input %s changed after it was hashed; this run is built from the bytes it read "
                                "(run %s, not %s)", cfg.convert.input, read_key, key)
                    key, run_dir = read_key, runs / read_key
                    known = [h["created_unix_ns"] for h in store.history(work)
                             if h["run_key"] == key and "created_unix_ns" in h]
                    created = store.created_ns(run_dir) or (min(known) if known else store.now_ns())
                _build(cfg, stage, key, created, read_from=read_from, vocab=vocab)
                store.swap_in(stage, run_dir)
            except BaseException:
                store.remove(stage)
                raise
        done = json.loads((run_dir / store.SUCCESS_NAME).read_text())
        created = store.created_ns(run_dir) or 0
        floor, why = store.forward_floor(work)
        is_published = published is not None and published.resolve() == run_dir.resolve()
        reason = None
        if is_published or created >= floor:
            store.publish(work, run_dir)
            history = store.history(work)
            if not history or history[-1]["run_key"] != key:  # also a publish whose record a kill cut off
                store.append_history(work, {"run_key": key, "created_unix_ns": created,
                                             "published_unix_ns": store.now_ns(), "rollback": False})
            is_published = True
            removed += store.keep_newest_runs(work, cfg.job.keep_runs)
        else:
            reason = (f"run {key} (created {store.iso(created)}) is older than the output trainers read: {why}; "
                      f"latest stays; pass --rollback {key} to publish it")
            log.warning("%s", reason)
    return {"run_dir": str(run_dir), "run_key": key, "skipped": skipped, "rebuilt": rebuilt,
            "published": is_published, "not_published_reason": reason,
            "profile": done.get("profile"), "verify": done.get("verify"), "removed_runs": removed,
            "seconds": time.perf_counter() - t0}
