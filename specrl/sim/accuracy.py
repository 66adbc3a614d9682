"""The simulator against published measurements: what ``specrl simulate validate`` runs.

Contract: ``run_validation(sections, refit, command, log)`` runs the bundled scenarios and the
published measurements with their documented inputs (no per-row tuning) and returns the record
that benchmarks/results/sim_validate.json holds: ``run_record(command)`` (command, date, machine,
versions) and one dict per section run, in ``SECTIONS`` order; ``log`` gets each section's table
(``section_lines``: every row with its simulated and published value and signed error
``relative_error``) as soon as the section is done. Sections:

- ``fits``: the constants fitted on named measurements (``specrl.sim.published``: DeepEP
  all-to-all, NeMo-RL v0.3 training MFU), refitted here beside what the hardware and training
  TOMLs carry; with ``refit`` also the paper's unpublished workload inputs
  (``specrl.sim.paper.refit_paper_inputs``, minutes) instead of reading them from the TOMLs;
- ``paper``: every row of arXiv 2604.26779's table (``specrl.sim.paper.PAPER_ROWS``, role "fit"
  or "check"), the k-sweep and n-gram shape checks, the EAGLE-3 acceptance refit, and the k
  sweep under the two alternative explanations of the k = 3 level (acceptance decaying along the
  response; forwards wider than the CUDA graph cap run eagerly), the step cost linear in k that
  RL-Zero's sweep implies (``paper.linear_k_costs``) and the share of each sweep row's
  speculative time whose verify forward is compute-bound (``paper.verify_roof``);
- ``heldout``: published serving measurements never used for fitting (``specrl.sim.serving``),
  the median and largest |error| on the GPUs the target names (``TARGET_HARDWARE``), over
  every row and by source group (``ServingPoint.origin``, ``ORIGINS``);
- ``physics``: the free constants of the Hopper profiles (``specrl.sim.fidelity.FREE``) fitted
  leaving each source group out, the left-out groups' errors pooled (the headline), the fit on
  every group and the errors of the constants the profiles carry (minutes);
- ``nemo_rl``: NeMo-RL GRPO step times and v0.3 phase breakdowns (checks of the training model);
- ``tornado``: the sensitivity of the paper scenarios' end-to-end speedup to their uncertain
  inputs.

Every value is a plain float, bool, str or a list/dict of them (``json.dumps`` writes it).
Imports no CLI module. Details: docs/simulator.md, "Validation".
"""

from __future__ import annotations

import datetime
import platform
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from specrl.costmodel.specs import load_hardware, load_model
from specrl.sim.fidelity import (
    FREE,
    current_values,
    errors_under,
    fitted_points,
    leave_one_source_out,
    stats,
)
from specrl.sim.paper import (
    PAPER_ROWS,
    RATIO_GRID,
    RLZERO,
    acceptance_fit,
    drift_alternative,
    graph_alternative,
    linear_k_costs,
    refit_paper_inputs,
    scenario_value,
    verify_roof,
)
from specrl.sim.published import DEEPEP_SOURCE, NEMO_RL_V03_PHASES, fit_all_to_all, fit_training
from specrl.sim.report import sensitivity
from specrl.sim.runner import run_scenario
from specrl.sim.scenario import load_scenario
from specrl.sim.serving import (
    ORIGINS,
    SERVING,
    TARGET_HARDWARE,
    fit_group_acceptance,
    serving_value,
)
from specrl.sim.training import load_efficiency

Log = Callable[[str], None]

