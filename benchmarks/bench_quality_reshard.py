"""Training quality across a world-size change: reshard at step S and resume, against an uninterrupted run.

For one recipe of :data:`benchmarks.quality_recipes.RECIPES` (default ``toys-sasrec``), through the
user's commands (subprocesses; every command goes to ``WORK/commands.log``):

1. ``fsdata convert --samples per-user --holdout last`` (leave-one-out, cached in WORK);
2. per seed, ``fsdata balance SAMPLES OLD --ranks R --batch-size-per-rank B --epochs E --seed SEED``;
3. **uninterrupted**: ``fstrain train OLD --simulate-ranks`` for all of OLD's steps, then held-out
   HR@10 / NDCG@10 (full ranking over the catalogue, history items excluded);
4. **resharded**: ``fstrain train OLD --simulate-ranks --max-steps S --checkpoint-dir CKPT`` (the
   checkpoint at step S), ``fsdata balance OLD NEW --ranks R' --batch-size-per-rank B' --from-step S
   --seed SEED`` (the samples of OLD's steps >= S re-planned for R': the rest of the epoch S falls
   in, then the whole epochs left), ``fstrain train NEW --simulate-ranks --checkpoint-dir CKPT
   --resume`` (NEW's step 0 = global step S), then the same evaluation.

``--simulate-ranks`` trains each step's whole global batch in one process: the exact update of the
plan's ranks (docs/fstrain.md), so R=4 and R'=2 run on a 2-core machine; the checkpoint, the
reshard and the resume are the ones a multi-rank job runs. With the default ``B' = R B / R'`` the
global batch (and so the optimizer's step size per sample) is unchanged across the reshard: only
which samples share a step after S changes, and the seeds of the epochs left.

Reports, per arm, mean, std and min-max over seeds of NDCG@10 and HR@10, the per-seed difference
(both arms of a seed share their first S steps exactly), and whether the resharded mean lies within
the uninterrupted runs' seed spread (min-max, and one std). Table + JSON.

Example (docs/results/bench_quality_reshard.md)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_quality_reshard --seeds 0,1,2 --epochs 3 \\
        --out docs/results --work /tmp/reshard/quality
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.quality_convergence import PY, _run, balance, convert
from benchmarks.quality_recipes import RECIPES, REPO_ROOT, Recipe


def _train(shards: Path, ev: Path, run: Path, log: Path, recipe: Recipe, seed: int, extra: list[str]) -> dict:
    """``fstrain train --simulate-ranks`` evaluated once at its end; the run's JSON summary + ``wall_seconds``."""
    t0 = time.perf_counter()
    if run.exists():
        shutil.rmtree(run)
    cmd = PY + ["fstrain.cli", "train", str(shards), "--seed", str(seed), "--eval-data", str(ev),
                "--eval-every-epochs", "0", "--eval-every-steps", "0", "--metrics-dir", str(run),
                "--max-seq-len", str(recipe.max_seq_len), "--pipeline", "none", "--step-mode", "plain",
                "--log-every-steps", "0", "--simulate-ranks", "--json", *recipe.train_args, *extra]
    summary = json.loads(_run(cmd, log).splitlines()[-1])
    summary["wall_seconds"] = time.perf_counter() - t0
    return summary


def _fields(summary: dict) -> dict:
    fin = summary.get("eval_final") or {}
    return {"ndcg@10": fin.get("ndcg@10"), "hr@10": fin.get("hr@10"), "first_step": summary["first_step"],
            "end_step": summary["end_step"], "global_end_step": summary["global_end_step"],
            "samples_trained": summary["num_samples_trained"], "tokens_trained": summary["num_tokens_trained"],
            "train_seconds": summary["train_seconds"], "wall_seconds": summary["wall_seconds"]}


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def _dropped(shards: Path) -> int:
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = shards / "_dropped.parquet"
    return pq.ParquetFile(path).metadata.num_rows if path.exists() else 0


