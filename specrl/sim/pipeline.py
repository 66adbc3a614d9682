"""RL pipeline simulation: how per-step phases become wall time, synchronous or asynchronous.

Contract: a step has six phases (``PHASES``): generation (the rollout), logprobs (policy and
reference forwards over every token), train (the policy update), drafter_train (online drafter
update, 0 when off), overhead (the framework's fixed per-step time: data, rewards, orchestration,
optimizer bookkeeping) and refit (pushing new weights to the generators).
``PIPELINES[mode](phases, steps, staleness)`` returns a Schedule of intervals on named resources:

- ``sync`` (colocated): one pool of GPUs runs the phases back to back, so a step takes exactly the
  sum of its phases.
- ``async`` (disaggregated, per-step batches that drain): generation GPUs and training GPUs are
  separate. The batch consumed by train step s must be generated with a policy version
  >= s - staleness (version v exists once train step v-1 and its refit are done), and each step's
  batch is generated as a unit: its long tail finishes before the next batch starts. With
  staleness 0 this is the synchronous schedule; with staleness >= 1 generation of the next batch
  overlaps training, and the steady-state step time tends to max(generation, trainer phases).
  Continuous generation across steps (the next steps' prompts fill the slots the tail leaves) is
  simulated by continuous.py, since it needs the rollout itself, not just per-step phase times.
Refit is charged to the trainer and gates the next generation that needs the new version; the
pause it causes on generators is modelled only in continuous.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import MappingProxyType

PHASES = ("generation", "logprobs", "train", "drafter_train", "overhead", "refit")
TRAINER_PHASES = PHASES[1:]


@dataclass(frozen=True)
class StepPhases:
    """Seconds per phase of one RL step."""

    generation: float
    logprobs: float
    train: float
    drafter_train: float
    refit: float
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    @property
    def trainer(self) -> float:
        return self.total - self.generation

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Interval:
    resource: str
    phase: str
    step: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Schedule:
    intervals: tuple[Interval, ...]
    steps: int
    warmup: int = 0  # steps ignored by step_time (pipeline filling)

    @property
    def makespan(self) -> float:
        return max(i.end_s for i in self.intervals)

    def step_end(self, step: int) -> float:
        return max(i.end_s for i in self.intervals if i.step == step)

    @property
    def step_time(self) -> float:
        """Steady-state seconds per step: spacing of step completions after ``warmup`` steps."""
        if self.steps == 1:
            return self.makespan
        w = min(self.warmup, self.steps - 2)
        return (self.step_end(self.steps - 1) - self.step_end(w)) / (self.steps - 1 - w)


def trainer_intervals(phases: StepPhases, step: int, start: float, resource: str) -> list[Interval]:
    """The trainer phases of one step back to back from ``start``."""
    out, t = [], start
    for name in TRAINER_PHASES:
        dur = getattr(phases, name)
        out.append(Interval(resource, name, step, t, t + dur))
        t += dur
    return out


def simulate_sync(phases: StepPhases, steps: int, staleness: int = 0) -> Schedule:
    """Colocated synchronous RL: generate -> logprobs -> train -> drafter_train -> overhead ->
    refit."""
    intervals: list[Interval] = []
    t = 0.0
    for s in range(steps):
        intervals.append(Interval("colocated", "generation", s, t, t + phases.generation))
        intervals += trainer_intervals(phases, s, t + phases.generation, "colocated")
        t = intervals[-1].end_s
    return Schedule(tuple(intervals), steps)


def simulate_async(phases: StepPhases, steps: int, staleness: int) -> Schedule:
    """Disaggregated asynchronous RL with a bound on how stale a batch's policy may be."""
    if staleness < 0:
        raise ValueError("staleness must be >= 0")
    intervals: list[Interval] = []
    refit_end: list[float] = []
    gen_free = 0.0
    for s in range(steps):
        needed = s - staleness  # oldest policy version allowed for this batch
        ready = refit_end[needed - 1] if needed >= 1 else 0.0
        g0 = max(gen_free, ready)
        gen_free = g0 + phases.generation
        intervals.append(Interval("generation", "generation", s, g0, gen_free))
        trainer_free = refit_end[-1] if refit_end else 0.0
        intervals += trainer_intervals(phases, s, max(gen_free, trainer_free), "training")
        refit_end.append(intervals[-1].end_s)
    return Schedule(tuple(intervals), steps)


PipelineFn = Callable[[StepPhases, int, int], Schedule]
PIPELINES: MappingProxyType[str, PipelineFn] = MappingProxyType(
    {"sync": simulate_sync, "async": simulate_async}
)
