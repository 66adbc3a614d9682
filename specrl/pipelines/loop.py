"""What the sync and async training loops share: the run directory, checkpoints, resume, logs.

``open_run(parts, run, resume, say)`` starts a fresh run (a used directory is refused) or
resumes the newest checkpoint that verifies (policy, optimizer, RNG, step state, alarm, backend
and drafter state; damaged newer ones named in one line), pushes the restored weights and
returns the run's ``StepState``; a resume's changed settings go to ``changes.jsonl``
(``record_changes``) before config.toml is rewritten. ``finish_step(parts, state, run, row,
log, stop)`` logs the row, checkpoints when due and returns whether the loop goes on;
``stop_checkpoint`` writes the checkpoint a stopped loop resumes from. ``METRIC_KEYS``: every
step row's numeric keys; ``TIMING_KEYS``: those that vary from run to run;
``PLACEMENT_KEYS``: where the parts ran (train workers' nodes). Details: docs/internals.md.
"""

from __future__ import annotations

import errno
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specrl.config import Config, load_run_config
from specrl.fsutil import atomic_write, disk_problem, room_problem, tree_bytes
from specrl.pipelines.alarm import alarm_line
from specrl.pipelines.build import RunParts
from specrl.pipelines.checkpoint import (
    CheckpointData,
    apply_to_learner,
    read_checkpoint,
    save_run_checkpoint,
)
from specrl.pipelines.evaluate import evaluate
from specrl.pipelines.manifest import CheckpointDamaged, RunDirError, is_complete
from specrl.pipelines.runconfig import changed_settings
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.signals import StopRequest
from specrl.pipelines.state import StepState
from specrl.pipelines.tracking import MetricsSink

METRIC_KEYS = (
    "step", "reward_mean", "reward_std", "accuracy", "response_length", "gen_time_s",
    "gen_tokens", "rollout_tokens_per_s", "acceptance_length", "train_time_s", "refit_time_s",
    "step_time_s", "logprob_delta_mean", "logprob_delta_max", "staleness_mean", "staleness_max",
    "learner_idle_s", "generator_idle_s", "reused_tokens", "policy_version",
)  # fmt: skip
TIMING_KEYS = frozenset(
    {"gen_time_s", "rollout_tokens_per_s", "train_time_s", "refit_time_s", "step_time_s",
     "logprob_time_s", "score_time_s", "prefill_s", "decode_s", "draft_s", "verify_s",
     "eval_time_s", "learner_time_s", "learner_idle_s", "generator_idle_s", "samples_per_s",
     "reward_overlap_s", "reward_wait_s",
     "learner_tokens_per_s", "learner_model_tflops", "learner_mfu",
     # speculation statistics: the controller's k per step follows measured step times
     "acceptance_length", "draft_acceptance_rate", "draft_acceptance_length", "drafting_steps",
     "spec_step_share",
     # a drafter trained during RL takes as many updates as its time budget pays
     "drafter_train_s", "drafter_sync_s", "drafter_updates", "drafter_kl", "drafter_loss",
     "drafter_version", "drafter_trigger", "drafter_trained_len"}
)  # fmt: skip
# where the run's parts ran (not what they computed): equal work on other nodes differs here
PLACEMENT_KEYS = frozenset({"train_nodes"})

Echo = Callable[[str], None]


@dataclass
class Log:
    """Where a loop reports: the rows' sinks (``pipelines.tracking``), the progress bar and an
    optional console line printer."""

    metrics: MetricsSink
    bar: tqdm
    echo: Echo | None = None

    def say(self, line: str) -> None:
        if self.echo:
            self.echo(line)


def checkpoint_due(cfg: Config, updates: int) -> bool:
    every = cfg.run.checkpoint_every
    return every > 0 and (updates % every == 0 or updates == cfg.run.steps)


def check_room(cfg: Config, run: RunDir, updates: int) -> None:
    """Before a step that ends with a checkpoint (of ``updates`` updates): ``RunDirError`` when
    the run's file system has less free space than the largest kept checkpoint takes (not the
    newest alone: a weights-only final one is a third of the full save that follows it on a
    resume), so the step's work is not done only to be lost (the first checkpoint has no size
    to go by)."""
    kept = run.checkpoints_newest_first()
    if not checkpoint_due(cfg, updates) or not kept:
        return
    size, largest = max((tree_bytes(c), c.name) for c in kept)
    if problem := room_problem(run.checkpoints, size):
        raise RunDirError(f"the checkpoint after step {updates} cannot be saved: {problem} "
                          f"(the size of {largest}); {_ROOM_HINT}")  # fmt: skip


