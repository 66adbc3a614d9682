"""The synchronous GRPO pipeline: rollout -> score -> learn -> refit, one step at a time.

Contract:
- ``build_run(cfg)`` checks everything that can fail (model name, task, drafter, sampling) and
  builds the parts of a run (``RunParts``): env, codec (prompt -> token ids, ids -> text), the
  learner (owns the float32 policy) and the engine (its own copy in ``model.dtype``, speculation
  per ``rollout.spec``). Tests pass their own tiny model, codec and env.
- ``train(parts, run_dir)`` runs ``run.steps`` steps. Step ``s``:
  1. prompts ``s*P .. s*P+P-1`` of the train stream: the train split in a seeded permutation per
     epoch (``prompt_order``), cycled; a pure function of (seed, step), so resume needs no state;
  2. ``engine.generate`` with n=G, temperature/top-k/top-p from the config, the tokenizer's stop
     tokens and a request seed derived from (run seed, step, prompt), speculation per config;
  3. texts -> env rewards -> group advantages (registered estimator);
  4. the engine/learner mismatch of raw (T=1) logprobs on the step's tokens, with the learner's
     ``raw_logprobs`` on the same sequences BEFORE the update (``logprob_delta_mean/max``);
  5. ``learner.train_step``; behaviour logprobs (``old_logprobs``) are the engine's processed
     logprobs when no top-k/top-p truncation is on (then the processed distribution is exactly
     softmax(logits / T), which the learner computes with the same T), so the clipped ratio also
     absorbs the engine's bf16 rounding; with truncation the engine's numbers belong to another
     distribution, so the learner's own (detached, ratio 1) logprobs are used instead;
  6. refit the engine copy (``refit.refit``), bump the policy version;
  7. a metrics row (``METRIC_KEYS`` at least) to ``metrics.jsonl`` and the console.
  Evaluation (greedy and sampled accuracy on the held-out split) runs before step s when
  ``s % eval_every == 0`` and after the last step, into ``eval.jsonl``. Checkpoints every
  ``checkpoint_every`` updates and after the last one. The suffix drafter keeps its per-prompt
  history inside the engine's proposer across steps (the engine indexes finished completions).
- ``train(..., resume=True)`` restores the latest checkpoint and continues: every later metric
  equals the uninterrupted run's except timings (deterministic CPU configuration).
- ``measure_speedup`` rolls out the next step's prompts with and without speculation on the same
  weights and seeds and returns both throughputs and their ratio.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from specrl.config import Config, ConfigError
from specrl.engine.engine import Engine
from specrl.engine.types import Completion, Request
from specrl.envs.reasoning_gym_env import Env, Prompt
from specrl.pipelines.checkpoint import RunDir, load_checkpoint, save_checkpoint
from specrl.pipelines.refit import engine_copy, refit
from specrl.rl import Learner, TrainSample, compute_advantages
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig, auto_tokens_per_forward
from specrl.spec.proposers import proposer_takes

METRIC_KEYS = (
    "step", "reward_mean", "reward_std", "accuracy", "response_length", "gen_time_s",
    "gen_tokens", "rollout_tokens_per_s", "acceptance_length", "train_time_s", "refit_time_s",
    "step_time_s", "logprob_delta_mean", "logprob_delta_max",
)  # fmt: skip
TIMING_KEYS = frozenset(
    {"gen_time_s", "rollout_tokens_per_s", "train_time_s", "refit_time_s", "step_time_s",
     "logprob_time_s", "score_time_s", "prefill_s", "decode_s", "draft_s", "verify_s",
     "eval_time_s", "learner_time_s"}
)  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_STREAM_TRAIN, _STREAM_GREEDY, _STREAM_SAMPLED = 0, 1, 2


class Codec(Protocol):
    """Text side of the model: prompt -> token ids, completion ids -> text, stop tokens."""

    stop_token_ids: tuple[int, ...]

    def prompt_ids(self, prompt: Prompt) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChatCodec:
    """A ``TextTokenizer`` with its chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(tokenizer.stop_token_ids)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.chat_prompt(list(prompt.messages)))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


@dataclass
class RunParts:
    """Everything a run needs, built and checked before any work."""

    cfg: Config
    env: Env
    codec: Codec
    learner: Learner
    engine: Engine
    orders: dict[int, list[Prompt]] = field(default_factory=dict)  # epoch -> train order


# --------------------------------------------------------------------------- building