SECTIONS = ("fits", "paper", "heldout", "physics", "nemo_rl", "tornado")
DRIFT_CHECK_DECAY = 0.02  # per 1k response tokens: fits the acceptance lengths within 0.1%
ONE_SEED = ("workload.seeds=1",)
TORNADO_SCENARIOS = (
    "paper-8b-rlzero-sync",
    "paper-8b-rlthink-sync",
    "paper-8b-async-lag1",
    "paper-235b-async-512",
)
# NeMo-RL published GRPO step times (v0.6 summary; Llama rows v0.4): (label, scenario, s/step)
NEMO_RL_STEPS: tuple[tuple[str, str, float], ...] = (
    ("Llama-3.1-8B 16xH100 sync", "nemo-rl-llama8b-16xh100", 97.7),
    ("Llama-3.1-8B 16xH100 1-off", "nemo-rl-llama8b-16xh100-async", 74.6),
    ("Qwen3-30B-A3B 32xH100 sync", "nemo-rl-qwen3-30b-a3b-32xh100", 192.0),
    ("Qwen3-30B-A3B 32xH100 1-off", "nemo-rl-qwen3-30b-a3b-32xh100-async", 152.0),
    ("Qwen3-235B 128xH100 sync", "nemo-rl-qwen3-235b-128xh100", 395.0),
    ("Qwen3-235B 256xH100 sync", "nemo-rl-qwen3-235b-256xh100", 312.0),
    ("Qwen3-235B 256xH100 1-off", "nemo-rl-qwen3-235b-256xh100-async", 231.0),
    ("Qwen3-235B 64xGB200 sync", "nemo-rl-qwen3-235b-64xgb200", 286.0),
)


def relative_error(simulated: float, published: float) -> float:
    """The signed error of a simulated value relative to the published one."""
    return (simulated - published) / published


def run_record(command: str) -> dict[str, Any]:
    """Command, date (UTC), machine and versions recorded with the result."""
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "versions": {"numpy": np.__version__},
    }


def run_validation(
    sections: Iterable[str] = SECTIONS, refit: bool = False, command: str = "", log: Log = print
) -> dict[str, Any]:
    """The record of the ``sections`` run (see module doc; unknown names raise ValueError
    before any work); ``log`` gets each table as its section ends."""
    wanted = set(sections)
    if unknown := sorted(wanted - set(SECTIONS)):
        raise ValueError(f"unknown section {unknown[0]!r}: choose from {', '.join(SECTIONS)}")
    result = run_record(command)
    for name in (s for s in SECTIONS if s in wanted):
        result[name] = run_section(name, refit, log)
        for line in section_lines(name, result[name]):
            log(line)
    return result


def run_section(name: str, refit: bool = False, log: Log = print) -> dict[str, Any]:
    """One section's dict (``refit``: the fits section re-derives the paper's inputs, giving
    ``log`` a line per input)."""
    if name == "fits":
        return fits_section(refit, log)
    if name == "paper":
        return paper_section()
    if name == "heldout":
        return heldout_section()
    if name == "physics":
        return physics_section(log)
    if name == "nemo_rl":
        return nemo_rl_section()
    if name == "tornado":
        return tornado_section()
    raise ValueError(f"unknown section {name!r}: choose from {', '.join(SECTIONS)}")


# --------------------------------------------------------------------------- sections


def fits_section(refit: bool = False, log: Log = print) -> dict[str, Any]:
    """All-to-all and training-MFU fits; with ``refit`` the paper's fitted inputs too."""
    latency, efficiency = fit_all_to_all()
    out: dict[str, Any] = {
        "all_to_all": {
            "latency_s": float(latency),
            "efficiency": float(efficiency),
            "source": DEEPEP_SOURCE,
        },
        "training_mfu": fit_training(),
        "training_sources": [m.source for m in NEMO_RL_V03_PHASES],
    }
    if refit:
        out["paper_inputs"] = refit_paper_inputs(log)
    return out


def shape_checks(values: dict[str, float]) -> dict[str, bool]:
    """The paper's qualitative findings, on the simulated rows by key."""
    return {
        "rl_zero_k3_best": values["rlzero-rollout"] > max(values["rlzero-k5"], values["rlzero-k7"]),
        "rl_think_k5_k7_slower_than_none": max(values["rlthink-k5"], values["rlthink-k7"]) < 1.0,
        "ngram_slower_than_none": max(values["rlzero-ngram"], values["rlthink-ngram"]) < 1.0,
    }


