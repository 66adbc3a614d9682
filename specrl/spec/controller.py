"""Speculation controller: per decode step, the number of draft tokens that maximises tokens/s.

``SpecController(k_max, target_cost)`` answers ``choose(rows, context) -> k`` (0 <= k <= k_max,
0 = a plain step) by maximising expected emitted tokens per second from three estimates that
``observe`` refreshes after every step: the target's step times (``costmodel.cost`` over a
profile fitted by ``costmodel.fit``, the simulator's model and fit, seeded by
``measure_forwards``; an MoE target's routing measured by ``measure_popularity`` prices the
unique experts a verify touches), the drafter's time, and per-position acceptance and coverage.
Speculation must beat a plain step by ``margin``; untried depths are explored within an
``explore_share`` budget. Decisions depend on measured times, so "distribution" runs reproduce
in distribution ("sample" exactness: token for token).
Details: docs/internals.md.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.fit import Record, design, features, fit_design, nnls
from specrl.costmodel.specs import HardwareSpec, ModelSpec, load_hardware
from specrl.models.device import model_device, synchronize
from specrl.models.moe import Routing

BASE_PROFILE = "cpu-2core"  # its peaks only convert fitted rates to efficiencies


def model_spec(model: torch.nn.Module, popularity: tuple[float, ...] = ()) -> ModelSpec:
    """The cost model's description of a ``specrl.models.transformer.Transformer``
    (``popularity``: an MoE's measured routing, ``measure_popularity``)."""
    c = model.config
    params = float(sum(p.numel() for p in model.parameters()))
    moe = {}
    if c.is_moe:  # a shared expert counted in experts of the routed width
        shared = round(c.shared_expert_intermediate_size / c.moe_intermediate_size)
        moe = dict(experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
                   shared_experts=shared, moe_layers=len(c.moe_layers),
                   moe_intermediate=c.moe_intermediate_size,
                   expert_popularity=popularity)  # fmt: skip
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
        params_active=params - (c.num_parameters() - c.num_parameters(active=True)),
        **moe,
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
    device = model_device(model)
    records = []
    for b, t in shapes:
        ids = random_ids(model, b, t)  # [b, t]: an MoE routes them apart, as text
        positions = context + torch.arange(t, device=device)[None, :].expand(b, t)  # [b, t]
        model(ids, positions, cache, kv_len=context + t)  # warm-up
        synchronize(device)
        t0 = time.perf_counter()
        model(ids, positions, cache, kv_len=context + t)
        synchronize(device)
        kind = "decode" if t == 1 else "verify"
        records.append(Record(b, t, float(context), time.perf_counter() - t0, kind))
    return records


def random_ids(model: torch.nn.Module, rows: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids [rows, tokens] on the model's device."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=g)
    return ids.to(model_device(model))


@torch.inference_mode()
def measure_popularity(model: torch.nn.Module, tokens: int = 512) -> tuple[float, ...]:
    """An MoE's routing of ``tokens`` random tokens in one forward: per expert the share of
    tokens that pick it, averaged over the MoE layers (summing to top-k); () for a dense
    model."""
    if not model.config.is_moe:
        return ()
    routing = Routing(record=True)
    ids = random_ids(model, 1, tokens, seed=1)
    model(ids, torch.arange(tokens, device=ids.device)[None], routing=routing)
    load = torch.stack(routing.load).double().mean(0) / tokens  # [E]
    return tuple(load.tolist())


@dataclass
class Acceptance:
    """Decayed counts, per draft position, of rows that drafted it and rows that accepted it."""

    k_max: int
    decay: float = 0.995  # per observed step: the evidence of ~200 steps
    counts: np.ndarray = field(init=False)  # [3, k_max] the three below, decayed at once
    asks: np.ndarray = field(init=False)  # [k_max] rows asked for a draft at the position
    tries: np.ndarray = field(init=False)  # [k_max] rows that drafted it
    hits: np.ndarray = field(init=False)  # [k_max] rows that accepted it

    def __post_init__(self) -> None:
        self.counts = np.zeros((3, self.k_max))
        self.asks, self.tries, self.hits = self.counts  # views of its rows

    def observe(self, drafted: list[int], accepted: list[int], asked: int | None = None) -> None:
        """A step whose rows were asked for ``asked`` drafts (default: as many as they
        drafted), drafted ``drafted`` [rows] and accepted ``accepted`` [rows] of them (both
        empty for a plain step)."""
        self.counts *= self.decay
        if not drafted:
            return
        pos = np.arange(self.k_max)[None, :]  # [1, k_max]
        drafted_at = (np.asarray(drafted)[:, None] > pos).sum(0)
        self.asks += drafted_at if asked is None else len(drafted) * (pos[0] < asked)
        self.tries += drafted_at
        self.hits += (np.asarray(accepted)[:, None] > pos).sum(0)

    def coverage(self) -> np.ndarray:
        """P(a row drafts position i when asked) for i = 1..k_max [k_max] (0 if never asked)."""
        return np.divide(self.tries, self.asks, out=np.zeros(self.k_max), where=self.asks > 0)

    def reach(self) -> np.ndarray:
        """P(accepted >= i | drafted >= i) for i = 1..k_max [k_max], non-increasing (0 where
        never drafted)."""
        p = np.divide(self.hits, self.tries, out=np.zeros(self.k_max), where=self.tries > 0)
        return np.minimum.accumulate(p)

    def emitted(self, k: int) -> float:
        """Expected tokens a row emits in a step that drafts ``k`` tokens for it."""
        return 1.0 + float(self.reach()[:k].sum())

    def emitted_rows(self, lengths: np.ndarray, cap: int) -> float:
        """Expected tokens all rows emit when row r verifies min(cap, lengths[r]) drafts."""
        cum = np.concatenate([[0.0], np.cumsum(self.reach())])  # [k_max + 1]
        return float(len(lengths) + cum[np.minimum(lengths, cap)].sum())


@dataclass
class DraftCost:
    """The drafter's seconds per step from its recent steps: rates per [1, k, rows, k * rows,
    positions caught up] (a feature that stays 0, as for model-free drafters, gets rate 0).
    Until ``full_after`` steps are in, only the per-draft-token and caught-up rates are fitted:
    five rates from two or three steps are noise (a first fit from two explored steps priced a
    0.6 ms head step at 6.5 ms, and speculation was then never chosen). From then on the rates
    are refitted once per ``refit_every`` steps: a fit per step was the controller's largest
    cost (~0.45 ms of a ~11 ms batch-1 step), and a window of 64 steps moves little in 8."""

    window: int = 64
    full_after: int = 8
    refit_every: int = 8
    records: deque = field(default_factory=deque)  # (features [5], seconds)
    coef: np.ndarray = field(default_factory=lambda: np.zeros(5))
    seen: int = 0  # steps observed

    @staticmethod
    def features(rows: int, k: int, caught_up: float = 0.0) -> np.ndarray:
        return np.array([1.0, k, rows, k * rows, caught_up], dtype=float)

    def observe(self, rows: int, k: int, seconds: float, caught_up: float = 0.0) -> None:
        self.records.append((self.features(rows, k, caught_up), seconds))
        while len(self.records) > self.window:
            self.records.popleft()
        self.seen += 1
        if self.seen > self.full_after and self.seen % self.refit_every:
            return
        x = np.stack([f for f, _ in self.records])
        if len(self.records) < self.full_after:
            x = x * np.array([0.0, 0.0, 0.0, 1.0, 1.0])  # dropped columns get rate 0
        self.coef = nnls(x, np.array([s for _, s in self.records]))

    def predict(self, rows: int, k: int, caught_up: float = 0.0) -> float:
        return 0.0 if k == 0 else float(self.features(rows, k, caught_up) @ self.coef)


def context_line(fn: Callable[[float], Any]) -> tuple[Any, Any]:
    """(fn(0), fn(1) - fn(0)): a function affine in the context, as the line it is."""
    at0 = fn(0.0)
    return at0, fn(1.0) - at0


@dataclass
class TargetCost:
    """The target's decode and verify step times: the cost model the simulator prices steps
    with (``specrl.costmodel``), refitted from the start-up records plus the engine's most
    recent ``window`` steps.

    Each record's cost-model features are computed once, when it arrives, and the prices are
    kept per (rows, k) as an affine function of the context (the cost model's bytes and FLOPs
    are affine in it), so a step's choice costs a few multiplications, not a cost-model
    evaluation per k (~0.3 ms of a ~12 ms step at batch 1 in the engine)."""

    model: ModelSpec
    startup: list[Record]
    window: int = 256
    base: HardwareSpec = field(default_factory=lambda: load_hardware(BASE_PROFILE))
    recent: deque = field(default_factory=deque)  # (features [FEATURES], shape, seconds) of steps
    cost: StepCostModel = field(init=False)
    _startup_x: np.ndarray = field(init=False)  # [n, FEATURES] features of the start-up records
    _affine: dict = field(default_factory=dict)  # (rows, k) -> (seconds at 0, per context)
    _lines: dict = field(default_factory=dict)  # (rows, tokens, kind) -> features at 0, per ctx

    def __post_init__(self) -> None:
        self._startup_x = design(self.model, self.startup)[0]
        self.refit()

    def refit(self) -> None:
        """Fit the start-up and recent records, every forward shape (rows, tokens per row)
        weighing as much as any other however many steps had it: a run's steps are mostly one
        shape (256 plain steps of one row, say), and unweighted they decide the fit alone,
        along the one direction they span (a fit that priced a 4-token verify of one row at
        4x its plain step, where it costs ~1.1x, and speculation was never chosen)."""
        shapes = [(r.batch_size, r.tokens_per_seq) for r in self.startup]
        shapes += [shape for _, shape, _ in self.recent]
        x = np.vstack([self._startup_x, *(f for f, _, _ in self.recent)])  # [n, FEATURES]
        y = np.array([r.step_time_s for r in self.startup] + [t for _, _, t in self.recent])
        count = Counter(shapes)
        weights = np.array([1.0 / count[shape] for shape in shapes])  # [n]
        self.cost = StepCostModel(self.model, fit_design(x, y, self.base, "engine-fitted", weights))
        self._affine.clear()

    def observe(self, record: Record) -> None:
        """Keep a step's features (affine in its context, kept per shape as for the prices)."""
        key = (record.batch_size, record.tokens_per_seq, record.kind)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = context_line(
                lambda c: features(self.model, replace(record, context_len=c))  # [FEATURES]
            )
        x = line[0] + line[1] * record.context_len  # [FEATURES]
        self.recent.append((x, key[:2], record.step_time_s))
        while len(self.recent) > self.window:
            self.recent.popleft()

    def predict(self, rows: int, k: int, context: float) -> float:
        """Seconds of the target's part of a step: decode (k = 0) or verify of k + 1 tokens."""
        line = self._affine.get((rows, k))
        if line is None:
            line = self._affine[rows, k] = context_line(lambda c: self.price(rows, k, c))
        return line[0] + line[1] * context

    def price(self, rows: int, k: int, context: float) -> float:
        """``predict`` straight from the cost model."""
        c = self.cost
        if k == 0:
            return c.decode(rows, context)
        return c.hw.step_overhead_s + c.verify(rows, k, context)


@dataclass(frozen=True)
class StepOutcome:
    """What the engine reports after a step: its shape, times and per-row drafts."""

    rows: int
    asked: int  # draft tokens asked of the drafter (0: a plain step)
    verified: int  # draft positions in the verify forward (its width - 1)
    context: float  # mean tokens cached per row
    step_s: float  # wall seconds of the whole step, drafting included
    draft_s: float
    drafted: list[int] = field(default_factory=list)  # [rows] drafts verified per row
    accepted: list[int] = field(default_factory=list)  # [rows]
    caught_up: int = 0  # positions the drafter read before drafting (all rows)


class Plan(NamedTuple):
    """One evaluation of the rates, serving the next choices at the same number of rows."""

    rows: int
    k: int  # the choice without exploring
    step_s: float  # its predicted seconds (each choice it serves adds a share to the budget)
    left: int  # further choices it serves


@dataclass
class SpecController:
    """Chooses k per step (docs/internals.md); ``observe`` feeds back each step's outcome.

    ``cheap_drafts`` (a deterministic drafter: n-gram, suffix): every step drafts ``k_max``
    (``choose``), and ``cap`` then decides, seeing each row's draft length, how many of them
    the verify forward takes (rows without a draft cost nothing to verify)."""

    k_max: int
    target: TargetCost
    cheap_drafts: bool = False
    explore_share: float = 0.02
    margin: float = 0.05  # speculate only where it is expected to be this much faster
    min_tries: int = 4
    refit_every: int = 16
    replan_every: int = 8  # choices one evaluation of the rates serves while the rows stay
    acceptance: Acceptance = field(init=False)
    draft: DraftCost = field(default_factory=DraftCost)
    budget: float = 0.0  # seconds of exploration the controller may still spend
    steps: int = 0
    explored: int = 0  # steps that verified more than the estimates asked, to measure them
    exploring: bool = False  # the step chosen last explores: its overrun is charged (observe)
    # (rows, verified k, predicted s, measured s) of recent steps, the prediction made first
    predictions: deque = field(default_factory=lambda: deque(maxlen=4096))
    _plan: Plan | None = None  # the last evaluation of the rates (``choose``)

    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.k_max)

    def predict(
        self,
        rows: int,
        k: int,
        context: float,
        asked: int | None = None,
        caught_up: float | None = None,
    ) -> float:
        """Predicted seconds of a step of ``rows`` rows verifying ``k`` drafts (0 = plain),
        drafting ``asked`` (default ``k``) of them after catching up ``caught_up`` positions
        (default: steady speculation's, the tokens such a step emits)."""
        asked = k if asked is None else asked
        if caught_up is None:
            caught_up = rows * self.acceptance.emitted(k)
        drafting = self.draft.predict(rows, asked, caught_up)
        return drafting + self.target.predict(rows, k, context)

    def rates(self, rows: int, context: float) -> list[float]:
        """Expected emitted tokens per second for k = 0..k_max, every row drafting k."""
        acc = self.acceptance
        return [
            rows * acc.emitted(k) / max(self.predict(rows, k, context), 1e-9)
            for k in range(self.k_max + 1)
        ]

    def capped_rates(self, rows: int, context: float) -> list[float]:
        """Cheap drafts: expected tokens per second of a plain step (index 0) and of drafting
        k_max then verifying at most c drafts per row (index c), rows drafting position i with
        the measured coverage c_i: the verify forward reaches position i when any row drafted
        it, with probability 1 - (1 - c_i)^rows (the cost model's ``draft_coverage`` term)."""
        acc = self.acceptance
        cov = acc.coverage()
        gain = np.cumsum(acc.reach() * cov)  # [k_max] expected accepted drafts per row
        wide = 1.0 - (1.0 - cov) ** rows  # [k_max] P(the forward verifies position i)
        t = [self.target.predict(rows, c, context) for c in range(self.k_max + 1)]
        extra = np.cumsum(wide * np.diff(t))  # [k_max] expected verify time beyond a plain one
        drafting = self.draft.predict(rows, self.k_max)
        return [rows / max(t[0], 1e-9)] + [
            rows * (1.0 + gain[c]) / max(drafting + t[0] + extra[c], 1e-9)
            for c in range(self.k_max)
        ]

    def choose(self, rows: int, context: float) -> int:
        """Draft tokens to ask for in the next step (0 = plain), exploring k_max within the
        budget. With cheap drafts: k_max (``cap`` decides after the draft) unless no k is
        expected to pay even where rows draft as often as they have (then a plain step: no
        drafting cost either).

        The rates are evaluated once per ``replan_every`` choices at the same number of rows
        (and after every refit): the estimates move little from one step to the next, and an
        evaluation in every step cost ~1.5% of a batch-1 step. The choices in between repeat the
        choice made without exploring (exploring waits for the next evaluation) and add its
        share to the exploration budget."""
        plan = self._plan
        if plan is not None and plan.rows == rows and plan.left > 0:
            self._plan = plan._replace(left=plan.left - 1)
            self.budget += self.explore_share * plan.step_s
            return plan.k
        rates = (self.capped_rates if self.cheap_drafts else self.rates)(rows, context)
        best = self._best(rates)
        if self.cheap_drafts and best > 0:
            self._plan = Plan(rows, self.k_max, 0.0, self.replan_every - 1)
            return self.k_max
        t_best = self._accrue(rows, context, best)
        self._plan = Plan(rows, best, t_best, self.replan_every - 1)
        if self.cheap_drafts:
            return self._explore_drafts(rows, context, t_best)
        return self._explore(rows, context, best, self.k_max, t_best)

    def _explore_drafts(self, rows: int, context: float, t_plain: float) -> int:
        """Cheap drafts, no k expected to pay: k_max (drafts for ``cap`` to explore) when
        position k_max is under-measured and the budget holds what drafting and verifying them
        would add to a plain step (``t_plain``), else 0. Only the drafting is charged here:
        ``cap`` charges the verify it explores, seeing which rows drafted."""
        if self.acceptance.tries[-1] >= self.min_tries:
            return 0
        if self.predict(rows, self.k_max, context) - t_plain > self.budget:
            return 0
        self.budget -= self.draft.predict(rows, self.k_max)
        return self.k_max

    def cap(self, rows: int, context: float, lengths: list[int]) -> int:
        """With cheap drafts: the most drafts per row the verify forward takes, given each
        row's draft length, for the most expected tokens per second (the draft is paid)."""
        lens = np.asarray(lengths)
        longest = int(lens.max()) if len(lens) else 0
        acc = self.acceptance
        rates = [
            acc.emitted_rows(lens, c) / max(self.target.predict(rows, c, context), 1e-9)
            for c in range(longest + 1)
        ]
        best = self._best(rates)
        t_best = self._accrue(rows, context, best, self.k_max)
        return self._explore(rows, context, best, longest, t_best, self.k_max)

    def _best(self, rates: list[float]) -> int:
        """The k of the highest rate, but 0 unless speculating is expected to beat a plain step
        by ``margin``: a drafter near break-even gains nothing, and a few percent of prediction
        error make it lose."""
        best = int(np.argmax(rates))
        return best if rates[best] > rates[0] * (1.0 + self.margin) else 0

    def _accrue(self, rows: int, context: float, best: int, asked: int | None = None) -> float:
        """The predicted seconds of a step verifying ``best`` (``asked``: drafts already asked
        of the drafter, else as many as verified); ``explore_share`` of them join the budget."""
        t_best = self.predict(rows, best, context, asked)
        self.budget += self.explore_share * t_best
        return t_best

    def _explore(
        self,
        rows: int,
        context: float,
        best: int,
        widest: int,
        t_best: float,
        asked: int | None = None,
    ) -> int:
        """``best`` (predicted ``t_best`` seconds), or ``widest`` when position ``widest`` is
        under-measured (fewer than ``min_tries`` rows drafted it: rows asked for a draft they did
        not have measure coverage, not acceptance) and the budget (``_accrue``) pays its
        predicted extra time."""
        acc = self.acceptance
        measured = acc.tries[widest - 1] if widest else 0.0
        if widest <= best or measured >= self.min_tries:
            return best
        extra = max(self.predict(rows, widest, context, asked) - t_best, 0.0)
        if extra > self.budget:
            return best
        self.budget -= extra
        self.explored += 1
        self.exploring = True
        return widest

    def observe(self, out: StepOutcome) -> None:
        """One finished step (``StepOutcome``)."""
        predicted = self.predict(out.rows, out.verified, out.context, out.asked, out.caught_up)
        self.predictions.append((out.rows, out.verified, predicted, out.step_s))
        if self.exploring:  # what exploring took beyond its price is paid from the budget too
            self.budget -= max(out.step_s - predicted, 0.0)
            self.exploring = False
        self.acceptance.observe(out.drafted, out.accepted, out.asked if out.asked else None)
        if out.asked:
            self.draft.observe(out.rows, out.asked, out.draft_s, out.caught_up)
        k = out.verified
        kind, tokens = ("verify", k + 1) if out.asked else ("decode", 1)
        seconds = out.step_s - out.draft_s
        self.target.observe(Record(out.rows, tokens, out.context, seconds, kind))
        self.steps += 1
        if self.steps % self.refit_every == 0:
            self.target.refit()
            self._plan = None


def start_controller(
    model: torch.nn.Module, k_max: int, max_batch: int, cheap_drafts: bool = False
) -> SpecController:
    """A controller for ``model`` after timing its forwards at ``calibration_shapes``."""
    records = measure_forwards(model, calibration_shapes(max_batch, k_max))
    spec = model_spec(model, measure_popularity(model))
    return SpecController(k_max, TargetCost(spec, records), cheap_drafts)
