"""'Applies only' in the simulator, complete by construction (issue 56): every input of a
scenario and every field of each spec is classified, and every rule refuses.

Contract checked: ``settings.coverage_problems`` finds no field in no class in ``Scenario``
(``scenario.COVERAGE``) nor in any ``Spec`` (``coverage``); each scenario rule refuses its input
given by ``--set`` (a value other than its default) where its condition fails, naming both keys
in one ``SimInputError`` line, and accepts it where the condition holds; a scenario file is
refused for an input it sets where that cannot apply, unless an override changed what the input
depends on; each ``checked`` input is refused by ``check_scenario``; a spec field given a value
other than its default where its spec cannot apply it is refused, and a drafter field a kind
does not read changes nothing of that kind's cost.
"""

from __future__ import annotations

import tomllib

import pytest
import tomlkit

from specrl import settings
from specrl.costmodel.drafters import DRAFTER_KINDS, draft_forward
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import (
    DRAFTER_FIELDS,
    DrafterSpec,
    HardwareSpec,
    ModelSpec,
    Spec,
    build_spec,
    list_specs,
    load_drafter,
    load_hardware,
    load_model,
    load_toml,
    spec_to_toml,
)
from specrl.settings import AppliesOnly, coverage_problems, value_at
from specrl.sim.scenario import APPLIES_ONLY, COVERAGE, Scenario, load_scenario
from specrl.sim.training import TrainingEfficiency
from specrl.sim.validate import check_scenario

BASE = "paper-8b-sync"  # sync, dense, EAGLE-3, constant acceptance, sampled lengths
ACC = "speculation.acceptance"
CANDIDATES: list[list[str]] = [
    [],
    ["pipeline.mode=async"],
    [f"{ACC}.kind=positional"],
    [f"{ACC}.kind=drift"],
    [f"{ACC}.kind=positional", f"{ACC}.per_position=[0.8]"],
    ["workload.length_trace=[100, 200]"],
    ["generation.ep=2"],
    ["speculation.tree_verify_tokens=8"],
]
VALUES = {  # a value other than the input's default, for each input with a rule (TOML)
    "pipeline.staleness": "3",
    "pipeline.async_generation": '"drain"',
    "pipeline.warmup_periods": "2",
    "pipeline.measure_periods": "3",
    f"{ACC}.per_position": "[0.8, 0.5]",
    f"{ACC}.decay_per_1k_tokens": "0.05",
    f"{ACC}.decay_per_rl_step": "0.01",
    f"{ACC}.floor": "0.1",
    f"{ACC}.decay_after_tokens": "100",
    "workload.rl_step": "4",
    f"{ACC}.acceptance_length": "2.5",
    f"{ACC}.at_k": "4",
    f"{ACC}.position_ratio": "0.9",
    f"{ACC}.measured_over": '"rollout"',
    "workload.seed": "7",
    "workload.response_sigma": "0.5",
    "workload.mean_is_after_cap": "true",
    "generation.routing_skew": "1.3",
    "speculation.draft_coverage": "[0.9, 0.5]",
}


def where(holds: bool, rules: list[AppliesOnly]) -> list[str]:
    """The first candidate where every one of ``rules`` holds (``holds``) or the first fails."""
    for sets in CANDIDATES:
        sc = load_scenario(BASE, sets)
        if (all if holds else any)(rule.holds(sc) is holds for rule in rules):
            return sets
    pytest.fail(f"no candidate where {[r.key for r in rules]} {'hold' if holds else 'fail'}")


# --------------------------------------------------------------------------- classification


def all_specs(cls: type[Spec] = Spec) -> set[type[Spec]]:
    return {sub for direct in cls.__subclasses__() for sub in {direct, *all_specs(direct)}}


def test_every_scenario_input_and_spec_field_is_classified():
    assert coverage_problems(Scenario, COVERAGE) == []
    specs = {ModelSpec, HardwareSpec, DrafterSpec, TrainingEfficiency}
    assert all_specs() == specs  # a spec added later is walked too
    for cls in specs:
        assert coverage_problems(cls, cls.coverage) == [], cls.__name__


def test_every_ruled_input_has_a_test_value():
    assert {rule.key for rule in APPLIES_ONLY} == set(VALUES)


@pytest.mark.parametrize("rule", APPLIES_ONLY, ids=[f"{r.key}|{r.condition}" for r in APPLIES_ONLY])
def test_every_scenario_rule_refuses_where_its_condition_fails(rule):
    item = f"{rule.key}={VALUES[rule.key]}"
    value = settings.parse_override(item)[1]
    assert value != value_at(load_scenario(BASE), rule.key)
    with pytest.raises(SimInputError) as e:
        load_scenario(BASE, [*where(False, [rule]), item])
    message = str(e.value)
    assert "\n" not in message
    assert f"{rule.key}=" in message and f"needs {rule.condition} (it is set, and " in message
    assert all(f"{other} is " in message for other in rule.others)
    ruled = [r for r in APPLIES_ONLY if r.key == rule.key]
    assert value_at(load_scenario(BASE, [*where(True, ruled), item]), rule.key) == value


