"""The check's ``grpo`` section: colocated GRPO steps, plain against speculative rollouts.

Contract: ``grpo_section(device, s, clock, deadline, accept, k, attention)`` builds a run
(``build_run`` on the device: the learner and the rollout engine's own bf16 copy on one GPU) of
a random model of ``s.grpo_model``'s shapes on a synthetic task (random prompt ids, reward = the
share of completion ids divisible by 4; no reasoning-gym), with an EAGLE-3 head trained online
from scratch and sample-exact verification. Every step rolls the same prompts out three times
with the same request seeds (identical tokens, checked, so the learner step is the same): plain;
with an oracle drafter (``oracle``) at per-token acceptance ``accept``, k up to ``k``; and with
the run's head. A warm-up step, then up to ``s.grpo_steps`` timed steps until ``deadline``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from specrl.gpubench.common import Clock, random_model
from specrl.gpubench.oracle import oracle_rollout, plain_rollout
from specrl.gpubench.sizes import Sizes

if TYPE_CHECKING:
    from specrl.engine import Engine
    from specrl.pipelines.build import RunParts
    from specrl.pipelines.state import TrainStream

MODEL_NAME = "gpu-check-random"  # the run's model.name (its weights are random_model's)


def grpo_overrides(device: torch.device, s: Sizes) -> list[str]:
    """The run config: a head trained online from scratch, sample-exact verification."""
    return [
        f"model.name={MODEL_NAME}",
        f"model.device={device}",
        "rollout.spec=eagle3",
        "rollout.spec_exact=sample",
        "drafter.mode=online",
        f"rollout.group_size={s.group}",
        f"rollout.prompts_per_step={s.prompts}",
        f"rollout.max_new_tokens={s.new_tokens}",
        f"rollout.max_batch={s.prompts * s.group}",
        "rollout.placement=inline",
        f"learner.micro_batch_tokens={4 * s.group * (s.grpo_prompt + s.new_tokens)}",
        "run.eval_every=0",
        "run.checkpoint_every=0",
        f"run.steps={s.grpo_steps + 1}",
    ]


def build_grpo_run(device: torch.device, s: Sizes) -> RunParts:
    """``build_run`` with the synthetic env and codec (handed an env, it does not check the
    ``env`` section against reasoning-gym, which the GPU machine lacks)."""
    from specrl.config import load_config
    from specrl.envs.synthetic import IdCodec, ModFourEnv
    from specrl.pipelines.build import build_run

    cfg = load_config(None, grpo_overrides(device, s))
    length = (s.grpo_prompt, s.grpo_prompt + 1)  # every prompt s.grpo_prompt ids long
    train = s.prompts * (s.grpo_steps + 1)
    env = ModFourEnv(train, 0, vocab=s.grpo_model.vocab_size, lengths=length)
    model = random_model(s.grpo_model, device)
    return build_run(cfg, model=model, codec=IdCodec(), env=env)


def grpo_step(
    parts: RunParts, stream: TrainStream, oracle: Engine, step: int, accept: float, k: int
) -> dict:
    """One step's three rollouts of the same prompts (plain, oracle, the run's head) and the
    learner step on the head's rollout (the same tokens under sample-exact verification)."""
    from specrl.pipelines.state import StepState
    from specrl.pipelines.step import collect, learn

    prompts = stream.draw(step)  # outside every timed window
    plain_s, out = plain_rollout(parts, prompts, step)
    plain = out.completions
    oracle_s, oracle_acc, oracle_same = oracle_rollout(
        parts, oracle, prompts, step, plain, k, accept
    )
    t0 = time.perf_counter()
    batch = collect(parts, prompts, step)
    head_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    row = learn(parts, StepState(step, step), batch, head_s)  # a fresh run: version = step
    learn_all_s = time.perf_counter() - t1
    drafter_s = row.get("drafter_train_s", 0.0) + row.get("drafter_sync_s", 0.0)
    learn_s = learn_all_s - drafter_s  # the policy's learner step and weight push
    m = batch.metrics
    return {
        "step": step,
        "plain_gen_s": plain_s,
        "oracle_gen_s": oracle_s,
        "head_gen_s": head_s,
        "learn_s": learn_s,
        "drafter_train_s": drafter_s,
        "plain_step_s": plain_s + learn_s,
        "oracle_step_s": oracle_s + learn_s,
        "head_step_s": head_s + learn_all_s,
        "gen_share_of_plain_step": plain_s / (plain_s + learn_s),
        "oracle_acceptance_length": oracle_acc,
        "oracle_same_tokens": oracle_same,
        "head_acceptance_length": m["acceptance_length"],
        "head_draft_acceptance_length": m["draft_acceptance_length"],
        "head_spec_step_share": m["spec_step_share"],
        "head_same_tokens": [c.token_ids for c in plain]
        == [c.token_ids for c in batch.completions],
        "gen_tokens": m["gen_tokens"],
        "reward_mean": m["reward_mean"],
        "learner_tokens_per_s": row.get("learner_tokens_per_s"),
        "learner_mfu": row.get("learner_mfu"),
    }


