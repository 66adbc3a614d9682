"""The decoder: cached incremental decoding equals a full forward; HF-family equivalence."""

from __future__ import annotations

import pytest
import torch

from specrl.models.checkpoints import hf_state_dict, load_model
from tests.conftest import make_tiny


def full_logits(model, ids: list[int]) -> torch.Tensor:
    t = torch.tensor([ids])
    return model(t, torch.arange(len(ids))[None]).logits[0]


def test_incremental_decode_matches_full_forward(tiny):
    ids = [3, 7, 1, 9, 4, 4, 2, 8]
    ref = full_logits(tiny, ids)
    cache = tiny.new_cache(2, 16)
    # prefill the first 5 tokens into slot 0, then decode one token at a time
    tiny(
        torch.tensor([ids[:5]]), torch.arange(5)[None], cache, slots=torch.tensor([0]), prefill=True
    )
    for p in range(5, len(ids)):
        out = tiny(torch.tensor([[ids[p]]]), torch.tensor([[p]]), cache, kv_len=p + 1).logits
        torch.testing.assert_close(out[0, 0], ref[p], atol=1e-5, rtol=1e-5)


def test_multi_token_step_and_rollback(tiny):
    """Writing k+1 positions then 'rolling back' (reusing a position) gives exact results."""
    ids = [5, 6, 7, 8, 9, 10]
    ref = full_logits(tiny, ids)
    cache = tiny.new_cache(1, 16)
    tiny(
        torch.tensor([ids[:2]]), torch.arange(2)[None], cache, slots=torch.tensor([0]), prefill=True
    )
    wrong = torch.tensor([[ids[2], 1, 2, 3]])  # last three positions will be "rejected"
    tiny(wrong, torch.arange(2, 6)[None], cache, kv_len=6)
    out = tiny(torch.tensor([ids[3:]]), torch.arange(3, 6)[None], cache, kv_len=6).logits
    torch.testing.assert_close(out[0], ref[3:], atol=1e-5, rtol=1e-5)


def test_ragged_batch_rows_are_independent(tiny):
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9]
    cache = tiny.new_cache(2, 16)
    width = len(a)
    ids = torch.tensor([a, b + [0] * (width - len(b))])
    tiny(ids, torch.arange(width).expand(2, width), cache, slots=torch.tensor([0, 1]), prefill=True)
    step = torch.tensor([[11], [12]])
    pos = torch.tensor([[len(a)], [len(b)]])
    out = tiny(step, pos, cache, kv_len=len(a) + 1).logits[:, 0]
    torch.testing.assert_close(out[0], full_logits(tiny, a + [11])[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], full_logits(tiny, b + [12])[-1], atol=1e-5, rtol=1e-5)


def test_capture_hidden_layers(tiny):
    ids = torch.tensor([[1, 2, 3]])
    out = tiny(ids, torch.arange(3)[None], capture=(0, 1))
    assert len(out.captured) == 2
    assert out.captured[0].shape == (1, 3, tiny.config.hidden_size)
    assert not torch.equal(out.captured[0], out.captured[1])


def test_packed_segments_equal_separate_sequences(tiny):
    a, b = [1, 2, 3], [4, 5]
    ids = torch.tensor([a + b])
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    seg = torch.tensor([[0, 0, 0, 1, 1]])
    h, _ = tiny.hidden_states(ids, pos, segments=seg)
    logits = tiny.lm_head(h)[0]
    torch.testing.assert_close(logits[:3], full_logits(tiny, a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[3:], full_logits(tiny, b), atol=1e-5, rtol=1e-5)


def test_bf16_packed_linear_tracks_weight_updates():
    model = make_tiny().to(torch.bfloat16)
    ids, pos = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    with torch.inference_mode():
        before = model(ids, pos).logits
    with torch.no_grad():
        model.layers[0].mlp.down.weight.mul_(2.0)
    with torch.inference_mode():
        after = model(ids, pos).logits
    with torch.enable_grad():
        unpacked = model(ids, pos).logits  # plain F.linear path
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, unpacked, atol=2e-2, rtol=2e-2)


HF_FAMILIES = {
    "llama": dict(attention_bias=False),
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(attention_bias=False),
}


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_matches_transformers_family(family, tmp_path):
    """Our loader + decoder reproduce transformers' logits for Llama, Qwen2 and Qwen3 configs."""
    transformers = pytest.importorskip("transformers")
    cfg_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    cfg = cfg_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rope_theta=5000.0,
        tie_word_embeddings=family != "qwen2",
        **HF_FAMILIES[family],
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, torch.arange(9).expand(2, 9)).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # and the inverse name mapping round-trips
    back = hf_state_dict(ours)
    sd = hf.state_dict()
    for name, value in back.items():
        torch.testing.assert_close(value, sd[name])


def test_cache_mask_is_none_only_for_one_query_seeing_every_key():
    from specrl.models.transformer import cache_mask

    assert cache_mask(torch.tensor([[6]]), 7) is None
    hidden = cache_mask(torch.tensor([[6]]), 9)  # stale keys 7, 8 must stay masked
    assert hidden.shape == (1, 1, 1, 9) and hidden[0, 0, 0].tolist() == [True] * 7 + [False] * 2
    two = cache_mask(torch.tensor([[6], [4]]), 7)  # row 1 must not see keys 5, 6
    assert two is not None and two[1, 0, 0].tolist() == [True] * 5 + [False] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unmasked_batch1_decode_equals_masked_over_stale_keys(tiny, dtype):
    """A batch-1 decode step reads no mask (every key < kv_len is visible); it must equal the
    same step with a longer kv_len whose extra (stale) keys the mask hides."""
    model = tiny.to(dtype)
    cache = model.new_cache(1, 16)
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    model(ids, torch.arange(5)[None], cache, slots=torch.tensor([0]), prefill=True)
    model(torch.tensor([[2, 5, 6]]), torch.arange(5, 8)[None], cache, kv_len=8)  # stale 6, 7
    step = (torch.tensor([[8]]), torch.tensor([[5]]), cache)
    unmasked = model(*step, kv_len=6).logits.float()
    masked = model(*step, kv_len=8).logits.float()
    torch.testing.assert_close(unmasked, masked, atol=1e-5, rtol=1e-5)
    polluted = model(*step, kv_len=8, slots=torch.tensor([0])).logits.float()  # one-slot view
    torch.testing.assert_close(polluted, masked, atol=1e-5, rtol=1e-5)
