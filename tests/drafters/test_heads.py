"""EAGLE-3 / MTP heads: the training-time-test unroll equals cached drafting; checkpoints."""

from __future__ import annotations

import pytest
import torch

from specrl.models.head_kinds import load_head
from specrl.models.heads import DraftHead, default_layers, draft_vocab_by_frequency, save_head
from specrl.spec.proposers.eagle3 import Eagle3Proposer
from tests.conftest import make_tiny

torch.set_num_threads(1)


def random_head(target, kind: str, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(target, kind)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.eval()


def test_default_layers():
    assert default_layers("eagle3", 30) == (1, 14, 26)
    assert default_layers("eagle3", 8) == (1, 3, 4)
    assert default_layers("eagle3", 2) == (0, 1)
    assert default_layers("mtp", 30) == (29,)
    with pytest.raises(ValueError, match="unknown head kind"):
        default_layers("medusa", 4)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_unroll_equals_cached_drafting(kind):
    """Depth j at position i of the unroll == feeding true features up to i-j, then j own steps."""
    target = make_tiny(seed=1, num_layers=8)
    head = random_head(target, kind)
    t, steps = 7, 3
    ids = torch.randint(0, 32, (1, t + 1))
    out = target(ids, torch.arange(t + 1)[None], capture=head.feature_layers)
    feats = torch.cat(out.captured, -1)[:, :t]  # [1, T, F]
    tokens = ids[:, 1:]  # token x_{i+1} for position i
    with torch.no_grad():
        unrolled = head.unroll(feats, tokens, steps)
        for j in range(steps):
            for i in range(j, t):
                cache = head.new_cache(1, 16)
                n = i - j + 1  # true features at positions 0..i-j
                g = head.step(
                    head.features_in(feats[:, :n]),
                    tokens[:, :n],
                    torch.arange(n)[None],
                    cache,
                    torch.zeros(1, n, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long),
                    n,
                )[:, -1:]
                for s in range(1, j + 1):
                    p = i - j + s
                    g = head.step(
                        g,
                        tokens[:, p : p + 1],
                        torch.tensor([[p]]),
                        cache,
                        torch.zeros(1, 1, dtype=torch.long),
                        torch.zeros(1, dtype=torch.long),
                        p + 1,
                    )
                torch.testing.assert_close(g[0, 0], unrolled[j][0, i], atol=1e-4, rtol=1e-4)


def test_save_load_roundtrip_and_refusal(tmp_path):
    target = make_tiny(seed=1, num_layers=8)
    head = random_head(target, "eagle3")
    save_head(head, tmp_path / "h")
    again = load_head(tmp_path / "h", target)
    for (ka, a), (kb, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(a, b)
    assert not any(k.startswith(("embed", "lm_head", "_target")) for k in head.state_dict())
    with pytest.raises(ValueError, match="hidden size 32, but the target has 64"):
        load_head(tmp_path / "h", make_tiny(seed=1, num_layers=8, hidden_size=64))
    with pytest.raises(ValueError, match="vocabulary 32, but the target has 16"):
        load_head(tmp_path / "h", make_tiny(seed=1, num_layers=8, vocab_size=16))
    with pytest.raises(ValueError, match="layer count 8, but the target has 6"):
        Eagle3Proposer(make_tiny(seed=1, num_layers=6), drafter_path=str(tmp_path / "h"))
    with pytest.raises(ValueError, match="not 'mtp'"):
        load_head(tmp_path / "h", target, kind="mtp")


def test_reduced_vocab_head_is_the_full_head_restricted(tmp_path):
    """Reduced-vocabulary logits are the full head's logits at d2t; q maps back into the target
    vocabulary; the LM-head copy follows in-place changes of the target; checkpoints keep d2t."""
    target = make_tiny(seed=1, num_layers=4)
    full = random_head(target, "eagle3")
    d2t = torch.tensor([0, 3, 4, 9, 31])
    head = DraftHead(target, "eagle3", draft_vocab=d2t)
    head.load_state_dict(full.state_dict() | {"d2t": d2t})
    g = torch.randn(2, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(head.logits(g), full.logits(g)[..., d2t])
        target.lm_head.weight.mul_(2.0)  # a refit changes the shared LM head in place
        torch.testing.assert_close(head.logits(g), full.logits(g)[..., d2t])
    assert head.draft_vocab_size == 5 and full.draft_vocab_size == 32
    assert head.to_target(torch.tensor([[0, 4], [2, 1]])).tolist() == [[0, 31], [4, 3]]
    q = torch.softmax(torch.randn(2, 5), -1)
    wide = head.to_full(q)
    assert wide.shape == (2, 32) and torch.equal(wide[:, d2t], q)
    assert float(wide.sum(-1).sub(1).abs().max()) < 1e-6
    assert float(wide[:, [1, 2, 30]].abs().sum()) == 0.0
    again = load_head(save_head(head, tmp_path / "v"), target)
    assert torch.equal(again.d2t, d2t) and again.d2t.dtype == torch.int64
    with torch.no_grad():
        torch.testing.assert_close(again.logits(g), head.logits(g))


def test_reduced_vocab_head_in_bf16_inference_then_training():
    """bf16 (prepacked LM-head rows): drafting in inference mode, then training, then drafting."""
    target = make_tiny(seed=1, num_layers=4).to(torch.bfloat16)
    head = DraftHead(target, "eagle3", draft_vocab=torch.tensor([0, 3, 4, 9, 31]))
    g = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        first = head.logits(g)  # [2, 5]
    head.requires_grad_(True)
    head.logits(g).float().sum().backward()  # autograd through the cached rows works
    assert head.norm.weight.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(head.logits(g), first)


def test_draft_vocab_choice_and_refusals():
    tokens = [[5, 5, 5, 2, 2, 7], [7, 9, 2]]
    assert draft_vocab_by_frequency(tokens, 3, 10).tolist() == [2, 5, 7]  # counts 3, 3, 2
    assert draft_vocab_by_frequency(tokens, 5, 10).tolist() == [0, 2, 5, 7, 9]  # tie 0: low id
    target = make_tiny(seed=1, num_layers=4)
    with pytest.raises(ValueError, match="must be in \\[1, 10\\], got 0"):
        draft_vocab_by_frequency(tokens, 0, 10)
    with pytest.raises(ValueError, match="sorted and without repeats"):
        DraftHead(target, "eagle3", draft_vocab=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="must be in \\[0, 32\\), got 40"):
        DraftHead(target, "eagle3", draft_vocab=torch.tensor([1, 40]))
