"""Training on your own task: a JSONL file of arithmetic word problems and the ``math`` reward.

Two measurements, each a subcommand, each writing a JSON with ``specrl.bench.run_metadata()``:

``learn``: the default ``specrl train`` (its steps, batch and lengths) on a JSONL file of
one-digit word problems this script writes (nothing from reasoning-gym), scored by the ``math``
reward (math-verify), 48 prompts held out by hash; per-step reward and the held-out greedy /
sampled accuracy, and ``docs/img/own_task_learn.png``.

``overlap``: rewards off the critical path. Three runs of the same steps side by side: the
``math`` reward alone (generation + learner, rewards ~free), plus a reward that sleeps 50 ms
per completion scored by the worker pool as groups finish (``reward.workers=2``), and the same
reward in the trainer's thread after generation (``reward.workers=0``). Reported: mean step
time of each, the reward seconds generation hid (``reward_overlap_s``) and the wait after it.
Sleep stands for a verifier that waits (a sandbox, a server); a CPU-bound reward on this
2-core machine would compete with generation instead.

    .venv/bin/python benchmarks/own_task.py learn --out benchmarks/results/own_task_learn.json
    .venv/bin/python benchmarks/own_task.py overlap --out benchmarks/results/reward_overlap.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from specrl.bench import run_metadata
from specrl.pipelines.rundir import RunDir

NAMES = ("Sam", "Mia", "Tom", "Ana", "Leo", "Zoe", "Max", "Ivy")
THINGS = ("apples", "pens", "cards", "shells", "coins", "books", "stickers", "marbles")
ASK = " Reply with only the final answer."
FILE_SETS = ('env.kind="file"', 'reward.funcs=["math"]')


def word_problems() -> list[dict[str, Any]]:
    """Distinct one-digit addition / subtraction word problems with integer answers."""
    rows = {}
    for name in NAMES:
        for thing in THINGS:
            for a in range(1, 10):
                for b in range(1, 10):
                    rows[f"{name} has {a} {thing} and gets {b} more. How many {thing} does "
                         f"{name} have now?"] = a + b  # fmt: skip
                    if b <= a:
                        rows[f"{name} has {a} {thing} and gives away {b}. How many {thing} "
                             f"are left?"] = a - b  # fmt: skip
    return [{"prompt": q + ASK, "answer": ans} for q, ans in rows.items()]


def write_problems(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` of the word problems, in a seeded order, as JSONL at ``path``."""
    rows = word_problems()
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
    return path


def train(run_dir: Path, data: Path, sets: list[str]) -> tuple[Path, float]:
    """One ``specrl.train`` run (as ``specrl train``): the run directory it used (``run_dir``,
    or ``run_dir-N`` if that was used) and its wall seconds."""
    import specrl

    overrides = [*FILE_SETS, f"env.train_file={json.dumps(str(data))}", *sets]
    t0 = time.perf_counter()
    used = specrl.train(overrides=overrides, run_dir=run_dir, compare=False, progress=False)
    return used, time.perf_counter() - t0


def learn(args: argparse.Namespace) -> dict[str, Any]:
    data = write_problems(args.work / "word_problems.jsonl", args.rows)
    run_dir, wall = train(args.work / "learn", data, args.set)
    run = RunDir(run_dir)
    rows, evals = run.rows(run.metrics), run.rows(run.evals)
    plot(rows, evals, args.plot)
    return {
        "run_dir": str(run_dir),
        "data": {"file": str(data), "rows": args.rows, "eval_held_out": 48},
        "sets": [*FILE_SETS, *args.set],
        "wall_s": wall,
        "steps": [{k: r[k] for k in ("step", "reward_mean", "accuracy", "response_length",
                                     "reward_math_mean", "step_time_s")} for r in rows],
        "evals": evals,
        "reward_first_last": [rows[0]["reward_mean"], rows[-1]["reward_mean"]],
        "eval_greedy_first_last": [evals[0]["greedy_accuracy"], evals[-1]["greedy_accuracy"]],
        "eval_sampled_first_last": [evals[0]["sampled_accuracy"], evals[-1]["sampled_accuracy"]],
        "plot": str(args.plot),
    }  # fmt: skip


def plot(rows: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label="train reward")
    for key in ("greedy_accuracy", "sampled_accuracy"):
        ax.plot([e["step"] for e in evals], [e[key] for e in evals], "o--",
                label=f"held-out {key.replace('_', ' ')}")  # fmt: skip
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M, word problems from a JSONL file, math reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def slow_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """A reward that takes 50 ms per completion and scores nothing (weight 0 in the runs)."""
    time.sleep(0.05 * len(completions))
    return [0.0] * len(completions)


OVERLAP_RUNS = {
    "math_only": [],
    "slow_pool": [
        f'reward.funcs=["math", "{__file__}:slow_reward"]',
        "reward.weights=[1, 0]",
        "reward.workers=2",
    ],  # fmt: skip
    "slow_inline": [
        f'reward.funcs=["math", "{__file__}:slow_reward"]',
        "reward.weights=[1, 0]",
        "reward.workers=0",
    ],  # fmt: skip
}


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    data = write_problems(args.work / "word_problems.jsonl", args.rows)
    base = [f"run.steps={args.steps}", "run.eval_every=0", "run.checkpoint_every=0", *args.set]
    out: dict[str, Any] = {"sets": base, "runs": {}}
    for name, sets in OVERLAP_RUNS.items():
        run_dir, _ = train(args.work / f"overlap-{name}", data, [*base, *sets])
        rows = RunDir(run_dir).rows(RunDir(run_dir).metrics)[1:]  # the first step warms up
        out["runs"][name] = {
            key: statistics.mean(r[key] for r in rows)
            for key in ("step_time_s", "gen_time_s", "train_time_s", "refit_time_s",
                        "reward_overlap_s", "reward_wait_s")
        }  # fmt: skip
    runs = out["runs"]
    out["reward_s_per_step"] = 0.05 * 64  # 8 prompts x 8 completions x 50 ms
    out["step_ratio_pool_vs_math_only"] = (
        runs["slow_pool"]["step_time_s"] / runs["math_only"]["step_time_s"]
    )
    out["step_ratio_inline_vs_math_only"] = (
        runs["slow_inline"]["step_time_s"] / runs["math_only"]["step_time_s"]
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("learn", "overlap"))
    ap.add_argument("--work", type=Path, default=Path("runs/own_task"), help="runs and data")
    ap.add_argument("--rows", type=int, default=1000, help="word problems in the JSONL file")
    ap.add_argument("--steps", type=int, default=6, help="overlap: steps per run")
    ap.add_argument("--set", action="append", default=[], help="config override for all runs")
    ap.add_argument("--plot", type=Path, default=Path("docs/img/own_task_learn.png"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = {"what": args.what, **(learn(args) if args.what == "learn" else overlap(args))}
    result["metadata"] = run_metadata()
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "evals")}, indent=1))


if __name__ == "__main__":
    main()
