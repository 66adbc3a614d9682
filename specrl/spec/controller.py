"""Speculation controller: per decode step, the number of draft tokens that maximises tokens/s.

Contract: ``SpecController(k_max, target_cost)`` answers ``choose(rows, context) -> k`` with
0 <= k <= k_max (0 = a plain step) for a step of ``rows`` live rows whose caches hold ``context``
tokens on average, maximising the expected emitted tokens per second

    rate(k) = rows * E[emitted | k] / (T_draft(rows, k) + T_verify(rows, k, context))
    rate(0) = rows / T_decode(rows, context)

from three estimates, each refreshed by what the engine reports after every step (``observe``):

- the target's step times: ``specrl.sim.cost.StepCostModel`` over a hardware profile fitted by
  ``specrl.sim.calibrate.fit_records`` (the simulator's own CPU model and fit: one cost model,
  two users), first from ``measure_forwards`` (timed forwards at a few shapes when the engine
  starts, about a second) and then from the engine's own recent decode and verify steps;
- the drafter's time: least squares on its recent steps over [1, k, rows, k * rows] (a
  model-free drafter costs per row, a draft network per forward and per row-forward);
- acceptance: per draft position i, the decayed share of rows that emitted at least i accepted
  draft tokens when i or more were asked (drafts shorter than asked count as rejections), so
  E[emitted | k] = 1 + sum_{i <= k} P(accepted >= i).

Speculation that never runs is never measured: while the estimate at position k_max rests on
fewer than ``min_tries`` rows the controller explores (a step at k_max) whenever the predicted
extra time of doing so fits a budget that grows by ``explore_share`` of every step's predicted
time, so exploring costs at most that share of decoding time. Every decision depends on
measured times, so with rejection sampling ("distribution") the completions of a seed are
reproducible in distribution, not token for token ("sample" exactness keeps them identical).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from specrl.sim.calibrate import Record, fit_records, nnls
from specrl.sim.cost import StepCostModel
from specrl.sim.specs import HardwareSpec, ModelSpec, load_hardware

BASE_PROFILE = "cpu-2core"  # its peaks only convert fitted rates to efficiencies


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """The simulator's description of a ``specrl.models.transformer.Transformer``."""
    c = model.config
    params = float(sum(p.numel() for p in model.parameters()))
    return ModelSpec(
        name=f"engine-{c.model_type}",
        layers=c.num_layers,
        hidden=c.hidden_size,
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        vocab=c.vocab_size,
        intermediate=c.intermediate_size,
        params_total=params,
        params_active=params,
    )


def calibration_shapes(max_batch: int, k_max: int) -> list[tuple[int, int]]:
    """(rows, tokens per row) of the start-up measurement: plain and k_max + 1 wide forwards at
    1, 8, 32 and ``max_batch`` rows, skipping verify forwards of more than 128 tokens (the model is
    linear in tokens there)."""
    batches = sorted({min(b, max_batch) for b in (1, 8, 32, max_batch)})
    widths = sorted({1, k_max + 1})
    return [(b, t) for b in batches for t in widths if b * t <= 128 or t == 1]


@torch.inference_mode()
def measure_forwards(
    model: torch.nn.Module, shapes: list[tuple[int, int]], context: int = 64
) -> list[Record]:
    """Time one forward per (rows, tokens) shape over a scratch cache holding ``context``
    positions per row (after one untimed warm-up each): decode records for 1 token, verify
    records for more."""
    rows = max(b for b, _ in shapes)
    width = max(t for _, t in shapes)
    cache = model.new_cache(rows, context + width)
    records = []
    for b, t in shapes:
        ids = torch.zeros(b, t, dtype=torch.long)  # [b, t]
        positions = context + torch.arange(t)[None, :].expand(b, t)  # [b, t]
        model(ids, positions, cache, kv_len=context + t)  # warm-up
        t0 = time.perf_counter()
        model(ids, positions, cache, kv_len=context + t)
        kind = "decode" if t == 1 else "verify"
        records.append(Record(b, t, float(context), time.perf_counter() - t0, kind))
    return records


@dataclass
class Acceptance:
    """Decayed counts, per draft position, of rows asked for it and rows that accepted it."""

    k_max: int
    decay: float = 0.995  # per observed step: the evidence of ~200 steps
    tries: np.ndarray = field(init=False)  # [k_max]
    hits: np.ndarray = field(init=False)  # [k_max]

    def __post_init__(self) -> None:
        self.tries = np.zeros(self.k_max)
        self.hits = np.zeros(self.k_max)

    def observe(self, k: int, accepted: list[int]) -> None:
        """A step that asked ``k`` drafts of each row, which accepted ``accepted`` [rows]."""
        self.tries *= self.decay
        self.hits *= self.decay
        if k == 0 or not accepted:
            return
        acc = np.asarray(accepted)
        self.tries[:k] += len(acc)
        self.hits[:k] += (acc[:, None] > np.arange(k)[None, :]).sum(0)

    def reach(self) -> np.ndarray:
        """P(accepted >= i) for i = 1..k_max [k_max], non-increasing (0 where never tried)."""
        p = np.divide(self.hits, self.tries, out=np.zeros(self.k_max), where=self.tries > 0)
        return np.minimum.accumulate(p)

    def emitted(self, k: int) -> float:
        """Expected tokens a row emits in a step with ``k`` drafts."""
        return 1.0 + float(self.reach()[:k].sum())


