"""Learner checkpoints through torch.distributed.checkpoint: 2 gloo ranks -> 1 process and back.

This process trains the one-process learner 2 steps, saves, trains a 3rd, and leaves a damaged
copy of its checkpoint. Two ranks, spawned once per module, train 2 steps, save, train a 3rd;
then load the one-process checkpoint into a fresh sharded learner and train its 3rd step, and
try the damaged copy. This process last loads the 2-rank checkpoint and trains its 3rd step.
Refusals of damaged and interrupted checkpoints run in this process alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from specrl.config_training import LearnerCfg
from specrl.models.config import tiny_config
from specrl.models.transformer import Transformer
from specrl.rl.learner import Learner
from specrl.rl.sharded import ShardedLearner, init_distributed
from specrl.rl.sharded_checkpoint import ShardedCheckpointError, load_learner, save_learner
from tests.rl.gloo_ranks import WORLD, full, run_ranks, tiny_batch, tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")

TIMEOUT_S = 180  # the whole spawned run; a hang fails the tests instead of blocking them
SEEDS = (11, 12, 13)  # one batch per step
ARGS = dict(dtype="fp32", lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, micro_batch_tokens=24)


def _cfg(**overrides) -> LearnerCfg:
    return LearnerCfg(**ARGS | overrides)


SHARD = "shard-{:05d}-model-00001-of-00001.safetensors"


def _learner(mesh=None, **overrides) -> Learner:
    if mesh is None:
        return Learner(tiny_policy(), _cfg(**overrides))
    return ShardedLearner(tiny_policy(), _cfg(**overrides), mesh=mesh)


def _step(learner: Learner, seed: int) -> None:
    learner.train_step(tiny_batch(seed, groups=3, size=2))


def _snapshot(learner: Learner) -> dict[str, torch.Tensor]:
    """Full weights and AdamW state (moments, step count) by parameter name."""
    named = list(learner.model.named_parameters())
    out = {name: full(p) for name, p in named}
    for (name, _), p in zip(named, learner.optimizer.param_groups[0]["params"], strict=True):
        out |= {f"{name}.{k}": full(v) for k, v in learner.optimizer.state[p].items()}
    return out


def _rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    mesh = init_distributed(rank, WORLD, "127.0.0.1", port, torch.device("cpu"), timeout_s=60)
    out = Path(out)
    learner = _learner(mesh)
    for seed in SEEDS[:2]:
        _step(learner, seed)
    results = {"saved": _snapshot(learner)}
    save_learner(learner, out / "two_ranks")
    _step(learner, SEEDS[2])
    results["straight"] = _snapshot(learner)
    resumed = _learner(mesh)
    load_learner(resumed, out / "one_process")
    results["loaded"] = _snapshot(resumed)
    _step(resumed, SEEDS[2])
    results["resumed"] = _snapshot(resumed)
    try:
        load_learner(_learner(mesh), out / "damaged")
    except ShardedCheckpointError as e:
        results["damaged"] = str(e)
    bf16 = dict(dtype="bf16", bf16_mode="params")  # float32 shards gathered as bf16
    learner = _learner(mesh, **bf16)
    _step(learner, SEEDS[0])
    save_learner(learner, out / "bf16_params")
    resumed = _learner(mesh, **bf16)
    load_learner(resumed, out / "bf16_params")
    results["bf16_params"] = (_snapshot(learner), _snapshot(resumed))
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def _flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dcp")
    single = _learner()
    for seed in SEEDS[:2]:
        _step(single, seed)
    save_learner(single, out / "one_process")
    saved = _snapshot(single)
    shutil.copytree(out / "one_process", out / "damaged")
    _flip_byte(out / "damaged" / SHARD.format(1))
    _step(single, SEEDS[2])
    run_ranks(_rank_main, (str(out),), TIMEOUT_S)
    resumed = _learner()
    load_learner(resumed, out / "two_ranks")
    loaded = _snapshot(resumed)
    _step(resumed, SEEDS[2])
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return dict(out=out, single=_snapshot(single), saved=saved, ranks=ranks,
                loaded=loaded, resumed=_snapshot(resumed))  # fmt: skip


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:  # float32's default tolerance (atol 1e-5, rtol 1.3e-6)
        torch.testing.assert_close(got[k], want[k], msg=k)


def test_two_ranks_saved_one_process_resumed_equals_three_steps_straight(runs):
    two_ranks_straight = runs["ranks"][0]["straight"]
    assert any(k.endswith(".exp_avg_sq") for k in two_ranks_straight)
    _close(runs["resumed"], two_ranks_straight)
    _close(runs["resumed"], runs["single"])
    files = sorted(p.name for p in (runs["out"] / "two_ranks").iterdir())
    assert files == ["manifest.json", "optimizer.json", SHARD.format(1), SHARD.format(2)]
    assert not (runs["out"] / "two_ranks.tmp").exists()


def test_one_process_saved_two_ranks_resumed_equals_three_steps_straight(runs):
    for rank in runs["ranks"]:
        for k, v in runs["saved"].items():  # the load itself is exact
            assert torch.equal(rank["loaded"][k], v), k
        _close(rank["resumed"], runs["single"])
        _close(rank["resumed"], rank["straight"])


def test_a_checkpoint_of_two_ranks_loads_exactly_into_one_process(runs):
    saved = runs["ranks"][0]["saved"]
    assert list(runs["loaded"]) == list(saved) and saved["embed.weight.step"] == 2
    for k, v in saved.items():
        assert torch.equal(runs["loaded"][k], v), k


def test_a_sharded_learner_with_bf16_parameters_saves_its_float32_shards(runs):
    for rank in runs["ranks"]:
        saved, loaded = rank["bf16_params"]
        assert saved["embed.weight"].dtype == torch.float32 and list(loaded) == list(saved)
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_a_damaged_shard_is_refused_on_every_rank_in_one_line(runs):
    damaged = runs["out"] / "damaged"
    want = f"{damaged}: {SHARD.format(1)}: sha256 mismatch"
    assert [r["damaged"] for r in runs["ranks"]] == [want] * WORLD
    with pytest.raises(ShardedCheckpointError) as e:
        load_learner(_learner(), damaged)
    assert str(e.value) == want


@pytest.fixture
def saved(tmp_path) -> Path:
    learner = _learner()
    _step(learner, SEEDS[0])
    return save_learner(learner, tmp_path / "ckpt")


def _refusal(path: Path, learner: Learner | None = None) -> str:
    with pytest.raises(ShardedCheckpointError) as e:
        load_learner(learner or _learner(), path)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name", ["optimizer.json", "manifest.json", SHARD.format(1)])
def test_each_damaged_file_is_named(saved, name):
    _flip_byte(saved / name, offset=0)  # the manifest's "{": unreadable
    problem = _refusal(saved)
    assert problem.startswith(f"{saved}: {name}: "), problem


def test_a_missing_or_unlisted_file_is_refused(saved):
    shutil.copy(saved / SHARD.format(1), saved / SHARD.format(2))  # DCP would read it too
    assert _refusal(saved) == f"{saved}: {SHARD.format(2)}: not in the manifest"
    (saved / SHARD.format(2)).unlink()
    (saved / "optimizer.json").unlink()
    assert _refusal(saved) == f"{saved}: optimizer.json: missing"


def test_an_interrupted_save_is_never_loaded(saved):
    tmp = saved.with_name("ckpt.tmp")
    shutil.copytree(saved, tmp)
    (tmp / "manifest.json").unlink()  # killed before the manifest (written last)
    shutil.rmtree(saved)
    assert _refusal(saved) == f"{saved}: no checkpoint (an interrupted save left ckpt.tmp)"
    assert _refusal(tmp) == f"{tmp}: an interrupted save, not a checkpoint"
    learner = _learner()
    _step(learner, SEEDS[0])
    save_learner(learner, saved)  # the next save replaces the leftover
    assert not tmp.exists()
    load_learner(_learner(), saved)


@pytest.mark.parametrize(
    "config, says",
    [
        (dict(hidden_size=48), "Size mismatch"),
        (dict(num_layers=3), "Missing key"),
        (dict(num_layers=1), "it has no model.layers.1."),  # DCP alone would load the rest
    ],
)
def test_a_checkpoint_of_another_model_does_not_fit(saved, config, says):
    other = Learner(Transformer(tiny_config(**config)).float(), _cfg())
    problem = _refusal(saved, other)
    assert problem.startswith(f"{saved} does not fit this learner: ") and says in problem


def test_hyperparameters_are_the_saved_ones_and_flags_this_optimizer_s(saved):
    learner = _learner(lr=5e-3, weight_decay=0.0)
    learner.optimizer.param_groups[0]["foreach"] = False
    load_learner(learner, saved)
    group = learner.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (1e-2, 0.1, (0.9, 0.99))
    assert group["foreach"] is False
    assert (
        json.loads((saved / "optimizer.json").read_text())["param_groups.embed.weight.lr"] == 1e-2
    )


def test_a_learner_with_separate_masters_or_no_step_yet_is_refused_in_one_line(tmp_path):
    learner = _learner(dtype="bf16", bf16_mode="params")
    _step(learner, SEEDS[0])
    with pytest.raises(ShardedCheckpointError, match="separate float32 masters"):
        save_learner(learner, tmp_path / "ckpt")
    fresh = _learner()
    with pytest.raises(ShardedCheckpointError, match="the learner has not stepped yet"):
        save_learner(fresh, tmp_path / "ckpt")
    assert not fresh.optimizer.state and os.listdir(tmp_path) == []
