"""The one registry mechanism (``specrl.registry``): names, did-you-mean errors, duplicates
refused, discovery on first read; and every kind of named thing looked up from config uses it."""

from __future__ import annotations

import pytest

from specrl.registry import Registry, UnknownName


def _colours() -> Registry[int]:
    reg: Registry[int] = Registry("colour")

    @reg.register("red")
    def red() -> int:
        return 1

    reg.register("green", 2)
    reg.register("blue", 3)
    return reg


def test_register_get_and_names():
    reg = _colours()
    assert reg.get("red")() == 1 and reg["green"] == 2
    assert reg.names() == ["blue", "green", "red"] == list(reg)
    assert [name for name, _ in reg.items()] == reg.names()
    assert "blue" in reg and "grey" not in reg and len(reg) == 3


def test_an_unknown_name_says_did_you_mean_and_the_valid_names():
    reg = _colours()
    with pytest.raises(UnknownName) as info:
        reg.get("gren")
    assert str(info.value) == "unknown colour 'gren' (did you mean green?); valid: blue, green, red"
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(KeyError, match="valid: blue, green, red"):
        reg["purple"]  # no close match: no suggestion
    assert "did you mean" not in str(UnknownName("x"))


def test_a_taken_name_is_refused():
    reg = _colours()
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        reg.register("red", 4)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("red")(reg.get("red"))  # the same object again, too
    assert reg.get("green") == 2


def test_discovery_runs_once_before_the_first_read_and_again_after_a_failure():
    calls = []

    def discover() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise ImportError("flaky")
        reg.register("late", 7)

    reg: Registry[int] = Registry("thing", discover=discover)
    with pytest.raises(ImportError):
        reg.names()
    assert reg.get("late") == 7 and "late" in reg and reg.names() == ["late"]
    assert calls == [0, 1]


def test_every_kind_of_named_thing_uses_the_one_registry():
    from specrl.backends import REGISTRY
    from specrl.rl.advantages import ADVANTAGES
    from specrl.rl.corrections import CORRECTIONS
    from specrl.rl.losses import LOSSES
    from specrl.spec.proposers import PROPOSERS, get_proposer_class

    kinds = {
        "policy loss": LOSSES,
        "advantage estimator": ADVANTAGES,
        "off-policy correction": CORRECTIONS,
        "proposer": PROPOSERS,
        "rollout backend": REGISTRY,
    }
    for kind, registry in kinds.items():
        assert isinstance(registry, Registry) and registry.kind == kind
    assert {"native", "vllm"} <= set(REGISTRY) and "suffix" in PROPOSERS
    with pytest.raises(KeyError, match=r"unknown proposer 'sufix' \(did you mean suffix\?\)"):
        get_proposer_class("sufix")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'rlo' \(did you mean rloo"):
        ADVANTAGES.get("rlo")
