"""Rollout backends: generation behind one protocol (``base.RolloutBackend``).

``build_backend(cfg, policy)`` picks the backend of a run:
- ``cluster.rollout_workers > 0``: ``ray_`` (that many rollout backends as Ray actors, each one
  built as below);
- ``rollout.backend='vllm'``: ``vllm`` (vLLM's engine in the trainer's process);
- ``rollout.backend='native'``: specrl's engine, ``native`` in the trainer's process or
  ``process`` in a worker process, by ``rollout.placement`` ('auto': a worker process for the
  async pipeline, so rollouts and learning run on different cores; inline for sync).
On a CUDA device (``model.device``) the native engine runs inline beside the learner, on a
copy of the policy on the same device (colocated); ``check_device`` refuses what cannot.
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
    "check_device",
    "placement",
    "run_device",
]


def placement(cfg: Config) -> str:
    """'inline' or 'process': ``rollout.placement`` with 'auto' resolved (process when async with
    the native engine on the CPU; vLLM, and everything on a GPU, runs inline: colocated)."""
    if cfg.rollout.placement != "auto":
        return cfg.rollout.placement
    native_async = cfg.pipeline.mode == "async" and cfg.rollout.backend == "native"
    return "process" if native_async and run_device(cfg).type == "cpu" else "inline"


def run_device(cfg: Config) -> torch.device:
    """``model.device`` resolved (``ConfigError`` naming it when it cannot be had here)."""
    from specrl.config import ConfigError
    from specrl.models.device import DeviceError, resolve_device

    try:
        return resolve_device(cfg.model.device)
    except DeviceError as e:
        raise ConfigError(f"bad value for model.device: {e}") from None


def check_device(cfg: Config) -> None:
    """A GPU run is colocated in one process: the worker-process engine (shared memory on the
    host) and the installed vLLM build (CPU) cannot serve it."""
    from specrl.config import ConfigError

    device = run_device(cfg)
    if device.type == "cpu":
        return

    if cfg.rollout.backend == "vllm":
        raise ConfigError(
            f"rollout.backend='vllm' with model.device={cfg.model.device!r}: the vLLM backend "
            "runs the installed vLLM build (CPU); use rollout.backend='native' on a GPU"
        )
    if cfg.rollout.placement == "process":
        raise ConfigError(
            f"rollout.placement='process' with model.device={cfg.model.device!r}: on a GPU the "
            "engine and the learner share one process (placement 'inline' or 'auto')"
        )


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
    check_device(cfg)
    if cfg.cluster.rollout_workers > 0:
        from specrl.backends.ray_ import build_ray

        return build_ray(cfg, policy)
    return build_local(cfg, policy)
