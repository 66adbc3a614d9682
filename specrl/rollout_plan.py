"""The rollout plan: a run config's rollout settings resolved and checked once, then frozen.

Contract: ``make_plan(cfg, backends)`` returns a ``RolloutPlan`` or raises ``ConfigError`` (one
line naming the bad value) before any model is loaded; ``backends`` maps each ``rollout.backend``
name to its ``BackendTraits`` (``specrl.backends.plan_rollout(cfg)`` passes the registry's).
Every rollout-setting error is raised here: ``check_backend`` refuses what a built backend
cannot honour, ``refusing`` turns a builder's ``ValueError`` into the one-line error. Backends
and pipelines read rollout settings from the plan, never from the config.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from specrl.config import Config, ConfigError
from specrl.errors import unknown
from specrl.models.device import DeviceError, resolve_device
from specrl.models.precision import torch_dtype
from specrl.paths import cached_drafter
from specrl.spec.config import SpecConfig, auto_tokens_per_forward
from specrl.spec.proposers import (
    available_proposers,
    get_proposer_class,
    head_kind,
    proposer_takes,
    takes_siblings,
)

IN_FLIGHT = "in_flight"  # a backend feature: weights can change between decode steps of a call
# a backend feature: generate(..., on_done=f) calls f(i, comps) as soon as request i's
# completions are all finished, while the rest of the call still generates (rewards start meanwhile)
GROUP_DONE = "group_done"


def _nothing_missing() -> str | None:
    return None


@dataclass(frozen=True)
class BackendTraits:
    """The per-backend rules ``make_plan`` applies (a registry entry's). A reason says why the
    backend cannot do something (the refusal quotes it); ``None`` means it can."""

    inline_only: str | None = None  # no worker process (rollout.placement='process')
    cpu_only: str | None = None  # no CUDA model.device
    head_arch: str = "proj"  # the layout (models.heads.ARCHS) of a head trained from nothing
    fixed_draft_vocab: bool = False  # a trained head's draft vocabulary size is fixed at start
    controller: bool = False  # max_tokens_per_forward='auto' is the cost-model controller
    exact_sample: bool = False  # spec_exact='auto' may pick 'sample'
    missing: Callable[[], str | None] = _nothing_missing  # what is needed and not installed
    check_spec: Callable[[SpecConfig, str | None, bool], object] | None = None  # (spec, drafter
    # dir, trained during RL) ValueError: refused
    check_in_flight: Callable[[str, str], object] | None = None  # (policy, drafter) ValueError


@dataclass(frozen=True)
class Workers:
    """Ray rollout workers (``cluster.*``)."""

    count: int
    address: str | None
    threads: int
    cpus: float
    gpus: float
    max_restarts: int


@dataclass(frozen=True)
class GroupSampling:
    """How each step's prompts are drawn and their groups sampled (``rollout.*``)."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    group_size: int  # completions per prompt
    prompts_per_step: int

    @property
    def truncated(self) -> bool:
        """Whether sampling truncates the distribution (top-k or top-p on)."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(frozen=True)
class RolloutPlan:
    """A run's rollout, resolved: what backends build and pipelines ask (see the module doc)."""

    backend: str  # rollout.backend: a registry name
    placement: str  # 'inline' | 'process' ('auto' resolved; a Ray worker runs inline)
    device: torch.device  # model.device resolved
    model: str  # model.name
    dtype: str  # model.dtype (``models.precision.torch_dtype`` resolves 'auto' for a device)
    gpu_memory_utilization: float  # a CUDA engine's share of the device memory
    spec: SpecConfig  # the backend's speculation, token cap and exact rule resolved
    drafter_dir: str | None  # a draft model or learned head; None: none (or trained from scratch)
    learned_drafter: bool  # the drafter has weights specrl can train
    training_mode: str | None  # 'online' | 'refresh': trained during RL; None: not
    in_flight: str | None  # in-flight token policy; None: weights change between calls
    threads: int  # torch threads of a worker-process engine (0 = half the cores)
    max_batch: int
    seed: int  # run.seed
    sampling: GroupSampling
    alarm_action: str  # rollout.alarm_action: what a drafter whose acceptance collapses triggers
    workers: Workers | None = None  # Ray rollout workers; None: no Ray
    head_arch: str = "proj"  # the layout of a head trained from nothing (BackendTraits)
    head_vocab: int = 0  # its draft vocabulary size, fixed at start (0: full, or picked later)
    step_graphs: str = "auto"  # rollout.step_graphs: the native engine's static/captured steps


class _Featured(Protocol):
    features: frozenset[str]


def make_plan(cfg: Config, backends: Mapping[str, BackendTraits]) -> RolloutPlan:
    """``cfg``'s rollout plan (``ConfigError`` for a setting that cannot run; see the module
    docstring). Every rollout setting is checked here, its names included."""
    if cfg.rollout.backend not in backends:
        known = unknown("rollout backend", cfg.rollout.backend, backends)
        raise ConfigError(f"bad value for rollout.backend: {known}")
    traits = backends[cfg.rollout.backend]
    _check_names(cfg)
    _check_sampling(cfg)
    _check_pipeline(cfg, _placement(cfg, traits))
    device = _device(cfg)
    _check_device(cfg, traits, device)
    placement = _checked_placement(cfg, traits, backends)
    missing = traits.missing()
    if missing:
        raise ConfigError(f"rollout.backend={cfg.rollout.backend!r} needs {missing}")
    path, mode = drafter_dir(cfg), _training_mode(cfg)
    spec = _checked_spec(cfg, traits, path, mode)
    m, r = cfg.model, cfg.rollout
    return RolloutPlan(
        backend=r.backend, placement=placement, device=device, model=m.name, dtype=m.dtype,
        gpu_memory_utilization=m.gpu_memory_utilization, spec=spec, drafter_dir=path,
        learned_drafter=learned_drafter(r.spec), training_mode=mode,
        in_flight=_in_flight(cfg, traits), threads=r.threads, max_batch=r.max_batch,
        seed=cfg.run.seed, sampling=_sampling(cfg), alarm_action=r.alarm_action,
        workers=_workers(cfg), head_arch=traits.head_arch,
        head_vocab=cfg.drafter.vocab if traits.fixed_draft_vocab else 0,
        step_graphs=r.step_graphs,
    )  # fmt: skip


def _check_names(cfg: Config) -> None:
    """``rollout.spec`` is 'none' or a registered drafter; ``rollout.spec_siblings`` > 0 only
    with a stochastic one."""
    spec, siblings = cfg.rollout.spec, cfg.rollout.spec_siblings
    known = ["none", *available_proposers()]
    if spec not in known:
        why = unknown("speculation method", spec, known)
        raise ConfigError(f"bad value for rollout.spec: {why} (got {json.dumps(spec)})")
    if siblings and spec in known[1:] and not takes_siblings(spec):
        raise ConfigError(
            "bad value for rollout.spec_siblings: applies only to a stochastic drafter, not to "
            f"rollout.spec {spec!r} (got {siblings})"
        )


def worker_plan(plan: RolloutPlan) -> RolloutPlan:
    """The plan a Ray rollout worker builds its local backend from (inline, no workers)."""
    if plan.workers is None:
        raise ConfigError("the Ray backend needs cluster.rollout_workers >= 1, got 0")
    return replace(plan, workers=None)


def check_backend(plan: RolloutPlan, backend: _Featured) -> None:
    """The built ``backend`` can honour the plan's in-flight policy."""
    if plan.in_flight and IN_FLIGHT not in backend.features:
        raise ConfigError(
            f"pipeline.update='in_flight': the {type(backend).__name__} backend cannot "
            "update weights between decode steps"
        )


@contextmanager
def refusing(key: str | None) -> Iterator[None]:
    """A ``ValueError`` raised inside (building what a plan describes) as the one-line
    ``ConfigError`` 'bad value for KEY: ...' (its own message without ``key``)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"bad value for {key}: {e}" if key else str(e)) from None


# --------------------------------------------------------------------------- sampling, pipeline


def _sampling(cfg: Config) -> GroupSampling:
    r = cfg.rollout
    return GroupSampling(
        temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
        max_new_tokens=r.max_new_tokens, group_size=r.group_size,
        prompts_per_step=r.prompts_per_step,
    )  # fmt: skip


def _check_sampling(cfg: Config) -> None:
    if cfg.rollout.temperature <= 0:
        raise ConfigError("bad value for rollout.temperature: GRPO needs sampling (> 0), got 0")
    if cfg.rollout.group_size < 2:
        raise ConfigError("bad value for rollout.group_size: GRPO needs >= 2 completions, got 1")


def _ignored(cfg: Config, placement: Callable[[], str]) -> str | None:
    """A setting that the rest of the config would ignore and that the config alone cannot
    tell (``config.APPLIES_ONLY`` refuses the others as they are read)."""
    if cfg.rollout.threads and placement() != "process":
        return (
            f"rollout.threads={cfg.rollout.threads} needs the engine in a worker process "
            "(rollout.placement='process', or 'auto' with pipeline.mode='async')"
        )
    return None


def _check_pipeline(cfg: Config, placement: Callable[[], str]) -> None:
    """Pipeline options that contradict each other, or would be ignored, refused."""
    p = cfg.pipeline
    ignored = _ignored(cfg, placement)
    if ignored:
        raise ConfigError(f"{ignored}: it would be ignored")
    if p.mode == "sync":
        if p.update != "between_steps":
            raise ConfigError(
                f"pipeline.update={p.update!r} needs pipeline.mode='async' (the sync pipeline "
                "never updates weights while generating)"
            )
        return
    if p.max_staleness > 0 and _sampling(cfg).truncated and cfg.learner.correction == "ppo":
        raise ConfigError(
            "pipeline.mode='async' with top-k/top-p sampling needs learner.correction='tis': "
            "'ppo' cannot use the engine's truncated behaviour logprobs, so stale groups "
            "would go uncorrected"
        )
    if p.update == "in_flight" and p.max_staleness == 0:
        raise ConfigError(
            "pipeline.update='in_flight' needs pipeline.max_staleness >= 1 (at 0 the producer "
            "never generates while the learner trains)"
        )


def _in_flight(cfg: Config, traits: BackendTraits) -> str | None:
    """The in-flight token policy when the async pipeline updates weights between decode steps
    (checked against the drafter by a backend that runs it)."""
    p = cfg.pipeline
    policy = p.in_flight_tokens if p.mode == "async" and p.update == "in_flight" else None
    if policy and traits.check_in_flight is not None:
        with refusing("pipeline.in_flight_tokens"):
            traits.check_in_flight(policy, cfg.rollout.spec)
    return policy


# --------------------------------------------------------------------------- where it runs


def _device(cfg: Config) -> torch.device:
    """``model.device`` resolved (``ConfigError`` naming it when it cannot be had here)."""
    try:
        return resolve_device(cfg.model.device)
    except DeviceError as e:
        raise ConfigError(f"bad value for model.device: {e}") from None


def _placement(cfg: Config, traits: BackendTraits) -> Callable[[], str]:
    """'inline' or 'process' (a thunk: resolving 'auto' may resolve the device): a worker
    process when async on the CPU with a backend that can run in one, else inline."""

    def resolved() -> str:
        if cfg.rollout.placement != "auto":
            return cfg.rollout.placement
        can = cfg.pipeline.mode == "async" and traits.inline_only is None
        return "process" if can and _device(cfg).type == "cpu" else "inline"

    return resolved


def _check_device(cfg: Config, traits: BackendTraits, device: torch.device) -> None:
    """A GPU run is colocated in one process: a worker-process engine (shared memory on the
    host) and a CPU-only backend cannot serve it."""
    if device.type == "cpu":
        if cfg.rollout.step_graphs == "capture":
            raise ConfigError(
                f"rollout.step_graphs='capture' with model.device={cfg.model.device!r}: CUDA "
                "graphs need a CUDA device ('static' runs the same steps on any device)"
            )
        return
    if traits.cpu_only:
        raise ConfigError(
            f"rollout.backend={cfg.rollout.backend!r} with model.device={cfg.model.device!r}: "
            f"{traits.cpu_only}"
        )
    if cfg.rollout.placement == "process":
        raise ConfigError(
            f"rollout.placement='process' with model.device={cfg.model.device!r}: on a GPU the "
            "engine and the learner share one process (placement 'inline' or 'auto')"
        )


def _checked_placement(
    cfg: Config, traits: BackendTraits, backends: Mapping[str, BackendTraits]
) -> str:
    """The placement the backend is built in (Ray workers: inline, each its own process)."""
    workers = cfg.cluster.rollout_workers
    if workers and cfg.rollout.placement == "process":
        raise ConfigError(
            f"rollout.placement='process' with cluster.rollout_workers={workers}: each Ray "
            "worker is its own process already (use 'auto' or 'inline')"
        )
    placement = "inline" if workers else _placement(cfg, traits)()
    if placement == "process" and traits.inline_only:
        able = _names(backends, lambda t: t.inline_only is None)
        raise ConfigError(
            f"rollout.placement='process' needs rollout.backend={able} ({traits.inline_only})"
        )
    return placement


def _workers(cfg: Config) -> Workers | None:
    c = cfg.cluster
    if c.rollout_workers == 0:
        return None
    return Workers(c.rollout_workers, c.address, c.threads, c.worker_cpus, c.worker_gpus,
                   c.max_restarts)  # fmt: skip


def _names(backends: Mapping[str, BackendTraits], able: Callable[[BackendTraits], bool]) -> str:
    return " or ".join(repr(name) for name, traits in backends.items() if able(traits))


# --------------------------------------------------------------------------- the drafter


def drafter_dir(cfg: Config) -> str | None:
    """The drafter directory a ``draft`` model or learned-head drafter (eagle3, mtp, hybrid) reads:
    ``rollout.drafter_path``, else the one ``specrl train-drafter --drafter SPEC`` cached for
    the model, if it exists."""
    if cfg.rollout.drafter_path is not None:
        return str(Path(cfg.rollout.drafter_path).expanduser())
    cached = cached_drafter(cfg.model.name, head_kind(cfg.rollout.spec))
    return None if cached is None else str(cached)


def learned_drafter(spec: str) -> bool:
    """Whether ``spec`` drafts with weights specrl can train: a head (eagle3, mtp: it takes a
    ``drafter_path``) or a ``draft`` model (it takes a ``draft_model``)."""
    known = spec in available_proposers()
    return known and (proposer_takes(spec, "drafter_path") or proposer_takes(spec, "draft_model"))


def _training_mode(cfg: Config) -> str | None:
    """``drafter.mode`` resolved: 'online' or 'refresh' when the run trains its drafter during
    RL, else None. 'auto' is 'refresh' for a learned drafter (eagle3, mtp, draft); an explicit
    mode for a drafter with nothing to train is refused (it would be ignored)."""
    mode, spec = cfg.drafter.mode, cfg.rollout.spec
    learned = learned_drafter(spec)
    if mode == "auto":
        return "refresh" if learned else None
    if not learned:
        raise ConfigError(
            f"drafter.mode={mode!r} needs a learned drafter (rollout.spec='eagle3', 'mtp' or "
            f"'draft'), got rollout.spec={spec!r}: it would be ignored"
        )
    return None if mode == "frozen" else mode


def _check_drafter(spec: str, path: str | None, mode: str | None) -> None:
    """A drafter that takes a draft model or a trained head needs one, unless the run trains
    it from scratch (``mode``)."""
    if mode is not None:
        return
    for takes, what in (("draft_model", "a model directory"), ("drafter_path", "a head directory")):
        if proposer_takes(spec, takes) and path is None:
            raise ConfigError(
                f"rollout.spec={spec!r} needs rollout.drafter_path ({what}; make one with "
                f"`specrl train-drafter --drafter {head_kind(spec)}`)"
            )


# --------------------------------------------------------------------------- speculation


def _checked_spec(
    cfg: Config, traits: BackendTraits, path: str | None, mode: str | None
) -> SpecConfig:
    """``spec_config``, refused first by the backend's own rule, then by the drafter's needs,
    then by ``SpecConfig.validate``."""
    spec = spec_config(cfg, traits)
    if traits.check_spec is not None:
        with refusing(None):
            traits.check_spec(spec, path, mode is not None)
    _check_drafter(spec.method, path, mode)
    with refusing("rollout.spec"):
        return spec.validate()


def spec_config(cfg: Config, traits: BackendTraits) -> SpecConfig:
    """The speculation settings from ``rollout.*`` for a backend with ``traits`` (unchecked).
    ``max_tokens_per_forward='auto'`` is the cost-model controller (``SpecConfig.adaptive``)
    where the backend runs it, else the fixed cap ``auto_tokens_per_forward`` gives (e.g. vLLM,
    which takes a per-batch-size schedule). ``spec_exact='auto'``: ``exact_rule``."""
    cap = cfg.rollout.max_tokens_per_forward
    adaptive = cap == "auto" and traits.controller
    if cap == "auto":
        cap = None if adaptive else auto_tokens_per_forward(torch_dtype(cfg.model.dtype))
    heads = proposer_takes(cfg.rollout.spec, "drafter_path")
    return SpecConfig(
        cfg.rollout.spec,
        cfg.rollout.num_spec_tokens,
        options={"drafter_path": drafter_dir(cfg)} if heads else {},
        max_tokens_per_forward=cap,
        siblings=cfg.rollout.spec_siblings,
        exact=exact_rule(cfg, traits),
        adaptive=adaptive,
    )


def exact_rule(cfg: Config, traits: BackendTraits) -> str:
    """``rollout.spec_exact`` with 'auto' resolved: 'sample' for a deterministic drafter without
    siblings on a backend that verifies that way (no acceptance lost), else 'distribution'."""
    exact, method = cfg.rollout.spec_exact, cfg.rollout.spec
    if exact != "auto":
        return exact
    known = method in available_proposers()
    plain_draft = known and get_proposer_class(method).deterministic
    sample = traits.exact_sample and plain_draft and not cfg.rollout.spec_siblings
    return "sample" if sample else "distribution"
