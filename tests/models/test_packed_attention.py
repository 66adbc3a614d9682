"""Packed attention through FlexAttention block masks against the dense [T, T] mask.

On the CPU flex attention runs eagerly and forward only (PyTorch has no CPU backward for it), so
the CPU checks hidden states, learner logprobs and the mask itself; the gradient check runs on
CUDA (``-k cuda``)."""

import copy
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from specrl.config_training import LearnerCfg
from specrl.models.packed_attention import PackedAttention, packed_mask_mod, use_flex
from specrl.rl.learner import Learner, TrainSample, pack_sequences
from tests.conftest import DEVICES
from tests.conftest import make_tiny as _make_tiny

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning"),
]


def make_tiny():  # head_dim 16: the smallest the compiled CUDA kernel takes
    return _make_tiny(head_dim=16)


def _groups() -> list[tuple[list[int], list[int]]]:
    """Two GRPO groups (shared prompts) and a lone sequence, of uneven lengths."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, 32, (n,), generator=g).tolist()  # noqa: E731
    seqs = []
    for prompt_len, lens in ((5, (3, 6, 1)), (7, (4, 2))):
        prompt = ids(prompt_len)
        seqs += [(prompt, ids(n)) for n in lens]
    return seqs + [(ids(3), ids(5))]


def _hidden(model, batch, mode: str) -> torch.Tensor:
    model.packed_attention = mode
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h, _ = model.hidden_states(
            batch.ids, batch.positions, segments=batch.segments, parents=batch.parents
        )
    return h


@pytest.mark.parametrize("device", DEVICES)
def test_flex_and_dense_give_the_same_hidden_states(device):
    model = make_tiny().to(device)
    batch = pack_sequences(_groups(), row_len=20, share_prompts=True).to(torch.device(device))
    assert batch.ids.shape[0] > 1 and (batch.segments < 0).any()  # several rows, padding
    real = batch.segments >= 0  # padding queries differ (flex: they see nothing)
    flex, dense = _hidden(model, batch, "flex"), _hidden(model, batch, "dense")
    torch.testing.assert_close(flex[real], dense[real], atol=1e-5, rtol=1e-5)


def test_flex_mask_is_the_dense_mask_at_every_real_query():
    model = make_tiny()
    batch = pack_sequences(_groups(), row_len=20, share_prompts=True)
    b, t = batch.ids.shape
    mask_mod = packed_mask_mod(batch.segments, batch.parents)
    flex = create_mask(mask_mod, b, None, t, t, device="cpu")[:, 0]  # [B, T, T]
    model.packed_attention = "dense"
    dense = model.attn_context(batch.positions, None, None, batch.segments,
                               parents=batch.parents).mask[:, 0]  # fmt: skip
    real = batch.segments >= 0  # [B, T]
    keys_real = real[:, None, :]
    assert torch.equal(flex[real], (dense & keys_real)[real])
    assert not flex[~real].any()


def test_learner_logprobs_agree_between_flex_and_dense():
    seqs = _groups()
    got = {}
    for mode in ("flex", "dense"):
        model = make_tiny()
        model.packed_attention = mode
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got[mode] = Learner(model, LearnerCfg(dtype="fp32"), row_len=20).raw_logprobs(seqs)
    for f, d in zip(got["flex"], got["dense"], strict=True):
        torch.testing.assert_close(f, d, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex backward needs CUDA")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flex_and_dense_learner_gradients_agree_cuda(dtype):
    samples = [
        TrainSample(p, c, a) for (p, c), a in zip(_groups(), [1, -1, 0.5, 2, -2, 1], strict=True)
    ]
    grads = {}
    for mode in ("flex", "dense"):
        model = make_tiny().cuda()
        model.packed_attention = mode
        learner = Learner(model, LearnerCfg(dtype=dtype), row_len=20)
        metrics = learner.accumulate_gradients(samples).metrics
        grads[mode] = (metrics["loss"], [p.grad.clone() for p in model.parameters()])
    (lf, gf), (ld, gd) = grads["flex"], grads["dense"]
    tol = 1e-4 if dtype == "fp32" else 3e-2
    assert abs(lf - ld) <= tol
    for a, b in zip(gf, gd, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_mode_choice_and_copies():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not use_flex("auto", cpu) and use_flex("auto", cuda)
    assert not use_flex("auto", cuda, head_dim=8) and use_flex("flex", cuda, head_dim=8)
    assert use_flex("flex", cpu) and not use_flex("dense", cuda)
    with pytest.raises(ValueError, match="packed_attention"):
        use_flex("sparse", cpu)
    model = make_tiny()
    twin = copy.deepcopy(model)
    assert isinstance(twin.flex, PackedAttention) and twin.flex is not model.flex
