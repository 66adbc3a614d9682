"""Specs as data: models, hardware and drafters loaded from the TOML files under ``sim/data``.

Every number the cost model uses about a model, a GPU (or this CPU) or a drafter comes from a
frozen ``Spec`` section built from a TOML file (``specrl/sim/data/<kind>/<name>.toml``, or a
path) or an equivalent dict; derived sizes live here, times do not. That directory, the
simulator's data, is read as files (``data_root``): loading a spec imports nothing of
``specrl.sim``. ``PRECISIONS`` names the weight formats a replica may serve. A bad name, file
or field raises a one-line ``SimInputError``, and so does a field given a value other than its
default where its spec cannot apply it (``Spec.coverage``'s rules: MoE terms of a dense model, a
drafter field its kind never reads, ``DRAFTER_FIELDS``); ``coverage`` classifies every field of
each spec.
Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import tomlkit
from pydantic import ConfigDict

from specrl.costmodel.errors import SimInputError, key_hint, unknown
from specrl.settings import (
    AppliesOnly,
    Coverage,
    Section,
    each,
    errors_as,
    misapplied,
    read_toml,
    set_off_default,
    validate,
)

DTYPE_BYTES = 2  # bf16 activations and KV cache everywhere in the simulator


@dataclass(frozen=True)
class Precision:
    """A weight format: bytes per parameter, and whether GEMMs run at the FP8 peak."""

    name: str
    weight_bytes: float
    fp8_compute: bool


PRECISIONS: MappingProxyType[str, Precision] = MappingProxyType(
    {
        "bf16": Precision("bf16", 2.0, False),
        "fp8": Precision("fp8", 1.0, True),  # weights and GEMMs in FP8; KV cache stays bf16
    }
)


class Spec(Section):
    """A spec read from a TOML file: strict like every settings section, and frozen. Its
    ``coverage`` classifies every field (a spec describes a thing: ``always`` is a fact of it,
    read wherever the simulation needs it; a rule's field means nothing for the thing
    otherwise)."""

    model_config = ConfigDict(frozen=True)
    coverage: ClassVar[Coverage] = Coverage((), ())


S = TypeVar("S", bound=Spec)


class ModelSpec(Spec):
    """A decoder-only transformer, dense or mixture-of-experts."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    params_total: float
    params_active: float
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_layers: int = 0
    moe_intermediate: int = 0
    kv_bytes_per_token: int = 0  # 0: standard attention, 2 * layers * kv_heads * head_dim * bytes
    # measured routing: per expert the chance a token picks it (summing to experts_per_token,
    # the MoE layers' mean); () = uniform routing (experts_per_token / experts each)
    expert_popularity: tuple[float, ...] = ()

    coverage: ClassVar[Coverage] = Coverage(
        rules=each(
            ("experts_per_token", "shared_experts", "moe_layers", "moe_intermediate",
             "expert_popularity"),
            "experts", lambda n: n > 0, " > 0 (a mixture-of-experts model)",
        ),
        always=(
            "name", "layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "intermediate",
            "params_total", "params_active", "experts", "kv_bytes_per_token",
        ),
    )  # fmt: skip

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def kv_bytes(self) -> int:
        """KV-cache bytes per token of context (bf16), MLA latent size when given explicitly."""
        if self.kv_bytes_per_token:
            return self.kv_bytes_per_token
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert in one layer (gate, up and down projections)."""
        return 3.0 * self.hidden * self.moe_intermediate

    @property
    def routed_params(self) -> float:
        return self.experts * self.expert_params * self.moe_layers

    @property
    def dense_params(self) -> float:
        """Parameters every forward reads whatever the routing (attention, shared, embeddings)."""
        return self.params_total - self.routed_params

    @property
    def weight_bytes(self) -> float:
        return self.params_total * DTYPE_BYTES

    def weight_bytes_at(self, precision: str) -> float:
        """Bytes of all weights stored at ``precision`` (a ``PRECISIONS`` name)."""
        return self.params_total * PRECISIONS[precision].weight_bytes


class HardwareSpec(Spec):
    """One accelerator (or this CPU) with the efficiency terms the cost model applies."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    intra_node_bandwidth: float
    scale_out_bandwidth: float
    gpus_per_node: int
    eta_mem: float
    eta_compute: float
    step_overhead_s: float
    forward_overhead_s: float
    comm_latency_s: float
    mem_fraction: float
    # Extra seconds per logit the speculative verifier processes (target and residual
    # distributions, logprobs, over the vocabulary at each of the k+1 positions) beyond a plain
    # step's sampling: GPUs derive it from the bytes the sampler moves; fitted on CPUs.
    verify_s_per_logit: float = 0.0
    # Seconds a speculative step's verification adds whatever its size (building the draft
    # batch, the rejection sampler's setup and bookkeeping): fitted on CPUs, 0 elsewhere.
    verify_overhead_s: float = 0.0
    # Extra seconds per FLOP of a prefill beyond the decode rate (1 / (peak * eta_compute)):
    # for engines whose prefill runs another code path than decode (specrl's native engine
    # decodes in its own kernels and prefills through torch); fitted on CPUs, 0 elsewhere.
    prefill_s_per_flop: float = 0.0
    # A forward of more query tokens than the largest captured CUDA graph runs without one
    # (vLLM's behaviour) and pays its kernel launches on the host: ``eager_s_per_layer`` per
    # decoder layer of that network. 0 tokens: every forward is graphed (or none is, and
    # step_overhead_s already holds it); the default of every profile.
    graph_capture_tokens: int = 0
    eager_s_per_layer: float = 0.0
    peak_flops_fp8: float = 0.0  # dense FP8 FLOP/s (0: no FP8 tensor cores)
    # expert-parallel all-to-all (dispatch or combine, one MoE layer): latency + bytes over the
    # link bandwidth times this efficiency (fitted on DeepEP's published kernel times)
    a2a_latency_s: float = 0.0
    a2a_efficiency: float = 1.0
    # bandwidth efficiency of streaming routed experts' weights (the unique experts a forward's
    # tokens touch; per-expert kernel calls make it lower than eta_mem's): 0 = eta_mem's.
    # Fitted from an engine's own steps (``costmodel.fit``) or on published serving points
    # (``sim.fidelity``: the H100/H200 profiles); 0 in the other bundled profiles.
    eta_expert_mem: float = 0.0
    # Fixed seconds of every forward per decoder layer (``layer_s``: the graphed kernels'
    # floor: norms, rotary, attention, GEMM tails, which do not shrink with tensor parallelism)
    # and extra per MoE layer (``moe_layer_s``: router GEMM, top-k, expert alignment, grouped
    # GEMMs, combine; vLLM's fused_moe sequence), and per routed expert a forward touches in
    # a MoE layer (``expert_s``: its tiles of the grouped GEMMs, on every GPU under tensor
    # parallelism, whatever its slice). 0 = not modelled; fitted on published serving points
    # (``specrl simulate validate --sections physics``).
    layer_s: float = 0.0
    moe_layer_s: float = 0.0
    expert_s: float = 0.0

    coverage: ClassVar[Coverage] = Coverage(
        rules=(
            AppliesOnly("eager_s_per_layer", "graph_capture_tokens", lambda n: n > 0, " > 0"),
        ),
        always=(
            "name", "peak_flops", "hbm_bandwidth", "hbm_bytes", "intra_node_bandwidth",
            "scale_out_bandwidth", "gpus_per_node", "eta_mem", "eta_compute", "step_overhead_s",
            "forward_overhead_s", "comm_latency_s", "mem_fraction", "verify_s_per_logit",
            "verify_overhead_s", "prefill_s_per_flop", "graph_capture_tokens", "peak_flops_fp8",
            "a2a_latency_s", "a2a_efficiency", "eta_expert_mem", "layer_s", "moe_layer_s",
            "expert_s",
        ),
    )  # fmt: skip

    def peak(self, precision: str) -> float:
        """Dense GEMM FLOP/s at a weight precision; FP8 on a device without it is an error."""
        if not PRECISIONS[precision].fp8_compute:
            return self.peak_flops
        if self.peak_flops_fp8 <= 0:
            raise SimInputError(f"hardware {self.name} has no FP8 peak (peak_flops_fp8 = 0)")
        return self.peak_flops_fp8


