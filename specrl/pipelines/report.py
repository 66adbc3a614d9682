"""Reports of a training run: a summary (dict and markdown) and PNG plots from its run directory.

``summarize(rows, evals, speed)`` condenses metrics.jsonl and eval.jsonl rows and an optional
speed check into a flat dict (first/last-window reward and accuracy, throughput, acceptance,
mismatch, step-time breakdown, idle times, staleness, a trained drafter's figures);
``summary_markdown`` / ``summary_text`` render it.

``read_run(run_dir)`` reads and checks what a report uses of one run directory (``RunLogs``):
no metric rows, an unreadable or damaged log or summary.json, or a row without a numeric
``step_time_s`` / ``reward_mean`` (or with a non-number where a number is read) is a
``ValueError`` naming the file. A metrics.jsonl the run did not write alone (two writers: a step
logged twice; a gap: a step missing from 0 to the last) is not refused: each step keeps its last
row, rows go in step order, and ``RunLogs.warning`` is one ``warning: ...`` line naming the
duplicated and missing steps (``step_warning``), which ``write_runs`` puts in summary.md and
``specrl report`` prints on stderr. ``write_runs(runs, dest, compare)`` writes the first run's
PNG plots and summary.md (and with ``compare`` compare.png of all runs' train reward) into
``dest``; ``write_report(run_dir, out=None, compare=())`` and ``write_comparison(run_dirs,
path)`` read every run first, so a bad input raises before the first file or directory is
written. Reads files only; never touches models. Details: docs/internals.md.
"""

from __future__ import annotations

import json
import tomllib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from specrl.fsutil import atomic_write
from specrl.pipelines.rundir import RunDir

BREAKDOWN = (
    ("generation", "gen_time_s"),
    ("learner", "train_time_s"),
    ("logprob check", "logprob_time_s"),
    ("refit", "refit_time_s"),
)
REQUIRED = ("reward_mean", "step_time_s")  # in every metric row a report reads
# what the report does arithmetic on, when a row has it
NUMERIC = (
    *REQUIRED,
    *(key for _, key in BREAKDOWN),
    *("accuracy", "response_length", "rollout_tokens_per_s", "acceptance_length"),
    *("spec_step_share", "logprob_delta_mean", "learner_idle_s", "generator_idle_s"),
    *("staleness_mean", "staleness_max", "reused_tokens", "gen_tokens", "drafter_updates"),
    *("drafter_train_s", "draft_acceptance_length"),
)
EVAL_NUMERIC = ("greedy_accuracy", "sampled_accuracy")
LISTED_SPANS = 5  # step ranges a warning lists before "..."


