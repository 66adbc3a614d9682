"""The default ``specrl train`` on the native and the vLLM rollout backend: reward curves.

Runs (or, with ``--reuse``, reads) two run directories made by the same command except
``rollout.backend`` (same seed, prompts, samples and number of steps; each backend with its
default drafter: suffix on native, ngram on vLLM), then writes their summaries, per-step reward,
engine-vs-learner logprob mismatch and time, ``docs/img/train_backends.png`` (reward over
completions trained on) and a JSON with ``specrl.bench.run_metadata()``.

    .venv/bin/python benchmarks/train_backends.py --out benchmarks/results/train_backends.json
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from train_sync_vs_async import describe, pair_arguments, reward_line

from specrl.bench import run_metadata
from specrl.pipelines.report import write_comparison
from specrl.pipelines.rundir import RunDir

BACKENDS = {"native": [], "vllm": ["--set", "rollout.backend=vllm"]}


def train(run_dir: Path, backend: str, sets: list[str]) -> list[str]:
    cmd = [".venv/bin/specrl", "train", "--run-dir", str(run_dir), "--no-progress"]
    cmd += BACKENDS[backend] + [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True)
    return cmd


def mismatch(run_dir: Path) -> dict:
    """Engine-vs-learner logprob mismatch over the run (mean of the steps' means, worst max)."""
    run = RunDir(run_dir)
    rows = run.rows(run.metrics)
    means = [r["logprob_delta_mean"] for r in rows]
    return {"logprob_delta_mean": sum(means) / len(means),
            "logprob_delta_max": max(r["logprob_delta_max"] for r in rows)}  # fmt: skip


def main() -> None:
    runs = {"native": "runs/backend-native", "vllm": "runs/backend-vllm"}
    args, dirs = pair_arguments(__doc__, runs, "docs/img/train_backends.png")
    commands = {b: "reused" if args.reuse else " ".join(train(d, b, args.set))
                for b, d in dirs.items()}  # fmt: skip
    out = run_metadata() | {"train_commands": commands}
    out |= {b: describe(d) | mismatch(d) for b, d in dirs.items()}
    out["vllm_over_native_wall"] = out["native"]["wall_s"] / out["vllm"]["wall_s"]
    write_comparison(list(dirs.values()), args.plot)
    for b in dirs:
        o = out[b]
        print(f"{b:>6}: {reward_line(o['summary'])}, |engine-learner logprob| "
              f"{o['logprob_delta_mean']:.4f} (max {o['logprob_delta_max']:.3f}), "
              f"{o['wall_s']:.0f} s")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
