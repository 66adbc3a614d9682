"""GRPO on the default workload with and without speculation, one run: throughput and step time.

For each variant (``none`` and every model-free drafter given, default ngram and suffix) the
script runs the synchronous pipeline for ``--steps`` steps from the same initial weights with the
same prompts and request seeds, and reports per variant the mean rollout tokens/s, generation
time, acceptance length and step time, plus ratios against ``none``. Then, on each speculative
variant's final weights and drafter state, it rolls out the next step's prompts plain and
speculative at each ``--batches`` max batch (same weights, same seeds): the speedup by batch
regime (speculation pays while decode is memory-bound, i.e. at small batches on this CPU), and
the free-drafter ceiling: the speedup had drafting cost nothing at the same acceptance.
Steps before ``--warmup`` are left out of the means. A drafter written ``NAME/S`` runs with
``rollout.spec_siblings=S`` (S extra first-token candidates). Prints a table, writes JSON with
``specrl.bench.run_metadata()``.

    .venv/bin/python benchmarks/grpo_spec_vs_plain.py --steps 4 --warmup 1
    .venv/bin/python benchmarks/grpo_spec_vs_plain.py --steps 2 --set rollout.prompts_per_step=4
    .venv/bin/python benchmarks/grpo_spec_vs_plain.py --drafters eagle3,eagle3/3 --batches 1,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from specrl.bench import run_metadata
from specrl.config import load_config
from specrl.pipelines.build import build_run
from specrl.pipelines.speed import measure_speedup
from specrl.pipelines.train import train

KEYS = ("rollout_tokens_per_s", "gen_time_s", "gen_tokens", "acceptance_length", "train_time_s",
        "step_time_s", "reward_mean")  # fmt: skip


def run_variant(spec: str, args) -> tuple[dict, list[dict]]:
    """Train ``--steps`` steps with ``rollout.spec=spec``; mean metrics and the batch sweep."""
    method, _, siblings = spec.partition("/")
    cfg = load_config(args.config, [*args.set, f"rollout.spec={method}", f"run.steps={args.steps}",
                                    f"rollout.spec_siblings={siblings or 0}",
                                    "run.eval_every=0", "run.checkpoint_every=0"])  # fmt: skip
    torch.manual_seed(cfg.run.seed)
    parts = build_run(cfg)
    with tempfile.TemporaryDirectory() as d:
        rows = train(parts, d, progress=False, echo=print)
    kept = rows[args.warmup :] or rows
    means = {k: statistics.fmean(r[k] for r in kept) for k in KEYS}
    sweep = []
    if spec != "none":
        for i, batch in enumerate(args.batches):  # new prompts each time: no self-made history
            parts.backend.engine.max_batch = batch
            speed = measure_speedup(parts, args.steps + i)
            sweep.append({"spec": spec, "max_batch": batch} | speed)
    return {"spec": spec, "steps_measured": len(kept)} | means, sweep


def with_ratios(results: list[dict]) -> list[dict]:
    base = next(r for r in results if r["spec"] == "none")
    for r in results:
        r["rollout_speedup"] = r["rollout_tokens_per_s"] / base["rollout_tokens_per_s"]
        r["gen_time_ratio"] = base["gen_time_s"] / r["gen_time_s"]
        r["step_speedup"] = base["step_time_s"] / r["step_time_s"]
    return results


def print_tables(results: list[dict], sweep: list[dict]) -> None:
    print(f"\n{'spec':8} {'tok/s':>8} {'gen s':>7} {'acc.len':>8} {'step s':>7} "
          f"{'rollout x':>10} {'step x':>7}")  # fmt: skip
    for r in results:
        print(f"{r['spec']:8} {r['rollout_tokens_per_s']:8.1f} {r['gen_time_s']:7.1f} "
              f"{r['acceptance_length']:8.2f} {r['step_time_s']:7.1f} "
              f"{r['rollout_speedup']:10.2f} {r['step_speedup']:7.2f}")  # fmt: skip
    print(f"\n{'spec':8} {'batch':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'acc.len':>8} "
          f"{'speedup':>8} {'free-draft x':>13}")  # fmt: skip
    for s in sweep:
        print(f"{s['spec']:8} {s['max_batch']:6d} {s['plain_tokens_per_s']:12.1f} "
              f"{s['spec_tokens_per_s']:11.1f} {s['spec_acceptance_length']:8.2f} "
              f"{s['rollout_speedup']:8.2f} {s['free_draft_speedup']:13.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="RL steps per variant")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    ap.add_argument("--drafters", default="ngram,suffix",
                    help="comma-separated drafters; NAME/S adds S sibling candidates")  # fmt: skip
    ap.add_argument("--batches", default="4,16,64", help="max batches of the rollout sweep")
    ap.add_argument("--config", default=None, help="TOML run config (default: embedded)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default="benchmarks/results/grpo_spec_vs_plain.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.threads:
        torch.set_num_threads(args.threads)
    results, sweep = [], []
    for spec in ["none", *[d for d in args.drafters.split(",") if d]]:
        means, rows = run_variant(spec, args)
        results.append(means)
        sweep += rows
    print_tables(with_ratios(results), sweep)
    out = {"meta": run_metadata(), "args": vars(args), "results": results, "batch_sweep": sweep}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
