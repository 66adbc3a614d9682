"""Scenarios: the typed input of one simulation, from TOML with ``--set key=value`` overrides.

Contract: a Scenario names a model, a hardware profile and a drafter (spec files), and gives the
workload, generation layout, speculation settings, training efficiency and pipeline mode. Every
field carries a description; ``field_help()`` renders them for ``specrl simulate --help``. Overrides
use dotted paths (``speculation.k=5``) and TOML literals (strings may be bare). Nothing here
simulates; runner.py does.
"""

from __future__ import annotations

import tomllib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specrl.sim.specs import read_toml, spec_path


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Workload(_Strict):
    samples_per_step: int = Field(gt=0, description="rollouts per RL step (prompts x group size)")
    prompt_len: int = Field(256, ge=1, description="prompt tokens per rollout")
    mean_response_len: float = Field(gt=0, description="mean response tokens (before truncation)")
    response_sigma: float = Field(
        0.8, ge=0, description="log-space sigma of the lognormal response length (the tail)"
    )
    max_response_len: int = Field(gt=0, description="response length cap (max_tokens)")
    mean_is_after_cap: bool = Field(
        False,
        description="mean_response_len is the observed mean after the cap (a published average)"
        " rather than the lognormal mean before truncation",
    )
    length_trace: list[int] = Field(
        default_factory=list, description="replay these response lengths instead of sampling"
    )
    rl_step: int = Field(0, ge=0, description="RL steps since the drafter was last trained")
    seed: int = Field(0, description="seed of the length sampler (same draw with and without spec)")


class Generation(_Strict):
    gpus: int = Field(gt=0, description="GPUs generating (sync: the whole colocated pool)")
    gpus_per_replica: int = Field(1, gt=0, description="GPUs per engine replica (TP x EP)")
    max_num_seqs: int = Field(256, gt=0, description="engine limit on running sequences")
    replan_tokens: int = Field(256, gt=0, description="re-choose k every this many tokens")
    routing_locality: float = Field(
        0.0, ge=0, le=1, description="MoE: chance a verify token reuses its sequence's experts"
    )
    prefill_group: int = Field(
        1, ge=1, description="sequences sharing one prompt, prefilled once (1: each its own)"
    )


class Acceptance(_Strict):
    kind: str = Field("constant", description="constant | positional | drift")
    acceptance_length: float = Field(
        2.26, ge=1, description="mean tokens per verify step at k = at_k (sets per-token rate)"
    )
    at_k: int = Field(3, ge=1, description="k at which acceptance_length was measured")
    per_position: list[float] = Field(
        default_factory=list, description="positional: acceptance of draft 1, 2, ... given prefix"
    )
    decay_per_1k_tokens: float = Field(0.0, description="drift: rate lost per 1k response tokens")
    decay_per_rl_step: float = Field(0.0, description="drift: rate lost per RL step of staleness")
    floor: float = Field(0.0, ge=0, le=1, description="drift: lowest per-token rate")


class Speculation(_Strict):
    enabled: bool = Field(True, description="simulate the speculative run (baseline always runs)")
    drafter: str = Field(
        "eagle3", description="drafter spec: eagle3 | mtp | draft-* | ngram | suffix"
    )
    policy: str = Field(
        "fixed", description="fixed (always k) | cost_optimal (best k<=k per batch)"
    )
    k: int = Field(3, ge=1, description="draft tokens per step (upper bound for cost_optimal)")
    tree_width: int = Field(1, ge=1, description="draft tokens per sequence per draft forward")
    tree_verify_tokens: int = Field(0, ge=0, description="tokens verified per sequence (0: k+1)")
    draft_coverage: list[float] = Field(
        default_factory=list,
        description="per draft position, chance a sequence drafts there (n-gram/suffix may not);"
        " verify is padded to the batch's longest draft ([]: all draft k)",
    )
    acceptance: Acceptance = Field(default_factory=Acceptance)


class Training(_Strict):
    gpus: int = Field(0, ge=0, description="training GPUs (async only; sync uses generation.gpus)")
    mfu: float = Field(0.0, ge=0, le=1, description="training MFU (0: hardware profile default)")
    logprob_passes: int = Field(2, ge=0, description="logprob forwards per token (policy + ref)")
    train_drafter: bool = Field(False, description="train the drafter online every step")


class PipelineCfg(_Strict):
    mode: str = Field("sync", description="sync (colocated) | async (disaggregated)")
    staleness: int = Field(1, ge=0, description="async: max policy versions a batch may lag")
    async_generation: str = Field(
        "continuous",
        description="async: continuous (generators stay full across steps within the staleness"
        " bound, as AReaL / NeMo-RL async with in-flight weight updates) | drain (each step's"
        " batch finishes, long tail included, before the next starts)",
    )
    steps: int = Field(
        6, ge=2, description="RL steps simulated (steady state after the first staleness steps)"
    )
    framework_overhead_s: float = Field(
        3.0,
        ge=0,
        description="fixed seconds per RL step outside generation/logprobs/train/refit (data,"
        " rewards, orchestration); 3 s = NeMo-RL v0.3 published step breakdowns (total minus"
        " phases: 2-4 s over four models)",
    )
    refit_fixed_s: float = Field(2.0, ge=0, description="fixed seconds per weight refit")
    refit_bandwidth: float = Field(
        100e9, gt=0, description="aggregate bytes/s of a refit (colocated ~1e11, RDMA ~1.5e12)"
    )


class Scenario(_Strict):
    name: str = Field(description="scenario name")
    description: str = Field("", description="what the scenario represents")
    sources: list[str] = Field(default_factory=list, description="where the inputs come from")
    model: str = Field(description="model spec name (specrl simulate list)")
    hardware: str = Field(description="hardware profile name (specrl simulate list)")
    workload: Workload
    generation: Generation
    speculation: Speculation = Field(default_factory=Speculation)
    training: Training = Field(default_factory=Training)
    pipeline: PipelineCfg = Field(default_factory=PipelineCfg)


def parse_value(text: str) -> Any:
    """A TOML literal (number, bool, list, quoted string) or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` applied."""
    out = _deep_copy(data)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        *parents, leaf = key.strip().split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = parse_value(value.strip())
    return out


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def load_scenario(name: str, overrides: list[str] | None = None) -> Scenario:
    """Load a bundled scenario by name (or a TOML path) and apply overrides."""
    data = read_toml(spec_path("scenarios", name))
    return Scenario.model_validate(apply_overrides(data, overrides or []))


def field_help(model: type[BaseModel] = Scenario, prefix: str = "") -> list[str]:
    """One line per input: dotted key, default and description (for --help)."""
    lines: list[str] = []
    for key, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            lines += field_help(sub, f"{prefix}{key}.")
            continue
        default = (
            "required"
            if info.is_required()
            else f"default {info.get_default(call_default_factory=True)!r}"
        )
        lines.append(f"{prefix}{key} ({default}): {info.description}")
    return lines
