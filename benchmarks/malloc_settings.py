"""What keeping freed memory in the process (``specrl.malloc``) buys the learner's steps.

Steps are timed with and without it, in alternating child processes.

Usage: python benchmarks/malloc_settings.py [--sizes 32,64,96,128] [--processes 2]
       [--out benchmarks/results/malloc_settings.json]

Contract: each child builds the default ``specrl train`` run (SmolLM2-135M, bf16 autocast
learner, 2 torch threads), calls ``keep_freed_memory()`` or not, and times ``Learner.train_step``
on synthetic GRPO batches (groups of 8 samples with 47-token prompts and 15-40-token
completions, the same seeded batches in every child) of each size in ``--sizes`` twice: the
first pass meets each packed shape for the first time ("new shapes", as RL steps keep doing),
the second runs the same batches again ("seen shapes"). ``--processes`` children per setting,
alternating (default, kept, default, kept, ...); per size and pass the median over children
and the ratio default / kept. Wall times only; no accuracy question (values are unchanged).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "malloc_settings.json"
SETTINGS = ("default", "kept")


def child(setting: str, sizes: list[int]) -> dict[str, list[float]]:
    """Time the learner on each size, twice (new shapes, then seen shapes)."""
    from specrl.config import load_config
    from specrl.malloc import keep_freed_memory
    from specrl.pipelines.build import build_run
    from specrl.rl.learner import TrainSample

    if setting == "kept" and not keep_freed_memory():
        raise SystemExit("glibc did not take the malloc settings here: nothing to compare")
    learner = build_run(load_config(None, ["rollout.spec=none"])).learner
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(47)] for _ in range(max(sizes) // 8)]

    def batch(n: int) -> list[TrainSample]:
        return [TrainSample(prompts[i // 8],
                            [rng.randrange(1000, 20000) for _ in range(rng.randint(15, 40))],
                            advantage=rng.gauss(0, 1)) for i in range(n)]  # fmt: skip

    batches = {n: batch(n) for n in sizes}
    times: dict[str, list[float]] = {"new": [], "seen": []}
    for phase in times:
        for n in sizes:
            t0 = time.perf_counter()
            learner.train_step(batches[n])
            times[phase].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,64,96,128", help="samples per step")
    ap.add_argument("--processes", type=int, default=2, help="children per setting")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(child(args.child, sizes)))
        return
    from specrl.bench import run_metadata, write_result

    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for i in range(args.processes):
        for setting in SETTINGS:
            cmd = [sys.executable, __file__, "--sizes", args.sizes, "--child", setting]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"process {i + 1}/{args.processes} {setting}: {runs[setting][-1]}", flush=True)
    points = []
    for phase in ("new", "seen"):
        for j, n in enumerate(sizes):
            med = {s: statistics.median(r[phase][j] for r in runs[s]) for s in SETTINGS}
            ratio = med["default"] / med["kept"]
            points.append(
                {"samples": n, "shapes": phase, "seconds": med, "default_over_kept": ratio}
            )
            print(f"{phase:>4} shapes, {n:3d} samples: default {med['default']:.2f} s, "
                  f"kept {med['kept']:.2f} s, default/kept {ratio:.3f}")  # fmt: skip
    meta = run_metadata() | {"args": {k: str(v) for k, v in vars(args).items()}}
    write_result({"meta": meta, "points": points, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
