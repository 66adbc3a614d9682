"""The check's ``learner`` section: one GRPO learner step, specrl's against transformers'.

Contract: ``learner_section(device, s, clock, deadline)`` trains one batch of equal-length
sequences (``s.learner_*``; on-policy, GRPO advantages) on a random model of
``s.learner_model``'s shapes with specrl's ``Learner`` in bf16 ``autocast`` and ``params`` modes
and with transformers' ``LlamaForCausalLM`` (sdpa, float32 weights under bf16 autocast, fused
AdamW) doing the same step; each row guarded on its own. Reported per row: the median step's
tokens/s, model TFLOP/s and MFU (``specrl.models.flops``' convention); and specrl's best mode
over transformers.
"""

from __future__ import annotations

import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specrl.errors import one_line
from specrl.gpubench.common import (
    Clock,
    guarded,
    median_of,
    model_flops,
    peak_memory,
    random_model,
    ratio,
    reset_peak,
    timed,
)
from specrl.gpubench.sizes import Sizes
from specrl.models.device import autocast, peak_flops

CLIP = (0.8, 1.2)  # transformers' step: the policy-gradient ratio's clip range
COMPILE_FRAMES = ("torch/_dynamo", "torch/_inductor", "flex_attention")


@dataclass(frozen=True)
class LearnerBatch:
    """The GRPO batch both learners train on: equal-length sequences (no padding)."""

    prompts: list[list[int]]  # one per sequence (a group repeats its prompt)
    completions: list[list[int]]
    advantages: list[float]

    @property
    def tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in zip(self.prompts, self.completions, strict=True))

    @property
    def positions(self) -> int:
        return sum(len(c) for c in self.completions)