def run_seed(a: argparse.Namespace, recipe: Recipe, samples: Path, ev: Path, seed: int, work: Path,
             log: Path) -> dict:
    """Both arms of one seed; the record of the JSON's ``runs``."""
    old, new, ckpt = work / f"old-s{seed}", work / f"new-s{seed}", work / f"ckpt-s{seed}"
    bal = balance(samples, old, log, ranks=a.ranks, batch_size_per_rank=a.batch_size_per_rank, epochs=a.epochs,
                  seed=seed)
    steps = int(bal["num_steps"])
    from_step = a.from_step if a.from_step is not None else int(round(steps * a.from_fraction))
    if not 0 < from_step < steps:
        raise SystemExit(f"--from-step {from_step} must be inside OLD's {steps} steps")
    rec = {"seed": seed, "old_steps": steps, "from_step": from_step, "old_dropped": _dropped(old),
           "old_predicted_bubble": bal["predicted_bubble"]}
    full = _train(old, ev, work / f"full-s{seed}-run", log, recipe, seed, [])
    rec["uninterrupted"] = _fields(full)
    print(f"seed {seed} uninterrupted R={a.ranks}: NDCG@10 {full['eval_final']['ndcg@10']:.4f} HR@10 "
          f"{full['eval_final']['hr@10']:.4f} ({full['wall_seconds']:.0f} s)", flush=True)
    if ckpt.exists():
        shutil.rmtree(ckpt)
    first = _train(old, ev, work / f"first-s{seed}-run", log, recipe, seed,
                   ["--max-steps", str(from_step), "--checkpoint-dir", str(ckpt)])
    t0 = time.perf_counter()
    rb = json.loads(_run(PY + ["fsdata", "balance", str(old), str(new), "--ranks", str(a.new_ranks),
                               "--batch-size-per-rank", str(a.new_batch_size_per_rank), "--from-step", str(from_step),
                               "--seed", str(seed), "--overwrite", "--no-progress", "--json"], log))
    reshard_seconds = time.perf_counter() - t0
    second = _train(new, ev, work / f"second-s{seed}-run", log, recipe, seed,
                    ["--checkpoint-dir", str(ckpt), "--resume"])
    manifest = json.loads((new / "_manifest.json").read_text())
    rec["resharded"] = {**_fields(second), "first_leg": _fields(first), "new_steps": int(rb["num_steps"]),
                        "new_dropped": _dropped(new), "new_predicted_bubble": rb["predicted_bubble"],
                        "resharded_from": manifest.get("resharded_from"), "reshard_seconds": reshard_seconds,
                        "samples_trained_total": first["num_samples_trained"] + second["num_samples_trained"]}
    print(f"seed {seed} R={a.ranks} -> R'={a.new_ranks} at step {from_step}: NDCG@10 "
          f"{second['eval_final']['ndcg@10']:.4f} HR@10 {second['eval_final']['hr@10']:.4f} (global end step "
          f"{second['global_end_step']}, {first['wall_seconds'] + second['wall_seconds']:.0f} s)", flush=True)
    for path in (old, new, ckpt):  # the shards and checkpoints are scratch; the figures are in the record
        shutil.rmtree(path, ignore_errors=True)
    return rec


def summarize(runs: list[dict]) -> dict:
    """Per arm mean/std/min/max of NDCG@10 and HR@10; the resharded mean against the uninterrupted spread."""
    table = {}
    for arm in ("uninterrupted", "resharded"):
        table[arm] = {m: _spread([r[arm][m] for r in runs]) for m in ("ndcg@10", "hr@10")}
    verdict = {}
    for m in ("ndcg@10", "hr@10"):
        base, other = table["uninterrupted"][m], table["resharded"][m]
        diffs = [r["resharded"][m] - r["uninterrupted"][m] for r in runs]
        verdict[m] = {"mean_diff": other["mean"] - base["mean"], "per_seed_diff": diffs,
                      "within_min_max": base["min"] <= other["mean"] <= base["max"],
                      "within_one_std": abs(other["mean"] - base["mean"]) <= base["std"]}
    return {"arms": table, "comparison": verdict}


