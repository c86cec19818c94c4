"""Training quality: published tables reproduced, and whether balancing changes what the model learns.

Modes (``python -m benchmarks.bench_quality MODE``):

* ``--reproduce``: the published SASRec / HSTU tables (:mod:`benchmarks.quality_recipes`) trained to
  convergence on per-user samples with the all-positions objective (:mod:`benchmarks.quality_convergence`).
* ``--parity``: shuffle vs the default balance vs cost-budget at convergence, several seeds.
* ``--per-user-vs-per-event``: the two sample kinds for the same epochs.
* no mode: the early-training guard below (a samples-seen budget on per-event samples).

For each dataset: ``fsdata convert --samples per-event --holdout last`` (leave-one-out), then for
every setting and seed: ``fsdata balance`` (R ranks x B, the setting's flags, ``--seed S``) and
``fstrain train --simulate-ranks`` (world size 1 on each step's whole global batch: the exact update
of R ranks, docs/fstrain.md) for the same number of samples seen, then held-out HR@10/NDCG@10 over
the full item vocabulary (``fstrain.components.evaluator``). Reports mean +- std over seeds per setting
(table + JSON).

Settings: ``shuffle`` (today's practice), ``balanced`` (per-step assignment only, W=1), one
``compose-W`` per ``--compose-windows`` entry (``fsdata balance --compose-window W``; skipped with a
message when this fsdata has no such flag), ``cost-budget`` (``--batch-policy cost-budget``: a
different batch contract, fewer and larger steps for the same samples), and any ``--setting
NAME='FLAGS'``.

Samples-seen budget: every run trains the first steps of its OUTPUT until at least
``--samples-seen`` samples went through (fixed contract: exactly ``samples_seen / (R B)`` steps;
cost-budget: the first step where the cumulative count reaches it, so slightly more samples and
far fewer steps). The budget is a small fraction of an epoch on a 2-core machine: this measures
early training, where batch composition would matter most, not converged quality.

Example (docs/fstrain.md, "Training quality")::

    python -m benchmarks.bench_quality --out bench-output --work /tmp/quality --seeds 0,1,2 \\
        --compose-windows 4,16,64
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks.quality_convergence import _run
from benchmarks.quality_recipes import REPO_ROOT, SOURCES


def _has_flag(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "fsdata", "balance", "--help"], cwd=REPO_ROOT, capture_output=True,
                         text=True).stdout
    return flag in out


def _steps_for(shards: Path, samples_seen: int) -> tuple[int, int]:
    """(steps, samples) of the shortest prefix of steps holding at least ``samples_seen`` samples."""
    man_path = shards / "_manifest.json"
    if not man_path.exists():
        man_path = shards / "manifest.json"
    man = json.loads(man_path.read_text())
    stats = shards / (man.get("step_stats_file") or ("_step_stats.parquet" if man_path.name.startswith("_")
                                                      else "step_stats.parquet"))
    t = pq.read_table(stats, columns=["step", "num_samples"]).to_pandas()
    per_step = t.groupby("step")["num_samples"].sum().sort_index()
    cum = per_step.cumsum()
    reached = cum[cum >= samples_seen]
    if reached.empty:
        return int(len(per_step)), int(cum.iloc[-1])
    step = int(reached.index[0])
    return step + 1, int(reached.iloc[0])


def main(argv: list[str] | None = None) -> int:
    """Dispatch: ``--reproduce`` / ``--parity`` / ``--per-user-vs-per-event`` (:mod:`benchmarks.quality_convergence`),
    else the early-training guard below."""
    argv = sys.argv[1:] if argv is None else argv
    if any(m in argv for m in ("--reproduce", "--parity", "--per-user-vs-per-event", "--bubbles")):
        from benchmarks.quality_convergence import main as convergence_main

        return convergence_main(argv)
    return early_main(argv)


def early_main(argv: list[str] | None = None) -> int:
    """The early-training guard (module docstring): per-event samples, a samples-seen budget."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "bench-output"), help="bench_quality.json goes here")
    p.add_argument("--work", default="/tmp/bench_quality", help="scratch: converted samples, shards, runs")
    p.add_argument("--datasets", default="ml-1m,beauty", help=f"comma-separated, of {', '.join(SOURCES)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--batch-size-per-rank", type=int, default=8)
    p.add_argument("--samples-seen", type=int, default=76_800, help="training budget per run (default 150 x 512)")
    p.add_argument("--max-seq-len", type=int, default=200, help="fsdata convert and model cap (default 200)")
    p.add_argument("--cost-model", default="quadratic", help="fsdata balance --cost-model (default L^2 + 64L)")
    p.add_argument("--compose-windows", default="", help="e.g. 4,16,64: one setting per W (--compose-window W)")
    p.add_argument("--no-cost-budget", action="store_true", help="leave out the cost-budget setting")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=FLAGS",
                   help="extra setting: its fsdata balance flags, e.g. 'lpt=--partitioner lpt' (repeatable)")
    p.add_argument("--train-args", default="--embedding-dim 32 --num-layers 1 --num-heads 1 --num-negatives 128",
                   help="fstrain train model/optimizer flags (default: a small model)")
    p.add_argument("--eval-max-users", type=int, default=10_000,
                   help="fixed seeded sample of evaluated users, same for every run (SASRec: 10,000; default)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs already in OUT/bench_quality.json (same dataset, setting, seed)")
    p.add_argument("--quick", action="store_true", help="smoke run: ml-1m, one seed, 20 steps' samples")
    a = p.parse_args(argv)
    if a.quick:
        a.datasets, a.seeds, a.samples_seen = "ml-1m", "0", 20 * a.ranks * a.batch_size_per_rank
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    py = [sys.executable, "-m"]
    has_compose = _has_flag("--compose-window")
    # balanced = per-step assignment only: W=1 spelled out where composition exists (its default may be > 1)
    settings: list[tuple[str, list[str]]] = [("shuffle", ["--strategy", "shuffle"]),
                                             ("balanced", ["--compose-window", "1"] if has_compose else [])]
    skipped = []
    windows = [int(w) for w in a.compose_windows.split(",") if w.strip()]
    if windows and not has_compose:
        msg = (f"skipping compose settings W={windows}: this fsdata balance has no --compose-window flag yet "
               "(issue 10 part 1)")
        print(msg, file=sys.stderr)
        skipped.append(msg)
        windows = []
    settings += [(f"compose-W{w}", ["--compose-window", str(w)]) for w in windows]
    if not a.no_cost_budget:
        settings.append(("cost-budget", ["--batch-policy", "cost-budget"]))
    for s in a.setting:
        name, _, flags = s.partition("=")
        settings.append((name, shlex.split(flags)))
    seeds = [int(s) for s in a.seeds.split(",")]
    runs = []
    done = {}
    if a.resume and (out / "bench_quality.json").exists():
        done = {(r["dataset"], r["setting"], r["seed"]): r
                for r in json.loads((out / "bench_quality.json").read_text())["runs"]}
    for ds in a.datasets.split(","):
        src, fmt = SOURCES[ds]
        if not src.exists():
            print(f"skipping {ds}: {src} not found", file=sys.stderr)
            skipped.append(f"{ds}: {src} not found")
            continue
        samples, evalf = work / ds / "samples.parquet", work / ds / "eval.parquet"
        if not (samples.exists() and evalf.exists()):
            _run(py + ["fsdata", "convert", str(src), str(samples), "--format", fmt, "--samples", "per-event",
                       "--max-seq-len", str(a.max_seq_len), "--holdout", "last", "--holdout-output", str(evalf),
                       "--overwrite", "--no-progress"], log)
        for name, flags in settings:
            for seed in seeds:
                if (ds, name, seed) in done:
                    runs.append(done[(ds, name, seed)])
                    continue
                shards, run = work / ds / f"{name}-s{seed}", work / ds / f"{name}-s{seed}-run"
                t0 = time.perf_counter()
                bal = json.loads(_run(py + ["fsdata", "balance", str(samples), str(shards), "--ranks", str(a.ranks),
                                            "--batch-size-per-rank", str(a.batch_size_per_rank), "--seed", str(seed),
                                            "--cost-model", a.cost_model, "--overwrite", "--no-progress", "--json"]
                                       + flags, log))
                steps, seen = _steps_for(shards, a.samples_seen)
                t1 = time.perf_counter()
                summary = json.loads(_run(py + ["fstrain.cli", "train", str(shards), "--simulate-ranks", "--max-steps",
                                                str(steps), "--seed", str(seed), "--eval-data", str(evalf),
                                                "--metrics-dir", str(run), "--max-seq-len", str(a.max_seq_len),
                                                "--pipeline", "none", "--step-mode", "plain", "--log-every-steps",
                                                "0", "--eval-max-users", str(a.eval_max_users), "--json"]
                                               + shlex.split(a.train_args), log).splitlines()[-1])
                ev = summary["eval"][-1]
                rec = {"dataset": ds, "setting": name, "seed": seed, "balance_flags": flags, "steps": steps,
                       "samples_seen": seen, "predicted_bubble": bal["predicted_bubble"],
                       "hr@10": ev["hr@10"], "ndcg@10": ev["ndcg@10"], "num_eval_users": ev["num_users"],
                       "balance_seconds": t1 - t0, "train_eval_seconds": time.perf_counter() - t1}
                runs.append(rec)
                print(f"{ds:7s} {name:12s} seed {seed}: {steps} steps, {seen:,} samples, bubble "
                      f"{rec['predicted_bubble']:.2%}, HR@10 {rec['hr@10']:.4f} NDCG@10 {rec['ndcg@10']:.4f} "
                      f"({rec['train_eval_seconds']:.0f} s)", flush=True)
                (out / "bench_quality.json").write_text(json.dumps({"runs": runs}, indent=2))
    rows = []
    for ds in dict.fromkeys(r["dataset"] for r in runs):
        for name, _ in settings:
            rs = [r for r in runs if r["dataset"] == ds and r["setting"] == name]
            if not rs:
                continue

            def ms(key: str) -> tuple[float, float]:
                v = [r[key] for r in rs]
                return statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0

            rows.append({"dataset": ds, "setting": name, "num_seeds": len(rs), "steps": rs[0]["steps"],
                         "samples_seen": statistics.fmean(r["samples_seen"] for r in rs),
                         "predicted_bubble": statistics.fmean(r["predicted_bubble"] for r in rs),
                         "ndcg@10_mean": ms("ndcg@10")[0], "ndcg@10_std": ms("ndcg@10")[1],
                         "hr@10_mean": ms("hr@10")[0], "hr@10_std": ms("hr@10")[1]})
    print(f"\nR={a.ranks} B={a.batch_size_per_rank}, budget {a.samples_seen:,} samples seen, seeds {seeds}, "
          f"model `{a.train_args}`, max_seq_len {a.max_seq_len}\n")
    print("| dataset | setting | steps | samples seen | predicted bubble | NDCG@10 (mean ± std) | HR@10 (mean ± std) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dataset']} | {r['setting']} | {r['steps']} | {r['samples_seen']:,.0f} | "
              f"{r['predicted_bubble']:.2%} | {r['ndcg@10_mean']:.4f} ± {r['ndcg@10_std']:.4f} | "
              f"{r['hr@10_mean']:.4f} ± {r['hr@10_std']:.4f} |")
    for s in skipped:
        print(f"\nskipped: {s}")
    result = {"settings": {"ranks": a.ranks, "batch_size_per_rank": a.batch_size_per_rank,
                           "samples_seen": a.samples_seen, "max_seq_len": a.max_seq_len, "cost_model": a.cost_model,
                           "train_args": a.train_args, "seeds": seeds, "eval_max_users": a.eval_max_users},
              "table": rows, "runs": runs, "skipped": skipped}
    (out / "bench_quality.json").write_text(json.dumps(result, indent=2))
    print(f"\nJSON: {out / 'bench_quality.json'}; commands: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