_ROOM_HINT = "free space (or lower run.keep_checkpoints), then specrl train --resume the run"


def save(parts: RunParts, state: StepState, run: RunDir) -> Path:
    """Checkpoint ``state`` (its ``step`` updates; the run's last, without optimizer state under
    ``run.final_checkpoint='weights'``), then remove the oldest beyond
    ``run.keep_checkpoints``; a full disk is a ``RunDirError`` saying what it needed (the save's
    ``.tmp`` removed, the previous checkpoints kept)."""
    saved = {"step": state.step, "policy_version": state.version,
             "alarm": parts.alarm.state_dict()}  # fmt: skip
    trainer = parts.drafter.trainer if parts.drafter is not None else None
    ckpt = run.checkpoint_dir(state.step)
    weights_only = state.step == parts.cfg.run.steps and parts.cfg.run.final_checkpoint == "weights"
    try:
        save_run_checkpoint(ckpt, parts.learner, saved, parts.backend.state_dict(), trainer,
                            weights_only)  # fmt: skip
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        last = run.latest_checkpoint()  # the one before: the .tmp was removed
        size = f" (the last one, {last.name}, took {tree_bytes(last):,} bytes)" if last else ""
        raise RunDirError(f"cannot save checkpoint {ckpt}: {disk_problem(e)}{size}; "
                          f"{_ROOM_HINT}") from e  # fmt: skip
    run.prune(ckpt, parts.cfg.run.keep_checkpoints)
    return ckpt


def _report(say: Echo | None, line: str) -> None:
    if say is not None:
        say(line)
    else:
        warnings.warn(line, stacklevel=3)


def newest_verified(run: RunDir, say: Echo | None = None) -> CheckpointData | None:
    """The newest checkpoint that verifies and holds optimizer state, read (``None`` if the run
    has none at all); the damaged newer ones, and a weights-only final one, are named in one
    line; if none is left that is a ``RunDirError``."""
    damaged: list[str] = []
    weights: list[str] = []  # weights-only checkpoints (``run.final_checkpoint='weights'``)
    for ckpt in run.checkpoints_newest_first():
        try:
            data = read_checkpoint(ckpt)
        except CheckpointDamaged as e:
            damaged.append(f"{ckpt.name} ({e})")
            continue
        if data.weights_only:
            weights.append(ckpt.name)
            continue
        skipped = ([_damaged(damaged)] if damaged else []) + (
            [_policy_only(weights)] if weights else []
        )
        if skipped:
            _report(say, f"{'; '.join(skipped)}; resuming from {ckpt.name}")
        return data
    if weights:
        raise RunDirError(f"cannot resume {run.path}: {_policy_only(weights)} and no earlier "
                          "checkpoint is kept (export it: specrl export)")  # fmt: skip
    if damaged:
        raise RunDirError(f"cannot resume {run.path}: no checkpoint verifies: {', '.join(damaged)}")
    return None


def _policy_only(names: list[str]) -> str:
    return (f"{', '.join(names)} holds the policy without optimizer state "
            "(run.final_checkpoint='weights'): it cannot continue a run")  # fmt: skip


def _damaged(found: list[str]) -> str:
    if len(found) == 1:
        return "checkpoint {} is damaged {}".format(*found[0].split(" ", 1))
    return f"checkpoints {', '.join(found)} are damaged"


def restore(parts: RunParts, run: RunDir, say: Echo | None = None) -> StepState:
    """Load the newest verified checkpoint into ``parts``; the step state it holds (a fresh one
    if none)."""
    data = newest_verified(run, say)
    if data is None:
        _report(say, f"{run.path} holds no checkpoint yet: starting from step 0")
        run.truncate(0)
        return StepState()
    saved, backend_state = apply_to_learner(data, parts.learner)
    state = StepState(saved["step"], saved["policy_version"])
    parts.alarm.load_state_dict(saved.get("alarm", {}))
    parts.push_weights(state.version)
    restore_drafter(parts, data, say)
    parts.backend.load_state_dict(backend_state)
    run.truncate(state.step)
    return state


