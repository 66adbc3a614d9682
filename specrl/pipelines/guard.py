"""Weight-sync guardrails: a content check of every weight update, and an acceptance alarm.

The failure they catch is silent in the field: after a weight sync the serving engine keeps old
or damaged weights (a skipped update, a dropped drafter on sleep/wake), output stays plausible
and speculation quietly stops paying.

Contract:
- ``WeightSyncError`` (a ``RuntimeError``): the rollout backend does not serve what the learner
  pushed. Its message is one line naming the version and both fingerprints; it ends the run.
- ``WeightGuard(dtype)``: the learner's side of the content check; ``dtype`` is the engine's
  (``model.dtype``), the one the backend casts the learner's float32 tensors to.
  ``remember(version, named)`` fingerprints tensors the backend serves already (version 0 at
  build time). ``push(backend, named, version)`` fingerprints ``named`` (before sending: the
  caller mutates its tensors later), calls ``update_weights``, then checks what the backend
  already serves: an idle backend applied the update at once (the sync pipeline fails on the
  step that pushed it); a pending one (the async producer is generating) is checked after the
  next rollout, so the learner never waits for the producer. ``floor()``: the versions whose
  updates have returned (a rollout that starts later serves at least those).
  ``verify(served, floor=None)`` raises ``WeightSyncError`` when the backend serves an older
  version than ``floor`` (update skipped), a version newer than any pushed, or another
  fingerprint than the one pushed for that version (skipped: old weights under the new
  version, or corrupted); a version it keeps no fingerprint of (only the ``KEEP`` newest are
  kept) and a ``None`` fingerprint are not compared. ``push_drafter(backend, state, version)``
  does the same for a learned drafter's tensors (``pipelines.drafter`` pushes every head the
  learner side trains): checked at once when the backend is idle (``idle``), else after the
  next rollout.
- ``AcceptanceAlarm(action)``: per step, ``observe(step, acceptance, drafts, version)`` with
  the acceptance length of the (row, verify step) pairs that drafted (``pipelines.step``'s
  ``draft_acceptance_length``), how many there were (``drafting_steps``) and the batch's policy
  version. A step with fewer than ``MIN_DRAFTS`` drafting pairs is no evidence and is skipped.
  After ``WARMUP`` steps with evidence whose running gain (EMA of acceptance - 1) is at least
  ``MIN_GAIN`` (a drafter that normally accepts), it returns a one-line warning when acceptance
  is at most ``COLLAPSED`` (drafts are no longer accepted), or when the policy version moved
  since the previous step (a refit) and the gain fell below ``DROP`` of its running level;
  else ``None``. An alarmed step does not move the running level. With
  ``action = "disable_spec"`` the first alarm also turns speculation off for the rest of the
  run (``spec_override()`` is then a plain ``SpecConfig``). ``state_dict()`` /
  ``load_state_dict(state)``: its JSON-able state, for a checkpoint (a resume that restores it
  alarms exactly where an uninterrupted run would).
- ``alarm_fields(alarm, step, metrics, version)``: the row fields (``acceptance_alarm``
  0/1, and the message as ``acceptance_warning`` when it fires); ``alarm_line(row)``: the
  console line for a row, or ``None``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import astuple, dataclass, field
from typing import Any, Literal

import torch

from specrl.backends.base import RolloutBackend, Served, Versions
from specrl.models.fingerprint import fingerprint, fingerprint_dtype
from specrl.spec.config import SpecConfig

KEEP = 128  # fingerprints of the newest versions kept (more than any staleness bound: <= 64)

MIN_DRAFTS = 32  # drafting (row, verify step) pairs that make a step evidence
WARMUP = 3  # steps with evidence before the alarm may fire
MIN_GAIN = 0.2  # running acceptance - 1 of a drafter that "normally accepts"
COLLAPSED = 1.05  # acceptance length at or below this: nothing is accepted any more
DROP = 0.5  # right after a refit, a gain below this share of the running gain alarms
DECAY = 0.7  # EMA weight of the running level

AlarmAction = Literal["warn", "disable_spec"]


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
        self, backend: RolloutBackend, named: Mapping[str, torch.Tensor], version: int
    ) -> float:
        """Fingerprint, send and (when already applied) check a policy update; seconds, the
        fingerprints and the check included."""
        t0 = time.perf_counter()
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


# --------------------------------------------------------------------------- acceptance alarm


@dataclass
class AcceptanceAlarm:
    """See the module docstring."""

    action: AlarmAction = "warn"
    level: float | None = None  # running gain (EMA of acceptance - 1) of unalarmed steps
    seen: int = 0  # drafted steps folded into ``level``
    version: int | None = None  # policy version of the previous observed step
    disabled: bool = False  # speculation turned off by an alarm

    def observe(self, step: int, acceptance: float, drafts: int, version: int) -> str | None:
        """The warning for this step, or ``None`` (see the module docstring)."""
        if drafts < MIN_DRAFTS:  # too few drafts to tell either way
            return None
        refit = self.version is not None and version > self.version
        self.version = version
        message = self._judge(step, acceptance, version, refit)
        if message is None:
            gain = acceptance - 1.0
            self.level = gain if self.level is None else DECAY * self.level + (1 - DECAY) * gain
            self.seen += 1
            return None
        if self.action == "disable_spec" and not self.disabled:
            self.disabled = True
            message += "; speculation is off for the rest of the run (rollout.alarm_action)"
        return message

    def _judge(self, step: int, acceptance: float, version: int, refit: bool) -> str | None:
        if self.level is None or self.seen < WARMUP or self.level < MIN_GAIN:
            return None
        running = 1.0 + self.level
        if acceptance <= COLLAPSED:
            return (
                f"acceptance alarm at step {step}: acceptance length {acceptance:.2f} (running "
                f"{running:.2f}): no draft is accepted any more (stale or dropped drafter "
                "weights after a weight sync?)"
            )
        if refit and acceptance - 1.0 < DROP * self.level:
            return (
                f"acceptance alarm at step {step}: acceptance length fell to {acceptance:.2f} "
                f"right after the update to policy version {version} (running {running:.2f}; "
                "stale drafter weights?)"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "seen": self.seen, "version": self.version,
                "disabled": self.disabled}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.level, self.seen = state.get("level"), int(state.get("seen", 0))
        self.version, self.disabled = state.get("version"), bool(state.get("disabled", False))

    def spec_override(self) -> SpecConfig | None:
        """A plain-decoding ``SpecConfig`` once an alarm turned speculation off, else ``None``."""
        return SpecConfig("none", 0) if self.disabled else None


def alarm_fields(
    alarm: AcceptanceAlarm, step: int, metrics: Mapping[str, Any], version: int
) -> dict[str, Any]:
    """The acceptance-alarm fields of a step's row (``metrics``: its rollout metrics)."""
    acceptance = float(metrics.get("draft_acceptance_length", 0.0))
    message = alarm.observe(step, acceptance, int(metrics.get("drafting_steps", 0)), version)
    if message is None:
        return {"acceptance_alarm": 0}
    return {"acceptance_alarm": 1, "acceptance_warning": message}


def alarm_line(row: Mapping[str, Any]) -> str | None:
    """The console line of a row whose acceptance alarm fired, else ``None``."""
    return f"warning: {row['acceptance_warning']}" if row.get("acceptance_alarm") else None