def paper_section() -> dict[str, Any]:
    """Every row of the paper's table with its error, the check statistics, the shape checks,
    the acceptance refit and the two alternative explanations of the k sweep."""
    rows, values = [], {}
    for row in PAPER_ROWS:
        sim = scenario_value(row.scenario, row.quantity)
        values[row.key] = sim
        rows.append(dict(row.__dict__, simulated=sim, error=relative_error(sim, row.published)))
    checks = [abs(r["error"]) for r in rows if r["role"] == "check"]
    ratio, worst = acceptance_fit(RLZERO, (), "rlzero-eagle3", "position_ratio", RATIO_GRID)
    scenarios = {r.key: r.scenario for r in PAPER_ROWS}
    return {
        "rows": rows,
        "checks_within_15pct": sum(e <= 0.15 for e in checks),
        "checks": len(checks),
        "median_abs_error_checks": float(np.median(checks)),
        "max_abs_error_checks": float(max(checks)),
        "shape": shape_checks(values),
        "acceptance": {"position_ratio": float(ratio), "worst_error": float(worst)},
        "drift_alternative": _floats(drift_alternative(DRIFT_CHECK_DECAY)),
        "graph_alternative": _floats(graph_alternative()),
        "k_sweep_linear": linear_k_costs(),
        "verify_roof": {key: verify_roof(scenarios[key]) for key in K_SWEEP_KEYS},
    }


K_SWEEP_KEYS = ("rlzero-rollout", "rlzero-k5", "rlzero-k7", "rlthink-k5", "rlthink-k7")


def error_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Count, median and largest |error| of held-out rows."""
    errors = [abs(r["error"]) for r in rows]
    return {
        "n_heldout": len(errors),
        "median_abs_error": float(np.median(errors)),
        "max_abs_error": float(max(errors)),
    }


def heldout_section() -> dict[str, Any]:
    """Every published serving point with its error (acceptance fitted per group on its "fit"
    row), and the held-out rows' error statistics on the target GPUs and on all of them."""
    groups = sorted({p.group for p in SERVING if p.role == "fit"})
    fitted = {g: float(fit_group_acceptance(g)) for g in groups}
    rows = []
    for p in SERVING:
        sim = serving_value(p, fitted.get(p.group))
        rows.append(dict(p.__dict__, kind=p.kind, simulated=sim,
                         error=relative_error(sim, p.published),
                         acceptance_used=p.acceptance_length or fitted.get(p.group)))  # fmt: skip
    held = [r for r in rows if r["role"] == "heldout"]
    scoped = error_stats([r for r in held if r["hardware"] in TARGET_HARDWARE])
    by_origin = {o: error_stats([r for r in held if r["origin"] == o]) for o in ORIGINS}
    return {"rows": rows, "fitted_acceptance": fitted, "target_hardware": list(TARGET_HARDWARE),
            **scoped, "all_hardware": error_stats(held), "by_origin": by_origin,
            "sources": len(by_origin)}  # fmt: skip


def physics_section(log: Log = print) -> dict[str, Any]:
    """The free constants of the Hopper profiles fitted leaving each source out, the pooled
    errors of the left-out sources, and the fit on every source beside what the profiles carry
    (``specrl.sim.fidelity``; minutes)."""
    result = leave_one_source_out(log=log)
    carried = current_values()
    result["carried"] = {c.field: v * c.unit for c, v in zip(FREE, carried, strict=True)}
    result["carried_errors"] = stats(errors_under(carried, fitted_points()))
    return result


def nemo_rl_section() -> dict[str, Any]:
    """NeMo-RL step times (checks) and v0.3 phase times (train and logprobs: fits) with errors."""
    rows = []
    for label, name, published in NEMO_RL_STEPS:
        sim = run_scenario(load_scenario(name, list(ONE_SEED))).no_spec.schedule.step_time
        rows.append(_nemo_row(f"{label} s/step", sim, published, "check"))
    for m in NEMO_RL_V03_PHASES:
        run = run_scenario(load_scenario(m.scenario, list(ONE_SEED))).no_spec
        for phase, published in m.seconds.items():
            sim = run.schedule.step_time if phase == "total" else getattr(run.phases, phase)
            role = "fit" if phase in ("train", "logprobs") else "check"
            rows.append(_nemo_row(f"v0.3 {m.scenario} {phase} s", sim, published, role))
    return {"rows": rows}


