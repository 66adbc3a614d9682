"""The asynchronous pipeline on one shared machine: generator and learner slow each other down.

``simulate_shared(gen, learn, staleness, overlap)`` returns when each step's learning completes,
generation and learning scheduled as specrl's in-process async loop runs them (``staleness``
bounds how far generation runs ahead) and, while both run, each slowed by its ``Overlap``
factor (per machine, fitted by ``specrl.sim.machine``). ``staleness = 0`` gives the synchronous
result; slowdowns of 1 give the disaggregated ``pipeline.simulate_async``.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Overlap:
    """Slowdown of each side while the other runs (>= 1; 1 = unaffected)."""

    generation: float = 2.0
    learning: float = 2.0

    def __post_init__(self) -> None:
        if self.generation < 1.0 or self.learning < 1.0:
            raise ValueError(f"overlap slowdowns must be >= 1, got {self}")


@dataclass
class _Job:
    work: float  # solo seconds left
    start: float  # when it may start


def _advance(
    gen: _Job | None, learn: _Job | None, now: float, overlap: Overlap
) -> tuple[float, str]:
    """Time at which the next of the running jobs finishes (a job runs once now >= its start),
    and which one ("gen" or "learn"); progresses both jobs' work to that time."""
    events = [j.start for j in (gen, learn) if j is not None and j.start > now]
    running = {n: j for n, j in (("gen", gen), ("learn", learn)) if j and j.start <= now}
    both = len(running) == 2
    slow = {"gen": overlap.generation if both else 1.0, "learn": overlap.learning if both else 1.0}
    finish = {n: now + j.work * slow[n] for n, j in running.items()}
    nxt = min([*finish.values(), *events])
    for n, j in running.items():
        j.work -= (nxt - now) / slow[n]
    done = [n for n in finish if finish[n] <= nxt]
    return nxt, done[0] if done else ""


def simulate_shared(
    gen: Sequence[float], learn: Sequence[float], staleness: int, overlap: Overlap
) -> np.ndarray:
    """Learning completion time of every step (see the module docstring); ``[steps]``."""
    if len(gen) != len(learn):
        raise ValueError(f"{len(gen)} generation times for {len(learn)} learning times")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    steps = len(gen)
    gen_done, learn_done = np.full(steps, np.inf), np.full(steps, np.inf)
    g = lg = 0  # next step to generate / to learn
    now = 0.0
    gen_job: _Job | None = None
    learn_job: _Job | None = None
    while lg < steps:
        if gen_job is None and g < steps:
            needed = g - staleness  # the oldest version allowed: learning of needed - 1 done
            ready = learn_done[needed - 1] if needed >= 1 else 0.0
            if np.isfinite(ready):
                gen_job = _Job(float(gen[g]), max(now, ready))
        if learn_job is None and np.isfinite(gen_done[lg]):
            learn_job = _Job(float(learn[lg]), now)
        now, which = _advance(gen_job, learn_job, now, overlap)
        if which == "gen":
            gen_done[g], gen_job, g = now, None, g + 1
        elif which == "learn":
            learn_done[lg], learn_job, lg = now, None, lg + 1
    return learn_done
