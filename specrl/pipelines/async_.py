"""The asynchronous GRPO loop: a producer thread generates while the learner trains.

``train_async(parts, state, run, end, log, stop)`` runs steps ``state.step .. end-1`` with
staleness bound ``s = pipeline.max_staleness``: the producer (its own train stream, never
``state``) evaluates when due and collects step ``t`` once version ``>= t - s`` is pushed; the
learner (the calling thread, owner of ``state``; versions and batches are handed over
explicitly) admits a batch only if its staleness is ``<= s``, learns, logs and checkpoints
(room for a due checkpoint checked before the step: ``loop.check_room``).
``stop`` ends it after the step in progress is checkpointed; ``s = 0`` runs the sync loop's
sequence; an error in either thread stops both and is raised here. Details: docs/internals.md.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from specrl.pipelines.build import RunParts
from specrl.pipelines.evaluate import eval_due
from specrl.pipelines.loop import Log, check_room, finish_step, log_eval
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.signals import StopRequest
from specrl.pipelines.state import StepState, TrainStream
from specrl.pipelines.step import Batch, collect, learn
from specrl.rewards import RewardError

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
            if isinstance(self.error, RewardError):  # the user's reward, not the producer
                raise self.error
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
    stream = TrainStream.of(parts.plan, parts.env)
    producer = Producer(parts, stream, state.step, end, state.version, log)
    producer.start()
    rows: list[dict[str, Any]] = []
    last = time.perf_counter()
    try:
        for step in range(state.step, end):
            check_room(parts.cfg, run, step + 1)
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
