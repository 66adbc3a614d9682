"""One machine's RL steps in the simulator: replay measured rollouts, fit per-machine terms.

Generation: ``replay_seconds`` runs the event-driven rollout over a measured rollout's lengths,
acceptance and draft coverage, priced by a ``calibrate``-fitted profile. Learning:
``fit_learner`` fits the trunk's and the LM head's MFU and a fixed per-step time. Asynchronous
steps: ``fit_overlap`` fits the two slowdowns of ``shared.simulate_shared``. ``MeasuredRollout``
and ``MeasuredStep`` hold measurements; nothing here measures. Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.fit import relative_nnls
from specrl.costmodel.specs import DrafterSpec, HardwareSpec, ModelSpec
from specrl.sim.acceptance import AcceptanceModel, AcceptanceParams
from specrl.sim.rollout import EngineConfig, simulate_rollout
from specrl.sim.shared import Overlap, simulate_shared


@dataclass(frozen=True)
class MeasuredRollout:
    """What one measured rollout gives the simulator to replay."""

    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    k: int  # draft tokens per verify step (0: plain decoding)
    accepted: tuple[int, ...]  # per draft position: rows whose draft there was accepted
    drafted: tuple[int, ...]  # per draft position: rows that drafted there
    spec_rows: int  # (row, verify step) pairs: the denominator of acceptance and coverage
    group: int  # samples per prompt (one prefill per group)
    max_seqs: int  # the engine's batch limit

    def acceptance(self) -> tuple[float, ...]:
        """Conditional per-position acceptance a_i = P(draft i accepted | 1..i-1 accepted)."""
        reach = [self.spec_rows, *self.accepted[: self.k]] + [0] * self.k
        return tuple(reach[i + 1] / reach[i] if reach[i] else 0.0 for i in range(self.k))

    def coverage(self) -> tuple[float, ...]:
        """Per draft position, the share of (row, step) pairs that drafted a token there."""
        drafted = [*self.drafted[: self.k]] + [0] * self.k
        return tuple(d / self.spec_rows if self.spec_rows else 0.0 for d in drafted[: self.k])

    @property
    def acceptance_length(self) -> float:
        return 1.0 + sum(self.accepted) / self.spec_rows if self.spec_rows else 1.0


def replay_seconds(
    run: MeasuredRollout, model: ModelSpec, profile: HardwareSpec, drafter: DrafterSpec | None
) -> float:
    """Simulated wall time of a measured rollout under ``profile`` (see docs/internals.md)."""
    spec = run.k > 0 and run.spec_rows > 0
    costs = StepCostModel(
        target=model,
        hw=profile,
        drafter=drafter if spec else None,
        prefill_group=run.group,
        draft_coverage=run.coverage() if spec else (),
    )
    rates = run.acceptance() if spec else (0.0,)
    acceptance = AcceptanceModel("positional", AcceptanceParams(rates[0], rates))
    cfg = EngineConfig(
        costs,
        acceptance,
        "fixed" if spec else "off",
        run.k if spec else 0,
        max_num_seqs=run.max_seqs,
    )
    prompts = np.asarray(run.prompt_lens)
    decoded = np.maximum(np.asarray(run.response_lens) - 1, 1)  # the prefill samples token 1
    return simulate_rollout(prompts, decoded, cfg, replicas=1).time_s


@dataclass(frozen=True)
class LearnerShape:
    """What one learner step ran: its forward shapes, summed over micro-batches."""

    positions: int  # padded positions the trunk ran (rows x row width)
    attended: int  # query-key pairs its attention computed (rows x width^2)
    head_tokens: int  # positions the LM head and log-softmax ran at (completion tokens)


@dataclass(frozen=True)
class MeasuredStep:
    """One measured RL step: its rollout, its learner's shapes and the seconds each side took."""

    rollout: MeasuredRollout
    learner: LearnerShape
    gen_s: float  # the rollout's wall time (under contention in an async run)
    learn_s: float  # the rest of a sync step: learning, weight push, scoring, bookkeeping
    step_s: float  # the loop's step time (async: since the previous step's learning ended)