# The DrafterSpec fields each kind's builder (``drafters.DRAFTER_KINDS``, the same kinds: a test
# checks) reads besides name, kind and position_ratio; a kind not listed is refused by validate.
DRAFTER_FIELDS: MappingProxyType[str, tuple[str, ...]] = MappingProxyType(
    {
        "eagle3": ("layers", "draft_vocab", "intermediate"),
        "block": ("layers", "draft_vocab", "intermediate"),
        "mtp": ("layers",),
        "draft_model": ("model",),
        "ngram": ("cpu_s_per_seq", "cpu_s_per_ctx_token"),
        "suffix": ("cpu_s_per_seq", "cpu_s_per_ctx_token"),
    }
)


def _drafter_rule(key: str) -> AppliesOnly:
    """``key`` applies only to the kinds that read it (a kind not listed: validate's to refuse)."""
    kinds = tuple(kind for kind, read in DRAFTER_FIELDS.items() if key in read)
    known = tuple(DRAFTER_FIELDS)
    needs = " " + " or ".join(repr(kind) for kind in kinds)
    return AppliesOnly(key, "kind", lambda k: k in kinds or k not in known, needs)


class DrafterSpec(Spec):
    """A speculation mechanism; ``kind`` selects the registered way to build its forward."""

    name: str
    kind: str
    layers: int = 1
    draft_vocab: int = 0  # 0: the target's vocabulary
    intermediate: int = 0  # 0: the target's dense intermediate size
    model: str = ""  # draft_model kind: name of a model spec
    cpu_s_per_seq: float = 0.0  # model-free kinds: CPU seconds per sequence per speculation round
    # model-free kinds: CPU seconds per context token per sequence per round (the match scan)
    cpu_s_per_ctx_token: float = 0.0
    # acceptance profile over draft positions: P(accept draft i+1 | drafts 1..i accepted) is
    # position_ratio times that of draft i (1: the same at every position)
    position_ratio: float = 1.0

    coverage: ClassVar[Coverage] = Coverage(
        rules=tuple(_drafter_rule(key) for key in dict.fromkeys(sum(DRAFTER_FIELDS.values(), ()))),
        always=("name", "kind", "position_ratio"),
    )


