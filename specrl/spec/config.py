"""Speculation settings and building a proposer from them.

Contract: ``SpecConfig(method, k)`` names a registered drafter (``none`` = plain decoding) and
the number of draft tokens per step, 0 <= k <= ``MAX_SPEC_TOKENS``, and ``siblings`` extra
candidates for the first draft token of a stochastic drafter (``specrl.spec.siblings``).
``build_proposer`` returns a ready ``Proposer`` or raises ``ValueError`` with a one-line reason
(unknown method, bad k, a drafter that needs weights and got none). ``drafter_spec`` turns
command-line style options (method, k, ``--drafter``) into a ``SpecConfig`` and a draft model,
loading the drafter at once: one that is missing, damaged or made for another target raises
``ValueError`` with one line naming it; its files are checked against their manifest first
(``models.heads.verify_drafter``: ``cannot load the eagle3 drafter: DIR/head.safetensors:
sha256 mismatch``), and one made before checksums loads with a ``notice:`` line on stderr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specrl.errors import one_line, unknown
from specrl.sampling import MAX_SIBLINGS
from specrl.spec.proposers import (
    available_proposers,
    get_proposer_class,
    head_kind,
    proposer_takes,
    takes_siblings,
)
from specrl.spec.verify import RULES

if TYPE_CHECKING:
    from specrl.models.heads import DraftHead
    from specrl.models.tokenizer import TextTokenizer
    from specrl.models.transformer import Transformer

MAX_SPEC_TOKENS = 16  # the verifier handles any k; past ~8 the cost always exceeds the gain
# Tokens per forward up to which a bf16 verification costs about one decode step on this
# project's 2-core CPU: 16 with oneDNN's linears, the native GEMV path's rows with the native
# kernels (SmolLM2 bf16, 2 threads, context 200: 4 tokens ~1.2x a 1-token forward, 8 ~1.5x,
# 16 ~1.9x; no step at 5 since the tiled GEMM took over from oneDNN).
ONEDNN_TOKENS_PER_FORWARD = 16


def auto_tokens_per_forward(dtype: torch.dtype) -> int:
    """The ``max_tokens_per_forward`` that 'auto' means for an engine of this dtype here."""
    from specrl.kernels.gemv import MAX_ROWS, gemv_kernel

    native = dtype == torch.bfloat16 and gemv_kernel() is not None
    return MAX_ROWS if native else ONEDNN_TOKENS_PER_FORWARD


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings.

    method: drafter name or 'none'. k: draft tokens per step. options: drafter arguments.
    max_tokens_per_forward: if set, a step drafts k_step = min(k, this // B - 1) tokens for a
    batch of B live rows, and runs plain decoding when that is < 1: verification stays in the
    memory-bound regime where it is nearly free (about 16 tokens per forward for SmolLM2 on 2
    CPU cores), so speculation turns itself off for large batches and back on in the tail.
    siblings: extra first-token candidates per row (a draft tree: the chain plus ``siblings``
    leaves under the root), drawn without replacement from the drafter's first distribution and
    verified in the same forward by recursive rejection sampling. Only stochastic drafters (those
    returning q) get them; a step drops them when B * (k + 1 + siblings) would pass
    ``max_tokens_per_forward``.
    exact: "distribution" (rejection sampling: the output distribution is the target's) or
    "sample" (the output is plain sampling's, token for token with the same seed;
    ``specrl.spec.verify``); "sample" takes no siblings.
    adaptive: each step drafts the k in 0..``k`` that the engine's cost-model controller
    (``specrl.spec.controller``) expects to emit the most tokens per second; takes no
    ``max_tokens_per_forward`` (that is the fixed rule ``k_for_batch`` it replaces).
    """

    method: str = "none"
    k: int = 3
    options: dict[str, Any] = field(default_factory=dict)
    max_tokens_per_forward: int | None = None
    siblings: int = 0
    exact: str = "distribution"  # verify's rule: "distribution" (standard) or "sample"
    adaptive: bool = False  # k per step from the engine's cost-model controller (0..k)

    def siblings_for_batch(self, batch: int, k: int) -> int:
        """Sibling candidates for a step of ``batch`` rows drafting ``k`` tokens (0 = none)."""
        if k < 1 or self.siblings == 0:
            return 0
        cap = self.max_tokens_per_forward
        if cap is not None and batch * (k + 1 + self.siblings) > cap:
            return 0
        return self.siblings

    def k_for_batch(self, batch: int) -> int:
        """Draft tokens for a step with ``batch`` live rows (0 = plain step)."""
        if not self.enabled:
            return 0
        if self.max_tokens_per_forward is None:
            return self.k
        return max(0, min(self.k, self.max_tokens_per_forward // max(batch, 1) - 1))

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.k > 0

    def validate(self) -> SpecConfig:
        if not 0 <= self.k <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_spec_tokens must be in [0, {MAX_SPEC_TOKENS}], got {self.k}")
        if not 0 <= self.siblings <= MAX_SIBLINGS:
            raise ValueError(f"siblings must be in [0, {MAX_SIBLINGS}], got {self.siblings}")
        cap = self.max_tokens_per_forward
        if cap is not None and cap < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1 or unset, got {cap}")
        if self.adaptive and cap is not None:
            raise ValueError("an adaptive spec chooses k itself: max_tokens_per_forward must "
                             f"be unset, got {cap}")  # fmt: skip
        if self.exact not in RULES:
            raise ValueError(f"spec_exact must be one of {', '.join(RULES)}, got {self.exact!r}")
        if self.exact == "sample" and self.siblings:
            raise ValueError("spec_exact='sample' takes no siblings (plain sampling draws one "
                             f"token per position), got siblings={self.siblings}")  # fmt: skip
        known = ["none", *available_proposers()]
        if self.method not in known:
            raise ValueError(unknown("speculation method", self.method, known))
        if self.siblings and not takes_siblings(self.method):
            stochastic = ", ".join(m for m in known if takes_siblings(m))
            raise ValueError(f"spec_siblings={self.siblings} applies only to a stochastic drafter "
                             f"({stochastic}), not to spec {self.method!r}")  # fmt: skip
        return self


UNTRAINED = "untrained"  # --drafter value: run a learned drafter's random head on purpose


def missing_head(method: str) -> str:
    """The one-line refusal of a learned drafter that has no trained head."""
    return (
        f"--spec {method} needs a trained head: make one with `specrl train-drafter --drafter "
        f"{head_kind(method)}` (or pass --drafter DIR; --drafter {UNTRAINED} runs a random "
        f"head, lossless but slower than no speculation)"
    )


def drafter_spec(
    method: str, k: int, drafter: str | None, target: Transformer, tokenizer: TextTokenizer
) -> tuple[SpecConfig, Transformer | None]:
    """(SpecConfig, draft model or None): a learned head (eagle3, mtp, hybrid) takes ``drafter``
    as its directory option, loaded here (``load_drafter_head``); without one it is refused (a
    random head would run silently) unless ``drafter`` is ``UNTRAINED``; a ``draft`` drafter a model
    (``load_draft``). A drafter that cannot be loaded raises
    ``ValueError`` (``CheckpointError`` is one) with one line naming it."""
    if proposer_takes(method, "drafter_path"):
        if drafter == UNTRAINED:
            return SpecConfig(method, k), None
        if not drafter:
            raise ValueError(missing_head(method))
        options: dict[str, Any] = {"drafter_path": drafter}
        if proposer_takes(method, "drafter"):
            options["drafter"] = load_drafter_head(drafter, target, head_kind(method))
        elif not Path(drafter).is_dir():
            raise ValueError(f"drafter {drafter} is not a directory")
        return SpecConfig(method, k, options=options), None
    return SpecConfig(method, k), load_draft(drafter, target, tokenizer)


def load_draft(
    drafter: str | None, target: Transformer, tokenizer: TextTokenizer
) -> Transformer | None:
    """``models.checkpoints.load_draft_model`` of ``drafter``, a directory checked against its
    manifest first (``ValueError`` naming a file that does not match; a notice once a draft
    model made before checksums has loaded)."""
    from specrl.models.checkpoints import load_draft_model
    from specrl.models.heads import MODEL_FILES, DrafterDamaged, notice, verify_drafter

    unverified = None
    if drafter is not None and Path(drafter).is_dir():
        try:
            unverified = verify_drafter(drafter, MODEL_FILES)
        except DrafterDamaged as e:
            raise ValueError(f"cannot load the draft model: {e}") from None
    model = load_draft_model(drafter, target, tokenizer)
    if unverified is not None:
        notice(unverified)
    return model


def load_drafter_head(path: str, target: Transformer, kind: str) -> DraftHead:
    """The trained ``kind`` head in directory ``path`` for ``target``; ``ValueError`` with one
    line (naming ``path``, or the file that does not match its manifest) when it is missing,
    damaged or made for another target or kind."""
    from safetensors import SafetensorError

    from specrl.models.head_kinds import load_head
    from specrl.models.heads import DrafterDamaged

    if not Path(path).is_dir():
        raise ValueError(
            f"drafter {path} is not a directory (train a {kind} head with "
            f"specrl train-drafter --drafter {kind})"
        )
    try:
        return load_head(path, target, kind=kind)
    except DrafterDamaged as e:  # names the file: DIR/head.safetensors: sha256 mismatch
        raise ValueError(f"cannot load the {kind} drafter: {e}") from None
    # OSError: a file missing or unreadable; ValueError: json's, and load_head's own for a head
    # that is damaged or made for another target; SafetensorError: damaged head.safetensors.
    except (OSError, ValueError, SafetensorError) as e:
        raise ValueError(f"cannot load the {kind} drafter from {path}: {one_line(e)}") from None


def build_proposer(spec: SpecConfig, **extra: Any):
    """Instantiate the drafter of ``spec`` (``extra`` adds e.g. the target model)."""
    spec.validate()
    if not spec.enabled:
        return None
    cls = get_proposer_class(spec.method)
    try:
        return cls(**{**spec.options, **_accepted(cls, extra)})
    except TypeError as e:
        raise ValueError(f"bad options for drafter {spec.method!r}: {e}") from None


def _accepted(cls: type, extra: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``extra`` that the drafter's constructor takes."""
    import inspect

    params = inspect.signature(cls).parameters
    return {k: v for k, v in extra.items() if k in params}
