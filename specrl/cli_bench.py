"""``specrl bench``: ``generate`` (tokens/s of the engine against itself, transformers and vLLM)
and ``grpo`` (GRPO steps with and without speculation).

Contract: ``register(app)`` adds the ``bench`` group. Each command reads its settings like
every command's (``cli_util.Shortcuts`` over ``specrl.config_bench``): defaults <- ``--config
F.toml`` <- its options, each the same as one key (``GENERATE``, ``GRPO``; an option and a
``--set`` of the same key in one command line are refused; an option given where it cannot apply
is refused in the options' words; a comma list option's text is read first, one line naming it)
<- ``--set section.key=value``. ``bench grpo``'s keys under ``train.`` are
the training run's config (``specrl train --set`` keys: ``--set
train.rollout.prompts_per_step=4``). Every value is checked before any work, each problem one
``error:`` line with exit code 2. ``--json PATH`` is checked writable first
(``specrl.fsutil.result_file_problem``; nothing is created); the results, with the settings used
(``meta.settings``, TOML that ``--config`` reads back), are written atomically at the end, and if
that fails they go to stdout and one ``error:`` line follows.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from specrl import cli_options as opts
from specrl.cli_bench_gpu import register as register_gpu
from specrl.cli_util import Shortcuts, fail, named_as_keys, write_or_print
from specrl.config_bench import (
    GENERATE_APPLIES,
    GRPO_APPLIES,
    GenerateBenchCfg,
    GrpoBenchCfg,
    SettingsError,
)


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group to the main specrl CLI."""
    bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks.")
    bench_app.command("generate")(bench_generate)
    bench_app.command("grpo")(bench_grpo)
    register_gpu(bench_app)
    app.add_typer(bench_app, name="bench")


# --------------------------------------------------------------------------- shared


def comma_list(flag: str, text: str, kind: Callable[[str], Any] = str) -> list[Any]:
    """A comma list option (``kind`` each entry), no empty entry (an empty text: [])."""
    if not text.strip():
        return []
    try:
        items = [kind(x.strip()) for x in text.split(",")]
    except ValueError:
        fail(f"{flag} must be a comma list of {kind.__name__}s, no empty entry: got {text!r}")
    if any(x == "" for x in items):
        fail(f"{flag} must be a comma list, no empty entry: got {text!r}")
    return items


def checked_json(json_path: Path | None) -> None:
    """``--json PATH`` that cannot be written: one line, before any work."""
    from specrl.fsutil import result_file_problem

    if json_path is not None and (problem := result_file_problem(json_path)):
        fail(f"cannot write --json: {problem}")


def save_results(result: dict, path: Path) -> None:
    """Write the results atomically (parents created); if that fails, print them to stdout so
    nothing is lost, then one ``error:`` line."""
    write_or_print(path, json.dumps(result, indent=1))


JsonOpt = Annotated[Path | None, typer.Option("--json", help="write results here")]
FROM_RESULT = ", or the meta.settings of a result"  # what else --config may be


# --------------------------------------------------------------------------- bench generate

# The options kept beside --config/--set, each the same as one key (giving both is refused).
GENERATE = Shortcuts(
    GenerateBenchCfg,
    GenerateBenchCfg.WHAT,
    {
        "model": ("--model", "model.name"),
        **named_as_keys("model", "dtype"),
        **named_as_keys("bench", "batch_sizes", "new_tokens", "repeats", "group_size", "compare"),
        "spec": ("--spec", "spec.drafters"),
        **named_as_keys("spec", "num_spec_tokens", "drafter"),
        "spec_exact": ("--spec-exact", "spec.exact"),
    },
    rules=GENERATE_APPLIES,
)
g = GENERATE.option


