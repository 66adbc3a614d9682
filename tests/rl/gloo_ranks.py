"""What the sharded-learner tests share: spawning gloo ranks with a deadline, the tiny policy
they train, its batches, and full tensors of (sharded) state."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from specrl.models.config import tiny_config
from specrl.models.transformer import Transformer
from specrl.rl.learner import TrainSample

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(main: Callable, args: tuple, timeout_s: float, world: int = WORLD) -> None:
    """``main(rank, port, *args)`` in ``world`` spawned processes; the test fails (and they
    are killed) if they have not all finished within ``timeout_s``."""
    ctx = mp.spawn(main, args=(free_port(), *args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not finish within {timeout_s} s")


MOE = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16)  # fmt: skip


def tiny_policy(moe: bool = False) -> Transformer:
    """A tiny random decoder whose next-token distribution is near uniform (logprobs ~ -3.5);
    ``moe``: a mixture of experts (``MOE``) in every layer."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(**(MOE if moe else {}))).float()
    with torch.no_grad():
        model.embed.weight.mul_(0.1)  # tied: the LM head too
    return model


def tiny_batch(
    seed: int, groups: int, size: int, behaviour: bool = False, routing: bool = False
) -> list[TrainSample]:
    """``groups`` prompts with ``size`` completions each (lengths 1..7, random advantages);
    with ``behaviour``, behaviour logprobs near the policy's and an empty completion second;
    with ``routing``, random experts of ``MOE``'s shape to replay."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi, n=1: torch.randint(lo, hi, (n,), generator=g).tolist()  # noqa: E731
    out = []
    experts = lambda n: torch.randint(0, MOE["num_experts"], (n, 2, 2), generator=g)  # noqa: E731
    for _ in range(groups):
        prompt = rand(0, 32, rand(2, 9)[0])
        prompt_experts = experts(len(prompt))  # one prefill: the group's alike
        for _ in range(size):
            completion = rand(0, 32, rand(1, 8)[0])
            old = [-3.5 + x / 20 for x in rand(-8, 8, len(completion))] if behaviour else None
            adv = float(torch.randn(1, generator=g))
            fed = torch.cat([prompt_experts, experts(len(completion) - 1)]) if routing else None
            out.append(TrainSample(prompt, completion, adv, old, fed))
    if behaviour:  # skipped by the learner, as in one process
        out.insert(1, TrainSample(out[0].prompt_ids, [], 1.0, []))
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (gathered from the ranks if ``t`` is a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