def _mean(rows: Sequence[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return fmean(values) if values else float("nan")


def window(n: int) -> int:
    return min(5, max(1, n // 3))


def step_breakdown(rows: Sequence[dict]) -> dict[str, float]:
    """Mean seconds per step in each phase, plus ``other`` (scoring, bookkeeping)."""
    out = {name: fmean(r.get(key, 0.0) for r in rows) for name, key in BREAKDOWN}
    out["other"] = max(0.0, _mean(rows, "step_time_s") - sum(out.values()))
    return out


def summarize(
    rows: Sequence[dict], evals: Sequence[dict] = (), speed: dict | None = None
) -> dict[str, Any]:
    if not rows:
        raise ValueError("no metric rows: the run has not finished a step")
    w = window(len(rows))
    first, last = rows[:w], rows[-w:]
    out: dict[str, Any] = {
        "steps": len(rows),
        "window": w,
        "reward_first": _mean(first, "reward_mean"),
        "reward_last": _mean(last, "reward_mean"),
        "accuracy_first": _mean(first, "accuracy"),
        "accuracy_last": _mean(last, "accuracy"),
        "response_length_first": _mean(first, "response_length"),
        "response_length_last": _mean(last, "response_length"),
        "rollout_tokens_per_s": _mean(rows, "rollout_tokens_per_s"),
        "acceptance_length": _mean(rows, "acceptance_length"),
        "spec_step_share": _mean(rows, "spec_step_share"),
        "logprob_delta_mean": _mean(rows, "logprob_delta_mean"),
        "step_time_s": _mean(rows, "step_time_s"),
        "total_step_time_s": sum(r["step_time_s"] for r in rows),
        "learner_idle_s": _mean(rows, "learner_idle_s"),
        "generator_idle_s": _mean(rows, "generator_idle_s"),
        "staleness_mean": _mean(rows, "staleness_mean"),
        "reused_tokens": sum(r.get("reused_tokens", 0) for r in rows),
    }
    out |= {f"time_{k.replace(' ', '_')}_s": v for k, v in step_breakdown(rows).items()}
    if any("drafter_version" in r for r in rows):  # a drafter trained during the run
        out |= drafter_summary(rows, first, last)
    for e, tag in ((evals[:1], "first"), (evals[-1:], "last")):
        for key in ("step", "greedy_accuracy", "sampled_accuracy"):
            if e and key in e[0]:
                out[f"eval_{tag}_{key}"] = e[0][key]
    return out | {f"speed_{k}": v for k, v in (speed or {}).items()}


def drafter_summary(
    rows: list[dict[str, Any]], first: list[dict[str, Any]], last: list[dict[str, Any]]
) -> dict[str, Any]:
    """How the drafter trained during the run: its updates, final version, its share of the
    step time, and draft acceptance (tokens per drafting row step) in the first/last window."""
    total = sum(r["step_time_s"] for r in rows)
    return {
        "drafter_updates": sum(r.get("drafter_updates", 0) for r in rows),
        "drafter_version": rows[-1].get("drafter_version", 0),
        "drafter_time_share": sum(r.get("drafter_train_s", 0.0) for r in rows) / total
        if total
        else 0.0,
        "draft_acceptance_first": _mean(first, "draft_acceptance_length"),
        "draft_acceptance_last": _mean(last, "draft_acceptance_length"),
    }


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_markdown(
    summary: dict[str, Any], title: str = "Training run", warnings: Sequence[str] = ()
) -> str:
    """A markdown table of ``summary``; each of ``warnings`` a quoted line above it."""
    lines = [f"# {title}", "", *(f"> {w}" for w in warnings), *([""] if warnings else [])]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in summary.items()]
    return "\n".join(lines) + "\n"


def summary_text(s: dict[str, Any]) -> str:
    w = s["window"]
    parts = [(n, s["time_" + n.replace(" ", "_") + "_s"]) for n, _ in BREAKDOWN]
    lines = [
        f"steps: {s['steps']}  (mean step {s['step_time_s']:.1f} s: "
        + ", ".join(f"{n} {v:.1f} s" for n, v in parts)
        + ")",
        f"reward: {s['reward_first']:.3f} (first {w} steps) -> {s['reward_last']:.3f} (last {w})",
        f"accuracy: {s['accuracy_first']:.3f} -> {s['accuracy_last']:.3f}",
        f"rollout: {s['rollout_tokens_per_s']:.0f} tok/s, acceptance length "
        f"{s['acceptance_length']:.2f}, |engine-learner logprob| {s['logprob_delta_mean']:.4f}",
    ]
    if "eval_first_greedy_accuracy" in s:
        lines.append(
            f"eval greedy acc {s['eval_first_greedy_accuracy']:.3f} -> "
            f"{s['eval_last_greedy_accuracy']:.3f}, sampled "
            f"{s['eval_first_sampled_accuracy']:.3f} -> {s['eval_last_sampled_accuracy']:.3f}"
        )
    share = s.get("spec_step_share", float("nan"))
    if share == share:  # nan: rows from before the metric (or another backend's)
        lines.append(speculation_line(share, s["acceptance_length"]))
    if "drafter_updates" in s:
        lines.append(
            f"drafter: {s['drafter_updates']} updates during the run (version "
            f"{s['drafter_version']}, {s['drafter_time_share']:.1%} of step time), draft "
            f"acceptance {s['draft_acceptance_first']:.2f} -> {s['draft_acceptance_last']:.2f}"
        )
    if "speed_rollout_speedup" in s:
        lines.append(
            f"rollout speedup (same prompts, weights, seeds): {s['speed_rollout_speedup']:.2f}x "
            f"({s['speed_spec_tokens_per_s']:.0f} vs {s['speed_plain_tokens_per_s']:.0f} tok/s "
            f"plain, acceptance length {s['speed_spec_acceptance_length']:.2f})"
        )
    return "\n".join(lines)


def speculation_line(share: float, acceptance: float) -> str:
    """What speculation did in the run, and why so little when it barely ran."""
    line = f"speculation: drafted in {share:.0%} of decode steps"
    if share >= 0.05:
        return line + f" (acceptance length {acceptance:.2f} over all steps)"
    return line + (
        " (the controller (rollout.max_tokens_per_forward='auto') drafts only where it expects "
        "more tokens/s: with many live rows a verify forward costs more than the drafts it "
        "accepts, and short replies leave no tail; long replies do: --preset reasoning)"
    )


# --------------------------------------------------------------------------- plots


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _series(rows: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_reward(rows: Sequence[dict], evals: Sequence[dict], path: Path) -> Path:
    fig, ax = _figure("Reward and accuracy", "value")
    for key in ("reward_mean", "accuracy"):
        ax.plot(*_series(rows, key), label=f"train {key}")
    for key in ("greedy_accuracy", "sampled_accuracy"):
        ax.plot(*_series(evals, key), "o--", label=f"eval {key} (x = updates)")
    ax.legend()
    return _save(fig, path)


def plot_key(rows: Sequence[dict], key: str, title: str, ylabel: str, path: Path) -> Path:
    fig, ax = _figure(title, ylabel)
    ax.plot(*_series(rows, key))
    return _save(fig, path)


def plot_step_time(rows: Sequence[dict], path: Path) -> Path:
    fig, ax = _figure("Step-time breakdown", "seconds")
    steps, bottom = [r["step"] for r in rows], [0.0] * len(rows)
    phases = [*BREAKDOWN, ("other", None)]
    for name, key in phases:
        if key is None:
            values = [max(0.0, r["step_time_s"] - b) for r, b in zip(rows, bottom, strict=True)]
        else:
            values = [r.get(key, 0.0) for r in rows]
        ax.bar(steps, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.legend()
    return _save(fig, path)


def plot_pipeline(rows: Sequence[dict], path: Path) -> Path:
    """Idle time of the learner and the generator per step, and token staleness (right axis);
    in-flight tokens reused by re-verification when there were any."""
    fig, ax = _figure("Pipeline: idle time and staleness", "seconds idle")
    for key in ("learner_idle_s", "generator_idle_s"):
        ax.plot(*_series(rows, key), label=key.removesuffix("_s").replace("_", " "))
    right = ax.twinx()
    right.set_ylabel("tokens' staleness (versions)")
    right.plot(*_series(rows, "staleness_mean"), "k:", label="mean staleness")
    right.plot(*_series(rows, "staleness_max"), "k.", label="max staleness")
    if any(r.get("reused_tokens") for r in rows):
        right.plot(*_series(rows, "reused_tokens"), "g--", label="reused in-flight tokens")
    handles = ax.get_legend_handles_labels()
    extra = right.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=8)
    return _save(fig, path)


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class RunLogs:
    """What a report reads of one run directory, checked (``read_run``): one metric row per
    step in step order, its eval rows, its speed check, its pipeline mode, and the warning about
    its steps (``None`` when each step from 0 to the last is logged once)."""

    path: Path
    rows: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    speed: dict[str, Any] | None
    mode: str
    warning: str | None


def read_run(run_dir: str | Path) -> RunLogs:
    """The checked logs of the run in ``run_dir`` (``ValueError`` naming what is wrong)."""
    run = RunDir(run_dir)
    logged = run.rows(run.metrics)  # an unreadable or garbled log: RunDirError (a ValueError)
    if not logged:
        raise ValueError(f"no metrics in {run.metrics}: is {run.path} a run directory?")
    check_numbers(logged, run.metrics, NUMERIC, REQUIRED)
    evals = run.rows(run.evals)
    check_numbers(evals, run.evals, EVAL_NUMERIC, ())
    rows = one_row_per_step(logged)
    warning = step_warning([r["step"] for r in logged], run.metrics)
    return RunLogs(run.path, rows, evals, _speed(run), _mode(run), warning)


def read_runs(run_dirs: Sequence[str | Path]) -> list[RunLogs]:
    """``read_run`` of each, in order: the first bad one raises."""
    return [read_run(d) for d in run_dirs]


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_numbers(
    rows: Sequence[dict], log: Path, keys: Sequence[str], required: Sequence[str]
) -> None:
    """``ValueError`` naming the first row of ``log`` that lacks a ``required`` key or holds a
    non-number under one of ``keys``."""
    for r in rows:
        for key in keys:
            if (key in r or key in required) and not _is_number(r.get(key)):
                got = "no" if key not in r else f"a non-numeric ({json.dumps(r[key])[:40]})"
                raise ValueError(
                    f"{log}: the row of step {r['step']} has {got} {key!r}: not a metrics log "
                    "specrl wrote?"
                )


def one_row_per_step(rows: Sequence[dict]) -> list[dict]:
    """One row per step (the last logged of a step wins), in step order."""
    by_step = {r["step"]: r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def step_spans(steps: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``steps`` as inclusive (first, last) runs of consecutive steps."""
    spans: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if spans and s == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], s)
        else:
            spans.append((s, s))
    return spans


def gaps(steps: Sequence[int]) -> list[tuple[int, int]]:
    """The inclusive spans of steps missing from 0 (or the lowest step) to the highest."""
    present = step_spans(steps)
    out, expect = [], min(0, present[0][0])
    for first, last in present:
        if first > expect:
            out.append((expect, first - 1))
        expect = last + 1
    return out


def describe_steps(spans: Sequence[tuple[int, int]]) -> str:
    """``step 3`` / ``steps 1, 4-6``: the first ``LISTED_SPANS`` spans, then ``, ... (N steps)``
    when there are more."""
    count = sum(last - first + 1 for first, last in spans)
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans[:LISTED_SPANS])
    if len(spans) > LISTED_SPANS:
        text += f", ... ({count} steps)"
    return f"step {text}" if count == 1 else f"steps {text}"


def step_warning(steps: Sequence[int], log: Path) -> str | None:
    """One ``warning:`` line naming the steps ``log`` holds more than once and those missing
    from 0 to its last, or ``None`` when each is there once."""
    counts = Counter(steps)
    parts = []
    twice = step_spans([s for s, n in counts.items() if n > 1])
    if twice:
        parts.append(f"{describe_steps(twice)} logged more than once (a second writer?): "
                     "the last row of each is used")  # fmt: skip
    missing = gaps(steps)
    if missing:
        parts.append(f"{describe_steps(missing)} missing")
    return f"warning: {log}: {'; '.join(parts)}" if parts else None


def _speed(run: RunDir) -> dict[str, Any] | None:
    """The speed check in summary.json (``None`` without one); ``ValueError`` if unreadable."""
    if not run.summary.exists():
        return None
    try:
        data = json.loads(run.summary.read_bytes())
    except OSError as e:
        raise ValueError(f"cannot read {run.summary}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, not UTF-8
        raise ValueError(f"{run.summary}: not JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{run.summary}: not a JSON object")
    speed = data.get("speed")
    if speed is not None and not isinstance(speed, dict):
        raise ValueError(f"{run.summary}: 'speed' is not an object")
    return speed


def _mode(run: RunDir) -> str:
    """The run's pipeline mode (and backend when not native), for a plot label; ``?`` when
    config.toml is missing or unreadable (a label only: not worth refusing the report)."""
    try:
        cfg = tomllib.loads(run.config.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, unreadable, not UTF-8 or not TOML
        return "?"
    pipeline, rollout = cfg.get("pipeline"), cfg.get("rollout")
    mode = str(pipeline.get("mode", "sync")) if isinstance(pipeline, dict) else "sync"
    backend = str(rollout.get("backend", "native")) if isinstance(rollout, dict) else "native"
    return mode if backend == "native" else f"{mode}, {backend}"


# --------------------------------------------------------------------------- writing


def write_runs(runs: Sequence[RunLogs], dest: Path, compare: bool = False) -> list[Path]:
    """The first run's plots and summary.md (the warnings of all ``runs`` in it), and with
    ``compare`` compare.png of all, in ``dest`` (created); returns the paths written."""
    main = runs[0]
    rows, evals = main.rows, main.evals
    warnings = [r.warning for r in runs if r.warning is not None]
    md = summary_markdown(summarize(rows, evals, main.speed), f"Run {main.path}", warnings)
    dest.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_reward(rows, evals, dest / "reward_accuracy.png"),
        plot_key(rows, "rollout_tokens_per_s", "Rollout throughput", "tokens/s",
                 dest / "rollout_throughput.png"),
        plot_key(rows, "acceptance_length", "Acceptance length (tokens per verify step)",
                 "tokens", dest / "acceptance_length.png"),
        plot_step_time(rows, dest / "step_time.png"),
        plot_pipeline(rows, dest / "pipeline.png"),
    ]  # fmt: skip
    atomic_write(dest / "summary.md", md)
    paths.append(dest / "summary.md")
    if compare:
        paths.append(plot_comparison(runs, dest / "compare.png"))
    return paths


def write_report(
    run_dir: str | Path, out: str | Path | None = None, compare: Sequence[str | Path] = ()
) -> list[Path]:
    """Plots and summary.md of the run in ``run_dir`` (and compare.png with the ``compare``
    runs) in ``out`` (default ``run_dir``); every run is read and checked before anything is
    written (see the module docstring)."""
    runs = read_runs([run_dir, *compare])
    dest = Path(out) if out is not None else runs[0].path
    return write_runs(runs, dest, compare=bool(compare))


def samples_axis(rows: Sequence[dict]) -> list[int]:
    """Completions trained on after each step (``gen_tokens / response_length`` per step)."""
    total, out = 0, []
    for r in rows:
        n = r.get("gen_tokens", 0) / r["response_length"] if r.get("response_length") else 0
        total += round(n)
        out.append(total)
    return out


def write_comparison(run_dirs: Sequence[str | Path], path: str | Path) -> Path:
    """Reward curves of several runs on one plot, every run read before it is drawn (see the
    module docstring)."""
    return plot_comparison(read_runs(run_dirs), Path(path))


def plot_comparison(runs: Sequence[RunLogs], path: Path) -> Path:
    """Train reward of each run against the completions it trained on."""
    fig, ax = _figure("Train reward", "reward (mean over the step's completions)")
    ax.set_xlabel("completions trained on")
    for run in runs:
        ax.plot(samples_axis(run.rows), [r["reward_mean"] for r in run.rows], "o-",
                markersize=3, label=f"{run.path.name} ({run.mode})")  # fmt: skip
    ax.legend()
    return _save(fig, path)
