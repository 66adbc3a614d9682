"""``specrl bench grpo``: GRPO steps with and without speculation, from the same weights and seeds.

Contract: ``run_grpo_bench(b, build=None, echo=print)`` measures the settings ``b``
(``specrl.config_bench.GrpoBenchCfg``) and returns a JSON-ready ``{"meta": ...}`` with, by
``b.bench.mode``:

- ``'runs'`` (the headline, benchmarks/results/grpo_spec_vs_plain.json): a training run of
  ``bench.steps`` steps per variant, no speculation (``none``) and each of ``runs.drafters``
  (``NAME/S``: with ``rollout.spec_siblings=S``), each from the same initial weights with the same
  prompts and request seeds. ``results``: per variant the means over the steps after
  ``bench.warmup`` (``KEYS``) and the ratios against ``none`` computed from those means
  (``rollout_speedup`` = tokens/s over none's, ``gen_time_ratio`` = none's generation time over
  this one's, ``step_speedup`` = none's step time over this one's). ``batch_sweep``: on each
  speculative variant's final weights and drafter state, the next steps' prompts rolled out plain
  and speculative at each ``runs.batches`` max batch (``pipelines.speed.measure_speedup``: the
  speedup and ``free_draft_speedup``, the free-drafter ceiling), with plain decoding's roofline
  (``specrl.bench.roofline_tokens_per_s``, the reference CPU).
- ``'interleaved'`` (benchmarks/results/reasoning_spec_vs_plain.json, on the ``reasoning``
  preset): one run; each step's prompts are rolled out plain (timing only) and speculative (the
  rollout the learner trains on), the order alternating from step to step, and with
  ``interleaved.ceiling`` once more per ``ceiling_accept`` by an oracle drafter
  (``OracleProposer``). ``steps``: per step generation and learner seconds, ``same_tokens``
  (plain and speculative emitted the same tokens: so under sample-exact verification the plain
  step is the same RL step), lengths, acceptance, reward; ``summary`` over the steps after the
  warmup, from summed times: ``rollout_speedup`` (plain / spec generation), ``step_speedup``
  ((plain gen + learn) / (spec gen + learn)), the free-drafter speedups (drafting time
  removed), ``ceilings`` per acceptance and, for the first, ``ceiling_*``.

``meta``: ``specrl.bench.run_metadata()``, the settings (``settings``: ``b.to_toml()``) and the
training runs' configs (``configs``: variant -> TOML). ``run_configs(b)`` gives those configs
(specrl train's defaults <- ``workload.preset`` <- ``workload.config`` <- ``b.train`` <- what
the bench sets: ``FORCED``, refused in ``b.train``), each checked to run here (``check_runnable``:
the native engine in this process); a problem is one ``ConfigError`` line, before any work.
``build`` (default ``pipelines.build.build_run``) makes a run's parts from its config (tests
pass a tiny model). The oracle drafter and its rollouts are ``specrl.gpubench.oracle``'s (the
GPU check times them too). Nothing here prints but through ``echo``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import BaseModel

from specrl import settings
from specrl.bench import roofline_tokens_per_s, run_metadata
from specrl.config import Config, ConfigError, preset_path, validate_config
from specrl.config_bench import GrpoBenchCfg
from specrl.errors import did_you_mean
from specrl.gpubench import oracle

if TYPE_CHECKING:
    from specrl.engine import Engine
    from specrl.pipelines.build import RunParts
    from specrl.pipelines.state import TrainStream

Echo = Callable[[str], None]
Build = Callable[[Config], "RunParts"]

# Means kept per variant (mode 'runs'), from the training loop's metric rows.
KEYS = ("rollout_tokens_per_s", "gen_time_s", "gen_tokens", "acceptance_length", "train_time_s",
        "step_time_s", "reward_mean")  # fmt: skip
# Run-config keys the bench sets itself (refused in ``b.train``), and what sets them.
FORCED = (
    ("run.steps", "bench.steps"),
    ("run.eval_every", "the bench (no evaluation)"),
    ("run.checkpoint_every", "the bench (no checkpoints)"),
    ("run.run_dir", "the bench (a temporary directory)"),
)
FORCED_RUNS = (
    ("rollout.spec", "runs.drafters"),
    ("rollout.spec_siblings", "runs.drafters (NAME/S)"),
)
FEW_ROWS = 4  # a rollout step with at most this many live rows counts as "few rows"


# --------------------------------------------------------------------------- configs


def variants(b: GrpoBenchCfg) -> list[str]:
    """The runs measured: 'none' and each of ``runs.drafters`` (mode 'runs'); 'spec', the
    configured drafter (mode 'interleaved')."""
    return ["none", *b.runs.drafters] if b.bench.mode == "runs" else ["spec"]


def _spec_items(variant: str) -> list[str]:
    """The run-config overrides of a 'runs' variant: ``NAME`` or ``NAME/S``."""
    if variant == "spec":
        return []
    method, slash, siblings = variant.partition("/")
    if slash and not (siblings.isdigit() and int(siblings) > 0):
        raise ConfigError(f"bad value for runs.drafters: {variant!r}: S of NAME/S must be an "
                          "integer >= 1")  # fmt: skip
    return [
        f"rollout.spec={json.dumps(method)}",
        *([f"rollout.spec_siblings={siblings}"] * bool(slash)),
    ]


def _holder(table: dict[str, Any], key: str) -> tuple[dict[str, Any], str]:
    """The table in ``table`` that holds dotted ``key`` ({} if none) and the key's last part."""
    *parents, name = key.split(".")
    node: Any = table
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else {}), name


