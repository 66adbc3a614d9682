"""What the sync and async training loops share: the run directory, checkpoints, resume, logs.

Contract:
- ``open_run(parts, run, resume)``: a fresh run refuses a used directory; a resume restores the
  latest checkpoint (policy, optimizer, RNG, the learner version, the backend's state such as
  the suffix drafter's history), pushes the restored weights to the backend as that version and
  drops metric/eval rows the resumed run will write again. Returns the first step to run.
- ``finish_step(parts, run, row, log)``: append the metrics row, update the progress bar and the
  console, checkpoint when due (every ``run.checkpoint_every`` updates and after the last one).
- ``METRIC_KEYS``: the numeric keys every step row has, in both modes; ``TIMING_KEYS``: those
  that vary from run to run (equality tests ignore them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from specrl.config import Config
from specrl.pipelines.build import RunParts
from specrl.pipelines.checkpoint import RunDir, load_checkpoint, save_checkpoint
from specrl.pipelines.evaluate import evaluate

METRIC_KEYS = (
    "step", "reward_mean", "reward_std", "accuracy", "response_length", "gen_time_s",
    "gen_tokens", "rollout_tokens_per_s", "acceptance_length", "train_time_s", "refit_time_s",
    "step_time_s", "logprob_delta_mean", "logprob_delta_max", "staleness_mean", "staleness_max",
    "learner_idle_s", "generator_idle_s", "reused_tokens", "policy_version",
)  # fmt: skip
TIMING_KEYS = frozenset(
    {"gen_time_s", "rollout_tokens_per_s", "train_time_s", "refit_time_s", "step_time_s",
     "logprob_time_s", "score_time_s", "prefill_s", "decode_s", "draft_s", "verify_s",
     "eval_time_s", "learner_time_s", "learner_idle_s", "generator_idle_s", "samples_per_s"}
)  # fmt: skip

Echo = Callable[[str], None]


@dataclass
class Log:
    """Where a loop reports: the progress bar and an optional console line printer."""

    bar: tqdm
    echo: Echo | None = None

    def say(self, line: str) -> None:
        if self.echo:
            self.echo(line)


def checkpoint_due(cfg: Config, updates: int) -> bool:
    every = cfg.run.checkpoint_every
    return every > 0 and (updates % every == 0 or updates == cfg.run.steps)


def save(parts: RunParts, run: RunDir, updates: int) -> None:
    state = {"step": updates, "policy_version": parts.version}
    save_checkpoint(run.checkpoint_dir(updates), parts.learner.model, parts.learner.optimizer,
                    state, parts.backend.state_dict())  # fmt: skip


def restore(parts: RunParts, run: RunDir) -> int:
    """Load the latest checkpoint into ``parts``; the number of updates it holds (0 if none)."""
    ckpt = run.latest_checkpoint()
    if ckpt is None:
        return 0
    state, backend_state = load_checkpoint(ckpt, parts.learner.model, parts.learner.optimizer)
    parts.version = state["policy_version"]
    parts.push_weights()
    parts.backend.load_state_dict(backend_state)
    run.truncate(state["step"])
    return state["step"]


def open_run(parts: RunParts, run: RunDir, resume: bool) -> int:
    """Create or resume ``run``; the first step to run (see the module docstring)."""
    if not resume and run.is_used():
        raise ValueError(f"run dir {run.path} is not empty: resume it or choose another")
    run.create()
    start = restore(parts, run) if resume else 0
    run.config.write_text(parts.cfg.to_toml())
    return start


def log_eval(parts: RunParts, run: RunDir, updates: int, log: Log) -> None:
    row = evaluate(parts, updates)
    run.append(run.evals, row)
    log.say(f"eval after {updates} updates: greedy acc {row.get('greedy_accuracy', 0):.3f}, "
            f"sampled acc {row.get('sampled_accuracy', 0):.3f}")  # fmt: skip


def finish_step(parts: RunParts, run: RunDir, row: dict[str, Any], log: Log) -> None:
    """Log a finished step's row and checkpoint when due."""
    run.append(run.metrics, row)
    log.bar.update(1)
    log.bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc_len=row["acceptance_length"])
    log.say(format_row(row))
    if checkpoint_due(parts.cfg, row["step"] + 1):
        save(parts, run, row["step"] + 1)


def format_row(row: dict[str, Any]) -> str:
    stale = f" stale {row['staleness_mean']:.2f}" if row.get("staleness_max") else ""
    return (
        f"step {row['step']:3d} reward {row['reward_mean']:.3f} acc {row['accuracy']:.3f} "
        f"len {row['response_length']:.1f} gen {row['gen_time_s']:.1f}s "
        f"({row['rollout_tokens_per_s']:.0f} tok/s, acc.len {row['acceptance_length']:.2f}) "
        f"train {row['train_time_s']:.1f}s refit {row['refit_time_s']:.2f}s "
        f"step {row['step_time_s']:.1f}s |dlogp| {row['logprob_delta_mean']:.4f}{stale}"
    )
