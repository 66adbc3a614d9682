"""The default ``specrl train`` with the sync and the async pipeline: reward curves side by side.

Runs (or, with ``--reuse``, reads) two run directories made by the same command except
``pipeline.mode`` (same seed, same prompts, same number of samples), then writes their summaries,
per-step reward and time, and ``docs/img/train_sync_vs_async.png`` (``specrl report --compare``'s
plot: reward over completions trained on) and a JSON with ``specrl.bench.run_metadata()``.

    .venv/bin/python benchmarks/train_sync_vs_async.py \
        --out benchmarks/results/train_sync_vs_async.json
    .venv/bin/python benchmarks/train_sync_vs_async.py --reuse --sync runs/sync-default \\
        --async runs/async-default --out benchmarks/results/train_sync_vs_async.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from specrl.bench import run_metadata
from specrl.pipelines.report import samples_axis, summarize, write_comparison
from specrl.pipelines.rundir import RunDir

MODES = {"sync": [], "async": ["--set", "pipeline.mode=async"]}


def train(run_dir: Path, mode: str, sets: list[str]) -> list[str]:
    cmd = [".venv/bin/specrl", "train", "--run-dir", str(run_dir), "--no-progress", *MODES[mode]]
    cmd += [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True)
    return cmd


def describe(run_dir: Path) -> dict:
    run = RunDir(run_dir)
    rows, evals = run.rows(run.metrics), run.rows(run.evals)
    keep = ("step", "reward_mean", "accuracy", "response_length", "gen_time_s", "train_time_s",
            "step_time_s", "staleness_mean", "learner_idle_s", "generator_idle_s")  # fmt: skip
    return {
        "run_dir": str(run_dir),
        "summary": summarize(rows, evals),
        "wall_s": sum(r["step_time_s"] for r in rows),
        "samples": samples_axis(rows)[-1],
        "steps": [{k: r[k] for k in keep if k in r} for r in rows],
        "evals": evals,
    }


def pair_arguments(
    doc: str, runs: dict[str, str], plot: str
) -> tuple[argparse.Namespace, dict[str, Path]]:
    """The command line of a comparison of training runs: ``--NAME DIR`` per contender (default
    ``runs[NAME]``), ``--reuse``, ``--set`` (for all), ``--plot``, ``--out``; (the arguments,
    the run dir of each contender)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in runs.items():
        ap.add_argument(f"--{name}", dest=f"run_{name}", type=Path, default=Path(default))
    ap.add_argument("--reuse", action="store_true", help="read existing run dirs, train none")
    ap.add_argument("--set", action="append", default=[], help="config override for all")
    ap.add_argument("--plot", type=Path, default=Path(plot))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    return args, {name: getattr(args, f"run_{name}") for name in runs}


def reward_line(summary: dict) -> str:
    """Reward and held-out sampled accuracy, first -> last, of a run's summary."""
    s = summary
    return (f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, eval sampled "
            f"{s.get('eval_first_sampled_accuracy', 0):.3f} -> "
            f"{s.get('eval_last_sampled_accuracy', 0):.3f}")  # fmt: skip


def main() -> None:
    runs = {"sync": "runs/sync-default", "async": "runs/async-default"}
    args, dirs = pair_arguments(__doc__, runs, "docs/img/train_sync_vs_async.png")
    commands = {}
    for mode, d in dirs.items():
        commands[mode] = "reused" if args.reuse else " ".join(train(d, mode, args.set))
    out = run_metadata() | {"train_commands": commands}
    out |= {mode: describe(d) for mode, d in dirs.items()}
    out["async_over_sync_wall"] = out["sync"]["wall_s"] / out["async"]["wall_s"]
    write_comparison([dirs["sync"], dirs["async"]], args.plot)
    for mode in dirs:
        print(f"{mode:>5}: {reward_line(out[mode]['summary'])}, {out[mode]['samples']} samples "
              f"in {out[mode]['wall_s']:.0f} s")  # fmt: skip
    print(f"async wall-time speedup over sync: {out['async_over_sync_wall']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
