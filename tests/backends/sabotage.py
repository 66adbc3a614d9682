"""A rollout backend that damages one update on purpose, for the weight-sync guard's tests."""

from __future__ import annotations

import torch


class Sabotaged:
    """A backend that forwards everything to ``inner`` but alters the update of ``version``
    (of the policy, or of the drafter with ``drafter=True``): 'skip' drops it, 'stale' sends
    the previous update's tensors under the new version, 'scale' multiplies one tensor by
    1.01, 'zero_row' zeroes one row of one matrix."""

    def __init__(self, inner, how: str, version: int, drafter: bool = False) -> None:
        self.inner, self.how, self.at, self.drafter = inner, how, version, drafter
        self.last: dict[str, dict[str, torch.Tensor]] = {}  # kind -> the previous tensors

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def update_weights(self, named, version):
        return self._send("policy", self.inner.update_weights, named, version)

    def update_drafter(self, state, version):
        return self._send("drafter", self.inner.update_drafter, state, version)

    def _send(self, kind: str, send, named, version: int) -> float:
        previous = self.last.get(kind)
        self.last[kind] = {n: t.detach().clone() for n, t in named.items()}
        if version != self.at or self.drafter != (kind == "drafter"):
            return send(named, version)
        if self.how == "skip":
            return 0.0
        if self.how == "stale":
            return send(previous, version)
        return send(self._damage(named), version)

    def _damage(self, named) -> dict[str, torch.Tensor]:
        out = {n: t.detach().clone() for n, t in named.items()}
        name = next(n for n in sorted(out) if out[n].dim() == 2 and out[n].is_floating_point())
        with torch.no_grad():
            if self.how == "scale":
                out[name].mul_(1.01)
            else:
                out[name][1].zero_()
        return out
