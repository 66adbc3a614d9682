"""Acceptance models and speculation policies: tokens a verify step emits, and which k to use.

Contract: an acceptance model maps (draft position i = 1..k, response position, RL step) to the
probability that draft i is accepted given drafts 1..i-1 were. Expected tokens emitted per verify
step for one sequence is then 1 + sum_i prod_{j<=i} a_j (the bonus/recovered token plus the
accepted prefix); with a constant a this is the closed form (1 - a^(k+1)) / (1 - a).
Acceptance models and speculation policies are registered by name (``ACCEPTANCE_KINDS``,
``POLICIES``) and selected from a scenario's data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from specrl.sim.cost import StepCostModel


def expected_tokens_iid(alpha: float, k: int) -> float:
    """Closed form (1 - a^(k+1)) / (1 - a) for i.i.d. acceptance a and k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_for_length(acceptance_length: float, k: int) -> float:
    """The i.i.d. per-token acceptance a whose expected tokens with k drafts is the given length."""
    if not 1.0 <= acceptance_length <= k + 1:
        raise ValueError(f"acceptance length {acceptance_length} outside [1, {k + 1}] for k={k}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_tokens_iid(mid, k) < acceptance_length else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class AcceptanceParams:
    """Inputs shared by the acceptance kinds (see each kind for which it reads)."""

    alpha: float  # per-token acceptance at response position 0, RL step 0
    per_position: tuple[float, ...] = ()  # positional: a_i for draft positions 1..len
    decay_per_1k_tokens: float = 0.0  # drift: alpha lost per 1000 response tokens
    decay_per_rl_step: float = 0.0  # drift: alpha lost per RL step since the drafter was trained
    floor: float = 0.0  # drift: lowest alpha


AcceptanceFn = Callable[[AcceptanceParams, int, np.ndarray, int], np.ndarray]


def _constant(p: AcceptanceParams, k: int, positions: np.ndarray, rl_step: int) -> np.ndarray:
    return np.full((len(positions), k), p.alpha)


def _positional(p: AcceptanceParams, k: int, positions: np.ndarray, rl_step: int) -> np.ndarray:
    rates = list(p.per_position) or [p.alpha]
    row = [rates[min(i, len(rates) - 1)] for i in range(k)]
    return np.tile(np.asarray(row, dtype=float), (len(positions), 1))


def _drift(p: AcceptanceParams, k: int, positions: np.ndarray, rl_step: int) -> np.ndarray:
    alpha = p.alpha - p.decay_per_1k_tokens * positions / 1000.0 - p.decay_per_rl_step * rl_step
    alpha = np.clip(alpha, p.floor, 1.0)
    return np.repeat(alpha[:, None], k, axis=1)


ACCEPTANCE_KINDS: MappingProxyType[str, AcceptanceFn] = MappingProxyType(
    {"constant": _constant, "positional": _positional, "drift": _drift}
)


@dataclass(frozen=True)
class AcceptanceModel:
    kind: str
    params: AcceptanceParams

    def rates(self, k: int, positions: np.ndarray, rl_step: int = 0) -> np.ndarray:
        """[n_seqs, k] conditional acceptance probabilities."""
        return ACCEPTANCE_KINDS[self.kind](self.params, k, positions, rl_step)

    def expected_tokens(self, k: int, positions: np.ndarray, rl_step: int = 0) -> np.ndarray:
        """[n_seqs] expected tokens emitted per verify step (1 when k = 0)."""
        positions = np.asarray(positions, dtype=float)
        if k == 0:
            return np.ones(len(positions))
        survive = np.cumprod(self.rates(k, positions, rl_step), axis=1)
        return 1.0 + survive.sum(axis=1)


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