def bench_generate(
    ctx: typer.Context,
    config: Annotated[Path | None, GENERATE.config_option(FROM_RESULT)] = None,
    sets: Annotated[
        list[str] | None,
        GENERATE.set_option(
            'bench.batch_sizes=[1,8], spec.drafters=["ngram"], spec.exact="sample"'
        ),
    ] = None,
    batch_sizes: Annotated[str | None, g("batch_sizes", "comma list")] = None,
    new_tokens: Annotated[int | None, g("new_tokens", "tokens per sequence")] = None,
    compare: Annotated[
        str | None, g("compare", "comma list of other engines: hf (transformers), vllm (the extra)")
    ] = None,
    json_path: JsonOpt = None,
    model: Annotated[str | None, g("model", opts.HELP["model"])] = None,
    dtype: Annotated[str | None, g("dtype", opts.HELP["dtype"])] = None,
    repeats: Annotated[int | None, g("repeats", "timed runs per point, >= 1 (best kept)")] = None,
    spec: Annotated[
        str | None, g("spec", "comma list of drafters to compare with no speculation")
    ] = None,
    num_spec_tokens: Annotated[
        int | None, g("num_spec_tokens", opts.HELP["num_spec_tokens"])
    ] = None,
    group_size: Annotated[
        int | None, g("group_size", "samples per prompt (GRPO group); divides batch")
    ] = None,
    drafter: Annotated[str | None, g("drafter", opts.HELP["drafter"])] = None,
    spec_exact: Annotated[str | None, g("spec_exact", opts.HELP["spec_exact"])] = None,
) -> None:
    """Tokens/s of the engine at several batch sizes: no speculation vs each --spec drafter,
    and optionally transformers (--compare hf) and vLLM (--compare vllm), all in one run, with
    ratios.

    Settings: defaults <- --config FILE <- the options <- --set section.key=value (every key:
    specrl.config_bench.GenerateBenchCfg); the JSON result records them (meta.settings)."""
    from specrl.bench import GenerateBench, default_drafter_path, run_generate_bench
    from specrl.models.checkpoints import CheckpointError, resolve_model
    from specrl.spec.config import missing_head

    cfg = GENERATE.read_parsed(ctx, generate_values).cfg
    b, s = cfg.bench, cfg.spec
    check_compare(b.compare)
    methods = check_methods(s.drafters, s.num_spec_tokens)
    if any(n % min(n, b.group_size) for n in b.batch_sizes):
        fail(f"--group-size {b.group_size} must be >= 1 and divide every batch size >= it "
             f"{b.batch_sizes}")  # fmt: skip
    torch_dtype = opts.parse_dtype(cfg.model.dtype)
    checked_json(json_path)
    takers = [m for m in methods if m == "draft" or _takes_head(m)]
    if s.drafter is not None and len(takers) > 1:
        fail(f"--drafter names one drafter; --spec has {len(takers)} that take one "
             f"({', '.join(takers)}): time them in separate runs")  # fmt: skip
    for method in methods:  # before any work: a learned drafter needs its head
        cached = s.drafter is None and _takes_head(method)
        if cached and default_drafter_path(cfg.model.name, method) is None:
            fail(missing_head(method))
    bench = GenerateBench(model=cfg.model.name, dtype=torch_dtype, batch_sizes=b.batch_sizes,
                          new_tokens=b.new_tokens, compare=b.compare, repeats=b.repeats,
                          methods=methods, k=s.num_spec_tokens, group_size=b.group_size,
                          drafter=s.drafter, exact=s.exact, controller=s.controller,
                          settings=cfg.to_toml())  # fmt: skip
    try:
        resolve_model(cfg.model.name)
        result = run_generate_bench(bench)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    if json_path is not None:
        save_results(result, json_path)


def generate_values(named: dict[str, Any]) -> dict[str, Any]:
    """The values of the options of ``bench generate`` given (``named``: {parameter name:
    value}) as the settings take them, each checked on its own (one line naming the option)."""
    from specrl.spec.verify import RULES

    given = dict(named)
    if "batch_sizes" in given:
        given["batch_sizes"] = parse_batch_sizes(given["batch_sizes"])
    for name, flag in (("new_tokens", "--new-tokens"), ("repeats", "--repeats")):
        if given.get(name, 1) < 1:
            fail(f"{flag} must be >= 1, got {given[name]}")
    if "compare" in given:
        given["compare"] = parse_compare(given["compare"])
    if "spec" in given:
        given["spec"] = [
            x.strip() for x in given["spec"].split(",") if x.strip() not in ("", "none")
        ]
    if given.get("spec_exact", RULES[0]) not in RULES:
        fail(f"--spec-exact must be one of {', '.join(RULES)}, got {given['spec_exact']!r}")
    if "dtype" in given:
        opts.parse_dtype(given["dtype"])  # an unknown dtype: one line naming the choices
    return given


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: a comma list of integers in [1, ``MAX_BATCH``], no empty entry."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        fail(f"--batch-sizes must be integers, comma-separated, no empty entry: got {text!r}")
    if not sizes or min(sizes) < 1:
        fail(f"batch sizes must be >= 1, got {text!r}")
    if max(sizes) > opts.MAX_BATCH:
        fail(f"batch sizes must be <= {opts.MAX_BATCH}, got {max(sizes)}")
    return sizes


def parse_compare(text: str) -> list[str]:
    """The --compare engines, each known (installed: ``check_compare``)."""
    others = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in others if x not in ("hf", "vllm")]
    if unknown:
        fail(f"unknown --compare engine {unknown[0]!r} (choose hf, vllm)")
    return others


def check_compare(others: list[str]) -> None:
    """An engine to compare whose package is missing is refused, never ignored."""
    if "vllm" in others and importlib.util.find_spec("vllm") is None:
        fail("--compare vllm needs the vllm extra (pip install 'specrl[vllm]')")
    if "hf" in others and importlib.util.find_spec("transformers") is None:
        fail("--compare hf needs transformers (pip install transformers)")


def _takes_head(method: str) -> bool:
    """Whether ``method`` runs a trained head (``--drafter`` or the cached one)."""
    from specrl.spec.proposers import proposer_takes

    return proposer_takes(method, "drafter_path")