def check_sampling(cfg: Config) -> None:
    if cfg.rollout.temperature <= 0:
        raise ConfigError("bad value for rollout.temperature: GRPO needs sampling (> 0), got 0")
    if cfg.rollout.group_size < 2:
        raise ConfigError("bad value for rollout.group_size: GRPO needs >= 2 completions, got 1")


def drafter_dir(cfg: Config) -> str | None:
    """The drafter directory a ``draft`` model or learned-head drafter (eagle3, mtp) reads:
    ``rollout.drafter_path``, else the one ``specrl train-drafter --drafter SPEC`` cached for
    the model, if it exists."""
    from specrl.drafters.cli import default_out

    if cfg.rollout.drafter_path is not None:
        return str(Path(cfg.rollout.drafter_path).expanduser())
    spec = cfg.rollout.spec
    cached = default_out(cfg.model.name, spec)
    marker = "config.json" if proposer_takes(spec, "draft_model") else "head.json"
    return str(cached) if (cached / marker).exists() else None


def check_drafter(cfg: Config) -> None:
    """A drafter that takes a draft model or a trained head needs one (checked up front)."""
    spec = cfg.rollout.spec
    for takes, what in (("draft_model", "a model directory"), ("drafter_path", "a head directory")):
        if proposer_takes(spec, takes) and drafter_dir(cfg) is None:
            raise ConfigError(
                f"rollout.spec={spec!r} needs rollout.drafter_path ({what}; make one with "
                f"`specrl train-drafter --drafter {spec}`)"
            )


def load_drafter(cfg: Config, dtype: torch.dtype) -> torch.nn.Module | None:
    """The draft model of a ``draft``-style drafter (heads are loaded by their proposer)."""
    if not proposer_takes(cfg.rollout.spec, "draft_model"):
        return None
    from specrl.models.checkpoints import load_model

    return load_model(drafter_dir(cfg), dtype=dtype)


def make_engine(cfg: Config, policy: torch.nn.Module, draft: torch.nn.Module | None) -> Engine:
    heads = proposer_takes(cfg.rollout.spec, "drafter_path")
    cap = cfg.rollout.max_tokens_per_forward
    if cap == "auto":
        cap = auto_tokens_per_forward(DTYPES[cfg.model.dtype])
    spec = SpecConfig(
        cfg.rollout.spec,
        cfg.rollout.num_spec_tokens,
        options={"drafter_path": drafter_dir(cfg)} if heads else {},
        max_tokens_per_forward=cap,
        siblings=cfg.rollout.spec_siblings,
    )
    model = engine_copy(policy, DTYPES[cfg.model.dtype])
    try:
        return Engine(model, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed, spec=spec,
                      draft_model=draft)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"bad value for rollout.spec: {e}") from None


def build_run(
    cfg: Config,
    model: torch.nn.Module | None = None,
    codec: Codec | None = None,
    env: Env | None = None,
) -> RunParts:
    """Check and build a run; ``model``/``codec``/``env`` default to the configured ones."""
    check_sampling(cfg)
    check_drafter(cfg)
    if model is None or codec is None:
        from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model

        resolve_model(cfg.model.name)  # unknown model: CheckpointError, before any work
        codec = codec or ChatCodec(load_tokenizer(cfg.model.name))
    if env is None:
        from specrl.envs.reasoning_gym_env import ReasoningGymEnv

        env = ReasoningGymEnv.from_config(cfg.env)
    draft = load_drafter(cfg, DTYPES[cfg.model.dtype])
    if model is None:
        model = load_model(cfg.model.name, dtype=torch.float32)
    temperature = cfg.rollout.temperature
    learner = Learner.from_config(
        model, cfg.learner, max_len=cfg.rollout.max_new_tokens, temperature=temperature
    )
    return RunParts(cfg, env, codec, learner, make_engine(cfg, learner.model, draft))


# --------------------------------------------------------------------------- one step


def prompt_order(parts: RunParts, epoch: int) -> list[Prompt]:
    """The train split in epoch ``epoch``'s seeded order (cached on ``parts``)."""
    if epoch not in parts.orders:
        seed = random.Random(f"{parts.cfg.run.seed}/{epoch}").getrandbits(32)
        parts.orders[epoch] = parts.env.prompts("train", seed=seed)
    return parts.orders[epoch]


