"""GRPO on a mixture-of-experts policy: a sync run with routing replay reports the mismatch
with and without it and the router's balance; a run's MoE checkpoint exports to a directory
transformers loads with specrl's logits."""

from __future__ import annotations

import pytest
import torch

from specrl.pipelines.build import build_run
from specrl.pipelines.export import export_model
from specrl.pipelines.train import train
from tests.conftest import make_tiny
from tests.engine.test_moe_engine import MOE
from tests.pipelines.pipeline_fakes import IdCodec, ModFourEnv, tiny_config
from tests.pipelines.test_export_model import (
    assert_same_logits,
    checkpoint_policy,
    hf_model,
    model_dir,
    train_run,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def moe_parts(*sets: str):
    torch.manual_seed(0)
    model = make_tiny(0, **MOE)
    return build_run(tiny_config(*sets), model=model, codec=IdCodec(), env=ModFourEnv(24))


@pytest.mark.parametrize("replay", [False, True])
def test_a_sync_run_on_a_moe_policy_reports_router_and_mismatch_metrics(tmp_path, replay):
    parts = moe_parts("rollout.spec=ngram", f"learner.routing_replay={str(replay).lower()}")
    try:
        rows = train(parts, str(tmp_path), progress=False)
    finally:
        parts.close()
    assert len(rows) == 4
    for row in rows:
        assert row["learner_moe_load_max"] >= 1.0 and row["learner_moe_aux_loss"] > 0
        assert row["logprob_delta_mean"] <= 1e-3  # float32 engine and learner
        assert ("logprob_delta_unreplayed_mean" in row) == replay
        if replay:  # the same experts either way in float32: the same logprobs
            assert row["logprob_delta_unreplayed_mean"] <= 1e-3


def test_a_moe_run_exports_to_a_directory_transformers_loads(tmp_path):
    pytest.importorskip("transformers")
    shape = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=64, mlp_only_layers=(0,))  # fmt: skip
    model = model_dir(tmp_path / "model", **shape)
    run = train_run(model, tmp_path / "run", "learner.routing_replay=true")
    out = export_model(run, tmp_path / "hf")
    ours = checkpoint_policy(run / "checkpoints" / "step_000002", model)
    assert ours.config.is_moe
    assert_same_logits(hf_model(out), ours)
