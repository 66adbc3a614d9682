"""Training a learned drafter (head or draft model) during RL, on the steps' own rollouts.

``OnlineDrafter(student, cfg, mode, fresh, seed)`` trains ``student`` (``drafters.students``)
on features the learner's training forward captures (``capture_layers()``: no extra forward).
``step(captured, signals)`` (once per RL step) measures the drafter's KL to the policy on the
fresh tokens, buffers them, and in mode "online" (every step) or "refresh" (when ``Trigger``
fires) spends a time budget of ``cfg.time_share`` x the step's time on optimizer steps; it
returns ``DrafterUpdate`` (metrics, and the tensors to push when it trained). ``context_note``
warns when rollouts outrun the drafter's training length; ``save`` / ``load`` checkpoint it.
Details: docs/internals.md.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specrl.config import DrafterCfg
from specrl.drafters.data import Example
from specrl.drafters.students import Student
from specrl.drafters.train import load_state, save_state
from specrl.fsutil import atomic_write
from specrl.models.device import autocast, model_device
from specrl.rl import Captured

CARRY_STEPS = 4  # unused budget carries over up to this many steps' worth
KL_DRIFT_UP = 1.02  # the KL level rises this much per step it is not beaten
MIN_DRAFTS = 32  # drafting rows that make a step's acceptance evidence
ACCEPT_DECAY = 0.8  # EMA weight of the running acceptance level


@dataclass
class StepSignals:
    """What the pipeline measured this step: its time so far (rollout + learner), the policy
    version after the update, the draft acceptance rate and how many rows drafted."""

    step_s: float
    version: int
    accept_rate: float = 0.0
    drafting_rows: int = 0


@dataclass
class Trigger:
    """Refresh decisions from measured drift (see docs/internals.md)."""

    tolerance: float
    max_lag: int
    kl_level: float | None = None
    accept_level: float | None = None
    trained_version: int | None = None
    trained_kl: float | None = None  # the fresh KL of the last step that trained

    def why(self, kl: float, signals: StepSignals) -> str:
        """The reason to train now ('' = none); updates the levels."""
        reason = ""
        if self.trained_version is None:
            reason = "cold"
        elif self._improving(kl):
            reason = "improving"
        elif self.kl_level is not None and kl > (1 + self.tolerance) * self.kl_level:
            reason = "kl"
        elif self._accept_fell(signals):
            reason = "acceptance"
        elif signals.version - self.trained_version >= self.max_lag:
            reason = "lag"
        self.kl_level = kl if self.kl_level is None else min(kl, self.kl_level * KL_DRIFT_UP)
        if signals.drafting_rows >= MIN_DRAFTS and reason != "acceptance":
            rate, level = signals.accept_rate, self.accept_level
            ema = rate if level is None else ACCEPT_DECAY * level + (1 - ACCEPT_DECAY) * rate
            self.accept_level = ema
        return reason

    def _improving(self, kl: float) -> bool:
        """Training pays: the KL fell by more than the tolerance since the last training."""
        return self.trained_kl is not None and kl < (1 - self.tolerance) * self.trained_kl

    def _accept_fell(self, signals: StepSignals) -> bool:
        level = self.accept_level
        enough = signals.drafting_rows >= MIN_DRAFTS and level is not None
        return enough and signals.accept_rate < (1 - self.tolerance) * level


@dataclass
class DrafterUpdate:
    """One step's drafter metrics and, when it trained, the tensors to push."""

    metrics: dict[str, Any]
    state: dict[str, torch.Tensor] | None = None
    version: int = 0


@dataclass
class _Ledger:
    """Counters that go into a checkpoint besides the optimizer."""

    version: int = 0
    updates: int = 0
    budget_s: float = 0.0
    update_s: float | None = None  # measured seconds per optimizer step (EMA)
    full: bool = False  # the budget reached its carry cap this step (it can grow no further)
    trained_len: int = 0
    last_loss: float = 0.0
    losses: list[float] = field(default_factory=list)


