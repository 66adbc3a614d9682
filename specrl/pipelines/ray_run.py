"""Training on Ray: the learner and its pipeline in one Ray actor, the rollout workers in others.

``precheck(cfg)``: the checks that need no model and no Ray. ``run_training_on_ray`` and
``train_on_ray`` run ``train.run_training`` / ``train.train`` unchanged in a learner actor
pinned to this node (the run dir and ``--resume`` as without Ray), built by ``make_parts(cfg)``
and owning its Ray backend's workers. Console lines come back through ``echo``; the first
SIGINT/SIGTERM stops the learner after a checkpointed step (``Stopped``), a second aborts; the
run's exceptions are raised here with their own type and one line. Nothing is left running.
Details: docs/internals.md.
"""

from __future__ import annotations

import pickle
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm import tqdm

from specrl.backends import plan_rollout
from specrl.backends.ray_session import RaySession, actor_threads, import_ray
from specrl.config import Config
from specrl.malloc import keep_freed_memory
from specrl.pipelines.build import RunParts, build_run, make_env
from specrl.pipelines.loop import Echo
from specrl.pipelines.scoring import Rewards
from specrl.pipelines.signals import Stopped, StopRequest, stop_on_signals
from specrl.pipelines.train import run_training, train
from specrl.pipelines.validate import check_names

POLL_S = 0.2  # how often this process prints the learner's lines and checks for a signal
CONTROL = "control"  # the learner actor's concurrency group for polls and stop requests

MakeParts = Callable[[Config], RunParts]
Reply = tuple[Any, ...]  # ("ok", value) | ("stopped", fields) | ("error", exception, trace)


class LearnerActor:
    """The body of the learner actor: builds the run and trains; lines and stop requests go
    through a second concurrency group while it runs."""

    def __init__(self, cfg: Config, make_parts: MakeParts) -> None:
        torch.set_num_threads(actor_threads(cfg.cluster.threads, cfg.cluster.rollout_workers))
        keep_freed_memory()  # the actor's process trains: as ``specrl train`` does for its own
        self.cfg, self.make_parts = cfg, make_parts
        self.stop = StopRequest()
        self.lines: deque[str] = deque()

    def run(self, call: str, run_dir: str, kwargs: dict[str, Any]) -> Reply:
        parts = None
        try:
            parts = self.make_parts(self.cfg)
            fn = train if call == "train" else run_training
            value = fn(parts, run_dir, progress=False, echo=self.lines.append, stop=self.stop,
                       **kwargs)  # fmt: skip
            return ("ok", value)
        except Stopped as e:
            return ("stopped", _stopped_fields(e))
        except Exception as e:
            return ("error", _portable(e), traceback.format_exc())
        finally:
            if parts is not None:
                parts.close()

    def drain(self) -> list[str]:
        """The lines printed since the previous call."""
        out = []
        while self.lines:
            out.append(self.lines.popleft())
        return out

    def request_stop(self, signum: int) -> None:
        """A signal reached the driver: stop after the step in progress."""
        if self.stop.signum is None:
            self.stop.signum = signum


def _stopped_fields(e: Stopped) -> dict[str, Any]:
    return {"updates": e.updates, "checkpoint": e.checkpoint, "run_dir": e.run_dir,
            "complete": e.complete, "skipped": e.skipped, "summary": e.summary}  # fmt: skip


def _portable(e: Exception) -> Exception:
    """``e`` if it survives pickling, else a ``RuntimeError`` with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


# --------------------------------------------------------------------------- driver side


class _Rows:
    """Complete lines of a growing file (reset when it is truncated), read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.count = path, 0, 0

    def __call__(self) -> int:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size < self.offset:
            self.offset = self.count = 0
        if size > self.offset:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
            end = data.rfind(b"\n") + 1
            self.count += data.count(b"\n", 0, end)
            self.offset += end
        return self.count


