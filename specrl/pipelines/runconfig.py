"""A run's configuration and directory, resolved before any work: the CLI's and the API's.

``resolve_config(config, sets, run_dir, resume, preset)`` returns the validated ``Config`` and the
run directory: a new run (its prompt files and file-named rewards made absolute:
``absolute_paths``) gets ``run_dir`` (or ``run.run_dir``), or the first unused
``NAME-1``, ``NAME-2``, ... beside it (``free_run_dir``: a used run directory is never
overwritten); ``--resume`` reads the run's own config.toml, where ``--set`` may change only
what does not change what a step computes (``RESUME_MAY_CHANGE``: length, evaluation,
checkpointing, logging, where and with how much memory it runs); any other change is refused,
so config.toml stays a true record (``changed_settings`` lists the changes, which
``loop.open_run`` logs to ``changes.jsonl`` with the step they apply from). Every problem is a
``ConfigError`` or ``RunDirError`` (``ValueError``s, one line). ``with_run_dir(cfg, path)``:
``cfg`` with ``run.run_dir`` set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specrl.config import Config, ConfigError, load_config, load_run_config, parse_override
from specrl.fsutil import writable_problem
from specrl.pipelines.rundir import RunDir

# What ``--set`` may change on a resume: how long the run goes, what it evaluates, keeps and
# logs, where and in how much memory it runs; never what a step computes (a section name: all of
# its fields). The stored config.toml takes the new values; ``changes.jsonl`` records them.
RESUME_MAY_CHANGE = (
    "run.steps",
    "run.eval_every",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.final_checkpoint",
    "run.tensorboard",
    "run.wandb",
    "model.device",
    "model.gpu_memory_utilization",
    "reward.workers",
    "reward.timeout_s",
    "rollout.threads",
    "rollout.step_graphs",
    "learner.micro_batch_tokens",
    "learner.logprob_chunk",
    "learner.activation_checkpointing",
    "cluster",
)


def free_run_dir(path: Path) -> Path:
    """``path`` if unused, else the first unused ``path-1``, ``path-2``, ..."""
    candidate, i = path, 0
    while RunDir(candidate).is_used():
        i += 1
        candidate = path.with_name(f"{path.name}-{i}")
    return candidate


def require_writable_dir(path: Path, what: str) -> None:
    """``ConfigError`` (``"<what> <why>"``) unless ``path`` is a directory this user can write
    in, or can be created as one (``fsutil.writable_problem``)."""
    problem = writable_problem(path, "dir")
    if problem is not None:
        raise ConfigError(f"{what} {problem}")


def check_resumable(run: RunDir) -> None:
    """What a resume reads before any work: config.toml, the logs, a writable directory no
    other process is writing (its lock)."""
    if not run.config.is_file():
        raise ConfigError(f"cannot resume {run.path}: no config.toml there")
    require_writable_dir(run.path, "run dir")
    run.check_unlocked()
    for log in (run.metrics, run.evals):
        run.rows(log)  # a line that is not JSON: RunDirError naming it


def resolve_config(
    config: Path | dict[str, Any] | None,
    sets: list[str],
    run_dir: Path | None,
    resume: Path | None,
    preset: str | None = None,
) -> tuple[Config, Path]:
    """The validated config and the run directory (``ConfigError`` or ``RunDirError``, both
    ``ValueError``, on any bad input)."""
    if resume is not None:
        if config is not None or preset is not None:
            raise ConfigError("--resume reads RUN_DIR/config.toml; change values with --set")
        check_resumable(RunDir(resume))
        if run_dir is not None and run_dir != resume:
            raise ConfigError(f"--run-dir {run_dir} with --resume {resume}: a resumed run "
                              "stays in its own directory")  # fmt: skip
        cfg = load_run_config(resume / "config.toml", sets)
        check_resume_overrides(cfg, RunDir(resume), sets)
        check_record_kept(load_run_config(resume / "config.toml"), cfg, resume)
        return with_run_dir(cfg, resume), resume
    if run_dir is not None and any(parse_override(i)[0] == ["run", "run_dir"] for i in sets):
        raise ConfigError(
            f"--run-dir {run_dir} with --set run.run_dir: name the run directory once"
        )
    cfg = absolute_paths(load_config(config, sets, preset))
    base = run_dir or Path(cfg.run.run_dir)
    require_writable_dir(base, "run dir")
    target = free_run_dir(base)
    require_writable_dir(target, "run dir")
    return with_run_dir(cfg, target), target


def check_resume_overrides(cfg: Config, run: RunDir, sets: list[str]) -> None:
    """What ``--set`` cannot change on a resume: the run's directory, and ``run.steps`` below
    the steps it has already run (nothing would be done)."""
    if any(parse_override(item)[0] == ["run", "run_dir"] for item in sets):
        raise ConfigError(f"--set run.run_dir with --resume {run.path}: a resumed run stays "
                          "in its own directory")  # fmt: skip
    done = len(run.rows(run.metrics))
    if cfg.run.steps < done:
        raise ConfigError(f"run.steps={cfg.run.steps} with --resume {run.path}: it has already "
                          f"run {done} steps (set run.steps >= {done})")  # fmt: skip


def changed_settings(before: Config, after: Config) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (before, after)}`` for every field that differs (``run.run_dir``
    aside: where the run is, not how it runs)."""
    old, new = before.model_dump(mode="json"), after.model_dump(mode="json")
    return {
        f"{section}.{name}": (value, new[section][name])
        for section, fields in old.items()
        for name, value in fields.items()
        if value != new[section][name] and f"{section}.{name}" != "run.run_dir"
    }


def may_change_on_resume(key: str) -> bool:
    """Whether ``--set key=...`` may change a resumed run (``RESUME_MAY_CHANGE``)."""
    return key in RESUME_MAY_CHANGE or key.split(".")[0] in RESUME_MAY_CHANGE


def check_record_kept(stored: Config, cfg: Config, run: Path) -> None:
    """``ConfigError`` naming the first setting ``cfg`` changes from the run's stored config
    that a resume may not change: the run's steps were made with the stored value."""
    for key, (old, new) in changed_settings(stored, cfg).items():
        if not may_change_on_resume(key):
            raise ConfigError(
                f"--set {key}={new!r} with --resume {run}: the run's steps were made with "
                f"{key}={old!r} and config.toml records that; a resume may change only "
                f"{', '.join(RESUME_MAY_CHANGE)} (start a new run to change it)"
            )


def with_run_dir(cfg: Config, run_dir: Path) -> Config:
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_dir": str(run_dir)})})


def absolute_paths(cfg: Config) -> Config:
    """``cfg`` with the prompt files and file-named rewards (``path/f.py:fn``) made absolute:
    config.toml names what the run read wherever a resume starts from."""
    env = {key: str(Path(value).resolve()) for key in ("train_file", "eval_file")
           if (value := getattr(cfg.env, key)) is not None}  # fmt: skip
    funcs = [_absolute_reward(f) for f in cfg.reward.funcs]
    reward = cfg.reward.model_copy(update={"funcs": funcs})
    return cfg.model_copy(update={"env": cfg.env.model_copy(update=env), "reward": reward})


def _absolute_reward(spec: str) -> str:
    path, sep, name = spec.rpartition(":")
    if sep and path.endswith(".py") and not Path(path).is_absolute():
        return f"{Path(path).resolve()}:{name}"
    return spec
