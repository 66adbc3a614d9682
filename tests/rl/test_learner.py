"""Learner: chunked/packed logprobs against naive computation, accumulation, a toy RL problem."""

import copy

import pytest
import torch

from specrl.config_training import LearnerCfg
from specrl.models.config import tiny_config
from specrl.models.transformer import Transformer
from specrl.rl.advantages import compute_advantages
from specrl.rl.learner import (
    Learner,
    TrainSample,
    head_logprobs,
    micro_batches,
    pack_sequences,
    packed_logprobs,
    raw_logprobs,
    token_logprobs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0, embed_std: float = 1.0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config()).float().eval()
    with torch.no_grad():
        model.embed.weight.mul_(embed_std)  # small = near-uniform next-token distribution
    return model


def _sequences(seed: int = 1, n: int = 5) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, c = torch.randint(1, 8, (2,), generator=g).tolist()
        ids = torch.randint(0, 32, (p + c,), generator=g).tolist()
        out.append((ids[:p], ids[p:]))
    return out


def _naive(model, prompt, completion):  # full forward + full log-softmax, one sequence alone
    ids = torch.tensor([prompt + completion])
    logits = model(ids, torch.arange(ids.shape[1])[None]).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[len(prompt) - 1 + j, t] for j, t in enumerate(completion)])


def test_chunked_packed_logprobs_equal_naive_full_log_softmax():
    model, seqs = _model(), _sequences()
    got = token_logprobs(model, seqs, chunk=3, row_len=64)  # several sequences share a row
    assert pack_sequences(seqs, 64).ids.shape[0] < len(seqs)
    for (p, c), lp in zip(seqs, got, strict=True):
        assert lp.shape == (len(c),)
        assert torch.allclose(lp.double(), _naive(model, p, c), atol=1e-6)


def test_packing_equals_one_sequence_per_row():
    model, seqs = _model(), _sequences(seed=2, n=6)
    packed = token_logprobs(model, seqs, row_len=128)
    alone = token_logprobs(model, seqs, row_len=1)  # one row each, right-padded
    assert pack_sequences(seqs, 1).ids.shape[0] == len(seqs)
    for a, b in zip(packed, alone, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def _groups(seed: int = 5, groups: int = 3, size: int = 4) -> list[tuple[list[int], list[int]]]:
    """GRPO-like sequences: ``size`` consecutive completions per prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        prompt = torch.randint(0, 32, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        for _ in range(size):
            n = int(torch.randint(1, 7, (1,), generator=g))
            out.append((prompt.tolist(), torch.randint(0, 32, (n,), generator=g).tolist()))
    return out


@pytest.mark.parametrize("row_len", [64, 12])
def test_shared_prompts_run_once_and_give_the_same_logprobs(row_len):
    """A group's prompt is packed once per block (twice or more when the group does not fit a
    row); every completion's logprobs still equal its own full forward."""
    model, seqs = _model(), _groups()
    shared = pack_sequences(seqs, row_len, share_prompts=True)
    alone = pack_sequences(seqs, row_len)
    copies = int((shared.segments >= 0).sum()) - sum(len(c) for _, c in seqs)  # prompt tokens
    prompts = sum(len(p) for p, _ in seqs[::4])
    assert (copies == prompts) if row_len == 64 else (prompts < copies < 4 * prompts)
    assert int((alone.segments >= 0).sum()) == sum(len(p) + len(c) for p, c in seqs)
    got = packed_logprobs(model, shared, chunk=5).split(shared.lengths)
    for (p, c), lp in zip(seqs, got, strict=True):  # float32 rounding of logits ~ -40
        assert torch.allclose(lp.double(), _naive(model, p, c), atol=1e-5)


