"""Published serving measurements, each with its source, and how the simulator evaluates them.

``SERVING`` lists ``ServingPoint`` rows (plain and speculative decoding, dense and MoE, H100/H200
and an RTX 3090 series): a steady batch on one replica or a phase of a bundled scenario, with a
``quantity`` (``tok_per_s``, ``speedup`` or ``seconds``). A speculative point's acceptance is
published or set by its group's "fit" row (``fit_group_acceptance``); "heldout" rows never set
an acceptance (the H100/H200 ones fit the Hopper profiles' engine constants: ``sim.fidelity``,
which reports them leaving each source out); each row names its independent source group
(``origin``, one of ``ORIGINS``). ``serving_value(point, overrides=...)`` returns the simulated
value, under scenario overrides (``engine.*``) if given.
Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from scipy.optimize import brentq

from specrl.settings import apply_overrides
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
    origin: str = ""  # the independent source group (``ORIGINS``): errors are reported by it

    @property
    def kind(self) -> str:
        """dense or moe, plain or speculative (for the table)."""
        spec = "spec" if self.drafter else "plain"
        return f"{'moe' if self.model.startswith(('deepseek', 'qwen3-30b')) else 'dense'} {spec}"


Overrides = tuple[str, ...]  # scenario overrides, "key=value"

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
VLLM_16937 = (
    "vllm-project/vllm PR #16937 ([V1][Spec Decode] EAGLE-3 Support), comment of 2025-04-24:"
    " 'Output tokens/s on H100 BS1', Llama-3.1-8B-Instruct, MT-bench, --max_num_seqs 1: vanilla 133"
)
VLLM_20780 = (
    "vllm-project/vllm issue #20780 (2025-07-10): Llama 3.1 8B, BS 1, TPOT in ms by K, vanilla"
    " 7.07; EAGLE 3 at K = 2..7: 4.32 / 4.09 / 4.05 / 4.13 / 4.2 / 4.29; acceptance lengths 2.36 /"
    " 2.79 / 3.08 / 3.32 / 3.46 / 3.54"
)
VLLM_20780_GPU = "the issue names no GPU: H100 as in the same author's PR #16937 run"
SPECFORGE_339 = (
    "sgl-project/SpecForge issue #339 (2025-12-01): Qwen/Qwen3-30B-A3B, --tp-size 2 on H100,"
    " bfloat16, SGLang bench_eagle3 on mtbench:20; throughput by batch 1 / 4 / 8 / 16: 222.47 /"
    " 566.21 / 733.61 / 1012.96; EAGLE-3 (3 steps, top-k 1, 4 draft tokens) at batch 4: 447.90,"
    " acceptance 1.86"
)
ANGELSLIM_163 = (
    "Tencent/AngelSlim issue #163 (2025-12-08): Qwen3-30B-A3B, H100 x4, TP4, EP1, SGLang;"
    " throughput by batch 1 / 4 / 8: 218.89 / 507.49 / 677.14"
)
MTBENCH_20 = (
    "throughput taken as output tokens/s; 20 MT-bench prompts, so batches above 20 (the reports'"
    " 32 and 64) cannot be full and are left out"
)
SGLANG_4716 = (
    "sgl-project/sglang PR #4716 (Fix EAGLE3 for llama3.3 70b, 2025-03-24): Llama-3.3-70B-Instruct,"
    " H100 TP8, --dtype float16, --cuda-graph-max-bs 1, MT-bench 80 questions: 'w/o spec: ..."
    " Throughput: 88.61 token/s'"
)
DATACRUNCH_R1 = (
    "datacrunch-research/blogs, deepseek-r1-deployment.md: DeepSeek-R1 on 8xH200, SGLang"
    " bench_one_batch --batch-size 1 --input 128 --output 256 --tp 8 --enable-torch-compile:"
    " 'Decode. median latency: 0.02098 s, median throughput: 47.67 token/s'"
)
# Independent source groups (one organisation's publications or one reporter's runs each)
EAGLE3_PAPER = "EAGLE-3 paper"
SGLANG = "SGLang docs and PRs"
NEMO_RL = "NeMo-RL blog"
VLLM = "vLLM GitHub"
QWEN30B_REPORTS = "SpecForge/AngelSlim reports"
DATACRUNCH = "DataCrunch blog"
ORIGINS = (EAGLE3_PAPER, SGLANG, NEMO_RL, VLLM, QWEN30B_REPORTS, DATACRUNCH)
STEADY = "MT-bench-like 150-token prompts and 400-token outputs"
EAGLE_LAYOUT = "chain k = 3 as the paper states; acceptance from the batch-2 column"

SERVING: tuple[ServingPoint, ...] = (
    ServingPoint("sglang-llama8b-b1", "Llama-3.1-8B, 1xH100, batch 1, plain", "heldout",
                 "tok_per_s", 158.34, SGLANG_DOCS, "llama-3.1-8b", "h100", assumed=STEADY,
                 origin=EAGLE3_PAPER),
    *(
        ServingPoint(f"eagle3-sglang-b{b}", f"Llama-3.1-8B, 1xH100, batch {b}, EAGLE-3",
                     "fit" if b == 2 else "heldout", "speedup", value, EAGLE3_TABLE,
                     "llama-3.1-8b", "h100", batch=b, drafter="eagle3", k=3,
                     group="eagle3-sglang-mtbench", assumed=f"{STEADY}; {EAGLE_LAYOUT}",
                     origin=EAGLE3_PAPER)
        for b, value in ((2, 1.81), (4, 1.82), (8, 1.62), (16, 1.48), (24, 1.39), (32, 1.32),
                         (48, 1.38), (56, 1.34), (64, 1.38))
    ),
    *(
        ServingPoint(f"eagle3-vllm-3090-b{b}", f"Llama-3.1-8B, 1xRTX 3090, batch {b}, EAGLE-3",
                     "fit" if b == 2 else "heldout", "speedup", value, EAGLE3_VLLM_TABLE,
                     "llama-3.1-8b", "rtx3090", batch=b, drafter="eagle3", k=2,
                     group="eagle3-vllm-3090-mtbench",
                     assumed=f"{STEADY}; chain k = 2 as the paper states; acceptance from the"
                     " batch-2 column; engine terms of the H100 vLLM fit", origin=EAGLE3_PAPER)
        for b, value in ((2, 1.75), (4, 1.68), (8, 1.58), (16, 1.49), (24, 1.42), (32, 1.36),
                         (48, 1.21), (56, 1.01))
    ),
    *(
        ServingPoint(f"deepseek-mtp-b{b}", f"DeepSeek-V3, 8xH200 TP8, batch {b}, MTP",
                     "heldout", "speedup", value, SGLANG_DEEPSEEK,
                     "deepseek-v3", "h200", gpus=8, precision="fp8", batch=b, drafter="mtp",
                     k=1, acceptance_length=1.875, acceptance_source=DEEPSEEK_MTP_ACCEPTANCE,
                     assumed=f"{STEADY}; one MTP draft (k = 1, SGLang's minimal MTP setting);"
                     " experts tensor-parallel (SGLang's TP8 default)", origin=SGLANG)
        for b, value in ((1, 1.8), (32, 1.5))
    ),
    ServingPoint("nemo-v03-llama8b-generation", "Llama-3.1-8B, 8xH100 TP1, RL rollout, plain",
                 "heldout", "seconds", 58.0, NEMO_V03 + ": Llama-3.1-8B-Instruct, 8 H100",
                 "llama-3.1-8b", "h100", scenario="nemo-rl-v03-llama8b-8xh100",
                 phase="generation", assumed="scenario inputs (prompt length, TP, tail)",
                 origin=NEMO_RL),
    ServingPoint("nemo-v03-qwen30b-generation", "Qwen3-30B-A3B, 64xH100 TP2, RL rollout, plain",
                 "heldout", "seconds", 78.0, NEMO_V03 + ": Qwen3-30B-A3B, 64 H100",
                 "qwen3-30b-a3b", "h100", gpus=2, scenario="nemo-rl-v03-qwen3-30b-a3b-64xh100",
                 phase="generation", assumed="scenario inputs (prompt length, TP2, tail)",
                 origin=NEMO_RL),
    ServingPoint("vllm-16937-llama8b-b1", "Llama-3.1-8B, 1xH100, batch 1, plain (vLLM V1)",
                 "heldout", "tok_per_s", 133.0, VLLM_16937, "llama-3.1-8b", "h100",
                 assumed=STEADY, origin=VLLM),
    ServingPoint("vllm-20780-llama8b-b1", "Llama-3.1-8B, H100, batch 1, plain: 7.07 ms TPOT",
                 "heldout", "tok_per_s", 1 / 7.07e-3, VLLM_20780, "llama-3.1-8b", "h100",
                 assumed=f"{STEADY}; {VLLM_20780_GPU}", origin=VLLM),
    *(
        ServingPoint(f"vllm-20780-eagle3-k{k}", f"Llama-3.1-8B, H100, batch 1, EAGLE-3 k = {k}",
                     "heldout", "speedup", 7.07 / tpot_ms, VLLM_20780, "llama-3.1-8b", "h100",
                     drafter="eagle3", k=k, acceptance_length=accepted,
                     acceptance_source=VLLM_20780, assumed=f"{STEADY}; {VLLM_20780_GPU}",
                     origin=VLLM)
        for k, accepted, tpot_ms in ((2, 2.36, 4.32), (3, 2.79, 4.09), (4, 3.08, 4.05),
                                     (5, 3.32, 4.13), (6, 3.46, 4.2), (7, 3.54, 4.29))
    ),
    *(
        ServingPoint(f"specforge-qwen30b-tp{tp}-b{b}",
                     f"Qwen3-30B-A3B, {tp}xH100 TP{tp}, batch {b}, plain", "heldout",
                     "tok_per_s", value, source, "qwen3-30b-a3b", "h100", gpus=tp, batch=b,
                     assumed=f"{STEADY}; {MTBENCH_20}", origin=QWEN30B_REPORTS)
        for tp, source, series in (
            (2, SPECFORGE_339, ((1, 222.47), (4, 566.21), (8, 733.61), (16, 1012.96))),
            (4, ANGELSLIM_163, ((1, 218.89), (4, 507.49), (8, 677.14))),
        )
        for b, value in series
    ),
    ServingPoint("specforge-qwen30b-tp2-b4-eagle3", "Qwen3-30B-A3B, 2xH100 TP2, batch 4, EAGLE-3",
                 "heldout", "speedup", 447.90 / 566.21, SPECFORGE_339, "qwen3-30b-a3b", "h100",
                 gpus=2, batch=4, drafter="eagle3", k=3, acceptance_length=1.86,
                 acceptance_source=SPECFORGE_339,
                 assumed=f"{STEADY}; {MTBENCH_20}; chain of 3 (steps 3, top-k 1, 4 draft tokens)",
                 origin=QWEN30B_REPORTS),
    ServingPoint("sglang-4716-llama70b-tp8-b1", "Llama-3.3-70B, 8xH100 TP8, batch 1, plain",
                 "heldout", "tok_per_s", 88.61, SGLANG_4716, "llama-3.1-70b", "h100", gpus=8,
                 assumed=f"{STEADY}; float16 as bf16 (the same bytes and FLOPs)",
                 origin=SGLANG),
    ServingPoint("datacrunch-deepseek-r1-b1", "DeepSeek-R1, 8xH200 TP8, batch 1, plain",
                 "heldout", "tok_per_s", 47.67, DATACRUNCH_R1, "deepseek-v3", "h200", gpus=8,
                 precision="fp8", prompt_len=128, output_len=256,
                 assumed="DeepSeek-R1 has DeepSeek-V3's architecture; experts tensor-parallel",
                 origin=DATACRUNCH),
)  # fmt: skip


def steady_scenario(
    point: ServingPoint, acceptance_length: float = 1.0, overrides: Overrides = ()
) -> Scenario:
    """One replica serving ``batch`` equal sequences at once (the steady batch of a point), with
    scenario ``overrides`` (``engine.*``: the profile's engine terms) applied."""
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
    return Scenario.model_validate(apply_overrides(data, list(overrides)))


def _steady_value(point: ServingPoint, acceptance_length: float, overrides: Overrides) -> float:
    sc = steady_scenario(point, acceptance_length, overrides)
    plain = simulate_generation(sc, False)
    if point.quantity == "tok_per_s":
        return plain.throughput
    return plain.time_s / simulate_generation(sc, True).time_s


def fit_group_acceptance(group: str, overrides: Overrides = ()) -> float:
    """The acceptance length at which the group's "fit" point reproduces its published value
    (its end of the range when none does)."""
    point = next(p for p in SERVING if p.group == group and p.role == "fit")
    lo, hi = 1.0, float(max(point.k, 1) + 1)

    def gap(length: float) -> float:
        return _steady_value(point, length, overrides) - point.published

    if gap(lo) >= 0:
        return lo
    if gap(hi) <= 0:
        return hi
    return float(brentq(gap, lo, hi, xtol=1e-9))


def serving_value(
    point: ServingPoint, acceptance_length: float | None = None, overrides: Overrides = ()
) -> float:
    """The simulated value of a point (a group's acceptance fitted when not given) under
    scenario ``overrides``."""
    if point.scenario:
        res = run_scenario(load_scenario(point.scenario, ["workload.seeds=1", *overrides]))
        return float(getattr(res.no_spec.phases, point.phase))
    if point.drafter and acceptance_length is None:
        acceptance_length = point.acceptance_length or fit_group_acceptance(point.group, overrides)
    return _steady_value(point, acceptance_length or 1.0, overrides)
