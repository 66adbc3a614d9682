"""A learned drafter trained during RL (issue 16): the learner's forward feeds it, its updates
reach the engine with a version, a fresh machine trains a head (or a draft model) from scratch,
resume restores it."""

from __future__ import annotations

import pytest
import torch

from specrl.backends import plan_rollout
from specrl.backends.native import drafter_tensors
from specrl.config import ConfigError
from specrl.config_training import LearnerCfg
from specrl.drafters.online import OnlineDrafter, StepSignals, Trigger, context_note
from specrl.models.fingerprint import fingerprint, fingerprint_dtype
from specrl.models.heads import DraftHead, save_head
from specrl.pipelines.loop import open_run
from specrl.pipelines.state import StepState
from specrl.pipelines.step import collect, learn
from specrl.pipelines.train import train
from specrl.rl import Learner, TrainSample
from tests.conftest import make_tiny
from tests.pipelines.pipeline_fakes import draw_prompts, tiny_config, tiny_parts

EAGLE = ("rollout.spec=eagle3", "rollout.max_new_tokens=12")


def eagle_config(*sets: str):
    """``tiny_config`` of an EAGLE-3 run (``EAGLE`` <- ``sets``); a head trained from nothing
    keeps the tiny model's whole vocabulary (``drafter.vocab=0``, which applies only there)."""
    cfg = tiny_config(*EAGLE, *sets)
    fresh = cfg.drafter.mode != "frozen" and cfg.rollout.spec != "draft"
    if fresh and cfg.rollout.drafter_path is None and not any("drafter.vocab" in s for s in sets):
        return tiny_config(*EAGLE, "drafter.vocab=0", *sets)
    return cfg


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    """A fresh machine: no drafter was ever trained or cached."""
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "empty-cache"))


def engine_head(parts) -> dict[str, torch.Tensor]:
    """The engine's drafter tensors (a head's state dict, a draft model's parameters)."""
    return drafter_tensors(parts.backend.engine.proposer)[0]


