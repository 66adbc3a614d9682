"""ShardedLearner (FSDP2 over gloo, 2 processes) against the single-process Learner.

Two ranks are spawned once per module; each runs every scenario and saves what it saw (metrics,
the full weights from ``iter_full_state``, gathered AdamW state, its bytes) to a file that the
tests compare with the same scenarios run by a plain ``Learner`` in this process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from specrl.config_training import LearnerCfg
from specrl.models.config import tiny_config
from specrl.rl import sharded
from specrl.rl.learner import Learner, TrainSample, batch_norm, nonempty
from specrl.rl.sharded import (
    ShardedLearner,
    init_distributed,
    iter_full_state,
    learner_bytes,
    split_by_tokens,
)
from tests.rl.gloo_ranks import WORLD, full, run_ranks, tiny_batch, tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")

TIMEOUT_S = 180  # the whole spawned run; a hang fails the tests instead of blocking them
TIMINGS = ("time_s", "tokens_per_s", "model_tflops")  # metrics that differ run to run
MOMENTS = ("exp_avg", "exp_avg_sq")
# an MoE's router statistics are per micro-batch (token shares of its tokens): other shares of
# the batch, other values
PARTITIONED = ("moe_load_max", "moe_aux_loss")


@dataclass(frozen=True)
class Scenario:
    learner: dict  # LearnerCfg settings besides the defaults of ``_learner``
    batch: dict  # ``_batch`` arguments; one batch per step, of seeds ``seeds``
    seeds: tuple[int, ...] = (11, 12, 13)
    ref: bool = False  # a (sharded) reference model
    max_len: int | None = None  # Dr. GRPO's generation budget
    moe: bool = False  # a mixture-of-experts policy (``gloo_ranks.MOE``)


SCENARIOS = {
    # GRPO groups, several micro-batches per rank, clipping active, logprobs kept
    "groups": Scenario(
        dict(loss="grpo", micro_batch_tokens=24, max_grad_norm=0.5), dict(groups=3, size=4)
    ),
    # odd count, varied lengths, an empty completion, behaviour logprobs, KL to a sharded
    # reference, per-token normalisation, recomputed blocks
    "uneven": Scenario(
        dict(loss="dapo", micro_batch_tokens=30, kl_coef=0.05, activation_checkpointing=True),
        dict(groups=7, size=1, behaviour=True),
        (21, 22, 23),
        ref=True,
    ),
    # one sample: rank 0 has nothing and only takes part in the collectives
    "idle": Scenario(dict(loss="dr_grpo"), dict(groups=1, size=1), (31, 32, 33), max_len=8),
    # bf16: autocast over float32 shards; bf16 parameters (float32 shards gathered as bf16)
    "autocast": Scenario(
        dict(dtype="bf16", bf16_mode="autocast", micro_batch_tokens=24), dict(groups=3, size=4)
    ),
    "bf16_params": Scenario(
        dict(dtype="bf16", bf16_mode="params", micro_batch_tokens=24), dict(groups=3, size=4)
    ),
    # a mixture of experts: experts sharded like any parameter, routing replayed, router
    # statistics reduced over ranks (not the load-balancing loss: its token shares are a
    # micro-batch's, so its gradient depends on how the batch is cut)
    "moe": Scenario(
        dict(routing_replay=True, micro_batch_tokens=24),
        dict(groups=3, size=4, routing=True),
        (51, 52, 53),
        moe=True,
    ),
}
FP32 = [name for name, sc in SCENARIOS.items() if "dtype" not in sc.learner]


def _learner(name: str, mesh) -> Learner:
    cfg = LearnerCfg(**dict(dtype="fp32", lr=1e-2) | SCENARIOS[name].learner)
    sc = SCENARIOS[name]
    ref = tiny_policy(sc.moe) if sc.ref else None  # the initial policy, as in a run
    if mesh is None:
        return Learner(tiny_policy(sc.moe), cfg, max_len=sc.max_len, ref_model=ref)
    return ShardedLearner(tiny_policy(sc.moe), cfg, mesh=mesh, max_len=sc.max_len, ref_model=ref)


def _run(name: str, mesh=None) -> dict:
    """Three steps of scenario ``name``; what they gave."""
    learner = _learner(name, mesh)
    metrics, kept = [], []
    for seed in SCENARIOS[name].seeds:
        step = learner.train_step(tiny_batch(seed, **SCENARIOS[name].batch), keep_logprobs=True)
        metrics.append({k: v for k, v in step.metrics.items() if k not in TIMINGS})
        kept.append([t.clone() for t in step.logprobs])
    names = [n for n, _ in learner.model.named_parameters()]
    state = learner.optimizer.state
    stepped = learner.optimizer.param_groups[0]["params"]  # the masters in bf16 "params" mode
    pairs = [(n, p, k) for n, p in zip(names, stepped, strict=True) for k in MOMENTS]
    adam = {f"{n}.{k}": full(state[p][k]) for n, p, k in pairs}
    groups = [{k: full(v) for k, v in g.items()} for g in iter_full_state(learner.model)]
    return dict(metrics=metrics, kept=kept, adam=adam, groups=groups, bytes=learner_bytes(learner))


def _gradients(mesh=None, per_rank_norm: bool = False) -> dict[str, torch.Tensor]:
    """The accumulated gradient of one uneven batch (full tensors)."""
    learner = _learner("uneven", mesh)
    samples = tiny_batch(41, groups=9, size=1, behaviour=True)
    if per_rank_norm:  # the bug this guards against: each rank normalises by its own share
        rank = dist.get_rank()
        share = lambda s: [s[i] for i in split_by_tokens(s, WORLD)[rank]]  # noqa: E731
        sharded.batch_norm = lambda s: batch_norm(share(s))
    try:
        learner.accumulate_gradients(samples)
    finally:
        sharded.batch_norm = batch_norm
    return {n: full(p.grad) for n, p in learner.model.named_parameters()}


def _rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    mesh = init_distributed(rank, WORLD, "127.0.0.1", port, torch.device("cpu"), timeout_s=60)
    results = {name: _run(name, mesh) for name in SCENARIOS}
    results["grads"] = _gradients(mesh)
    results["grads_per_rank_norm"] = _gradients(mesh, per_rank_norm=True)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results (2 spawned processes, killed past ``TIMEOUT_S``)."""
    out = tmp_path_factory.mktemp("sharded")
    run_ranks(_rank_main, (str(out),), TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def single() -> dict:
    return {name: _run(name) for name in SCENARIOS}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b)  # float32's default tolerance (atol 1e-5, rtol 1.3e-6)


