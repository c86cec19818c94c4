"""Training quality near convergence: reproduction, parity of balancing, per-user vs per-event.

Every run goes through the user's commands: ``fsdata convert --samples per-user --holdout last``
(leave-one-out), ``fsdata balance --epochs E`` (every epoch its own seeded shuffle and
composition), ``fstrain train --eval-every-epochs N`` (full ranking over the catalogue, history
items excluded: :mod:`fstrain.components.evaluator`). Runs are subprocesses; the commands go to
``WORK/commands.log``.

* ``--reproduce [--recipes a,b]``: one row per :data:`benchmarks.quality_recipes.RECIPES` entry
  (world size 1, the source's global batch), seeds ``--seeds``: final and best NDCG@10 / HR@10, the
  target, wall time and tokens/s.
* ``--parity``: for each dataset and ``(R, B)`` setting, ``--strategy shuffle`` vs the default
  balance (composition on) vs ``--batch-policy cost-budget``, trained with ``--simulate-ranks``
  (the exact update of R ranks in one process) for the recipe's epochs; mean and seed std of
  NDCG@10, the predicted bubble of each setting.
* ``--per-user-vs-per-event``: the same model and epochs on both sample kinds: NDCG@10, tokens
  trained and wall time.

Identical global batches train identical models: the loss is normalised by the step's global
count, negatives are drawn from ``(seed, step)`` and dropout masks are keyed by ``(seed, step,
sample_id, position)``, so a run depends on which samples each step holds, not on their rank
(tested in tests/fstrain). Every run records :func:`global_batches_digest` of its shards; with
``--reuse FILE`` (a JSON this benchmark wrote, repeatable) a run whose recipe, seed and digest
equal an earlier trained run's takes that run's figures instead of training again, marked
``reused_from`` (e.g. the default balance where composition regrouped no window, or a
reproduction row at R=1 and the shuffle at R=16 B=8, which share their global batches).
``--no-train`` balances only and reports what those runs give, leaving the rest "not run".

Examples::

    python -m benchmarks.bench_quality --reproduce --recipes ml-1m-sasrec --out docs/results
    python -m benchmarks.bench_quality --parity --recipes ml-1m-sasrec --rank-batches 16x8 --seeds 0,1,2
    python -m benchmarks.bench_quality --bubbles --rank-batches 16x8,8x32,256x32
    python -m benchmarks.bench_quality --per-user-vs-per-event --recipes toys-sasrec --epochs 10
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.quality_recipes import RECIPES, REPO_ROOT, SOURCES, Recipe

PY = [sys.executable, "-m"]


def _run(cmd: list[str], log: Path) -> str:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n{r.stdout[-4000:]}{r.stderr[-4000:]}\n# exit {r.returncode} after "
                f"{time.perf_counter() - t0:.1f} s\n")
    if r.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout


def convert(recipe: Recipe, work: Path, log: Path, samples: str = "per-user") -> tuple[Path, Path]:
    """``fsdata convert`` of the recipe's dataset (cached in ``work``): ``(samples, eval file)``."""
    src, fmt = SOURCES[recipe.dataset]
    if not src.exists():
        raise FileNotFoundError(f"{src} not found (the datasets live in ../shared/datasets)")
    d = work / f"{recipe.dataset}-{samples}-L{recipe.max_seq_len}"
    out, ev = d / "samples.parquet", d / "eval.parquet"
    if not (out.exists() and ev.exists()):
        _run(PY + ["fsdata", "convert", str(src), str(out), "--format", fmt, "--samples", samples,
                   "--max-seq-len", str(recipe.max_seq_len), "--holdout", "last", "--holdout-output", str(ev),
                   "--overwrite", "--no-progress"], log)
    return out, ev


def balance(samples: Path, shards: Path, log: Path, *, ranks: int, batch_size_per_rank: int, epochs: int,
            seed: int, flags: list[str] = ()) -> dict:
    """``fsdata balance --epochs``; returns its JSON summary."""
    return json.loads(_run(PY + ["fsdata", "balance", str(samples), str(shards), "--ranks", str(ranks),
                                 "--batch-size-per-rank", str(batch_size_per_rank), "--epochs", str(epochs),
                                 "--seed", str(seed), "--overwrite", "--no-progress", "--json", *flags], log))


