"""What vLLM speculates with for specrl's ``SpecConfig`` (the vLLM backend's speculation).

``vllm_speculative_config(spec, max_batch, drafter_dir)`` is vLLM's ``speculative_config``
(``None``: plain decoding) for ``ngram``, ``draft``, ``eagle3`` (a head in vLLM's layout) and
``block`` (a block head in vLLM's DFlash layout, served frozen: vLLM's ``dflash`` method),
with the k cap as vLLM's per-batch-size schedule; anything else is a one-line ``ValueError``
naming what is unsupported. ``check_spec`` is the registry's rule for the vLLM backend's plans;
``served_drafter`` writes, where needed, the drafter directory vLLM loads for a plan (a specrl
head exported, a drafter trained from nothing; a block head only frozen); ``lookup_for`` is the
batch-size -> k table of a per-call ``spec`` override.
Details: docs/internals.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specrl.drafters.export import (
    eagle3_head_config,
    export_eagle3,
    is_eagle3_export,
    is_head_dir,
)
from specrl.drafters.export_dflash import export_dflash, is_dflash_export
from specrl.models.head_kinds import fresh_head
from specrl.models.heads import read_head_config, save_head
from specrl.spec.config import SpecConfig

if TYPE_CHECKING:
    from specrl.rollout_plan import RolloutPlan

SUPPORTED_SPEC = ("none", "ngram", "draft", "eagle3", "block")
VLLM_METHODS = {"draft": "draft_model", "eagle3": "eagle3", "block": "dflash"}
NATIVE_ONLY = {"suffix": "its history spans calls inside specrl's engine",
               "hybrid": "its suffix half's history spans calls inside specrl's engine",
               "self": "layer-skip self-speculation is specrl's"}  # fmt: skip


def _schedule(spec: SpecConfig, max_batch: int) -> list[tuple[int, int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: (first, last, k) ranges of batch sizes
    with the k ``spec.k_for_batch`` gives (0 = plain steps)."""
    ranges: list[tuple[int, int, int]] = []
    for b in range(1, max_batch + 1):
        k = spec.k_for_batch(b)
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], b, k)
        else:
            ranges.append((b, b, k))
    return ranges


def vllm_speculative_config(
    spec: SpecConfig, max_batch: int, drafter_dir: str | os.PathLike | None = None
) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for specrl's ``spec`` (``None``: plain decoding); a
    one-line ``ValueError`` for anything this backend cannot run (see the module docstring)."""
    if not _check_method(spec):
        return None
    method = spec.method
    out: dict[str, Any] = {"num_speculative_tokens": spec.k}
    if method == "ngram":
        opts = spec.options
        out |= {"method": "ngram", "prompt_lookup_max": int(opts.get("max_n", 4)),
                "prompt_lookup_min": int(opts.get("min_n", 2))}  # fmt: skip
    else:
        _check_drafter_dir(method, drafter_dir)
        if method == "block" and _on_cpu():
            raise ValueError(DFLASH_CPU)
        out |= {"method": VLLM_METHODS[method], "model": str(drafter_dir)}
        if method == "block":  # drafts drawn from q, as specrl's engine draws them
            out["draft_sample_method"] = "probabilistic"
    out["num_speculative_tokens_per_batch_size"] = _schedule(spec, max_batch)
    return out


# measured (docs/drafters.md, benchmarks/results/block_vllm.json): greedy replies equal and
# acceptance as specrl's, sampled ones wrong (a few tokens each, then a stop token)
DFLASH_CPU = (
    "rollout.spec='block' on the vllm backend: vLLM 0.32's dflash method emits wrong tokens "
    "when it samples (temperature > 0) on the CPU platform, so its rollouts would not be the "
    "policy's; use rollout.backend='native' (the block drafter, exact), or serve the exported "
    "head greedily with vLLM outside specrl"
)


def _on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (imported when asked: vLLM is an extra)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _check_method(spec: SpecConfig) -> bool:
    """Whether ``spec`` speculates; ``ValueError`` for a drafter or setting vLLM cannot run."""
    method = spec.method
    if not spec.enabled:
        return False
    if method in NATIVE_ONLY:
        raise ValueError(
            f"rollout.spec={method!r} is not supported by the vllm backend "
            f"({NATIVE_ONLY[method]}); use ngram, draft or none there, or rollout.backend=native"
        )
    if method == "mtp":
        raise ValueError(
            "rollout.spec='mtp' is not supported by the vllm backend (vLLM's mtp runs a model's "
            "own MTP layers; specrl's mtp head has no vLLM layout)"
        )
    if method not in SUPPORTED_SPEC:
        raise ValueError(f"rollout.spec={method!r} is not supported by the vllm backend")
    if spec.siblings:
        raise ValueError("rollout.spec_siblings > 0 is not supported by the vllm backend")
    if spec.exact != "distribution":
        raise ValueError(
            f"rollout.spec_exact={spec.exact!r} is not supported by the vllm backend (its "
            "rejection sampler is vLLM's own); use rollout.backend=native"
        )
    return True


def _check_drafter_dir(method: str, drafter_dir: str | os.PathLike | None) -> None:
    """``ValueError`` unless ``drafter_dir`` is what vLLM loads for ``method`` (draft, eagle3)."""
    if method == "draft":
        if drafter_dir is None or not (Path(drafter_dir) / "config.json").is_file():
            raise ValueError(
                f"rollout.spec='draft' on the vllm backend needs a draft model directory "
                f"(config.json + safetensors), got {drafter_dir!r}"
            )
    elif method == "block":
        if drafter_dir is None or not is_dflash_export(drafter_dir):
            raise ValueError(
                f"rollout.spec='block' on the vllm backend needs a block head in vLLM's DFlash "
                f"layout or a specrl block head directory (head.json), got {drafter_dir!r}"
            )
    elif drafter_dir is None or not is_eagle3_export(drafter_dir):
        raise ValueError(
            f"rollout.spec='eagle3' on the vllm backend needs a head in vLLM's EAGLE-3 layout "
            f"(config.json with an Eagle3 architecture), got {drafter_dir!r}; a specrl "
            f"head directory (head.json) must be exported first"
        )


def check_spec(spec: SpecConfig, drafter_dir: str | None, trained: bool = False) -> None:
    """``ValueError`` (one line) unless a run can serve ``spec`` with ``drafter_dir`` on the
    vLLM backend: ``build_vllm`` writes (``served_drafter``) a specrl EAGLE-3 head directory in
    vLLM's layout, and a drafter the run trains from nothing (``trained``, no directory)."""
    if not _check_method(spec.validate()) or spec.method == "ngram":
        return
    if spec.method == "block" and trained:
        raise ValueError(
            "rollout.spec='block' on the vllm backend serves a trained block head frozen "
            "(drafter.mode='frozen' with rollout.drafter_path, or the head `specrl "
            "train-drafter --drafter block` cached): training it during the run needs "
            "rollout.backend='native'"
        )
    if drafter_dir is None and trained:
        return
    if spec.method == "block" and drafter_dir is not None and is_head_dir(drafter_dir):
        if read_head_config(drafter_dir).get("kind") != "block":
            raise ValueError(f"rollout.drafter_path {drafter_dir} holds no block head")
        return
    if spec.method == "eagle3" and drafter_dir is not None and is_head_dir(drafter_dir):
        eagle3_head_config(Path(drafter_dir))  # ExportError (a ValueError): vLLM cannot load it
        return
    _check_drafter_dir(spec.method, drafter_dir)


