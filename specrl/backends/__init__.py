"""Rollout backends: generation behind one protocol (``base.RolloutBackend``).

``build_backend(cfg, policy)`` picks the backend of a run:
- ``cluster.rollout_workers > 0``: ``ray_`` (that many rollout backends as Ray actors, each one
  built as below);
- ``rollout.backend='vllm'``: ``vllm`` (vLLM's engine in the trainer's process);
- ``rollout.backend='native'``: specrl's engine, ``native`` in the trainer's process or
  ``process`` in a worker process, by ``rollout.placement`` ('auto': a worker process for the
  async pipeline, so rollouts and learning run on different cores; inline for sync).
``ConfigError`` (one line) for a combination that cannot run, before anything is built.
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
    "build_local",
    "placement",
]


def placement(cfg: Config) -> str:
    """'inline' or 'process': ``rollout.placement`` with 'auto' resolved (process when async with
    the native engine; vLLM always runs inline)."""
    if cfg.rollout.placement != "auto":
        return cfg.rollout.placement
    native_async = cfg.pipeline.mode == "async" and cfg.rollout.backend == "native"
    return "process" if native_async else "inline"


def build_local(cfg: Config, policy: torch.nn.Module) -> RolloutBackend:
    """The configured backend in this process (or its worker process), ignoring ``cluster``."""
    if cfg.rollout.backend == "vllm":
        if placement(cfg) == "process":
            from specrl.config import ConfigError

            raise ConfigError(
                "rollout.placement='process' needs rollout.backend='native' (the vLLM backend "
                "runs in the trainer's process; use cluster.rollout_workers for separate workers)"
            )
        from specrl.backends.vllm import build_vllm

        return build_vllm(cfg, policy)
    if placement(cfg) == "process":
        from specrl.backends.process import build_process

        return build_process(cfg, policy)
    from specrl.backends.native import build_native

    return build_native(cfg, policy)


def build_backend(cfg: Config, policy: torch.nn.Module) -> RolloutBackend:
    """The configured backend over its own copy of ``policy`` (``ConfigError`` on bad input)."""
    if cfg.cluster.rollout_workers > 0:
        from specrl.backends.ray_ import build_ray

        return build_ray(cfg, policy)
    return build_local(cfg, policy)
