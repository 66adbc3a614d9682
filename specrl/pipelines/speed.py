"""The end-of-run speed check: the same prompts rolled out plain and speculative.

Contract: ``measure_speedup(parts, step)`` rolls out step ``step``'s prompts without speculation
and with the backend's configured speculation (same weights, same seeds) and returns both token
counts, times and throughputs, the speculative acceptance length, ``rollout_speedup`` and
``free_draft_speedup``: the speedup had drafting cost nothing (the speculative rollout's time less
its drafter time; same verify forwards and acceptance), the most any cheaper drafter step could
give at this acceptance.
"""

from __future__ import annotations

from specrl.pipelines.build import RunParts
from specrl.pipelines.state import TrainStream
from specrl.pipelines.step import rollout, rollout_metrics
from specrl.spec.config import SpecConfig


def measure_speedup(parts: RunParts, step: int) -> dict[str, float]:
    """See the module docstring."""
    prompts = TrainStream.of(parts.plan, parts.env).draw(step)
    out: dict[str, float] = {}
    for name, spec in (("plain", SpecConfig("none", 0)), ("spec", parts.backend.spec)):
        m = rollout_metrics(rollout(parts, prompts, step, spec=spec))
        out |= {f"{name}_tokens": m["gen_tokens"], f"{name}_time_s": m["gen_time_s"],
                f"{name}_tokens_per_s": m["rollout_tokens_per_s"]}  # fmt: skip
        if name == "spec":
            out |= {"spec_acceptance_length": m["acceptance_length"], "spec_draft_s": m["draft_s"]}
    plain = max(out["plain_tokens_per_s"], 1e-9)
    out["rollout_speedup"] = out["spec_tokens_per_s"] / plain
    undrafted = max(out["spec_time_s"] - out["spec_draft_s"], 1e-9)
    out["free_draft_speedup"] = out["spec_tokens"] / undrafted / plain
    return out
