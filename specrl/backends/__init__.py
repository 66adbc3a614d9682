"""Rollout backends: generation behind one protocol (``base.RolloutBackend``).

``native`` wraps specrl's engine in the trainer's process; ``process`` runs it in a worker
process. ``build_backend(cfg, policy)`` picks by ``rollout.placement`` ('auto': a worker
process for the async pipeline, so rollouts and learning run on different cores; inline for
sync).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specrl.backends.base import IN_FLIGHT, Rollout, RolloutBackend, Served, Versions

if TYPE_CHECKING:
    import torch

    from specrl.config import Config

__all__ = [
    "IN_FLIGHT",
    "Rollout",
    "RolloutBackend",
    "Served",
    "Versions",
    "build_backend",
    "placement",
]


def placement(cfg: Config) -> str:
    """'inline' or 'process': ``rollout.placement`` with 'auto' resolved (process when async)."""
    if cfg.rollout.placement != "auto":
        return cfg.rollout.placement
    return "process" if cfg.pipeline.mode == "async" else "inline"


def build_backend(cfg: Config, policy: torch.nn.Module) -> RolloutBackend:
    """The configured backend over its own copy of ``policy`` (``ConfigError`` on bad input)."""
    if placement(cfg) == "process":
        from specrl.backends.process import build_process

        return build_process(cfg, policy)
    from specrl.backends.native import build_native

    return build_native(cfg, policy)
