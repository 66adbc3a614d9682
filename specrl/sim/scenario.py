"""Scenarios: the typed input of one simulation, from TOML with ``--set key=value`` overrides.

Contract: a Scenario names a model, a hardware profile and a drafter (spec files), and gives the
workload, generation layout, speculation settings, training efficiency and pipeline mode. Every
field carries a description; ``field_help()`` renders them for ``specrl simulate --help``. Overrides
use dotted paths (``speculation.k=5``) and TOML literals (strings may be bare). A scenario file
may start from another (``extends = "name"``: that scenario's values, then this file's), so a
variant states only what differs. Values are
checked strictly (TOML types: a bool is not an int, no inf/nan) and every bad input, an unknown
scenario or key (with the valid keys and a did-you-mean), a wrong type or range, a malformed or
unreadable file, raises ``SimInputError`` with one line saying where it came from (the file or the
``--set`` item). Integers are bounded (GPU counts by ``MAX_GPUS``: the simulation's cost grows
with them). An async-only pipeline input given by ``--set`` for a sync run is refused.
Checks across fields and specs live in validate.py. Nothing here simulates;
runner.py does.
"""

from __future__ import annotations

import tomllib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specrl.errors import did_you_mean
from specrl.sim.errors import SimInputError
from specrl.sim.specs import read_toml, spec_path

MAX_GPUS = 65_536  # GPU counts: the simulation's cost grows with them (1e6 took 15 s)
MAX_TOKENS = 10_000_000  # token counts (lengths, caps)


class _Strict(BaseModel):
    # strict: TOML has types, so a bool is not an int and "3" is not a number; no inf/nan
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Workload(_Strict):
    samples_per_step: int = Field(
        gt=0, le=10_000_000, description="rollouts per RL step (prompts x group size)"
    )
    prompt_len: int = Field(256, ge=1, le=MAX_TOKENS, description="prompt tokens per rollout")
    mean_response_len: float = Field(gt=0, description="mean response tokens (before truncation)")
    response_sigma: float = Field(
        0.8, ge=0, description="log-space sigma of the lognormal response length (the tail)"
    )
    max_response_len: int = Field(
        gt=0, le=MAX_TOKENS, description="response length cap (max_tokens)"
    )
    mean_is_after_cap: bool = Field(
        False,
        description="mean_response_len is the observed mean after the cap (a published average)"
        " rather than the lognormal mean before truncation",
    )
    length_trace: list[int] = Field(
        default_factory=list, description="replay these response lengths instead of sampling"
    )
    rl_step: int = Field(
        0, ge=0, le=1_000_000, description="RL steps since the drafter was last trained"
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="seed of the length sampler (same draw with and without spec)",
    )
    seeds: int = Field(
        3,
        ge=1,
        le=64,
        description="length draws averaged (seed, seed+1, ...); results give their spread (one"
        " draw when length_trace is given or response_sigma is 0)",
    )


class Generation(_Strict):
    gpus: int = Field(
        gt=0, le=MAX_GPUS, description="GPUs generating (sync: the whole colocated pool)"
    )
    gpus_per_replica: int = Field(
        1, gt=0, le=MAX_GPUS, description="GPUs per engine replica (TP x EP)"
    )
    max_num_seqs: int = Field(
        256, gt=0, le=1_000_000, description="engine limit on running sequences"
    )
    replan_tokens: int = Field(
        256, gt=0, le=MAX_TOKENS, description="re-choose k every this many tokens"
    )
    routing_locality: float = Field(
        0.0, ge=0, le=1, description="MoE: chance a verify token reuses its sequence's experts"
    )
    prefill_group: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="sequences sharing one prompt, prefilled once (1: each its own)",
    )
    ep: int = Field(
        1,
        ge=1,
        le=MAX_GPUS,
        description="MoE: expert-parallel degree inside a replica (1: experts tensor-parallel,"
        " vLLM's default; > 1: E/ep experts per GPU, all-to-all dispatch and combine)",
    )
    precision: str = Field("bf16", description="weight precision of the generators: bf16 | fp8")
    routing_skew: float = Field(
        1.0,
        ge=1,
        description="MoE with ep > 1: the busiest rank's token load over a uniform router's",
    )


