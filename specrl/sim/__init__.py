"""specrl.sim: a performance simulator for RL post-training with speculative rollouts.

Pure Python + numpy (matplotlib only for PNGs); no torch, and of specrl only
``specrl.costmodel`` (specs, the step-cost model and its fit, which the speculation controller
uses too) and the leaves ``errors``, ``fsutil``, ``settings`` (and ``cli_util`` in ``cli``).
Specs are TOML data under ``data/`` (read by ``costmodel.specs``); ``costmodel.cost`` prices
engine steps, ``acceptance`` tokens per step, ``rollout`` continuous batching, ``training`` the
trainer; ``pipeline`` and ``continuous`` schedule RL phases, ``runner`` runs a scenario,
``calibrate`` fits hardware profiles to engine traces; ``published``, ``paper`` and ``serving``
hold the measurements it is fitted on and checked against. ``validate`` checks a scenario
first; every bad input raises ``costmodel.errors.SimInputError`` (one line).
Details: docs/internals.md, docs/simulator.md.
"""

from specrl.costmodel.errors import SimInputError
from specrl.sim.runner import ScenarioResult, run_scenario
from specrl.sim.scenario import Scenario, load_scenario

__all__ = ["Scenario", "ScenarioResult", "SimInputError", "load_scenario", "run_scenario"]
