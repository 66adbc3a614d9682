"""Engine statistics: per-call and cumulative counters of speculation and time.

Contract: ``EngineStats`` holds plain counters; ``add`` accumulates another call's counters;
derived rates (acceptance length, per-position acceptance) are properties, never stored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def bump(counts: list[int], i: int) -> None:
    while len(counts) <= i:
        counts.append(0)
    counts[i] += 1


@dataclass
class EngineStats:
    """Cumulative counters of one ``generate`` call."""

    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position_accepted: list[int] = field(default_factory=list)
    per_position_drafted: list[int] = field(default_factory=list)
    emitted_per_row_step: int = 0  # sum over (row, step) of emitted tokens
    row_steps: int = 0

    def add(self, other: EngineStats) -> None:
        """Accumulate another call's counters into these (cumulative statistics)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
            else:
                setattr(self, f.name, mine + theirs)

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts at position i accepted (i = 0 is the first draft token)."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.per_position_accepted, self.per_position_drafted, strict=False)
        ]

    @property
    def acceptance_length(self) -> float:
        return self.emitted_per_row_step / self.row_steps if self.row_steps else 0.0