def print_table(a: argparse.Namespace, result: dict) -> None:
    print("\n| run | seeds | NDCG@10 mean ± std | NDCG@10 min-max | HR@10 mean ± std | HR@10 min-max |")
    print("|---|---:|---:|---:|---:|---:|")
    n = len(result["runs"])
    labels = {"uninterrupted": f"uninterrupted R={a.ranks} x B={a.batch_size_per_rank}",
              "resharded": f"R={a.ranks} x {a.batch_size_per_rank}, resharded at S to R'={a.new_ranks} x "
                           f"{a.new_batch_size_per_rank}, resumed"}
    for arm, label in labels.items():
        nd, hr = result["summary"]["arms"][arm]["ndcg@10"], result["summary"]["arms"][arm]["hr@10"]
        print(f"| {label} | {n} | {nd['mean']:.4f} ± {nd['std']:.4f} | {nd['min']:.4f}-{nd['max']:.4f} | "
              f"{hr['mean']:.4f} ± {hr['std']:.4f} | {hr['min']:.4f}-{hr['max']:.4f} |")
    for m, v in result["summary"]["comparison"].items():
        print(f"{m}: resharded - uninterrupted {v['mean_diff']:+.4f} (per seed "
              f"{', '.join(f'{d:+.4f}' for d in v['per_seed_diff'])}); within the uninterrupted min-max: "
              f"{'yes' if v['within_min_max'] else 'NO'}; within one std: {'yes' if v['within_one_std'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_quality_reshard",
                                description=__doc__.splitlines()[0], epilog=__doc__.split("Example")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="toys-sasrec", choices=sorted(RECIPES), help="model, data and loss (default "
                   "toys-sasrec)")
    p.add_argument("--epochs", type=int, default=3, help="fsdata balance --epochs of OLD (default 3)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated; one balance + training seed each")
    p.add_argument("--ranks", type=int, default=4, help="OLD's R (default 4)")
    p.add_argument("--batch-size-per-rank", type=int, default=None, help="OLD's B (default: the recipe's batch / R)")
    p.add_argument("--new-ranks", type=int, default=2, help="NEW's R' (default 2)")
    p.add_argument("--new-batch-size-per-rank", type=int, default=None,
                   help="NEW's B' (default R B / R': the same global batch)")
    p.add_argument("--from-step", type=int, default=None, help="S (default: --from-fraction of OLD's steps)")
    p.add_argument("--from-fraction", type=float, default=0.5,
                   help="S as a fraction of OLD's steps when --from-step is not given (default 0.5: mid-run)")
    p.add_argument("--out", default=str(REPO_ROOT / "bench-output"), help="bench_quality_reshard.json goes here")
    p.add_argument("--work", default="/tmp/bench_quality_reshard", help="scratch: samples, shards, checkpoints")
    a = p.parse_args(argv)
    recipe = RECIPES[a.recipe]
    if a.batch_size_per_rank is None:
        a.batch_size_per_rank = max(1, recipe.batch_size // a.ranks)
    if a.new_batch_size_per_rank is None:
        a.new_batch_size_per_rank = max(1, a.ranks * a.batch_size_per_rank // a.new_ranks)
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    t0 = time.perf_counter()
    samples, ev = convert(recipe, work, log)
    runs = [run_seed(a, recipe, samples, ev, int(s), work, log) for s in a.seeds.split(",")]
    result = {"mode": "reshard", "recipe": a.recipe, "dataset": recipe.dataset, "epochs": a.epochs,
              "ranks": a.ranks, "batch_size_per_rank": a.batch_size_per_rank, "new_ranks": a.new_ranks,
              "new_batch_size_per_rank": a.new_batch_size_per_rank, "train_args": list(recipe.train_args),
              "runs": runs}
    result["summary"] = summarize(runs)
    print_table(a, result)
    result.update({"command": "python -m benchmarks.bench_quality_reshard " + shlex.join(argv or sys.argv[1:]),
                   "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
                   "load_average_end": os.getloadavg(), "total_seconds": time.perf_counter() - t0})
    path = out / "bench_quality_reshard.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nJSON: {path}; commands: {log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
