"""Synchronous vs asynchronous GRPO on the same config and machine, with and without speculation.

Each contender trains ``--warmup + --steps`` steps from the same initial weights, prompts and
request seeds, in its own fresh process (thread settings are per process), and every one uses
the whole machine:
- ``sync-T``: the synchronous pipeline, engine inline, ``T`` torch threads, for each T in
  ``--sync-threads`` (its fastest setting is measured, not assumed);
- ``async-T``: the asynchronous pipeline (``pipeline.max_staleness``, default 1) with the engine
  in its own worker process (``rollout.placement=process``, ``rollout.threads=1``) and the
  learner with ``T`` torch threads, for each T in ``--async-threads`` (1: one core each; 2: the
  learner also competes for the worker's core): rollouts and learning overlap.
Also reported: the async ceiling, the fastest sync step time / max(async generation time, async
learner ``train_time_s``) per step (means over the steps after ``--warmup``), i.e. what perfect
overlap of the two measured phases would give (the learner's refit and logprob check, ~0.05 s,
are left out).
Reported per contender: samples/s (completions trained per second of the whole run's wall time,
first step included, so async pays for filling its pipeline), the same over the steps after
``--warmup`` only (``steady_samples_per_s``: with few steps, an async producer's head start from
the warm-up inflates it), mean step time, generation's share of a sync step, mean staleness and
idle times (means over the steps after ``--warmup``); then
async over the fastest sync, per speculation setting (``--specs``, default none and suffix). The
machine's copy bandwidth and GEMM rate are measured in the same run (64 MiB buffers, far larger
than the caches). Writes JSON with ``specrl.bench.run_metadata()``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_vs_async.py --steps 4 --warmup 1 \\
        --set rollout.max_new_tokens=128 --out benchmarks/results/sync_vs_async.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = "--child"


def contender_overrides(name: str) -> list[str]:
    if name == "async":
        return ["pipeline.mode=async", "rollout.placement=process", "rollout.threads=1"]
    return ["pipeline.mode=sync", "rollout.placement=inline"]


def run_child(args: argparse.Namespace) -> dict:
    """In a fresh process: train and return the measured means."""
    import torch

    from specrl.config import load_config
    from specrl.pipelines.build import build_run
    from specrl.pipelines.train import train

    torch.set_num_threads(args.threads)
    steps = args.warmup + args.steps
    cfg = load_config(args.config, [*args.set, f"run.steps={steps}", "run.eval_every=0",
                                    "run.checkpoint_every=0"])  # fmt: skip
    torch.manual_seed(cfg.run.seed)
    parts = build_run(cfg)
    try:
        with tempfile.TemporaryDirectory() as d:
            rows = train(parts, d, progress=False)
    finally:
        parts.backend.close()
    kept = rows[args.warmup :]
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    wall = sum(r["step_time_s"] for r in rows)  # the whole run: async pays its pipeline fill
    steady = sum(r["step_time_s"] for r in kept)
    mean = {k: statistics.fmean(r[k] for r in kept) for k in (
        "step_time_s", "gen_time_s", "train_time_s", "gen_tokens", "response_length",
        "acceptance_length", "staleness_mean", "learner_idle_s", "generator_idle_s",
        "reward_mean")}  # fmt: skip
    return {"samples_per_s": per_step * len(rows) / wall, "wall_s": wall, "steps": len(rows),
            "steady_samples_per_s": per_step * len(kept) / steady,
            "gen_share_of_step": mean["gen_time_s"] / mean["step_time_s"],
            "learner_dtype": parts.learner.dtype} | mean  # fmt: skip


def run_contender(name: str, threads: int, spec: str, args: argparse.Namespace) -> dict:
    sets = [*args.set, f"rollout.spec={spec}", *contender_overrides(name)]
    if name == "async":
        sets.append(f"pipeline.max_staleness={args.staleness}")
    cmd = [sys.executable, __file__, CHILD, "--threads", str(threads), "--steps", str(args.steps),
           "--warmup", str(args.warmup)] + [a for s in sets for a in ("--set", s)]  # fmt: skip
    if args.config:
        cmd += ["--config", args.config]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{name} ({spec}) failed:\n{out.stderr[-3000:]}")
    label = f"{name}-{threads}"
    return {"contender": label, "spec": spec, "threads": threads} | json.loads(
        out.stdout.strip().splitlines()[-1]
    )


def compare(args: argparse.Namespace) -> dict:
    from specrl.bench import measure_machine, run_metadata

    machine = {dt: measure_machine(getattr(__import__("torch"), dt))
               for dt in ("float32", "bfloat16")}  # fmt: skip
    results, ratios = [], []
    for spec in args.specs:
        rows = [run_contender("sync", t, spec, args) for t in args.sync_threads]
        asyncs = [run_contender("async", t, spec, args) for t in args.async_threads]
        for r in rows + asyncs:
            print(f"{spec:>7} {r['contender']:>7}: {r['samples_per_s']:.2f} samples/s, step "
                  f"{r['step_time_s']:.2f} s (gen {r['gen_time_s']:.2f} s = "
                  f"{100 * r['gen_share_of_step']:.0f}% of it, train {r['train_time_s']:.2f} s), "
                  f"acc.len {r['acceptance_length']:.2f}, stale {r['staleness_mean']:.2f}",
                  flush=True)  # fmt: skip
        best = max(rows, key=lambda r: r["samples_per_s"])
        fast = max(asyncs, key=lambda r: r["samples_per_s"])
        ratio = fast["samples_per_s"] / best["samples_per_s"]
        ceiling = best["step_time_s"] / max(fast["gen_time_s"], fast["train_time_s"])
        ratios.append({"spec": spec, "fastest_sync": best["contender"],
                       "fastest_async": fast["contender"], "async_over_sync": ratio,
                       "async_ceiling": ceiling,
                       "sync_gen_share": best["gen_share_of_step"]})  # fmt: skip
        print(f"{spec:>7} {fast['contender']} / {best['contender']}: {ratio:.2f}x (perfect "
              f"overlap would give {ceiling:.2f}x)", flush=True)  # fmt: skip
        results += rows + asyncs
    return run_metadata() | {"machine_roofline": machine, "workload": args.set,
                             "results": results, "ratios": ratios}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per contender")
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the means")
    ap.add_argument("--config", default=None, help="TOML run config")
    ap.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--specs", default="none,suffix", help="speculation settings to compare")
    ap.add_argument("--sync-threads", default="1,2", help="torch threads of the sync contenders")
    ap.add_argument("--async-threads", default="1,2", help="learner threads of async contenders")
    ap.add_argument("--staleness", type=int, default=1, help="async pipeline.max_staleness")
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    args.specs = args.specs.split(",")
    args.sync_threads = [int(t) for t in args.sync_threads.split(",")]
    args.async_threads = [int(t) for t in args.async_threads.split(",")]
    out = compare(args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
