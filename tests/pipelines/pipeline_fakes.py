"""A tiny synthetic task for pipeline tests: token-id prompts and a verifiable reward over ids.

Reward of a completion = the share of its tokens (stop token excluded) that are multiples of 4;
``correct`` = reward >= 0.5. A tiny random model starts near 1/4 and GRPO can raise it quickly.
Texts are space-separated ids, so the codec round-trips exactly. ``FakeBackend`` generates
without an engine: pipelines run on it, which shows they know only the ``RolloutBackend`` seam.
"""

from __future__ import annotations

import math
import random

import torch

from specrl.config import Config, load_config
from specrl.envs.reasoning_gym_env import Prompt
from specrl.envs.synthetic import STOP, IdCodec, ModFourEnv  # noqa: F401 (re-exported)
from specrl.pipelines.build import RunParts, build_run
from specrl.pipelines.state import TrainStream
from tests.conftest import make_tiny

TINY_OVERRIDES = [
    "model.dtype=fp32", "learner.dtype=fp32", "learner.lr=3e-3", "learner.micro_batch_tokens=256",
    "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=8",
    "rollout.spec=none", "run.steps=4", "run.eval_every=2", "run.checkpoint_every=2",
    "rollout.placement=inline",  # no worker process per test (tests of 'process' set it)
]  # fmt: skip
SPECULATING = ["rollout.max_tokens_per_forward=1024"]  # speculate at every step (tests exercise it)


def tiny_config(*overrides: str) -> Config:
    """``TINY_OVERRIDES`` <- ``overrides``; a speculating run (its ``rollout.spec`` not 'none')
    also drafts at every step (``SPECULATING``, unless the overrides set the cap)."""
    plain = load_config(None, [*TINY_OVERRIDES, *overrides])
    if plain.rollout.spec == "none" or any("max_tokens_per_forward" in o for o in overrides):
        return plain
    return load_config(None, [*TINY_OVERRIDES, *SPECULATING, *overrides])


def tiny_parts(cfg: Config, model_seed: int = 0, num_train: int = 24) -> RunParts:
    torch.manual_seed(0)
    env = ModFourEnv(num_train=num_train)
    return build_run(cfg, model=make_tiny(model_seed), codec=IdCodec(), env=env)


def draw_prompts(parts: RunParts, step: int) -> list[Prompt]:
    """The prompts of step ``step`` of ``parts``' run (a fresh ``TrainStream``)."""
    return TrainStream.of(parts.plan, parts.env).draw(step)


class FakeBackend:
    """A ``RolloutBackend`` without an engine: completions are seeded random ids in [2, 32)
    (a stop token with probability 1/8 per position) with uniform logprobs over 30 tokens.
    It records every call, and a checksum of each weight update, so tests can see what a
    pipeline asked of it."""

    features: frozenset[str] = frozenset()

    def __init__(self) -> None:
        from specrl.spec.config import SpecConfig

        self.spec = SpecConfig("none", 0)
        self.version = 0
        self.calls: list[tuple[str, int]] = []  # (what, version at the call)
        self.checksums: list[tuple[int, float]] = []  # (version, sum of all pushed weights)
        self.state: dict = {}
        self.prompts: list[tuple[str, list[list[int]]]] = []  # ("train"/"eval", prompt ids)

    def generate(self, requests, spec=None):
        from specrl.backends import Rollout
        from specrl.rollout_types import Completion

        self.calls.append(("generate", self.version))
        kind = "eval" if requests and requests[0].sampling.n == 1 else "train"
        self.prompts.append((kind, [list(r.prompt_ids) for r in requests]))
        comps = []
        for i, req in enumerate(requests):
            for j in range(req.sampling.n):
                rng = random.Random(f"{req.sampling.seed}/{j}")
                ids = [rng.randrange(2, 32) for _ in range(req.sampling.max_new_tokens)]
                cut = next((k for k in range(len(ids)) if rng.random() < 1 / 8), len(ids))
                ids = ids[:cut] + [STOP] if cut < len(ids) else ids
                lp = [-math.log(30.0)] * len(ids)
                comps.append(Completion(i, j, list(req.prompt_ids), ids, lp, list(lp),
                                        [self.version] * len(ids), "stop",
                                        seed=req.sampling.seed or 0,
                                        policy_version=self.version))  # fmt: skip
        return Rollout(comps, seconds=1e-3)

    def update_weights(self, named_tensors, version):
        total = float(sum(t.detach().double().sum() for t in named_tensors.values()))
        self.checksums.append((version, total))
        self.calls.append(("update", version))
        self.version = version
        return 0.0

    def update_drafter(self, state, version):
        raise ValueError("the fake backend runs no drafter")

    def versions(self):
        from specrl.backends import Versions

        return Versions(self.version)

    def served(self):
        """The version it serves; no fingerprint (it keeps no weights)."""
        from specrl.backends import Served

        return Served(self.version, None)

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)

    def close(self):
        self.calls.append(("close", self.version))


def fake_parts(cfg: Config, backend: FakeBackend | None = None) -> RunParts:
    torch.manual_seed(0)
    return build_run(cfg, model=make_tiny(0), codec=IdCodec(), env=ModFourEnv(),
                     backend=backend or FakeBackend())  # fmt: skip