def learner_batch(s: Sizes, vocab: int, seed: int = 0) -> LearnerBatch:
    """Random prompts and completions, each group's advantages its rewards standardised."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    prompts, completions, advantages = [], [], []
    for _ in range(s.learner_groups):
        prompt, rewards = ids(s.learner_prompt), [rng.random() for _ in range(s.learner_group)]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards) or 1.0
        for r in rewards:
            prompts.append(prompt)
            completions.append(ids(s.learner_completion))
            advantages.append((r - mean) / std)
    return LearnerBatch(prompts, completions, advantages)


def from_compile(e: BaseException) -> bool:
    """Whether ``e`` comes out of torch.compile or flex attention (the failures that the dense
    mask avoids), not from the learner itself."""
    where = "".join(traceback.format_exception(e))
    return any(k in where for k in COMPILE_FRAMES)


def specrl_row(
    device: torch.device, s: Sizes, batch: LearnerBatch, mode: str, deadline: float
) -> dict:
    """specrl's ``Learner`` (bf16, ``mode``) on ``batch``: the median step's metrics. Where flex
    attention cannot compile, the row is measured again with the dense mask (said in the row)."""
    from specrl.config_training import LearnerCfg
    from specrl.rl import Learner, TrainSample

    samples = [
        TrainSample(p, c, a)
        for p, c, a in zip(batch.prompts, batch.completions, batch.advantages, strict=True)
    ]
    seq_len = s.learner_prompt + s.learner_completion
    model = random_model(s.learner_model, device)
    cfg = LearnerCfg(lr=1e-6, dtype="bf16", bf16_mode=mode, share_prompts=False,
                     micro_batch_tokens=s.micro_seqs * seq_len)  # fmt: skip
    learner = Learner(model, cfg, row_len=seq_len)
    row: dict[str, Any] = {"learner": "specrl", "bf16_mode": mode,
                           "attention": model.packed_attention}  # fmt: skip
    reset_peak(device)
    t0 = time.perf_counter()
    try:
        learner.train_step(samples)  # warm-up: compiles flex attention on CUDA
    except Exception as e:  # noqa: BLE001 (the dense mask is the fallback for flex only)
        if device.type != "cuda" or not from_compile(e):
            raise
        row |= {"attention": "dense", "flex_error": f"{type(e).__name__}: {one_line(e)}"}
        model.packed_attention = "dense"
        learner.train_step(samples)
    row["warmup_s"] = time.perf_counter() - t0
    steps = []
    while len(steps) < s.learner_repeats and (not steps or time.perf_counter() < deadline):
        steps.append(learner.train_step(samples).metrics)
    keys = ("time_s", "tokens_per_s", "model_tflops", "mfu", "forward_tokens")
    return (
        row
        | {k: median_of(steps, k) for k in keys}
        | {
            "timed_steps": len(steps),
            "loss": steps[-1]["loss"],
            "peak_memory_bytes": peak_memory(device),
        }  # fmt: skip
    )


def transformers_row(device: torch.device, s: Sizes, batch: LearnerBatch, deadline: float) -> dict:
    """transformers' ``LlamaForCausalLM`` (sdpa, float32 weights, bf16 autocast) doing the
    same step: a padded forward, float32 log-softmax at the completion positions, the clipped
    policy-gradient loss, backward, gradient clipping, AdamW; the median step's tokens/s,
    model TFLOP/s and MFU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**s.learner_model.to_hf_dict())
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )
    params = list(model.parameters())
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0, **fast)
    p, c = s.learner_prompt, s.learner_completion
    ids = torch.tensor(
        [q + r for q, r in zip(batch.prompts, batch.completions, strict=True)], device=device
    )  # [N, P + C]
    adv = torch.tensor(batch.advantages, device=device)  # [N]
    keep = torch.arange(p - 1, p + c - 1, device=device)  # the positions predicting completions

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for rows in torch.arange(len(ids), device=device).split(s.micro_seqs):
            with autocast(device, True):
                logits = model(input_ids=ids[rows], logits_to_keep=keep).logits  # [n, C, V]
            logprobs = torch.log_softmax(logits.float(), -1)
            lp = logprobs.gather(-1, ids[rows, p:, None]).squeeze(-1)  # [n, C]
            ratio_ = torch.exp(lp - lp.detach())
            a = adv[rows, None]  # [n, 1]
            loss = -torch.min(ratio_ * a, ratio_.clamp(*CLIP) * a).sum() / batch.positions
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    reset_peak(device)
    times = timed(step, device, s.learner_repeats, warmup=1, deadline=deadline)
    seconds, peak = statistics.median(times), peak_flops(device)
    flops = model_flops(s.learner_model, batch.tokens, batch.positions) / seconds
    return {
        "learner": "transformers",
        "attention": "sdpa",
        "time_s": seconds,
        "tokens_per_s": batch.tokens / seconds,
        "model_tflops": flops / 1e12,
        "mfu": ratio(flops, peak),
        "forward_tokens": batch.tokens,
        "timed_steps": len(times),
        "peak_memory_bytes": peak_memory(device),
    }


def learner_section(device: torch.device, s: Sizes, clock: Clock, deadline: float) -> dict:
    """Both specrl modes and transformers on the same batch; each row guarded on its own."""
    batch = learner_batch(s, s.learner_model.vocab_size)
    share = lambda n: time.perf_counter() + max(0.0, deadline - time.perf_counter()) / n  # noqa: E731
    rows = [
        guarded(clock, "learner specrl autocast",
                lambda: specrl_row(device, s, batch, "autocast", share(3))),
        guarded(clock, "learner specrl params",
                lambda: specrl_row(device, s, batch, "params", share(2))),
        guarded(clock, "learner transformers",
                lambda: transformers_row(device, s, batch, share(1))),
    ]  # fmt: skip
    ours = [r for r in rows if r.get("learner") == "specrl" and r.get("tokens_per_s")]
    best = max(ours, key=lambda r: r["tokens_per_s"], default={})
    theirs = next((r for r in rows if r.get("learner") == "transformers"), {})
    return {
        "model": asdict(s.learner_model),
        "sequences": len(batch.prompts),
        "prompt_tokens": s.learner_prompt,
        "completion_tokens": s.learner_completion,
        "micro_batch_sequences": s.micro_seqs,
        "rows": rows,
        "best_specrl_mode": best.get("bf16_mode"),
        "mfu": best.get("mfu"),
        "over_transformers": ratio(best.get("tokens_per_s"), theirs.get("tokens_per_s")),
    }