def test_the_known_cases_read_as_one_line():
    with pytest.raises(SimInputError) as e:
        load_scenario(BASE, [f"{ACC}.decay_per_1k_tokens=0.05"])
    assert str(e.value) == (
        f"{ACC}.decay_per_1k_tokens=0.05 needs {ACC}.kind='drift' (it is set, and {ACC}.kind is "
        "'constant')"
    )
    with pytest.raises(SimInputError, match=rf"^{ACC}.per_position=\[0.5\] needs {ACC}.kind="):
        load_scenario(BASE, [f"{ACC}.per_position=[0.5]"])


def test_a_file_is_refused_for_what_it_sets_where_it_cannot_apply(tmp_path):
    """A scenario file's own inputs are checked too, unless an override changed what they
    depend on (``--set pipeline.mode=sync`` on an async scenario is its sync baseline)."""
    data, _ = load_toml("scenarios", BASE)
    data["speculation"]["acceptance"]["floor"] = 0.2  # constant: no floor
    path = tmp_path / "mine.toml"
    path.write_text(tomlkit.dumps(data))
    with pytest.raises(SimInputError, match=f"^{ACC}.floor=0.2 needs {ACC}.kind='drift'"):
        load_scenario(str(path))
    assert load_scenario(str(path), [f"{ACC}.kind=drift"]).speculation.acceptance.floor == 0.2
    moved = load_scenario(str(path), [f"{ACC}.kind=positional", f"{ACC}.kind=constant"])
    assert moved.speculation.acceptance.floor == 0.2  # the kind came from an override: kept
    sync = load_scenario("paper-235b-async", ["pipeline.mode=sync", "training.gpus=0"])
    assert sync.pipeline.staleness == load_scenario("paper-235b-async").pipeline.staleness


def test_every_bundled_scenario_and_spec_loads():
    for name in list_specs("scenarios"):
        load_scenario(name)
    for kind, load in (("models", load_model), ("hardware", load_hardware),
                       ("drafters", load_drafter)):  # fmt: skip
        for name in list_specs(kind):
            load(name)


# --------------------------------------------------------------------------- checked against specs


CHECKED = {  # for each ``checked`` input: (scenario, overrides) check_scenario refuses, and words
    "training.gpus": (BASE, ["training.gpus=8"], "training.gpus=8 with pipeline.mode=sync"),
    "generation.routing_locality": (BASE, ["generation.routing_locality=0.5"],
                                    "generation.routing_locality=0.5 needs a mixture-of-experts"),
    "engine.eager_s_per_layer": (BASE, ["engine.eager_s_per_layer=1e-4"],
                                 "engine.eager_s_per_layer=0.0001 needs "
                                 "engine.graph_capture_tokens > 0"),
    "engine.cpu_s_per_ctx_token": (BASE, ["engine.cpu_s_per_ctx_token=1e-7"],
                                   "engine.cpu_s_per_ctx_token=1e-07 needs a model-free drafter"),
    "training.train_drafter": ("paper-8b-rlzero-ngram-sync", ["training.train_drafter=true"],
                               "training.train_drafter=true needs a drafter with weights"),
    **{f"engine.{key}": (BASE, [f"engine.{key}=0.5"],
                         f"engine.{key}=0.5 needs a mixture-of-experts model; qwen3-8b is dense")
       for key in ("moe_layer_s", "expert_s", "eta_expert_mem")},
}  # fmt: skip


def test_every_checked_input_has_an_example():
    assert set(CHECKED) == {key for key, _ in COVERAGE.checked}


@pytest.mark.parametrize("key", sorted(CHECKED))
def test_every_checked_input_is_refused_by_check_scenario(key):
    name, sets, words = CHECKED[key]
    sc = load_scenario(name, sets)  # the scenario alone cannot tell
    with pytest.raises(SimInputError) as e:
        check_scenario(sc)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_checked_inputs_pass_where_the_specs_read_them():
    check_scenario(load_scenario(BASE, ["engine.graph_capture_tokens=1024",
                                        "engine.eager_s_per_layer=1e-4"]))  # fmt: skip
    check_scenario(load_scenario(BASE, ["training.train_drafter=true"]))
    check_scenario(load_scenario("paper-8b-rlzero-ngram-sync", ["engine.cpu_s_per_ctx_token=1e-7"]))
    check_scenario(load_scenario("paper-235b-async", ["generation.routing_locality=0.5"]))
    moe_terms = ["engine.moe_layer_s=1e-5", "engine.expert_s=1e-6", "engine.eta_expert_mem=0.5"]
    check_scenario(load_scenario("paper-235b-async", moe_terms))
    off = load_scenario(BASE, ["speculation.enabled=false", "engine.cpu_s_per_ctx_token=1e-7"])
    check_scenario(off)  # kept: the baseline switch keeps speculative inputs


