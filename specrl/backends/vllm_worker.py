"""What the vLLM backend runs inside vLLM: process-wide patches of vllm 0.32's CPU build and the
worker-side weight operations (``specrl.backends.vllm`` is the backend itself).

Contract: ``patch_vllm()`` (once per process) applies the patches its docstring lists;
``process_state_kept()`` restores what building vLLM's worker changes process-wide (the torch
thread setter, the python/numpy/torch RNG states); ``load_policy(worker, weights)`` /
``load_drafter(worker, weights)`` reload the policy's / draft model's layers in place from
Hugging Face-named tensors (vLLM's layerwise reload, the tied output layer's packed GEMM rebuilt);
``parameters_by_name(worker, drafter)`` is the model's parameters by vLLM's names. Everything
here imports vllm lazily, so importing this module needs no vllm.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """vLLM's ``rejection_sampler.expand_batch_to_tokens`` in plain torch: row ``i``'s value
    (``replace_to`` where it equals ``replace_from``) repeated for its tokens
    (``cu_num_tokens`` is cumulative), ``[num_tokens]`` in ``x``'s dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [B]
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)  # [B]
    out = x.new_zeros(num_tokens)
    expanded = torch.repeat_interleave(values, counts)  # [sum(counts)]
    out[: expanded.numel()] = expanded[:num_tokens]
    return out


# vLLM warnings that are expected on every start or weight update of this backend (the layerwise
# reload finds no weights for rotary embeddings, which have none, for a tied output layer, which
# the reload rebuilds from the embedding, and for an EAGLE-3 head's embedding, the target's; the
# CPU worker refuses thread changes this backend does not make; fp32 checkpoint tensors cast to
# the engine's bf16). A real failure to load is caught by the weight-sync guard, which reads the
# engine's tensors.
BENIGN_WARNINGS = (  # (vLLM module whose logger says it, message prefix, first arguments or ())
    ("model_executor.model_loader.reload.layerwise", "%s: Failed to load weights",
     ("RotaryEmbedding", "ParallelLMHead", "VocabParallelEmbedding")),
    ("model_executor.models.utils", "Attempted to load weight %s with dtype %s into", ()),
    ("v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`", ()),
    ("utils.torch_utils", "OMP_NUM_THREADS=%s is set; leaving Torch threads at", ()),
)  # fmt: skip


class BenignWarnings(logging.Filter):
    """Drops the records of one logger's ``BENIGN_WARNINGS`` (``(prefix, first_args)`` pairs:
    message prefix, and the first argument when ``first_args`` is not empty)."""

    def __init__(self, rules: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
        super().__init__()
        self.rules = rules

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()
        for prefix, first_args in self.rules:
            if msg.startswith(prefix) and (not first_args or (args and args[0] in first_args)):
                return False
        return True


def quiet_benign_warnings() -> None:
    """Install ``BenignWarnings`` on the loggers ``BENIGN_WARNINGS`` names (idempotent: vLLM
    configures its handlers only when an engine starts, so the filters sit on the loggers)."""
    for module in {m for m, _, _ in BENIGN_WARNINGS}:
        logger = logging.getLogger(f"vllm.{module}")
        rules = tuple((p, a) for m, p, a in BENIGN_WARNINGS if m == module)
        logger.filters = [f for f in logger.filters if not isinstance(f, BenignWarnings)]
        logger.addFilter(BenignWarnings(rules))


@functools.cache  # once per process: the patches are process-wide
def patch_vllm() -> None:
    """Process-wide patches of vllm 0.32's CPU build (idempotent; each is looked up by
    vLLM at call time):
    - the rejection sampler's ``expand_batch_to_tokens``: the CPU kernel that replaces its Triton
      kernel (``cpu_triton_utils._expand_kernel_impl``) writes into an int64 *copy* of the
      output, so a float or int32 output (temperature, top-p, top-k per draft token) keeps
      uninitialised memory. Every speculative step at temperature > 0 then samples with garbage
      temperatures: NaN processed logprobs, wrong tokens, near-zero acceptance, and a crash with
      top-k. Replaced by ``expand_batch_to_tokens`` (plain torch, exact); and a speculative
      step whose rows drafted nothing still runs the sampling constraints on zero tokens, where
      the top-k path fails (``k.max()`` of an empty tensor): zero tokens skip them;
    - keep linear weights readable: the CPU build packs a linear weight into a GEMM handle and
      frees the parameter (``dispatch_cpu_unquantized_gemm``); this keeps it (the handle is
      still built from it, on every load and reload) so ``served`` can read the engine's
      weights;
    - register the CPU kernel overrides once per process: every engine start re-registers
      them and rescans every module for references to the kernels, and that scan fails once
      numba's llvmlite is loaded (the ngram proposer loads it), so a second engine in the
      process would not start;
    - vLLM's expected warnings on every start and weight update (``BENIGN_WARNINGS``) dropped
      from its console output."""
    from vllm.model_executor.layers import utils as vutils
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample import rejection_sampler

    dispatch = vutils.dispatch_cpu_unquantized_gemm
    register = dispatcher.register_kernels

    def keep(layer: torch.nn.Module, remove_weight: bool) -> None:
        return dispatch(layer, remove_weight=False)

    def register_once(overrides: Mapping[str, Any]) -> None:
        fresh = {k: v for k, v in overrides.items() if k not in dispatcher._registry}
        if fresh:
            register(fresh)

    constraints = rejection_sampler.apply_sampling_constraints

    def constrained(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else constraints(logits, *args, **kwargs)

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    rejection_sampler.apply_sampling_constraints = constrained
    vutils.dispatch_cpu_unquantized_gemm = keep
    dispatcher.register_kernels = register_once
    quiet_benign_warnings()


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Undo what building a vLLM worker in this process changes process-wide: it replaces
    ``torch.set_num_threads`` by a no-op and reseeds python, numpy and torch."""
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def reload_layers(
    model: torch.nn.Module, model_config: Any, weights: list[tuple[str, torch.Tensor]]
) -> None:
    """vLLM's in-place layerwise reload of ``model`` (checkpoint names), then the tied
    ``lm_head``'s GEMM handle rebuilt from the new embedding."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    model.load_weights(iter(weights))
    finalize_layerwise_reload(model, model_config)
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def load_policy(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        reload_layers(worker.get_model(), worker.vllm_config.model_config, weights)


def load_drafter(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        draft_cfg = worker.vllm_config.speculative_config.draft_model_config
        reload_layers(worker.get_draft_model(), draft_cfg, weights)


def forget_reload_records(worker: Any) -> None:
    """Drop vLLM's layerwise-reload records of the worker's models (policy and draft model),
    for an engine being closed. vLLM 0.32 keeps them in a module-level ``WeakKeyDictionary``
    whose values still reach their keys (a parameter's wrapped weight loader holds its layer),
    so a closed engine's weights were never freed: a copy of the model per engine built in the
    process (1.1 GB resident per closed SmolLM2 fp32 engine)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for model in (worker.get_model(), worker.get_draft_model()):
        for layer in model.modules() if model is not None else ():
            LAYERWISE_INFO.pop(layer, None)


def parameters_by_name(worker: Any, drafter: bool) -> dict[str, torch.Tensor]:
    model = worker.get_draft_model() if drafter else worker.get_model()
    return {n: p.detach() for n, p in model.named_parameters()}