class _Console:
    """Where the learner's lines and progress are shown in this process."""

    def __init__(self, cfg: Config, run_dir: str, progress: bool, echo: Echo | None) -> None:
        self.echo, self.rows = echo, _Rows(Path(run_dir) / "metrics.jsonl")
        self.bar = tqdm(disable=not progress, desc=f"train ({cfg.pipeline.mode}, ray)",
                        unit="step", total=cfg.run.steps)  # fmt: skip

    def show(self, lines: list[str]) -> None:
        for line in lines:
            if self.echo is not None:
                self.echo(line)
        if not self.bar.disable:
            self.bar.n = self.rows()
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _learner(ray: ModuleType, cfg: Config, make_parts: MakeParts) -> Any:
    """The learner actor, on this node (the run dir's filesystem), reserving no CPU."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    cls = ray.remote(concurrency_groups={CONTROL: 1})(LearnerActor)
    return cls.options(num_cpus=0, max_restarts=0, scheduling_strategy=here).remote(cfg, make_parts)


def _wait(ray: ModuleType, actor: Any, ref: Any, stop: StopRequest, console: _Console) -> Reply:
    """Poll until the run ends: print its lines, pass a signal on to it."""
    forwarded = False
    try:
        while True:
            ready, _ = ray.wait([ref], timeout=POLL_S)
            if stop.requested and not forwarded:
                actor.request_stop.options(concurrency_group=CONTROL).remote(stop.signum)
                forwarded = True
            console.show(ray.get(actor.drain.options(concurrency_group=CONTROL).remote()))
            if ready:
                return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise RuntimeError(f"the Ray learner actor died: {line}") from None


def _unwrap(reply: Reply, stop: StopRequest) -> Any:
    """The run's value, or its ``Stopped`` / exception raised here."""
    if reply[0] == "ok":
        return reply[1]
    if reply[0] == "stopped":
        f = reply[1]
        raise Stopped(stop, f["updates"], f["checkpoint"], f["run_dir"], complete=f["complete"],
                      skipped=f["skipped"], summary=f["summary"])  # fmt: skip
    _, error, trace = reply
    error.add_note(f"raised in the Ray learner actor:\n{trace}")
    raise error


def _drive(
    cfg: Config,
    call: str,
    run_dir: str,
    kwargs: dict[str, Any],
    console: _Console,
    make_parts: MakeParts | None,
) -> Any:
    """Run ``call`` in a learner actor (see the module docstring)."""
    ray = import_ray()
    session = RaySession.open(cfg.cluster.address)
    try:
        with stop_on_signals() as stop:
            actor = _learner(ray, cfg, make_parts or build_run)
            try:
                where = str(Path(run_dir).absolute())  # the actor's cwd is its node's
                reply = _wait(ray, actor, actor.run.remote(call, where, kwargs), stop, console)
            finally:
                ray.kill(actor, no_restart=True)
    finally:
        console.close()
        session.close()
    return _unwrap(reply, stop)


def precheck(cfg: Config) -> None:
    """What can be checked before Ray starts (``ConfigError``, ``FileEnvError``,
    ``RewardError``: one line): the names and the rollout plan (as ``build.build_run`` checks
    them), the environment (a prompt file's every row) and the reward functions, and that the
    ray package is installed."""
    check_names(cfg)
    plan_rollout(cfg)
    Rewards.build(cfg.reward, make_env(cfg.env)).close()  # no worker started: nothing to stop
    import_ray()


def run_training_on_ray(
    cfg: Config,
    run_dir: str,
    resume: bool = False,
    compare_plain: bool = True,
    progress: bool = True,
    echo: Echo | None = None,
    make_parts: MakeParts | None = None,
) -> dict[str, Any]:
    """``train.run_training`` in a learner actor (see the module docstring)."""
    kwargs = {"resume": resume, "compare_plain": compare_plain}
    console = _Console(cfg, run_dir, progress, echo)
    return _drive(cfg, "run_training", run_dir, kwargs, console, make_parts)


def train_on_ray(
    cfg: Config,
    run_dir: str,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    echo: Echo | None = None,
    make_parts: MakeParts | None = None,
) -> list[dict[str, Any]]:
    """``train.train`` in a learner actor (see the module docstring)."""
    kwargs = {"resume": resume, "stop_after": stop_after}
    console = _Console(cfg, run_dir, progress, echo)
    return _drive(cfg, "train", run_dir, kwargs, console, make_parts)