def draw_prompts(parts: RunParts, step: int) -> list[Prompt]:
    """Prompts of step ``step``: positions step*P .. step*P+P-1 of the cycled train stream."""
    p, n = parts.cfg.rollout.prompts_per_step, len(prompt_order(parts, 0))
    return [prompt_order(parts, i // n)[i % n] for i in range(step * p, step * p + p)]


def request_seed(run_seed: int, step: int, index: int, stream: int) -> int:
    return ((run_seed * 1_000_003 + step) * 8191 + index) * 4 + stream


def rollout(
    parts: RunParts,
    prompts: Sequence[Prompt],
    step: int,
    stream: int = _STREAM_TRAIN,
    n: int | None = None,
    temperature: float | None = None,
    spec: SpecConfig | None = None,
) -> tuple[list[Completion], float]:
    """n completions per prompt (request order) and the seconds ``generate`` took."""
    r, codec = parts.cfg.rollout, parts.codec
    t = r.temperature if temperature is None else temperature
    reqs = [
        Request(codec.prompt_ids(p), SamplingParams(
            temperature=t, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
            stop_token_ids=codec.stop_token_ids, n=n or r.group_size,
            seed=request_seed(parts.cfg.run.seed, step, i, stream)))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    t0 = time.perf_counter()
    comps = parts.engine.generate(reqs, spec=spec)
    elapsed = time.perf_counter() - t0
    bad = next((c for c in comps if c.error), None)
    if bad is not None:
        raise RuntimeError(f"generation failed for prompt {bad.request_index}: {bad.error}")
    return comps, elapsed


def score(
    parts: RunParts, prompts: Sequence[Prompt], comps: Sequence[Completion]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards and correctness ``[num_prompts, n]`` (completions are grouped per prompt)."""
    texts = [parts.codec.decode(c.token_ids) for c in comps]
    metas = [prompts[c.request_index].meta for c in comps]
    pairs = list(zip(texts, metas, strict=True))
    rewards = torch.tensor([parts.env.reward(t, m) for t, m in pairs], dtype=torch.float32)
    correct = torch.tensor([float(parts.env.correct(t, m)) for t, m in pairs])
    return rewards.view(len(prompts), -1), correct.view(len(prompts), -1)


def logprob_delta(
    learner: Learner, comps: Sequence[Completion], ours: list[torch.Tensor] | None = None
) -> dict[str, float]:
    """Mean and max |engine raw logprob - learner raw logprob| over all completion tokens;
    ``ours``: the learner's raw logprobs of the non-empty completions if already computed (the
    training forward at temperature 1), else a no-grad forward computes them."""
    t0 = time.perf_counter()
    live = [c for c in comps if c.token_ids]
    if ours is None:
        ours = learner.raw_logprobs([(c.prompt_ids, c.token_ids) for c in live])
    delta = torch.cat(
        [(o.float() - torch.tensor(c.raw_logprobs)).abs() for o, c in zip(ours, live, strict=True)]
    )  # [M]
    return {
        "logprob_delta_mean": float(delta.mean()) if delta.numel() else 0.0,
        "logprob_delta_max": float(delta.max()) if delta.numel() else 0.0,
        "logprob_time_s": time.perf_counter() - t0,
    }


def uses_engine_logprobs(cfg: Config) -> bool:
    """Whether the engine's processed logprobs are the learner's behaviour logprobs (no top-k/p)."""
    return cfg.rollout.top_k == 0 and cfg.rollout.top_p >= 1.0


def train_samples(
    comps: Sequence[Completion], advantages: torch.Tensor, behaviour: bool
) -> list[TrainSample]:
    """One ``TrainSample`` per completion; ``advantages`` is ``[num_prompts, G]``."""
    flat = advantages.flatten().tolist()
    return [
        TrainSample(c.prompt_ids, c.token_ids, a, list(c.logprobs) if behaviour else None)
        for c, a in zip(comps, flat, strict=True)
    ]


def rollout_metrics(comps: Sequence[Completion], gen_s: float, engine: Engine) -> dict:
    st = engine.stats
    tokens = sum(len(c.token_ids) for c in comps)
    return {
        "gen_time_s": gen_s,
        "gen_tokens": tokens,
        "rollout_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "acceptance_length": st.acceptance_length,
        "draft_acceptance_rate": st.accepted / st.drafted if st.drafted else 0.0,
        "response_length": tokens / max(len(comps), 1),
        "truncated_frac": sum(c.finish_reason == "length" for c in comps) / max(len(comps), 1),
        "prefill_s": st.prefill_s,
        "draft_s": st.draft_s,
        "verify_s": st.verify_s,
    }


def run_step(parts: RunParts, step: int) -> dict[str, Any]:
    """One synchronous RL step (see the module docstring); returns its metrics row."""
    t0, cfg = time.perf_counter(), parts.cfg
    prompts = draw_prompts(parts, step)
    comps, gen_s = rollout(parts, prompts, step)
    row: dict[str, Any] = {"step": step} | rollout_metrics(comps, gen_s, parts.engine)
    t1 = time.perf_counter()
    rewards, correct = score(parts, prompts, comps)  # [P, G]
    adv = compute_advantages(cfg.learner.advantage, rewards, **_adv_kwargs(cfg))
    row |= {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(correct.mean()),
        "score_time_s": time.perf_counter() - t1,
    }
    samples = train_samples(comps, adv, uses_engine_logprobs(cfg))
    if parts.learner.temperature == 1.0:  # the training forward's logprobs are the raw ones
        kept: list[torch.Tensor] = []
        stats = parts.learner.train_step(samples, keep=kept)
        row |= logprob_delta(parts.learner, comps, kept)
    else:
        row |= logprob_delta(parts.learner, comps)
        stats = parts.learner.train_step(samples)
    row |= {"train_time_s": stats.pop("time_s")} | {f"learner_{k}": v for k, v in stats.items()}
    row["refit_time_s"] = refit(parts.engine, dict(parts.learner.model.named_parameters()))
    row["policy_version"] = parts.engine.policy_version
    row["step_time_s"] = time.perf_counter() - t0
    return row


def _adv_kwargs(cfg: Config) -> dict[str, Any]:
    return {"normalize_std": cfg.learner.normalize_std} if cfg.learner.advantage == "grpo" else {}


# --------------------------------------------------------------------------- evaluation


def evaluate(parts: RunParts, updates: int) -> dict[str, Any]:
    """Greedy and sampled (one sample, the rollout temperature) accuracy on the eval split."""
    t0 = time.perf_counter()
    prompts = parts.env.prompts("eval")
    row: dict[str, Any] = {"step": updates, "num_prompts": len(prompts)}
    if not prompts:
        return row
    for name, stream, temp in (("greedy", _STREAM_GREEDY, 0.0), ("sampled", _STREAM_SAMPLED, None)):
        comps, _ = rollout(parts, prompts, updates, stream, n=1, temperature=temp)
        rewards, correct = score(parts, prompts, comps)
        row[f"{name}_accuracy"] = float(correct.mean())
        row[f"{name}_reward"] = float(rewards.mean())
    row["eval_time_s"] = time.perf_counter() - t0
    return row


def eval_due(cfg: Config, updates: int) -> bool:
    every = cfg.run.eval_every
    return every > 0 and (updates % every == 0 or updates == cfg.run.steps)


def checkpoint_due(cfg: Config, updates: int) -> bool:
    every = cfg.run.checkpoint_every
    return every > 0 and (updates % every == 0 or updates == cfg.run.steps)


# --------------------------------------------------------------------------- the loop


def save(parts: RunParts, run: RunDir, updates: int) -> None:
    state = {"step": updates, "policy_version": parts.engine.policy_version}
    save_checkpoint(run.checkpoint_dir(updates), parts.learner.model, parts.learner.optimizer,
                    state, parts.engine.proposer)  # fmt: skip


def restore(parts: RunParts, run: RunDir) -> int:
    """Load the latest checkpoint into ``parts``; the number of updates it holds (0 if none)."""
    ckpt = run.latest_checkpoint()
    if ckpt is None:
        return 0
    state = load_checkpoint(ckpt, parts.learner.model, parts.learner.optimizer,
                            parts.engine.proposer)  # fmt: skip
    refit(parts.engine, dict(parts.learner.model.named_parameters()))
    parts.engine.policy_version = state["policy_version"]
    run.truncate(state["step"])
    return state["step"]


Echo = Callable[[str], None]


def train(
    parts: RunParts,
    run_dir: str,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    echo: Echo | None = None,
) -> list[dict[str, Any]]:
    """Run (or continue) the configured steps; returns this call's metric rows.

    ``stop_after`` ends the call after that many updates in total (an interruption, for tests).
    """
    cfg, run = parts.cfg, RunDir(run_dir)
    if not resume and run.is_used():
        raise ValueError(f"run dir {run.path} is not empty: resume it or choose another")
    run.create()
    start = restore(parts, run) if resume else 0
    run.config.write_text(cfg.to_toml())
    end = min(cfg.run.steps, stop_after if stop_after is not None else cfg.run.steps)
    rows = []
    bar = tqdm(range(start, end), disable=not progress, desc="train", unit="step", initial=start,
               total=cfg.run.steps)  # fmt: skip
    for step in bar:
        if eval_due(cfg, step):
            _log_eval(parts, run, step, echo)
        row = run_step(parts, step)
        run.append(run.metrics, row)
        rows.append(row)
        bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc_len=row["acceptance_length"])
        if echo:
            echo(format_row(row))
        if checkpoint_due(cfg, step + 1):
            save(parts, run, step + 1)
    bar.close()
    if end == cfg.run.steps and eval_due(cfg, end):
        _log_eval(parts, run, end, echo)
    return rows


def _log_eval(parts: RunParts, run: RunDir, updates: int, echo: Echo | None) -> None:
    row = evaluate(parts, updates)
    run.append(run.evals, row)
    if echo:
        echo(f"eval after {updates} updates: greedy acc {row.get('greedy_accuracy', 0):.3f}, "
             f"sampled acc {row.get('sampled_accuracy', 0):.3f}")  # fmt: skip


def format_row(row: dict[str, Any]) -> str:
    return (
        f"step {row['step']:3d} reward {row['reward_mean']:.3f} acc {row['accuracy']:.3f} "
        f"len {row['response_length']:.1f} gen {row['gen_time_s']:.1f}s "
        f"({row['rollout_tokens_per_s']:.0f} tok/s, acc.len {row['acceptance_length']:.2f}) "
        f"train {row['train_time_s']:.1f}s refit {row['refit_time_s']:.2f}s "
        f"step {row['step_time_s']:.1f}s |dlogp| {row['logprob_delta_mean']:.4f}"
    )


# --------------------------------------------------------------------------- speedup check


def measure_speedup(parts: RunParts, step: int) -> dict[str, float]:
    """Roll out step ``step``'s prompts plain and speculative (same weights and seeds).

    Besides the speedup, ``free_draft_speedup``: the speedup had drafting cost nothing (the
    speculative rollout's time less its drafter time; same verify forwards, same acceptance),
    the most any cheaper drafter step could give at this acceptance.
    """
    prompts = draw_prompts(parts, step)
    out: dict[str, float] = {}
    for name, spec in (("plain", SpecConfig("none", 0)), ("spec", parts.engine.spec)):
        comps, gen_s = rollout(parts, prompts, step, spec=spec)
        m = rollout_metrics(comps, gen_s, parts.engine)
        out |= {f"{name}_tokens": m["gen_tokens"], f"{name}_time_s": gen_s,
                f"{name}_tokens_per_s": m["rollout_tokens_per_s"]}  # fmt: skip
        if name == "spec":
            out |= {"spec_acceptance_length": m["acceptance_length"], "spec_draft_s": m["draft_s"]}
    plain = max(out["plain_tokens_per_s"], 1e-9)
    out["rollout_speedup"] = out["spec_tokens_per_s"] / plain
    undrafted = max(out["spec_time_s"] - out["spec_draft_s"], 1e-9)
    out["free_draft_speedup"] = out["spec_tokens"] / undrafted / plain
    return out


def run_training(
    parts: RunParts,
    run_dir: str,
    resume: bool = False,
    compare_plain: bool = True,
    progress: bool = True,
    echo: Echo | None = None,
) -> dict[str, Any]:
    """``train``, then (speculation on, ``compare_plain``) ``measure_speedup`` on the next
    step's prompts; writes and returns the run summary (``summary.json``)."""
    from specrl.pipelines.report import summarize

    t0 = time.perf_counter()
    train(parts, run_dir, resume=resume, progress=progress, echo=echo)
    speed = None
    if compare_plain and parts.engine.spec.enabled:
        speed = measure_speedup(parts, parts.cfg.run.steps)
    run = RunDir(run_dir)
    summary = summarize(run.rows(run.metrics), run.rows(run.evals), speed)
    summary["wall_s"] = time.perf_counter() - t0
    run.summary.write_text(json.dumps({"summary": summary, "speed": speed}, indent=1))
    return summary
