"""Training on your own task: a JSONL file of arithmetic word problems and the ``math`` reward.

Two measurements, each a subcommand, each writing a JSON with ``specrl.bench.run_metadata()``:

``learn``: the default ``specrl train`` (its steps, batch and lengths) on a JSONL file of
one-digit word problems this script writes (nothing from reasoning-gym), scored by the ``math``
reward (math-verify), 48 prompts held out by hash; per-step reward and the held-out greedy /
sampled accuracy, and ``docs/img/own_task_learn.png``.

``overlap``: rewards off the critical path. Three runs of the same steps side by side: the
``math`` reward alone (generation + learner, rewards ~free); plus a reward that sleeps
``--reward-ms`` per call (one GRPO group) or per completion, scored by the worker pool as each
group finishes (``reward.workers=--workers``); and the same reward in the trainer's thread after
generation (``reward.workers=0``). Reported: mean step time of each (the first step, a warm-up,
left out), the reward seconds generation hid (``reward_overlap_s``), the wait after it, and
the step time each slow-reward run adds to the math-only one. Sleep stands for a verifier that
waits (a sandbox, a server); a CPU-bound reward on this 2-core machine would compete with
generation instead. ``--long`` asks for step-by-step replies, whose groups finish apart.

    .venv/bin/python benchmarks/own_task.py learn --out benchmarks/results/own_task_learn.json
    .venv/bin/python benchmarks/own_task.py overlap --out runs/own_task/reward_overlap.json
    .venv/bin/python benchmarks/own_task.py overlap --long --per completion --workers 4 \
        --set rollout.max_new_tokens=256 --set rollout.prompts_per_step=4 --steps 5 \
        --out benchmarks/results/reward_overlap_long.json
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
STEPS = " Explain your reasoning step by step, then end with 'The answer is <answer>.'"
FILE_SETS = ('env.kind="file"', 'reward.funcs=["math"]')


def word_problems(ask: str = ASK) -> list[dict[str, Any]]:
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
    return [{"prompt": q + ask, "answer": ans} for q, ans in rows.items()]


def write_problems(path: Path, n: int, long: bool = False, seed: int = 0) -> Path:
    """``n`` of the word problems, in a seeded order, as JSONL at ``path`` (``long``: asking for
    step-by-step reasoning: long replies of varied length)."""
    rows = word_problems(STEPS if long else ASK)
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
    data = write_problems(args.work / "word_problems.jsonl", args.rows, args.long)
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


def slow_reward(
    prompts: list[str],
    completions: list[str],
    *,
    ms_per_call: float = 0.0,
    ms_per_completion: float = 0.0,
    **columns: Any,
) -> list[float]:
    """A reward that takes ``ms_per_call`` + ``ms_per_completion`` per completion of the call
    (sleeping, as a verifier that waits on a sandbox or a server) and scores 0 (weight 0)."""
    time.sleep((ms_per_call + ms_per_completion * len(completions)) / 1000)
    return [0.0] * len(completions)


def slow_reward_file(args: argparse.Namespace) -> Path:
    """A reward file binding ``slow_reward``'s cost: ``file.py:slow`` is what the runs name."""
    path = args.work / "slow_reward.py"
    key = "ms_per_call" if args.per == "call" else "ms_per_completion"
    path.write_text(f"from functools import partial\nimport sys\nsys.path.insert(0, "
                    f"{str(Path(__file__).parent)!r})\nfrom own_task import slow_reward\n"
                    f"slow = partial(slow_reward, {key}={args.reward_ms})\n")  # fmt: skip
    return path


def overlap_runs(args: argparse.Namespace) -> dict[str, list[str]]:
    """The three contenders: the math reward alone; plus the slow reward in the worker pool
    (``--workers``); plus the slow reward in the trainer's thread after generation."""
    funcs = f'reward.funcs=["math", "{slow_reward_file(args)}:slow"]'
    return {
        "math_only": [],
        "slow_pool": [funcs, "reward.weights=[1, 0]", f"reward.workers={args.workers}"],
        "slow_inline": [funcs, "reward.weights=[1, 0]", "reward.workers=0"],
    }


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    data = write_problems(args.work / "word_problems.jsonl", args.rows, args.long)
    base = [f"run.steps={args.steps}", "run.eval_every=0", "run.checkpoint_every=0", *args.set]
    out: dict[str, Any] = {"sets": base, "reward": {"ms": args.reward_ms, "per": args.per,
                           "workers": args.workers}, "long": args.long, "runs": {}}  # fmt: skip
    for name, sets in overlap_runs(args).items():
        run_dir, _ = train(args.work / f"overlap-{name}", data, [*base, *sets])
        rows = RunDir(run_dir).rows(RunDir(run_dir).metrics)[1:]  # the first step warms up
        out["runs"][name] = {
            key: statistics.mean(r[key] for r in rows)
            for key in ("step_time_s", "gen_time_s", "train_time_s", "refit_time_s",
                        "response_length", "reward_overlap_s", "reward_wait_s")
        }  # fmt: skip
    runs = out["runs"]
    base_s = runs["math_only"]["step_time_s"]
    for name in ("slow_pool", "slow_inline"):
        out[f"step_ratio_{name}_vs_math_only"] = runs[name]["step_time_s"] / base_s
        out[f"exposed_reward_s_{name}"] = runs[name]["step_time_s"] - base_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("learn", "overlap"))
    ap.add_argument("--work", type=Path, default=Path("runs/own_task"), help="runs and data")
    ap.add_argument("--rows", type=int, default=1000, help="word problems in the JSONL file")
    ap.add_argument("--steps", type=int, default=6, help="overlap: steps per run")
    ap.add_argument("--reward-ms", type=float, default=50.0, help="overlap: the slow reward's ms")
    ap.add_argument(
        "--per",
        choices=("call", "completion"),
        default="call",
        help="overlap: the slow reward's ms per call (one group) or per completion",
    )
    ap.add_argument("--workers", type=int, default=2, help="overlap: reward.workers of the pool")
    ap.add_argument("--long", action="store_true",
                    help="ask for step-by-step replies (long, of varied length)")  # fmt: skip
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
