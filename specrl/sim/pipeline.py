"""RL pipeline simulation: how per-step phases become wall time, synchronous or asynchronous.

Contract: a step has five phases (``PHASES``): generation (the rollout), logprobs (policy and
reference forwards over every token), train (the policy update), drafter_train (online drafter
update, 0 when off) and refit (pushing new weights to the generators). ``PIPELINES[mode](phases,
steps, staleness)`` returns a Schedule of intervals on named resources:

- ``sync`` (colocated): one pool of GPUs runs the phases back to back, so a step takes exactly the
  sum of its phases.
- ``async`` (disaggregated): generation GPUs and training GPUs are separate. The batch consumed by
  train step s must be generated with a policy version >= s - staleness (version v exists once
  train step v-1 and its refit are done). With staleness 0 this is the synchronous schedule; with
  staleness >= 1 generation of the next batch overlaps training, and the steady-state step time
  tends to max(generation, logprobs + train + drafter_train + refit).
Refit is charged to the trainer and gates the next generation that needs the new version; the
pause it causes on generators is not modelled separately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import MappingProxyType

PHASES = ("generation", "logprobs", "train", "drafter_train", "refit")
TRAINER_PHASES = PHASES[1:]


@dataclass(frozen=True)
class StepPhases:
    """Seconds per phase of one RL step."""

    generation: float
    logprobs: float
    train: float
    drafter_train: float
    refit: float

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

    @property
    def makespan(self) -> float:
        return max(i.end_s for i in self.intervals)

    def step_end(self, step: int) -> float:
        return max(i.end_s for i in self.intervals if i.step == step)

    @property
    def step_time(self) -> float:
        """Steady-state seconds per step: spacing of step completions after the first."""
        if self.steps == 1:
            return self.makespan
        return (self.step_end(self.steps - 1) - self.step_end(0)) / (self.steps - 1)


def _run_trainer(phases: StepPhases, step: int, start: float, resource: str) -> list[Interval]:
    out, t = [], start
    for name in TRAINER_PHASES:
        dur = getattr(phases, name)
        out.append(Interval(resource, name, step, t, t + dur))
        t += dur
    return out


def simulate_sync(phases: StepPhases, steps: int, staleness: int = 0) -> Schedule:
    """Colocated synchronous RL: generate -> logprobs -> train -> drafter_train -> refit."""
    intervals: list[Interval] = []
    t = 0.0
    for s in range(steps):
        intervals.append(Interval("colocated", "generation", s, t, t + phases.generation))
        intervals += _run_trainer(phases, s, t + phases.generation, "colocated")
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
        intervals += _run_trainer(phases, s, max(gen_free, trainer_free), "training")
        refit_end.append(intervals[-1].end_s)
    return Schedule(tuple(intervals), steps)


PipelineFn = Callable[[StepPhases, int, int], Schedule]
PIPELINES: MappingProxyType[str, PipelineFn] = MappingProxyType(
    {"sync": simulate_sync, "async": simulate_async}
)
