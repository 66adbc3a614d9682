"""``specrl train-drafter`` end to end on the real SmolLM2, for every drafter, then ``specrl
generate`` with what it wrote.

Small options (2 prompts, 8 new tokens, 2 training steps) keep each run short; the defaults
differ only in size. ``SPECRL_CACHE`` is a temporary directory shared by this module's tests
(the bundled model is converted into it once), so the drafters go to its default place,
``drafters/smollm2-135m-instruct-<drafter>``. Where the native GEMV kernel runs (AVX512-BF16),
the bf16 target uses it here too; elsewhere the M = 0 case it once crashed on is covered by
tests/models/test_native_gemv.py and tests/drafters/test_train.py.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specrl.cli import app

pytestmark = pytest.mark.slow

SMALL = [
    "--set", "data.num_prompts=2",
    "--set", "data.samples_per_prompt=1",
    "--set", "data.max_new_tokens=8",
    "--set", "data.temperatures=[0]",
    "--set", "train.steps=2",
    "--set", "train.batch_size=2",
    "--set", "train.ckpt_every=1",
    "--set", "eval.prompts=1",
    "--set", "eval.num_spec_tokens=2",
]  # fmt: skip
HEAD_FILES = {"head.json", "head.safetensors", "train_state_tv.safetensors"}
DRAFT_FILES = {"config.json", "model.safetensors", "distill.json", "tokenizer.json"}
DATA_FILES = {"rollouts.json", "examples.safetensors", "train_state.safetensors"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh ``SPECRL_CACHE`` for this module."""
    path = tmp_path_factory.mktemp("specrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRL_CACHE", str(path))
        yield path


@pytest.mark.parametrize("drafter", ["eagle3", "mtp", "draft"])
def test_train_drafter_writes_a_drafter_that_generate_uses(cache, drafter):
    extra = ["--set", "train.tv_steps=1"] if drafter != "draft" else []
    result = CliRunner().invoke(app, ["train-drafter", "--drafter", drafter, *SMALL, *extra])
    assert result.exit_code == 0, result.output
    out = cache / "drafters" / f"smollm2-135m-instruct-{drafter}"
    assert f"saved {drafter} drafter to {out}" in result.output
    assert "held-out acceptance length" in result.output
    files = {p.name for p in out.iterdir()}
    assert DATA_FILES | (DRAFT_FILES if drafter == "draft" else HEAD_FILES) <= files
    assert not [f for f in files if f.endswith((".pt", ".tmp"))]  # no pickles, no leftovers

    args = ["generate", "--spec", drafter, "--drafter", str(out), "--num-spec-tokens", "2"]
    args += ["--max-new-tokens", "6", "--temperature", "0", "--json", "What is 2+2?"]
    gen = CliRunner().invoke(app, args)
    assert gen.exit_code == 0, gen.output
    rows = [json.loads(line) for line in gen.output.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["token_ids"], gen.output
    assert rows[0]["finish_reason"] in ("length", "stop")
    assert rows[0]["acceptance_length"] >= 1.0
