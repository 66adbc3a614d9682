"""Training a ``DraftHead`` with the training-time-test unroll, and measuring its acceptance.

``train_head(head, examples, cfg, out=None)`` minimises the decayed sum over unroll depths of a
``HEAD_LOSSES`` loss ("ce" or "tv") between the frozen target's and the head's distributions,
checkpointing to and resuming from ``out``; ``fit`` is the loop both drafter trainers share
(AdamW, warmup + cosine, bf16 autocast, seeded batches so that a resumed run has the same
losses; ``NonFiniteWeights`` before a diverged drafter is saved); ``save_state`` /
``load_state`` are its safetensors state file (never unpickled); ``acceptance`` is the engine's
acceptance length with a drafter. Details: docs/internals.md.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from specrl.drafters.data import Example
from specrl.errors import one_line
from specrl.fsutil import atomic_writer
from specrl.models.device import autocast, model_device, on
from specrl.models.heads import DraftHead, save_head
from specrl.models.transformer import Transformer

STATE_FILE = "train_state.safetensors"
STATE_FORMAT = "specrl-train-state"
STATE_VERSION = 1


@dataclass
class TrainConfig:
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 20
    batch_size: int = 4
    unroll: int = 3
    decay: float = 0.8
    max_len: int = 512  # examples are cut to this many tokens
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 100
    bf16: bool = True  # autocast the forward to bfloat16 (AMX on CPU)
    loss: str = "ce"  # a key of HEAD_LOSSES (heads only; the draft model distils with KL)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10%."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def collate(examples: list[Example], max_len: int):
    """Padded batch: feats [B, T-1, F], tokens [B, T-1] (x_{i+1}), final [B, T-1, H]
    (target hidden at i+1), mask [B, T-1] (position predicts a completion token, not padding)."""
    lens = [min(len(e.tokens), max_len) for e in examples]
    t = max(lens) - 1
    b = len(examples)
    f = examples[0].feats  # the batch is made where the features are (the learner's device)
    feats = f.new_zeros(b, t, f.shape[-1])
    final = f.new_zeros(b, t, examples[0].final.shape[-1])
    tokens = torch.zeros(b, t, dtype=torch.int64, device=f.device)
    mask = torch.zeros(b, t, dtype=torch.bool, device=f.device)
    for i, (e, n) in enumerate(zip(examples, lens, strict=True)):
        feats[i, : n - 1] = e.feats[: n - 1]
        final[i, : n - 1] = e.final[1:n]
        tokens[i, : n - 1] = e.tokens[1:n]
        first = max(e.prompt_len - 2, 0)  # position i predicts token i+2
        mask[i, first : n - 1] = True
    return feats, tokens, final, mask


def ttt_loss(head: DraftHead, batch, unroll: int, decay: float, loss: str = "ce") -> torch.Tensor:
    """Weighted ``HEAD_LOSSES[loss]`` over draft depths: the unroll's (an EAGLE-3 / MTP head)
    or a block's slots (a block head), ``decay**j`` at depth j (see docs/internals.md)."""
    feats, tokens, final, mask = on(model_device(head), *batch)  # examples may sit elsewhere
    target_p = target_probs(head, final[mask])  # [N, Vd] at the loss positions only
    outs = head.depth_outputs(feats.to(head.dtype), tokens, mask, unroll)
    total = torch.zeros((), dtype=torch.float32, device=feats.device)
    for j, (g, where) in enumerate(outs):
        if not where.any():
            continue
        lp = F.log_softmax(head.logits(g).float(), -1)  # [Nj, Vd]
        total = total + decay**j * HEAD_LOSSES[loss](target_p[where[mask]], lp)
    return total


