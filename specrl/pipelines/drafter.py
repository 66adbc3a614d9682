"""The learned drafter's side of a run: training it during RL and watching its context length.

``build_drafter_side(cfg, plan, policy, backend, guard)``: ``None`` when the drafter learns
nothing (none, ngram, suffix, self), else a ``DrafterSide``: with the plan's ``training_mode``
on, an ``OnlineDrafter`` over the drafter the backend loaded (or a fresh one), pushed at once as
drafter version 0 through the guard; a frozen drafter keeps only its training length.
A saved drafter that is not a head (a draft model, a head in vLLM's EAGLE-3 layout) is checked
against its manifest here (``models.heads.verify_drafter``; damage: ``ConfigError`` 'bad value
for rollout.drafter_path: DIR/model.safetensors: sha256 mismatch'; one made before checksums: a
``notice:`` line on stderr); a head is checked by ``load_head`` wherever it loads.
``drafter_fields(side, guard, backend, idle, version, comps, rollout, captured, step_s)`` (in
``learn``): one ``OnlineDrafter.step`` within its time budget, a trained drafter pushed through
the guard, and ``drafter_warning`` when rollouts first run past the training length.
Details: docs/internals.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specrl.backends import RolloutBackend
from specrl.config import Config
from specrl.drafters.distill import SPEC_FILE, untrained_draft
from specrl.drafters.export import import_eagle3, is_eagle3_export, is_head_dir
from specrl.drafters.online import OnlineDrafter, StepSignals, context_note
from specrl.drafters.students import student_for
from specrl.models.head_kinds import fresh_head, load_head
from specrl.models.heads import MODEL_FILES, notice, read_head_config, verify_drafter
from specrl.pipelines.guard import WeightGuard
from specrl.rl import Captured
from specrl.rollout_plan import RolloutPlan, refusing
from specrl.rollout_types import Completion
from specrl.spec.proposers import head_kind, proposer_takes


@dataclass
class DrafterSide:
    """The trainer (None: a frozen head) and the longest sequence the head has trained on."""

    trainer: OnlineDrafter | None
    trained_len: int = 0
    warned: bool = False

    def capture_layers(self) -> tuple[int, ...] | None:
        """The layers the learner's training forward captures for the trainer (None: none)."""
        return None if self.trainer is None else self.trainer.capture_layers()


def build_drafter_side(
    cfg: Config,
    plan: RolloutPlan,
    policy: torch.nn.Module,
    backend: RolloutBackend,
    guard: WeightGuard,
) -> DrafterSide | None:
    """See the module docstring (``cfg``: the drafter's training settings and the seed)."""
    if not plan.learned_drafter:
        return None
    mode, path = plan.training_mode, plan.drafter_dir
    if path is not None and not is_head_dir(path):
        with refusing("rollout.drafter_path"):
            unverified = verify_drafter(path, MODEL_FILES)
        if unverified is not None:
            notice(unverified)
    known = _trained_len(path) if path else 0
    if mode is None:
        return DrafterSide(None, known)
    student = student_for(_initial_drafter(plan, cfg.run.seed, policy), policy)
    trainer = OnlineDrafter(student, cfg.drafter, mode, fresh=path is None, seed=cfg.run.seed)
    trainer.ledger.trained_len = known
    guard.push_drafter(backend, trainer.state(), 0)
    return DrafterSide(trainer, known)


def _initial_drafter(plan: RolloutPlan, seed: int, policy: torch.nn.Module) -> torch.nn.Module:
    """The float32 drafter the trainer starts from: the saved one at ``plan.drafter_dir`` (a
    head in vLLM's EAGLE-3 layout read back by ``drafters.export.import_eagle3``), else a draft
    model's untrained start (``drafters.distill.untrained_draft``, as the engine builds it) or a
    random head seeded by ``seed`` (``run.seed``) in the plan's head layout and vocabulary size
    (``models.head_kinds.fresh_head``, as the vLLM backend writes it)."""
    spec, path = plan.spec.method, plan.drafter_dir
    if proposer_takes(spec, "draft_model"):
        if path is None:
            return untrained_draft(policy, torch.float32)
        from specrl.models.checkpoints import load_model

        return load_model(path, dtype=torch.float32)
    if path is not None and is_eagle3_export(path):
        with refusing("rollout.drafter_path"):
            return import_eagle3(path, policy, say=_given)
    if path is not None:
        return load_head(path, policy, kind=head_kind(spec), say=_given)
    return fresh_head(policy, head_kind(spec), seed, plan.head_arch, plan.head_vocab)


def _given(line: str) -> None:
    """A notice already given (by ``build_drafter_side``, or by the backend that loaded the
    same head) is not repeated."""


def _trained_len(path: str) -> int:
    """The longest sequence a saved drafter trained on (0 when its head.json, or a draft
    model's distill.json, does not say)."""
    try:
        if (Path(path) / SPEC_FILE).is_file():
            extra = json.loads((Path(path) / SPEC_FILE).read_text()).get("extra") or {}
        else:
            extra = read_head_config(path).get("extra") or {}
        return int(extra.get("trained_len") or (extra.get("train") or {}).get("max_len") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def drafter_fields(
    side: DrafterSide,
    guard: WeightGuard,
    backend: RolloutBackend,
    idle: bool,
    version: int,
    comps: Sequence[Completion],
    rollout: Mapping[str, Any],
    captured: list[Captured],
    step_s: float,
) -> dict[str, Any]:
    """See the module docstring (``side``: the run's drafter side, pushing through ``guard``
    to ``backend``; ``idle``: no generate call runs meanwhile, ``WeightGuard.push_drafter``;
    ``version``: the policy version just pushed; ``comps`` and ``rollout``: the batch's
    completions and rollout metrics)."""
    row: dict[str, Any] = {}
    if side.trainer is not None:
        rate = float(rollout.get("draft_acceptance_rate", 0.0))
        signals = StepSignals(step_s, version, rate, int(rollout.get("drafting_steps", 0)))
        update = side.trainer.step(captured, signals)
        row |= update.metrics
        if update.state is not None:
            row["drafter_sync_s"] = guard.push_drafter(backend, update.state, update.version,
                                                       idle=idle)  # fmt: skip
        side.trained_len = side.trainer.ledger.trained_len
    note = context_note(side.trained_len, [len(c.prompt_ids) + len(c.token_ids) for c in comps])
    if note and not side.warned:
        side.warned = True
        row["drafter_warning"] = note
    return row