def _nemo_row(quantity: str, sim: float, published: float, role: str) -> dict[str, Any]:
    return {"quantity": quantity, "simulated": float(sim), "published": published,
            "error": relative_error(float(sim), published), "role": role}  # fmt: skip


def tornado_section() -> dict[str, Any]:
    """Each ``TORNADO_SCENARIOS`` end-to-end speedup and its swings over the uncertain inputs."""
    out = {}
    for name in TORNADO_SCENARIOS:
        sc = load_scenario(name, list(ONE_SEED))
        center = float(run_scenario(sc).end_to_end_speedup_vs_sync_no_spec)
        out[name] = {"center": center, "swings": [_floats(s.__dict__) for s in sensitivity(sc)]}
    return out


def _floats(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with numpy scalars as Python floats."""
    return {k: float(v) if isinstance(v, np.floating) else v for k, v in d.items()}


# --------------------------------------------------------------------------- tables


def section_lines(name: str, data: dict[str, Any]) -> list[str]:
    """The table of one section's dict (``run_section``), one string per line."""
    render = {"fits": _fits_lines, "paper": _paper_lines, "heldout": _heldout_lines,
              "physics": _physics_lines, "nemo_rl": _nemo_rl_lines,
              "tornado": _tornado_lines}  # fmt: skip
    return render[name](data)


def _fits_lines(data: dict[str, Any]) -> list[str]:
    h100 = load_hardware("h100")
    a2a = data["all_to_all"]
    lines = [f"all-to-all fit ({a2a['source'][:40]}...): latency {a2a['latency_s'] * 1e6:.1f} us,"
             f" efficiency {a2a['efficiency']:.3f} (profiles carry"
             f" {h100.a2a_latency_s * 1e6:.1f} us, {h100.a2a_efficiency})"]  # fmt: skip
    carried = {"dense": "llama-3.1-8b", "moe": "qwen3-30b-a3b"}
    for cls, mfu in data["training_mfu"].items():
        have = load_efficiency(load_model(carried[cls]))
        lines.append(f"training MFU fit, {cls}: train {mfu['train_mfu']:.4f} logprob"
                     f" {mfu['logprob_mfu']:.4f} (table {have.train_mfu} /"
                     f" {have.logprob_mfu})")  # fmt: skip
    return lines


def _paper_lines(data: dict[str, Any]) -> list[str]:
    lines = ["", f"{'role':<6} {'row':<52} {'simulated':>9} {'published':>9} {'error':>8}"]
    lines += [f"{r['role']:<6} {r['label']:<52} {r['simulated']:>9.3f} {r['published']:>9.3f}"
              f" {r['error']:>+8.1%}" for r in data["rows"]]  # fmt: skip
    acc, drift, graph = data["acceptance"], data["drift_alternative"], data["graph_alternative"]
    lin = data["k_sweep_linear"]
    return [
        *lines,
        f"checks within 15%: {data['checks_within_15pct']}/{data['checks']}; median |error|"
        f" {data['median_abs_error_checks']:.1%}, max {data['max_abs_error_checks']:.1%};"
        f" shape {data['shape']}",
        f"EAGLE-3 per-position ratio refitted on 3.32/4.35/5.06: {acc['position_ratio']}"
        f" (worst {acc['worst_error']:.2%})",
        "",
        f"drift alternative (decay {drift['decay_per_1k_tokens']} per 1k tokens, ratio"
        f" {drift['position_ratio']}, overhead {drift['draft_forward_overhead_s'] * 1e3:.2f} ms):"
        + _sweep(drift),
        f"graph alternative (cap {graph['graph_capture_tokens']:.0f} tokens, fitted"
        f" {graph['eager_s_per_layer'] * 1e6:.0f} us per layer):" + _sweep(graph),
        f"RL-Zero's k sweep as a step of base + per_draft x k decode steps: base"
        f" {lin['base']:.2f}, per_draft {lin['per_draft']:.2f} (worst residual"
        f" {lin['worst_residual']:.3f}; a verify forward alone is 1)",
        "verify forwards compute-bound (share of speculative time; mean rows per replica): "
        + ", ".join(
            f"{k} {v['compute_bound_share']:.0%} ({v['mean_rows']:.0f})"
            for k, v in data["verify_roof"].items()
        ),
    ]


def _sweep(alt: dict[str, Any]) -> str:
    return "".join(f" {k} {v:.2f}" for k, v in alt.items() if k.startswith("rl"))


def _heldout_lines(data: dict[str, Any]) -> list[str]:
    lines = ["", f"{'role':<8} {'measurement':<48} {'simulated':>9} {'published':>9} {'error':>8}"]
    lines += [f"{r['role']:<8} {r['label']:<48} {r['simulated']:>9.3f} {r['published']:>9.3f}"
              f" {r['error']:>+8.1%}" for r in data["rows"]]  # fmt: skip
    line = "{n_heldout} rows, median |error| {median_abs_error:.1%}, max {max_abs_error:.1%}"
    lines.append(f"on {'/'.join(data['target_hardware'])} (the target's scope; in sample for the"
                 " fitted engine constants, held out from everything else; --sections physics"
                 " holds the held-out error):"
                 f" {line.format(**data)}; all: {line.format(**data['all_hardware'])};"
                 f" fitted acceptance {data['fitted_acceptance']}")  # fmt: skip
    lines += [f"  {origin:<28} {line.format(**stats)}"
              for origin, stats in data["by_origin"].items()]  # fmt: skip
    return lines


def _physics_lines(data: dict[str, Any]) -> list[str]:
    loso, every = data["leave_one_source_out"], data["all_sources"]
    line = "{rows} rows, median |error| {median:.1%}, max {max:.1%}"
    lines = [
        "",
        f"free constants {', '.join(data['free'])}; loss {data['loss']}",
        f"{'left out':<28} {'rows':>4} {'median':>7} {'max':>7}  constants fitted on the rest",
    ]
    for origin, d in loso["by_origin"].items():
        lines.append(f"{origin:<28} {d['rows']:>4} {d['median']:>7.1%} {d['max']:>7.1%}  "
                     + _constants(d["constants"]))  # fmt: skip
    return [
        *lines,
        f"leave-one-source-out (the headline): {line.format(**loso)}",
        f"fitted on every source (in sample): {line.format(**every)}; "
        + _constants(every["constants"]),
        f"the profiles' carried constants: {line.format(**data['carried_errors'])}; "
        + _constants(data["carried"]),
    ]


def _constants(values: dict[str, float]) -> str:
    units = {c.field: c for c in FREE}
    return ", ".join(f"{k} {round(v / units[k].unit, 6):.3g}{units[k].unit_name}"
                     for k, v in values.items())  # fmt: skip


def _nemo_rl_lines(data: dict[str, Any]) -> list[str]:
    lines = ["", f"{'NeMo-RL check':<48} {'simulated':>9} {'published':>9} {'error':>8}"]
    return lines + [f"{r['quantity'][:48]:<48} {r['simulated']:>9.1f} {r['published']:>9.1f}"
                    f" {r['error']:>+8.1%}  {r['role']}" for r in data["rows"]]  # fmt: skip


def _tornado_lines(data: dict[str, Any]) -> list[str]:
    return [f"tornado {name} ({t['center']:.2f}x): "
            + ", ".join(f"{s['label']} {s['low_speedup']:.2f}-{s['high_speedup']:.2f}"
                        for s in t["swings"]) for name, t in data.items()]  # fmt: skip