@pytest.mark.parametrize("name", FP32)
def test_three_sharded_steps_equal_three_single_process_steps(ranks, single, name):
    want = single[name]
    for got in (r[name] for r in ranks):
        assert len(got["groups"]) == len(want["groups"]) == 1 + tiny_config().num_layers
        for g, w in zip(got["groups"], want["groups"], strict=True):
            assert list(g) == list(w)
            for k in w:
                _close(g[k], w[k])
        assert list(got["adam"]) == list(want["adam"])
        for k in want["adam"]:
            _close(got["adam"][k], want["adam"][k])
        for g, w in zip(got["metrics"], want["metrics"], strict=True):
            same = {k for k in w if k not in ("forward_tokens", "micro_batches", *PARTITIONED)}
            assert g.keys() == w.keys()
            assert {k: g[k] for k in same} == pytest.approx({k: w[k] for k in same}, rel=1e-5)
        for g, w in zip(got["kept"], want["kept"], strict=True):
            assert len(g) == len(w)
            for a, b in zip(g, w, strict=True):
                _close(a, b)


@pytest.mark.parametrize("name", ["autocast", "bf16_params"])
def test_bf16_sharded_steps_stay_within_bf16_rounding_of_single_process_steps(ranks, single, name):
    """Micro-batches of other samples round bf16 gradients otherwise (and AdamW moves an
    element with a near-zero gradient by ~lr either way): close on average, not elementwise."""
    want = single[name]
    for got in (r[name] for r in ranks):
        for g, w in zip(got["groups"], want["groups"], strict=True):
            for k in w:
                assert (g[k].float() - w[k].float()).abs().mean() < 5e-3, k  # measured 2e-3
        for g, w in zip(got["metrics"], want["metrics"], strict=True):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=3e-2)  # measured 1.1e-2


