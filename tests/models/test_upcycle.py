"""Sparse upcycling: the MoE computes what the dense model does at step 0, in every family it
maps to; bad shapes are refused; ``specrl upcycle`` writes a directory transformers and specrl
load, with its settings recorded."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch
from typer.testing import CliRunner

from specrl.cli import app
from specrl.config_commands import MAX_EXPERTS
from specrl.engine import Engine
from specrl.models import upcycle as up
from specrl.models.checkpoints import load_model
from specrl.models.moe import Routing
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import make_tiny
from tests.test_cli_edges import write_tiny_model

FAMILIES = {"llama": {}, "qwen2": dict(attention_bias=True), "qwen3": dict(qk_norm=True)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_upcycled_model_computes_the_dense_one(family):
    dense = make_tiny(seed=2, vocab_size=48, model_type=family, **FAMILIES[family])
    moe = up.upcycle(dense, experts=4, top_k=2, seed=1, router_std=0.5)
    assert moe.config.model_type == up.UPCYCLED[family] and moe.config.is_moe
    ids, pos = torch.randint(0, 48, (3, 11)), torch.arange(11).expand(3, 11)
    routing = Routing(record=True)
    with torch.no_grad():
        want, got = dense(ids, pos).logits, moe(ids, pos, routing=routing).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(int((load > 0).sum()) > 2 for load in routing.load)  # the router spreads tokens
    params = SamplingParams(temperature=0, max_new_tokens=16)
    a = Engine(dense, max_batch=2).generate([Request([1, 2, 3], params)])
    b = Engine(moe, max_batch=2).generate([Request([1, 2, 3], params)])
    assert a[0].token_ids == b[0].token_ids


def test_upcycling_leaves_the_dense_model_and_copies_its_weights():
    dense = make_tiny(seed=2)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    moe = up.upcycle(dense, experts=3, top_k=1)
    with torch.no_grad():
        moe.layers[0].mlp.gate_up[1].add_(1.0)  # experts are copies, not views of one another
    assert torch.equal(moe.layers[0].mlp.gate_up[0], dense.layers[0].mlp.gate_up.weight)
    for k, v in dense.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(experts=1, top_k=1), "experts must be in"), (dict(experts=4, top_k=5), "top_k must"),
     (dict(experts=MAX_EXPERTS + 1, top_k=1), "experts must be in"),
     (dict(experts=4, top_k=2, router_std=float("nan")), "router_std")],
)  # fmt: skip
def test_bad_shapes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        up.upcycle(make_tiny(), **kwargs)


def test_a_moe_is_not_upcycled_again():
    moe = up.upcycle(make_tiny(), experts=2, top_k=1)
    with pytest.raises(ValueError, match="a mixture of experts already"):
        up.upcycle(moe, experts=2, top_k=1)


def test_the_command_writes_a_model_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    dense_dir = write_tiny_model(tmp_path / "dense")
    out = tmp_path / "moe"
    result = CliRunner().invoke(app, ["upcycle", str(out), "--model", str(dense_dir),
                                      "--experts", "3", "--top-k", "2", "--set",
                                      "upcycle.router_std=0.3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 3
    record = tomllib.loads((out / "specrl_upcycle.toml").read_text())
    assert record["upcycle"] | {"seed": None} == dict(experts=3, top_k=2, seed=None,
                                                      router_std=0.3, dtype="float32")  # fmt: skip
    ours, dense = load_model(out), load_model(dense_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 200, (1, 9))
    with torch.no_grad():
        theirs, mine = hf(ids).logits, ours(ids, torch.arange(9)[None]).logits
        plain = dense(ids, torch.arange(9)[None]).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, plain, atol=1e-5, rtol=1e-5)


def test_the_command_refuses_in_one_line_before_work(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["upcycle", str(tmp_path / "full")], "exists and is not empty"),
        (["upcycle", str(tmp_path / "a"), "--experts", "2", "--top-k", "3"], "top_k (3) must"),
        (["upcycle", str(tmp_path / "a"), "--experts", "999"], "experts"),
    ]
    for args, match in cases:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], lines
    assert not (tmp_path / "a").exists()


def test_the_bounds_agree():
    assert MAX_EXPERTS == up.MAX_EXPERTS


@pytest.mark.slow
def test_the_upcycled_bundled_model_greedy_equals_the_dense_one(smollm2):
    moe = up.upcycle(smollm2, experts=4, top_k=2)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    prompts = [[1, 504, 3458, 314, 253, 1345], [1, 11454, 42, 2464]]
    dense = Engine(smollm2, max_batch=2).generate([Request(p, params) for p in prompts])
    sparse = Engine(moe, max_batch=2).generate([Request(p, params) for p in prompts])
    assert [c.token_ids for c in sparse] == [c.token_ids for c in dense]