def test_learner_captures_each_samples_features_from_its_training_forward():
    model = make_tiny(0)
    learner = Learner(model, LearnerCfg(dtype="fp32").model_copy(update={"lr": 0.0}))
    prompt = [5, 6, 7]
    samples = [TrainSample(prompt, [9, 10, 11], 1.0), TrainSample(prompt, [12, 2], -1.0),
               TrainSample([3, 4], [8], 0.5)]  # fmt: skip
    captured = learner.train_step(samples, capture=(0, 1)).features
    assert [c.tokens.tolist() for c in captured] == [
        list(s.prompt_ids) + list(s.completion_ids) for s in samples
    ]
    for s, c in zip(samples, captured, strict=True):
        ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
        with torch.no_grad():  # the sequence alone: packing and prompt sharing change nothing
            final, layers = model.hidden_states(ids, torch.arange(ids.shape[1])[None],
                                                capture=(0, 1))  # fmt: skip
        assert c.prompt_len == len(s.prompt_ids)
        torch.testing.assert_close(c.feats.float(), torch.cat(layers, -1)[0], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(c.final.float(), final[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "block", "draft", "hybrid"])
def test_online_updates_reach_the_engine_with_version_and_content(no_cache, kind, monkeypatch):
    parts = tiny_parts(eagle_config(f"rollout.spec={kind}", "drafter.mode=online"))
    trainer = parts.drafter.trainer
    monkeypatch.setattr(trainer, "_affordable", lambda: 1)  # no timing here (budget: own test)
    before = {k: v.clone() for k, v in engine_head(parts).items()}
    learner = StepState()
    for step in range(2):
        row = learn(parts, learner, collect(parts, draw_prompts(parts, step), step), 0.0)
        assert row["drafter_updates"] == 1 and row["drafter_version"] == step + 1
        served = parts.backend.served()
        assert served.drafter_version == trainer.ledger.version == step + 1
        state = trainer.state()
        assert served.drafter == fingerprint(state, fingerprint_dtype(served.drafter))
        for name, t in engine_head(parts).items():
            torch.testing.assert_close(t, state[name].to(t.dtype))
    assert any(not torch.equal(before[k], v) for k, v in engine_head(parts).items())


def test_training_data_are_each_steps_own_rollouts(no_cache):
    parts = tiny_parts(eagle_config("drafter.mode=online", "drafter.buffer_steps=1"))
    seen, state = [], StepState()
    for step in range(2):
        batch = collect(parts, draw_prompts(parts, step), step)
        learn(parts, state, batch, 0.0)
        expected = sorted(c.prompt_ids + c.token_ids for c in batch.completions if c.token_ids)
        (buffered,) = parts.drafter.trainer.buffer
        assert sorted(e.tokens.tolist() for e in buffered) == expected
        seen.append(expected)
    assert seen[0] != seen[1]


def test_a_fresh_machine_trains_the_head_from_its_first_step(no_cache, tmp_path):
    cfg = eagle_config("run.steps=3", "drafter.vocab=16")
    assert cfg.drafter.mode == "auto" and plan_rollout(cfg).training_mode == "refresh"
    parts = tiny_parts(cfg)
    assert parts.drafter.trainer.fresh
    rows = train(parts, str(tmp_path / "run"), progress=False)
    assert rows[0]["drafter_trigger"] == "cold" and rows[0]["drafter_updates"] >= 1
    head = parts.backend.engine.proposer.head  # the vocabulary the trainer picked, served
    assert head.d2t is not None and len(head.d2t) == 16
    assert torch.equal(head.d2t, parts.drafter.trainer.model.d2t)


def test_a_fresh_machine_trains_a_draft_model_from_the_policys_first_layers(no_cache, tmp_path):
    cfg = tiny_config("rollout.spec=draft", "rollout.max_new_tokens=12", "run.steps=2")
    assert plan_rollout(cfg).training_mode == "refresh"
    parts = tiny_parts(cfg)
    trainer, engine = parts.drafter.trainer, parts.backend.engine
    assert trainer.fresh and trainer.capture_layers() == ()  # learns from the final hidden only
    assert engine.draft_model.config.num_layers == 1  # half of the tiny policy's 2 layers
    start = {k: v.clone() for k, v in engine_head(parts).items()}
    for name, t in parts.learner.model.named_parameters():  # the policy's own first layer
        if name.startswith("layers.0.") or name == "norm.weight":
            torch.testing.assert_close(start[name], t.to(start[name].dtype))
    rows = train(parts, str(tmp_path / "run"), progress=False)
    assert rows[0]["drafter_trigger"] == "cold" and rows[0]["drafter_updates"] >= 1
    assert rows[0]["drafter_kl"] > 0 and engine.stats.drafted > 0
    moved = [k for k, v in engine_head(parts).items() if not torch.equal(v, start[k])]
    assert any(k.startswith("layers.") for k in moved)  # trained
    assert all(k.startswith("layers.") or k in ("norm.weight", "embed.weight") for k in moved)
    trained = parts.drafter.trainer.model  # its embedding / LM head: the policy's, as it moved
    torch.testing.assert_close(trained.embed.weight, parts.learner.model.embed.weight)


def test_frozen_needs_a_trained_head_and_explicit_modes_need_a_learned_drafter(no_cache):
    with pytest.raises(ConfigError, match="specrl train-drafter --drafter eagle3"):
        tiny_parts(eagle_config("drafter.mode=frozen"))
    with pytest.raises(ConfigError, match="drafter.mode='online' needs a learned drafter"):
        tiny_parts(tiny_config("rollout.spec=suffix", "drafter.mode=online"))
    assert plan_rollout(tiny_config("rollout.spec=suffix")).training_mode is None
    with pytest.raises(ConfigError, match="'mtp' is not supported by the vllm backend"):
        plan_rollout(eagle_config("rollout.spec=mtp", "rollout.backend=vllm",
                                 "drafter.mode=online"))  # fmt: skip
    with pytest.raises(ConfigError, match="serves a trained block head frozen .* needs "
                       "rollout.backend='native'"):  # fmt: skip
        plan_rollout(eagle_config("rollout.spec=block", "rollout.backend=vllm",
                                 "drafter.mode=online"))  # fmt: skip


@pytest.mark.parametrize("kind", ["eagle3", "block", "draft"])
def test_resume_restores_the_drafter_and_its_optimizer(no_cache, tmp_path, kind):
    cfg = eagle_config(f"rollout.spec={kind}", "drafter.mode=online", "run.steps=2",
                      "run.checkpoint_every=2", "run.eval_every=0")  # fmt: skip
    first = tiny_parts(cfg)
    train(first, str(tmp_path / "run"), progress=False)
    saved, opt = first.drafter.trainer.state(), first.drafter.trainer.opt.state_dict()
    again = tiny_parts(cfg)
    assert any(not torch.equal(v, saved[k]) for k, v in again.drafter.trainer.state().items())
    assert open_run(again, again_dir := _run_dir(tmp_path), resume=True).step == 2
    trainer = again.drafter.trainer
    for name, t in trainer.state().items():
        assert torch.equal(t, saved[name]), name
    restored = trainer.opt.state_dict()
    assert restored["state"].keys() == opt["state"].keys()
    for i, slot in opt["state"].items():
        for key, value in slot.items():
            assert torch.equal(torch.as_tensor(restored["state"][i][key]), torch.as_tensor(value))
    assert trainer.ledger.version == first.drafter.trainer.ledger.version
    assert again.backend.served().drafter_version == trainer.ledger.version
    for name, t in engine_head(again).items():
        torch.testing.assert_close(t, saved[name].to(t.dtype))
    assert again_dir.latest_checkpoint() is not None


def _run_dir(tmp_path):
    from specrl.pipelines.rundir import RunDir

    return RunDir(tmp_path / "run")


def test_a_saved_head_starts_the_trainer_and_is_not_replaced(tmp_path, monkeypatch):
    torch.manual_seed(3)
    path = save_head(DraftHead(make_tiny(0), "eagle3"), tmp_path / "head",
                     extra={"trained_len": 40})  # fmt: skip
    parts = tiny_parts(eagle_config(f"rollout.drafter_path={path}"))
    assert not parts.drafter.trainer.fresh and parts.drafter.trained_len == 40
    frozen = tiny_parts(eagle_config(f"rollout.drafter_path={path}", "drafter.mode=frozen"))
    assert frozen.drafter.trainer is None and frozen.drafter.trained_len == 40
    for a, b in zip(engine_head(parts).values(), engine_head(frozen).values(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- units


def signals(version: int, rate: float = 0.0, rows: int = 0) -> StepSignals:
    return StepSignals(1.0, version, rate, rows)


def test_trigger_fires_on_each_measured_signal_and_not_on_a_steady_one():
    t = Trigger(tolerance=0.1, max_lag=5)
    assert t.why(2.0, signals(1, 0.5, 64)) == "cold"
    t.trained_version, t.trained_kl = 1, 2.0
    assert t.why(1.5, signals(2, 0.5, 64)) == "improving"  # training paid: keep going
    t.trained_version, t.trained_kl = 2, 1.5
    assert t.why(1.45, signals(3, 0.5, 64)) == ""  # < 10% better: converged
    assert t.why(1.46, signals(4, 0.5, 64)) == ""
    assert t.why(1.8, signals(5, 0.5, 64)) == "kl"  # the policy moved away from the head
    assert t.why(1.46, signals(6, 0.3, 64)) == "acceptance"
    assert t.why(1.46, signals(6, 0.3, 4)) == ""  # 4 drafting rows are no evidence
    assert t.why(1.46, signals(7, 0.5, 64)) == "lag"  # 5 versions since the last training


def test_the_kl_level_drifts_up_so_a_settled_policy_stops_triggering():
    t = Trigger(tolerance=0.1, max_lag=1000, trained_version=0)
    t.why(1.0, signals(10))
    fired = [t.why(1.2, signals(11 + i)) for i in range(12)]
    assert fired[0] == "kl" and fired[-1] == ""


def test_updates_are_paid_from_the_time_budget():
    from specrl.config import DrafterCfg
    from specrl.drafters.students import HeadStudent

    trainer = OnlineDrafter(HeadStudent(DraftHead(make_tiny(0), "eagle3")),
                            DrafterCfg(max_updates=5), "online", fresh=False)  # fmt: skip
    assert trainer._affordable() == 1  # cost unknown: one update measures it
    trainer.ledger.update_s, trainer.ledger.budget_s = 0.1, 0.35
    assert trainer._affordable() == 3  # paid in full: 3.5 updates' worth buys 3
    trainer.ledger.budget_s = 10.0
    assert trainer._affordable() == 5
    trainer.ledger.budget_s = 0.09  # less than one update: saved for the next step
    assert trainer._affordable() == 0
    trainer.ledger.budget_s = -0.01
    assert trainer._affordable() == 0
    # an update dearer than the full budget can hold: one on credit, then none until repaid
    trainer.ledger.update_s, trainer.ledger.budget_s, trainer.ledger.full = 1.2, 0.8, True
    assert trainer._affordable() == 1
    trainer.ledger.budget_s, trainer.ledger.full = -0.4, False
    assert trainer._affordable() == 0


def test_a_dear_update_does_not_stop_training_for_good(no_cache, monkeypatch):
    """Steps of 1 s with a 0.1 share (the budget caps at 0.4 s) and updates measured at 1 s:
    the trainer still updates, about once per 10 steps (the share on average)."""
    from specrl.config import DrafterCfg
    from specrl.drafters.online import StepSignals
    from specrl.drafters.students import HeadStudent

    trainer = OnlineDrafter(HeadStudent(DraftHead(make_tiny(0), "eagle3")),
                            DrafterCfg(time_share=0.1), "online", fresh=False)  # fmt: skip
    trainer.ledger.update_s = 1.0
    trainer.buffer.append([])  # something to train on (the batch is patched below)
    spent = []

    def train(n):
        spent.append(n)
        trainer.ledger.budget_s -= n * 1.0  # as _train charges what the updates took
        return [0.0] * n

    monkeypatch.setattr(trainer, "_train", lambda n: train(n) if n else [])
    monkeypatch.setattr(trainer, "fresh_kl", lambda examples: 1.0)
    for step in range(40):
        trainer.step([], StepSignals(step_s=1.0, version=step))
    assert 3 <= sum(spent) <= 5


def test_context_note_names_the_trained_length():
    assert context_note(0, [5000]) is None and context_note(100, [100, 80]) is None
    note = context_note(100, [90, 150, 130])
    assert "2 of 3 rollouts" in note and "100 tokens" in note and "150" in note
    assert "\n" not in note


def test_a_drafter_update_during_a_generate_call_applies_before_the_next(no_cache):
    parts = tiny_parts(eagle_config("drafter.mode=online"))
    backend, trainer = parts.backend, parts.drafter.trainer
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.25)
    with backend._lock:
        backend._busy = True  # as while the async producer generates
    backend.update_drafter(trainer.state(), 7)
    assert backend.versions().drafter == 0  # not yet: the call owns the engine
    with backend._lock:
        backend._busy = False
    assert backend.served().drafter_version == 7  # idle again: applied
    for name, t in engine_head(parts).items():
        torch.testing.assert_close(t, trainer.state()[name].to(t.dtype))


def test_the_run_summary_says_how_the_drafter_trained(no_cache, tmp_path):
    from specrl.pipelines.report import summarize, summary_text

    parts = tiny_parts(eagle_config("drafter.mode=online", "run.steps=2"))
    rows = train(parts, str(tmp_path / "run"), progress=False)
    s = summarize(rows, [], None)
    assert s["drafter_updates"] == sum(r["drafter_updates"] for r in rows) >= 1  # step 0 trains
    version = rows[-1]["drafter_version"]
    assert s["drafter_version"] == version >= 1
    assert f"updates during the run (version {version}, " in summary_text(s)


def test_the_hybrid_drafter_serves_and_finds_an_eagle3_head(tmp_path, monkeypatch):
    from specrl.paths import drafter_cache_dir

    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    cfg = eagle_config("rollout.spec=hybrid", "drafter.mode=frozen")
    with pytest.raises(ConfigError, match="specrl train-drafter --drafter eagle3`"):
        tiny_parts(cfg)
    torch.manual_seed(3)
    save_head(DraftHead(make_tiny(0), "eagle3"), drafter_cache_dir(cfg.model.name, "eagle3"))
    parts = tiny_parts(cfg)  # the head `train-drafter --drafter eagle3` cached
    assert parts.drafter.trainer is None and parts.backend.engine.proposer.name == "hybrid"
    assert plan_rollout(eagle_config("rollout.spec=hybrid")).training_mode == "refresh"