def train(shards: Path, ev: Path, run: Path, log: Path, recipe: Recipe, seed: int, *, simulate: bool = False,
          extra: list[str] = ()) -> dict:
    """``fstrain train`` with periodic evaluation; returns the run summary plus ``wall_seconds``."""
    t0 = time.perf_counter()
    cmd = PY + ["fstrain.cli", "train", str(shards), "--seed", str(seed), "--eval-data", str(ev),
                "--eval-every-epochs", str(recipe.eval_every_epochs), "--metrics-dir", str(run),
                "--max-seq-len", str(recipe.max_seq_len), "--pipeline", "none", "--step-mode", "plain",
                "--log-every-steps", "0", "--json", *recipe.train_args, *extra]
    if simulate:
        cmd.append("--simulate-ranks")
    summary = json.loads(_run(cmd, log).splitlines()[-1])
    summary["wall_seconds"] = time.perf_counter() - t0
    return summary


def global_batches_digest(shards: Path) -> str:
    """sha256 of which samples each step of a balance output holds, independent of ranks and file order.

    Args:
        shards: a ``fsdata balance`` output (rank folders with ``step`` int32 and ``sample_id`` int64).

    Returns:
        64 hex digits over the ``(step, sorted sample_ids)`` pairs in step order: equal for two
        outputs whose every global batch holds the same samples (e.g. R=16 B=8 and R=1 B=128 of the
        same shuffle), whatever ranks and rows within a step they sit in.
    """
    import polars as pl  # noqa: PLC0415

    t = (pl.scan_parquet(str(shards / "rank-*" / "*.parquet")).select("step", "sample_id")
         .sort(["step", "sample_id"]).collect())
    h = hashlib.sha256()
    h.update(t["step"].cast(pl.Int64).to_numpy().tobytes())
    h.update(t["sample_id"].cast(pl.Int64).to_numpy().tobytes())
    return h.hexdigest()


def load_reusable(paths: list[str]) -> list[dict]:
    """Runs with figures and a ``global_batches_sha256`` of earlier JSONs of this benchmark.

    A run that itself took another run's figures (``reused_from``) is a source too and keeps that
    origin, so a committed table regenerates from its own JSON (its figures came from a trained run
    with the same recipe, seed, epochs and global batches).

    Raises:
        SystemExit: a file is missing or is not JSON (one line naming it).
    """
    runs = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--reuse {path}: cannot read it as this benchmark's JSON ({e.__class__.__name__}: "
                             f"{e}); pass a bench_quality_*.json this benchmark wrote") from None
        for r in doc.get("runs", []):
            if r.get("global_batches_sha256") and "ndcg@10" in r:
                runs.append(r | {"source_json": str(path)})
    return runs


def find_identical(pool: list[dict], recipe: str, seed: int, epochs: int, digest: str) -> dict | None:
    """A run of ``pool`` with the same recipe, seed, epochs and global batches, or None; a trained run
    before one that reused another's figures."""
    same = [r for r in pool if (r["recipe"], r["seed"], r["epochs"], r.get("global_batches_sha256"))
            == (recipe, seed, epochs, digest) and "ndcg@10" in r]
    return min(same, key=lambda r: bool(r.get("reused_from")), default=None)


_RESULT_FIELDS = ("ndcg@10", "hr@10", "ndcg@50", "hr@50", "mrr", "best_ndcg@10", "best_epoch", "curve",
                  "tokens_trained", "tokens_per_second", "train_seconds", "wall_seconds")


def _reuse(rec: dict, twin: dict) -> dict:
    label = (f"{twin.get('strategy') or 'reproduce'} R={twin.get('ranks', 1)} B={twin.get('batch_size_per_rank', '')}"
             f" seed {twin['seed']}").replace(" B= ", " ")
    rec.update({k: twin[k] for k in _RESULT_FIELDS if k in twin})
    rec["reused_from"] = twin.get("reused_from") or (
        label + (f" ({Path(twin['source_json']).name})" if twin.get("source_json") else ""))
    return rec


