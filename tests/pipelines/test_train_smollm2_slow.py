"""The real default (SmolLM2-135M-Instruct, default task) through the pipeline, tiny settings."""

from __future__ import annotations

import json

import pytest

from specrl.config import load_config
from specrl.pipelines.build import build_run
from specrl.pipelines.loop import METRIC_KEYS
from specrl.pipelines.report import write_report
from specrl.pipelines.train import run_training, train
from tests.conftest import ON_SERVER_WORKER

TINY = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "env.num_eval=4", "run.steps=2", "run.eval_every=2", "run.checkpoint_every=2"]  # fmt: skip


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_default_run_two_steps(tmp_path):
    summary = run_training(build_run(load_config(None, TINY)), str(tmp_path), progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(set(METRIC_KEYS) <= set(r) for r in rows)
    assert all(r["logprob_delta_mean"] < 0.1 for r in rows)  # bf16 engine vs bf16 autocast
    assert summary["speed_rollout_speedup"] > 0
    backend = json.loads((tmp_path / "checkpoints/step_000002/backend.json").read_text())
    assert backend["drafter"]["name"] == "suffix"
    assert len(write_report(tmp_path)) == 6


@pytest.mark.parametrize("spec", ["none", "suffix"])
def test_fp32_engine_learner_mismatch(tmp_path, spec):
    fp32 = ["model.dtype=fp32", "learner.dtype=fp32", "run.steps=1", "run.eval_every=0",
            "run.checkpoint_every=0", f"rollout.spec={spec}"]  # fmt: skip
    cfg = load_config(None, [*TINY, *fp32])
    rows = train(build_run(cfg), str(tmp_path), progress=False)
    assert rows[0]["logprob_delta_mean"] <= 1e-3


@ON_SERVER_WORKER
def test_vllm_backend_runs_the_default_task(tmp_path):
    """``rollout.backend=vllm`` (its default drafter: ngram): the run trains, vLLM's logprobs
    agree with the learner's in float32, the guard checked every push (a mismatch would raise),
    and the speed check ran through the same backend."""
    from specrl.backends.vllm import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (specrl[vllm])")
    fp32 = ["model.dtype=fp32", "learner.dtype=fp32", "run.eval_every=0",
            "run.checkpoint_every=0", "rollout.backend=vllm"]  # fmt: skip
    parts = build_run(load_config(None, [*TINY, *fp32]))
    assert type(parts.backend).__name__ == "VllmBackend" and parts.backend.spec.method == "ngram"
    summary = run_training(parts, str(tmp_path), progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(set(METRIC_KEYS) <= set(r) for r in rows)
    assert all(r["logprob_delta_mean"] <= 1e-3 for r in rows)
    assert parts.backend.versions().policy == 2  # two learner updates reached vLLM
    assert summary["speed_rollout_speedup"] > 0