def test_shared_prompts_give_the_same_gradient():
    samples = _samples(_groups(seed=6))
    grads = []
    for share in (True, False):
        learner = Learner(
            _model(), LearnerCfg(micro_batch_tokens=40, dtype="fp32", share_prompts=share)
        )
        learner.accumulate_gradients(samples)
        grads.append([p.grad.clone() for p in learner.model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_train_step_keeps_the_logprobs_of_its_forward():
    """``keep_logprobs``: the result has each non-empty sample's logprobs from the step's own
    forward (before the update), in order, across micro-batches: what a separate no-grad pass
    would give."""
    seqs = _groups(seed=7)
    seqs.insert(3, (seqs[3][0], []))  # an empty completion is skipped
    model = _model()
    want = [lp for lp in raw_logprobs(model, seqs) if len(lp)]
    learner = Learner(copy.deepcopy(model), LearnerCfg(micro_batch_tokens=30, dtype="fp32"))
    step = learner.train_step([TrainSample(p, c, 1.0) for p, c in seqs], keep_logprobs=True)
    kept = step.logprobs
    assert learner.train_step([TrainSample(p, c, 1.0) for p, c in seqs]).logprobs is None
    assert len(kept) == len(want) == len(seqs) - 1 and not kept[0].requires_grad
    for a, b in zip(kept, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_micro_batches_count_a_shared_prompt_once():
    samples = [TrainSample([1] * 10, [2, 3], 1.0) for _ in range(4)]
    assert micro_batches(samples, 20, share_prompts=True) == [[0, 1, 2, 3]]  # 10 + 4 x 2
    assert micro_batches(samples, 20) == [[0], [1], [2], [3]]  # 12 each
    other = [*samples[:2], TrainSample([5] * 10, [2, 3], 1.0)]  # a new prompt counts in full
    assert micro_batches(other, 20, share_prompts=True) == [[0, 1], [2]]


def test_head_logprobs_temperature_and_grad_match_unchunked():
    torch.manual_seed(0)
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    t = torch.randint(0, 50, (10,))
    got = head_logprobs(h, w, t, temperature=0.7, chunk=4)
    ref = torch.log_softmax(h @ w.T / 0.7, -1).gather(1, t[:, None])[:, 0]
    assert torch.allclose(got, ref, atol=1e-6)
    (gh, gw) = torch.autograd.grad(got.sum(), (h, w))
    (rh, rw) = torch.autograd.grad(ref.sum(), (h, w))
    assert torch.allclose(gh, rh, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


def test_raw_logprobs_need_no_grad_and_learner_uses_its_precision():
    model, seqs = _model(), _sequences(n=2)
    model.requires_grad_(True)
    out = raw_logprobs(model, seqs)
    assert not out[0].requires_grad
    fp32 = Learner(copy.deepcopy(model), LearnerCfg(dtype="fp32")).raw_logprobs(seqs)
    bf16 = Learner(copy.deepcopy(model), LearnerCfg(dtype="bf16")).raw_logprobs(seqs)
    assert all(torch.equal(a, b) for a, b in zip(out, fp32, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(out, bf16, strict=True))


def _samples(seqs, seed=3):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(len(seqs), generator=g).tolist()
    return [TrainSample(p, c, a) for (p, c), a in zip(seqs, adv, strict=True)]


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_equals_one_big_batch(loss):
    samples = _samples(_sequences(seed=4, n=6))
    grads = []
    for budget in (10_000, 14):
        cfg = LearnerCfg(loss=loss, dtype="fp32")  # a budget below the config's minimum:
        cfg = cfg.model_copy(update={"micro_batch_tokens": budget})  # unvalidated
        learner = Learner(_model(), cfg, max_len=8)
        metrics = learner.accumulate_gradients(samples).metrics
        grads.append([p.grad.clone() for p in learner.model.parameters()])
        assert metrics["micro_batches"] == (1 if budget > 100 else len(micro_batches(samples, 14)))
    assert len(micro_batches(samples, 14)) >= 2
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_behaviour_logprobs_enter_the_ratio_and_kl_to_reference():
    model, seqs = _model(), _sequences(n=3)
    ref = copy.deepcopy(model)
    learner = Learner(model, LearnerCfg(dtype="fp32", kl_coef=0.1), ref_model=ref)
    current = raw_logprobs(model, seqs)
    samples = [TrainSample(p, c, 1.0, (lp - 0.1).tolist()) for (p, c), lp in
               zip(seqs, current, strict=True)]  # fmt: skip
    m = learner.accumulate_gradients(samples).metrics
    assert m["ratio_mean"] == pytest.approx(torch.exp(torch.tensor(0.1)).item(), rel=1e-5)
    assert m["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before any step
    learner.optimizer.zero_grad()
    for _ in range(3):
        m = learner.train_step([TrainSample(p, c, 1.0) for p, c in seqs]).metrics
    assert m["kl"] > 0 and m["grad_norm"] > 0


def test_bf16_logprobs_close_to_fp32():
    model, seqs = _model(), _sequences(n=3)
    learner = Learner(copy.deepcopy(model), LearnerCfg(dtype="bf16"))
    batch = pack_sequences(seqs)
    with torch.no_grad():
        lp16, _ = learner._logprobs(learner.model, batch)
    lp32 = torch.cat(token_logprobs(model, seqs))
    assert lp16.dtype == torch.float32
    assert (lp16 - lp32).abs().max() < 0.05


def _sample_completions(model, prompt, n, length, gen):
    seqs = torch.tensor([prompt] * n)
    for _ in range(length):
        pos = torch.arange(seqs.shape[1])[None].expand_as(seqs)
        with torch.no_grad():
            logits = model(seqs, pos).logits[:, -1]
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        seqs = torch.cat([seqs, nxt], 1)
    return seqs[:, len(prompt) :].tolist()


def _p_target(model, prompt, target):
    with torch.no_grad():
        return float(raw_logprobs(model, [(prompt, [target])])[0].exp())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grpo_steps_raise_expected_reward_on_toy_problem(dtype):
    # reward = share of completion tokens equal to TARGET; GRPO should make TARGET likelier
    target, prompts = 5, [[1, 2, 3], [4, 6]]
    model = _model(seed=7, embed_std=0.05)
    learner = Learner(model, LearnerCfg(lr=3e-3, dtype=dtype, micro_batch_tokens=64))
    gen = torch.Generator().manual_seed(0)
    before = [_p_target(model, p, target) for p in prompts]
    for _ in range(12):
        samples, rewards = [], []
        for p in prompts:
            comps = _sample_completions(model, p, 8, 3, gen)
            rewards.append([sum(t == target for t in c) / 3 for c in comps])
            samples += [(p, c) for c in comps]
        adv = compute_advantages("grpo", torch.tensor(rewards)).flatten().tolist()
        learner.train_step([TrainSample(p, c, a) for (p, c), a in zip(samples, adv, strict=True)])
    after = [_p_target(model, p, target) for p in prompts]
    assert all(0.01 < b < 0.1 for b in before), before
    assert all(a > 3 * b for a, b in zip(after, before, strict=True)), (before, after)


def test_the_learner_takes_the_configured_settings():
    from specrl.config import load_config

    cfg = load_config(None, ["learner.loss=dapo", "learner.lr=1e-3", "learner.dtype=fp32",
                             "learner.clip_eps_high=0.3"]).learner  # fmt: skip
    learner = Learner(_model(), cfg, max_len=16)
    assert learner.loss_name == "dapo" and learner.dtype == "fp32"
    assert learner.optimizer.param_groups[0]["lr"] == 1e-3
    assert learner.loss_kwargs["eps_high"] == 0.3 and learner.loss_kwargs["max_len"] == 16


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        Learner(_model(), LearnerCfg(dtype="fp16"))
    with pytest.raises(ValueError, match="ref_model"):
        Learner(_model(), LearnerCfg(kl_coef=0.1))
    with pytest.raises(ValueError, match="unknown policy loss"):
        Learner(_model(), LearnerCfg(loss="ppo2"))
    with pytest.raises(ValueError, match="old_logprobs"):
        Learner(_model(), LearnerCfg()).train_step([TrainSample([1], [2, 3], 1.0, [0.0])])
    with pytest.raises(ValueError, match="non-empty"):
        Learner(_model(), LearnerCfg()).train_step([TrainSample([1], [], 1.0)])


@pytest.mark.slow
def test_logprobs_match_transformers_on_smollm2():
    transformers = pytest.importorskip("transformers")
    from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model

    tok = load_tokenizer()
    ours = load_model(dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model("smollm2"), dtype=torch.float32
    ).eval()
    seqs = [
        (tok.encode_chat("What is 3 + 4?"), tok.encode("The answer is 7.<|im_end|>")),
        (tok.encode_chat("Spell 'cat' backward."), tok.encode("tac")),
        (tok.encode("Once upon a time"), tok.encode(" there was a small dragon who liked tea")),
    ]
    got = token_logprobs(ours, seqs, chunk=5)
    for (p, c), lp in zip(seqs, got, strict=True):
        with torch.no_grad():
            logits = ref(torch.tensor([p + c])).logits[0].double()
        expect = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1, len(p) + len(c) - 1), c]
        assert (lp.double() - expect).abs().max() < 1e-4
