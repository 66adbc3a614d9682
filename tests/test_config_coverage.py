"""'Applies only', complete by construction (issue 56): every field of ``Config`` is classified in
``config.COVERAGE``, and every rule refuses.

Contract checked: ``settings.coverage_problems`` walks every field of every section and names
one in no class (a rule, always applying, checked at build, kept with its reason) and every name
or condition field that is no field; each ``APPLIES_ONLY`` rule refuses its field set to a value
other than its default where its condition fails (one ``ConfigError`` line naming the field and
each field of the condition) and accepts that value where every rule of the field holds; each
``checked`` field is refused by its build-time check; a stored config.toml holding fields that
cannot apply still loads (``load_run_config`` drops them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomlkit

from specrl import settings
from specrl.config import (
    APPLIES_ONLY,
    COVERAGE,
    UNLEARNED_SPECS,
    Config,
    ConfigError,
    load_config,
    load_run_config,
    validate_config,
)
from specrl.envs.synthetic import IdCodec, ModFourEnv
from specrl.pipelines.build import build_run
from specrl.settings import AppliesOnly, Coverage, Section, coverage_problems, value_at
from tests.conftest import make_tiny

# Override sets searched for a configuration where a rule fails, and one where all of a field's
# rules hold (a rule added later finds its own here, or the test says which rule lacks one).
CANDIDATES: list[list[str]] = [
    [],
    ["rollout.spec=none"],
    ["rollout.backend=vllm"],
    ["pipeline.mode=async"],
    ["pipeline.mode=async", "pipeline.update=in_flight"],
    ["cluster.rollout_workers=1"],
    ["cluster.train_workers=2"],
    ['env.kind="file"', 'env.train_file="a.jsonl"'],
    ["reward.workers=0"],
    ["run.checkpoint_every=0"],
    ['reward.funcs=["regex"]', 'reward.pattern="x"'],
    ["learner.correction=tis"],
    ["learner.advantage=rloo"],
    ["learner.dtype=fp32"],
    ["model.device=cpu"],
    ["rollout.spec=eagle3"],
    ["rollout.spec=eagle3", "drafter.mode=frozen"],
    ["rollout.spec=eagle3", "drafter.mode=online"],
]
HERE = str(Path(__file__).parent)  # a path that exists (rollout.drafter_path is checked)
VALUES = {  # a value other than the field's default, for each field with a rule (TOML)
    "pipeline.max_staleness": "3",
    "pipeline.update": '"in_flight"',
    "pipeline.in_flight_tokens": '"keep"',
    "cluster.address": '"10.0.0.5:6379"',
    "cluster.placement": '"spread"',
    "cluster.threads": "2",
    "cluster.worker_cpus": "1.5",
    "cluster.worker_gpus": "1.0",
    "cluster.max_restarts": "5",
    "rollout.num_spec_tokens": "5",
    "rollout.spec_siblings": "2",
    "rollout.spec_exact": '"distribution"',
    "rollout.max_tokens_per_forward": "64",
    "rollout.alarm_action": '"disable_spec"',
    "rollout.step_graphs": '"static"',
    "learner.routing_replay": "true",
    "rollout.drafter_path": f'"{HERE}"',
    "env.train_file": '"b.jsonl"',
    "env.eval_file": '"e.jsonl"',
    "env.prompt_column": '"q"',
    "env.answer_column": '"a"',
    "env.system_prompt": '"be brief"',
    "env.max_prompt_tokens": "100",
    "env.task": '"leg_counting"',
    "env.task_config": "{min_terms=3}",
    "env.template": '"step_by_step"',
    "env.format_bonus": "0.1",
    "env.seed": "5",
    "run.final_checkpoint": '"weights"',
    "reward.timeout_s": "5.0",
    "reward.pattern": '"y"',
    "learner.is_cap": "3.0",
    "learner.normalize_std": "false",
    "learner.bf16_mode": '"params"',
    "learner.head_precision": '"fp32"',
    "model.gpu_memory_utilization": "0.5",
    "drafter.time_share": "0.2",
    "drafter.lr": "1e-3",
    "drafter.batch_tokens": "512",
    "drafter.buffer_steps": "2",
    "drafter.max_updates": "4",
    "drafter.drift_tolerance": "0.2",
    "drafter.max_lag": "4",
    "drafter.vocab": "16",
}


def unchecked(sets: list[str]) -> Config:
    """The config of ``sets`` without the refusal of fields that cannot apply."""
    return validate_config(settings.apply_overrides({}, sets), check_applies=False)


def where(holds: bool, rules: list[AppliesOnly]) -> list[str]:
    """The first candidate where every one of ``rules`` holds (``holds``) or the first fails."""
    for sets in CANDIDATES:
        cfg = unchecked(sets)
        if (all if holds else any)(rule.holds(cfg) is holds for rule in rules):
            return sets
    pytest.fail(f"no candidate where {[r.key for r in rules]} {'hold' if holds else 'fail'}")


# --------------------------------------------------------------------------- classification


def test_every_config_field_is_classified():
    """A field added later without a rule or an ``always`` entry fails here, by name."""
    assert coverage_problems(Config, COVERAGE) == []
    walked = settings.leaf_keys(Config)
    assert len(walked) >= 89 and "drafter.lr" in walked and "cluster.max_restarts" in walked


def test_the_walk_names_what_is_in_no_class():
    class Inner(Section):
        a: int = 0
        b: int = 0

    class Outer(Section):
        inner: Inner = Inner()
        c: bool = False

    cover = Coverage(
        rules=(AppliesOnly("inner.a", "nowhere", bool, " on"),),
        always=("c", "inner.c"),
    )
    assert coverage_problems(Outer, cover) == [
        "inner.b: in no class",
        "inner.c: no such field",
        "nowhere: no such field",
    ]
    both = Coverage(rules=(AppliesOnly("inner.a", "c", bool, " on"),), always=("inner.a",))
    assert "inner.a: always and conditional" in coverage_problems(Outer, both)


def test_every_ruled_field_has_a_test_value():
    assert {rule.key for rule in APPLIES_ONLY} == set(VALUES)


def test_the_unlearned_specs_are_the_registry_s():
    from specrl.rollout_plan import learned_drafter
    from specrl.spec.proposers import PROPOSERS, available_proposers

    # a benchmark's drafters (specrl.gpubench.oracle) register when a benchmark runs in-process
    ours = [p for p in available_proposers() if PROPOSERS[p].__module__.startswith("specrl.spec")]
    unlearned = {"none", *(p for p in ours if not learned_drafter(p))}
    assert unlearned == set(UNLEARNED_SPECS)


# --------------------------------------------------------------------------- every rule refuses


@pytest.mark.parametrize("rule", APPLIES_ONLY, ids=[f"{r.key}|{r.condition}" for r in APPLIES_ONLY])
def test_every_rule_refuses_where_its_condition_fails(rule):
    item = f"{rule.key}={VALUES[rule.key]}"
    value = settings.parse_override(item)[1]
    assert value != value_at(Config(), rule.key)  # a value other than the default
    with pytest.raises(ConfigError) as e:
        load_config(None, [*where(False, [rule]), item])
    message = str(e.value)
    assert "\n" not in message
    assert f"{rule.key}=" in message and f"needs {rule.condition} (it is set, and " in message
    assert all(f"{other} is " in message for other in rule.others)
    ruled = [r for r in APPLIES_ONLY if r.key == rule.key]
    cfg = load_config(None, [*where(True, ruled), item])  # the rule is all that refused it
    assert value_at(cfg, rule.key) == value


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["rollout.spec=suffix", "drafter.lr=1e-3"],
         "drafter.lr=0.001 needs rollout.spec of a learned drafter (not 'none', 'ngram', "
         "'suffix' or 'self') (it is set, and rollout.spec is 'suffix')"),
        (["rollout.spec=eagle3", "drafter.mode=frozen", "drafter.max_updates=4"],
         "drafter.max_updates=4 needs drafter.mode other than 'frozen'"),
        (["rollout.spec=eagle3", "drafter.mode=online", "drafter.max_lag=4"],
         "drafter.max_lag=4 needs drafter.mode 'refresh' or 'auto'"),
        (['cluster.address="auto"'],
         "cluster.address='auto' needs cluster.rollout_workers > 0 or cluster.train_workers > 1 "
         "(it is set, and cluster.rollout_workers is 0, cluster.train_workers is 1)"),
        (["learner.advantage=rloo", "learner.normalize_std=false"],
         "learner.normalize_std=False needs learner.advantage='grpo'"),
        (['env.kind="file"', 'env.train_file="a.jsonl"', "env.seed=3"],
         "env.seed=3 needs env.kind='reasoning_gym'"),
    ],
)  # fmt: skip
def test_the_new_refusals_read_as_one_line(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_ray_settings_apply_with_train_workers_alone():
    """cluster.address and cluster.threads are read by the train workers' Ray session too."""
    cfg = load_config(
        None, ["cluster.train_workers=2", 'cluster.address="auto"', "cluster.threads=2"]
    )
    assert (cfg.cluster.address, cfg.cluster.threads) == ("auto", 2)


