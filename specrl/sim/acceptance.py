"""Acceptance models and speculation policies: tokens a verify step emits, and which k to use.

An acceptance model gives the probability that draft i is accepted after drafts 1..i-1, by
draft position, response position and RL step; a verify step then emits
1 + sum_i prod_{j<=i} a_j tokens in expectation. ``rollout_acceptance`` is the acceptance
length an engine reports for a whole rollout; ``alpha_for_rollout_length`` inverts it. Models
and policies are registered by name (``ACCEPTANCE_KINDS``, ``POLICIES``) for scenarios.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np

from specrl.costmodel.cost import StepCostModel


def expected_tokens_iid(alpha: float, k: int) -> float:
    """Closed form (1 - a^(k+1)) / (1 - a) for i.i.d. acceptance a and k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def position_rates(alpha: float, k: int, ratio: float = 1.0) -> np.ndarray:
    """[k] conditional acceptance of drafts 1..k: alpha * ratio^(i-1), within [0, 1]."""
    return np.clip(alpha * ratio ** np.arange(k), 0.0, 1.0)


def expected_tokens_profile(alpha: float, k: int, ratio: float = 1.0) -> float:
    """Expected tokens per verify step with rates ``position_rates(alpha, k, ratio)``."""
    return float(1.0 + np.cumprod(position_rates(alpha, k, ratio)).sum())


