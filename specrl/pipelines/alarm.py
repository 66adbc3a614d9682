"""The acceptance alarm: a drafter whose drafts stop being accepted after a weight sync.

``AcceptanceAlarm(action).observe(step, acceptance, drafts, version)`` returns a one-line
warning once a drafter that normally accepts collapses, or falls right after a refit (steps with
too few drafts are no evidence); ``action = "disable_spec"`` also turns speculation off for the
rest of the run (``spec_override()``). Its state round-trips through a checkpoint.
``alarm_fields`` gives a step row's fields, ``alarm_line`` a row's console line.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from specrl.spec.config import SpecConfig

MIN_DRAFTS = 32  # drafting (row, verify step) pairs that make a step evidence
WARMUP = 3  # steps with evidence before the alarm may fire
MIN_GAIN = 0.2  # running acceptance - 1 of a drafter that "normally accepts"
COLLAPSED = 1.05  # acceptance length at or below this: nothing is accepted any more
DROP = 0.5  # right after a refit, a gain below this share of the running gain alarms
DECAY = 0.7  # EMA weight of the running level

AlarmAction = Literal["warn", "disable_spec"]


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
