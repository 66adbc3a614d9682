"""vLLM rollouts with a drafter trained during RL (issue 40): ``drafter.mode`` online/refresh
plans for ``eagle3`` and ``draft`` on ``rollout.backend=vllm``; the vLLM backend serves the head
the trainer starts from (from nothing: seeded by ``run.seed``; from a cached head in vLLM's
layout or a specrl head directory), and after every update vLLM's own drafter tensors are the
trained ones (the guard's check passes; a tampered push fails it). Two engines in all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specrl.backends import plan_rollout
from specrl.backends.vllm import vllm_available
from specrl.backends.vllm_spec import served_drafter
from specrl.backends.vllm_weights import eagle3_ours
from specrl.backends.vllm_worker import parameters_by_name
from specrl.config import ConfigError, load_config
from specrl.drafters.export import export_eagle3, import_eagle3, is_eagle3_export
from specrl.models.fingerprint import fingerprint
from specrl.models.head_kinds import fresh_head
from specrl.models.heads import DraftHead, save_head
from specrl.pipelines.guard import WeightSyncError
from tests.backends.sabotage import Sabotaged
from tests.conftest import ON_SERVER_WORKER, make_tiny
from tests.pipelines.pipeline_fakes import tiny_config

VLLM = ("rollout.backend=vllm", "rollout.spec=eagle3", "rollout.num_spec_tokens=2")
RUN = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
       "env.num_eval=4", "run.steps=2", "run.eval_every=0", "run.checkpoint_every=0",
       "model.dtype=fp32", "learner.dtype=fp32", "drafter.mode=online",
       *VLLM]  # fmt: skip


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    """A fresh machine: no drafter was ever trained or cached."""
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "empty-cache"))


def head_dir(tmp_path: Path, arch: str) -> Path:
    return save_head(DraftHead(make_tiny(), "eagle3", arch=arch), tmp_path / f"head-{arch}")


# --------------------------------------------------------------------------- plans, no engine


@pytest.mark.parametrize("spec", ["eagle3", "draft"])
@pytest.mark.parametrize("mode", ["online", "refresh", "auto"])
def test_vllm_plans_a_drafter_trained_during_rl(no_cache, spec, mode):
    cfg = tiny_config(*VLLM, f"rollout.spec={spec}", f"drafter.mode={mode}")
    plan = plan_rollout(cfg)
    assert plan.training_mode == ("refresh" if mode == "auto" else mode)
    assert plan.drafter_dir is None  # from nothing: build_vllm writes what vLLM loads
    # vLLM serves its own EAGLE-3 layer and sizes the draft vocabulary when it starts
    assert (plan.head_arch, plan.head_vocab) == ("eagle3", cfg.drafter.vocab)
    native = plan_rollout(tiny_config(f"rollout.spec={spec}", f"drafter.mode={mode}"))
    assert (native.head_arch, native.head_vocab) == ("proj", 0)


def test_a_specrl_eagle3_head_directory_plans_and_a_proj_one_is_refused(no_cache, tmp_path):
    for mode in ("frozen", "online"):
        path = head_dir(tmp_path, "eagle3")
        plan = plan_rollout(tiny_config(*VLLM, f"rollout.drafter_path={path}",
                                        f"drafter.mode={mode}"))  # fmt: skip
        assert plan.drafter_dir == str(path)
    proj = head_dir(tmp_path, "proj")
    with pytest.raises(ConfigError, match="'proj' layout .* --head-arch eagle3") as e:
        plan_rollout(tiny_config(*VLLM, f"rollout.drafter_path={proj}", "drafter.mode=online"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["drafter.mode=frozen"], "needs a head in vLLM's EAGLE-3 layout"),
        (["rollout.spec=draft", "drafter.mode=frozen"], "needs a draft model directory"),
        (["rollout.spec=mtp", "drafter.mode=online"], "'mtp' is not supported by the vllm"),
    ],
)
def test_what_vllm_cannot_serve_is_refused_in_one_line(no_cache, sets, words):
    with pytest.raises(ConfigError, match=words) as e:
        plan_rollout(tiny_config(*VLLM, *sets))
    assert "\n" not in str(e.value)


def test_served_drafter_writes_what_the_trainer_starts_from(no_cache, tmp_path):
    """From nothing: the exported head is ``fresh_head`` seeded by run.seed (the trainer's
    start), its draft vocabulary sized by drafter.vocab; a specrl head directory is exported
    as it is; a draft model from nothing is the policy's first layers as a model directory."""
    policy = make_tiny()
    plan = plan_rollout(tiny_config(*VLLM, "drafter.mode=online", "drafter.vocab=16",
                                    "run.seed=7"))  # fmt: skip
    out = Path(served_drafter(plan, policy, ".", tmp_path / "fresh"))
    assert is_eagle3_export(out) and out.is_relative_to(tmp_path / "fresh")
    want = fresh_head(policy, "eagle3", 7, "eagle3", 16).state_dict()
    got = import_eagle3(out, policy).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert len(got["d2t"]) == 16
    path = head_dir(tmp_path, "eagle3")
    cached = plan_rollout(tiny_config(*VLLM, f"rollout.drafter_path={path}"))
    out = Path(served_drafter(cached, policy, ".", tmp_path / "cached"))
    want = DraftHead(policy, "eagle3", arch="eagle3")
    want.load_state_dict(import_eagle3(out, policy).state_dict())
    assert fingerprint(want.state_dict()) == fingerprint(
        import_eagle3(export_eagle3(path, policy, tmp_path / "by-hand"), policy).state_dict()
    )
    draft = plan_rollout(tiny_config(*VLLM, "rollout.spec=draft", "drafter.mode=online"))
    out = Path(served_drafter(draft, policy, ".", tmp_path / "draft"))
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and raw["hidden_size"] == policy.config.hidden_size
    big = plan_rollout(tiny_config(*VLLM, "drafter.mode=online", "drafter.vocab=100000"))
    with pytest.raises(ValueError, match="drafter.vocab: 100000 is not below"):
        served_drafter(big, policy, ".", tmp_path / "big")