def data_root() -> Path:
    """The bundled spec files, ``specrl/sim/data`` (found from ``specrl``, not ``specrl.sim``:
    resolving the latter would import the simulator)."""
    return Path(str(resources.files("specrl") / "sim" / "data"))


SPEC_KINDS: dict[str, str] = {
    "scenarios": "scenario",
    "models": "model",
    "hardware": "hardware",
    "drafters": "drafter",
}


def spec_path(kind: str, name: str) -> Path:
    """Resolve a spec name (or a path to a .toml file) to a file; raise SimInputError naming the
    valid choices (with a did-you-mean) if there is none."""
    what = SPEC_KINDS[kind]
    if not isinstance(name, str) or not name.strip():
        raise SimInputError(f"{what} must be a spec name or a .toml path, got {name!r}")
    candidate = Path(name)
    if candidate.suffix == ".toml" or "/" in name:
        if candidate.is_dir():
            raise SimInputError(f"{what} spec {name}: is a directory, not a .toml file")
        if not candidate.is_file():
            raise SimInputError(f"{what} spec file {name} not found")
        return candidate
    path = data_root() / kind / f"{name}.toml"
    if not path.is_file():
        raise unknown(f"{what} spec", name, list_specs(kind))
    return path


def list_specs(kind: str) -> list[str]:
    """Names of the bundled specs of one kind: models, hardware, drafters or scenarios."""
    return sorted(p.stem for p in (data_root() / kind).glob("*.toml"))


def build_spec(cls: type[S], data: dict[str, Any], what: str, source: str = "") -> S:
    """A spec from a dict, its keys and types checked, and no field given a value other than
    its default where the spec cannot apply it (``cls.coverage``; ``SimInputError`` in one
    line, after ``SOURCE: `` or ``WHAT: ``)."""
    with errors_as(SimInputError):
        spec = validate(cls, data, what, hint=key_hint(cls), source=source)
    if problems := misapplied(spec, cls.coverage.rules, lambda key: set_off_default(spec, key)):
        raise SimInputError(f"{source or what}: {'; '.join(problems)}")
    return spec


def load_toml(kind: str, name: str) -> tuple[dict[str, Any], str]:
    """The table of a spec file of ``kind`` (``spec_path``) and its path."""
    path = spec_path(kind, name)
    with errors_as(SimInputError):
        return read_toml(path, f"{SPEC_KINDS[kind]} file"), str(path)


def _load(kind: str, cls: type[S], name: str) -> S:
    data, path = load_toml(kind, name)
    return build_spec(cls, data, f"{SPEC_KINDS[kind]} spec", path)


def load_model(name: str) -> ModelSpec:
    return _load("models", ModelSpec, name)


def load_hardware(name: str) -> HardwareSpec:
    return _load("hardware", HardwareSpec, name)


def load_drafter(name: str) -> DrafterSpec:
    return _load("drafters", DrafterSpec, name)


def with_overrides(spec: S, **changes: Any) -> S:
    """A copy of a frozen spec with some fields replaced, unchecked like ``dataclasses.replace``
    (sensitivity analysis, fitted profiles); an unknown field is a ``TypeError``."""
    unknown_fields = sorted(set(changes) - set(type(spec).model_fields))
    if unknown_fields:
        raise TypeError(f"{type(spec).__name__} has no field {unknown_fields[0]!r}")
    return spec.model_copy(update=changes)


def spec_to_toml(spec: HardwareSpec | DrafterSpec, header: str = "") -> str:
    """Serialise a hardware profile or drafter spec in the TOML layout the loaders read."""
    doc = tomlkit.document()
    for line in header.splitlines():
        doc.add(tomlkit.comment(line))
    for name in type(spec).model_fields:
        doc.add(name, getattr(spec, name))
    return tomlkit.dumps(doc)
