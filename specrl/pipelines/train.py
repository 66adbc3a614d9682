"""Training entry points: run the configured loop (sync or async) and summarise the run.

``train(parts, run_dir, resume=False, progress=True, stop_after=None, echo=None, stop=None)``
runs (or resumes) ``run.steps`` steps with the ``pipeline.mode`` loop, rows to every sink that
is on (``tracking.open_tracker``), and returns this call's metric rows, holding the run
directory's writer lock (``RunDir.locked``: another writer is a ``RunDirError``); after
SIGINT/SIGTERM the step in progress is checkpointed and ``signals.Stopped`` raised; a dead
train worker is ``TrainWorkerDied`` naming it and the checkpoint a resume starts from, a failed
reward (``reward.on_error='fail'``) a ``RewardError`` naming the function, the prompt's row and
that checkpoint. ``run_training(...)``: ``train``, then the speed check; writes and returns
``summary.json`` (a signal once every step is done skips the check and raises
``Stopped(complete=True)``). Console lines go to ``echo``;
nothing here prints. Details: docs/internals.md.
"""

from __future__ import annotations

import json
import time
from contextlib import closing, nullcontext
from typing import Any

from tqdm import tqdm

from specrl.fsutil import atomic_write
from specrl.pipelines.async_ import train_async
from specrl.pipelines.build import RunParts
from specrl.pipelines.evaluate import eval_due
from specrl.pipelines.loop import Echo, Log, log_eval, open_run, stop_checkpoint
from specrl.pipelines.manifest import is_complete
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.signals import Interrupted, Stopped, StopRequest, stop_on_signals
from specrl.pipelines.speed import measure_speedup
from specrl.pipelines.sync import train_sync
from specrl.pipelines.tracking import open_tracker
from specrl.pipelines.train_workers import TrainGroup, TrainWorkerDied
from specrl.rewards import RewardError

LOOPS = {"sync": train_sync, "async": train_async}
SPEED_CHECK = "the speed check"


def train(
    parts: RunParts,
    run_dir: str,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    echo: Echo | None = None,
    stop: StopRequest | None = None,
) -> list[dict[str, Any]]:
    """See the module docstring."""
    with RunDir(run_dir).locked():  # one writer at a time
        return _unlocked_train(parts, run_dir, resume, progress, stop_after, echo, stop)


def _unlocked_train(
    parts: RunParts,
    run_dir: str,
    resume: bool,
    progress: bool,
    stop_after: int | None,
    echo: Echo | None,
    stop: StopRequest | None,
) -> list[dict[str, Any]]:
    """``train`` once the caller holds the run's lock."""
    handlers = nullcontext(stop) if stop is not None else stop_on_signals()
    run = RunDir(run_dir)
    if isinstance(parts.learner, TrainGroup):  # their shards go there: before any work
        parts.learner.check_storage(run.path)
    with handlers as request:
        try:
            return _train(parts, run, resume, progress, stop_after, echo, request)
        except (TrainWorkerDied, RewardError) as e:
            raise type(e)(f"{e}; {last_checkpoint(run)}") from None


def _train(
    parts: RunParts,
    run: RunDir,
    resume: bool,
    progress: bool,
    stop_after: int | None,
    echo: Echo | None,
    stop: StopRequest,
) -> list[dict[str, Any]]:
    cfg = parts.cfg
    state = open_run(parts, run, resume, echo)
    end = min(cfg.run.steps, stop_after if stop_after is not None else cfg.run.steps)
    with closing(open_tracker(cfg, run, state.step)) as tracker:
        bar = tqdm(disable=not progress, desc=f"train ({cfg.pipeline.mode})", unit="step",
                   initial=state.step, total=cfg.run.steps)  # fmt: skip
        log = Log(tracker, bar, echo)
        try:
            rows = LOOPS[cfg.pipeline.mode](parts, state, run, end, log, stop)
        finally:
            bar.close()
        if stop.requested and state.step < cfg.run.steps:
            raise Stopped(stop, state.step, stop_checkpoint(parts, state, run), run.path)
        if state.step == cfg.run.steps and eval_due(cfg, state.step):
            log_eval(parts, state.step, log)
    if stop.requested:
        raise Stopped(stop, state.step, None, run.path, complete=True)
    return rows


def last_checkpoint(run: RunDir) -> str:
    """Which checkpoint a resume of ``run`` starts from, in words."""
    last = next((c for c in run.checkpoints_newest_first() if is_complete(c)), None)
    if last is None:
        return f"no checkpoint yet in {run.path} (a resume starts from step 0)"
    return f"last checkpoint {last}; continue with: specrl train --resume {run.path}"


def run_training(
    parts: RunParts,
    run_dir: str,
    resume: bool = False,
    compare_plain: bool = True,
    progress: bool = True,
    echo: Echo | None = None,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """See the module docstring."""
    t0, run = time.perf_counter(), RunDir(run_dir)
    wanted = compare_plain and parts.backend.spec.enabled
    handlers = nullcontext(stop) if stop is not None else stop_on_signals()
    with handlers as request, run.locked():  # the summary too: one writer at a time
        try:
            _unlocked_train(parts, run_dir, resume, progress, None, echo, request)
        except Stopped as e:
            if not e.complete:
                raise
        speed = speed_check(parts, request) if wanted else None
        summary = write_summary(run, speed, time.perf_counter() - t0)
    if request.requested:
        skipped = SPEED_CHECK if wanted and speed is None else ""
        raise Stopped(request, parts.cfg.run.steps, None, run.path, complete=True, skipped=skipped,
                      summary=summary)  # fmt: skip
    return summary


def speed_check(parts: RunParts, stop: StopRequest) -> dict[str, float] | None:
    """``measure_speedup`` after the last step; ``None`` if a signal came before or during it
    (a signal cuts it short at once)."""
    notice = f"skipping {SPEED_CHECK}; the run completed all {parts.cfg.run.steps} steps"
    try:
        with stop.interrupting(notice):
            return measure_speedup(parts, parts.cfg.run.steps)
    except Interrupted:
        return None


def write_summary(run: RunDir, speed: dict[str, float] | None, wall_s: float) -> dict[str, Any]:
    """Summarise the run's logs (plus ``speed``), write summary.json atomically, return it."""
    from specrl.pipelines.report import summarize

    summary = summarize(run.rows(run.metrics), run.rows(run.evals), speed)
    summary["wall_s"] = wall_s
    atomic_write(run.summary, json.dumps({"summary": summary, "speed": speed}, indent=1))
    return summary