def _given(table: dict[str, Any], key: str) -> bool:
    node, name = _holder(table, key)
    return name in node


def _drop(table: dict[str, Any], key: str) -> None:
    node, name = _holder(table, key)
    node.pop(name, None)


def run_table(b: GrpoBenchCfg) -> dict[str, Any]:
    """The training run's TOML table: ``workload.preset`` <- ``workload.config`` <- ``b.train``
    (``ConfigError`` for a key the bench sets itself)."""
    forced = FORCED + (FORCED_RUNS if b.bench.mode == "runs" else ())
    for key, by in forced:
        if _given(b.train, key):
            raise ConfigError(f"train.{key} is set by {by}: leave it out of train")
    drafters = b.runs.drafters if b.bench.mode == "runs" else []
    if "none" in [d.partition("/")[0] for d in drafters] or len(set(drafters)) < len(drafters):
        raise ConfigError(f"bad value for runs.drafters: {drafters}: each drafter once, and "
                          "not 'none' (it always runs)")  # fmt: skip
    with settings.errors_as(ConfigError):
        data = settings.read_toml(preset_path(p)) if (p := b.workload.preset) else {}
        if b.workload.config is not None:
            path = Path(b.workload.config).expanduser()
            data = settings.merge(data, settings.read_toml(path, "run config"))
        return settings.merge(data, b.train)


def run_configs(b: GrpoBenchCfg) -> dict[str, Config]:
    """Each variant's training-run config, validated and checked to run here. A run-config key
    that cannot apply to some variants (``rollout.num_spec_tokens`` without speculation) is
    left out of those; one that applies to none is refused (``ConfigError``)."""
    table = run_table(b)
    if unknown := next(unknown_keys(b.train, Config), None):
        keys = [f"train.{k}" for k in settings.schema_keys(Config)]
        raise ConfigError(
            f"unknown train key 'train.{unknown}'{did_you_mean(f'train.{unknown}', keys)}"
        )
    forced = [f"run.steps={b.bench.steps}", "run.eval_every=0", "run.checkpoint_every=0"]
    with settings.errors_as(ConfigError):
        datas = {
            v: settings.apply_overrides(table, [*forced, *_spec_items(v)]) for v in variants(b)
        }
    try:
        loose = {v: {r.key for r in validate_config(d, check_applies=False).inapplicable()}
                 for v, d in datas.items()}  # fmt: skip
        nowhere = set.intersection(*loose.values())
        configs = {}
        for v, data in datas.items():
            for key in loose[v] - nowhere:
                _drop(data, key)
            configs[v] = validate_config(data)
    except ConfigError as e:
        raise ConfigError(f"train: {e}") from None
    for variant, cfg in configs.items():
        try:
            check_runnable(cfg, b.bench.mode)
        except ConfigError as e:
            where = "train" if variant in ("none", "spec") else f"runs.drafters {variant!r}"
            raise ConfigError(f"{where}: {e}") from None
    return configs