def soft_cross_entropy(p: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum p log q (p [N, Vd] target probabilities, lp [N, Vd] log q)."""
    return -(p * lp).sum(-1).mean()


def total_variation(p: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """Mean over rows of 1/2 sum |p - q|: on the draft vocabulary, 1 - sum min(p, q) up to a
    constant, i.e. the probability that speculative sampling rejects a draft from q."""
    return 0.5 * (p - lp.exp()).abs().sum(-1).mean()


HEAD_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ce": soft_cross_entropy,
    "tv": total_variation,
}


@torch.no_grad()
def target_probs(head: DraftHead, final: torch.Tensor) -> torch.Tensor:
    """The frozen target's next-token distribution [N, Vd] from its final hidden states [N, H],
    restricted to the head's draft vocabulary (mass outside it dropped, not renormalised)."""
    lm = head.target.lm_head
    lp = torch.log_softmax(lm(final.to(lm.weight.dtype)).float(), -1)  # [N, V]
    if head.d2t is not None:
        lp = lp.index_select(-1, head.d2t)  # [N, Vd]
    return lp.exp()


def draw_batch(examples: list[Example], cfg: TrainConfig, step: int) -> list[Example]:
    """The mini-batch of ``step``: a function of ``cfg.seed`` and the step only (resumable)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    return rng.sample(examples, min(cfg.batch_size, len(examples)))


def fit(
    module: nn.Module,
    examples: list[Example],
    cfg: TrainConfig,
    loss_fn: Callable[[list[Example]], torch.Tensor],
    state_path: Path | None = None,
    progress: bool = True,
) -> list[float]:
    """Minimise ``loss_fn(batch)`` over ``module``'s trainable parameters (see
    docs/internals.md); returns the loss of every step (of this and earlier runs). Leaves
    ``module`` in eval mode with gradients off."""
    module.train()
    opt = torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
    )
    step, losses = 0, []
    if state_path is not None and state_path.exists():
        try:
            step, losses = load_state(state_path, module, opt)
        except ValueError as e:  # damaged or from another setup: start over, saying so
            warnings.warn(f"specrl: {e}; training from step 0", stacklevel=2)
    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, desc="train", unit="step")
    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        with autocast(model_device(module), cfg.bf16):
            loss = loss_fn(draw_batch(examples, cfg, step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        check_finite(module, step, losses[-1])
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if state_path is not None and (step % cfg.ckpt_every == 0 or step == cfg.steps):
            save_state(state_path, module, opt, step, losses)
    bar.close()
    module.eval().requires_grad_(False)
    return losses


class NonFiniteWeights(ValueError):
    """Training made a drafter's weights (or its loss) non-finite; nothing of it is saved."""


def check_finite(module: nn.Module, step: int, loss: float) -> None:
    """Raise ``NonFiniteWeights`` naming ``step`` if the loss or a trainable weight of
    ``module`` is not finite (a too-large learning rate)."""
    bad = [n for n, p in module.named_parameters() if p.requires_grad and not p.isfinite().all()]
    if bad or not math.isfinite(loss):
        what = f"weight {bad[0]}" if bad else "loss"
        raise NonFiniteWeights(f"training diverged at step {step}: the drafter's {what} is not "
                               f"finite (loss {loss:g}); nothing was saved from this phase, try a "
                               "lower learning rate")  # fmt: skip


def save_state(
    path: Path, module: nn.Module, opt: torch.optim.Optimizer, step: int, losses: list[float]
) -> None:
    """Write the training state to ``path`` atomically (the file format: docs/internals.md)."""
    from safetensors.torch import save_file

    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = dict(module.named_parameters())
    tensors = {f"param.{n}": params[n].detach().contiguous() for n in names}
    sd = opt.state_dict()
    values: dict[str, dict] = {}
    for i, slot in sd["state"].items():
        for k, v in slot.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{i}.{k}"] = v.detach().contiguous()
            else:
                values.setdefault(str(i), {})[k] = v
    meta = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "step": step,
        "losses": losses,
        "params": names,
        "opt_values": values,
        "param_groups": sd["param_groups"],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path) as tmp:
        save_file(tensors, str(tmp), metadata={"specrl": json.dumps(meta)})


