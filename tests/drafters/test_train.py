"""Drafter training on a tiny target: the loss falls, checkpoints resume, acceptance improves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specrl.drafters.data import (
    Sequence,
    build_examples,
    load_examples,
    rollouts,
    save_examples,
)
from specrl.drafters.train import (
    STATE_FILE,
    NonFiniteWeights,
    TrainConfig,
    acceptance,
    collate,
    total_variation,
    train_head,
    ttt_loss,
)
from specrl.models.head_kinds import load_head
from specrl.models.heads import DraftHead, draft_vocab_by_frequency
from tests.conftest import make_tiny

torch.set_num_threads(1)


def tiny_setup(kind: str = "eagle3", draft_vocab: int = 0):
    target = make_tiny(seed=7, vocab_size=32, num_layers=4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (6,), generator=gen).tolist() for _ in range(24)]
    seqs = rollouts(target, prompts[:16], samples_per_prompt=4, temperature=1.0,
                    max_new_tokens=24, seed=1)  # fmt: skip
    vocab = (
        draft_vocab_by_frequency([s.tokens[s.prompt_len :] for s in seqs], draft_vocab, 32)
        if draft_vocab
        else None
    )
    torch.manual_seed(0)
    head = DraftHead(target, kind, draft_vocab=vocab)
    examples = build_examples(target, seqs, head.feature_layers, dtype=torch.float32)
    return target, head, examples, prompts[16:]


@pytest.mark.parametrize("draft_vocab", [0, 20], ids=["full-vocab", "vocab20"])
def test_loss_falls_and_trained_head_accepts_more(tmp_path, draft_vocab):
    target, head, examples, held_out = tiny_setup(draft_vocab=draft_vocab)
    before = {t: acceptance(target, head, held_out, k=3, temperature=t, max_new_tokens=24)
              for t in (0.0, 1.0)}  # fmt: skip
    cfg = TrainConfig(steps=80, lr=3e-3, warmup=5, batch_size=8, bf16=False, ckpt_every=40)
    losses = train_head(head, examples, cfg, out=tmp_path / "h", progress=False)
    assert len(losses) == 80
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    after = {t: acceptance(target, head, held_out, k=3, temperature=t, max_new_tokens=24)
             for t in (0.0, 1.0)}  # fmt: skip
    assert after[0.0] > before[0.0] and after[1.0] > before[1.0], (before, after)
    saved = load_head(tmp_path / "h", target)
    assert json.loads((tmp_path / "h" / "head.json").read_text())["kind"] == "eagle3"
    for a, b in zip(head.state_dict().values(), saved.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_resume_continues_where_it_stopped(tmp_path):
    target, head, examples, _ = tiny_setup("mtp")
    save_examples(examples, tmp_path / "ex.safetensors")
    examples = load_examples(tmp_path / "ex.safetensors")
    cfg = TrainConfig(steps=6, warmup=2, batch_size=4, bf16=False, ckpt_every=3)
    torch.manual_seed(0)
    first = DraftHead(target, "mtp")
    torch.manual_seed(0)
    ref = DraftHead(target, "mtp")
    full = train_head(ref, examples, cfg, progress=False)
    part = TrainConfig(**{**vars(cfg), "steps": 3})
    train_head(first, examples, part, out=tmp_path / "r", progress=False)
    again = DraftHead(target, "mtp")  # fresh weights: resume must load the saved state
    resumed = train_head(again, examples, cfg, out=tmp_path / "r", progress=False)
    assert len(resumed) == 6
    assert resumed[:3] == full[:3]
    torch.testing.assert_close(torch.tensor(resumed[3:]), torch.tensor(full[3:]))


def test_total_variation_is_the_rejection_probability():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(5, 11, generator=gen), -1)
    lq = torch.log_softmax(3 * torch.randn(5, 11, generator=gen), -1)
    reject = 1 - torch.minimum(p, lq.exp()).sum(-1)  # speculative sampling rejects a q-draft
    torch.testing.assert_close(total_variation(p, lq), reject.mean())


def test_tv_phase_after_ce_lowers_the_rejection_probability_more_than_ce(tmp_path):
    target, head, examples, _ = tiny_setup()
    ce = TrainConfig(steps=60, lr=3e-3, warmup=5, batch_size=8, bf16=False)
    train_head(head, examples, ce, progress=False)
    start = {k: v.clone() for k, v in head.state_dict().items()}
    batch = collate(examples, 512)
    before = float(ttt_loss(head, batch, 3, 0.8, loss="tv"))
    after = {}
    for loss in ("ce", "tv"):
        head.load_state_dict(start)
        more = TrainConfig(steps=40, lr=1e-3, warmup=5, batch_size=8, bf16=False, loss=loss)
        losses = train_head(head, examples, more, out=tmp_path, progress=False, state_name=loss)
        assert len(losses) == 40 and (tmp_path / loss).exists()
        after[loss] = float(ttt_loss(head, batch, 3, 0.8, loss="tv"))
    assert after["tv"] < min(before, after["ce"]), (before, after)


def test_shared_prompt_examples_equal_teacher_forcing():
    """Sequences sharing a prompt reuse one prompt forward; features equal a plain forward."""
    target = make_tiny(seed=3, vocab_size=32, num_layers=4)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 32, (5,), generator=gen).tolist()
    other = torch.randint(0, 32, (3,), generator=gen).tolist()
    seqs = [
        Sequence(prompt + torch.randint(0, 32, (n,), generator=gen).tolist(), len(prompt))
        for n in (4, 9, 1)
    ] + [Sequence(other + [7, 8], len(other))]
    layers = (0, 2, 3)
    examples = build_examples(target, seqs, layers, dtype=torch.float32)
    for seq, ex in zip(seqs, examples, strict=True):
        ids = torch.tensor([seq.tokens])
        ref = target(ids, torch.arange(ids.shape[1])[None], capture=layers)
        assert ex.tokens.tolist() == seq.tokens and ex.prompt_len == seq.prompt_len
        torch.testing.assert_close(ex.feats, torch.cat(ref.captured, -1)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ex.final, ref.hidden[0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- no pickles, no LM head call


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any torch.load (a pickle) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called: drafter files must be read without pickles")

    monkeypatch.setattr(torch, "load", refuse)


def test_examples_round_trip_through_safetensors(tmp_path, no_unpickling):
    target, head, examples, _ = tiny_setup()
    path = tmp_path / "ex.safetensors"
    save_examples(examples, path)
    with safe_open(str(path), "pt") as f:  # a safetensors file, tensors only
        assert f.metadata()["format"] == "specrl-drafter-examples"
        assert set(f.keys()) == {"tokens", "feats", "final", "lengths", "prompt_lens"}
    loaded = load_examples(path)
    assert len(loaded) == len(examples)
    for a, b in zip(examples, loaded, strict=True):
        assert a.prompt_len == b.prompt_len
        for name in ("tokens", "feats", "final"):
            assert torch.equal(getattr(a, name), getattr(b, name))
    assert not list(tmp_path.glob("*.tmp"))


def _truncated(path):
    path.write_bytes(path.read_bytes()[:-100])


def _pickled(path):
    import pickle

    path.write_bytes(pickle.dumps([{"tokens": [1, 2]}]))


def _foreign(path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(path))


def _inconsistent(path):
    from safetensors.torch import load_file, save_file

    t = load_file(str(path))
    t["lengths"][0] += 1  # the lengths no longer add up to the tokens
    save_file(t, str(path), metadata={"format": "specrl-drafter-examples", "version": "1"})


@pytest.mark.parametrize("damage", [_truncated, _pickled, _foreign, _inconsistent])
def test_a_damaged_examples_file_is_one_value_error(tmp_path, no_unpickling, damage):
    _, _, examples, _ = tiny_setup()
    path = tmp_path / "ex.safetensors"
    save_examples(examples, path)
    damage(path)
    with pytest.raises(ValueError, match=str(path)) as e:
        load_examples(path)
    assert "\n" not in str(e.value)


def test_training_state_is_safetensors_and_a_damaged_one_restarts(tmp_path, no_unpickling):
    """The state file holds tensors and JSON, nothing to unpickle; a damaged one is ignored
    with a warning and training starts over (the same losses as a fresh run)."""
    target, _, examples, _ = tiny_setup("mtp")
    cfg = TrainConfig(steps=4, warmup=2, batch_size=4, bf16=False, ckpt_every=2)
    torch.manual_seed(0)
    fresh = train_head(DraftHead(target, "mtp"), examples, cfg, progress=False)
    torch.manual_seed(0)
    train_head(DraftHead(target, "mtp"), examples, cfg, out=tmp_path, progress=False)
    state = tmp_path / STATE_FILE
    with safe_open(str(state), "pt") as f:
        meta = json.loads(f.metadata()["specrl"])
        assert meta["step"] == 4 and len(meta["losses"]) == 4
        assert all(k.startswith(("param.", "opt.")) for k in f.keys())  # noqa: SIM118
    state.write_bytes(state.read_bytes()[:200])
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=f"cannot read training state {state}"):
        again = train_head(DraftHead(target, "mtp"), examples, cfg, out=tmp_path, progress=False)
    assert again == fresh


def test_a_state_for_other_parameters_is_ignored_not_loaded(tmp_path, no_unpickling):
    """A state saved by an eagle3 head does not fit an mtp head: warned about, not loaded."""
    target, head, examples, _ = tiny_setup("eagle3")
    cfg = TrainConfig(steps=2, warmup=1, batch_size=4, bf16=False)
    train_head(head, examples, cfg, out=tmp_path, progress=False)
    torch.manual_seed(0)
    mtp = DraftHead(target, "mtp")
    before = {k: v.clone() for k, v in mtp.state_dict().items()}
    with pytest.warns(UserWarning, match="saved for other parameters"):
        losses = train_head(mtp, examples, TrainConfig(**{**vars(cfg), "steps": 0}), out=tmp_path,
                            progress=False)  # fmt: skip
    assert losses == [] and all(torch.equal(before[k], v) for k, v in mtp.state_dict().items())


def test_building_examples_never_calls_the_lm_head():
    """Issue 20: features came from a forward with ``logits_at=ids[:, :0]``, which sent an
    empty batch to the LM head, and the native GEMV kernel refuses M = 0 (``specrl
    train-drafter --drafter eagle3`` died after 14 minutes). Here the LM head refuses an empty
    batch the same way and records every call: features need no logits at all."""
    target = make_tiny(seed=3, vocab_size=32, num_layers=4)
    rows: list[int] = []
    real = target.lm_head.forward

    def refusing(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.numel() // x.shape[-1])
        if rows[-1] == 0:
            raise ValueError("gemv kernel refused shapes M=0, N=32, K=32")
        return real(x)

    target.lm_head.forward = refusing
    prompt = [1, 2, 3, 4]
    seqs = [Sequence(prompt + [5, 6, 7], 4), Sequence(prompt + [8], 4), Sequence([9, 10, 11], 2)]
    for layers in [(0, 2, 3), ()]:  # eagle3-style features; none (a draft model's data)
        examples = build_examples(target, seqs, layers, dtype=torch.float32)
        assert [len(e.tokens) for e in examples] == [7, 5, 3]
        assert all(e.feats.shape[-1] == 32 * len(layers) for e in examples)
    assert rows == []  # the LM head never ran
    with pytest.raises(ValueError, match="M=0"):  # control: the stand-in refuses M = 0
        ids = torch.tensor([[1, 2]])
        target(ids, torch.arange(2)[None], logits_at=ids[:, :0])


def test_a_diverged_head_is_never_saved(tmp_path):
    """Issue 42: `--tv-lr inf` saved a head of non-finite weights that then ran silently at
    acceptance 1.0. A step that makes a weight or the loss non-finite stops training, naming the
    step; neither the head nor its training state is written."""
    _, head, examples, _ = tiny_setup()
    cfg = TrainConfig(steps=5, lr=float("inf"), warmup=0, batch_size=8, bf16=False, ckpt_every=1)
    with pytest.raises(NonFiniteWeights, match=r"training diverged at step \d+: the drafter's"):
        train_head(head, examples, cfg, out=tmp_path, progress=False, state_name="tv")
    assert not (tmp_path / "head.safetensors").exists() and not (tmp_path / "tv").exists()
