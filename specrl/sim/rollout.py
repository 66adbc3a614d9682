"""Event-driven simulation of one rollout phase: continuous batching on each engine replica.

``simulate_rollout(prompts, responses, engine, replicas)`` returns the wall time for all
sequences to finish (the slowest replica) with a per-replica timeline. Sequences are dealt round
robin; a replica admits them within ``max_num_seqs`` and its KV cache and preempts the newest on
overflow (vLLM's policy). Between events the batch is fixed and many steps are priced at once,
with acceptance in expectation.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specrl.costmodel.cost import StepCostModel
from specrl.sim.acceptance import POLICIES, AcceptanceModel, PolicyInput


@dataclass(frozen=True)
class EngineConfig:
    """How one replica runs: its cost model, drafter acceptance, and speculation policy."""

    costs: StepCostModel
    acceptance: AcceptanceModel
    policy: str = "off"
    k: int = 0
    max_num_seqs: int = 256
    replan_tokens: int = 256
    rl_step: int = 0


@dataclass(frozen=True)
class Segment:
    """A stretch of identical engine steps (or a prefill when ``k`` is -1)."""

    start_s: float
    end_s: float
    n_seqs: int
    k: int
    steps: int
    tokens: float = 0.0  # tokens emitted (decode segments)


def acceptance_of(segments: list[Segment]) -> float:
    """Tokens emitted per sequence-step over the speculative segments (k > 0); 0 if none."""
    spec = [s for s in segments if s.k > 0]
    seq_steps = sum(s.steps * s.n_seqs for s in spec)
    return sum(s.tokens for s in spec) / seq_steps if seq_steps else 0.0


@dataclass
class ReplicaResult:
    time_s: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    preemptions: int = 0
    segments: list[Segment] = field(default_factory=list)

    def time_in(self, predicate) -> float:
        return sum(s.end_s - s.start_s for s in self.segments if predicate(s))

    @property
    def prefill_s(self) -> float:
        return self.time_in(lambda s: s.k < 0)

    @property
    def spec_fraction(self) -> float:
        """Share of decode time spent in speculative steps (k > 0)."""
        decode = self.time_in(lambda s: s.k >= 0)
        return self.time_in(lambda s: s.k > 0) / decode if decode else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per sequence-step of speculative steps (what vLLM reports); 0 if none."""
        return acceptance_of(self.segments)

    @property
    def mean_batch(self) -> float:
        """Time-weighted number of running sequences during decode."""
        decode = [s for s in self.segments if s.k >= 0]
        total = sum(s.end_s - s.start_s for s in decode)
        return sum(s.n_seqs * (s.end_s - s.start_s) for s in decode) / total if total else 0.0


