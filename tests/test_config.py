"""Run configuration: defaults, TOML round trip, overrides and one-line errors naming the key;
registered names (task, template, drafter, loss, advantage, correction) checked by
``pipelines.validate.check_names``."""

import pytest

from specrl.backends import plan_rollout
from specrl.config import Config, ConfigError, load_config, parse_override, preset_names
from specrl.pipelines.validate import check_names


def test_default_config_is_complete_and_documented():
    cfg = Config()
    assert cfg.rollout.group_size >= 2 and cfg.run.steps >= 1
    for section in ("model", "env", "rollout", "learner", "run"):
        fields = type(getattr(cfg, section)).model_fields
        for name, info in fields.items():
            assert info.description, f"{section}.{name} has no description"


def test_toml_round_trip(tmp_path):
    sets = ["learner.lr=3e-6", "env.task_config.max_digits=2", "env.task_config.operators=['+']"]
    cfg = load_config(None, [*sets, "learner.betas=[0.8, 0.95]", "learner.clip_eps_high=0.28"])
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    assert "# AdamW learning rate." in cfg.to_toml()
    again = load_config(path)
    assert again == cfg
    assert again.learner.lr == 3e-6 and again.env.task_config["max_digits"] == 2
    assert again.env.task_config["operators"] == ["+"]
    assert again.learner.betas == (0.8, 0.95)
    assert load_config(path, ["learner.clip_eps_high=0.3"]).learner.clip_eps_high == 0.3


def test_overrides_parse_types_and_bare_strings():
    cfg = load_config(None, ["env.task=leg_counting", "rollout.spec=none", "learner.dtype=fp32",
                             "rollout.temperature=0.7", "env.num_eval=0",
                             "run.eval_every=0"])  # fmt: skip
    assert cfg.env.task == "leg_counting" and cfg.rollout.spec == "none"
    assert cfg.rollout.temperature == 0.7 and cfg.env.num_eval == 0
    assert parse_override("a.b = 3") == (["a", "b"], 3)
    assert parse_override('a.b="x y"') == (["a", "b"], "x y")