def unknown_keys(table: dict[str, Any], model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """The dotted keys of ``table`` that ``model`` has no field for (below a value field,
    whatever its value, none)."""
    for key, value in table.items():
        info = model.model_fields.get(key)
        if info is None:
            yield f"{prefix}{key}"
        elif (sub := settings.submodel(info.annotation)) is not None and isinstance(value, dict):
            yield from unknown_keys(value, sub, f"{prefix}{key}.")


def check_runnable(cfg: Config, mode: str) -> None:
    """``ConfigError`` unless ``cfg`` rolls out on the native engine in this process (the bench
    times it and sets its batch) and, for mode 'interleaved', steps synchronously."""
    from specrl.backends import plan_rollout
    from specrl.pipelines.validate import check_names

    check_names(cfg)
    plan = plan_rollout(cfg)
    need = "bench grpo times the native engine in this process: it needs "
    if plan.backend != "native":
        raise ConfigError(f"{need}rollout.backend='native' (got {plan.backend!r})")
    if plan.placement != "inline" or plan.workers is not None:
        raise ConfigError(f"{need}the engine inline (rollout.placement 'inline', or 'auto' with "
                          "pipeline.mode 'sync'; no cluster.rollout_workers)")  # fmt: skip
    if mode == "interleaved" and cfg.pipeline.mode != "sync":
        raise ConfigError("bench.mode='interleaved' times synchronous steps: it needs "
                          f"train.pipeline.mode='sync' (got {cfg.pipeline.mode!r})")  # fmt: skip


# --------------------------------------------------------------------------- the run


def run_grpo_bench(b: GrpoBenchCfg, build: Build | None = None, echo: Echo = print) -> dict:
    """Measure ``b`` (see the module docstring); ``build`` makes a run's parts."""
    if build is None:
        from specrl.pipelines.build import build_run as build
    configs = run_configs(b)
    if b.bench.mode == "runs":
        body = measure_runs(b, configs, build, echo)
    else:
        body = measure_interleaved(b, configs["spec"], build, echo)
    toml = {v: cfg.to_toml() for v, cfg in configs.items()}
    meta = run_metadata() | {"settings": b.to_toml(), "configs": toml}
    return {"meta": meta, **body}


def _use_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def measure_runs(b: GrpoBenchCfg, configs: dict[str, Config], build: Build, echo: Echo) -> dict:
    """Mode 'runs': ``results`` (with ratios) and ``batch_sweep``; prints both tables."""
    results, sweep = [], []
    for variant, cfg in configs.items():
        means, rows = run_variant(b, variant, cfg, build, echo)
        results.append(means)
        sweep += rows
    results = with_ratios(results)
    for line in runs_table(results, sweep):
        echo(line)
    return {"results": results, "batch_sweep": sweep}


def run_variant(
    b: GrpoBenchCfg, variant: str, cfg: Config, build: Build, echo: Echo
) -> tuple[dict, list[dict]]:
    """Train ``cfg`` for ``bench.steps`` steps; its means and, if it speculates, its sweep."""
    from specrl.pipelines.signals import StopRequest
    from specrl.pipelines.train import train

    torch.manual_seed(cfg.run.seed)  # the same initial weights for every variant
    with tempfile.TemporaryDirectory() as run_dir, closing(build(cfg)) as parts:
        _use_threads(b.bench.threads)
        # no signal handlers of the run's own (stop given): Ctrl-C ends the bench at once
        rows = train(parts, run_dir, progress=False, echo=echo, stop=StopRequest())
        means = variant_means(variant, rows, b.bench.warmup)
        sweep = [] if variant == "none" else batch_sweep(parts, variant, b)
    return means, sweep


def variant_means(variant: str, rows: Sequence[dict], warmup: int) -> dict:
    """The means of ``KEYS`` over the rows after ``warmup``."""
    kept = rows[warmup:]
    means = {k: statistics.fmean(float(r[k]) for r in kept) for k in KEYS}
    return {"spec": variant, "steps_measured": len(kept)} | means


def with_ratios(results: list[dict]) -> list[dict]:
    """Each result with its ratios against the 'none' result."""
    base = next(r for r in results if r["spec"] == "none")
    return [
        r | {
            "rollout_speedup": _ratio(r["rollout_tokens_per_s"], base["rollout_tokens_per_s"]),
            "gen_time_ratio": _ratio(base["gen_time_s"], r["gen_time_s"]),
            "step_speedup": _ratio(base["step_time_s"], r["step_time_s"]),
        }
        for r in results
    ]  # fmt: skip


def batch_sweep(parts: RunParts, variant: str, b: GrpoBenchCfg) -> list[dict]:
    """Plain vs speculative rollouts at each ``runs.batches`` max batch, new prompts each time
    (after the run's last step: no history the drafter made itself), and plain decoding's
    roofline at that batch."""
    from specrl.pipelines.speed import measure_speedup

    engine = parts.backend.engine
    rows = []
    for i, batch in enumerate(b.runs.batches):
        engine.max_batch = batch
        step = b.bench.steps + i
        speed = measure_speedup(parts, step)
        rows.append(
            {"spec": variant, "max_batch": batch} | speed | roofline(parts, step, batch, speed)
        )
    return rows


def roofline(parts: RunParts, step: int, batch: int, speed: dict[str, float]) -> dict[str, float]:
    """Plain decoding's roofline (reference CPU) for step ``step``'s rollout at max batch
    ``batch``: live rows min(batch, sequences), context the mean prompt and half the mean reply;
    and the plain rollout's fraction of it."""
    from specrl.pipelines.state import TrainStream

    prompts = TrainStream.of(parts.plan, parts.env).draw(step)
    sequences = len(prompts) * parts.plan.sampling.group_size
    prompt = statistics.fmean(len(parts.codec.prompt_ids(p)) for p in prompts)
    context = int(prompt + speed["plain_tokens"] / max(sequences, 1) / 2)
    model = parts.backend.engine.model
    dtype = next(model.parameters()).dtype
    roof = roofline_tokens_per_s(model.config, min(batch, sequences), dtype, max(context, 1))
    return {"plain_roofline_tokens_per_s": roof,
            "plain_fraction_of_roofline": speed["plain_tokens_per_s"] / roof}  # fmt: skip


def runs_table(results: list[dict], sweep: list[dict]) -> list[str]:
    """The two tables of mode 'runs', as lines."""

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = ["", f"{'spec':8} {'tok/s':>8} {'gen s':>7} {'acc.len':>8} {'step s':>7} "
                 f"{'rollout x':>10} {'step x':>7}"]  # fmt: skip
    lines += [f"{r['spec']:8} {r['rollout_tokens_per_s']:8.1f} {r['gen_time_s']:7.1f} "
              f"{r['acceptance_length']:8.2f} {r['step_time_s']:7.1f} "
              f"{x(r['rollout_speedup']):>10} {x(r['step_speedup']):>7}"
              for r in results]  # fmt: skip
    if sweep:
        lines += ["", f"{'spec':8} {'batch':>6} {'plain tok/s':>12} {'spec tok/s':>11} "
                      f"{'acc.len':>8} {'speedup':>8} {'free-draft x':>13}"]  # fmt: skip
        lines += [f"{s['spec']:8} {s['max_batch']:6d} {s['plain_tokens_per_s']:12.1f} "
                  f"{s['spec_tokens_per_s']:11.1f} {s['spec_acceptance_length']:8.2f} "
                  f"{s['rollout_speedup']:8.2f} {s['free_draft_speedup']:13.2f}"
                  for s in sweep]  # fmt: skip
    return lines


# --------------------------------------------------------------------------- interleaved


def measure_interleaved(b: GrpoBenchCfg, cfg: Config, build: Build, echo: Echo) -> dict:
    """Mode 'interleaved': ``steps`` (one row per step) and ``summary``."""
    from specrl.engine import Engine
    from specrl.pipelines.state import TrainStream

    torch.manual_seed(cfg.run.seed)
    ceiling = b.interleaved
    with closing(build(cfg)) as parts:
        _use_threads(b.bench.threads)
        oracles = {}
        if ceiling.ceiling:  # over the run's engine model, shared: it follows every update
            model = parts.backend.engine.model
            for a in ceiling.ceiling_accept:
                oracles[a] = Engine(model, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed)
        rows, stream = [], TrainStream.of(parts.plan, parts.env)
        for step in range(b.bench.steps):
            row = interleaved_step(parts, stream, step, oracles, ceiling.ceiling_k)
            rows.append(row)
            echo(step_line(row))
    summary = summarize(rows[b.bench.warmup :])
    echo(str({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))
    return {"summary": summary, "steps": rows}


def interleaved_step(
    parts: RunParts, stream: TrainStream, step: int, oracles: dict[float, Engine], ceiling_k: int
) -> dict:
    """Step ``step``: its prompts rolled out plain and speculative (order alternating), once
    per oracle engine (keyed by per-token acceptance), then the learner on the speculative
    rollout."""
    from specrl.pipelines.state import StepState
    from specrl.pipelines.step import collect, learn

    prompts = stream.draw(step)  # outside every timed window
    if step % 2 == 0:
        plain_s, plain, few = plain_rollout(parts, prompts, step)
    t0 = time.perf_counter()
    batch = collect(parts, prompts, step)
    spec_s = time.perf_counter() - t0
    if step % 2 == 1:
        plain_s, plain, few = plain_rollout(parts, prompts, step)
    ceilings = {a: oracle.oracle_rollout(parts, e, prompts, step, plain, ceiling_k, a)
                for a, e in oracles.items()}  # fmt: skip
    t1 = time.perf_counter()
    learned = learn(parts, StepState(step, step), batch, spec_s)  # a fresh run: version = step
    learn_s = time.perf_counter() - t1
    m = batch.metrics
    lengths = [len(c.token_ids) for c in batch.completions]
    return {
        "step": step,
        "plain_gen_s": plain_s,
        "spec_gen_s": spec_s,
        "learn_s": learn_s,
        "spec_draft_s": m["draft_s"],
        "gen_share_of_plain_step": plain_s / (plain_s + learn_s),
        "same_tokens": [c.token_ids for c in plain] == [c.token_ids for c in batch.completions],
        "tokens": sum(lengths),
        "length_p10_p50_p90_max": [float(x) for x in np.percentile(lengths, [10, 50, 90, 100])],
        "plain_time_share_at_most_4_rows": few,
        "acceptance_length": m["acceptance_length"],
        "spec_step_share": m["spec_step_share"],
        "reward_mean": m["reward_mean"],
        "accuracy": m["accuracy"],
        "loss": learned.get("learner_loss"),
        "oracle": {
            str(a): {"gen_s": s, "acceptance_length": acc, "same": same}
            for a, (s, acc, same) in ceilings.items()
        },  # fmt: skip
    }


def step_line(row: dict) -> str:
    """One step of mode 'interleaved', as a console line."""
    oracle = "".join(f" | oracle {a}: {o['gen_s']:.1f}s acc {o['acceptance_length']:.2f}"
                     for a, o in row["oracle"].items())  # fmt: skip
    return (f"step {row['step']}: gen plain {row['plain_gen_s']:.1f}s spec "
            f"{row['spec_gen_s']:.1f}s learn {row['learn_s']:.1f}s | accept "
            f"{row['acceptance_length']:.2f} spec steps {row['spec_step_share']:.0%} | lengths "
            f"{row['length_p10_p50_p90_max']} | <=4 rows "
            f"{row['plain_time_share_at_most_4_rows']:.0%} | reward {row['reward_mean']:.3f} | "
            f"same tokens {row['same_tokens']}{oracle}")  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    """The summary of mode 'interleaved' over ``rows``, from summed times."""
    plain = sum(r["plain_gen_s"] for r in rows)
    spec = sum(r["spec_gen_s"] for r in rows)
    learn_s = sum(r["learn_s"] for r in rows)
    undrafted = spec - sum(r["spec_draft_s"] for r in rows)
    ceilings = {}
    for a in rows[0]["oracle"]:
        runs = [r["oracle"][a] for r in rows]
        oracle = sum(x["gen_s"] for x in runs)
        ceilings[a] = {
            "rollout_speedup": plain / oracle,
            "step_speedup": (plain + learn_s) / (oracle + learn_s),
            "acceptance_length_mean": float(np.mean([x["acceptance_length"] for x in runs])),
            "same_tokens": all(x["same"] for x in runs),
        }
    first = {f"ceiling_{k}": v for k, v in next(iter(ceilings.values()), {}).items()}
    return {"ceilings": ceilings} | first | {
        "steps": len(rows),
        "rollout_speedup": plain / spec,
        "step_speedup": (plain + learn_s) / (spec + learn_s),
        "free_drafter_rollout_speedup": plain / undrafted,
        "free_drafter_step_speedup": (plain + learn_s) / (undrafted + learn_s),
        "gen_share_of_plain_step": plain / (plain + learn_s),
        "plain_time_share_at_most_4_rows": float(
            np.mean([r["plain_time_share_at_most_4_rows"] for r in rows])
        ),
        "all_same_tokens": all(r["same_tokens"] for r in rows),
        "acceptance_length_mean": float(np.mean([r["acceptance_length"] for r in rows])),
    }  # fmt: skip


# --------------------------------------------------------------------------- rollouts


def few_rows_share(records: Sequence[Any]) -> float:
    """Share of decode time spent in steps with <= ``FEW_ROWS`` live rows."""
    steps = [r for r in records if r.kind in ("decode", "verify", "draft")]
    total = sum(r.step_time_s for r in steps)
    few = sum(r.step_time_s for r in steps if r.batch_size <= FEW_ROWS)
    return few / total if total else 0.0


def plain_rollout(parts: RunParts, prompts: list, step: int) -> tuple[float, list, float]:
    """Seconds, completions and the <= ``FEW_ROWS`` rows share of step ``step``'s prompts
    rolled out without speculation."""
    seconds, out = oracle.plain_rollout(parts, prompts, step, record=True)
    return seconds, out.completions, few_rows_share(out.stats.step_records)
