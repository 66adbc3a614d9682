"""The backend registry: ``REGISTRY`` (a ``specrl.registry.Registry``: name -> ``Entry``,
builders and ``BackendTraits``), ``plan_rollout(cfg)`` (the run's ``RolloutPlan`` under its
rules) and ``build_local(plan, policy)`` (the planned backend in this process or its worker
process, Ray workers aside: what ``build_backend`` and each Ray rollout worker build). Builders
are ``"module:function"`` names, imported when used, so that this module imports no backend.
Re-exported by ``specrl.backends``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specrl.backends.base import RolloutBackend
from specrl.registry import Registry
from specrl.rollout_plan import BackendTraits, RolloutPlan, make_plan

if TYPE_CHECKING:
    import torch

    from specrl.config import Config


def _attr(target: str) -> Any:
    """The object named by ``"module:name"`` (the module imported now)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _call(target: str) -> Callable[..., Any]:
    """A function that calls ``target`` (``_attr``), imported when called."""
    return lambda *args: _attr(target)(*args)


@dataclass(frozen=True)
class Entry:
    """A registered backend: its builders (``"module:function"`` taking ``(plan, policy)``,
    imported when used; ``process`` set exactly when ``traits.inline_only`` is None) and the
    rules its plans follow."""

    inline: str
    process: str | None = None
    traits: BackendTraits = BackendTraits()


REGISTRY: Registry[Entry] = Registry("rollout backend")
REGISTRY.register(
    "native",
    Entry(
        "specrl.backends.native:build_native",
        "specrl.backends.process:build_process",
        BackendTraits(controller=True, exact_sample=True,
                      check_in_flight=_call("specrl.backends.native:check_in_flight")),
    ),
)  # fmt: skip
REGISTRY.register(
    "vllm",
    Entry(
        "specrl.backends.vllm:build_vllm",
        traits=BackendTraits(
            inline_only="the vLLM backend runs in the trainer's process; use "
            "cluster.rollout_workers for separate workers",
            cpu_only="the vLLM backend runs the installed vLLM build (CPU); use "
            "rollout.backend='native' on a GPU",
            head_arch="eagle3",  # vLLM's EAGLE-3 layer
            fixed_draft_vocab=True,  # vLLM sizes the head's LM head when the engine starts
            missing=_call("specrl.backends.vllm:missing_extra"),
            check_spec=_call("specrl.backends.vllm_spec:check_spec"),
        ),
    ),
)


def plan_rollout(cfg: Config) -> RolloutPlan:
    """``cfg``'s rollout plan (``ConfigError``, one line, for a setting that cannot run)."""
    return make_plan(cfg, {name: entry.traits for name, entry in REGISTRY.items()})


def build_local(plan: RolloutPlan, policy: torch.nn.Module) -> RolloutBackend:
    """The planned backend in this process (or its worker process), ignoring Ray workers."""
    entry = REGISTRY[plan.backend]
    target = entry.process if plan.placement == "process" else entry.inline
    assert target is not None, "the plan refuses a worker process for an inline-only backend"
    return _attr(target)(plan, policy)
