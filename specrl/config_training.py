"""The training sections of a run's ``Config``: the policy learner's and the drafter's.

Contract: ``LearnerCfg`` (policy loss, advantages, optimizer, precision) and ``DrafterCfg``
(training a learned drafter during RL) are ``specrl.settings`` sections that ``specrl.config``
puts under ``learner`` and ``drafter``; import them from there. A leaf: it imports only
``specrl.settings``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictFloat, field_validator

from specrl.settings import Section


class LearnerCfg(Section):
    """Policy loss, advantages and optimizer."""

    loss: str = Field("grpo", description="Registered policy loss (grpo, dr_grpo, dapo).")
    advantage: str = Field(
        "grpo", description="Registered advantage estimator (grpo, dr_grpo, rloo)."
    )
    normalize_std: bool = Field(True, description="grpo advantages: divide by the group std.")
    lr: float = Field(2e-5, gt=0.0, le=1.0, description="AdamW learning rate.")
    betas: tuple[StrictFloat, StrictFloat] = Field(
        (0.9, 0.99), strict=False, description="AdamW betas, each in [0, 1)."
    )  # strict=False: TOML gives a list; each element stays a strict number
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient-norm clipping threshold.")
    micro_batch_tokens: int = Field(
        2048,
        ge=16,
        le=10_000_000,
        description="Token budget per micro-batch (gradient accumulation).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="k3 KL-to-reference coefficient (0 = off).")
    share_prompts: bool = Field(
        True,
        description="Pack a GRPO group's completions after one copy of their prompt (the "
        "prompt runs once per micro-batch, not once per sample; same logprobs and gradients).",
    )
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="Lower ratio clip epsilon.")
    clip_eps_high: float | None = Field(
        None, gt=0.0, description="Upper clip epsilon; None = the loss's default."
    )
    dtype: Literal["fp32", "bf16", "auto"] = Field(
        "auto",
        description="Trainer precision: bf16 autocast with fp32 master weights, or fp32; "
        "'auto': bf16 where the CPU multiplies bf16 natively, else fp32.",
    )
    logprob_chunk: int = Field(
        256, ge=1, le=1_000_000, description="Positions per LM-head/log-softmax chunk."
    )
    correction: str = Field(
        "ppo",
        description="Off-policy correction (registered): 'ppo' clips the ratio to the "
        "behaviour logprobs the engine returned; 'tis' (decoupled PPO) clips against the "
        "learner's own pre-update logprobs and weights each token by the truncated importance "
        "ratio min(pi_learner / pi_behaviour, is_cap).",
    )
    is_cap: float = Field(
        2.0, gt=0.0, le=1000.0, description="'tis': cap of the per-token importance weight."
    )
    bf16_mode: Literal["autocast", "params"] = Field(
        "autocast",
        description="How dtype='bf16' trains (refused as 'params' when the precision is fp32): "
        "'autocast' keeps float32 parameters and runs the trunk under bf16 autocast; 'params' "
        "holds the model's parameters in bf16 for forward and backward plus a float32 master "
        "copy of each that AdamW updates (the bf16 weights are refreshed from it after every "
        "step and are what the rollout engine receives; checkpoints keep the masters).",
    )
    head_precision: Literal["auto", "fp32"] = Field(
        "auto",
        description="LM head product of the learner's logprobs (always float32 logits and "
        "log-softmax): 'auto' takes bf16 inputs with float32 accumulation on a CUDA device in "
        "bf16 (a float32 product over a large vocabulary costs more than the bf16 trunk), "
        "float32 elsewhere; 'fp32' always multiplies in float32.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder block in backward instead of keeping its "
        "activations: less activation memory (longer rows, bigger micro-batches) for about "
        "one more forward pass of compute per step.",
    )
    routing_replay: bool = Field(
        False,
        description="Mixture-of-experts policies (native backend): the learner's forward "
        "routes every token to the experts the rollout engine routed it to (the router still "
        "weighs them), so engine and learner differ by precision only, not by expert choice "
        "(rollout routing replay). Costs one extra no-grad forward per step: the engine/learner "
        "logprob mismatch is reported with and without it. A dense policy refuses it.",
    )
    moe_aux_loss_coef: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="Mixture-of-experts policies: weight of the load-balancing loss (E * sum "
        "of token share x mean router probability per expert, averaged over MoE layers) added "
        "to the policy loss; 0 = off, as RL usually keeps it. A dense policy refuses > 0.",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class DrafterCfg(Section):
    """Training a learned drafter (rollout.spec = eagle3, mtp or draft) during RL."""

    mode: Literal["auto", "frozen", "online", "refresh"] = Field(
        "auto",
        description="'frozen': the drafter is never trained during RL; 'online': trained on every "
        "step's rollouts (the learner's training forward provides the target's features), "
        "within drafter.time_share of the step time; 'refresh': trained only when measured "
        "drift asks for it (the drafter's KL to the policy on the step's fresh tokens above its "
        "best level, draft acceptance below its running level, or drafter.max_lag policy "
        "versions since the last training), with the same time budget. 'auto': 'refresh' for a "
        "learned drafter (eagle3, mtp, draft), nothing for the others. Without trained weights "
        "(none cached, no rollout.drafter_path) 'online' and 'refresh' start from a random head "
        "(a draft model: the policy's first layers) and train it from the first step; 'frozen' "
        "then refuses to run.",
    )
    time_share: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="Most drafter training time as a share of the step time, on average "
        "(unused time carries over for refresh bursts, up to 4 steps' worth).",
    )
    lr: float = Field(5e-4, gt=0.0, le=1.0, description="AdamW learning rate of the drafter.")
    batch_tokens: int = Field(
        1024, ge=16, le=1_000_000, description="Tokens per drafter training mini-batch."
    )
    buffer_steps: int = Field(
        4, ge=1, le=1024, description="Rollouts of the last N RL steps are the training data."
    )
    max_updates: int = Field(
        16, ge=1, le=10_000, description="Most head optimizer steps per RL step."
    )
    drift_tolerance: float = Field(
        0.1,
        gt=0.0,
        le=10.0,
        description="refresh: train when the head's KL on fresh tokens exceeds (1 + this) x "
        "its best level, or draft acceptance falls below (1 - this) x its running level.",
    )
    max_lag: int = Field(
        8, ge=1, le=1_000_000, description="refresh: train at least every N policy versions."
    )
    vocab: int = Field(
        4096,
        ge=0,
        le=1_000_000,
        description="Draft vocabulary of a head started from scratch: the N most frequent "
        "tokens of the first step's rollouts (0 = the full vocabulary).",
    )