def summarize_grpo(rows: list[dict]) -> dict:
    """The timed steps together: generation's share of the plain step, speedups, acceptance."""
    total = lambda key: sum(r[key] for r in rows)  # noqa: E731
    plain, learn_s = total("plain_gen_s"), total("learn_s")
    return {
        "generation_share": plain / (plain + learn_s),
        "plain_step_s": total("plain_step_s") / len(rows),
        "oracle_step_s": total("oracle_step_s") / len(rows),
        "head_step_s": total("head_step_s") / len(rows),
        "oracle_step_speedup": total("plain_step_s") / total("oracle_step_s"),
        "head_step_speedup": total("plain_step_s") / total("head_step_s"),
        "oracle_rollout_speedup": plain / total("oracle_gen_s"),
        "head_rollout_speedup": plain / total("head_gen_s"),
        "oracle_acceptance_length": statistics.fmean(r["oracle_acceptance_length"] for r in rows),
        "head_draft_acceptance_length": statistics.fmean(
            r["head_draft_acceptance_length"] for r in rows
        ),
        "same_tokens": all(r["oracle_same_tokens"] and r["head_same_tokens"] for r in rows),
    }


def grpo_section(
    device: torch.device,
    s: Sizes,
    clock: Clock,
    deadline: float,
    accept: float,
    k: int,
    attention: str = "auto",
) -> dict:
    """The section (module docstring); the learner's packed attention is ``attention``
    ('dense' where flex attention failed in the learner section)."""
    from specrl.engine import Engine
    from specrl.pipelines.state import TrainStream

    parts = build_grpo_run(device, s)
    parts.learner.model.packed_attention = attention
    cfg = parts.cfg
    fraction = cfg.model.gpu_memory_utilization if device.type == "cuda" else None
    oracle = Engine(parts.backend.engine.model, max_batch=cfg.rollout.max_batch,
                    seed=cfg.run.seed, memory_fraction=fraction)  # fmt: skip
    rows, stream = [], TrainStream.of(parts.plan, parts.env)
    for step in range(s.grpo_steps + 1):
        if step > 1 and time.perf_counter() > deadline:
            break
        rows.append(grpo_step(parts, stream, oracle, step, accept, k))
        r = rows[-1]
        clock.log(
            f"grpo step {step}: gen plain {r['plain_gen_s']:.2f}s oracle "
            f"{r['oracle_gen_s']:.2f}s head {r['head_gen_s']:.2f}s learn {r['learn_s']:.2f}s"
        )
    measured = rows[1:] or rows
    return {
        "model": asdict(s.grpo_model),
        "prompts_per_step": s.prompts,
        "group_size": s.group,
        "prompt_tokens": s.grpo_prompt,
        "max_new_tokens": s.new_tokens,
        "oracle_accept": accept,
        "oracle_max_k": k,
        "learner_attention": attention,
        "warmup_steps": len(rows) - len(measured),
        "summary": summarize_grpo(measured),
        "steps": rows,
    }
