"""Held-out acceptance length of every drafter side by side (k=3, T=0 and T=1), with the ceiling.

Acceptance length is EAGLE's tau: tokens emitted per decode/verify step per row (the prefill's
token not counted). The ``self`` drafter (the target drafting for itself, q == p) accepts every
draft, so its row is the ceiling the task's completion lengths allow: short completions end
inside a verify step. T=1 takes ``--samples`` completions per prompt. Prompts are the task's eval
split (disjoint from the train split the drafters were trained on). Learned drafters default to
the cached ones of ``specrl train-drafter`` (``cache_dir()/drafters/<model>-<kind>``); a missing
one is skipped. Extra heads or draft models can be compared with ``--extra NAME=KIND:DIR``
(KIND: eagle3, mtp or draft). With ``--siblings S`` every learned (stochastic) drafter also gets
a row ``NAME+sS`` that adds S first-token candidates per step (``SpecConfig.siblings``: a draft
tree of k + S nodes, still verified losslessly). T=1 rows repeat the sampling for every seed of
``--seeds`` and report the mean over seeds (``per_seed`` holds each): one seed of 48 x 4
completions moves by several hundredths.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/drafter_acceptance.py --threads 1

Writes benchmarks/results/drafter_acceptance.json (with ``specrl.bench.run_metadata()``).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

from specrl.bench import run_metadata, write_result
from specrl.drafters.data import task_prompt_ids
from specrl.engine import Engine
from specrl.models.checkpoints import load_model, load_tokenizer
from specrl.paths import drafter_cache_dir
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig

MODEL = "smollm2-135m-instruct"
OUT = Path(__file__).parent / "results" / "drafter_acceptance.json"


def drafters(args) -> dict[str, tuple[str, str | None]]:
    """name -> (spec method, drafter dir or None) for every drafter that is available."""
    out: dict[str, tuple[str, str | None]] = {"self": ("self", None), "ngram": ("ngram", None),
                                              "suffix": ("suffix", None)}  # fmt: skip
    for kind in ("eagle3", "mtp", "draft"):
        path = drafter_cache_dir(MODEL, kind)
        marker = "config.json" if kind == "draft" else "head.json"
        if (path / marker).exists():
            out[kind] = (kind, str(path))
        else:
            print(f"skipping {kind}: nothing at {path}", file=sys.stderr)
    for item in args.extra:
        name, _, rest = item.partition("=")
        kind, _, path = rest.partition(":")
        out[name] = (kind, path)
    return out


LEARNED = ("eagle3", "mtp", "draft")  # stochastic drafters: the ones siblings apply to


def engine_for(
    target, method: str, path: str | None, k: int, max_batch: int, siblings: int = 0
) -> Engine:
    if method == "draft":
        draft = load_model(path, dtype=target.embed.weight.dtype)
        spec = SpecConfig("draft", k, siblings=siblings)
        return Engine(target, max_batch=max_batch, spec=spec, draft_model=draft)
    options = {"drafter_path": path} if path else {}
    spec = SpecConfig(method, k, options=options, siblings=siblings)
    return Engine(target, max_batch=max_batch, spec=spec)


def measure(engine: Engine, prompts, params: SamplingParams) -> dict:
    out = engine.generate([Request(p, params) for p in prompts])
    st = engine.stats
    return {
        "acceptance_length": round(st.acceptance_length, 3),
        "per_position_acceptance": [round(x, 3) for x in st.per_position_acceptance],
        "mean_completion_tokens": round(sum(len(c.token_ids) for c in out) / len(out), 2),
    }


def temperature_rows(make_engine, prompts, args, stops: tuple[int, ...], label: dict) -> list[dict]:
    """``label`` + a T=0 row (one completion per prompt) and a T=1 row (``args.samples`` each,
    for every seed of ``args.seeds``, default 0: the mean over seeds, each in ``per_seed``),
    each measured on a fresh engine from ``make_engine()`` (fresh drafter state)."""
    rows = []
    for t in (0.0, 1.0):
        seeds = getattr(args, "seeds", [0]) if t > 0 else [0]
        runs = [measure(make_engine(), prompts, SamplingParams(
            temperature=t, max_new_tokens=args.max_new_tokens, seed=seed,
            n=args.samples if t > 0 else 1, stop_token_ids=stops)) for seed in seeds]  # fmt: skip
        row = label | {"temperature": t} | mean_runs(runs)
        print(row, flush=True)
        rows.append(row)
    return rows


def mean_runs(runs: list[dict]) -> dict:
    """One run as is; several: each key's mean (element-wise for lists) and ``per_seed``."""
    if len(runs) == 1:
        return runs[0]
    mean = {k: round(sum(r[k] for r in runs) / len(runs), 3)
            for k in ("acceptance_length", "mean_completion_tokens")}  # fmt: skip
    per_pos = zip(*(r["per_position_acceptance"] for r in runs), strict=False)
    mean["per_position_acceptance"] = [round(sum(x) / len(x), 3) for x in per_pos]
    return mean | {"per_seed": [r["acceptance_length"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt at T=1")
    ap.add_argument("--extra", action="append", default=[], help="NAME=KIND:DIR (repeatable)")
    ap.add_argument(
        "--siblings",
        type=int,
        default=3,
        help="also run learned drafters with this many first-token siblings (0: no)",
    )
    ap.add_argument("--seeds", default="0", help="comma list of T=1 sampling seeds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    torch.set_num_threads(args.threads)
    target = load_model(MODEL, dtype=torch.bfloat16)
    tok = load_tokenizer(MODEL)
    prompts = task_prompt_ids(tok, args.task, "eval", args.eval_prompts, seed=0)
    stops = tuple(tok.stop_token_ids)
    rows = []
    for name, (method, path) in drafters(args).items():
        variants = [0] + ([args.siblings] if args.siblings and method in LEARNED else [])
        for sib in variants:
            make = partial(engine_for, target, method, path, args.k, 16, sib)
            label = {"drafter": name + (f"+s{sib}" if sib else ""), "path": path, "siblings": sib}
            rows += temperature_rows(make, prompts, args, stops, label)
    meta = run_metadata("benchmarks/drafter_acceptance.py " + " ".join(sys.argv[1:]))
    write_result({"meta": meta, "args": vars(args) | {"out": str(args.out)}, "rows": rows},
                 args.out)  # fmt: skip


if __name__ == "__main__":
    main()