@dataclass(frozen=True)
class RolloutResult:
    time_s: float
    tokens: float
    replicas: tuple[ReplicaResult, ...]

    @property
    def throughput(self) -> float:
        return self.tokens / self.time_s if self.time_s else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per sequence-step of the speculative steps of all replicas."""
        return acceptance_of([s for r in self.replicas for s in r.segments])

    def summary(self) -> dict[str, float]:
        n = len(self.replicas)
        return {
            "time_s": self.time_s,
            "tokens": self.tokens,
            "tokens_per_s": self.throughput,
            "engine_steps_mean": sum(r.steps for r in self.replicas) / n,
            "prefill_s_mean": sum(r.prefill_s for r in self.replicas) / n,
            "mean_batch": sum(r.mean_batch for r in self.replicas) / n,
            "spec_fraction": sum(r.spec_fraction for r in self.replicas) / n,
            "acceptance_length": self.acceptance_length,
            "preemptions": float(sum(r.preemptions for r in self.replicas)),
        }


def sample_lengths(mean: float, sigma: float, max_len: int, n: int, seed: int) -> np.ndarray:
    """Lognormal lengths with the given mean (before truncation) and log-sigma, cut at max_len."""
    rng = np.random.default_rng(seed)
    if sigma <= 0:
        return np.full(n, min(max(round(mean), 1), max_len), dtype=np.int64)
    mu = np.log(mean) - 0.5 * sigma**2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, max_len).astype(np.int64)


def sample_lengths_capped_mean(
    mean: float, sigma: float, max_len: int, n: int, seed: int
) -> np.ndarray:
    """Like sample_lengths, but ``mean`` is the mean after the cap (e.g. a published average):
    the pre-truncation mean is found by bisection on the same seeded draw."""
    if mean >= max_len:
        raise ValueError(f"mean after cap {mean} must be below the cap {max_len}")
    lo, hi = 1.0, 64.0 * max_len
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        got = sample_lengths(mid, sigma, max_len, n, seed).mean()
        lo, hi = (mid, hi) if got < mean else (lo, mid)
    return sample_lengths(0.5 * (lo + hi), sigma, max_len, n, seed)


@dataclass
class Replica:
    """Mutable state of one replica during a simulation (local to simulate_replica)."""

    prompt: np.ndarray
    target: np.ndarray
    generated: np.ndarray
    active: np.ndarray
    waiting: deque
    order: list[int]

    def context(self, idx: np.ndarray) -> np.ndarray:
        return self.prompt[idx] + self.generated[idx]


def _admit(st: Replica, capacity: float, max_num_seqs: int) -> list[int]:
    used = float(st.context(np.flatnonzero(st.active)).sum())
    admitted: list[int] = []
    while st.waiting and int(st.active.sum()) < max_num_seqs:
        i = st.waiting[0]
        need = st.prompt[i] + st.generated[i] + 1
        if used + need > capacity and st.active.any():
            break
        st.waiting.popleft()
        st.active[i] = True
        st.order.append(i)
        admitted.append(i)
        used += need
    return admitted


def preempt(st: Replica, capacity: float) -> int:
    count = 0
    while st.context(np.flatnonzero(st.active)).sum() > capacity and int(st.active.sum()) > 1:
        i = st.order.pop()
        st.active[i] = False
        st.waiting.appendleft(i)
        count += 1
    return count


def _segment_steps(
    remaining: np.ndarray, tps: np.ndarray, ctx_sum: float, cfg: EngineConfig, cap: float
) -> int:
    """Steps until the first sequence finishes, the next replan, or the KV cache fills.
    remaining, tps: [n] tokens left and tokens per step of the running sequences."""
    tps_sum = float(tps.sum())
    to_finish = int(np.ceil(remaining / tps).min())
    to_replan = max(1, int(cfg.replan_tokens * len(tps) / tps_sum))
    free = cap - ctx_sum
    to_full = max(1, int(free / tps_sum)) if free > 0 else 1
    return max(1, min(to_finish, to_replan, to_full))


def decode_segment(
    st: Replica, cfg: EngineConfig, cap: float, t0: float, max_dt: float = np.inf
) -> Segment:
    """Advance the running batch by one segment of identical steps (at most ``max_dt`` seconds,
    but at least one step) and retire the sequences that finish."""
    act = np.flatnonzero(st.active)
    n_seqs = len(act)
    generated, target = st.generated[act], st.target[act]  # [n]
    ctx_sum = float((st.prompt[act] + generated).sum())
    ctx_mean = ctx_sum / n_seqs
    inp = PolicyInput(cfg.costs, cfg.acceptance, n_seqs, ctx_mean, generated, cfg.rl_step, cfg.k)
    k = POLICIES[cfg.policy](inp) if cfg.costs.drafter is not None else 0
    tps = cfg.acceptance.expected_tokens(k, generated, cfg.rl_step)  # [n]
    n = _segment_steps(target - generated, tps, ctx_sum, cfg, cap)
    if np.isfinite(max_dt):
        n = max(1, min(n, int(max_dt / cfg.costs.step(n_seqs, k, ctx_mean))))
    mid = ctx_mean + float(tps.sum()) / n_seqs * (n - 1) / 2
    dt = n * cfg.costs.step(n_seqs, k, mid)
    advanced = np.minimum(generated + n * tps, target)  # [n]
    st.generated[act] = advanced
    done = advanced >= target - 1e-9
    if done.any():
        finished = act[done]
        st.active[finished] = False
        gone = set(finished.tolist())
        st.order[:] = [i for i in st.order if i not in gone]
    return Segment(t0, t0 + dt, n_seqs, k, n, float(advanced.sum() - generated.sum()))


def simulate_replica(
    prompts: np.ndarray, responses: np.ndarray, cfg: EngineConfig
) -> ReplicaResult:
    """Run one replica until every sequence has generated its response length."""
    n = len(responses)
    st = Replica(
        prompt=np.asarray(prompts, dtype=float),
        target=np.asarray(responses, dtype=float),
        generated=np.zeros(n),
        active=np.zeros(n, dtype=bool),
        waiting=deque(range(n)),
        order=[],
    )
    cap = cfg.costs.kv_capacity_tokens()
    res = ReplicaResult(tokens=float(st.target.sum()))
    t = 0.0
    while st.waiting or st.active.any():
        admitted = _admit(st, cap, cfg.max_num_seqs)
        if admitted:
            idx = np.asarray(admitted)
            dt = cfg.costs.prefill(len(idx), float(st.context(idx).mean()))
            res.segments.append(Segment(t, t + dt, len(idx), -1, 1))
            t += dt
        seg = decode_segment(st, cfg, cap, t)
        res.segments.append(seg)
        res.steps += seg.steps
        t = seg.end_s
        res.preemptions += preempt(st, cap)
    res.time_s = t
    return res


def simulate_rollout(
    prompts: np.ndarray, responses: np.ndarray, cfg: EngineConfig, replicas: int
) -> RolloutResult:
    """Deal sequences round robin over ``replicas`` identical engines; time is the slowest one."""
    results = tuple(
        simulate_replica(prompts[r::replicas], responses[r::replicas], cfg)
        for r in range(replicas)
        if len(responses[r::replicas])
    )
    return RolloutResult(
        time_s=max(r.time_s for r in results),
        tokens=float(np.sum(responses)),
        replicas=results,
    )
