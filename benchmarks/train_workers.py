"""The default ``specrl train`` on 1 and on 2 train workers: reward curves, time, memory per rank.

Runs (or, with ``--reuse``, reads) two run directories made by the same command except
``cluster.train_workers`` (same seed, prompts and number of steps), then records their reward
and held-out accuracy, the learner's time (``train_time_s``: the step on the ranks;
``refit_time_s``: gathering the shards block by block into the trainer's copy plus the push
through the weight-sync guard) and the steps' wall time. Memory: the learner's parameter,
gradient and AdamW bytes after one step on the default model, in one process and on each of the
2 ranks (``rl.sharded.learner_bytes``, local shards), measured in this process with the same
config. On a 2-core machine the two ranks share the cores the one process had: no speedup is
expected, the time is recorded as it is. Writes a plot and a JSON with
``specrl.bench.run_metadata()``.

    .venv/bin/python benchmarks/train_workers.py --out benchmarks/results/train_workers.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from train_sync_vs_async import describe, pair_arguments, reward_line

from specrl.bench import run_metadata
from specrl.config import load_config
from specrl.pipelines.build import build_run
from specrl.pipelines.report import write_comparison
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.train import train as train_in_process
from specrl.rl.sharded import learner_bytes

WORKERS = (1, 2)


def train(run_dir: Path, workers: int, sets: list[str]) -> list[str]:
    cmd = [".venv/bin/specrl", "train", "--run-dir", str(run_dir), "--no-progress", "--no-compare",
           "--set", f"cluster.train_workers={workers}"]  # fmt: skip
    cmd += [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True)
    return cmd


def learner_times(run_dir: Path) -> dict[str, float]:
    """Medians over the run's steps of the learner's step and of the weight refit."""
    run = RunDir(run_dir)
    rows = run.rows(run.metrics)
    keys = ("train_time_s", "refit_time_s")
    return {key: statistics.median(r[key] for r in rows) for key in keys}


def memory(workers: int, sets: list[str]) -> list[dict[str, int]]:
    """The learner's bytes after one step of the configured run on ``workers`` train workers
    (one entry per rank; one for the one-process learner)."""
    cfg = load_config(None, [*sets, "run.steps=1", "run.eval_every=0", "run.checkpoint_every=0",
                             f"cluster.train_workers={workers}"])  # fmt: skip
    parts = build_run(cfg)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            train_in_process(parts, tmp, progress=False)
        if workers == 1:
            return [learner_bytes(parts.learner)]
        return parts.learner.memory()
    finally:
        parts.close()


def main() -> None:
    runs = {"one": "runs/train-workers-1", "two": "runs/train-workers-2"}
    args, named = pair_arguments(__doc__, runs, "docs/img/train_workers.png")
    dirs = dict(zip(WORKERS, named.values(), strict=True))
    commands = {n: "reused" if args.reuse else " ".join(train(d, n, args.set))
                for n, d in dirs.items()}  # fmt: skip
    out = run_metadata() | {"train_commands": commands}
    for n, d in dirs.items():
        out[f"workers_{n}"] = describe(d) | learner_times(d) | {"memory": memory(n, args.set)}
    one, two = out["workers_1"], out["workers_2"]
    out["two_over_one_wall"] = two["wall_s"] / one["wall_s"]
    out["rank_over_whole_bytes"] = [r["total"] / one["memory"][0]["total"] for r in two["memory"]]
    write_comparison(list(dirs.values()), args.plot)
    for n in WORKERS:
        o = out[f"workers_{n}"]
        print(f"{n} worker(s): {reward_line(o['summary'])}, {o['wall_s']:.0f} s, train "
              f"{o['train_time_s']:.2f} s/step, refit {o['refit_time_s']:.2f} s/step, bytes per "
              f"rank {[r['total'] for r in o['memory']]}")  # fmt: skip
    print(f"rank / whole learner bytes: {out['rank_over_whole_bytes']}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