def _bisect(fn, target: float, lo: float = 0.0, hi: float = 1.0) -> float:
    """The x in [lo, hi] where the increasing ``fn`` reaches ``target`` (60 halvings)."""
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if fn(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def alpha_for_length(acceptance_length: float, k: int, ratio: float = 1.0) -> float:
    """The first-draft acceptance a whose expected tokens with k drafts (rates a * ratio^(i-1))
    is the given length (ratio 1: the i.i.d. rate)."""
    if not 1.0 <= acceptance_length <= k + 1:
        raise ValueError(f"acceptance length {acceptance_length} outside [1, {k + 1}] for k={k}")
    return _bisect(lambda a: expected_tokens_profile(a, k, ratio), acceptance_length)


@dataclass(frozen=True)
class AcceptanceParams:
    """Inputs shared by the acceptance kinds (see each kind for which it reads)."""

    alpha: float  # acceptance of the first draft at response position 0, RL step 0
    per_position: tuple[float, ...] = ()  # positional: a_i for draft positions 1..len
    decay_per_1k_tokens: float = 0.0  # drift: alpha lost per 1000 response tokens (past the next)
    decay_per_rl_step: float = 0.0  # drift: alpha lost per RL step since the drafter was trained
    floor: float = 0.0  # drift: lowest alpha
    position_ratio: float = 1.0  # a_(i+1) / a_i over draft positions (the drafter's profile)
    decay_after_tokens: float = 0.0  # drift: response tokens before the decay starts


AcceptanceFn = Callable[[AcceptanceParams, int, np.ndarray, int], np.ndarray]


def _constant(p: AcceptanceParams, k: int, positions: np.ndarray, rl_step: int) -> np.ndarray:
    return np.tile(position_rates(p.alpha, k, p.position_ratio), (len(positions), 1))


def _positional(p: AcceptanceParams, k: int, positions: np.ndarray, rl_step: int) -> np.ndarray:
    rates = list(p.per_position) or [p.alpha]
    row = [rates[min(i, len(rates) - 1)] for i in range(k)]
    return np.tile(np.asarray(row, dtype=float), (len(positions), 1))


def _drift(p: AcceptanceParams, k: int, positions: np.ndarray, rl_step: int) -> np.ndarray:
    past = np.maximum(np.asarray(positions, dtype=float) - p.decay_after_tokens, 0.0)
    alpha = p.alpha - p.decay_per_1k_tokens * past / 1000.0 - p.decay_per_rl_step * rl_step
    alpha = np.clip(alpha, p.floor, 1.0)
    shape = p.position_ratio ** np.arange(k)
    return np.clip(alpha[:, None] * shape[None, :], 0.0, 1.0)


@dataclass(frozen=True)
class AcceptanceKind:
    """A registered acceptance model: its rates, and whether they change along the response."""

    rates: AcceptanceFn
    by_position: bool


ACCEPTANCE_KINDS: MappingProxyType[str, AcceptanceKind] = MappingProxyType(
    {
        "constant": AcceptanceKind(_constant, False),
        "positional": AcceptanceKind(_positional, False),
        "drift": AcceptanceKind(_drift, True),
    }
)


@dataclass(frozen=True)
class AcceptanceModel:
    kind: str
    params: AcceptanceParams

    def rates(self, k: int, positions: np.ndarray, rl_step: int = 0) -> np.ndarray:
        """[n_seqs, k] conditional acceptance probabilities."""
        return ACCEPTANCE_KINDS[self.kind].rates(self.params, k, positions, rl_step)

    def expected_tokens(self, k: int, positions: np.ndarray, rl_step: int = 0) -> np.ndarray:
        """[n_seqs] expected tokens emitted per verify step (1 when k = 0)."""
        positions = np.asarray(positions, dtype=float)
        if k == 0:
            return np.ones(len(positions))
        if not ACCEPTANCE_KINDS[self.kind].by_position:  # one row serves every sequence
            survive = np.cumprod(self.rates(k, positions[:1], rl_step), axis=1)
            return np.full(len(positions), 1.0 + float(survive.sum()))
        survive = np.cumprod(self.rates(k, positions, rl_step), axis=1)
        return 1.0 + survive.sum(axis=1)


ROLLOUT_GRID_TOKENS = 64  # response positions per acceptance evaluation in rollout_acceptance


def rollout_acceptance(
    model: AcceptanceModel, k: int, lengths: np.ndarray, rl_step: int = 0
) -> float:
    """Acceptance length a rollout reports: tokens emitted over sequence-steps, summed over
    sequences of the given response lengths (each priced every ROLLOUT_GRID_TOKENS tokens)."""
    lengths = np.asarray(lengths, dtype=float)  # [n]
    grid = float(ROLLOUT_GRID_TOKENS)
    starts = np.arange(0.0, float(lengths.max()) + grid, grid)  # [m] segment starts
    tps = model.expected_tokens(k, starts, rl_step)  # [m] tokens per step in each segment
    before = np.concatenate([[0.0], np.cumsum(grid / tps)])  # [m + 1] steps before segment j
    seg = np.minimum((lengths // grid).astype(int), len(starts) - 1)  # [n]
    steps = before[seg] + (lengths - seg * grid) / tps[seg]  # [n]
    return float(lengths.sum() / steps.sum())


def alpha_for_rollout_length(
    model: AcceptanceModel, k: int, lengths: np.ndarray, target: float, rl_step: int = 0
) -> float:
    """The first-draft rate a_1 at which ``rollout_acceptance`` equals ``target`` (the model's
    other parameters kept); ValueError when no a_1 in [0, 1] reaches it."""

    def at(alpha: float) -> float:
        params = replace(model.params, alpha=alpha)
        return rollout_acceptance(AcceptanceModel(model.kind, params), k, lengths, rl_step)

    if not at(0.0) <= target <= at(1.0):
        raise ValueError(
            f"a rollout acceptance length of {target} at k={k} is outside the reachable"
            f" [{at(0.0):.3g}, {at(1.0):.3g}] for this acceptance profile"
        )
    return _bisect(at, target)


@dataclass(frozen=True)
class PolicyInput:
    """What a speculation policy may look at when choosing k for the next steps."""

    costs: StepCostModel
    acceptance: AcceptanceModel
    n_seqs: int
    context: float
    positions: np.ndarray
    rl_step: int
    k: int  # the scenario's k (fixed) or upper bound (cost-optimal)


PolicyFn = Callable[[PolicyInput], int]


def tokens_per_second(inp: PolicyInput, k: int) -> float:
    tokens = float(inp.acceptance.expected_tokens(k, inp.positions, inp.rl_step).sum())
    return tokens / inp.costs.step(inp.n_seqs, k, inp.context)


def _off(inp: PolicyInput) -> int:
    return 0


def _fixed(inp: PolicyInput) -> int:
    return inp.k


def _cost_optimal(inp: PolicyInput) -> int:
    """The k in 0..k (0 = speculation off) with the highest expected tokens per second."""
    return max(range(inp.k + 1), key=lambda k: tokens_per_second(inp, k))


POLICIES: MappingProxyType[str, PolicyFn] = MappingProxyType(
    {"off": _off, "fixed": _fixed, "cost_optimal": _cost_optimal}
)
