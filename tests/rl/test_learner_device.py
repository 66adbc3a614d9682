"""The learner's device path: placement and fused AdamW, activation checkpointing, bf16 with
float32 masters ('params' mode, checkpointed bit-exact), and the throughput metrics (model FLOPs
against a hand count). CUDA cases run where a GPU is present (``-k cuda``)."""

import copy

import pytest
import torch

from specrl.config import LearnerCfg
from specrl.models.device import peak_flops
from specrl.models.flops import param_counts, train_flops
from specrl.models.transformer import Block
from specrl.pipelines.checkpoint import load_checkpoint, save_checkpoint
from specrl.rl.learner import Learner, TrainSample
from tests.conftest import DEVICES, make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _samples(seed: int = 0, groups: int = 3, size: int = 4) -> list[TrainSample]:
    """GRPO-like groups: ``size`` completions after each shared prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        prompt = torch.randint(0, 32, (4,), generator=g).tolist()
        for _ in range(size):
            completion = torch.randint(0, 32, (6,), generator=g).tolist()
            out.append(TrainSample(prompt, completion, float(torch.randn(1, generator=g))))
    return out


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_learner_runs_where_its_model_is(device):
    model = make_tiny(head_dim=16).to(device)  # head_dim 16: flex attention on CUDA
    learner = Learner(model, LearnerCfg(dtype="fp32", lr=1e-3, micro_batch_tokens=40))
    assert learner.device.type == device
    fused = learner.optimizer.defaults["fused"]
    assert (fused, learner.optimizer.defaults["foreach"]) == (
        (True, None) if device == "cuda" else (None, True)
    )
    metrics = learner.train_step(_samples()).metrics
    assert metrics["micro_batches"] > 1 and all(p.device.type == device for p in model.parameters())
    cpu = Learner(make_tiny(head_dim=16), LearnerCfg(dtype="fp32", lr=1e-3, micro_batch_tokens=40))
    want = cpu.train_step(_samples()).metrics
    assert metrics["loss"] == pytest.approx(want["loss"], abs=1e-4)
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_activation_checkpointing_gives_the_same_loss_and_gradients(monkeypatch):
    count = [0]
    forward = Block.forward

    def counted(self, *args):
        count[0] += 1
        return forward(self, *args)

    monkeypatch.setattr(Block, "forward", counted)
    calls = {}
    for flag in (False, True):
        model, count[0] = make_tiny(), 0
        learner = Learner(model, LearnerCfg(dtype="fp32", activation_checkpointing=flag))
        metrics = learner.accumulate_gradients(_samples()).metrics
        calls[flag] = (metrics["loss"], _grads(model), count[0])
    (loss0, grads0, n0), (loss1, grads1, n1) = calls[False], calls[True]
    assert n1 == 2 * n0 == 2 * len(model.layers)  # each block ran again in backward
    assert loss0 == loss1
    for a, b in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # no recomputation outside training forwards
        learner.raw_logprobs([([1, 2], [3, 4])])
    assert count[0] == n1 + len(model.layers)


def test_step_metrics_count_model_flops_by_hand():
    # tiny_config: H=32, I=64, 2 layers, 4 heads / 2 KV heads of 8, V=32, tied embeddings
    per_layer = 32 + 32 * (32 + 2 * 16) + 32 * 32 + 32 + 32 * 2 * 64 + 64 * 32
    assert param_counts(make_tiny()) == (2 * per_layer + 32, 32 * 32)
    samples = [TrainSample([1, 2, 3, 4], [5, 6, 7], 1.0), TrainSample([1, 2, 3, 4], [8, 9], -1.0),
               TrainSample([3, 1], [2, 2, 2, 2, 2], 0.5)]  # fmt: skip
    learner = Learner(make_tiny(), LearnerCfg(dtype="fp32"))
    m = learner.train_step(samples).metrics
    forward, positions = 4 + 3 + 2 + 2 + 5, 3 + 2 + 5  # the shared prompt runs once
    assert (m["forward_tokens"], m["tokens"]) == (forward, positions)
    flops = 6 * 18592 * forward + 6 * 1024 * positions
    assert train_flops(learner.model, forward, positions) == flops
    assert m["model_tflops"] * 1e12 * m["time_s"] == pytest.approx(flops)
    assert m["tokens_per_s"] * m["time_s"] == pytest.approx(forward)
    assert "mfu" not in m  # no known peak on the CPU


def test_bf16_params_mode_is_refused_without_bf16():
    with pytest.raises(ValueError, match="bf16_mode='params'.*dtype='fp32'"):
        Learner(make_tiny(), LearnerCfg(dtype="fp32", bf16_mode="params"))
    with pytest.raises(ValueError, match="bf16_mode"):
        Learner(make_tiny(), LearnerCfg(bf16_mode="half"))
    cfg = LearnerCfg(dtype="fp32", bf16_mode="params")
    with pytest.raises(ValueError, match="bf16_mode='params'"):
        Learner(make_tiny(), cfg)
    cfg = LearnerCfg(dtype="bf16", bf16_mode="params", activation_checkpointing=True)
    learner = Learner(make_tiny(), cfg)
    assert learner.masters is not None and learner.model.checkpoint_layers


def _update(params, init) -> torch.Tensor:
    return torch.cat(
        [(p.detach().float() - i).flatten() for p, i in zip(params, init, strict=True)]
    )


def test_bf16_params_masters_track_an_fp32_reference():
    model = make_tiny()
    init = [p.detach().clone() for p in model.parameters()]
    runs = {}
    for name, kw in {"fp32": dict(dtype="fp32"), "autocast": dict(dtype="bf16"),
                     "params": dict(dtype="bf16", bf16_mode="params")}.items():  # fmt: skip
        learner = Learner(copy.deepcopy(model), LearnerCfg(lr=1e-3, micro_batch_tokens=40, **kw))
        for step in range(3):
            learner.train_step(_samples(seed=step))
        runs[name] = learner
    bf = runs["params"]
    assert all(m.dtype == torch.float32 for m in bf.masters)
    assert all(p.dtype == torch.bfloat16 for p in bf.model.parameters())
    for p, m in zip(bf.model.parameters(), bf.masters, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))  # refreshed from the masters
    ref = _update(runs["fp32"].model.parameters(), init)
    err = (_update(bf.masters, init) - ref).norm() / ref.norm()
    err_autocast = (_update(runs["autocast"].model.parameters(), init) - ref).norm() / ref.norm()
    assert err < 0.25 and err < 2 * err_autocast  # bf16 forward noise, as with autocast


def test_bf16_params_masters_keep_updates_below_bf16_resolution():
    model = make_tiny()
    learner = Learner(copy.deepcopy(model), LearnerCfg(lr=1e-6, dtype="bf16", bf16_mode="params"))
    learner.train_step(_samples())
    moved = _update(learner.masters, list(model.parameters()))
    assert 0 < moved.abs().max() <= 2e-6  # the masters took the step; bf16 alone would round


def test_bf16_params_checkpoint_keeps_the_masters_bit_exact(tmp_path):
    def learner():
        return Learner(make_tiny(), LearnerCfg(lr=1e-3, dtype="bf16", bf16_mode="params"))

    a = learner()
    a.train_step(_samples(seed=0))
    save_checkpoint(tmp_path / "step_000001", a.model, a.optimizer,
                    {"step": 1, "policy_version": 1})  # fmt: skip
    assert (tmp_path / "step_000001" / "masters.safetensors").is_file()
    b = learner()
    b.train_step(_samples(seed=5))  # different state, overwritten by the resume
    load_checkpoint(tmp_path / "step_000001", b.model, b.optimizer)
    for x, y in zip(a.masters, b.masters, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(x, y)
    a.train_step(_samples(seed=1))
    b.train_step(_samples(seed=1))
    for x, y in zip(a.masters, b.masters, strict=True):
        assert torch.equal(x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["autocast", "params"])
def test_bf16_modes_step_on_cuda_and_report_mfu(mode):
    model = make_tiny(head_dim=16).cuda()
    cfg = LearnerCfg(dtype="bf16", bf16_mode=mode, lr=1e-3, micro_batch_tokens=40,
                     activation_checkpointing=True)  # fmt: skip
    learner = Learner(model, cfg)
    assert learner.optimizer.defaults["fused"]
    m = learner.train_step(_samples()).metrics
    assert m["loss"] == m["loss"] and m["tokens_per_s"] > 0 and m["model_tflops"] > 0
    assert ("mfu" in m) == (peak_flops(learner.device) is not None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_head_on_cuda_accumulates_bf16_inputs_in_float32():
    """On CUDA in bf16 the LM head multiplies bf16 inputs into float32 logits: the logprobs
    equal a float64 product of the bf16-rounded inputs (float32 accumulation, not bf16 output
    rounding), 'fp32' keeps the float32 product, and gradients flow through both."""
    from specrl.rl.head import bf16_head, head_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(300, 64, generator=g) * 2).cuda().requires_grad_(True)  # [M, H]
    weight = torch.randn(5000, 64, generator=g).cuda().requires_grad_(True)  # [V, H]
    targets = torch.randint(0, 5000, (300,), generator=g).cuda()
    rounded = head_logprobs(hidden.bfloat16().double(), weight.bfloat16().double(), targets)
    exact = head_logprobs(hidden.double(), weight.double(), targets)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert bf16_head(hidden, weight)
        fast = head_logprobs(hidden, weight, targets, chunk=128)
        full = head_logprobs(hidden, weight, targets, chunk=128, head="fp32")
    assert fast.dtype == full.dtype == torch.float32
    assert (fast.double() - rounded).abs().max().item() < 1e-3
    assert (full.double() - exact).abs().max().item() < 1e-3
    (fast.sum() + full.sum()).backward()
    assert torch.isfinite(weight.grad).all() and torch.isfinite(hidden.grad).all()


def test_head_precision_is_checked_and_float32_on_the_cpu():
    with pytest.raises(ValueError, match="head precision must be one of"):
        Learner(make_tiny(), LearnerCfg(dtype="fp32").model_copy(update={"head_precision": "bf16"}))
    learner = Learner(make_tiny(), LearnerCfg(head_precision="fp32", dtype="bf16"))
    auto = Learner(make_tiny(), LearnerCfg(dtype="bf16"))
    assert (learner.head, auto.head) == ("fp32", "auto")
    samples = _samples()
    pairs = [(s.prompt_ids, s.completion_ids) for s in samples]
    assert all(  # on the CPU both are the float32 product: the same numbers
        torch.equal(a, b)
        for a, b in zip(learner.raw_logprobs(pairs), auto.raw_logprobs(pairs), strict=True)
    )


def test_bf16_head_function_backward_is_the_product_of_rounded_inputs():
    """``Bf16Head`` (the CUDA LM head: bf16 inputs, float32 accumulation, its own backward) on
    the CPU, where its products are float32 products of the same bf16 values: forward and
    gradients equal autograd's through the float32 product of the rounded inputs."""
    from specrl.rl.head import Bf16Head

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 16, generator=g, requires_grad=True)  # [m, H] float32
    weight = torch.randn(40, 16, generator=g).bfloat16().requires_grad_(True)  # [V, H]
    upstream = torch.randn(7, 40, generator=g)  # [m, V]
    out = Bf16Head.apply(hidden, weight)
    assert out.dtype == torch.float32
    out.backward(upstream)
    h_ref = hidden.detach().bfloat16().float().requires_grad_(True)
    w_ref = weight.detach().float().requires_grad_(True)
    ref = h_ref @ w_ref.T
    torch.testing.assert_close(out, ref)
    ref.backward(upstream.bfloat16().float())  # the backward reads the gradient in bf16
    torch.testing.assert_close(hidden.grad, h_ref.grad)
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(weight.grad, w_ref.grad.bfloat16())


def test_resume_keeps_this_runs_optimizer_implementation(tmp_path):
    """A checkpoint written with fused AdamW (as on a GPU) resumes with this run's foreach
    AdamW on the CPU, and the same state."""
    first = Learner(make_tiny(), LearnerCfg(dtype="fp32", lr=1e-3))
    first.train_step(_samples())
    for group in first.optimizer.param_groups:  # as a CUDA run would have saved it
        group.update(fused=True, foreach=None)
    ckpt = tmp_path / "step_000001"
    save_checkpoint(ckpt, first.model, first.optimizer, {"step": 1, "policy_version": 1})
    second = Learner(make_tiny(seed=1), LearnerCfg(dtype="fp32", lr=1e-3))
    load_checkpoint(ckpt, second.model, second.optimizer)
    group = second.optimizer.param_groups[0]
    assert (group["fused"], group["foreach"]) == (None, True)
    a, b = first.train_step(_samples(1)).metrics, second.train_step(_samples(1)).metrics
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
