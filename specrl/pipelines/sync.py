"""The synchronous GRPO loop: collect -> learn, one step at a time.

``train_sync(parts, state, run, end, log, stop)`` runs steps ``state.step .. end-1`` in one
thread (owning ``state`` and the train stream): evaluate when due, ``collect`` (staleness 0),
``learn`` (advances ``state``, pushes the weights), ``finish_step`` (a step that ends with a
checkpoint first checks there is room for it: ``loop.check_room``); a requested ``stop`` ends
it after the step in progress is checkpointed. Returns the rows of the steps it ran. With a
deterministic CPU configuration every metric except timings is a function of the config (a
resume equals an uninterrupted run; async at ``max_staleness = 0`` equals this loop).
Details: docs/internals.md.
"""

from __future__ import annotations

import time
from typing import Any

from specrl.pipelines.build import RunParts
from specrl.pipelines.evaluate import eval_due
from specrl.pipelines.loop import Log, check_room, finish_step, log_eval
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.signals import StopRequest
from specrl.pipelines.state import StepState, TrainStream
from specrl.pipelines.step import collect, learn


def train_sync(
    parts: RunParts, state: StepState, run: RunDir, end: int, log: Log, stop: StopRequest
) -> list[dict[str, Any]]:
    """See the module docstring."""
    rows, stream = [], TrainStream.of(parts.plan, parts.env)
    for step in range(state.step, end):
        check_room(parts.cfg, run, step + 1)
        if eval_due(parts.cfg, step):
            log_eval(parts, step, log)
        t0 = time.perf_counter()
        batch = collect(parts, stream.draw(step), step)
        t1 = time.perf_counter()
        row: dict[str, Any] = {"step": step} | batch.metrics | learn(parts, state, batch, t1 - t0)
        t2 = time.perf_counter()
        row |= {"learner_idle_s": t1 - t0, "generator_idle_s": t2 - t1, "step_time_s": t2 - t0}
        rows.append(row)
        if not finish_step(parts, state, run, row, log, stop):
            break
    return rows