CHECKED = {  # for each ``checked`` field: overrides its build-time check refuses, and the words
    "rollout.threads": (["rollout.threads=1"], "rollout.threads=1 needs the engine in a worker"),
    "rollout.spec_siblings": (["rollout.spec=ngram", "rollout.spec_siblings=2"],
                              "applies only to a stochastic drafter"),
    "drafter.mode": (["rollout.spec=suffix", "drafter.mode=online"],
                     "drafter.mode='online' needs a learned drafter"),
}  # fmt: skip
# checked fields only the model can decide: refused when the run is built over a dense one
CHECKED_WITH_MODEL = {
    "learner.routing_replay": (["learner.routing_replay=true"],
                               "learner.routing_replay needs a mixture-of-experts policy"),
    "learner.moe_aux_loss_coef": (["learner.moe_aux_loss_coef=0.01"],
                                  "learner.moe_aux_loss_coef > 0 needs a mixture-of-experts"),
}  # fmt: skip


def test_every_checked_field_has_an_example():
    assert set(CHECKED) | set(CHECKED_WITH_MODEL) == {key for key, _ in COVERAGE.checked}


@pytest.mark.parametrize("key", sorted(CHECKED))
def test_every_checked_field_is_refused_at_build(key):
    from specrl.backends import plan_rollout

    sets, words = CHECKED[key]
    cfg = load_config(None, sets)  # the config alone cannot tell
    with pytest.raises(ConfigError) as e:
        plan_rollout(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", sorted(CHECKED_WITH_MODEL))
def test_every_model_checked_field_is_refused_with_a_dense_model(key):
    sets, words = CHECKED_WITH_MODEL[key]
    cfg = load_config(None, ["rollout.placement=inline", *sets])
    with pytest.raises(ValueError) as e:
        build_run(cfg, model=make_tiny(), codec=IdCodec(), env=ModFourEnv(8)).close()
    assert words in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- stored configs


def test_a_stored_config_holding_every_field_still_loads(tmp_path):
    """An older specrl wrote every field of config.toml: those a rule now refuses where they
    cannot apply (drafter.* under spec 'suffix', env.seed of a file task) had no effect and are
    dropped on a resume; the ones that apply stay."""
    dumped = Config().model_dump(mode="json")
    dumped["env"] |= {"kind": "file", "train_file": "a.jsonl"}
    dumped["drafter"]["lr"] = 1e-3  # moot under the default spec 'suffix'
    table = {s: {k: v for k, v in fields.items() if v is not None} for s, fields in dumped.items()}
    path = tmp_path / "config.toml"
    path.write_text(tomlkit.dumps(table))
    with pytest.raises(ConfigError, match="drafter.lr=0.001 needs rollout.spec"):
        load_config(path)  # as a new run's file it is refused
    cfg = load_run_config(path)
    assert cfg.env.kind == "file" and cfg.drafter.lr == Config().drafter.lr
    assert cfg.learner.normalize_std is True  # advantage 'grpo': it applies, kept
    assert load_run_config(path, ["rollout.spec=eagle3"]).drafter.lr == 1e-3  # applies again


def test_to_toml_comments_out_what_cannot_apply():
    text = Config().to_toml()  # spec 'suffix': nothing learned
    assert "# lr: AdamW learning rate of the drafter. (applies only with rollout.spec of a " in text
    assert "\nlr = 0.0005" not in text
    cfg = load_config(None, ["rollout.spec=eagle3"])
    assert "\nlr = 0.0005" in cfg.to_toml()
    assert load_config(tomlkit.parse(Config().to_toml()).unwrap()) == Config()