# --------------------------------------------------------------------------- specs


SPEC_CASES = [  # (class, data where the rule fails, field, a value other than its default)
    *((ModelSpec, "qwen3-8b", key, value) for key, value in
      (("experts_per_token", 8), ("shared_experts", 1), ("moe_layers", 4),
       ("moe_intermediate", 512), ("expert_popularity", (0.5, 0.5)))),
    (HardwareSpec, "h100", "eager_s_per_layer", 1e-4),
    (TrainingEfficiency, {"model_class": "dense", "train_mfu": 0.4, "logprob_mfu": 0.4},
     "expert_parallel", 8),
    *((DrafterSpec, {"name": "d", "kind": next(k for k, r in DRAFTER_FIELDS.items()
                                                if key not in r)}, key, value)
      for key, value in (("layers", 2), ("draft_vocab", 1000), ("intermediate", 1024),
                         ("model", "qwen3-0.6b"), ("cpu_s_per_seq", 1e-5),
                         ("cpu_s_per_ctx_token", 1e-7))),
]  # fmt: skip


def spec_data(cls: type[Spec], base: str | dict) -> dict:
    kind = {ModelSpec: "models", HardwareSpec: "hardware"}.get(cls)
    return dict(base) if isinstance(base, dict) else load_toml(kind, base)[0]


def test_every_spec_rule_has_a_case():
    assert {(c, key) for c, _, key, _ in SPEC_CASES} == {
        (cls, rule.key) for cls in all_specs() for rule in cls.coverage.rules
    }


@pytest.mark.parametrize(("cls", "base", "key", "value"), SPEC_CASES,
                         ids=[f"{c.__name__}.{k}" for c, _, k, _ in SPEC_CASES])  # fmt: skip
def test_a_spec_field_its_spec_cannot_apply_is_refused(cls, base, key, value):
    data = spec_data(cls, base)
    rule = next(r for r in cls.coverage.rules if r.key == key)
    with pytest.raises(SimInputError) as e:
        build_spec(cls, {**data, key: value}, "spec", "my.toml")
    assert str(e.value).startswith(f"my.toml: {key}={value!r} needs {rule.condition} (it is set")
    default = cls.model_fields[key].get_default()
    assert value_at(build_spec(cls, {**data, key: default}, "spec"), key) == default  # written


def test_a_drafter_field_a_kind_does_not_read_changes_nothing():
    """``DRAFTER_FIELDS`` is what each kind's builder reads: a field it does not list leaves the
    kind's draft forward and CPU cost as they were; one it lists changes one of them."""
    from specrl.costmodel.cost import StepCostModel

    assert set(DRAFTER_FIELDS) == set(DRAFTER_KINDS)
    target, hw = load_model("qwen3-8b"), load_hardware("h100")
    changed = {"layers": 2, "draft_vocab": 1000, "intermediate": 1024, "model": "qwen3-8b",
               "cpu_s_per_seq": 1e-3, "cpu_s_per_ctx_token": 1e-6}  # fmt: skip
    base = {"model": "qwen3-0.6b"}

    def cost(spec: DrafterSpec) -> tuple:
        costs = StepCostModel(target=target, hw=hw, gpus=1, drafter=spec)
        return draft_forward(spec, target), costs.draft(64, 3, 1000.0)

    for kind, reads in DRAFTER_FIELDS.items():
        plain = cost(DrafterSpec(name="d", kind=kind, **base))
        for key, value in changed.items():
            moved = cost(DrafterSpec(name="d", kind=kind, **{**base, key: value}))
            assert (moved != plain) is (key in reads), (kind, key)


def test_a_spec_written_whole_reads_back():
    """``spec_to_toml`` writes every field; a default where the kind cannot apply it is no
    refusal (calibrate writes model-free drafters and profiles this way)."""
    for spec in (load_drafter("ngram"), load_hardware("h100"), load_drafter("eagle3")):
        kind = "drafters" if isinstance(spec, DrafterSpec) else "hardware"
        data = tomllib.loads(spec_to_toml(spec))
        assert build_spec(type(spec), data, kind) == spec