class Acceptance(_Strict):
    kind: str = Field("constant", description="constant | positional | drift")
    acceptance_length: float = Field(
        2.26, ge=1, description="mean tokens per verify step at k = at_k (sets per-token rate)"
    )
    at_k: int = Field(3, ge=1, le=64, description="k at which acceptance_length was measured")
    per_position: list[float] = Field(
        default_factory=list, description="positional: acceptance of draft 1, 2, ... given prefix"
    )
    decay_per_1k_tokens: float = Field(0.0, description="drift: rate lost per 1k response tokens")
    decay_per_rl_step: float = Field(0.0, description="drift: rate lost per RL step of staleness")
    floor: float = Field(0.0, ge=0, le=1, description="drift: lowest per-token rate")
    decay_after_tokens: int = Field(
        0, ge=0, le=MAX_TOKENS, description="drift: response tokens before the decay starts"
    )
    position_ratio: float | None = Field(
        None,
        gt=0,
        description="acceptance of draft i+1 over draft i's (None: the drafter spec's profile)",
    )
    measured_over: str = Field(
        "start",
        description="start: acceptance_length holds at response position 0 | rollout: it is the"
        " rollout's mean (tokens per sequence-step, as vLLM reports it) and the start rate is"
        " solved to match it",
    )


class Speculation(_Strict):
    enabled: bool = Field(True, description="simulate the speculative run (baseline always runs)")
    drafter: str = Field(
        "eagle3", description="drafter spec: eagle3 | mtp | draft-* | ngram | suffix"
    )
    policy: str = Field(
        "fixed", description="fixed (always k) | cost_optimal (best k<=k per batch)"
    )
    k: int = Field(
        3, ge=1, le=64, description="draft tokens per step (upper bound for cost_optimal)"
    )
    tree_width: int = Field(
        1, ge=1, le=64, description="draft tokens per sequence per draft forward"
    )
    tree_verify_tokens: int = Field(
        0, ge=0, le=4096, description="tokens verified per sequence (0: k+1)"
    )
    draft_coverage: list[float] = Field(
        default_factory=list,
        description="per draft position, chance a sequence drafts there (n-gram/suffix may not);"
        " verify is padded to the batch's longest draft ([]: all draft k)",
    )
    acceptance: Acceptance = Field(default_factory=Acceptance)


class Training(_Strict):
    gpus: int = Field(
        0, ge=0, le=MAX_GPUS, description="training GPUs (async only; sync uses generation.gpus)"
    )
    mfu: float = Field(
        0.0, ge=0, le=1, description="training MFU (0: the model class's, data/training.toml)"
    )
    logprob_mfu: float = Field(
        0.0, ge=0, le=1, description="logprob-pass MFU (0: the model class's, data/training.toml)"
    )
    logprob_passes: int = Field(
        2, ge=0, le=16, description="logprob forwards per token (policy + ref)"
    )
    train_drafter: bool = Field(False, description="train the drafter online every step")


