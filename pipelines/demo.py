"""``make demo``: the nightly job end to end on an embedded default (local files, no server).

On MovieLens-1M from ``../shared/datasets`` when present (per-event samples, history up to 512:
the heavy-tailed workload 256 ranks see), otherwise on generated samples with a heavy-tailed
(lognormal) length distribution. Prints where the output went and the predicted bubble before and
after balancing. It ends with a short training run the way users train: MovieLens-1M per-user
samples (``fsdata convert --samples per-user --holdout last``), balanced for a world size of 2,
trained with the all-positions next-item
objective by 2 processes (``torch.distributed.run``), the prioritized, overlapped embedding
pipeline and the shared-memory (SM-free on CPU) all-to-all backend, then evaluated on the
held-out items (HR@10, NDCG@10); logging loss, throughput and the measured bubble. Without the
dataset, the training run uses the generated samples (last-position objective, no evaluation).

It writes what there is to look at and prints where: the shards' HTML report (``fsdata report``:
length histogram, cost per sample, per-rank load before/after, bubble per step), the training
run's report (``fstrain report``: measured compute and wait per rank, loss curve) and TensorBoard
event files (``fstrain train --tensorboard-dir``).

Cost model: the CLI default, ``hstu`` (FLOPs of 4 HSTU layers at d_model 256), so the demo's
numbers are the ones ``fsdata profile``/``balance`` print for the same data. ``--cost-model
quadratic`` (``L^2 + 64 L``, attention-dominated) reproduces the higher "before" bubbles in
docs/fsdata.md; the demo prints which model it used.

Run: ``python -m pipelines.demo [-o demo-output] [--ranks 256] [--batch-size-per-rank 32] [--json]``
(``--json``: the summary as one JSON object on stdout, the lines a person reads on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from fsdata.common.cli import add_common_flags, add_json_flag, add_output_flag, configure_logging, resolve_progress
from fsdata.samples.settings import ConvertSettings
from fsdata.balancer.settings import BalanceSettings
from pipelines.nightly import NightlyConfig, run_nightly
from pipelines.nightly.config import JobSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("FREESCALE_DATASETS", REPO_ROOT.parent / "shared" / "datasets"))
ML1M = DATASETS / "ml-1m_ensfm" / "sequences.txt"


def synthetic_input(out_dir: Path, num_samples: int = 300_000, seed: int = 0) -> Path:
    """Generated samples whose lengths follow a lognormal (median ~55, capped at 512 like the
    MovieLens-1M per-event histories: the same cap users train with)."""
    from fsdata.samples.synth import write_synth_samples

    path = out_dir / "synthetic-samples.parquet"
    if not path.exists():
        rng = np.random.default_rng(seed)
        source = np.clip(rng.lognormal(mean=4.0, sigma=1.0, size=100_000), 1, 512).astype(np.int64)
        write_synth_samples(path, num_samples, source, seed=seed)
    return path


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags (the CLI convention of fsdata.common.cli)."""
    p = argparse.ArgumentParser(prog="python -m pipelines.demo", description=__doc__.split("\n\n")[0])
    add_output_flag(p, default=str(REPO_ROOT / "demo-output"), metavar="DIR",
                    help="folder for everything the demo writes (default: demo-output/ in the repository)")
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--batch-size-per-rank", type=int, default=32)
    p.add_argument("--cost-model", default="hstu", help="per-sample cost model (default hstu, the fsdata default)")
    p.add_argument("--train-steps", type=int, default=30, help="steps of the closing training run (0: skip)")
    add_json_flag(p, "print the summary as one JSON object on stdout (the readable lines go to stderr)")
    add_common_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    progress = resolve_progress(a.progress)  # bars only on a terminal: `make demo > log` stays clean
    configure_logging(a.verbose, a.quiet, default=logging.INFO, fmt="%(asctime)s %(name)s: %(message)s")
    say = _say(a.json)
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    balance = BalanceSettings(num_ranks=a.ranks, batch_size_per_rank=a.batch_size_per_rank, cost_model=a.cost_model,
                              progress=progress)
    job = JobSettings(output=str(out / "nightly"))
    if ML1M.exists():
        say(f"demo: MovieLens-1M from {ML1M} (per-event samples, history <= 512)")
        convert = ConvertSettings(input=str(ML1M), format="sequences", samples="per-event", max_seq_len=512)
    else:
        say(f"demo: {DATASETS} is absent; using generated heavy-tailed samples")
        convert = ConvertSettings(input=str(synthetic_input(out)), format="samples")
    cfg = NightlyConfig(convert=convert, balance=balance, job=job)
    r = run_nightly(cfg)
    v = r["verify"]
    shards = Path(r["run_dir"]) / "shards"
    converted = Path(r["run_dir"]) / "samples.parquet"
    samples = converted if converted.exists() else Path(cfg.convert.input)
    report_html = out / "nightly" / "latest" / "report.html"  # written by the nightly job with each run
    say()
    say(f"output:            {out / 'nightly' / 'latest' / 'shards'}  (-> {shards})")
    say(f"cost model:        {a.cost_model}" + ("  (the fsdata default; --cost-model quadratic weighs attention "
                                                  "more and gives higher 'before' bubbles)" if a.cost_model == "hstu"
                                                  else "  (the fsdata default is hstu)"))
    say(f"ranks x steps:     {v['num_ranks']} x {v['num_steps']}, {v['num_samples_written']:,} samples written, "
          f"{v['num_samples_dropped']:,} dropped (listed in the manifest)")
    say(f"bubble before:     {v['baseline_predicted_bubble']:.2%}  (shuffled, equal counts per rank: today)")
    say(f"bubble after:      {v['predicted_bubble']:.4%}  (fsdata balance, verified)")
    say(f"report:            {report_html.resolve().as_uri()}  (open in a browser; PNGs beside it)")
    summary = {"output": str(out), "shards": str(out / "nightly" / "latest" / "shards"), "run_dir": r["run_dir"],
               "cost_model": a.cost_model, "num_ranks": v["num_ranks"], "num_steps": v["num_steps"],
               "num_samples_written": v["num_samples_written"], "num_samples_dropped": v["num_samples_dropped"],
               "baseline_predicted_bubble": v["baseline_predicted_bubble"], "predicted_bubble": v["predicted_bubble"],
               "report": str(report_html.resolve())}
    if a.train_steps > 0:
        trained = train_demo(samples, out, a.train_steps, progress=progress, say=say)
        summary["train"] = {k: trained[k] for k in ("num_steps", "measured_bubble", "objective", "eval_final")
                            if k in trained}
        summary |= {"train_metrics": str(out / "train-metrics"),
                    "train_report": str((out / "train-report.html").resolve()), "tensorboard": str(out / "tensorboard")}
    if a.json:
        print(json.dumps(summary, indent=2))
    return 0


