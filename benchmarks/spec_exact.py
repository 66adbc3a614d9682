"""Sample-exact speculation (``--spec-exact sample``) vs the standard rule, per drafter.

On SmolLM2-135M with GRPO-like groups (T=1, no truncation, and T=0.8/top-k 50/top-p 0.95), each
drafter runs the same seeded requests under both verification rules, next to plain decoding:
acceptance length and how many completions equal plain sampling's token for token
(sample-exact: all of them where the verify forward's logits equal the decode forward's, as in
float32; the standard rule: none but by chance). Learned heads (eagle3, mtp) are the ones
``specrl train-drafter`` cached, skipped (and said so) when there is none; ``draft`` is the
target's first layers. Each engine's second call is measured; the first, with the same seeds, is
the suffix drafter's earlier epoch: under the sample rule it holds exactly the tokens the second
call draws, so suffix's sample-rule acceptance is that best case, not an RL number (RL steps
draw fresh seeds). Acceptance, not speed: nothing is timed (the rule changes which drafts are
accepted, not what a step costs), so it may run beside other work.

    .venv/bin/python benchmarks/spec_exact.py --out benchmarks/results/spec_exact.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from specrl.bench import BENCH_QUESTIONS, default_drafter_path, run_metadata, write_result
from specrl.engine import Engine
from specrl.models.checkpoints import load_model, load_tokenizer
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig, drafter_spec
from specrl.spec.proposers import proposer_takes

MODEL = "smollm2-135m-instruct"
SETTINGS = {"T1": dict(temperature=1.0),
            "T0.8-topk50-topp0.95": dict(temperature=0.8, top_k=50, top_p=0.95)}  # fmt: skip


def requests(tok, args, settings: dict) -> list[Request]:
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.group_size, seed=11,
                            stop_token_ids=tok.stop_token_ids, **settings)  # fmt: skip
    return [Request(tok.encode_chat(q), params) for q in BENCH_QUESTIONS[: args.prompts]]


def second_call(engine: Engine, reqs: list[Request]) -> list:
    """The second of two calls: the first is one earlier epoch for the suffix drafter."""
    engine.generate(reqs)
    return engine.generate(reqs)


def drafter(method: str, args, model, tok) -> tuple[SpecConfig, torch.nn.Module | None] | None:
    if proposer_takes(method, "drafter_path"):
        path = default_drafter_path(MODEL, method)
        if path is None:
            return None
    else:
        path = args.draft if method == "draft" else None
    return drafter_spec(method, args.k, path, model, tok)


def row(engine: Engine, out: list, plain: list) -> dict:
    same = sum(a.token_ids == b.token_ids for a, b in zip(out, plain, strict=True))
    st = engine.stats
    return {"acceptance_length": st.acceptance_length, "drafted": st.drafted,
            "accepted": st.accepted, "tokens": sum(len(c.token_ids) for c in out),
            "identical_to_plain": same, "completions": len(out)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ngram,suffix,draft,eagle3,mtp")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft", default="prefix:10", help="the draft model of method 'draft'")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(MODEL, dtype=getattr(torch, args.dtype))
    tok = load_tokenizer(MODEL)
    batch = args.prompts * args.group_size
    results: dict = {"config": vars(args) | {"out": str(args.out)}, "skipped": {}}
    for name, settings in SETTINGS.items():
        reqs = requests(tok, args, settings)
        plain_engine = Engine(model, max_batch=batch)
        plain = second_call(plain_engine, reqs)
        res = {"plain": row(plain_engine, plain, plain)}
        for method in args.methods.split(","):
            built = drafter(method, args, model, tok)
            if built is None:
                results["skipped"][method] = "no trained head cached (specrl train-drafter)"
                continue
            spec, draft = built
            for rule in ("distribution", "sample"):
                engine = Engine(model, max_batch=batch, draft_model=draft,
                                spec=dataclasses.replace(spec, exact=rule))  # fmt: skip
                res[f"{method}/{rule}"] = row(engine, second_call(engine, reqs), plain)
                print(name, method, rule, res[f"{method}/{rule}"], flush=True)
            d, s = res[f"{method}/distribution"], res[f"{method}/sample"]
            res[f"{method}/sample_over_distribution"] = (
                s["acceptance_length"] / d["acceptance_length"]
            )
        results[name] = res
    out = run_metadata() | results
    if args.out is not None:
        write_result(out, args.out)


if __name__ == "__main__":
    main()