@dataclass
class DraftCost:
    """The drafter's seconds per step from its recent steps: [1, k, rows, k * rows] rates."""

    window: int = 64
    records: deque = field(default_factory=deque)  # (features [4], seconds)
    coef: np.ndarray = field(default_factory=lambda: np.zeros(4))

    @staticmethod
    def features(rows: int, k: int) -> np.ndarray:
        return np.array([1.0, k, rows, k * rows], dtype=float)

    def observe(self, rows: int, k: int, seconds: float) -> None:
        self.records.append((self.features(rows, k), seconds))
        while len(self.records) > self.window:
            self.records.popleft()
        x = np.stack([f for f, _ in self.records])
        self.coef = nnls(x, np.array([s for _, s in self.records]))

    def predict(self, rows: int, k: int) -> float:
        return 0.0 if k == 0 else float(self.features(rows, k) @ self.coef)


@dataclass
class TargetCost:
    """The target's decode and verify step times: the simulator's cost model, refitted from
    the start-up records plus the engine's most recent ``window`` steps."""

    model: ModelSpec
    startup: list[Record]
    window: int = 256
    base: HardwareSpec = field(default_factory=lambda: load_hardware(BASE_PROFILE))
    recent: deque = field(default_factory=deque)
    cost: StepCostModel = field(init=False)

    def __post_init__(self) -> None:
        self.refit()

    def refit(self) -> None:
        records = [*self.startup, *self.recent]
        hw = fit_records(self.model, records, self.base, "engine-fitted")
        self.cost = StepCostModel(self.model, hw)

    def observe(self, record: Record) -> None:
        self.recent.append(record)
        while len(self.recent) > self.window:
            self.recent.popleft()

    def predict(self, rows: int, k: int, context: float) -> float:
        """Seconds of the target's part of a step: decode (k = 0) or verify of k + 1 tokens."""
        c = self.cost
        if k == 0:
            return c.decode(rows, context)
        return c.hw.step_overhead_s + c.verify(rows, k, context)


@dataclass
class SpecController:
    """Chooses k per step (module docstring); ``observe`` feeds back each step's outcome."""

    k_max: int
    target: TargetCost
    explore_share: float = 0.02
    min_tries: int = 4
    refit_every: int = 16
    acceptance: Acceptance = field(init=False)
    draft: DraftCost = field(default_factory=DraftCost)
    budget: float = 0.0  # seconds of exploration the controller may still spend
    steps: int = 0
    explored: int = 0  # steps run at k_max to measure acceptance
    # (rows, k, predicted s, measured s) of recent steps, the prediction made before each ran
    predictions: deque = field(default_factory=lambda: deque(maxlen=4096))

    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.k_max)

    def predict(self, rows: int, k: int, context: float) -> float:
        """Predicted seconds of a step of ``rows`` rows drafting ``k`` tokens (0 = plain)."""
        return self.draft.predict(rows, k) + self.target.predict(rows, k, context)

    def rates(self, rows: int, context: float) -> list[float]:
        """Expected emitted tokens per second for k = 0..k_max."""
        acc = self.acceptance
        return [
            rows * acc.emitted(k) / max(self.predict(rows, k, context), 1e-9)
            for k in range(self.k_max + 1)
        ]

    def choose(self, rows: int, context: float) -> int:
        """Draft tokens for the next step (0 = plain), exploring k_max within the budget."""
        rates = self.rates(rows, context)
        best = int(np.argmax(rates))
        t_best = self.predict(rows, best, context)
        self.budget += self.explore_share * t_best
        if best == self.k_max or self.acceptance.tries[-1] >= self.min_tries:
            return best
        extra = max(self.predict(rows, self.k_max, context) - t_best, 0.0)
        if extra > self.budget:
            return best
        self.budget -= extra
        self.explored += 1
        return self.k_max

    def observe(
        self,
        rows: int,
        k: int,
        context: float,
        step_s: float,
        draft_s: float,
        accepted: list[int],
    ) -> None:
        """One finished step: its shape, wall time (drafting included) and accepted drafts per
        row (empty for a plain step)."""
        self.predictions.append((rows, k, self.predict(rows, k, context), step_s))
        self.acceptance.observe(k, accepted)
        if k:
            self.draft.observe(rows, k, draft_s)
        kind, tokens = ("verify", k + 1) if k else ("decode", 1)
        self.target.observe(Record(rows, tokens, context, step_s - draft_s, kind))
        self.steps += 1
        if self.steps % self.refit_every == 0:
            self.target.refit()


def start_controller(model: torch.nn.Module, k_max: int, max_batch: int) -> SpecController:
    """A controller for ``model`` after timing its forwards at ``calibration_shapes``."""
    records = measure_forwards(model, calibration_shapes(max_batch, k_max))
    return SpecController(k_max, TargetCost(model_spec(model), records))
