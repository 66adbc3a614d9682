"""Weight-sync guardrail: a content check of every weight update.

``WeightGuard(dtype)`` fingerprints what the learner pushes (policy: ``push``, a learned
drafter: ``push_drafter``) and ``verify(served, floor)`` compares what the backend serves:
an older version than one acknowledged, a version never pushed, or another fingerprint than
the one pushed raises ``WeightSyncError`` (one line naming the version and both fingerprints),
which ends the run. The acceptance alarm, the second guardrail, is ``pipelines.alarm``.
Details: docs/internals.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import astuple, dataclass, field

import torch

from specrl.backends.base import RolloutBackend, Served, Versions
from specrl.backends.ray_ import RemoteWeights
from specrl.models.fingerprint import fingerprint, fingerprint_dtype

KEEP = 128  # fingerprints of the newest versions kept (more than any staleness bound: <= 64)


class WeightSyncError(RuntimeError):
    """The rollout backend does not serve the weights the learner pushed (one line)."""


# --------------------------------------------------------------------------- content check


@dataclass
class _Pushed:
    """Fingerprints of pushed versions of one kind (policy or drafter) and the newest acked."""

    what: str  # "policy" | "drafter"
    prints: dict[int, str] = field(default_factory=dict)  # version -> fingerprint
    acked: int = 0  # the newest version whose update call returned

    def remember(self, version: int, fp: str) -> None:
        self.prints[version] = fp
        for old in sorted(self.prints)[:-KEEP]:
            del self.prints[old]

    def check(self, version: int, fp: str | None, floor: int | None) -> None:
        """``WeightSyncError`` if ``(version, fp)`` served is not what was pushed."""
        label = "" if self.what == "policy" else "drafter "
        if floor is not None and version < floor:
            raise WeightSyncError(
                f"weight sync check failed at {label}version {floor}: the rollout backend "
                f"still serves {self.what} version {version} (update skipped)"
            )
        newest = max(self.prints, default=self.acked)
        if version > max(newest, self.acked):
            raise WeightSyncError(
                f"weight sync check failed: the rollout backend serves {self.what} version "
                f"{version}, newer than any the learner pushed ({newest})"
            )
        expected = self.prints.get(version)
        if fp is not None and expected is not None and fp != expected:
            raise WeightSyncError(
                f"weight sync check failed at {label}version {version}: the rollout backend "
                f"serves {self.what} fingerprint {fp}, the learner pushed {expected} "
                "(update skipped or corrupted)"
            )


@dataclass
class WeightGuard:
    """See the module docstring (``build_run`` sets the engine's ``dtype``)."""

    dtype: torch.dtype = torch.float32
    policy: _Pushed = field(default_factory=lambda: _Pushed("policy"))
    drafter: _Pushed = field(default_factory=lambda: _Pushed("drafter"))

    def remember(self, version: int, named: Mapping[str, torch.Tensor]) -> None:
        """Expect ``named`` (learner side, cast to ``dtype``) as policy version ``version``."""
        self.policy.remember(version, fingerprint(named, self.dtype))

    def push(
        self,
        backend: RolloutBackend,
        named: Mapping[str, torch.Tensor] | RemoteWeights,
        version: int,
    ) -> float:
        """Fingerprint, send and (when already applied) check a policy update (a
        ``RemoteWeights`` comes fingerprinted, in ``dtype``); seconds, the fingerprints and the
        check included."""
        t0 = time.perf_counter()
        if isinstance(named, RemoteWeights):
            self.policy.remember(version, named.fingerprint)
        else:
            self.remember(version, named)
        backend.update_weights(named, version)
        self.policy.acked = version
        self.verify(backend.served())
        return time.perf_counter() - t0

    def push_drafter(
        self,
        backend: RolloutBackend,
        state: Mapping[str, torch.Tensor],
        version: int,
        idle: bool = True,
    ) -> float:
        """Fingerprint, send and check a learned drafter's tensors; seconds, check included.
        ``idle``: no generate call runs, so the update must be served at once (an older
        version is a skipped update); else (the async producer is generating) it is checked as
        ``push`` checks a policy update, after the next rollout."""
        t0 = time.perf_counter()
        held = backend.served().drafter
        if held is not None:  # fingerprinted in the dtype the engine's drafter holds
            self.drafter.remember(version, fingerprint(state, fingerprint_dtype(held)))
        backend.update_drafter(state, version)
        self.drafter.acked = version
        self.verify(backend.served(), self.floor() if idle else None)
        return time.perf_counter() - t0

    def floor(self) -> Versions:
        """The policy and drafter versions whose updates have returned."""
        return Versions(self.policy.acked, self.drafter.acked)

    def verify(self, served: Served, floor: Versions | None = None) -> None:
        """``WeightSyncError`` unless ``served`` is what was pushed (see the module docstring)."""
        policy_floor, drafter_floor = (None, None) if floor is None else astuple(floor)
        self.policy.check(served.policy_version, served.policy, policy_floor)
        self.drafter.check(served.drafter_version, served.drafter, drafter_floor)
