"""Which rollout backend a run gets: ``rollout.backend``, ``rollout.placement`` and
``cluster.rollout_workers`` (``specrl.backends.build_backend``), the vLLM backend's default
drafter, one-line refusals of combinations that cannot run, and the vLLM warnings the backend
silences (only the expected ones)."""

from __future__ import annotations

import logging

import pytest

from specrl.backends import REGISTRY, build_backend, plan_rollout
from specrl.backends.vllm_worker import BenignWarnings, quiet_benign_warnings
from specrl.config import ConfigError, load_config


def test_vllm_backend_defaults_to_ngram_and_keeps_an_explicit_drafter():
    assert load_config(None, []).rollout.spec == "suffix"
    assert load_config(None, ["rollout.backend=vllm"]).rollout.spec == "ngram"
    for spec in ("none", "suffix", "eagle3"):
        cfg = load_config(None, ["rollout.backend=vllm", f"rollout.spec={spec}"])
        assert cfg.rollout.spec == spec


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "inline"),
        (["pipeline.mode=async"], "process"),
        (["pipeline.mode=async", "rollout.backend=vllm"], "inline"),
        (["rollout.placement=process"], "process"),
    ],
)
def test_auto_placement(overrides, expected):
    assert plan_rollout(load_config(None, overrides)).placement == expected


@pytest.fixture
def built(monkeypatch):
    """Which builder ``build_backend`` called (no engine is built)."""
    calls = []
    from specrl.backends import native, process, vllm

    for module, name in ((native, "build_native"), (process, "build_process"),
                         (vllm, "build_vllm")):  # fmt: skip
        monkeypatch.setattr(module, name, lambda plan, policy, n=name: calls.append(n) or n)
    return calls


@pytest.mark.parametrize(
    ("overrides", "builder"),
    [
        ([], "build_native"),
        (["pipeline.mode=async"], "build_process"),
        (["rollout.backend=vllm"], "build_vllm"),
        (["rollout.backend=vllm", "pipeline.mode=async"], "build_vllm"),
    ],
)
def test_build_backend_dispatch(built, overrides, builder):
    assert build_backend(plan_rollout(load_config(None, overrides)), None) == builder
    assert built == [builder]


def test_ray_workers_go_to_the_ray_backend(monkeypatch, built):
    ray_ = pytest.importorskip("specrl.backends.ray_")

    monkeypatch.setattr(ray_, "build_ray", lambda plan, policy: "ray")
    cfg = load_config(None, ["cluster.rollout_workers=2"])
    assert build_backend(plan_rollout(cfg), None) == "ray" and built == []


def test_vllm_in_a_worker_process_is_refused_in_one_line(built):
    cfg = load_config(None, ["rollout.backend=vllm", "rollout.placement=process"])
    with pytest.raises(ConfigError, match="rollout.placement='process' needs rollout.backend="):
        build_backend(plan_rollout(cfg), None)
    assert built == []


def test_vllm_without_the_extra_is_refused_in_one_line(monkeypatch):
    from specrl.backends import vllm

    monkeypatch.setattr(vllm, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs the vllm extra: pip install -e '\.\[vllm\]'"):
        plan_rollout(load_config(None, ["rollout.backend=vllm"]))


def record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_only_the_expected_vllm_warnings_are_silenced():
    layerwise = "vllm.model_executor.model_loader.reload.layerwise"
    quiet_benign_warnings()
    quiet_benign_warnings()  # idempotent: one filter per logger
    (f,) = [f for f in logging.getLogger(layerwise).filters if isinstance(f, BenignWarnings)]
    assert not f.filter(record(layerwise, "%s: Failed to load weights", "RotaryEmbedding"))
    assert not f.filter(record(layerwise, "%s: Failed to load weights", "ParallelLMHead"))
    assert f.filter(record(layerwise, "%s: Failed to load weights", "QKVParallelLinear"))
    assert f.filter(record(layerwise, "something else %s", "RotaryEmbedding"))
    utils = "vllm.model_executor.models.utils"
    (g,) = [f for f in logging.getLogger(utils).filters if isinstance(f, BenignWarnings)]
    msg = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    assert not g.filter(record(utils, msg, "w", "torch.float32", "torch.bfloat16"))
    assert g.filter(record(utils, "%s: Failed to load weights", "RotaryEmbedding"))


def test_a_drafter_vllm_cannot_run_is_refused_before_the_engine_starts(monkeypatch):
    from specrl.backends import vllm

    if not vllm.vllm_available():
        pytest.skip("vllm is not installed (specrl[vllm])")
    monkeypatch.setattr(vllm, "patch_vllm", lambda: pytest.fail("the engine was started"))
    cfg = load_config(None, ["rollout.backend=vllm", "rollout.spec=suffix"])
    with pytest.raises(ConfigError, match="'suffix' is not supported by the vllm backend") as e:
        plan_rollout(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("sets", "want"),
    [
        ([], "sample"),  # the default drafter, suffix: deterministic
        (["rollout.spec=ngram"], "sample"),
        (["rollout.spec=self"], "distribution"),  # stochastic: 'sample' would cost acceptance
        (["rollout.spec=self", "rollout.spec_siblings=2"], "distribution"),
        (["rollout.spec=none"], "distribution"),
    ],
)
def test_auto_exactness_is_sample_only_where_it_costs_nothing(sets, want):
    from specrl.rollout_plan import spec_config

    native, vllm = REGISTRY["native"].traits, REGISTRY["vllm"].traits
    assert spec_config(load_config(None, sets), native).exact == want
    assert spec_config(load_config(None, sets), vllm).exact == "distribution"


def test_spec_exact_reaches_the_engine_and_bad_combinations_are_one_line():
    from specrl.backends.native import make_engine
    from tests.conftest import make_tiny

    cfg = load_config(None, ["rollout.spec=ngram", "rollout.spec_exact=sample"])
    assert plan_rollout(cfg).spec.exact == "sample"
    assert make_engine(plan_rollout(cfg), make_tiny()).spec.exact == "sample"
    assert plan_rollout(load_config(None, ["rollout.spec_exact=distribution"])).spec.exact == (
        "distribution"
    )
    with pytest.raises(ConfigError, match="spec_exact"):
        load_config(None, ["rollout.spec_exact=bitwise"])
    both = load_config(None, ["rollout.spec=self", "rollout.spec_exact=sample",
                              "rollout.spec_siblings=2"])  # fmt: skip
    with pytest.raises(ConfigError, match="takes no siblings"):
        make_engine(plan_rollout(both), make_tiny())
    deterministic = load_config(None, ["rollout.spec=ngram", "rollout.spec_siblings=2"])
    with pytest.raises(ConfigError, match="spec_siblings: applies only to a stochastic drafter"):
        plan_rollout(deterministic)


def test_backend_names_come_from_the_registry():
    cfg = load_config(None, ["rollout.backend=vlm"])  # any name loads; the plan checks it
    with pytest.raises(ConfigError, match=r"unknown rollout backend 'vlm' \(did you mean vllm\?\)"):
        plan_rollout(cfg)
    assert plan_rollout(load_config(None, ["rollout.backend=native"])).backend == "native"