@pytest.mark.parametrize(
    "override, words",
    [
        ("learner.lr=-1", ["learner.lr", "greater than 0", "-1"]),
        ("learner.lr=fast", ["learner.lr", "fast"]),
        ("rollout.group_size=2.5", ["rollout.group_size", "2.5"]),
        ("rollout.top_p=0", ["rollout.top_p", "0"]),
        ("rollout.spec_siblings=17", ["rollout.spec_siblings", "16", "17"]),
        ("rollout.max_tokens_per_forward=0", ["rollout.max_tokens_per_forward", "'auto'", "0"]),
        ("rollout.max_tokens_per_forward=autox", ["rollout.max_tokens_per_forward", "autox"]),
        ("learner.betas=[0.9, 1.5]", ["learner.betas", "[0, 1)"]),
        ("learner.lrr=1e-5", ["unknown config key", "learner.lrr"]),
        ("trainer.lr=1e-5", ["unknown config key", "trainer"]),
        ("rollout.drafter_path=/no/such/file.safetensors", ["rollout.drafter_path", "not found"]),
    ],
)
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize(
    "override, words",
    [
        ("rollout.spec=medusa", ["rollout.spec", "medusa", "suffix"]),
        ("rollout.spec=sufix", ["rollout.spec", "did you mean suffix"]),
        ("learner.loss=grpoo", ["learner.loss", "grpoo", "did you mean grpo"]),
        ("learner.advantage=rlo", ["learner.advantage", "rloo"]),
        ("learner.correction=tiss", ["learner.correction", "did you mean tis"]),
        ("env.task=leg_countin", ["env.task", "leg_counting"]),
        ("env.template=tags", ["env.template", "answer_tag"]),
        ("env.task_config.max_digitz=2", ["env.task_config", "max_digitz"]),
        ("env.task_config.max_digits=0", ["env.task_config", "basic_arithmetic"]),
    ],
)
def test_unknown_names_name_the_key(override, words):
    cfg = load_config(None, [override])  # config.py checks types and bounds, not registries
    with pytest.raises(ConfigError) as e:  # build_run's first checks: names, then the rollout plan
        check_names(cfg)
        plan_rollout(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize(
    "override, words",
    [
        ("run.steps=true", ["run.steps", "expected an integer", "got true"]),
        ("run.steps=2.0", ["run.steps", "expected an integer", "got 2.0"]),
        ('run.steps="3"', ["run.steps", "expected an integer", '"3"']),
        ("rollout.group_size=false", ["rollout.group_size", "expected an integer"]),
        ('learner.lr="1e-5"', ["learner.lr", "expected a number", '"1e-5"']),
        ("learner.lr=true", ["learner.lr", "expected a number", "got true"]),
        ("learner.normalize_std=1", ["learner.normalize_std", "expected true or false"]),
        ("learner.share_prompts=yes", ["learner.share_prompts", "expected true or false"]),
        ("rollout.temperature=inf", ["rollout.temperature", "finite", "got inf"]),
        ("learner.max_grad_norm=nan", ["learner.max_grad_norm", "finite", "got nan"]),
        ("learner.kl_coef=inf", ["learner.kl_coef", "finite"]),
        ('learner.betas=[0.9, "x"]', ["learner.betas", "expected a number"]),
        ("learner.betas=[true, 0.9]", ["learner.betas", "expected a number"]),
        ("run.run_dir=5", ["run.run_dir", "expected a string"]),
        ("model=3", ["model", "expected a table"]),
        ("run.seed=268435456", ["run.seed", "268435455"]),
        ("rollout.max_tokens_per_forward=true", ["rollout.max_tokens_per_forward", "'auto'"]),
    ],
)
def test_types_are_strict(override, words):
    """A bool is not an integer, a string is not a number: refused naming key and type."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_legitimate_override_values_still_parse():
    cfg = load_config(None, ["run.steps=3", "learner.lr=1", "learner.betas=[1e-1, 0]",
                             "learner.normalize_std=false", "rollout.max_tokens_per_forward=4",
                             "rollout.top_p=1",
                             "run.seed=268435455", "learner.clip_eps_high=1"])  # fmt: skip
    assert cfg.run.steps == 3 and isinstance(cfg.run.steps, int)
    assert cfg.learner.lr == 1.0 and isinstance(cfg.learner.lr, float)
    assert cfg.learner.betas == (0.1, 0.0) and cfg.learner.normalize_std is False
    assert cfg.rollout.max_tokens_per_forward == 4 and cfg.rollout.top_p == 1.0
    assert cfg.learner.clip_eps_high == 1.0 and cfg.run.seed == 2**28 - 1


def test_check_names_accepts_the_defaults_and_reports_every_bad_name():
    check_names(Config())
    check_names(load_config(None, ["env.task=leg_counting", "rollout.spec=none"]))
    cfg = load_config(None, ["learner.loss=grpoo", "env.template=tags"])
    with pytest.raises(ConfigError, match="env.template.*; bad value for learner.loss"):
        check_names(cfg)


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["learner.lr"])
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\nlr = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[run]\nstepz = 3\n")
    with pytest.raises(ConfigError, match="run.stepz"):
        load_config(unknown)
    with pytest.raises(ConfigError, match="not a table"):
        load_config(None, ["learner.lr=1", "learner.lr.x=2"])
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00 garbage")
    with pytest.raises(ConfigError, match=f"config file {binary} is not UTF-8 text"):
        load_config(binary)


def test_assignment_is_validated():
    cfg = Config()
    with pytest.raises(ValueError):
        cfg.rollout.max_new_tokens = 0


def test_largest_run_seed_keeps_request_seeds_in_the_engine_range():
    """run.seed's bound keeps every derived request seed valid (SamplingParams.validate)."""
    from specrl.config import MAX_RUN_SEED, RunCfg
    from specrl.pipelines.step import request_seed
    from specrl.sampling import MAX_SEED

    bounds = RunCfg.model_fields["steps"].metadata
    most_steps = next(m.le for m in bounds if hasattr(m, "le"))
    most_prompts = 100_000  # env.num_eval's bound: the largest prompt index of one call
    assert 0 <= request_seed(MAX_RUN_SEED, most_steps, most_prompts, 3) <= MAX_SEED


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_names_registered_things(name):
    cfg = load_config(None, [], preset=name)
    check_names(cfg)
    assert cfg != Config()  # a preset that changes nothing is no preset


def test_reasoning_preset_then_file_then_overrides(tmp_path):
    """The preset is the base; a --config file and --set overrides apply over it, table by
    table (a file's [rollout] keeps the preset's other rollout keys)."""
    assert "reasoning" in preset_names()
    cfg = load_config(None, [], preset="reasoning")
    assert cfg.env.template == "step_by_step" and cfg.rollout.max_new_tokens == 512
    path = tmp_path / "run.toml"
    path.write_text("[rollout]\ngroup_size = 4\n")
    cfg = load_config(path, ["rollout.max_new_tokens=128"], preset="reasoning")
    assert cfg.rollout.group_size == 4 and cfg.rollout.max_new_tokens == 128
    assert cfg.env.template == "step_by_step"  # from the preset


def test_unknown_preset_is_one_line_naming_the_presets():
    with pytest.raises(ConfigError, match="unknown preset 'reasonin'.*reasoning") as e:
        load_config(None, [], preset="reasonin")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (['env.kind="file"'], "env.kind='file' needs env.train_file"),
        (['env.kind="file"', 'env.train_file="a.jsonl"', 'env.task="leg_counting"'],
         "env.task='leg_counting' needs env.kind='reasoning_gym'"),
        (['env.train_file="a.jsonl"'], "env.train_file='a.jsonl' needs env.kind='file'"),
        (['reward.funcs=["math", "exact"]', "reward.weights=[1.0]"],
         "reward.weights has 1 values for 2 reward.funcs"),
        (['reward.funcs=["regex"]'], "reward.funcs has 'regex' but reward.pattern is unset"),
        (['reward.pattern="x"'], "reward.pattern='x' needs reward.funcs holding 'regex'"),
        (["reward.workers=0", "reward.timeout_s=5"], "reward.timeout_s=5.0 needs reward.workers"),
    ],
)  # fmt: skip
def test_own_task_settings_that_cannot_hold(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_an_inline_table_override_merges_key_by_key():
    """``--set 'rollout={group_size=2}'`` changes group_size only: earlier overrides and the
    file's values of the section stay (it never replaces the section whole)."""
    sets = ["rollout.max_new_tokens=17", "rollout={group_size=2}",
            "env.task_config={max_terms=3}", "env.task_config={min_terms=3}"]  # fmt: skip
    cfg = load_config(None, sets)
    assert cfg.rollout.group_size == 2 and cfg.rollout.max_new_tokens == 17
    assert cfg.env.task_config == {"max_terms": 3, "min_terms": 3}


def test_nothing_to_evaluate_is_refused():
    with pytest.raises(ConfigError, match="env.num_eval=0 with run.eval_every=8"):
        load_config(None, ["env.num_eval=0"])
    assert load_config(None, ["env.num_eval=0", "run.eval_every=0"]).env.num_eval == 0


def test_is_cap_is_refused_where_no_correction_reads_it():
    with pytest.raises(ConfigError, match="learner.is_cap=3.0 needs learner.correction other"):
        load_config(None, ["learner.is_cap=3.0"])
    assert load_config(None, ["learner.correction=tis", "learner.is_cap=3.0"]).learner.is_cap == 3


def test_a_resume_may_set_what_makes_a_stored_field_moot(tmp_path):
    """config.toml holds every field: ``--set reward.workers=0`` on a resume drops the stored
    reward.timeout_s (it no longer applies) instead of refusing; an override that cannot apply
    is still refused."""
    from specrl.config import load_run_config

    path = tmp_path / "config.toml"
    path.write_text(Config().to_toml())
    assert load_run_config(path, ["reward.workers=0"]).reward.workers == 0
    with pytest.raises(ConfigError, match="reward.timeout_s=5.0 needs reward.workers"):
        load_run_config(path, ["reward.workers=0", "reward.timeout_s=5"])
