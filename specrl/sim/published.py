"""Published measurements the engine and trainer constants are fitted on, and those fits.

Data (frozen dataclasses in tuples) and pure functions: ``DEEPEP_LOW_LATENCY`` (DeepEP's
all-to-all kernel times) and ``fit_all_to_all()`` (costmodel/cost.py's all-to-all constants);
``NEMO_RL_V03_PHASES`` (a GRPO step's phases) and ``fit_training()`` (the MFUs of
``data/training.toml``). Each source names its publication and table. The paper's table lives
in paper.py, the held-out serving measurements in serving.py.
Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from specrl.costmodel.cost import all_to_all_time
from specrl.costmodel.specs import HardwareSpec, load_hardware, load_model, with_overrides
from specrl.sim.runner import rl_phases
from specrl.sim.scenario import load_scenario
from specrl.sim.training import model_class

# --------------------------------------------------------------------------- all-to-all (EP)


@dataclass(frozen=True)
class AllToAllPoint:
    """One DeepEP kernel timing: ``ep`` ranks, bytes sent per GPU, seconds."""

    ep: int
    op: str  # dispatch (FP8 with scales) or combine (BF16)
    bytes_per_gpu: float
    seconds: float


_LL_TOKENS, _LL_TOPK, _HIDDEN = 128, 8, 7168
_FP8_BYTES = _HIDDEN + _HIDDEN // 128 * 4  # FP8 values plus one fp32 scale per 128
_LL_DISPATCH = _LL_TOKENS * _LL_TOPK * _FP8_BYTES
_LL_COMBINE = _LL_TOKENS * _LL_TOPK * _HIDDEN * 2

DEEPEP_SOURCE = (
    "DeepEP V1 performance table (deepseek-ai/DeepEP, docs/legacy.md; the README's table since"
    " the June 2025 low-latency update), low-latency kernels on H800 (NVLink ~160 GB/s, CX7"
    " InfiniBand 400 Gb/s per GPU), 128 tokens per batch, hidden 7168, top-8 experts, FP8"
    " dispatch and BF16 combine; latency per EP degree"
)
DEEPEP_LOW_LATENCY: tuple[AllToAllPoint, ...] = tuple(
    AllToAllPoint(ep, op, size, us * 1e-6)
    for ep, dispatch_us, combine_us in (
        (8, 77, 114),
        (16, 118, 195),
        (32, 155, 273),
        (64, 173, 314),
        (128, 192, 369),
        (256, 194, 360),
    )
    for op, size, us in (
        ("dispatch", _LL_DISPATCH, dispatch_us),
        ("combine", _LL_COMBINE, combine_us),
    )
)


def h800() -> HardwareSpec:
    """The H800 the DeepEP numbers were measured on: an H100 SXM with NVLink at 400 GB/s
    (200 GB/s per direction) and one 400 Gb/s NIC per GPU."""
    return with_overrides(
        load_hardware("h100"),
        name="h800",
        intra_node_bandwidth=200e9,
        scale_out_bandwidth=50e9,
        a2a_latency_s=0.0,
        a2a_efficiency=1.0,
    )


def fit_all_to_all(points: tuple[AllToAllPoint, ...] = DEEPEP_LOW_LATENCY) -> tuple[float, float]:
    """(a2a_latency_s, a2a_efficiency): least squares of t = latency + wire / efficiency, with
    wire = cost.all_to_all_time at zero latency and efficiency 1 on the H800's links."""
    hw = h800()
    wire = np.array([all_to_all_time(hw, p.ep, p.bytes_per_gpu) for p in points])
    t = np.array([p.seconds for p in points])
    x = np.stack([np.ones_like(wire), wire], axis=1)
    latency, per_wire = np.linalg.lstsq(x, t, rcond=None)[0]
    return float(latency), float(1.0 / per_wire)


# --------------------------------------------------------------------------- training MFU


@dataclass(frozen=True)
class PhaseMeasurement:
    """Published seconds of the phases of one colocated GRPO step of a bundled scenario."""

    scenario: str
    seconds: MappingProxyType[str, float]
    source: str


NEMO_RL_V03_SOURCE = (
    "NeMo-RL v0.3 Megatron-Core blog (NVIDIA, 2025): GRPO step-time breakdown, mean of steps"
    " 22-29, 2048 rollouts, max sequence 4096, colocated Megatron training"
)
NEMO_RL_V03_PHASES: tuple[PhaseMeasurement, ...] = (
    PhaseMeasurement(
        "nemo-rl-v03-llama8b-8xh100",
        MappingProxyType(
            {"generation": 58.0, "train": 28.0, "logprobs": 18.0, "refit": 5.0, "total": 112.0}
        ),
        NEMO_RL_V03_SOURCE + ": Llama-3.1-8B-Instruct, 8 H100",
    ),
    PhaseMeasurement(
        "nemo-rl-v03-qwen3-30b-a3b-64xh100",
        MappingProxyType(
            {"generation": 78.0, "train": 50.0, "logprobs": 23.0, "refit": 12.0, "total": 167.0}
        ),
        NEMO_RL_V03_SOURCE + ": Qwen3-30B-A3B, 64 H100 (EP8 TP2 training)",
    ),
)
TRAINING_FIT_PHASES = MappingProxyType({"train": "train_mfu", "logprobs": "logprob_mfu"})


def _phases_at(scenario: str, mfu: float):
    sc = load_scenario(scenario, [f"training.mfu={mfu!r}", f"training.logprob_mfu={mfu!r}"])
    return rl_phases(sc, 0.0, False, sc.generation.gpus)


def fit_training() -> dict[str, dict[str, float]]:
    """MFU of RL training and of the logprob passes per model class, from the v0.3 phases (the
    generation phase is held out): the MFU at which training.py reproduces each published phase.
    A phase costs C / mfu + K (K: its collectives), so two evaluations, at MFU 1 and 1/2, give C
    and K, and mfu = C / (published - K)."""
    out: dict[str, dict[str, float]] = {}
    for m in NEMO_RL_V03_PHASES:
        one, half = _phases_at(m.scenario, 1.0), _phases_at(m.scenario, 0.5)
        fitted = {}
        for phase, key in TRAINING_FIT_PHASES.items():
            compute = getattr(half, phase) - getattr(one, phase)
            collectives = getattr(one, phase) - compute
            fitted[key] = compute / (m.seconds[phase] - collectives)
        out[model_class(load_model(load_scenario(m.scenario).model))] = fitted
    return out
