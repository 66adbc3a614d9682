"""The asynchronous GRPO loop: a producer thread generates while the learner trains.

Contract: ``train_async(parts, state, run, end, log, stop)`` runs steps ``state.step ..
end-1`` with staleness bound ``s = pipeline.max_staleness``. Ownership: the learner (the calling
thread) owns ``state``; the producer owns its train stream (``pipelines.state.TrainStream``)
and never reads ``state``. What crosses between them is handed over explicitly: each version
the learner pushed (``Producer.published``), each batch (the producer's buffer), and the rows
both write (``log.metrics`` takes one row at a time).
- the producer (a thread) handles steps in order; before step ``t`` it waits until the learner
  has pushed version ``>= t - s``, evaluates when ``eval_due(cfg, t)`` (with the weights it has;
  the eval row records ``policy_version``), then collects step ``t``'s prompts with the newest
  weights the backend serves, and puts the batch into a buffer of ``s + 1`` slots (never full: the
  version wait already keeps at most ``s + 1`` batches ahead of the learner). Its wait for a
  version is the batch's ``generator_idle_s``.
- the learner (the calling thread) takes batches in step order, admits one only if
  ``learner_version - behaviour_version <= s`` (the bound holds by construction; a violation
  raises rather than training on it), learns (``learn``, given its wait for the batch: it
  advances ``state`` and pushes version ``t + 1`` to the backend: between generate calls, or
  between decode steps with ``pipeline.update = "in_flight"``), logs and checkpoints the step,
  then tells the producer (so at ``s = 0`` a checkpoint's backend state, e.g. the suffix
  drafter's history, holds exactly the steps before it; at ``s >= 1`` it may also hold up to
  ``s`` later steps' completions). ``learner_idle_s`` is
  its wait for the batch; ``step_time_s`` the wall time since the previous step's learning
  ended, so the step times add up to the loop's wall time (less the last step's logging).
- once ``stop`` (a ``signals.StopRequest``) is requested, the learner finishes the step it is
  on (waiting for its batch if need be), checkpoints it before telling the producer, and ends
  the loop; the producer drops what it generated ahead and is joined (it finishes the generate
  call it is in), so the checkpoint is the one a regular schedule would have written.
- ``s = 0`` runs exactly the sync loop's sequence (eval, collect t under version t, learn t):
  same seeds, same metrics except timings. An exception in either thread stops both and is
  raised here; nothing is left running.
Resume (``loop.open_run``) restarts at the last checkpoint: prompts are a function of the step,
so batches generated but not learned before a kill are generated again, never lost or learned
twice.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from specrl.pipelines.build import RunParts
from specrl.pipelines.evaluate import eval_due
from specrl.pipelines.loop import Log, finish_step, log_eval
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.signals import StopRequest
from specrl.pipelines.state import StepState, TrainStream
from specrl.pipelines.step import Batch, collect, learn

_POLL_S = 0.1  # how often a waiting thread checks whether the other one stopped


class Producer(threading.Thread):
    """Generates the batches of steps ``start .. end-1`` within the staleness bound, starting
    with the learner at ``version``; it owns ``stream`` (see the module docstring)."""

    def __init__(
        self, parts: RunParts, stream: TrainStream, start: int, end: int, version: int, log: Log
    ) -> None:
        super().__init__(name="specrl-producer", daemon=True)
        self.parts, self.stream, self.steps, self.log = parts, stream, range(start, end), log
        self.bound = parts.cfg.pipeline.max_staleness
        self.buffer: queue.Queue[Batch | None] = queue.Queue(maxsize=self.bound + 1)
        self.pushed = version  # newest version the learner has pushed (handed over)
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for step in self.steps:
                t0 = time.perf_counter()
                if not self._wait_version(step - self.bound):
                    return
                idle = time.perf_counter() - t0
                if eval_due(self.parts.cfg, step):
                    log_eval(self.parts, step, self.log)
                batch = collect(self.parts, self.stream.draw(step), step)
                batch.metrics["generator_idle_s"] = idle
                if not self._put(batch):
                    return
        except BaseException as e:  # handed to the learner thread
            self.error = e
            self._put(None)

    def _wait_version(self, version: int) -> bool:
        with self.cond:
            while self.pushed < version:
                if self.stopping.is_set():
                    return False
                self.cond.wait(_POLL_S)
        return not self.stopping.is_set()

    def _put(self, batch: Batch | None) -> bool:
        while not self.stopping.is_set():
            try:
                self.buffer.put(batch, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def published(self, version: int) -> None:
        """The learner pushed ``version`` to the backend."""
        with self.cond:
            self.pushed = version
            self.cond.notify_all()

    def take(self) -> Batch:
        """The next batch, in step order (re-raises the producer's error)."""
        while True:
            try:
                batch = self.buffer.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.is_alive() and self.buffer.empty():
                    raise RuntimeError("the rollout producer stopped without a batch") from None
                continue
            if batch is None:
                raise RuntimeError(f"rollout producer failed: {self.error}") from self.error
            return batch

    def stop(self) -> None:
        self.stopping.set()
        with self.cond:
            self.cond.notify_all()
        self.join()


def admit(version: int, bound: int, batch: Batch) -> None:
    """Refuse a batch older than the staleness ``bound`` for a learner at ``version`` (never
    happens by construction)."""
    if version - batch.behaviour_version > bound:
        raise RuntimeError(
            f"staleness bound broken: batch of step {batch.step} from version "
            f"{batch.behaviour_version}, learner at {version} "
            f"(pipeline.max_staleness={bound})"
        )


def train_async(
    parts: RunParts, state: StepState, run: RunDir, end: int, log: Log, stop: StopRequest
) -> list[dict[str, Any]]:
    """See the module docstring."""
    stream = TrainStream.of(parts.cfg, parts.env)
    producer = Producer(parts, stream, state.step, end, state.version, log)
    producer.start()
    rows: list[dict[str, Any]] = []
    last = time.perf_counter()
    try:
        for step in range(state.step, end):
            t0 = time.perf_counter()
            batch = producer.take()
            idle = time.perf_counter() - t0
            if batch.step != step:
                raise RuntimeError(f"expected the batch of step {step}, got step {batch.step}")
            admit(state.version, parts.cfg.pipeline.max_staleness, batch)
            row: dict[str, Any] = {"step": step} | batch.metrics | learn(parts, state, batch, idle)
            now = time.perf_counter()
            row |= {"learner_idle_s": idle, "step_time_s": now - last}
            last = now
            rows.append(row)
            if not finish_step(parts, state, run, row, log, stop):
                break
            producer.published(state.version)
    finally:
        producer.stop()
    return rows
