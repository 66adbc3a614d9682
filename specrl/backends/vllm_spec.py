"""What vLLM speculates with for specrl's ``SpecConfig`` (the vLLM backend's speculation).

``vllm_speculative_config(spec, max_batch, drafter_dir)`` is vLLM's ``speculative_config``
(``None``: plain decoding) for ``ngram``, ``draft`` and ``eagle3`` (a head in vLLM's layout),
with the k cap as vLLM's per-batch-size schedule; anything else is a one-line ``ValueError``
naming what is unsupported. ``check_spec`` is the registry's rule for the vLLM backend's plans;
``lookup_for`` is the batch-size -> k table of a per-call ``spec`` override.
Details: docs/internals.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specrl.spec.config import SpecConfig

SUPPORTED_SPEC = ("none", "ngram", "draft", "eagle3")
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
    method = spec.method
    if not spec.enabled:
        return None
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
    out: dict[str, Any] = {"num_speculative_tokens": spec.k}
    if method == "ngram":
        opts = spec.options
        out |= {"method": "ngram", "prompt_lookup_max": int(opts.get("max_n", 4)),
                "prompt_lookup_min": int(opts.get("min_n", 2))}  # fmt: skip
    elif method == "draft":
        if drafter_dir is None or not (Path(drafter_dir) / "config.json").is_file():
            raise ValueError(
                f"rollout.spec='draft' on the vllm backend needs a draft model directory "
                f"(config.json + safetensors), got {drafter_dir!r}"
            )
        out |= {"method": "draft_model", "model": str(drafter_dir)}
    else:  # eagle3
        if drafter_dir is None or not _is_vllm_eagle3(Path(drafter_dir)):
            raise ValueError(
                f"rollout.spec='eagle3' on the vllm backend needs a head in vLLM's EAGLE-3 layout "
                f"(config.json with an Eagle3 architecture), got {drafter_dir!r}; a specrl "
                f"head directory (head.json) must be exported first"
            )
        out |= {"method": "eagle3", "model": str(drafter_dir)}
    out["num_speculative_tokens_per_batch_size"] = _schedule(spec, max_batch)
    return out


def _is_vllm_eagle3(path: Path) -> bool:
    try:
        arch = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any("eagle3" in str(a).lower() for a in arch)


def check_spec(spec: SpecConfig, drafter_dir: str | None) -> None:
    """``ValueError`` (one line) unless the vLLM backend can run ``spec`` with ``drafter_dir``."""
    vllm_speculative_config(spec.validate(), 1, drafter_dir)


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
