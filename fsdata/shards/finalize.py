"""Stage 3 of ``fsdata balance``, finalize (docs/format.md): ``_step_stats.parquet``,
``_dropped.parquet`` and, last, ``_manifest.json`` from the plan and the rank files' records.

Local output: every root file goes to a temporary first and all are renamed into place together;
object store: each file is one PUT and the manifest, written last, is the commit marker
(:mod:`fsdata.atomic`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import atomic, fsio
from fsdata.balancer.plan import Plan
from fsdata.errors import InputError
from fsdata.samples import schema as S
from fsdata.shards.manifest import (DROPPED_NAME, FORMAT_VERSION, MANIFEST_NAME, STEP_STATS_NAME, FileEntry, Manifest,
                                    rank_file_path, sha256_file)
from fsdata.shards.manifest import write_step_stats as _write_step_stats
from fsdata.shards.plan_file import PLAN_DIGEST_KEY, PlanTable, plan_digest
from fsdata.shards.plan_meta import PlanMeta
from fsdata.shards.writer import rank_step_tokens


def write_step_stats(path: Path | str, plan: Plan | PlanTable, num_tokens: np.ndarray | None = None) -> None:
    """``_step_stats.parquet`` of ``plan`` (the format: :func:`fsdata.shards.manifest.write_step_stats`);
    ``num_tokens`` ``[S x R]`` int64: history tokens per (step, rank) (None: no ``num_tokens`` column)."""
    if isinstance(plan, PlanTable):
        counts, loads = plan.counts_and_loads()
    else:
        counts, loads = plan.counts, plan.loads
    _write_step_stats(path, counts, loads, num_tokens)


def file_records(output: str | os.PathLike, num_ranks: int, expect_digest: str | None = None) -> list[FileEntry]:
    """Records of rank files already written under ``output`` (row count from the footer, size, SHA-256).

    Args:
        output: the folder holding the rank files.
        num_ranks: R.
        expect_digest: when given, every file's recorded plan digest must equal it.

    Raises:
        InputError: a rank file is missing or unreadable, or was written from another plan.
    """
    output = fsio.normalize(output)
    remote = fsio.is_remote(output)
    out = output if remote else Path(output)
    records = []
    for r in range(num_ranks):
        rel = rank_file_path(r)
        path = fsio.join(out, rel) if remote else out / rel
        try:
            fs, where = fsio.filesystem_and_path(str(path))
            md = pq.read_metadata(where, filesystem=fs)
            n = md.num_rows
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"{path}: cannot read the rank file ({str(e).splitlines()[0]}); "
                             "rerun 'fsdata write'") from None
        if expect_digest is not None:
            got = (md.metadata or {}).get(PLAN_DIGEST_KEY)
            if got is None or got.decode() != expect_digest:
                what = "records no plan digest" if got is None else f"has plan digest {got.decode()[:12]}..."
                raise InputError(f"{path}: {what}, but the plan's is {expect_digest[:12]}...: the rank files were "
                                 "written from another plan (other seed, strategy, cost model, settings or input); "
                                 "rerun 'fsdata write' with this plan")
        records.append(FileEntry(rank=r, path=rel, num_rows=n, num_bytes=fsio.size(path), sha256=sha256_file(path)))
    return records


_OWN_ROOT_FILES = (STEP_STATS_NAME, DROPPED_NAME, MANIFEST_NAME)


def _check_only_rank_files(out: Path | str, num_ranks: int) -> None:
    """Refuse anything in ``out`` besides the plan's rank files and finalize's own root files
    (an extra ``part-00001.parquet``, another rank's folder, hidden files or folders): folder-level
    readers would read them as data.

    Raises:
        InputError: one line naming up to five such paths.
    """
    want = {rank_file_path(r) for r in range(num_ranks)} | set(_OWN_ROOT_FILES)
    if fsio.is_remote(out):
        base = fsio.resolve(out).path + "/"
        files = [fsio.resolve(u).path[len(base):] for u in fsio.walk_files(out)]
    else:
        files = []  # files and links (not followed), and empty folders with a trailing "/"
        for dirpath, dirnames, filenames in os.walk(out):
            rel = os.path.relpath(dirpath, out)
            prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if prefix and not dirnames and not filenames:
                files.append(prefix)
            files += [prefix + f for f in filenames]
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            files += [prefix + d for d in links]
            dirnames[:] = [d for d in dirnames if d not in links]
    own_tmp = re.compile(r"^\.(?:" + "|".join(map(re.escape, _OWN_ROOT_FILES)) + r")\.tmp-\d+$")
    extra = sorted(f for f in files if f not in want and not own_tmp.match(f))
    if extra:
        raise InputError(f"{out} holds {extra[:5]} besides the plan's {num_ranks} rank files; folder readers would "
                         "read them: remove them, or rerun 'fsdata write' into an empty OUTPUT")


def _extra(meta: PlanMeta, plan, out, remote: bool) -> dict:
    """The manifest's keys after the known ones: the plan's own (``manifest_extra``; a resharded
    OUTPUT's carried keys among them, which win), what the input's convert metadata carries
    (``num_items``, ``vocab``, ``feature_columns``) and, last, ``plan_digest``."""
    extra = dict(meta.manifest_extra)
    for key, value in _carried(meta.carried, out, remote).items():
        extra.setdefault(key, value)
    extra["plan_digest"] = plan_digest(plan)
    return extra


def finalize(output: str | os.PathLike, plan: PlanTable, records: list[FileEntry] | None = None) -> Manifest:
    """Stage 3: write ``_step_stats.parquet``, ``_dropped.parquet`` (when rows were dropped) and,
    last, ``_manifest.json`` into ``output``, from the plan and the rank files' records.

    Args:
        output: the folder holding the rank files (OUTPUT or its temporary stand-in), a local path
            or a URI (on an object store the manifest written last is the OUTPUT's commit marker).
        plan: the plan the rank files were written from.
        records: the :func:`fsdata.shards.writer.write_rank` results, one per rank; None: recomputed from the files.

    Returns:
        The written :class:`~fsdata.shards.manifest.Manifest`.

    Raises:
        InputError: the rank files do not match the plan (missing rank, other row counts, other
            columns), or something other than rank files lies in ``output``.
    """
    output = fsio.resolve_pointer(output)  # normalised; an object store's pointer object followed
    remote = fsio.is_remote(output)
    out = output if remote else Path(output)

    def at(name: str):
        return fsio.join(out, name) if remote else out / name

    R = plan.num_ranks
    _check_only_rank_files(out, R)
    if records is None:
        records = file_records(out, R, expect_digest=plan_digest(plan))
    records = sorted(records, key=lambda f: f.rank)
    counts, _ = plan.counts_and_loads()
    if [f.rank for f in records] != list(range(R)):
        raise InputError(f"{out}: rank file records cover ranks {[f.rank for f in records][:8]}, the plan has "
                         f"{R} ranks; rerun 'fsdata write' with this plan")
    for f in records:
        if f.num_rows != int(counts[:, f.rank].sum()):
            raise InputError(f"{at(f.path)}: {f.num_rows} rows but the plan gives rank {f.rank} "
                             f"{int(counts[:, f.rank].sum())}; rerun 'fsdata write' with this plan")
    fs, first = fsio.filesystem_and_path(str(at(records[0].path)))
    columns = pq.read_schema(first, filesystem=fs).names
    # Local: every root file goes to a temporary first and all are renamed into place only when all
    # were written, so a failing or killed re-run (full disk, file-size limit, SIGKILL) leaves the
    # previous complete output as it was. A user's output folder keeps no temporaries: they live in
    # a sibling folder that the next run removes once its process is gone; inside balance the output
    # is itself a hidden temporary and holds them. Object store: each file is one PUT (old or new).
    staged: list[tuple[Path, Path]] = []
    staging: list[Path] = []
    if not remote:
        atomic.clean_stale_tmp(out)

    def stage(name: str):
        if remote:
            return at(name)
        if out.name.startswith("."):
            tmp = out / f".{name}.tmp-{os.getpid()}"
        else:
            if not staging:
                staging.append(out.parent / f"{atomic.tmp_prefix(out)}{os.getpid()}-finalize")
                staging[0].mkdir(exist_ok=True)
            tmp = staging[0] / name
        staged.append((tmp, out / name))
        return tmp

    tokens = np.stack([f.step_tokens if f.step_tokens is not None else rank_step_tokens(at(f.path), plan.num_steps)
                       for f in records], axis=1)
    try:
        stats_path = stage(STEP_STATS_NAME)
        write_step_stats(stats_path, plan, tokens)
        meta = plan.meta
        dropped = plan.dropped_sample_ids()
        dropped_file = dropped_path = None
        if len(dropped):
            dropped_file = DROPPED_NAME
            dropped_path = stage(dropped_file)
            fs, where = fsio.filesystem_and_path(str(dropped_path))
            cols = {S.SAMPLE_ID: pa.array(dropped, type=pa.int64())}
            if plan.epochs > 1:  # the remainder is per epoch
                cols["epoch"] = pa.array(plan.dropped_epochs(), type=pa.int32())
            cols["reason"] = pa.array(["remainder"] * len(dropped))
            pq.write_table(pa.table(cols), where, compression="zstd", filesystem=fs)
        m = Manifest(
            path=str(out), format_version=FORMAT_VERSION, **meta.manifest_fields(),
            num_samples_written=int(counts.sum()), num_samples_dropped=int(len(dropped)),
            dropped_file=dropped_file, columns=columns, step_stats_file=STEP_STATS_NAME,
            step_stats_sha256=sha256_file(stats_path),
            dropped_sha256=sha256_file(dropped_path) if dropped_file else None,
            files=records, extra=_extra(meta, plan, out, remote))
        if remote:
            m.write(out)
        else:
            stage(MANIFEST_NAME).write_text(m.dumps())
            for tmp, final in staged:  # the manifest last
                os.replace(tmp, final)
            stale_dropped = out / DROPPED_NAME
            if dropped_file is None and stale_dropped.exists():  # left by a previous finalize with another plan
                stale_dropped.unlink()
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        if staging:
            shutil.rmtree(staging[0], ignore_errors=True)
    return m


def _carried(carried: dict, out, remote: bool) -> dict:
    """The manifest keys carried from ``fsdata convert``'s metadata (docs/format.md): ``num_items``,
    ``vocab`` (its path made relative to OUTPUT; null for an object store or another drive) and
    ``feature_columns``, in this order after the other keys; absent when the input did not record them."""
    extra = {}
    if "num_items" in carried:
        extra["num_items"] = int(carried["num_items"])
    src = carried.get("vocab_source")
    if src:
        where = None
        if src.get("dir") and not remote:
            try:
                where = os.path.relpath(src["dir"], os.path.abspath(out))
            except ValueError:  # another drive
                where = None
        extra["vocab"] = {"digest": src["digest"], "path": where}
    if carried.get("feature_columns"):
        extra["feature_columns"] = list(carried["feature_columns"])
    return extra
