"""The real SmolLM2-135M-Instruct: equivalence with transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from specrl.engine import Engine
from specrl.models.checkpoints import bundled_gguf, resolve_model
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow
NEW_TOKENS = 24


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    lps = [
        torch.log_softmax(step[0].float(), -1)[t].item()
        for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, lps


def test_greedy_matches_transformers(smollm2, smollm2_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model("smollm2"), dtype=torch.float32
    ).eval()
    prompts = [smollm2_tok.encode_chat(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    ours = Engine(smollm2, max_batch=len(prompts)).generate([Request(p, params) for p in prompts])
    for prompt, c in zip(prompts, ours, strict=True):
        tokens, lps = hf_greedy(hf, prompt)
        assert c.token_ids == tokens, smollm2_tok.decode(prompt)
        assert max(abs(a - b) for a, b in zip(c.raw_logprobs, lps, strict=True)) < 1e-4


def test_gguf_conversion_matches_transformers_gguf_loader(smollm2, smollm2_tok):
    """Our dequantisation + q/k un-permutation equals transformers' own GGUF loading."""
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([smollm2_tok.encode_chat("Tell me a fact about owls.")])
    with torch.no_grad():
        ref = hf(ids).logits
    got = smollm2(ids, torch.arange(ids.shape[1])[None]).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_chat_template_and_stop_tokens(smollm2_tok):
    text = smollm2_tok.chat_prompt([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert smollm2_tok.encode("<|im_end|>") == [2]
    assert 2 in smollm2_tok.stop_token_ids
    assert smollm2_tok.decode(smollm2_tok.encode("12 apples")) == "12 apples"