class OnlineDrafter:
    """See docs/internals.md."""

    def __init__(
        self, student: Student, cfg: DrafterCfg, mode: str, fresh: bool, seed: int = 0
    ) -> None:
        if mode not in ("online", "refresh"):
            raise ValueError(f"drafter mode must be 'online' or 'refresh', got {mode!r}")
        self.student, self.cfg, self.mode, self.fresh, self.seed = student, cfg, mode, fresh, seed
        self.model = model = student.module  # the trained module (float32 master weights)
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0
        )
        self.buffer: deque[list[Example]] = deque(maxlen=cfg.buffer_steps)
        self.trigger = Trigger(cfg.drift_tolerance, cfg.max_lag)
        self.ledger = _Ledger()
        model.eval()

    # ------------------------------------------------------------------ the learner's side

    def capture_layers(self) -> tuple[int, ...]:
        """The layers the learner's training forward should capture for this drafter."""
        return tuple(self.student.layers)

    def state(self) -> dict[str, torch.Tensor]:
        """The drafter's tensors as ``update_drafter`` takes them (detached)."""
        return self.student.state()

    # ------------------------------------------------------------------ one RL step

    def step(self, captured: list[Captured], signals: StepSignals) -> DrafterUpdate:
        """See docs/internals.md."""
        t0 = time.perf_counter()
        self.student.follow()  # what the drafter shares with the policy, as it moved
        examples = [Example(c.tokens, c.prompt_len, c.feats, c.final) for c in captured]
        examples = [e for e in examples if len(e.tokens) - e.prompt_len >= 1]
        if self.fresh and self.ledger.updates == 0 and examples:
            self._pick_vocab(examples)
        if examples:
            self.buffer.append(examples)
        share = self.cfg.time_share * signals.step_s
        ledger = self.ledger
        ledger.full = ledger.budget_s + share >= CARRY_STEPS * share
        ledger.budget_s = min(ledger.budget_s + share, CARRY_STEPS * share)
        measure = examples and (ledger.budget_s > 0 or ledger.updates == 0)
        kl = self.fresh_kl(examples) if measure else math.nan  # drafter time: paid from the budget
        reason = self._reason(kl, signals)
        ledger.budget_s -= time.perf_counter() - t0
        t1 = time.perf_counter()
        updates = self._train(self._affordable()) if reason and self.buffer else []
        ledger.budget_s -= time.perf_counter() - t1
        if updates:
            ledger.version += 1
            self.trigger.trained_version, self.trigger.trained_kl = signals.version, kl
            ledger.last_loss = sum(updates) / len(updates)
        spent = time.perf_counter() - t0
        metrics = {
            "drafter_kl": None if math.isnan(kl) else kl,
            "drafter_loss": ledger.last_loss,
            "drafter_updates": len(updates),
            "drafter_train_s": spent,
            "drafter_version": ledger.version,
            "drafter_trigger": reason if updates else "",
            "drafter_trained_len": ledger.trained_len,
        }
        state = self.state() if updates else None
        return DrafterUpdate(metrics, state, ledger.version)

    def _reason(self, kl: float, signals: StepSignals) -> str:
        if math.isnan(kl):  # not measured (the budget is spent): no levels move
            return "online" if self.mode == "online" else ""
        why = self.trigger.why(kl, signals)  # online: keeps the levels current for the metrics
        return "online" if self.mode == "online" else why

    def _affordable(self) -> int:
        """Optimizer steps the budget pays for in full at their measured cost (unused budget
        carries over), at most ``cfg.max_updates``; one while that cost is still unmeasured,
        and one on credit when the budget is full (at its carry cap) yet short of one update:
        its debt is repaid from the next steps' shares, so training goes on at the share on
        average instead of stopping for good once an update costs more than the cap holds."""
        per, ledger = self.ledger.update_s, self.ledger
        if per is None:
            return 1
        n = int(ledger.budget_s / per)
        if n == 0 and ledger.full and ledger.budget_s > 0:
            n = 1
        return max(0, min(self.cfg.max_updates, n))

    def _pick_vocab(self, examples: list[Example]) -> None:
        """A head trained from scratch drafts from the step's most frequent tokens."""
        self.student.pick_vocab(examples, self.cfg.vocab)

    # ------------------------------------------------------------------ training

    def _train(self, n: int) -> list[float]:
        """``n`` optimizer steps on mini-batches from the buffer; their losses."""
        losses = []
        frozen = self.student.frozen()
        for p in frozen:  # the policy's shared embedding / LM head get no gradient here
            p.requires_grad_(False)
        self.model.train()
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                losses.append(self._update(self._batch()))
                took = time.perf_counter() - t0
                per = self.ledger.update_s
                self.ledger.update_s = took if per is None else 0.5 * per + 0.5 * took
        finally:
            self.model.eval()
            for p in frozen:
                p.requires_grad_(True)
        return losses

    def _batch(self) -> list[Example]:
        """About ``batch_tokens`` tokens of examples from the buffer (seeded by the update)."""
        pool = [e for step in self.buffer for e in step]
        random.Random(self.seed * 1_000_003 + self.ledger.updates).shuffle(pool)
        return take_tokens(pool, self.cfg.batch_tokens)

    def _update(self, batch: list[Example]) -> float:
        longest = max(len(e.tokens) for e in batch)
        with autocast(model_device(self.model), True):
            loss = self.student.loss(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        ledger = self.ledger
        ledger.updates += 1
        ledger.trained_len = max(ledger.trained_len, longest)
        ledger.losses.append(float(loss.detach()))
        return ledger.losses[-1]

    def fresh_kl(self, examples: list[Example]) -> float:
        """Mean KL(policy || drafter) at draft depth 0 over the completion positions of up to
        ``batch_tokens`` tokens of ``examples`` (for a head: the policy restricted to the draft
        vocabulary, as the loss sees it)."""
        with autocast(model_device(self.model), True):
            return self.student.kl(take_tokens(examples, self.cfg.batch_tokens))

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: Path) -> list[Path]:
        """Write the drafter + optimizer (``path``) and the counters (``path`` + .json)."""
        save_state(path, self.model, self.opt, self.ledger.updates, self.ledger.losses)
        meta = {
            "ledger": asdict(self.ledger) | {"losses": []},
            "trigger": asdict(self.trigger),
            "student": self.student.meta(),
        }
        side = path.with_name(path.name + ".json")
        atomic_write(side, json.dumps(meta))
        return [path, side]

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote (``ValueError`` naming the file when it does not fit)."""
        side = path.with_name(path.name + ".json")
        try:
            meta = json.loads(side.read_text())
            older = "student" not in meta  # written before draft models trained online
            self.student.load_meta({"d2t": meta["d2t"]} if older else meta["student"])
            ledger, trigger = _Ledger(**meta["ledger"]), Trigger(**meta["trigger"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read drafter state {side}: {e}") from None
        updates, losses = load_state(path, self.model, self.opt)
        self.student.follow()  # the restored policy's shared parts (not in the file)
        self.ledger, self.trigger = ledger, trigger
        self.ledger.updates, self.ledger.losses = updates, losses


def take_tokens(examples: list[Example], budget: int) -> list[Example]:
    """The leading examples that fit ``budget`` tokens (at least one)."""
    batch, tokens = [], 0
    for e in examples:
        if batch and tokens + len(e.tokens) > budget:
            break
        batch.append(e)
        tokens += len(e.tokens)
    return batch


def context_note(trained_len: int, lengths: list[int]) -> str | None:
    """A one-line warning when sequences (prompt + completion lengths ``lengths``) run past
    ``trained_len``, the longest the drafter has trained on (0 = unknown: no warning)."""
    over = [n for n in lengths if n > trained_len]
    if trained_len <= 0 or not over:
        return None
    return (
        f"drafter context: {len(over)} of {len(lengths)} rollouts run past the {trained_len} "
        f"tokens the drafter was trained on (up to {max(over)}); acceptance may collapse there "
        "(drafter.mode='online' or 'refresh' trains on them)"
    )
