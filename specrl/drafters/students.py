"""What ``OnlineDrafter`` trains: a learned head (EAGLE-3 / MTP / block) or a draft model, one
interface.

A ``Student`` wraps the drafter's trainable float32 ``module`` and gives the policy ``layers`` it
reads, ``loss(batch)`` and ``kl(batch)`` (KL(policy || drafter) at the first draft position: the
drift signal), the ``frozen()`` policy parameters, ``follow()`` (take over what it shares with
the moving policy), ``pick_vocab``, and ``state()`` / ``meta()`` / ``load_meta`` for pushes and
checkpoints. ``HeadStudent`` trains with the training-time-test loss, ``DraftStudent`` by
distillation against the policy's LM head; ``student_for(drafter, policy)`` picks by type.
Details: docs/internals.md.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from specrl.drafters.data import Example
from specrl.drafters.distill import collate_tokens, distill_loss, set_trainable
from specrl.drafters.train import collate, target_probs, ttt_loss
from specrl.models.heads import DraftHead, draft_vocab_by_frequency
from specrl.models.transformer import Transformer

UNROLL = 3  # training-time-test depth (train-drafter's default); the decay is the head's


class Student(Protocol):
    """See docs/internals.md."""

    module: torch.nn.Module
    layers: tuple[int, ...]

    def loss(self, batch: list[Example]) -> torch.Tensor: ...
    def kl(self, batch: list[Example]) -> float: ...
    def frozen(self) -> list[torch.nn.Parameter]: ...
    def follow(self) -> None: ...
    def pick_vocab(self, examples: list[Example], size: int) -> None: ...
    def state(self) -> dict[str, torch.Tensor]: ...
    def meta(self) -> dict[str, Any]: ...
    def load_meta(self, meta: dict[str, Any]) -> None: ...


def _longest(batch: list[Example]) -> int:
    return max(len(e.tokens) for e in batch)


class HeadStudent:
    """An EAGLE-3 / MTP head over the learner's policy (see docs/internals.md)."""

    def __init__(self, head: DraftHead) -> None:
        self.module = head
        self.layers = tuple(head.feature_layers)
        self.depth = getattr(head, "block_size", UNROLL)  # a block head trains its block
        head.float().requires_grad_(True)

    def loss(self, batch: list[Example]) -> torch.Tensor:
        head = self.module
        return ttt_loss(head, collate(batch, _longest(batch)), self.depth, head.decay)

    @torch.no_grad()
    def kl(self, batch: list[Example]) -> float:
        head = self.module
        feats, toks, final, mask = collate(batch, _longest(batch))
        if not mask.any():
            return float("nan")
        g, where = head.depth_outputs(feats.to(head.dtype), toks, mask, 1)[0]
        lq = torch.log_softmax(head.logits(g).float(), -1)  # [N, Vd]
        p = target_probs(head, final[where])  # [N, Vd] (restricted to the draft vocabulary)
        plogp = torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p))
        return float((plogp - p * lq).sum(-1).mean())

    def frozen(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.target.parameters() if p.requires_grad]

    def follow(self) -> None:
        """Nothing: the head reads the live policy's embedding and LM head."""

    def pick_vocab(self, examples: list[Example], size: int) -> None:
        vocab_size = self.module.target_config.vocab_size
        size = min(size, vocab_size)
        if size > 0:
            tokens = [e.tokens.tolist() for e in examples]
            self.module.set_draft_vocab(draft_vocab_by_frequency(tokens, size, vocab_size))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def meta(self) -> dict[str, Any]:
        d2t = self.module.d2t
        return {"d2t": None if d2t is None else d2t.tolist()}

    def load_meta(self, meta: dict[str, Any]) -> None:
        d2t = meta["d2t"]
        self.module.set_draft_vocab(None if d2t is None else torch.tensor(d2t))


class DraftStudent:
    """A draft model distilled on the moving policy (see docs/internals.md)."""

    layers: tuple[int, ...] = ()

    def __init__(self, model: Transformer, policy: torch.nn.Module) -> None:
        self.module = model.float()
        self.policy, self.target_lm = policy, policy.lm_head
        set_trainable(model)

    def loss(self, batch: list[Example]) -> torch.Tensor:
        return distill_loss(self.module, self.target_lm, collate_tokens(batch, _longest(batch)))

    @torch.no_grad()
    def kl(self, batch: list[Example]) -> float:
        tokens = collate_tokens(batch, _longest(batch))
        if not tokens[2].any():
            return float("nan")
        return float(distill_loss(self.module, self.target_lm, tokens))

    def frozen(self) -> list[torch.nn.Parameter]:
        return []  # the policy's LM head runs under no_grad in distill_loss

    @torch.no_grad()
    def follow(self) -> None:
        """Copy the policy's embedding and LM head into the draft's frozen copies."""
        theirs = dict(self.policy.named_parameters())
        for name, p in self.module.named_parameters():
            if not p.requires_grad and name in theirs and theirs[name].shape == p.shape:
                p.copy_(theirs[name])

    def pick_vocab(self, examples: list[Example], size: int) -> None:
        """A draft model drafts over the full vocabulary (its LM head is the policy's)."""

    def state(self) -> dict[str, torch.Tensor]:
        return {
            n: p.detach().clone() if p.requires_grad else p.detach()
            for n, p in self.module.named_parameters()
        }

    def meta(self) -> dict[str, Any]:
        return {}

    def load_meta(self, meta: dict[str, Any]) -> None:
        """Nothing besides the parameters and optimizer."""


def student_for(drafter: torch.nn.Module, policy: torch.nn.Module) -> Student:
    """``HeadStudent`` for a ``DraftHead``, ``DraftStudent`` for a draft ``Transformer``."""
    if isinstance(drafter, DraftHead):
        return HeadStudent(drafter)
    if isinstance(drafter, Transformer):
        return DraftStudent(drafter, policy)
    raise TypeError(f"no online trainer for a {type(drafter).__name__} drafter")