class PipelineCfg(_Strict):
    mode: str = Field("sync", description="sync (colocated) | async (disaggregated)")
    staleness: int = Field(1, ge=0, le=64, description="async: max policy versions a batch may lag")
    async_generation: str = Field(
        "continuous",
        description="async: continuous (generators stay full across steps within the staleness"
        " bound, as AReaL / NeMo-RL async with in-flight weight updates) | drain (each step's"
        " batch finishes, long tail included, before the next starts)",
    )
    warmup_periods: int = Field(
        1,
        ge=0,
        le=64,
        description="async: periods of staleness + 1 steps simulated before measuring (the"
        " pipeline filling); sync is exact from the first step",
    )
    measure_periods: int = Field(
        2,
        ge=1,
        le=64,
        description="async: periods of staleness + 1 steps averaged in steady state (step"
        " completions repeat with that period); one more period runs after them",
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


class Engine(_Strict):
    """Overrides of the engine terms of the hardware profile and drafter spec (sensitivity)."""

    step_overhead_s: float | None = Field(
        None, ge=0, description="seconds per engine step (None: the hardware profile's)"
    )
    forward_overhead_s: float | None = Field(
        None, ge=0, description="seconds per drafter forward (None: the hardware profile's)"
    )
    verify_s_per_logit: float | None = Field(
        None, ge=0, description="sampler seconds per verified logit (None: the profile's)"
    )
    cpu_s_per_ctx_token: float | None = Field(
        None, ge=0, description="model-free drafter: CPU s per context token (None: the spec's)"
    )
    graph_capture_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_TOKENS,
        description="largest CUDA-graph forward, tokens; 0: no limit (None: the profile's)",
    )
    eager_s_per_layer: float | None = Field(
        None,
        ge=0,
        description="host s per layer past graph_capture_tokens (None: the profile's)",
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
    engine: Engine = Field(default_factory=Engine)


def parse_value(text: str) -> Any:
    """A TOML literal (number, bool, list, quoted string) or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` applied (keys are not checked here;
    ``check_override_keys`` does that against the schema)."""
    out = _deep_copy(data)
    for item in overrides:
        parents, leaf, value = _split_override(item)
        node = out
        for depth, p in enumerate(parents):
            if p not in node:
                node[p] = {}
            elif not isinstance(node[p], dict):
                where = ".".join(parents[: depth + 1])
                raise SimInputError(
                    f"--set {item}: {where} is {node[p]!r} in the scenario, not a table of keys"
                )
            node = node[p]
        node[leaf] = parse_value(value)
    return out


def _split_override(item: str) -> tuple[list[str], str, str]:
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise SimInputError(
            f"--set {item!r} is not KEY=VALUE with a dotted KEY (e.g. speculation.k=5)"
        )
    *parents, leaf = (p.strip() for p in parts)
    return parents, leaf, value.strip()


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def _section(annotation: Any) -> type[BaseModel] | None:
    ok = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if ok else None


def scenario_keys(model: type[BaseModel] = Scenario, prefix: str = "") -> list[str]:
    """Every dotted key a scenario accepts: tables (``speculation``) and values
    (``speculation.k``)."""
    keys: list[str] = []
    for key, info in model.model_fields.items():
        keys.append(f"{prefix}{key}")
        sub = _section(info.annotation)
        if sub is not None:
            keys += scenario_keys(sub, f"{prefix}{key}.")
    return keys


def _model_at(path: tuple[str, ...]) -> type[BaseModel] | None:
    """The schema table at a dotted path (None if the path is not a table)."""
    model: type[BaseModel] | None = Scenario
    for part in path:
        info = model.model_fields.get(part) if model else None
        model = _section(info.annotation) if info else None
    return model


def _unknown_key(dotted: str) -> SimInputError:
    parent, _, _ = dotted.rpartition(".")
    table = _model_at(tuple(parent.split("."))) if parent else Scenario
    valid = [f"{parent}.{k}" if parent else k for k in (table.model_fields if table else ())]
    where = f" in [{parent}]" if parent else ""
    hint = did_you_mean(dotted, scenario_keys())
    return SimInputError(f"unknown key {dotted}{hint}; valid keys{where}: {', '.join(valid)}")


def check_override_keys(overrides: list[str]) -> None:
    """Raise SimInputError for an override whose key the schema does not have."""
    for item in overrides:
        parents, leaf, _ = _split_override(item)
        path = (*parents, leaf)
        for depth in range(1, len(path)):
            if _model_at(path[:depth]) is None:
                key = ".".join(path[:depth])
                if key not in scenario_keys():
                    raise SimInputError(f"--set {item}: {_unknown_key(key)}")
                raise SimInputError(f"--set {item}: {key} is a value, not a table of keys")
        if ".".join(path) not in scenario_keys():
            raise SimInputError(f"--set {item}: {_unknown_key('.'.join(path))}")


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: dict[str, Any]) -> str:
    dotted = _loc(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        return str(_unknown_key(dotted))
    if kind == "missing":
        return f"{dotted}: required, missing"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{dotted}: expected a table of keys, got {err['input']!r}"
    return f"{dotted}: {err['msg'].replace('Input should', 'should')}, got {err['input']!r}"


def _origin(err: dict[str, Any], overrides: list[str]) -> str:
    dotted = _loc(err["loc"])
    for item in overrides:
        key = item.partition("=")[0].strip()
        if dotted == key or dotted.startswith(key + ".") or dotted.startswith(key + "["):
            return f"--set {item}"
    return ""


def validation_message(error: ValidationError, source: str, overrides: list[str]) -> str:
    """One line for a pydantic error: where the value came from, the key, what is wrong."""
    errs = error.errors()
    first = errs[0]
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    origin = _origin(first, overrides)
    text = _describe(first)
    if origin and text.startswith(f"{_loc(first['loc'])}: "):
        text = text.partition(": ")[2]  # the --set item already names the key
    return f"{origin or source}: {text}{more}"


MAX_EXTENDS = 8  # depth of `extends` chains (a longer one is a cycle or a mistake)


def scenario_data(name: str, depth: int = 0) -> tuple[dict[str, Any], str]:
    """A scenario file's table with its ``extends`` chain merged in (the base scenario's values,
    then this file's), and the path it came from."""
    path = spec_path("scenarios", name)
    data = read_toml(path)
    base = data.pop("extends", None)
    if base is None:
        return data, str(path)
    if not isinstance(base, str) or depth >= MAX_EXTENDS:
        raise SimInputError(
            f"scenario {path}: extends must name a scenario, at most {MAX_EXTENDS} deep"
            f" (got {base!r})"
        )
    merged, _ = scenario_data(base, depth + 1)
    return _merge(merged, data), str(path)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = _deep_copy(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def load_scenario(name: str, overrides: list[str] | None = None) -> Scenario:
    """Load a bundled scenario by name (or a TOML path) and apply overrides; any bad input
    raises SimInputError with a one-line message."""
    overrides = list(overrides or [])
    data, path = scenario_data(name)
    check_override_keys(overrides)
    try:
        sc = Scenario.model_validate(apply_overrides(data, overrides))
    except ValidationError as e:
        raise SimInputError(validation_message(e, f"scenario {path}", overrides)) from None
    check_async_only(sc, overrides)
    return sc


ASYNC_ONLY = ("staleness", "async_generation", "warmup_periods", "measure_periods")


def check_async_only(sc: Scenario, overrides: list[str]) -> None:
    """An async-only pipeline input given by ``--set`` (whatever its value) for a sync run,
    where it would be ignored: ``SimInputError`` naming both keys. (A scenario file's own
    values stay: ``--set pipeline.mode=sync`` turns an async scenario into its sync baseline.)"""
    if sc.pipeline.mode == "async":
        return
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.removeprefix("pipeline.") in ASYNC_ONLY and key.startswith("pipeline."):
            raise SimInputError(f"--set {item}: {key} applies only with pipeline.mode = "
                                f"'async' (the scenario runs {sc.pipeline.mode!r})")  # fmt: skip


def field_help(model: type[BaseModel] = Scenario, prefix: str = "") -> list[str]:
    """One line per input: dotted key, default and description (for --help)."""
    lines: list[str] = []
    for key, info in model.model_fields.items():
        sub = _section(info.annotation)
        if sub is not None:
            lines += field_help(sub, f"{prefix}{key}.")
            continue
        default = (
            "required"
            if info.is_required()
            else f"default {info.get_default(call_default_factory=True)!r}"
        )
        lines.append(f"{prefix}{key} ({default}): {info.description}")
    return lines