def served_drafter(
    plan: RolloutPlan, policy: torch.nn.Module, model_dir: str, out: Path
) -> str | None:
    """The drafter directory vLLM loads for ``plan``: ``plan.drafter_dir`` where vLLM loads it
    as it is, else one written under ``out`` (a directory the caller owns): a specrl EAGLE-3
    head exported (``drafters.export.export_eagle3``), a head trained from nothing
    (``models.head_kinds.fresh_head``, seeded by ``run.seed`` as the trainer starts it) exported, or
    a draft model's untrained start (``drafters.distill.untrained_draft``, the tokenizer of
    ``model_dir`` with it). ``ValueError`` (one line) for a head vLLM cannot serve."""
    method, path = plan.spec.method, plan.drafter_dir
    if not plan.spec.enabled or method not in ("eagle3", "draft", "block"):
        return path
    if method == "block":  # served frozen (check_spec): exported when it is a specrl head
        return str(export_dflash(path, policy, out / "dflash")) if is_head_dir(path) else path
    if method == "draft":
        if path is not None:
            return path
        from specrl.drafters.distill import save_draft_model, untrained_draft

        draft = untrained_draft(policy, torch.float32)
        return str(save_draft_model(draft, out / "draft", policy.config, model_dir))
    if path is not None and not is_head_dir(path):
        return path
    if path is None:
        vocab = policy.config.vocab_size
        if plan.head_vocab >= vocab:
            raise ValueError(
                f"bad value for drafter.vocab: {plan.head_vocab} is not below the model's "
                f"vocabulary ({vocab}); use 0 (the full vocabulary) with rollout.backend='vllm'"
            )
        head = fresh_head(policy, "eagle3", plan.seed, plan.head_arch, plan.head_vocab)
        path = str(save_head(head, out / "head"))
    return str(export_eagle3(path, policy, out / "eagle3"))


def lookup_for(configured: SpecConfig, spec: SpecConfig | None, max_batch: int) -> list[int] | None:
    """The batch-size -> k table for a call of a backend built with ``configured`` (None: the
    configured one)."""
    if spec is None or spec == configured:
        return None
    spec = spec.validate()
    if not configured.enabled:
        if spec.enabled:
            raise ValueError(
                f"spec override {spec.method!r}: this vllm backend was built without speculation"
            )
        return None
    if spec.enabled and (spec.method != configured.method or spec.k > configured.k):
        raise ValueError(
            f"spec override {spec.method!r} (k={spec.k}): this vllm backend runs "
            f"{configured.method!r} with k <= {configured.k}; only that method at a lower k, "
            "or none, can be chosen per call"
        )
    ks = [spec.k_for_batch(b) if spec.enabled else 0 for b in range(1, max_batch + 1)]
    return [0, *ks]
