"""specrl.sim: a performance simulator for RL post-training with speculative rollouts.

Contract: pure Python + numpy (matplotlib only when a PNG is written); imports no torch and no
other specrl package but the leaves ``specrl.errors`` and ``specrl.fsutil`` (and, in ``cli``,
``specrl.cli_util``), which import nothing from specrl. Specs (models, hardware, drafters,
scenarios) are TOML data under ``data/``; ``cost`` prices engine steps, ``rollout`` simulates
continuous batching, ``pipeline`` schedules RL phases, ``runner`` ties a scenario together,
``calibrate`` fits hardware profiles to engine traces, ``report`` draws charts and ``cli``
exposes ``specrl simulate``. ``validate`` checks a scenario before any work; every bad input
raises ``errors.SimInputError`` (one line).
"""

from specrl.sim.errors import SimInputError
from specrl.sim.runner import ScenarioResult, run_scenario
from specrl.sim.scenario import Scenario, load_scenario

__all__ = ["Scenario", "ScenarioResult", "SimInputError", "load_scenario", "run_scenario"]
