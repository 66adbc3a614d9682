"""The native and vLLM rollout backends side by side, through the ``RolloutBackend`` seam.

Usage: python benchmarks/native_vs_vllm.py [--batch-sizes 1,8,32,64] [--new-tokens 128]
       [--methods none,ngram,draft,eagle3 --eagle3-head DIR] [--dtype fp32] [--repeats 1]
       [--rl-steps 2] [--out PATH]

Writes benchmarks/results/native_vs_vllm.json (command, date, machine, versions, this machine's
roofline measured in the same run). Same GRPO-like requests for both backends: B completions as B
// G chat prompts x G samples (G = min(8, B)), temperature 1, exactly ``new_tokens`` each (no stop
token), the same seeds. Per method: ``none`` (plain), ``ngram`` (k=3, fixed k), ``draft`` (k=3; the
draft model is the target's first ``--draft-layers`` layers, saved as a Hugging Face directory both
backends load), ``eagle3`` (k=3; a head trained with ``specrl train-drafter --drafter eagle3
--head-arch eagle3``, ``--eagle3-head``: the native engine loads it, vLLM its export by
``specrl.drafters.export.export_eagle3``). Each (backend, method, batch) is run ``--warmup`` times
untimed (vLLM's first calls in a process take seconds each), then timed best of ``--repeats``.
Reports tokens/s, acceptance (vLLM's own counters for vLLM), fraction of the roofline, and the
ratios vLLM / native and speculative / plain. Then ``--rl-steps`` steps of the default ``specrl
train`` run on each backend (``rollout.spec`` none and ngram; same seeds), with the generation,
learner and step seconds of each step (the first step includes warm-up; compare the last).
Run it alone on the machine: it times both.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

OUT = Path(__file__).parent / "results" / "native_vs_vllm.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def requests(tok, batch: int, new_tokens: int, seed: int):
    from specrl.bench import BENCH_QUESTIONS
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams

    group = min(8, batch)
    return [
        Request(
            tok.encode_chat(BENCH_QUESTIONS[i % len(BENCH_QUESTIONS)]),
            SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=group, seed=seed + i),
        )  # fmt: skip
        for i in range(batch // group)
    ]


def save_draft(target, tok_dir: Path, layers: int, out: Path) -> Path:
    """The target's first ``layers`` layers as a Hugging Face model directory."""
    import json
    import shutil

    from safetensors.torch import save_file

    from specrl.models.checkpoints import hf_state_dict
    from specrl.models.transformer import layer_prefix_model

    draft = layer_prefix_model(target, layers)
    save_file({k: v.float().contiguous() for k, v in hf_state_dict(draft).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (out / "config.json").write_text(json.dumps(draft.config.to_hf_dict(), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)
    return out


def timed(backend, reqs, spec, repeats: int, warmup: int) -> dict:
    from specrl.pipelines.step import rollout_metrics

    for _ in range(warmup):  # vLLM's first calls are slow (kernels, numba, caches)
        backend.generate(reqs, spec=spec)
    best = None
    for _ in range(repeats):
        out = backend.generate(reqs, spec=spec)
        if best is None or out.seconds < best.seconds:
            best = out
    m = rollout_metrics(best)
    return {
        "tokens": best.tokens,
        "seconds": best.seconds,
        "tokens_per_s": best.tokens / best.seconds,
        "acceptance_length": m["acceptance_length"],
        "draft_acceptance_length": m["draft_acceptance_length"],
        "drafted": best.stats.drafted,
        "accepted": best.stats.accepted,
    }


def rl_steps(steps: int, dtype: str) -> list[dict]:
    """``steps`` steps of the default run per backend and speculation (none, ngram), same seeds:
    one row per step with its generation / learner / step seconds and acceptance."""
    from specrl.config import load_config
    from specrl.pipelines.build import build_run
    from specrl.pipelines.train import train

    keep = ("step", "gen_time_s", "train_time_s", "step_time_s", "rollout_tokens_per_s",
            "acceptance_length", "reward_mean", "logprob_delta_mean")  # fmt: skip
    out = []
    for backend in ("native", "vllm"):
        for spec in ("none", "ngram"):
            sets = [f"rollout.backend={backend}", f"rollout.spec={spec}", f"run.steps={steps}",
                    "run.eval_every=0", "run.checkpoint_every=0",
                    f"model.dtype={dtype}"]  # fmt: skip
            parts = build_run(load_config(None, sets))
            try:
                with tempfile.TemporaryDirectory(prefix="specrl-rl-") as run_dir:
                    rows = train(parts, run_dir, progress=False)
            finally:
                parts.backend.close()
            for r in rows:
                out.append({"backend": backend, "spec": spec} | {k: r.get(k) for k in keep})
                print(
                    f"RL step {r['step']} {backend:>6} {spec:>5}: gen {r['gen_time_s']:.2f}s "
                    f"train {r['train_time_s']:.2f}s step {r['step_time_s']:.2f}s",
                    flush=True,
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    ap.add_argument("--eagle3-head", type=Path, default=None, help="specrl eagle3-layout head")
    ap.add_argument("--rl-steps", type=int, default=2, help="RL steps per backend (0 = none)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if "eagle3" in args.methods.split(",") and args.eagle3_head is None:
        raise SystemExit("--methods eagle3 needs --eagle3-head DIR (a trained eagle3-layout head)")

    from specrl.backends.native import NativeBackend
    from specrl.backends.vllm import VllmBackend
    from specrl.bench import (
        check_writable,
        measure_machine,
        roofline_tokens_per_s,
        run_metadata,
        write_result,
    )
    from specrl.engine.engine import Engine
    from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model
    from specrl.spec.config import SpecConfig

    problem = check_writable(args.out)
    if problem:
        raise SystemExit(problem)
    dtype = DTYPES[args.dtype]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    model_dir = resolve_model("smollm2-135m-instruct")
    tok = load_tokenizer(model_dir)
    target = load_model(model_dir, dtype=dtype)
    load = os.getloadavg()
    machine = measure_machine(dtype)
    print(f"machine: copy {machine['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s, "
          f"GEMM {machine['gemm_flops'] / 1e12:.2f} TFLOP/s ({args.dtype}); "
          f"load average before {load[0]:.2f}")  # fmt: skip
    rows = []
    tmp = tempfile.TemporaryDirectory(prefix="specrl-draft-")
    for method in methods:
        spec = SpecConfig(method, args.k if method != "none" else 0)
        draft_dir = None
        draft = None
        if method == "draft":
            draft_dir = save_draft(target, model_dir, args.draft_layers, Path(tmp.name))
            draft = load_model(draft_dir, dtype=dtype)
        native_spec = spec
        if method == "eagle3":
            from specrl.drafters.export import export_eagle3
            from specrl.spec.config import drafter_spec

            native_spec, _ = drafter_spec(method, args.k, str(args.eagle3_head), target, tok)
            draft_dir = export_eagle3(args.eagle3_head, target, Path(tmp.name) / "eagle3")
        t0 = time.perf_counter()
        vllm = VllmBackend(model_dir, dtype=dtype, spec=spec, drafter_dir=draft_dir,
                           max_batch=max(batches))  # fmt: skip
        print(f"[{method}] vLLM engine built in {time.perf_counter() - t0:.1f}s", flush=True)
        native = NativeBackend(Engine(target, max_batch=max(batches), spec=native_spec,
                                      draft_model=draft))  # fmt: skip
        for batch in batches:
            reqs = requests(tok, batch, args.new_tokens, seed=1000 * batch)
            context = len(reqs[0].prompt_ids) + args.new_tokens // 2
            roof = roofline_tokens_per_s(target.config, batch, dtype, context,
                                         machine["copy_bandwidth_bytes_s"],
                                         machine["gemm_flops"])  # fmt: skip
            for name, backend in (("native", native), ("vllm", vllm)):
                r = timed(backend, reqs, backend.spec, args.repeats, args.warmup)
                row = {"backend": name, "spec": method, "num_spec_tokens": spec.k,
                       "batch_size": batch, "group_size": min(8, batch),
                       "new_tokens": args.new_tokens, "dtype": args.dtype, **r,
                       "measured_roofline_tokens_per_s": roof,
                       "fraction_of_measured_roofline": r["tokens_per_s"] / roof}  # fmt: skip
                rows.append(row)
                print(f"batch {batch:>3} {name:>6} {method:>6}: {r['tokens_per_s']:8.1f} tok/s  "
                      f"accept {r['draft_acceptance_length']:.2f}  "
                      f"({row['fraction_of_measured_roofline']:.0%} of roofline {roof:.0f})",
                      flush=True)  # fmt: skip
        vllm.close()
        native.close()
    tmp.cleanup()
    ratios = []
    for r in rows:
        same = {(o["backend"], o["spec"]): o for o in rows if o["batch_size"] == r["batch_size"]}
        if r["backend"] == "vllm" and ("native", r["spec"]) in same:
            base = same[("native", r["spec"])]
            ratios.append({"batch_size": r["batch_size"], "name": f"vllm/{r['spec']}",
                           "baseline": f"native/{r['spec']}",
                           "ratio": r["tokens_per_s"] / base["tokens_per_s"]})  # fmt: skip
        if r["spec"] != "none" and (r["backend"], "none") in same:
            base = same[(r["backend"], "none")]
            ratios.append({"batch_size": r["batch_size"], "name": f"{r['backend']}/{r['spec']}",
                           "baseline": f"{r['backend']}/none",
                           "ratio": r["tokens_per_s"] / base["tokens_per_s"]})  # fmt: skip
    for q in ratios:
        print(
            f"batch {q['batch_size']:>3}: {q['name']:>14} / {q['baseline']:<12} {q['ratio']:.2f}x"
        )
    steps = rl_steps(args.rl_steps, args.dtype) if args.rl_steps else []
    meta = run_metadata() | {
        "machine_measured": machine,
        "load_average_before": load,
        "load_average_after": os.getloadavg(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    write_result({"meta": meta, "results": rows, "ratios": ratios, "rl_steps": steps}, args.out)


if __name__ == "__main__":
    main()