def _eval_fields(summary: dict) -> dict:
    fin, best = summary["eval_final"], summary["eval_best"]
    return {"ndcg@10": fin["ndcg@10"], "hr@10": fin["hr@10"], "ndcg@50": fin["ndcg@50"], "hr@50": fin["hr@50"],
            "mrr": fin["mrr"], "best_ndcg@10": best["ndcg@10"], "best_epoch": best["epoch"],
            "curve": [(r["epoch"], r["ndcg@10"]) for r in summary["eval"]],
            "tokens_trained": summary["num_tokens_trained"], "tokens_per_second": summary["tokens_per_second"],
            "train_seconds": summary["train_seconds"], "wall_seconds": summary["wall_seconds"]}


def _ms(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def reproduce(a: argparse.Namespace, work: Path, log: Path) -> dict:
    runs = []
    pool = load_reusable(a.reuse)
    for name in a.recipes.split(","):
        recipe = RECIPES[name]
        epochs = a.epochs or recipe.epochs
        samples, ev = convert(recipe, work, log)
        for seed in [int(s) for s in a.seeds.split(",")]:
            shards = work / f"{name}-e{epochs}-s{seed}"
            t0 = time.perf_counter()
            bal = balance(samples, shards, log, ranks=1, batch_size_per_rank=recipe.batch_size, epochs=epochs,
                          seed=seed)
            balance_seconds = time.perf_counter() - t0
            digest = global_batches_digest(shards)
            rec = {"recipe": name, "seed": seed, "epochs": epochs, "balance_seconds": balance_seconds,
                   "num_steps": bal.get("num_steps"), "global_batches_sha256": digest}
            twin = find_identical(pool, name, seed, epochs, digest)
            if twin is not None:
                _reuse(rec, twin)
            elif a.no_train:
                print(f"{name} seed {seed}: not run (--no-train)", flush=True)
                continue
            else:
                rec.update(_eval_fields(train(shards, ev, work / f"{shards.name}-run", log, recipe, seed)))
            runs.append(rec)
            print(f"{name} seed {seed}: NDCG@10 {rec['ndcg@10']:.4f} HR@10 {rec['hr@10']:.4f} (best "
                  f"{rec['best_ndcg@10']:.4f} at epoch {rec['best_epoch']:g}), {rec['wall_seconds']:.0f} s, "
                  f"{rec['tokens_per_second']:,.0f} tokens/s" + (f" [= {rec['reused_from']}]" if rec.get("reused_from")
                                                                 else ""), flush=True)
    rows = []
    print("\n| data | model | published NDCG@10 / HR@10 | target NDCG@10 | ours NDCG@10 (mean ± std) | ours HR@10 "
          "| best NDCG@10 (epoch) | epochs | seeds | wall s / run | tokens/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in a.recipes.split(","):
        rs = [r for r in runs if r["recipe"] == name]
        recipe = RECIPES[name]
        if not rs:
            continue
        n_m, n_s = _ms([r["ndcg@10"] for r in rs])
        h_m, h_s = _ms([r["hr@10"] for r in rs])
        row = {"recipe": name, "dataset": recipe.dataset, "published_ndcg@10": recipe.published_ndcg10,
               "published_hr@10": recipe.published_hr10, "target_ndcg@10": recipe.target_ndcg10,
               "ndcg@10_mean": n_m, "ndcg@10_std": n_s, "hr@10_mean": h_m, "hr@10_std": h_s,
               "best_ndcg@10": max(r["best_ndcg@10"] for r in rs), "epochs": rs[0]["epochs"], "seeds": len(rs),
               "wall_seconds_mean": statistics.fmean(r["wall_seconds"] for r in rs),
               "tokens_per_second_mean": statistics.fmean(r["tokens_per_second"] for r in rs),
               "meets_target": n_m >= recipe.target_ndcg10, "source": recipe.source,
               "differences": recipe.differences}
        rows.append(row)
        best = max(rs, key=lambda r: r["best_ndcg@10"])
        print(f"| {recipe.dataset} | {name} | {recipe.published_ndcg10:.4f} / {recipe.published_hr10:.4f} | "
              f">= {recipe.target_ndcg10:.4f} | {n_m:.4f} ± {n_s:.4f} | {h_m:.4f} ± {h_s:.4f} | "
              f"{best['best_ndcg@10']:.4f} ({best['best_epoch']:g}) | {row['epochs']} | {len(rs)} | "
              f"{row['wall_seconds_mean']:.0f} | {row['tokens_per_second_mean']:,.0f} |")
    return {"mode": "reproduce", "table": rows, "runs": runs}


#: ``--parity`` settings: name -> fsdata balance flags (the default balance composes global batches).
PARITY_STRATEGIES = {"shuffle": ["--strategy", "shuffle"], "default": [],
                     "cost-budget": ["--batch-policy", "cost-budget"]}


def parity(a: argparse.Namespace, work: Path, log: Path) -> dict:
    runs, rows = [], []
    pool = load_reusable(a.reuse)
    seeds = [int(s) for s in a.seeds.split(",")]
    settings = [tuple(int(x) for x in rb.split("x")) for rb in a.rank_batches.split(",")]
    for name in a.recipes.split(","):
        recipe = RECIPES[name]
        epochs = a.epochs or recipe.epochs
        samples, ev = convert(recipe, work, log)
        for R, B in settings:
            for strategy in a.strategies.split(","):
                flags = PARITY_STRATEGIES[strategy]
                for seed in seeds:
                    shards = work / f"parity-{name}-R{R}B{B}-{strategy}-e{epochs}-s{seed}"
                    bal = balance(samples, shards, log, ranks=R, batch_size_per_rank=B, epochs=epochs, seed=seed,
                                  flags=list(flags))
                    digest = global_batches_digest(shards)
                    manifest = json.loads((shards / "_manifest.json").read_text())
                    compose = (manifest.get("settings") or {}).get("compose") or {}
                    rec = {"recipe": name, "ranks": R, "batch_size_per_rank": B, "strategy": strategy,
                           "seed": seed, "epochs": epochs, "predicted_bubble": bal["predicted_bubble"],
                           "num_steps": bal.get("num_steps"), "windows_composed": compose.get("windows_composed"),
                           "global_batches_sha256": digest}
                    twin = find_identical(pool + runs, name, seed, epochs, digest)
                    if twin is not None:
                        _reuse(rec, twin)
                    elif a.no_train:
                        print(f"{name} R={R} B={B} {strategy} seed {seed}: not run (--no-train), predicted bubble "
                              f"{rec['predicted_bubble']:.2%}", flush=True)
                        runs.append(rec)
                        continue
                    else:
                        rec.update(_eval_fields(train(shards, ev, work / f"{shards.name}-run", log, recipe, seed,
                                                      simulate=True)))
                    runs.append(rec)
                    print(f"{name} R={R} B={B} {strategy} seed {seed}: NDCG@10 {rec['ndcg@10']:.4f}, predicted "
                          f"bubble {rec['predicted_bubble']:.2%}, {rec['wall_seconds']:.0f} s"
                          + (f" [= {rec['reused_from']}]" if rec.get("reused_from") else ""), flush=True)
                every = [r for r in runs if (r["recipe"], r["ranks"], r["batch_size_per_rank"], r["strategy"])
                         == (name, R, B, strategy)]
                rs = [r for r in every if "ndcg@10" in r]
                if not rs:
                    rows.append({"recipe": name, "ranks": R, "batch_size_per_rank": B, "strategy": strategy,
                                 "seeds": 0, "epochs": epochs, "ndcg@10_mean": None, "ndcg@10_std": None,
                                 "predicted_bubble": statistics.fmean(r["predicted_bubble"] for r in every)})
                    continue
                m, sd = _ms([r["ndcg@10"] for r in rs])
                rows.append({"recipe": name, "ranks": R, "batch_size_per_rank": B, "strategy": strategy,
                             "ndcg@10_mean": m, "ndcg@10_std": sd, "seeds": len(rs), "epochs": epochs,
                             "seeds_list": [r["seed"] for r in rs],
                             "reused": sum(bool(r.get("reused_from")) for r in rs),
                             "predicted_bubble": statistics.fmean(r["predicted_bubble"] for r in every)})
    print("\n| data | R x B | strategy | predicted bubble | NDCG@10 (mean ± std) | seeds (same batches as an "
          "earlier run) | vs shuffle | within 1 std |")
    print("|---|---|---|---:|---:|---|---:|---|")
    for row in rows:
        head = (f"| {row['recipe']} | {row['ranks']} x {row['batch_size_per_rank']} | {row['strategy']} | "
                f"{row['predicted_bubble']:.2%} | ")
        if row["ndcg@10_mean"] is None:
            print(head + "not run | 0 | - | - |")
            continue
        seeds_cell = f"{row['seeds']} ({row['reused']})"
        base = next((r for r in rows if (r["recipe"], r["ranks"], r["batch_size_per_rank"], r["strategy"]) ==
                     (row["recipe"], row["ranks"], row["batch_size_per_rank"], "shuffle")), None)
        if base is None or base["ndcg@10_mean"] is None:  # shuffle not run
            print(head + f"{row['ndcg@10_mean']:.4f} ± {row['ndcg@10_std']:.4f} | {seeds_cell} | - | - |")
            continue
        diff = row["ndcg@10_mean"] - base["ndcg@10_mean"]
        row["diff_vs_shuffle"] = diff
        row["within_one_std"] = (abs(diff) <= max(base["ndcg@10_std"], 1e-12)
                                 if row["strategy"] != "shuffle" and base["seeds"] > 1 else None)  # 1 seed: no std
        if row["within_one_std"] is None:
            within = "-" if base["seeds"] < 2 and row["strategy"] != "shuffle" else ""
        else:
            within = "yes" if row["within_one_std"] else "NO"
        print(head + f"{row['ndcg@10_mean']:.4f} ± {row['ndcg@10_std']:.4f} | {seeds_cell} | {diff:+.4f} | "
              f"{within} |")
    return {"mode": "parity", "table": rows, "runs": runs}


def bubbles(a: argparse.Namespace, work: Path, log: Path) -> dict:
    """Predicted bubble of every parity setting (balance only, no training), plus ``--rank-batches``."""
    rows = []
    for name in a.recipes.split(","):
        recipe = RECIPES[name]
        epochs = a.epochs or recipe.epochs
        samples, _ = convert(recipe, work, log)
        for R, B in [tuple(int(x) for x in rb.split("x")) for rb in a.rank_batches.split(",")]:
            for strategy in a.strategies.split(","):
                shards = work / f"bubble-{name}-R{R}B{B}-{strategy}-e{epochs}"
                row = {"recipe": name, "ranks": R, "batch_size_per_rank": B, "strategy": strategy, "epochs": epochs}
                try:
                    bal = balance(samples, shards, log, ranks=R, batch_size_per_rank=B, epochs=epochs, seed=0,
                                  flags=list(PARITY_STRATEGIES[strategy]))
                    row.update(predicted_bubble=bal["predicted_bubble"], num_steps=bal.get("num_steps"),
                               equal_count_bubble=bal.get("baseline_predicted_bubble"))
                except RuntimeError as e:  # e.g. a global batch larger than the dataset
                    row["error"] = str(e).split(": ", 1)[-1]
                rows.append(row)
    print("\n| data | R x B | strategy | epochs | steps | predicted bubble | equal-count bubble |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['recipe']} | {r['ranks']} x {r['batch_size_per_rank']} | {r['strategy']} | {r['epochs']} | - "
                  f"| refused: {r['error']} | - |")
        else:
            eq = r.get("equal_count_bubble")
            print(f"| {r['recipe']} | {r['ranks']} x {r['batch_size_per_rank']} | {r['strategy']} | {r['epochs']} | "
                  f"{r['num_steps']} | {r['predicted_bubble']:.2%} | {'-' if eq is None else f'{eq:.2%}'} |")
    return {"mode": "bubbles", "table": rows, "runs": []}


def per_user_vs_per_event(a: argparse.Namespace, work: Path, log: Path) -> dict:
    runs = []
    for name in a.recipes.split(","):
        recipe = RECIPES[name]
        if a.eval_every_epochs:
            recipe = dataclasses.replace(recipe, eval_every_epochs=a.eval_every_epochs)
        epochs = a.epochs or recipe.epochs
        for kind in ("per-user", "per-event"):
            samples, ev = convert(recipe, work, log, samples=kind)
            shards = work / f"kind-{name}-{kind}-e{epochs}"
            balance(samples, shards, log, ranks=1, batch_size_per_rank=recipe.batch_size, epochs=epochs, seed=0)
            summary = train(shards, ev, work / f"{shards.name}-run", log, recipe, 0)
            rec = {"recipe": name, "samples": kind, "objective": summary["objective"], "epochs": epochs,
                   **_eval_fields(summary)}
            runs.append(rec)
    print("\n| data | samples | objective | epochs | NDCG@10 | HR@10 | tokens trained | train s | tokens/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r['recipe']} | {r['samples']} | {r['objective']} | {r['epochs']} | {r['ndcg@10']:.4f} | "
              f"{r['hr@10']:.4f} | {r['tokens_trained']:,} | {r['train_seconds']:.0f} | "
              f"{r['tokens_per_second']:,.0f} |")
    return {"mode": "per-user-vs-per-event", "table": runs, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_quality", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("Examples::")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--reproduce", action="store_true", help="the published tables (quality_recipes.RECIPES)")
    mode.add_argument("--parity", action="store_true", help="shuffle vs default vs cost-budget at convergence")
    mode.add_argument("--per-user-vs-per-event", action="store_true", help="the two sample kinds, same epochs")
    mode.add_argument("--bubbles", action="store_true",
                      help="predicted bubble of each --parity setting (balance only, no training)")
    p.add_argument("--recipes", default=None, help=f"comma-separated, of {', '.join(RECIPES)} (default: per mode)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--epochs", type=int, default=None, help="override the recipes' epochs")
    p.add_argument("--eval-every-epochs", type=int, default=None,
                   help="--per-user-vs-per-event: evaluate every N epochs (default: the recipe's), for the curve")
    p.add_argument("--rank-batches", default="16x8,8x32", help="--parity: RxB settings (default 16x8,8x32)")
    p.add_argument("--strategies", default=",".join(PARITY_STRATEGIES),
                   help=f"--parity: comma-separated, of {', '.join(PARITY_STRATEGIES)} (default: all)")
    p.add_argument("--reuse", action="append", default=[], metavar="FILE",
                   help="--reproduce/--parity: a JSON of this benchmark; runs with the same recipe, seed, epochs and "
                        "global batches take its figures instead of training (repeatable)")
    p.add_argument("--no-train", action="store_true",
                   help="--reproduce/--parity: balance only; report the runs --reuse gives, the rest as not run")
    p.add_argument("--out", default=str(REPO_ROOT / "bench-output"), help="JSON goes here")
    p.add_argument("--work", default="/tmp/bench_quality_convergence", help="scratch: samples, shards, runs")
    a = p.parse_args(argv)
    if a.recipes is None:
        a.recipes = (",".join(RECIPES) if a.reproduce else "ml-1m-sasrec,sports-sasrec" if a.parity or a.bubbles
                     else "toys-sasrec")
    bad = [s for s in a.strategies.split(",") if s not in PARITY_STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad}; use {', '.join(PARITY_STRATEGIES)}")
    unknown = [r for r in a.recipes.split(",") if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipes {unknown}; use {', '.join(RECIPES)}")
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    t0 = time.perf_counter()
    fn = (reproduce if a.reproduce else parity if a.parity else bubbles if a.bubbles else per_user_vs_per_event)
    result = fn(a, work, log)
    result.update({"command": "python -m benchmarks.bench_quality " + shlex.join(argv or sys.argv[1:]),
                   "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPU cores, no GPU",
                   "total_seconds": time.perf_counter() - t0})
    path = out / f"bench_quality_{result['mode']}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nJSON: {path}; commands: {log}")
    return 0
