"""Rollout backends: generation behind one protocol (``base.RolloutBackend``), one registry.

``plan_rollout(cfg)`` is the run's ``rollout_plan.RolloutPlan`` under the rules of the
backends in ``REGISTRY``; ``build_backend(plan, policy)`` builds it: Ray workers (``ray_``,
each building ``build_local``) for ``cluster.rollout_workers > 0``, else the entry's builder
for the plan's placement (``native`` inline, ``process`` in a worker process, ``vllm``).
``REGISTRY``, ``plan_rollout`` and ``build_local`` live in ``registry`` and are re-exported
here. ``REGISTRY`` holds the engines (``native``, ``vllm``), each an ``Entry``: its builders
(inline, and in a worker process where it may run there) and its ``BackendTraits``; the plan
checks ``rollout.backend`` against it. A third engine touches only ``backends/``: its module(s)
and one entry there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specrl.backends.base import GROUP_DONE, IN_FLIGHT, Rollout, RolloutBackend, Served, Versions
from specrl.backends.registry import REGISTRY, Entry, build_local, plan_rollout

if TYPE_CHECKING:
    import torch

    from specrl.rollout_plan import RolloutPlan

__all__ = [
    "GROUP_DONE",
    "IN_FLIGHT",
    "REGISTRY",
    "Entry",
    "Rollout",
    "RolloutBackend",
    "Served",
    "Versions",
    "build_backend",
    "build_local",
    "plan_rollout",
]


def build_backend(plan: RolloutPlan, policy: torch.nn.Module) -> RolloutBackend:
    """The planned backend over its own copy of ``policy``."""
    if plan.workers is not None:
        from specrl.backends.ray_ import build_ray

        return build_ray(plan, policy)
    return build_local(plan, policy)