def learner_features(model: ModelSpec, shape: LearnerShape) -> np.ndarray:
    """[trunk FLOPs, head FLOPs, 1] of a learner step (forward + backward = 3 forwards each):
    the trunk (every weight but the LM head, and attention over the packed rows) at every
    padded position, the LM head at completion positions."""
    head_params = model.vocab * model.hidden
    pair = 4.0 * model.layers * model.heads * model.head_dim  # QK and PV per query-key pair
    trunk = 2.0 * (model.params_active - head_params) * shape.positions + pair * shape.attended
    head = 2.0 * head_params * shape.head_tokens
    return np.array([3.0 * trunk, 3.0 * head, 1.0])


@dataclass(frozen=True)
class LearnerFit:
    """The learner's per-machine terms: the MFU of its trunk (bf16 autocast in specrl's learner)
    and of its LM head (float32), and a fixed per-step time (optimizer step, weight push)."""

    trunk_mfu: float
    head_mfu: float
    fixed_s: float

    def seconds(self, model: ModelSpec, hw: HardwareSpec, shape: LearnerShape) -> float:
        trunk, head, _ = learner_features(model, shape)
        return (trunk / self.trunk_mfu + head / self.head_mfu) / hw.peak_flops + self.fixed_s


def _mfu(seconds_per_flop: float, hw: HardwareSpec) -> float:
    return 1.0 / (seconds_per_flop * hw.peak_flops) if seconds_per_flop > 0 else np.inf


def fit_learner(model: ModelSpec, hw: HardwareSpec, steps: Sequence[MeasuredStep]) -> LearnerFit:
    """The LearnerFit that best fits the learning seconds of ``steps`` (relative errors, rates
    >= 0; a rate the fit drops costs nothing)."""
    x = np.stack([learner_features(model, s.learner) for s in steps])
    coef = relative_nnls(x, np.asarray([s.learn_s for s in steps]))
    if coef[0] <= 0 and coef[1] <= 0:
        raise ValueError("the learner's time does not grow with its FLOPs in these steps")
    return LearnerFit(_mfu(coef[0], hw), _mfu(coef[1], hw), float(coef[2]))


def predict_run(
    gen: Sequence[float], learn: Sequence[float], staleness: int, overlap: Overlap, skip: int = 1
) -> float:
    """Predicted wall time of a run's steps after the first ``skip`` (sync: staleness 0)."""
    done = simulate_shared(gen, learn, staleness, overlap)
    return float(done[-1] - (done[skip - 1] if skip else 0.0))


def fit_overlap(
    runs: Sequence[tuple[Sequence[float], Sequence[float], int, float]],
    grid: np.ndarray | None = None,
) -> Overlap:
    """The overlap slowdowns (on ``grid``, both sides) minimising the squared log error of
    ``runs``' wall times; each run is (predicted solo generation seconds per step, predicted
    learning seconds per step, staleness, measured wall time of its steps after the first)."""
    grid = np.geomspace(1.0, 16.0, 121) if grid is None else grid  # 2.3% steps
    best, best_err = Overlap(), np.inf
    for g in grid:
        for lrn in grid:
            ov = Overlap(float(g), float(lrn))
            err = sum(np.log(predict_run(gs, ls, s, ov) / wall) ** 2 for gs, ls, s, wall in runs)
            if err < best_err:
                best, best_err = ov, err
    return best


def error_summary(rows: Sequence[dict]) -> dict[str, float]:
    """Mean and max |error| of held-out rows, mean of fitted ones (rows with "error", "fitted")."""
    held = [abs(r["error"]) for r in rows if not r["fitted"]]
    fit = [abs(r["error"]) for r in rows if r["fitted"]]
    return {
        "heldout_mean_abs_error": float(np.mean(held)),
        "heldout_max_abs_error": float(np.max(held)),
        "fitted_mean_abs_error": float(np.mean(fit)),
    }


def error_table(rows: Sequence[dict], width: int) -> str:
    """Predicted vs measured, one line per row ("config", "fitted", "acceptance_length",
    "measured_s", "predicted_s", "error"), configs right-aligned in ``width`` characters."""
    lines = [
        f"{'config':>{width}} {'set':>8} {'accept':>6} {'measured s':>10} {'predicted s':>11} error"
    ]
    for r in rows:
        kind = "fit" if r["fitted"] else "held-out"
        lines.append(
            f"{r['config']:>{width}} {kind:>8} {r['acceptance_length']:6.2f} "
            f"{r['measured_s']:10.2f} {r['predicted_s']:11.2f} {r['error']:+6.1%}"
        )
    return "\n".join(lines)
