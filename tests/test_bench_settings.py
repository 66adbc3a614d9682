"""Settings of ``specrl bench generate`` and ``specrl bench grpo`` (``specrl.config_bench``):
``--config FILE`` and ``--set section.key=value`` over the defaults, the options kept as
shortcuts of one key each, every bad value one ``error:`` line with exit code 2 before any work,
unknown keys with a did-you-mean, the settings recorded in the result and read back equal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from specrl import settings
from specrl.bench import specrl_runner
from specrl.bench_grpo import run_configs
from specrl.cli import app
from specrl.config_bench import (
    GENERATE_APPLIES,
    GENERATE_COVERAGE,
    GRPO_APPLIES,
    GRPO_COVERAGE,
    GenerateBenchCfg,
    GrpoBenchCfg,
    SettingsError,
    load_generate_bench,
    load_grpo_bench,
)
from specrl.spec.config import SpecConfig


class ReachedWork(BaseException):  # noqa: N818 - not an error: the inputs were all accepted
    pass


@pytest.fixture
def no_work(monkeypatch):
    """The benchmarks themselves raise ``ReachedWork`` (their arguments are recorded)."""
    seen: list = []

    def reached(*args, **kwargs):
        seen.append(args[0])
        raise ReachedWork

    monkeypatch.setattr("specrl.bench.run_generate_bench", reached)
    monkeypatch.setattr("specrl.bench_grpo.run_grpo_bench", reached)
    return seen


def invoke(*args: str):
    try:
        return CliRunner().invoke(app, ["bench", *args])
    except ReachedWork:
        return None


def one_error(*args: str) -> str:
    result = invoke(*args)
    assert result is not None, f"work started: {args}"
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
        result.exit_code, result.output)  # fmt: skip
    return lines[0]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--steps", "0"], "bad value for bench.steps: Input should be greater than or equal to 1 "
         "(got 0)"),
        (["--set", "bench.stepz=3"], "unknown bench grpo key 'bench.stepz' (did you mean "
         "bench.steps?); valid keys in [bench]: bench.mode, bench.steps"),
        (["--set", "bench.mode=\"fast\""], "bad value for bench.mode: Input should be 'runs' or "
         "'interleaved' (got \"fast\")"),
        (["--steps", "2", "--warmup", "2"], "bench.warmup=2 leaves none of bench.steps=2"),
        (["--batches", "1,,4"], "--batches must be a comma list of ints, no empty entry"),
        (["--batches", "0"], "bad value for runs.batches[0]"),
        (["--mode", "interleaved", "--ceiling", "--ceiling-accept", "1.5"],
         "bad value for interleaved.ceiling_accept[0]: Input should be less than or equal to 1"),
        (["--ceiling-k", "3"], "--ceiling-k applies only with --mode='interleaved'"),
        (["--mode", "interleaved", "--ceiling-k", "3"], "--ceiling-k applies only with "
         "--ceiling=true"),
        (["--mode", "interleaved", "--batches", "4"], "--batches applies only with "
         "--mode='runs'"),
        (["--set", "bench.mode=\"interleaved\"", "--set", "runs.batches=[4]"],
         "runs.batches=[4] needs bench.mode='runs' (it is set, and bench.mode is 'interleaved')"),
        (["--steps", "2", "--set", "bench.steps=3"], "--steps and --set bench.steps both set "
         "bench.steps: give one"),
        (["--set", "train.rollout.prompts_per_stepp=4"], "unknown train key "
         "'train.rollout.prompts_per_stepp' (did you mean train.rollout.prompts_per_step?)"),
        (["--set", "train.rollout.group_size=0"], "train: bad value for rollout.group_size"),
        (["--set", "train.run.steps=3"], "train.run.steps is set by bench.steps"),
        (["--set", "train.rollout.spec=\"ngram\""], "train.rollout.spec is set by runs.drafters"),
        (["--set", "train=3"], "bad value for train: expected a table (got 3)"),
        (["--drafters", "ngram,bogus"], "runs.drafters 'bogus': bad value for rollout.spec: "
         "unknown speculation method 'bogus'"),
        (["--drafters", "ngram,ngram"], "each drafter once"),
        (["--drafters", "eagle3/x"], "S of NAME/S must be an integer >= 1"),
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--train-config", "/no/such.toml"], "run config /no/such.toml does not exist"),
        (["--set", "train.rollout.backend=\"vllm\""], "needs rollout.backend='native'"),
        (["--mode", "interleaved", "--set", "train.pipeline.mode=\"async\""], "the engine inline"),
        (["--drafters", "ngram", "--set", "train.pipeline.max_staleness=2"],
         "train: pipeline.max_staleness=2 needs pipeline.mode='async'"),
        (["--json", "/proc/specrl-bench.json"], "cannot write --json"),
    ],
)  # fmt: skip
def test_bad_grpo_settings_are_one_line_before_work(no_work, args, match):
    assert match in one_error("grpo", *args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--set", "bench.repeatz=2"], "unknown bench generate key 'bench.repeatz' (did you mean "
         "bench.repeats?)"),
        (["--set", "spec.drafters=[\"ngram\"]", "--set", "spec.num_spec_tokens=17"],
         "bad value for spec.num_spec_tokens: Input should be less than or equal to 16"),
        (["--set", "spec.exact=\"sample\""], "spec.exact='sample' needs spec.drafters naming a "
         "drafter (it is set, and spec.drafters is [])"),
        (["--spec-exact", "sample"], "--spec-exact applies only with --spec naming a drafter"),
        (["--spec", "eagle3,draft", "--drafter", "prefix:1"], "--drafter names one drafter; "
         "--spec has 2 that take one (eagle3, draft)"),
        (["--set", "bench.compare=[\"sglang\"]"], "bad value for bench.compare[0]"),
        (["--set", "spec.drafters=[\"bogus\"]"], "unknown speculation method 'bogus'"),
        (["--set", "bench.group_size=3", "--batch-sizes", "4"], "--group-size 3"),
        (["--set", "model.dtype=\"int8\""], "bad value for model.dtype"),
        (["--repeats", "2", "--set", "bench.repeats=3"], "--repeats and --set bench.repeats "
         "both set bench.repeats: give one"),
    ],
)  # fmt: skip
def test_bad_generate_settings_are_one_line_before_work(no_work, args, match):
    assert match in one_error("generate", *args)


def test_a_config_file_and_sets_reach_the_benchmark(no_work, tmp_path):
    path = tmp_path / "b.toml"
    path.write_text('[bench]\nmode = "interleaved"\nsteps = 3\n[train.rollout]\ngroup_size = 4\n')
    assert invoke("grpo", "--config", str(path), "--warmup", "2", "--set",
                  "train.rollout.prompts_per_step=4") is None  # fmt: skip
    (cfg,) = no_work
    assert (cfg.bench.mode, cfg.bench.steps, cfg.bench.warmup) == ("interleaved", 3, 2)
    assert cfg.train == {"rollout": {"group_size": 4, "prompts_per_step": 4}}
    (run,) = run_configs(cfg).values()  # forwarded to the training run, its steps set
    assert (run.rollout.group_size, run.rollout.prompts_per_step, run.run.steps) == (4, 4, 3)
    assert run.run.eval_every == 0 == run.run.checkpoint_every


def test_a_bad_value_in_a_config_file_names_the_file(no_work, tmp_path):
    path = tmp_path / "b.toml"
    path.write_text("[bench]\nsteps = -1\n")
    assert one_error("grpo", "--config", str(path)) == (
        f"error: {path}: bad value for bench.steps: Input should be greater than or equal to 1 "
        "(got -1)"
    )


@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("grpo", ["--mode", "interleaved", "--preset", "reasoning", "--ceiling",
                  "--ceiling-accept", "1.0,0.8", "--set", "train.rollout.spec=\"eagle3\""]),
        ("grpo", ["--drafters", "ngram,eagle3/2", "--batches", "", "--threads", "2"]),
        ("generate", ["--batch-sizes", "1,4", "--spec", "ngram,suffix", "--spec-exact", "sample",
                      "--group-size", "2", "--repeats", "3"]),
        ("generate", ["--model", "smollm2-135m-instruct", "--dtype", "float32"]),
    ],
)  # fmt: skip
def test_the_recorded_settings_read_back_equal(no_work, tmp_path, command, args):
    """The TOML a result records (``meta.settings``) given back to ``--config`` runs the same
    benchmark."""
    assert invoke(command, *args) is None
    first = no_work.pop()
    recorded = first.to_toml() if command == "grpo" else first.settings
    path = tmp_path / "settings.toml"
    path.write_text(recorded)
    assert invoke(command, "--config", str(path)) is None
    again = no_work.pop()
    if command == "grpo":
        assert again == first
    else:
        assert again.settings == recorded and again == first


def test_a_run_config_key_applies_to_the_variants_it_can():
    cfg = load_grpo_bench(None, ['runs.drafters=["ngram", "eagle3"]',
                                 "train.rollout.num_spec_tokens=5",
                                 'train.rollout.drafter_path="."'])  # fmt: skip
    runs = run_configs(cfg)
    assert runs["none"].rollout.num_spec_tokens == 3  # the default: no speculation there
    assert runs["ngram"].rollout.num_spec_tokens == 5 == runs["eagle3"].rollout.num_spec_tokens
    assert runs["eagle3"].rollout.drafter_path == "." and runs["ngram"].rollout.drafter_path is None
    with pytest.raises(ValueError, match="rollout.drafter_path='.' needs rollout.spec"):
        run_configs(load_grpo_bench(None, ['runs.drafters=["ngram"]',
                                           'train.rollout.drafter_path="."']))  # fmt: skip


@pytest.mark.parametrize(
    ("model", "coverage"),
    [(GenerateBenchCfg, GENERATE_COVERAGE), (GrpoBenchCfg, GRPO_COVERAGE)],
)
def test_every_field_is_classified(model, coverage):
    assert settings.coverage_problems(model, coverage) == []


# A value other than the default for each field with a rule, and settings where it fails.
RULE_CASES = [
    (load_generate_bench, GENERATE_APPLIES, "spec.num_spec_tokens=5", []),
    (load_generate_bench, GENERATE_APPLIES, 'spec.drafter="prefix:2"', []),
    (load_generate_bench, GENERATE_APPLIES, 'spec.exact="sample"', ['spec.drafters=["none"]']),
    (load_generate_bench, GENERATE_APPLIES, "spec.controller=true", []),
    (load_grpo_bench, GRPO_APPLIES, "runs.drafters=[\"mtp\"]", ['bench.mode="interleaved"']),
    (load_grpo_bench, GRPO_APPLIES, "runs.batches=[1]", ['bench.mode="interleaved"']),
    (load_grpo_bench, GRPO_APPLIES, "interleaved.ceiling=true", []),
    (load_grpo_bench, GRPO_APPLIES, "interleaved.ceiling_k=2", ['bench.mode="interleaved"']),
    (load_grpo_bench, GRPO_APPLIES, "interleaved.ceiling_accept=[0.5]",
     ['bench.mode="interleaved"']),
]  # fmt: skip


@pytest.mark.parametrize(("load", "item", "where"), [(c[0], c[2], c[3]) for c in RULE_CASES])
def test_every_rule_refuses_its_field(load, item, where):
    key = item.partition("=")[0]
    with pytest.raises(SettingsError, match=f"{key}=.* needs "):
        load(None, [*where, item])


def test_every_rule_has_a_case():
    for rules in (GENERATE_APPLIES, GRPO_APPLIES):
        cases = {item.partition("=")[0] for _, of, item, _ in RULE_CASES if of is rules}
        assert cases == {rule.key for rule in rules}


def test_the_bounds_are_the_librarys():
    """``config_bench`` imports no torch: its copies of the library's bounds must agree."""
    from specrl import cli_options, config_bench
    from specrl.spec.config import MAX_SPEC_TOKENS

    assert config_bench.MAX_SPEC_TOKENS == MAX_SPEC_TOKENS
    assert config_bench.MAX_BATCH == cli_options.MAX_BATCH
    assert config_bench.MAX_NEW_TOKENS == cli_options.MAX_NEW_TOKENS


def test_the_controller_setting_reaches_the_benchmark_and_its_engines(no_work, monkeypatch):
    """spec.controller=true: the benchmark's speculating engines choose k per step (plain stays
    plain)."""
    assert invoke("generate", "--spec", "ngram", "--set", "spec.controller=true") is None
    (bench,) = no_work
    assert bench.controller is True and bench.methods == ["ngram"]
    specs = []

    class FakeEngine:  # records the speculation it is built with; generates nothing
        stats = SimpleNamespace(acceptance_length=1.0)

        def __init__(self, model, **kw) -> None:
            specs.append(kw["spec"])

        def generate(self, requests) -> list:
            return []

    monkeypatch.setattr("specrl.engine.Engine", FakeEngine)
    for spec in (SpecConfig("ngram", 3), SpecConfig("none", 0)):
        specrl_runner(None, [[1, 2]], bench, spec)
    assert [s.adaptive for s in specs] == [True, False]