# --------------------------------------------------------------------------- engines


def served_head(backend) -> dict[str, torch.Tensor]:
    """vLLM's own EAGLE-3 tensors under specrl's names (read on the engine thread)."""
    return eagle3_ours(backend._rpc(parameters_by_name, True))


def assert_serves_the_trained_head(parts) -> None:
    trainer, backend = parts.drafter.trainer, parts.backend
    state = trainer.state()
    served = served_head(backend)
    assert state.keys() == served.keys()
    assert all(torch.equal(state[k], served[k]) for k in state)
    assert backend.served().drafter == fingerprint(state, torch.float32)
    assert backend.versions().drafter == trainer.ledger.version


def trained_run(cfg, run_dir: Path):
    """``cfg`` built and trained (the guard checks every push; a mismatch raises), its rows."""
    from specrl.pipelines.build import build_run
    from specrl.pipelines.train import train

    parts = build_run(cfg)
    assert type(parts.backend).__name__ == "VllmBackend"
    start = {k: v.clone() for k, v in parts.drafter.trainer.state().items()}
    assert_serves_the_trained_head(parts)  # version 0: what the trainer starts from
    rows = train(parts, str(run_dir), progress=False)
    return parts, start, rows


@pytest.mark.slow
@pytest.mark.solo  # 10-12.5 GB resident (measured)
@ON_SERVER_WORKER
def test_vllm_trains_an_eagle3_head_from_nothing_then_from_the_cached_head(no_cache, tmp_path):
    if not vllm_available():
        pytest.skip("vllm is not installed (specrl[vllm])")
    parts, start, rows = trained_run(load_config(None, RUN), tmp_path / "nothing")
    try:
        owned = Path(parts.backend._owned)
        assert owned.is_dir()
        seeded = fresh_head(parts.learner.model, "eagle3", 0, "eagle3", 4096).state_dict()
        assert all(torch.equal(start[k], seeded[k]) for k in seeded)  # run.seed's fresh head
        trainer = parts.drafter.trainer
        assert [r["drafter_version"] for r in rows][-1] == trainer.ledger.version >= 1
        assert rows[0]["drafter_updates"] >= 1 and rows[0]["drafting_steps"] > 0
        state = trainer.state()
        assert not torch.equal(state["d2t"], start["d2t"])  # the vocabulary picked, and served
        assert_serves_the_trained_head(parts)
        version = trainer.ledger.version
        parts.guard.push_drafter(parts.backend, state, version + 1)  # an honest push passes
        with pytest.raises(WeightSyncError, match=f"at drafter version {version + 2}"):
            sabotaged = Sabotaged(parts.backend, "scale", version + 2, drafter=True)
            parts.guard.push_drafter(sabotaged, state, version + 2)
        head = save_head(trainer.model, tmp_path / "trained")
        cached = export_eagle3(head, parts.learner.model, tmp_path / "cached")
    finally:
        parts.backend.close()
    assert not owned.exists()  # the drafter build_vllm wrote is gone with the engine
    cfg = load_config(None, [*RUN, f"rollout.drafter_path={cached}", "run.seed=3"])
    parts, start, rows = trained_run(cfg, tmp_path / "cached-run")
    try:  # the trainer started from the cached head (not a fresh one), and moved on
        assert all(torch.equal(start[k], state[k]) for k in state)
        assert parts.drafter.trainer.ledger.version >= 1
        assert_serves_the_trained_head(parts)
    finally:
        parts.backend.close()


@pytest.mark.slow
@pytest.mark.solo  # 10-12.5 GB resident (measured)
@ON_SERVER_WORKER
def test_vllm_trains_a_draft_model_from_nothing(no_cache, tmp_path):
    """The policy's first layers, written for vLLM at start, trained and pushed: vLLM serves
    the trained draft model (the guard checked every push during the run)."""
    if not vllm_available():
        pytest.skip("vllm is not installed (specrl[vllm])")
    from specrl.pipelines.build import build_run
    from specrl.pipelines.train import train

    cfg = load_config(None, [*RUN, "rollout.spec=draft", "run.steps=1"])
    parts = build_run(cfg)
    try:
        rows = train(parts, str(tmp_path / "run"), progress=False)
        trainer = parts.drafter.trainer
        assert rows[0]["drafter_updates"] >= 1 and trainer.ledger.version == 1
        served = parts.backend.served()
        assert served.drafter_version == 1
        assert served.drafter == fingerprint(trainer.state(), torch.float32)
    finally:
        parts.backend.close()