def _say(to_stderr: bool):
    """``print`` for the readable lines: on stdout, or on stderr when stdout carries ``--json``."""
    return (lambda *args: print(*args, file=sys.stderr)) if to_stderr else print


#: The demo's training run: per-user samples, history up to 200 items (generative-recommenders' ML-1M cap).
TRAIN_MAX_SEQ_LEN = 200


def train_demo(samples: Path, out: Path, steps: int, *, progress: bool = True, say=print) -> dict:
    """Balance per-user MovieLens-1M samples for 2 ranks and train ``steps`` steps with 2 processes.

    With the dataset present, ``fsdata convert --samples per-user --holdout last`` writes the
    training samples and the evaluation file; the run uses the all-positions objective and ends
    with a held-out evaluation. Without it, ``samples`` (generated) are trained with the
    last-position objective.

    Args:
        samples: the nightly job's samples (used only when MovieLens-1M is absent).
        out: the demo's output folder.
        steps: training steps.
        progress: show progress bars.
        say: prints the readable lines (``print``, or to stderr under ``--json``).

    Returns:
        The rank-0 training summary (``measured_bubble``, ``num_steps``, ``eval_final`` with the
        dataset, ...).

    Raises:
        RuntimeError: the training processes failed.
    """
    from fsdata.cli import main as fsdata_main

    no_progress = [] if progress else ["--no-progress"]
    eval_file = None
    if ML1M.exists():
        samples, eval_file = out / "train-ml1m-per-user.parquet", out / "train-ml1m-eval.parquet"
        if not (samples.exists() and eval_file.exists()):
            rc = fsdata_main(["convert", str(ML1M), str(samples), "--format", "sequences", "--samples", "per-user",
                              "--max-seq-len", str(TRAIN_MAX_SEQ_LEN), "--holdout", "last", "--holdout-output",
                              str(eval_file), "--overwrite"] + no_progress)
            if rc:
                raise RuntimeError(f"fsdata convert for the training demo failed with status {rc}")
    shards = out / "train-shards-2ranks"
    if not any((shards / name).exists() for name in ("_manifest.json", "manifest.json")):
        rc = fsdata_main(["balance", str(samples), str(shards), "--ranks", "2", "--batch-size-per-rank", "32",
                          "--overwrite"] + no_progress)
        if rc:
            raise RuntimeError(f"fsdata balance for the training demo failed with status {rc}")
    metrics = out / "train-metrics"
    tensorboard = out / "tensorboard"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fstrain.cli", "train", str(shards), "--max-steps", str(steps), "--log-every-steps", "5",
           "--pipeline", "prioritized", "--backend", "shm", "--metrics-dir", str(metrics),
           "--tensorboard-dir", str(tensorboard), "--max-seq-len", str(TRAIN_MAX_SEQ_LEN if eval_file else 512),
           "--embedding-dim", "32", "--num-layers", "1", "--num-heads", "2", "--num-negatives", "64",
           "--sparse-lr", "0.2", "--json", "--progress" if progress else "--no-progress"]
    if eval_file:
        cmd += ["--eval-data", str(eval_file)]
    say()
    say("training: " + " ".join(cmd[2:]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"training failed with status {proc.returncode}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    say(f"trained:           {summary['num_steps']} steps on 2 ranks ({summary['objective']} objective, prioritized "
        f"pipeline, shm backend); measured bubble {summary['measured_bubble']:.2%}; metrics in {metrics}")
    if summary.get("eval_final"):
        ev = summary["eval_final"]
        say(f"held-out:          HR@10 {ev['hr@10']:.4f} NDCG@10 {ev['ndcg@10']:.4f} after {ev['epoch']:.2f} epochs "
            f"({ev['num_users']:,} users, full ranking; a {steps}-step demo, far from convergence: "
            "benchmarks/bench_quality.py --reproduce trains to it)")
    from fstrain.measure.report import write_train_report

    report = write_train_report(shards, metrics, out / "train-report.html", input_path=samples)
    say(f"training report:   {Path(report['html']).resolve().as_uri()}")
    say(f"tensorboard:       tensorboard --logdir {tensorboard}  (then open http://localhost:6006)")
    return summary


if __name__ == "__main__":
    sys.exit(main())
