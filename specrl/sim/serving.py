"""Published serving measurements, each with its source, and how the simulator evaluates them.

``SERVING`` lists ``ServingPoint`` rows (plain and speculative decoding, dense and MoE, H100/H200
and an RTX 3090 series): a steady batch on one replica or a phase of a bundled scenario, with a
``quantity`` (``tok_per_s``, ``speedup`` or ``seconds``). A speculative point's acceptance is
published or set by its group's "fit" row (``fit_group_acceptance``); "heldout" rows never fit
anything. ``serving_value(point)`` returns the simulated value.
Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrl.sim.runner import run_scenario, simulate_generation
from specrl.sim.scenario import Scenario, load_scenario


@dataclass(frozen=True)
class ServingPoint:
    key: str
    label: str
    role: str  # "fit" | "heldout"
    quantity: str  # "tok_per_s" | "speedup" | "seconds"
    published: float
    source: str
    model: str = ""
    hardware: str = ""
    gpus: int = 1  # GPUs of the replica (TP)
    precision: str = "bf16"
    batch: int = 1
    prompt_len: int = 150
    output_len: int = 400
    drafter: str = ""  # "" = plain decoding
    k: int = 0
    group: str = ""  # points sharing one fitted acceptance length
    scenario: str = ""  # a bundled scenario instead of a steady batch
    phase: str = ""
    assumed: str = ""
    acceptance_length: float = 0.0  # published acceptance (0: fitted on the group's fit row)
    acceptance_source: str = ""

    @property
    def kind(self) -> str:
        """dense or moe, plain or speculative (for the table)."""
        spec = "spec" if self.drafter else "plain"
        return f"{'moe' if self.model.startswith(('deepseek', 'qwen3-30b')) else 'dense'} {spec}"


# The GPUs the held-out accuracy target is stated for (issue 19); rows on other hardware are
# reported beside it.
TARGET_HARDWARE = ("h100", "h200")

SGLANG_DOCS = (
    "EAGLE-3 (Li et al., arXiv 2503.01840, NeurIPS 2025), Table 4, also in the SGLang"
    " documentation, speculative decoding: Llama-3.1-8B-Instruct on 1 H100, MT-bench, batch 1:"
    " 158.34 tok/s without speculation"
)
EAGLE3_TABLE = (
    "EAGLE-3 (Li et al., arXiv 2503.01840, NeurIPS 2025), section 4.3 and Table 3: throughput"
    " in SGLang v0.4.4 on one H100, LLaMA-Instruct 3.1 8B, MT-bench, chain of 3 drafts (no"
    " tree), by batch size, over SGLang without speculation"
)
EAGLE3_VLLM_TABLE = (
    "EAGLE-3 (Li et al., arXiv 2503.01840, NeurIPS 2025), section 4.4 and Table 5: throughput"
    " in vLLM on one RTX 3090, LLaMA-Instruct 3.1 8B, MT-bench, chain of at most 2 drafts (no"
    " tree), by batch size, over vLLM without speculation"
)
SGLANG_DEEPSEEK = (
    "SGLang documentation, DeepSeek V3/R1 usage, multi-token prediction: decoding 1.8x faster at"
    " batch size 1 and 1.5x at batch size 32 on H200 TP8 (DeepSeek-V3, FP8 weights)"
)
DEEPSEEK_MTP_ACCEPTANCE = (
    "DeepSeek-V3 technical report (arXiv 2412.19437, section 5.4.3): the second token predicted by"
    " the MTP module is accepted 85-90% of the time; 1.875 tokens per step at k = 1 (the midpoint)"
)
NEMO_V03 = "NeMo-RL v0.3 Megatron-Core blog: GRPO step breakdown, generation phase (vLLM)"
STEADY = "MT-bench-like 150-token prompts and 400-token outputs"
EAGLE_LAYOUT = "chain k = 3 as the paper states; acceptance from the batch-2 column"

SERVING: tuple[ServingPoint, ...] = (
    ServingPoint("sglang-llama8b-b1", "Llama-3.1-8B, 1xH100, batch 1, plain", "heldout",
                 "tok_per_s", 158.34, SGLANG_DOCS, "llama-3.1-8b", "h100", assumed=STEADY),
    *(
        ServingPoint(f"eagle3-sglang-b{b}", f"Llama-3.1-8B, 1xH100, batch {b}, EAGLE-3",
                     "fit" if b == 2 else "heldout", "speedup", value, EAGLE3_TABLE,
                     "llama-3.1-8b", "h100", batch=b, drafter="eagle3", k=3,
                     group="eagle3-sglang-mtbench", assumed=f"{STEADY}; {EAGLE_LAYOUT}")
        for b, value in ((2, 1.81), (4, 1.82), (8, 1.62), (16, 1.48), (24, 1.39), (32, 1.32),
                         (48, 1.38), (56, 1.34), (64, 1.38))
    ),
    *(
        ServingPoint(f"eagle3-vllm-3090-b{b}", f"Llama-3.1-8B, 1xRTX 3090, batch {b}, EAGLE-3",
                     "fit" if b == 2 else "heldout", "speedup", value, EAGLE3_VLLM_TABLE,
                     "llama-3.1-8b", "rtx3090", batch=b, drafter="eagle3", k=2,
                     group="eagle3-vllm-3090-mtbench",
                     assumed=f"{STEADY}; chain k = 2 as the paper states; acceptance from the"
                     " batch-2 column; engine terms of the H100 vLLM fit")
        for b, value in ((2, 1.75), (4, 1.68), (8, 1.58), (16, 1.49), (24, 1.42), (32, 1.36),
                         (48, 1.21), (56, 1.01))
    ),
    *(
        ServingPoint(f"deepseek-mtp-b{b}", f"DeepSeek-V3, 8xH200 TP8, batch {b}, MTP",
                     "heldout", "speedup", value, SGLANG_DEEPSEEK,
                     "deepseek-v3", "h200", gpus=8, precision="fp8", batch=b, drafter="mtp",
                     k=1, acceptance_length=1.875, acceptance_source=DEEPSEEK_MTP_ACCEPTANCE,
                     assumed=f"{STEADY}; one MTP draft (k = 1, SGLang's minimal MTP setting);"
                     " experts tensor-parallel (SGLang's TP8 default)")
        for b, value in ((1, 1.8), (32, 1.5))
    ),
    ServingPoint("nemo-v03-llama8b-generation", "Llama-3.1-8B, 8xH100 TP1, RL rollout, plain",
                 "heldout", "seconds", 58.0, NEMO_V03 + ": Llama-3.1-8B-Instruct, 8 H100",
                 "llama-3.1-8b", "h100", scenario="nemo-rl-v03-llama8b-8xh100",
                 phase="generation", assumed="scenario inputs (prompt length, TP, tail)"),
    ServingPoint("nemo-v03-qwen30b-generation", "Qwen3-30B-A3B, 64xH100 TP2, RL rollout, plain",
                 "heldout", "seconds", 78.0, NEMO_V03 + ": Qwen3-30B-A3B, 64 H100",
                 "qwen3-30b-a3b", "h100", gpus=2, scenario="nemo-rl-v03-qwen3-30b-a3b-64xh100",
                 phase="generation", assumed="scenario inputs (prompt length, TP2, tail)"),
)  # fmt: skip


def steady_scenario(point: ServingPoint, acceptance_length: float = 1.0) -> Scenario:
    """One replica serving ``batch`` equal sequences at once (the steady batch of a point)."""
    k = max(point.k, 1)
    data = {
        "name": point.key,
        "model": point.model,
        "hardware": point.hardware,
        "workload": {
            "samples_per_step": point.batch,
            "prompt_len": point.prompt_len,
            "mean_response_len": float(point.output_len),
            "response_sigma": 0.0,
            "max_response_len": point.output_len,
        },
        "generation": {
            "gpus": point.gpus,
            "gpus_per_replica": point.gpus,
            "max_num_seqs": point.batch,
            "precision": point.precision,
        },
        "speculation": {
            "enabled": bool(point.drafter),
            "drafter": point.drafter or "eagle3",
            "k": k,
            "acceptance": {"acceptance_length": acceptance_length, "at_k": k},
        },
    }
    return Scenario.model_validate(data)


def _steady_value(point: ServingPoint, acceptance_length: float) -> float:
    sc = steady_scenario(point, acceptance_length)
    plain = simulate_generation(sc, False)
    if point.quantity == "tok_per_s":
        return plain.throughput
    return plain.time_s / simulate_generation(sc, True).time_s


def fit_group_acceptance(group: str) -> float:
    """The acceptance length at which the group's "fit" point reproduces its published value."""
    point = next(p for p in SERVING if p.group == group and p.role == "fit")
    lo, hi = 1.0, float(max(point.k, 1) + 1)
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _steady_value(point, mid) < point.published else (lo, mid)
    return 0.5 * (lo + hi)


def serving_value(point: ServingPoint, acceptance_length: float | None = None) -> float:
    """The simulated value of a point (a group's acceptance fitted when not given)."""
    if point.scenario:
        res = run_scenario(load_scenario(point.scenario, ["workload.seeds=1"]))
        return float(getattr(res.no_spec.phases, point.phase))
    if point.drafter and acceptance_length is None:
        acceptance_length = point.acceptance_length or fit_group_acceptance(point.group)
    return _steady_value(point, acceptance_length or 1.0)
