"""Drafters that follow the policy: acceptance per RL step, frozen vs online vs refresh.

Usage: python benchmarks/online_drafter.py --in-domain DIR --generic DIR [--steps 40]
    [--modes frozen,online,refresh] [--draft-modes frozen,online,refresh] [--async-steps 12]
    [--threads 2] [--out benchmarks/results/online_drafter.json] [--plot docs/online_drafter.png]

Each run is a real ``specrl train`` (a subprocess, its own run directory) of SmolLM2-135M on the
default task (basic_arithmetic, answer_only template), 4 prompts x 8 completions, up to 64 new
tokens, the default learner: the policy moves (reward and reply length change over the run; both
are recorded). The EAGLE-3 drafter drafts k = 3 at every step (``max_tokens_per_forward`` 1024,
so acceptance is measured at every step, not only where the controller drafts), starting from
(a) ``--in-domain`` (a head trained by ``specrl train-drafter`` on the task's own rollouts) and
(b) ``--generic`` (the same recipe on generic chat prompts), under every ``--modes`` value; then
a cold start (no head at all: ``drafter.mode`` auto = refresh from a random head), the draft
model drafter (``rollout.spec=draft``, k = 3) under every ``--draft-modes`` value, each starting
from the untrained draft a fresh machine starts from (the policy's first 4 layers, final norm
and LM head: ``drafters.distill.untrained_draft``, saved once so that 'frozen' has weights to
load), and one async run (online, from the in-domain head, ``--async-steps`` steps) for the
drafter's time share there. The cold start checkpoints every 5 steps; each checkpoint's policy
and drafter are then rolled out plain and speculative on 2 rows (where speculation can pay
here): the step at which speculation first pays. Every run ends with the run's own speed check
(the next step's prompts rolled out plain and with the run's final drafter; ``rollout_speedup``).
Writes the per-step series (draft acceptance length, reward, reply length, drafter updates /
time / KL / trigger, step time), the end-of-run speedups, the drafter-time share of step time,
the cold start's speed by checkpoint, and ``run_metadata()``; the plot shows acceptance per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specrl.bench import run_metadata, write_result  # noqa: E402

BASE = [
    "rollout.spec=eagle3", "rollout.num_spec_tokens=3", "rollout.max_tokens_per_forward=1024",
    "rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=64",
    "run.eval_every=0", "run.checkpoint_every=0",
]  # fmt: skip
SERIES = ("draft_acceptance_length", "reward_mean", "response_length", "drafter_updates",
          "drafter_train_s", "drafter_kl", "drafter_trigger", "step_time_s", "gen_time_s",
          "train_time_s")  # fmt: skip


def run(
    name: str,
    sets: list[str],
    steps: int,
    threads: int,
    env: dict[str, str],
    keep: Path | None = None,
) -> dict:
    """One ``specrl train`` run; its per-step series, speed check and drafter time share
    (``keep``: run there and leave the run directory, checkpoints included)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = keep or Path(tmp) / "run"
        pairs = [("--set", s) for s in [*BASE, f"run.steps={steps}", *sets]]
        cmd = [sys.executable, "-m", "specrl.cli", "train", "--run-dir", str(run_dir),
               *[x for pair in pairs for x in pair]]  # fmt: skip
        print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
        proc = subprocess.run(cmd, env=env | {"OMP_NUM_THREADS": str(threads)},
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"[{name}] failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run_dir / "summary.json").read_text())
    series = {k: [r.get(k) for r in rows] for k in SERIES}
    drafter_s = sum(r.get("drafter_train_s", 0.0) for r in rows)
    step_s = sum(r["step_time_s"] for r in rows)
    out = {
        "sets": sets,
        "series": series,
        "speed": summary.get("speed"),
        "drafter_time_share": drafter_s / step_s if step_s else 0.0,
        "drafter_updates": sum(r.get("drafter_updates", 0) for r in rows),
        "acceptance_first5": _mean(series["draft_acceptance_length"][:5]),
        "acceptance_last5": _mean(series["draft_acceptance_length"][-5:]),
        "reward_first5": _mean(series["reward_mean"][:5]),
        "reward_last5": _mean(series["reward_mean"][-5:]),
    }
    speed = out["speed"] or {}
    print(f"[{name}] acceptance {out['acceptance_first5']:.3f} -> {out['acceptance_last5']:.3f}, "
          f"reward {out['reward_first5']:.3f} -> {out['reward_last5']:.3f}, end speedup "
          f"{speed.get('rollout_speedup', float('nan')):.3f}, drafter share "
          f"{out['drafter_time_share']:.3f}", flush=True)  # fmt: skip
    return out


def speed_by_checkpoint(run_dir: Path, sets: list[str], threads: int, cache: str) -> list[dict]:
    """The cold-start run's speed at each checkpoint (and before any training): the policy and
    drafter of step N restored, step N's prompts rolled out plain and speculative on 2 rows
    (1 prompt x 2, where speculation can pay on this CPU), 5 times; the median speedup."""
    import statistics

    import torch

    os.environ["SPECRL_CACHE"] = cache  # the cold run's empty cache: a fresh head is built
    torch.set_num_threads(threads)
    from specrl.config import load_config
    from specrl.pipelines.build import build_run
    from specrl.pipelines.checkpoint import apply_checkpoint, read_checkpoint
    from specrl.pipelines.loop import restore_drafter
    from specrl.pipelines.rundir import RunDir
    from specrl.pipelines.speed import measure_speedup

    cfg = load_config(run_dir / "config.toml", [*sets, "rollout.prompts_per_step=1",
                                                "rollout.group_size=2"])  # fmt: skip
    parts = build_run(cfg)
    out = []
    ckpts = sorted(RunDir(run_dir).checkpoints_newest_first(), key=lambda c: c.name)
    for ckpt in [None, *ckpts]:
        step = 0
        if ckpt is not None:
            data = read_checkpoint(ckpt)
            state, _ = apply_checkpoint(data, parts.learner.model, parts.learner.optimizer)
            step = state["step"]
            parts.push_weights(state["policy_version"])
            restore_drafter(parts, data)
        checks = [measure_speedup(parts, step) for _ in range(5)]
        speedup = statistics.median(c["rollout_speedup"] for c in checks)
        acc = statistics.median(c["spec_acceptance_length"] for c in checks)
        out.append({"step": step, "rollout_speedup": speedup, "acceptance_length": acc})
        print(f"[cold start, 2 rows] step {step}: acceptance {acc:.2f}, speedup {speedup:.2f}x",
              flush=True)  # fmt: skip
    return out


def untrained_draft_dir(out: Path) -> Path:
    """The untrained draft model of the default policy (what a fresh machine trains), saved."""
    import torch

    from specrl.config import load_config
    from specrl.drafters.distill import save_draft_model, untrained_draft
    from specrl.models.checkpoints import load_model, resolve_model

    name = load_config(None, []).model.name
    policy = load_model(name, dtype=torch.float32)
    return save_draft_model(untrained_draft(policy, torch.float32), out, policy.config,
                            resolve_model(name))  # fmt: skip


def _mean(xs: list) -> float:
    xs = [x for x in xs if x]
    return sum(xs) / len(xs) if xs else float("nan")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        acc = r["series"]["draft_acceptance_length"]
        style = {"in-domain": "-", "generic": "--", "draft": "-."}.get(name.split()[0], ":")
        ax.plot(range(len(acc)), acc, style, label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("acceptance length (k = 3)")
    ax.set_title("Drafters during GRPO (SmolLM2-135M, basic_arithmetic)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-domain", required=True)
    ap.add_argument("--generic", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--modes", default="frozen,online,refresh")
    ap.add_argument("--draft-modes", default="frozen,online,refresh",
                    help="modes of the draft-model rows ('' = none)")  # fmt: skip
    ap.add_argument("--async-steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/online_drafter.json"))
    ap.add_argument("--plot", default=str(REPO / "docs/online_drafter.png"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ)
        results = {}
        for start, head in (("in-domain", a.in_domain), ("generic", a.generic)):
            for mode in a.modes.split(","):
                sets = [f"rollout.drafter_path={head}", f"drafter.mode={mode}"]
                results[f"{start} {mode}"] = run(f"{start} {mode}", sets, a.steps, a.threads, env)
        cold_env = env | {"SPECRL_CACHE": empty}  # a fresh machine: nothing cached
        cold_dir = Path(empty) / "cold-run"
        results["cold start"] = run("cold start", ["run.checkpoint_every=5"], a.steps, a.threads,
                                    cold_env, keep=cold_dir)  # fmt: skip
        cold_speed = speed_by_checkpoint(cold_dir, ["run.checkpoint_every=5"], a.threads, empty)
        draft_dir = untrained_draft_dir(Path(empty) / "draft")
        for mode in [m for m in a.draft_modes.split(",") if m]:
            sets = [
                "rollout.spec=draft",
                f"rollout.drafter_path={draft_dir}",
                f"drafter.mode={mode}",
            ]
            results[f"draft {mode}"] = run(f"draft {mode}", sets, a.steps, a.threads, env)
        sync_async = run("async online", [f"rollout.drafter_path={a.in_domain}",
                                          "drafter.mode=online", "pipeline.mode=async"],
                         a.async_steps, a.threads, env)  # fmt: skip
    end = {n: (r["speed"] or {}).get("rollout_speedup") for n, r in results.items()}
    doc = {
        "command": " ".join(sys.argv),
        "metadata": run_metadata(" ".join(sys.argv)),
        "steps": a.steps,
        "runs": results,
        "async_online": sync_async,
        "cold_start_speed_2_rows": cold_speed,
        "cold_start_first_pays_step": next(
            (c["step"] for c in cold_speed if c["rollout_speedup"] > 1.0), None
        ),
        "end_rollout_speedup": end,
        "drafter_time_share": {n: r["drafter_time_share"] for n, r in results.items()}
        | {"async online": sync_async["drafter_time_share"]},
    }
    write_result(doc, Path(a.out))
    plot(results, Path(a.plot))
    print(json.dumps({"end_rollout_speedup": end, "drafter_time_share": doc["drafter_time_share"]},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
