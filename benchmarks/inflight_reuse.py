"""New weights in the middle of a batch: discard vs keep vs reverify, SmolLM2-135M, one run.

A batch of ``--batch`` sequences (``--group-size`` samples per chat prompt) generates
``--new-tokens`` tokens at ``--temperature`` 1 (no stop token, so every row runs to the end and
"halfway" is exact). When the rows hold half their tokens the weights change, between two
decode steps, to a perturbed copy (every weight + N(0, (noise * that tensor's std)^2), noise
from ``--noise``; 0 = the same weights, the ceiling of reuse). Per mode of ``Engine.stage_weights``:
- ``discard``: live rows restart from their prompts (prefill again, regenerate everything);
- ``keep``: nothing is redone (no extra cost), but the old tokens stay off-policy and the rows'
  KV caches stay those of the old weights;
- ``reverify``: the prompts are prefilled again and one forward over the rows' completions
  verifies their old tokens as a one-hot draft (exact for the new policy); the accepted prefix
  is kept, the rest regenerated;
``reverify_cap``: reverify checking only the first ``--reverify-cap`` old tokens of a row (a
smaller forward; each old token survives with probability p_new(token), so few long runs are
lost); and a run without an update (the floor). Reported: generate seconds (median of
``--repeats``), old tokens kept/thrown away, the share of stale tokens reverify keeps, and
reverify's time saved against discard and the ratio. Every mode starts from the same weights
and seeds, so the tokens before the switch are the same.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/inflight_reuse.py

``--dtype auto`` runs bf16 where oneDNN packs bf16 linears and fp32 elsewhere (on an AVX2-only
CPU bf16 matmuls are emulated, ~4x slower than fp32, and would stretch the run past 15 min).

Writes benchmarks/results/inflight_reuse.json (with ``specrl.bench.run_metadata()``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specrl.bench import bench_prompts, run_metadata, write_result
from specrl.engine import Engine
from specrl.models.checkpoints import load_model, load_tokenizer
from specrl.models.linear import onednn_packs
from specrl.models.weights import copy_weights, snapshot
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams

OUT = Path(__file__).parent / "results" / "inflight_reuse.json"
MODES = ("none", "discard", "keep", "reverify", "reverify_cap")  # none: no update (the floor)


class SwitchAt(Engine):
    """Stages ``update`` (named, version, mode) during decode step ``at`` of the next call: it
    applies before step ``at + 1``, when the rows hold ``at + 2`` tokens."""

    update: tuple | None = None
    at: int = -1

    def _step(self, rows, start):
        if self.update is not None and self.stats.steps == self.at:
            self.stage_weights(*self.update)
            self.update = None
        return super()._step(rows, start)


@torch.no_grad()
def perturbed(base: dict[str, torch.Tensor], noise: float, seed: int) -> dict[str, torch.Tensor]:
    """Each tensor + N(0, (noise * its std)^2), in its dtype (tied tensors stay shared)."""
    gen = torch.Generator().manual_seed(seed)
    out, seen = {}, {}
    for name, t in base.items():
        if id(t) not in seen:
            x = t.float()
            seen[id(t)] = (x + torch.randn(x.shape, generator=gen) * noise * x.std()).to(t.dtype)
        out[name] = seen[id(t)]
    return out


def run_once(engine: SwitchAt, base, new, mode: str, requests, cap: int) -> dict:
    """One generate call starting from ``base`` (version 0), switching to ``new`` (mode;
    ``reverify_cap``: reverify checking at most ``cap`` old tokens per row)."""
    copy_weights(engine.model, base)
    engine.policy_version = 0
    engine.update = None if mode == "none" else (new, 1, mode.removesuffix("_cap"))
    engine.reverify_max_tokens = cap if mode == "reverify_cap" else None
    t0 = time.perf_counter()
    out = engine.generate(requests)
    seconds = time.perf_counter() - t0
    st = engine.stats
    stale = sum(v == 0 for c in out for v in c.token_versions)
    return {
        "seconds": seconds,
        "tokens_generated": st.tokens,
        "completion_tokens": sum(len(c.token_ids) for c in out),
        "stale_tokens_in_completions": stale,
        "weight_updates": st.weight_updates,
        "reverified_tokens": st.reverified_tokens,
        "reused_tokens": st.reused_tokens,
        "discarded_tokens": st.discarded_tokens,
        "reverify_s": st.reverify_s,
        "prefill_s": st.prefill_s,
        "decode_s": st.decode_s,
    }


def summarize(runs: dict[str, list[dict]], rows: int, old_tokens: int) -> dict:
    """Median seconds per mode, reuse shares and reverify against discard (``rows`` live at the
    switch holding ``old_tokens`` in all)."""
    med = {m: statistics.median(r["seconds"] for r in rs) for m, rs in runs.items()}
    rv, cap = runs["reverify"][0], runs["reverify_cap"][0]
    return {
        "seconds": {m: round(s, 3) for m, s in med.items()},
        "old_tokens_at_switch": old_tokens,
        "reverify_kept_share": round(rv["reused_tokens"] / max(rv["reverified_tokens"], 1), 4),
        "reverify_kept_tokens_per_row": round(rv["reused_tokens"] / rows, 3),
        "reverify_forward_s": round(
            statistics.median(r["reverify_s"] for r in runs["reverify"]), 3
        ),
        "reverify_saved_s_vs_discard": round(med["discard"] - med["reverify"], 3),
        "discard_over_reverify": round(med["discard"] / med["reverify"], 3),
        "reverify_cap_kept_tokens_per_row": round(cap["reused_tokens"] / rows, 3),
        "reverify_cap_saved_s_vs_discard": round(med["discard"] - med["reverify_cap"], 3),
        "discard_over_reverify_cap": round(med["discard"] / med["reverify_cap"], 3),
        "reverify_over_keep": round(med["reverify"] / med["keep"], 3),
        "discard_extra_s_vs_none": round(med["discard"] - med["none"], 3),
        "reverify_extra_s_vs_none": round(med["reverify"] - med["none"], 3),
        "keep_stale_share_of_completion_tokens": round(
            runs["keep"][0]["stale_tokens_in_completions"] / runs["keep"][0]["completion_tokens"], 4
        ),
    }


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if onednn_packs(torch.bfloat16) else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--noise", default="1e-3,1e-2", help="relative weight perturbations")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--reverify-cap", type=int, default=8, help="reverify_cap: old tokens checked")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="auto: bf16 where oneDNN packs bf16 linears, else fp32 (an AVX2-only "
                    "CPU runs bf16 matmuls ~4x slower than fp32)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    model = load_model(dtype=dtype)
    prompts = bench_prompts(load_tokenizer(), args.batch, args.group_size)
    group = args.batch // len(prompts)
    params = SamplingParams(args.temperature, max_new_tokens=args.new_tokens, n=group, seed=0)
    requests = [Request(p, params.replace(seed=i)) for i, p in enumerate(prompts)]
    engine = SwitchAt(model, max_batch=args.batch)
    engine.at = args.new_tokens // 2 - 2  # rows hold new_tokens // 2 tokens at the switch
    base = snapshot(dict(model.named_parameters()), dtype)
    engine.generate(requests)  # warm-up (kernels, cache allocation)
    results = []
    for i, noise in enumerate(float(x) for x in args.noise.split(",")):
        new = perturbed(base, noise, seed=100 + i)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:  # interleaved, so machine load hits every mode alike
                runs[mode].append(run_once(engine, base, new, mode, requests, args.reverify_cap))
        summary = summarize(runs, args.batch, args.batch * (args.new_tokens // 2))
        print(f"noise {noise:g}: {summary}")
        results.append({"noise": noise, "summary": summary, "runs": runs})
    meta = run_metadata("benchmarks/inflight_reuse.py " + " ".join(sys.argv[1:]))
    args_out = vars(args) | {"out": str(args.out), "dtype_used": str(dtype).removeprefix("torch.")}
    write_result({"meta": meta, "args": args_out,
                  "results": results}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
