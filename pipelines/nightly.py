"""The nightly preprocessing job on one machine: convert, profile, balance, verify, publish.

Composition only (the logic lives in :mod:`fsdata`). Layout under ``--work-dir``::

    runs/<run_key>/samples.parquet   # convert output (absent when --format samples)
    runs/<run_key>/profile.json
    runs/<run_key>/shards/           # fsdata balance OUTPUT (docs/format.md)
    runs/<run_key>/verify.json
    runs/<run_key>/_SUCCESS          # completion marker, written last
    latest -> runs/<run_key>         # switched atomically (symlink + rename) after verify passes

``run_key`` hashes the input files' bytes and every setting, so a rerun with the same inputs is a
no-op, and a rerun after a failure resumes from the last completed stage. A failure never touches
``latest``: trainers keep reading the previous verified output.

Usage::

    python -m pipelines.nightly --input ../shared/datasets/ml-1m_ensfm/sequences.txt --format sequences \\
        --samples per-event --max-seq-len 512 --work-dir nightly/ --ranks 256 --batch-size-per-rank 32
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdata import __version__ as fsdata_version
from fsdata.balance import BalanceSettings, sha256_file, write_balanced
from fsdata.convert import convert
from fsdata.cost import load_cost_model
from fsdata.errors import FsdataError
from fsdata.io import list_parquet_files, open_samples
from fsdata.plan import DEFAULT_PARTITIONER, make_plan
from fsdata.profile import profile
from fsdata.verify import verify

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
    num_ranks: int = 256
    batch_size_per_rank: int = 32
    cost_model: str = "hstu"
    seed: int = 0
    strategy: str = "balanced"
    batch_policy: str = "fixed"
    partitioner: str = DEFAULT_PARTITIONER
    extra: dict = field(default_factory=dict)
    """Anything else a caller wants in the key (e.g. a dataset version tag)."""


def _input_digest(path: str) -> str:
    p = Path(path)
    files = [str(p)] if p.is_file() else list_parquet_files(path)
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def run_key(cfg: NightlyConfig) -> str:
    """Hex key of a run: SHA-256 of the input bytes, the settings and the fsdata version (16 chars)."""
    if not Path(cfg.input).exists():
        raise FsdataError(f"input {cfg.input} does not exist; pass the nightly log or sample files")
    h = hashlib.sha256()
    h.update(_input_digest(cfg.input).encode())
    h.update(json.dumps({**asdict(cfg), "input": None, "fsdata": fsdata_version}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def publish(work_dir: Path, run_dir: Path) -> None:
    """Point ``work_dir/latest`` at ``run_dir`` atomically (new symlink, then rename over the old)."""
    tmp = work_dir / f".latest.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(run_dir, work_dir), tmp)
    os.replace(tmp, work_dir / "latest")


def run_nightly(cfg: NightlyConfig, work_dir: str | os.PathLike, *, progress: bool = True) -> dict:
    """Run (or skip) the nightly job.

    Args:
        cfg: the job's settings.
        work_dir: folder holding ``runs/`` and the ``latest`` pointer.
        progress: show progress bars.

    Returns:
        Dict with ``run_dir``, ``skipped`` (True when the run was already complete), ``profile``,
        ``verify`` and ``seconds``.

    Raises:
        FsdataError: any stage's user error; ``latest`` is left as it was.
    """
    t0 = time.perf_counter()
    work = Path(work_dir)
    key = run_key(cfg)
    run_dir = work / "runs" / key
    shards = run_dir / "shards"
    done = run_dir / "_SUCCESS"
    if done.exists():
        publish(work, run_dir)
        log.info("run %s is complete; nothing to do", key)
        return {"run_dir": str(run_dir), "skipped": True, **json.loads(done.read_text()),
                "seconds": time.perf_counter() - t0}
    run_dir.mkdir(parents=True, exist_ok=True)
    samples = cfg.input
    if cfg.format != "samples":
        samples = str(run_dir / "samples.parquet")
        if not Path(samples).exists():
            log.info("convert %s -> %s", cfg.input, samples)
            convert(cfg.input, samples, fmt=cfg.format, samples=cfg.samples, max_seq_len=cfg.max_seq_len,
                    user_col=cfg.user_col, item_col=cfg.item_col, time_col=cfg.time_col, progress=progress)
    cost_model = load_cost_model(cfg.cost_model)
    src = open_samples(samples)
    lengths, ids = src.lengths_and_ids()
    report = profile(lengths, cost_model, num_ranks=cfg.num_ranks, batch_size_per_rank=cfg.batch_size_per_rank,
                     seed=cfg.seed)
    (run_dir / "profile.json").write_text(json.dumps(report, indent=2))
    if not shards.exists():
        plan = make_plan(cost_model.cost(lengths), num_ranks=cfg.num_ranks, batch_size_per_rank=cfg.batch_size_per_rank,
                         seed=cfg.seed, strategy=cfg.strategy, batch_policy=cfg.batch_policy,
                         partitioner=cfg.partitioner)
        settings = BalanceSettings(num_ranks=cfg.num_ranks, batch_size_per_rank=cfg.batch_size_per_rank, seed=cfg.seed,
                                   strategy=cfg.strategy, batch_policy=cfg.batch_policy, partitioner=cfg.partitioner,
                                   progress=progress)
        write_balanced(src, shards, plan, ids, cost_model, settings)
    checked = verify(shards, samples, progress=progress)
    (run_dir / "verify.json").write_text(json.dumps(checked, indent=2))
    summary = {"profile": report, "verify": checked}
    tmp_done = run_dir / "._SUCCESS.tmp"
    tmp_done.write_text(json.dumps(summary))
    os.replace(tmp_done, done)
    publish(work, run_dir)
    return {"run_dir": str(run_dir), "skipped": False, **summary, "seconds": time.perf_counter() - t0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.nightly", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True)
    p.add_argument("--format", default="sequences", choices=["sequences", "events", "samples"])
    p.add_argument("--samples", default="per-event", choices=["per-user", "per-event"])
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--user-col", default="0")
    p.add_argument("--item-col", default="1")
    p.add_argument("--time-col", default=None)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--batch-size-per-rank", type=int, default=32)
    p.add_argument("--cost-model", default="hstu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="balanced", choices=["balanced", "shuffle"])
    p.add_argument("--batch-policy", default="fixed", choices=["fixed", "cost-budget"])
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = NightlyConfig(input=a.input, format=a.format, samples=a.samples, max_seq_len=a.max_seq_len,
                        user_col=a.user_col, item_col=a.item_col, time_col=a.time_col, num_ranks=a.ranks,
                        batch_size_per_rank=a.batch_size_per_rank, cost_model=a.cost_model, seed=a.seed,
                        strategy=a.strategy, batch_policy=a.batch_policy)
    try:
        r = run_nightly(cfg, a.work_dir, progress=not a.no_progress)
    except FsdataError as e:
        print(f"nightly: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({k: r[k] for k in ("run_dir", "skipped", "seconds")} | {"verify": r["verify"]}, indent=2))
    else:
        v = r["verify"]
        print(f"{'up to date' if r['skipped'] else 'published'}: {Path(a.work_dir) / 'latest'} -> {r['run_dir']}")
        print(f"  bubble before (equal counts) {v['baseline_predicted_bubble']:.2%}  after {v['predicted_bubble']:.4%}"
              f"  ({v['num_ranks']} ranks x {v['num_steps']} steps, {v['num_samples_written']:,} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