def check_methods(drafters: list[str], k: int) -> list[str]:
    """The drafters compared ('none' left out), each registered; k >= 1 to draft."""
    from specrl.spec.config import SpecConfig

    methods = [m for m in drafters if m != "none"]
    try:
        for m in methods:
            SpecConfig(m, k).validate()
    except ValueError as e:
        fail(str(e))
    if methods and k < 1:
        fail(f"--num-spec-tokens {k} drafts nothing with --spec {','.join(methods)}: give "
             "k >= 1")  # fmt: skip
    return methods


# --------------------------------------------------------------------------- bench grpo

# The options kept beside --config/--set, each the same as one key (giving both is refused).
GRPO = Shortcuts(
    GrpoBenchCfg,
    GrpoBenchCfg.WHAT,
    {
        **named_as_keys("bench", "mode", "steps", "warmup", "threads"),
        "preset": ("--preset", "workload.preset"),
        "train_config": ("--train-config", "workload.config"),
        **named_as_keys("runs", "drafters", "batches"),
        **named_as_keys("interleaved", "ceiling", "ceiling_k", "ceiling_accept"),
    },
    rules=GRPO_APPLIES,
)
r = GRPO.option
COMMA_LISTS: dict[str, type] = {"drafters": str, "batches": int, "ceiling_accept": float}


def bench_grpo(
    ctx: typer.Context,
    config: Annotated[Path | None, GRPO.config_option(FROM_RESULT)] = None,
    sets: Annotated[
        list[str] | None,
        GRPO.set_option(
            "bench.steps=2, runs.batches=[1,4]; a key under train. sets the training run's "
            "config (specrl train --set keys), e.g. train.rollout.prompts_per_step=4"
        ),
    ] = None,
    mode: Annotated[
        str | None,
        r(
            "mode",
            "runs (a training run per variant, then a rollout sweep by batch) or "
            "interleaved (one run, each step rolled out plain and speculative)",
        ),
    ] = None,  # fmt: skip
    preset: Annotated[str | None, r("preset", "specrl train preset, e.g. reasoning")] = None,
    train_config: Annotated[
        Path | None, r("train_config", "run config TOML (as specrl train --config)")
    ] = None,
    steps: Annotated[int | None, r("steps", "RL steps")] = None,
    warmup: Annotated[int | None, r("warmup", "first steps left out")] = None,
    threads: Annotated[int | None, r("threads", "torch threads (0: as torch chooses)")] = None,
    drafters: Annotated[
        str | None,
        r("drafters", "mode runs: comma list of drafters, NAME/S with S sibling candidates"),
    ] = None,
    batches: Annotated[
        str | None, r("batches", "mode runs: comma list of max batches of the sweep")
    ] = None,
    ceiling: Annotated[
        bool | None,
        r("ceiling", "mode interleaved: add the oracle-drafter rollouts (the ceiling)"),
    ] = None,
    ceiling_k: Annotated[
        int | None, r("ceiling_k", "with --ceiling: the oracle's largest k")
    ] = None,
    ceiling_accept: Annotated[
        str | None,
        r(
            "ceiling_accept",
            "with --ceiling: comma list of per-token acceptances in (0, 1], one "
            "oracle rollout each",
        ),
    ] = None,  # fmt: skip
    json_path: JsonOpt = None,
) -> None:
    """GRPO steps with and without speculation from the same weights and seeds: rollout and
    step time ratios, speedup by batch, the free-drafter and oracle ceilings.

    Settings: defaults <- --config FILE <- the options <- --set section.key=value (every key:
    specrl.config_bench.GrpoBenchCfg; train.KEY: the training run's config, over --preset and
    --train-config); the JSON result records them (meta.settings, meta.configs)."""
    from specrl.bench_grpo import run_configs, run_grpo_bench

    cfg = GRPO.read_parsed(ctx, grpo_values).cfg
    checked_json(json_path)
    errors = run_errors()
    try:
        run_configs(cfg)  # the training runs' configs: checked before any work
        result = run_grpo_bench(cfg, echo=typer.echo)
    except errors as e:
        fail(str(e))
    if json_path is not None:
        save_results(result, json_path)


def grpo_values(named: dict[str, Any]) -> dict[str, Any]:
    """The values of the options of ``bench grpo`` given (``named``: {parameter name: value})
    as the settings take them: the comma lists (``COMMA_LISTS``) as lists."""
    return {n: comma_list(GRPO.options[n][0], v, COMMA_LISTS[n]) if n in COMMA_LISTS else v
            for n, v in named.items()}  # fmt: skip


def run_errors() -> tuple[type[Exception], ...]:
    """What a bad run config, model, environment or reward raises: one ``error:`` line."""
    from specrl.config import ConfigError
    from specrl.envs.files import FileEnvError
    from specrl.models.checkpoints import CheckpointError
    from specrl.rewards import RewardError

    return (ConfigError, CheckpointError, FileEnvError, RewardError, SettingsError)