def test_the_scenarios_exercise_what_they_claim(single):
    steps = single["groups"]["metrics"]
    assert all(m["grad_norm"] > 0.5 for m in steps)  # clipping by the (global) norm is active
    assert any(m["micro_batches"] > 2 for m in steps)
    uneven = single["uneven"]["metrics"]
    assert all(m["kl"] > 0 for m in uneven[1:]) and any(m["clip_frac"] > 0 for m in uneven)
    batch = tiny_batch(21, groups=7, size=1, behaviour=True)
    assert len(nonempty(batch)) == 7 and not batch[1].completion_ids
    assert sorted(len(r) for r in split_by_tokens(nonempty(batch), WORLD)) == [3, 4]
    shares = split_by_tokens(tiny_batch(31, groups=1, size=1), WORLD)
    assert [len(r) for r in shares] == [0, 1]  # the 'idle' scenario leaves rank 0 empty
    moe = single["moe"]["metrics"]
    assert all(m["moe_aux_loss"] > 0 and m["moe_load_max"] > 1 for m in moe)


def test_a_global_normaliser_gives_the_single_process_gradient_and_a_per_rank_one_does_not(
    ranks,
):
    want = _gradients()
    for r in ranks:
        for k in want:
            _close(r["grads"][k], want[k])
        off = max((r["grads_per_rank_norm"][k] - want[k]).abs().max() for k in want)
        scale = max(want[k].abs().max() for k in want)
        assert off > 0.05 * scale  # 5000x the tolerance the global normaliser meets


def test_each_rank_holds_about_half_of_parameters_gradients_and_optimizer_state(ranks, single):
    whole = single["groups"]["bytes"]
    for r in ranks:
        got = r["groups"]["bytes"]
        for key in ("params", "grads", "optimizer", "total"):
            assert 0.4 < got[key] / whole[key] < 0.6, (key, got, whole)
    summed = sum(r["groups"]["bytes"]["params"] for r in ranks)
    assert summed == whole["params"]


def test_split_by_tokens_is_balanced_contiguous_and_deterministic():
    samples = [TrainSample([1] * p, [2] * c, 0.0) for p, c in [(3, 5), (2, 1), (9, 9), (1, 1),
                                                               (4, 4), (2, 6), (5, 0)]]  # fmt: skip
    for parts in (1, 2, 3, 4, 8):
        shares = split_by_tokens(samples, parts)
        assert len(shares) == parts and [i for r in shares for i in r] == list(range(7))
        assert shares == split_by_tokens(samples, parts)
    cost = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]  # 8 3 18 2 8 8 5 = 52
    assert [sum(cost[i] for i in r) for r in split_by_tokens(samples, 2)] == [29, 23]
    assert [len(r) for r in split_by_tokens(samples[:1], 3)] == [0, 1, 0]  # nearest cuts


def test_iter_full_state_of_an_unsharded_model_is_its_state_dict():
    model = tiny_policy()
    groups = list(iter_full_state(copy.deepcopy(model), dtype=torch.bfloat16))
    assert [next(iter(g)) for g in groups] == ["embed.weight", "layers.0.attn_norm.weight",
                                               "layers.1.attn_norm.weight"]  # fmt: skip
    merged = {k: v for g in groups for k, v in g.items()}
    state = model.state_dict()
    assert list(merged) == [k for k in state if not k.startswith("layers.")] + [
        k for k in state if k.startswith("layers.")
    ]
    assert all(torch.equal(merged[k], state[k].to(torch.bfloat16)) for k in state)
