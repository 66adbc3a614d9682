"""The block head (DFlash-style): its training forward equals cached drafting, slot for slot;
its checkpoints round-trip; its proposer drafts k tokens from one block forward."""

from __future__ import annotations

import pytest
import torch

from specrl.models.block_head import BlockHead, pick_anchors
from specrl.models.head_kinds import load_head, new_head
from specrl.models.heads import save_head
from tests.conftest import make_tiny

torch.set_num_threads(1)


def random_block(target, seed: int = 0, **geometry) -> BlockHead:
    torch.manual_seed(seed)
    head = new_head(target, "block", geometry=geometry)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.eval()


def features(target, head, t: int, seed: int = 0):
    torch.manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (2, t + 1))
    out = target(ids, torch.arange(t + 1)[None].expand(2, -1), capture=head.feature_layers)
    return torch.cat(out.captured, -1)[:, :t], ids[:, 1:]  # feats [2, T, F], x_{i+1} [2, T]


@pytest.mark.parametrize("steps", [1, 4])
def test_depth_outputs_equal_cached_drafting(steps):
    """Slot j of the block anchored at a (trained at position a+j) == the context fed through
    the cache up to a, then one block forward of ``steps`` slots."""
    target = make_tiny(seed=1, num_layers=8)
    head = random_block(target, layers=2, block_size=4)
    t = 9
    feats, tokens = features(target, head, t)
    mask = torch.ones(2, t, dtype=torch.bool)
    mask[1, :3] = False  # the second row's prompt: no loss there, no anchors
    with torch.no_grad():
        outs = head.depth_outputs(feats, tokens, mask, steps)
        idx, valid = pick_anchors(mask, tokens, -(-t // steps))
        checked = 0
        for row in range(2):
            for a in idx[row][valid[row]].tolist():
                n = a + 1  # context positions 0..a
                cache = head.new_cache(1, 32)
                zero = torch.zeros(1, dtype=torch.long)
                head.step(head.features_in(feats[row : row + 1, :n]), tokens[row : row + 1, :n],
                          torch.arange(n)[None], cache, torch.zeros(1, n, dtype=torch.long),
                          zero, n)  # fmt: skip
                last = tokens[row : row + 1, a : a + 1]  # x_{a+1}, at position a+1
                g = head.block(last, n + torch.arange(steps + 1)[None], cache, zero,
                               n + steps + 1)[:, 1:]  # fmt: skip
                for j in range(steps):
                    got, where = outs[j]
                    if a + j >= t:
                        continue
                    assert where[row, a + j]
                    # the entry's index among the True ones of ``where`` in row-major order
                    k = int(where[:row].sum()) + int(where[row, : a + j].sum())
                    torch.testing.assert_close(got[k], g[0, j], atol=1e-4, rtol=1e-4)
                    checked += 1
    assert checked >= 2 * steps


def test_anchors_cover_every_loss_position_at_one_step():
    mask = torch.tensor([[False, True, True, True], [False, False, True, True]])
    idx, valid = pick_anchors(mask, torch.zeros(2, 4, dtype=torch.long), 4)
    assert [row[ok].tolist() for row, ok in zip(idx, valid, strict=True)] == [[1, 2, 3], [2, 3]]
    idx, valid = pick_anchors(mask, torch.zeros(2, 4, dtype=torch.long), 2)
    assert bool(valid.all()) and bool(mask.gather(1, idx).all())  # two loss positions each


def test_block_head_save_load_roundtrip(tmp_path):
    target = make_tiny(seed=1, num_layers=8)
    head = random_block(target, layers=3, block_size=6)
    save_head(head, tmp_path / "h")
    back = load_head(tmp_path / "h", target, kind="block")
    assert isinstance(back, BlockHead) and len(back.layers) == 3 and back.block_size == 6
    assert back.mask_token == target.config.vocab_size - 1
    for (n, a), (m, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b)
    with pytest.raises(ValueError, match="holds a 'block' head, not 'eagle3'"):
        load_head(tmp_path / "h", target, kind="eagle3")