def restore_drafter(parts: RunParts, data: CheckpointData, say: Echo | None = None) -> None:
    """A drafter trained during RL continues from its checkpointed head and optimizer (pushed
    to the backend under its version); without that state it starts as built, saying so."""
    trainer = parts.drafter.trainer if parts.drafter is not None else None
    if trainer is None:
        return
    if data.drafter is None:
        _report(say, f"{data.path.name} holds no drafter state: the drafter trains from its start")
        return
    try:
        trainer.load(data.drafter)
    except ValueError as e:
        raise RunDirError(f"checkpoint {data.path} does not fit this run: {e}") from None
    parts.drafter.trained_len = trainer.ledger.trained_len
    parts.guard.push_drafter(parts.backend, trainer.state(), trainer.ledger.version)


def open_run(parts: RunParts, run: RunDir, resume: bool, say: Echo | None = None) -> StepState:
    """Create or resume ``run``; its step state (see the module docstring)."""
    if not resume and run.is_used():
        raise RunDirError(f"run dir {run.path} is not empty: resume it or choose another")
    run.create()
    if resume:
        run.recover_interrupted()
    state = restore(parts, run, say) if resume else StepState()
    run.clear_interrupted()
    if resume:
        record_changes(parts.cfg, run, state.step)
    atomic_write(run.config, parts.cfg.to_toml())
    return state


def record_changes(cfg: Config, run: RunDir, step: int) -> None:
    """Append to ``changes.jsonl`` the settings a resume changed (``runconfig.changed_settings``
    against the stored config.toml, which is then rewritten), with the step they apply from."""
    changed = changed_settings(load_run_config(run.config), cfg)
    if changed:
        row = {"step": step, "changed": {k: {"from": a, "to": b} for k, (a, b) in changed.items()}}
        run.append(run.changes, row)


def log_eval(parts: RunParts, updates: int, log: Log) -> None:
    row = evaluate(parts, updates)
    log.metrics.write("eval", row)
    log.say(f"eval after {updates} updates: greedy acc {row.get('greedy_accuracy', 0):.3f}, "
            f"sampled acc {row.get('sampled_accuracy', 0):.3f}")  # fmt: skip


def finish_step(
    parts: RunParts,
    state: StepState,
    run: RunDir,
    row: dict[str, Any],
    log: Log,
    stop: StopRequest | None = None,
) -> bool:
    """Log a finished step's row and checkpoint ``state`` when due; whether to go on (see the
    module docstring)."""
    log.metrics.write("train", row)
    log.bar.update(1)
    log.bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc_len=row["acceptance_length"])
    log.say(format_row(row))
    if line := alarm_line(row):
        log.say(line)
    if note := row.get("drafter_warning"):
        log.say(f"warning: {note}")
    if checkpoint_due(parts.cfg, state.step):
        save(parts, state, run)
    return stop is None or not stop.requested


def stop_checkpoint(parts: RunParts, state: StepState, run: RunDir) -> Path:
    """The checkpoint of ``state.step`` updates for a stopped run: the existing ``step_N`` if
    it is complete (the regular schedule wrote it at the end of that step, or the run resumed
    from it and ran no step since), else written now."""
    ckpt = run.checkpoint_dir(state.step)
    return ckpt if is_complete(ckpt) else save(parts, state, run)


def format_row(row: dict[str, Any]) -> str:
    stale = f" stale {row['staleness_mean']:.2f}" if row.get("staleness_max") else ""
    return (
        f"step {row['step']:3d} reward {row['reward_mean']:.3f} acc {row['accuracy']:.3f} "
        f"len {row['response_length']:.1f} gen {row['gen_time_s']:.1f}s "
        f"({row['rollout_tokens_per_s']:.0f} tok/s, acc.len {row['acceptance_length']:.2f}) "
        f"train {row['train_time_s']:.1f}s refit {row['refit_time_s']:.2f}s "
        f"step {row['step_time_s']:.1f}s |dlogp| {row['logprob_delta_mean']:.4f}{stale}"
    )