def load_state(
    path: Path, module: nn.Module, opt: torch.optim.Optimizer
) -> tuple[int, list[float]]:
    """Restore ``module``'s trainable parameters and ``opt`` from ``path``; returns (step,
    losses). ``ValueError`` naming the file, with nothing changed, when it is unreadable, not a
    training state or does not fit ``module`` (other parameter names or shapes). Nothing is
    unpickled."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("specrl")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, SafetensorError) as e:  # missing or unreadable; damaged or not safetensors
        raise ValueError(f"cannot read training state {path}: {one_line(e)}") from None
    try:  # metadata that is not a training state's: no "specrl" JSON object, fields missing
        meta = json.loads(raw)
        step, losses = int(meta["step"]), [float(x) for x in meta["losses"]]
    except (KeyError, TypeError, ValueError) as e:  # ValueError: json's errors too
        raise ValueError(
            f"cannot read training state {path}: its metadata is not a training state's "
            f"({one_line(e)})"
        ) from None
    if meta.get("format") != STATE_FORMAT or meta.get("version") != STATE_VERSION:
        raise ValueError(f"{path} is not a specrl training state (version {STATE_VERSION})")
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    saved = {k.removeprefix("param."): v for k, v in tensors.items() if k.startswith("param.")}
    if meta.get("params") != list(params) or any(
        saved.get(n) is None or saved[n].shape != p.shape for n, p in params.items()
    ):
        raise ValueError(f"training state {path} was saved for other parameters than these")
    try:
        opt.load_state_dict(_optimizer_state(meta, tensors, opt))
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # saved values of other shapes
        raise ValueError(
            f"training state {path} does not fit the optimizer: {one_line(e)}"
        ) from None
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
    return step, losses


def _optimizer_state(meta: dict, tensors: dict[str, torch.Tensor], opt) -> dict:
    """The optimizer state dict saved by ``save_state`` (tuples, as in ``opt``, restored)."""
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = t
    for i, slot in meta["opt_values"].items():
        state.setdefault(int(i), {}).update(slot)
    like = opt.param_groups[0] if opt.param_groups else {}
    groups = [
        {k: tuple(v) if isinstance(like.get(k), tuple) else v for k, v in g.items()}
        for g in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def train_head(
    head: DraftHead,
    examples: list[Example],
    cfg: TrainConfig,
    out: str | Path | None = None,
    progress: bool = True,
    state_name: str = STATE_FILE,
) -> list[float]:
    """Train ``head`` in place (see docs/internals.md); returns the loss of every step.
    ``state_name``: the checkpoint file in ``out`` (one per training phase)."""
    head.requires_grad_(True)
    head.target.requires_grad_(False)
    state_path = Path(out) / state_name if out is not None else None

    def loss_fn(batch: list[Example]) -> torch.Tensor:
        return ttt_loss(head, collate(batch, cfg.max_len), cfg.unroll, cfg.decay, cfg.loss)

    losses = fit(head, examples, cfg, loss_fn, state_path, progress)
    if out is not None:
        longest = max(min(len(e.tokens), cfg.max_len) for e in examples)
        save_head(head, out, extra={"train": asdict(cfg), "final_loss": losses[-1:],
                                    "trained_len": longest})  # fmt: skip
    return losses


def acceptance(
    target: Transformer,
    drafter: DraftHead | Transformer,
    prompt_ids: list[list[int]],
    k: int = 3,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    stop_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    max_batch: int = 16,
) -> float:
    """Engine acceptance length (emitted tokens per verify step per row) with ``drafter``."""
    from specrl.engine import Engine
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams
    from specrl.spec.config import SpecConfig

    params = SamplingParams(
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop_token_ids=tuple(stop_token_ids),
    )
    if isinstance(drafter, Transformer):
        spec, draft_model = SpecConfig("draft", k), drafter
    else:
        spec, draft_model = SpecConfig(drafter.kind, k, options={"drafter": drafter}), None
    engine = Engine(target, max_batch=max_batch, spec=spec, draft_model=draft_model, seed=seed)
    engine.generate([Request(p, params) for p in prompt_ids])
    return engine.stats.acceptance_length
