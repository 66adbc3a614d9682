"""EAGLE-3 / MTP heads: the training-time-test unroll equals cached drafting; checkpoints."""

from __future__ import annotations

import pytest
import torch

from specrl.models.heads import DraftHead, default_layers, load_head, save_head
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
