"""RL pipeline simulation: how per-step phases become wall time, synchronous or asynchronous.

A step has six phases (``PHASES``: generation, logprobs, train, drafter_train, overhead, refit);
``PIPELINES[mode](phases, steps, staleness)`` returns a ``Schedule`` of intervals on named
resources: ``sync`` runs them back to back on one pool, ``async`` generates each step's batch on
separate GPUs with a policy at most ``staleness`` versions old. ``Schedule.step_time`` is the
steady-state spacing of step completions over ``steady_window``; ``half_spread`` compares the
window's halves. Details: docs/internals.md.
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
    measured: int = 0  # step spacings step_time averages after the warm-up (0: all the rest)

    @property
    def makespan(self) -> float:
        return max(i.end_s for i in self.intervals)

    def step_end(self, step: int) -> float:
        return max(i.end_s for i in self.intervals if i.step == step)

    @property
    def last_measured(self) -> int:
        """Index of the step whose completion ends the measured window."""
        last = self.warmup + (self.measured or self.steps - 1 - self.warmup)
        if self.warmup < 0 or last <= self.warmup or last > self.steps - 1:
            raise ValueError(
                f"a window of {self.warmup} warm-up and {self.measured} measured steps does not"
                f" fit in {self.steps} steps"
            )
        return last

    @property
    def step_time(self) -> float:
        """Steady-state seconds per step: mean spacing of step completions over the measured
        window (``measured`` spacings after the first ``warmup`` steps)."""
        if self.steps == 1:
            return self.makespan
        last = self.last_measured
        return (self.step_end(last) - self.step_end(self.warmup)) / (last - self.warmup)

    def period_step_times(self, period: int) -> list[float]:
        """Mean step spacing over each whole period of ``period`` steps of the measured window
        (asynchronous step completions repeat with period staleness + 1)."""
        start, last = self.warmup, self.last_measured
        ends = [self.step_end(s) for s in range(start, last + 1, period)]
        return [(b - a) / period for a, b in zip(ends, ends[1:], strict=False)]

    def half_spread(self, period: int) -> float:
        """|first half - second half| / mean of the measured window's step time, the halves made
        of whole periods (0 when fewer than two periods are measured): how far the measurement
        is from a steady state."""
        times = self.period_step_times(period)
        half = len(times) // 2
        if half == 0:
            return 0.0
        first, second = sum(times[:half]) / half, sum(times[-half:]) / half
        return abs(first - second) / (sum(times) / len(times))


@dataclass(frozen=True)
class StepWindow:
    """How many steps to simulate and which to measure: ``warmup`` steps filling the pipeline,
    ``measured`` steps averaged, ``cooldown`` steps after them so that the generators still have
    work queued while the measured steps complete (the last steps of a run drain)."""

    warmup: int
    measured: int
    cooldown: int
    period: int

    @property
    def steps(self) -> int:
        return self.warmup + self.measured + self.cooldown + 1


def steady_window(
    mode: str, staleness: int, warmup_periods: int, measure_periods: int
) -> StepWindow:
    """The StepWindow of a pipeline: async in periods of staleness + 1 steps (the usual period
    of its step completions), one period of cool-down; sync repeats every step (period 1)."""
    period = staleness + 1 if mode == "async" else 1
    return StepWindow(warmup_periods * period, measure_periods * period, period, period)


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


ASYNC_GENERATION = ("continuous", "drain")  # async generation models (continuous.py, here)

PipelineFn = Callable[[StepPhases, int, int], Schedule]
PIPELINES: MappingProxyType[str, PipelineFn] = MappingProxyType(
    {"sync": simulate_sync, "async": simulate_async}
)
