"""The acceptance alarm: quiet on a steady run; a warning in the row when acceptance collapses to
~1.0 or falls far below its running level right after a refit (a fake backend reports it);
``rollout.alarm_action = "disable_spec"`` turns speculation off for the rest of the run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from specrl.config import ConfigError
from specrl.pipelines.alarm import MIN_DRAFTS, WARMUP, AcceptanceAlarm, alarm_line
from specrl.pipelines.train import train
from specrl.rollout_types import EngineStats
from tests.pipelines.pipeline_fakes import FakeBackend, fake_parts, tiny_config

DRAFTS = 64  # drafting (row, verify step) pairs per fake rollout (>= MIN_DRAFTS)


class SpeculatingBackend(FakeBackend):
    """A ``FakeBackend`` whose rollouts report speculation statistics: ``DRAFTS`` drafting
    pairs of 3 drafts each, accepted so that the acceptance length is ``schedule(version)``
    (none when the call asks for plain decoding). Records each call's ``spec`` argument."""

    def __init__(self, schedule: Callable[[int], float]) -> None:
        super().__init__()
        self.schedule = schedule
        self.specs: list = []

    def generate(self, requests, spec=None):
        out = super().generate(requests, spec)
        self.specs.append(spec)
        if spec is None or spec.enabled:
            accepted = round((self.schedule(self.version) - 1.0) * DRAFTS)
            out.stats = EngineStats(drafted=3 * DRAFTS, accepted=accepted,
                                    per_position_drafted=[DRAFTS] * 3)  # fmt: skip
        return out


def run(tmp_path, schedule, *overrides: str) -> tuple[list[dict], SpeculatingBackend]:
    backend = SpeculatingBackend(schedule)
    # a drafting spec (the alarm applies only where something drafts); the fake backend drafts
    cfg = tiny_config("run.steps=8", "run.eval_every=0", "rollout.spec=ngram", *overrides)
    return train(fake_parts(cfg, backend), str(tmp_path), progress=False), backend


MODES = [(), ("pipeline.mode=async", "pipeline.max_staleness=1")]


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_a_steady_run_raises_no_alarm(tmp_path, mode):
    rows, _ = run(tmp_path, lambda v: 2.5 + 0.2 * (v % 2), *mode)  # some noise
    assert [r["acceptance_alarm"] for r in rows] == [0] * 8
    assert all("acceptance_warning" not in r for r in rows)
    assert {r["draft_acceptance_length"] for r in rows} == {2.5, 2.703125}
    assert {r["drafting_steps"] for r in rows} == {DRAFTS}


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_acceptance_collapsing_after_a_refit_raises_the_alarm(tmp_path, mode):
    rows, _ = run(tmp_path, lambda v: 2.5 if v < 5 else 1.0, *mode)
    alarmed = [r for r in rows if r["acceptance_alarm"]]
    assert alarmed and alarmed == [r for r in rows if r["behaviour_version"] >= 5]
    first = alarmed[0]
    assert (
        f"acceptance alarm at step {first['step']}: acceptance length 1.00"
        in (first["acceptance_warning"])
    )
    assert "running 2.50" in first["acceptance_warning"]
    assert alarm_line(first) == f"warning: {first['acceptance_warning']}"
    assert alarm_line(rows[0]) is None


def test_a_fall_far_below_the_running_level_after_a_refit_raises_the_alarm(tmp_path):
    rows, _ = run(tmp_path, lambda v: 2.5 if v != 5 else 1.5)
    assert [r["acceptance_alarm"] for r in rows] == [0, 0, 0, 0, 0, 1, 0, 0]
    assert (
        "fell to 1.50 right after the update to policy version 5" in (rows[5]["acceptance_warning"])
    )


def test_disable_spec_turns_speculation_off_after_the_alarm(tmp_path):
    rows, backend = run(tmp_path, lambda v: 2.5 if v < 5 else 1.0,
                        "rollout.alarm_action=disable_spec")  # fmt: skip
    assert [r["acceptance_alarm"] for r in rows] == [0, 0, 0, 0, 0, 1, 0, 0]
    assert "speculation is off for the rest of the run" in rows[5]["acceptance_warning"]
    assert backend.specs[:6] == [None] * 6  # the configured speculation
    assert [s.enabled for s in backend.specs[6:]] == [False, False]
    assert [r["drafting_steps"] for r in rows[6:]] == [0, 0]


# --------------------------------------------------------------------------- the alarm itself


def feed(alarm: AcceptanceAlarm, values, start_version: int = 0) -> list[str | None]:
    return [alarm.observe(i, a, DRAFTS, start_version + i) for i, a in enumerate(values)]


def test_no_alarm_during_warm_up_or_without_evidence():
    assert feed(AcceptanceAlarm(), [2.5] * (WARMUP - 1) + [1.0]) == [None] * WARMUP
    alarm = AcceptanceAlarm()
    feed(alarm, [2.5] * WARMUP)
    assert alarm.observe(9, 1.0, MIN_DRAFTS - 1, 9) is None  # too few drafts to tell
    assert alarm.observe(10, 1.0, MIN_DRAFTS, 10) is not None


def test_a_drafter_that_never_accepts_raises_no_alarm():
    assert feed(AcceptanceAlarm(), [1.1] * 6 + [1.0, 1.0]) == [None] * 8


def test_a_drop_without_a_refit_is_not_a_refit_alarm_but_a_collapse_is():
    alarm = AcceptanceAlarm()
    feed(alarm, [2.5] * 4)
    assert alarm.observe(4, 1.5, DRAFTS, 3) is None  # same policy version: drift, no refit
    assert alarm.observe(5, 1.0, DRAFTS, 3) is not None  # collapsed, refit or not


def test_alarmed_steps_keep_the_running_level_and_state_round_trips():
    alarm = AcceptanceAlarm()
    feed(alarm, [2.5] * 4)
    level = alarm.level
    assert all(m is not None for m in feed(alarm, [1.0] * 3, start_version=4))
    assert alarm.level == level
    copy = AcceptanceAlarm()
    copy.load_state_dict(alarm.state_dict())
    assert copy == alarm
    assert copy.observe(9, 1.0, DRAFTS, 9) == alarm.observe(9, 1.0, DRAFTS, 9)


def test_alarm_action_config():
    assert tiny_config().rollout.alarm_action == "warn"
    spec = "rollout.spec=ngram"
    assert tiny_config(spec, "rollout.alarm_action=disable_spec").rollout.alarm_action == (
        "disable_spec"
    )
    with pytest.raises(ConfigError, match="rollout.alarm_action='disable_spec' needs rollout.spec"):
        tiny_config("rollout.alarm_action=disable_spec")  # spec 'none': nothing drafts
    with pytest.raises(ConfigError, match="rollout.alarm_action") as info:
        tiny_config("rollout.alarm_action=off")
    assert "\n" not in str(info.value)
