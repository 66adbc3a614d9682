"""Continuous asynchronous generation: generators stay full across RL steps (staleness bound).

``simulate_continuous(prompts, responses, cfg, replicas, phases, steps, staleness)`` simulates
AReaL / NeMo-RL style async RL (always-busy generators, in-flight weight updates): a sequence of
step s is admitted once policy version s - staleness exists and takes a free slot at once; the
trainer takes steps in order and each refit pauses the generators. Returns a
``ContinuousResult`` whose ``schedule`` has the per-step pipelines' shape; staleness 0 gives
the synchronous schedule. Details: docs/internals.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specrl.sim.pipeline import Interval, Schedule, StepPhases, trainer_intervals
from specrl.sim.rollout import (
    EngineConfig,
    Replica,
    ReplicaResult,
    Segment,
    decode_segment,
    preempt,
)


@dataclass
class _Stream:
    """One replica's state across all RL steps."""

    st: Replica
    step_of: np.ndarray
    res: ReplicaResult
    clock: float = 0.0
    blocked: bool = False
    pauses_done: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.st.waiting) or bool(self.st.active.any())


@dataclass(frozen=True)
class ContinuousResult:
    schedule: Schedule
    versions: tuple[float, ...]  # versions[v]: time policy version v exists (v = 0 at t = 0)
    generation_spans: tuple[tuple[float, float], ...]  # per step: first admission, last finish
    replicas: tuple[ReplicaResult, ...] = field(default=())

    @property
    def generation_busy_fraction(self) -> float:
        """Share of the makespan the generators spend in prefill/decode (mean over replicas)."""
        end = self.schedule.makespan
        busy = [r.time_in(lambda s: s.k >= -1) for r in self.replicas]
        return float(np.mean(busy)) / end if end else 0.0


def _deal(prompts: np.ndarray, responses: np.ndarray, replicas: int, steps: int):
    idx = np.arange(len(responses))
    for r in range(replicas):
        parts = [idx[(idx + s) % replicas == r] for s in range(steps)]
        sel = np.concatenate(parts)
        step_of = np.concatenate([np.full(len(p), s) for s, p in enumerate(parts)])
        yield np.asarray(prompts)[sel], np.asarray(responses)[sel], step_of


def _admit_upto(x: _Stream, cap: float, max_num_seqs: int, allowed: int) -> list[int]:
    """rollout._admit, restricted to sequences of steps <= ``allowed`` (waiting is step-ordered)."""
    st = x.st
    used = float(st.context(np.flatnonzero(st.active)).sum())
    admitted: list[int] = []
    while st.waiting and int(st.active.sum()) < max_num_seqs:
        i = st.waiting[0]
        if x.step_of[i] > allowed:
            break
        need = st.prompt[i] + st.generated[i] + 1
        if used + need > cap and st.active.any():
            break
        st.waiting.popleft()
        st.active[i] = True
        st.order.append(i)
        admitted.append(i)
        used += need
    return admitted


def simulate_continuous(
    prompts: np.ndarray,
    responses: np.ndarray,
    cfg: EngineConfig,
    replicas: int,
    phases: StepPhases,
    steps: int,
    staleness: int,
) -> ContinuousResult:
    """Asynchronous RL with continuous generation under a staleness bound (see module doc)."""
    if staleness < 0:
        raise ValueError("staleness must be >= 0")
    cap = cfg.costs.kv_capacity_tokens()
    streams: list[_Stream] = []
    for p, r, step_of in _deal(prompts, responses, replicas, steps):
        if not len(r):
            continue
        st = Replica(
            prompt=p.astype(float),
            target=r.astype(float),
            generated=np.zeros(len(r)),
            active=np.zeros(len(r), dtype=bool),
            waiting=deque(range(len(r))),
            order=[],
        )
        streams.append(_Stream(st, step_of, ReplicaResult(tokens=float(r.sum()))))

    n = len(responses)
    left = np.full(steps, n)
    first_start = np.full(steps, np.inf)
    last_end = np.zeros(steps)
    versions = [0.0]
    trainer_iv: list[Interval] = []
    refit_windows: list[tuple[float, float]] = []

    def gate(s: int) -> float | None:
        v = s - staleness
        if v <= 0:
            return 0.0
        return versions[v] if v < len(versions) else None

    def allowed_at(t: float) -> int:
        return staleness + sum(1 for v in versions[1:] if v <= t)

    def train_ready_steps() -> None:
        while len(versions) - 1 < steps and left[len(versions) - 1] == 0:
            s = len(versions) - 1
            start = max(last_end[s], versions[s] if s >= 1 else 0.0)
            ivs = trainer_intervals(phases, s, start, "training")
            trainer_iv.extend(ivs)
            versions.append(ivs[-1].end_s)
            refit_windows.append((ivs[-1].end_s - phases.refit, ivs[-1].end_s))
            for x in streams:
                x.blocked = False

    def apply_pauses(x: _Stream) -> None:
        while x.pauses_done < len(refit_windows):
            a, b = refit_windows[x.pauses_done]
            if x.clock < a:
                return
            x.res.segments.append(Segment(x.clock, x.clock + (b - a), 0, -2, 0))
            x.clock = b if x.clock < b else x.clock + (b - a)
            x.pauses_done += 1

    while True:
        live = [x for x in streams if x.busy and not x.blocked]
        if not live:
            if any(x.busy for x in streams):
                raise RuntimeError("continuous generation deadlocked")  # pragma: no cover
            break
        x = min(live, key=lambda s: s.clock)
        st = x.st
        apply_pauses(x)
        admitted = _admit_upto(x, cap, cfg.max_num_seqs, allowed_at(x.clock))
        if admitted:
            idx = np.asarray(admitted)
            for s in set(x.step_of[idx].tolist()):
                first_start[s] = min(first_start[s], x.clock)
            dt = cfg.costs.prefill(len(idx), float(st.context(idx).mean()))
            x.res.segments.append(Segment(x.clock, x.clock + dt, len(idx), -1, 1))
            x.clock += dt
        if not st.active.any():
            g = gate(int(x.step_of[st.waiting[0]]))
            if g is None:
                x.blocked = True
                continue
            x.clock = max(x.clock, g)
            while x.pauses_done < len(refit_windows) and refit_windows[x.pauses_done][1] <= g:
                x.pauses_done += 1  # idle through this refit
            continue
        max_dt = np.inf
        if st.waiting and int(st.active.sum()) < cfg.max_num_seqs:
            g = gate(int(x.step_of[st.waiting[0]]))
            if g is not None and g > x.clock:
                max_dt = g - x.clock
        before = np.flatnonzero(st.active)
        seg = decode_segment(st, cfg, cap, x.clock, max_dt)
        x.res.segments.append(seg)
        x.res.steps += seg.steps
        x.clock = seg.end_s
        done = before[~st.active[before]]
        for s in x.step_of[done].tolist():
            left[s] -= 1
            last_end[s] = max(last_end[s], seg.end_s)
        x.res.preemptions += preempt(st, cap)
        if len(done):
            train_ready_steps()

    for x in streams:
        x.res.time_s = x.clock
    gen_iv = [
        Interval("generation", "generation", s, float(first_start[s]), float(last_end[s]))
        for s in range(steps)
    ]
    schedule = Schedule(tuple(gen_iv + trainer_iv), steps, warmup=min(staleness, steps - 2))
    return ContinuousResult(
        schedule=schedule,
        versions=tuple(versions),
        generation_spans=tuple(
            (float(a), float(b)) for a, b in zip(first_start, last_end, strict=True)
        ),
        replicas=tuple(x.res for x in streams),
    )
