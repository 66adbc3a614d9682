"""Probe which reasoning-gym tasks SmolLM2-135M-Instruct solves sometimes (sampled accuracy).

Generates with transformers (bf16, batched; --temperature, default 1; 0 = greedy) from the bundled
model, on the first ``--n`` prompts of the env's train split, and scores with
``specrl.envs.ReasoningGymEnv``; prints one JSON row per (task, config, template) and writes JSON.
Results and the choice they led to: docs/task_choice.md.

    .venv/bin/python benchmarks/task_probe.py --n 128 --max-new-tokens 48 [--only 0|TASK]
    .venv/bin/python benchmarks/task_probe.py --grpo-steps 12     # does GRPO raise the reward?
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specrl.bench import run_metadata
from specrl.envs import ReasoningGymEnv
from specrl.models.checkpoints import load_tokenizer, resolve_model

ADD_SUB = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"],
               allow_parentheses=False, allow_negation=False)  # fmt: skip
CANDIDATES: list[tuple[str, dict, str]] = [
    ("basic_arithmetic", ADD_SUB, "answer_only"),
    ("basic_arithmetic", ADD_SUB | {"operators": ["+"]}, "answer_only"),
    ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1), "answer_only"),
    ("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1), "answer_only"),
    ("basic_arithmetic", ADD_SUB, "answer_line"),
    ("basic_arithmetic", ADD_SUB, "answer_tag"),
    ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1), "answer_only"),
    ("leg_counting", dict(min_animals=1, max_animals=1, max_instances=2), "answer_only"),
    # first round (all near 0%)
    ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1), "answer_line"),
    ("leg_counting", dict(min_animals=1, max_animals=2, max_instances=3), "answer_only"),
    ("spell_backward", dict(min_word_len=3, max_word_len=4), "answer_only"),
    ("letter_counting", dict(min_words=2, max_words=4), "answer_only"),
    ("word_sequence_reversal", dict(min_words=2, max_words=3), "answer_only"),
    (
        "number_sorting",
        dict(min_numbers=3, max_numbers=3, min_decimals=0, max_decimals=0),
        "answer_only",
    ),  # fmt: skip
]


def generate(model, tok, prompts, max_new: int, seed: int, temperature: float) -> list[str]:
    ids = [tok.encode(tok.chat_prompt(list(p.messages))) for p in prompts]
    width = max(map(len, ids))
    pad = tok.stop_token_ids[0]
    batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=batch,
        attention_mask=mask,
        do_sample=temperature > 0,
        temperature=temperature or None,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        eos_token_id=list(tok.stop_token_ids),
        pad_token_id=pad,
    )
    return [tok.decode(row[width:].tolist()) for row in out]


def grpo_probe(steps: int, lr: float) -> None:
    """A bare GRPO loop on the default config (plain decoding with specrl.engine, bf16 engine copy,
    learner in bf16 autocast): does reward rise on the default task? Not the pipeline."""
    import copy

    from specrl.config import Config
    from specrl.engine.engine import Engine
    from specrl.models.checkpoints import load_model
    from specrl.rl import Learner, TrainSample, compute_advantages
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams

    cfg, tok = Config(), load_tokenizer("smollm2")
    env, policy = ReasoningGymEnv.from_config(cfg.env), load_model(dtype=torch.float32)
    engine_model = copy.deepcopy(policy).to(torch.bfloat16)
    learner = Learner(policy, cfg.learner.model_copy(update={"lr": lr}))
    engine, order = Engine(engine_model, max_batch=64), env.prompts("train", seed=0)
    p, g = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    for step in range(steps):
        t0, prompts = time.perf_counter(), order[step * p : (step + 1) * p]
        reqs = [Request(tok.encode(tok.chat_prompt(list(x.messages))), SamplingParams(
            temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens, n=g, seed=1000 * step + i,
            stop_token_ids=tok.stop_token_ids)) for i, x in enumerate(prompts)]  # fmt: skip
        comps = engine.generate(reqs)
        gen_s = time.perf_counter() - t0
        texts = [tok.decode(c.token_ids) for c in comps]
        metas = [prompts[c.request_index].meta for c in comps]
        rewards = torch.tensor([env.reward(t, m) for t, m in zip(texts, metas, strict=True)])
        adv = compute_advantages("grpo", rewards.view(p, g)).flatten().tolist()
        m = learner.train_step(
            [TrainSample(c.prompt_ids, c.token_ids, a) for c, a in zip(comps, adv, strict=True)]
        ).metrics
        with torch.no_grad():  # refit
            for dst, src in zip(engine_model.parameters(), policy.parameters(), strict=True):
                dst.copy_(src)
        row = dict(step=step, reward_mean=round(rewards.mean().item(), 3), gen_s=round(gen_s, 1),
                   gen_tokens=sum(len(c.token_ids) for c in comps), train_s=round(m["time_s"], 1),
                   grad_norm=round(m["grad_norm"], 3))  # fmt: skip
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--only", default=None, help="task name, or index into CANDIDATES")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="task_probe.json")
    ap.add_argument("--show", type=int, default=1)
    ap.add_argument("--grpo-steps", type=int, default=0, help="run the GRPO probe instead")
    ap.add_argument("--lr", type=float, default=2e-5)
    args = ap.parse_args()
    if args.grpo_steps:
        torch.set_num_threads(args.threads)
        return grpo_probe(args.grpo_steps, args.lr)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)  # 2 threads crawl when another process is busy
    path = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tok = load_tokenizer("smollm2")
    rows = []
    for i, (task, cfg, template) in enumerate(CANDIDATES):
        if args.only and args.only not in (task, str(i)):
            continue
        env = ReasoningGymEnv(task, cfg, num_train=args.n, num_eval=0, template=template, seed=0)
        prompts = env.prompts("train")
        t0 = time.perf_counter()
        texts = generate(model, tok, prompts, args.max_new_tokens, 0, args.temperature)
        scores = [env.score(t, p.meta) for t, p in zip(texts, prompts, strict=True)]
        acc = sum(s >= 1 for s in scores) / len(scores)
        fmt = sum(env.extract(t) is not None for t in texts) / len(texts)
        row = dict(
            task=task,
            config=cfg,
            template=template,
            temperature=args.temperature,
            n=len(texts),
            accuracy=acc,
            mean_score=sum(scores) / len(scores),
            format_rate=fmt,
            seconds=round(time.perf_counter() - t0, 1),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        for t in texts[: args.show]:
            print("   sample:", repr(t[:300]), flush=True)
    with open(args.out, "w") as f:
        json.dump({**run_metadata(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
