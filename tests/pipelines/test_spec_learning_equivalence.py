"""Speculation changes nothing in learning: reward curves with and without it agree within seed
noise (Welch's t-test over seeds on each run's mean reward), while the test has the power to see
a real change (a lower sampling temperature is detected)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts

SEEDS = range(16)  # with 8, self vs plain once failed at p=0.001 by chance (seeds 8-23: 0.71)
STEPS = 12


pytestmark = pytest.mark.usefixtures("one_thread")


def _curves(tmp_path, *overrides: str) -> np.ndarray:  # [seeds, steps] reward means
    curves = []
    for seed in SEEDS:
        cfg = tiny_config(f"run.seed={seed}", f"run.steps={STEPS}", "learner.lr=1e-2",
                          "run.eval_every=0", "run.checkpoint_every=0", *overrides)  # fmt: skip
        rows = train(tiny_parts(cfg), str(tmp_path / f"{'-'.join(overrides)}-{seed}"),
                     progress=False)  # fmt: skip
        curves.append([r["reward_mean"] for r in rows])
    return np.array(curves)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> np.ndarray:
    return _curves(tmp_path_factory.mktemp("plain"), "rollout.spec=none")


def test_plain_runs_learn(plain):
    early, late = plain[:, :3].mean(1), plain[:, -3:].mean(1)
    assert stats.ttest_rel(late, early).pvalue < 0.01 and late.mean() > early.mean() + 0.2


@pytest.mark.parametrize("spec", ["self", "ngram", "suffix"])
def test_speculative_runs_learn_the_same(tmp_path, plain, spec):
    curves = _curves(tmp_path, f"rollout.spec={spec}")
    p = stats.ttest_ind(plain.mean(1), curves.mean(1), equal_var=False).pvalue
    assert p > 0.01, f"{spec}: mean reward differs from plain decoding (Welch p={p:.4f})"
    # per step: the mean over seeds stays within a 4-standard-error band of plain decoding
    se = np.sqrt(plain.var(0, ddof=1) / len(SEEDS) + curves.var(0, ddof=1) / len(SEEDS))
    assert np.all(np.abs(plain.mean(0) - curves.mean(0)) <= 4 * se + 1e-9)


def test_comparison_detects_a_real_change(tmp_path, plain):
    colder = _curves(tmp_path, "rollout.temperature=0.5")  # a different behaviour policy
    p = stats.ttest_ind(plain.mean(1), colder.mean(1), equal_var=False).pvalue
    assert p < 0.01
