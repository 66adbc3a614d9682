"""specrl.sim: a performance simulator for RL post-training with speculative rollouts.

Contract: pure Python + numpy (matplotlib only when a PNG is written); imports no other specrl
package and no torch. Specs (models, hardware, drafters, scenarios) are TOML data under ``data/``;
``cost`` prices engine steps, ``rollout`` simulates continuous batching, ``pipeline`` schedules RL
phases, ``runner`` ties a scenario together, ``calibrate`` fits hardware profiles to engine traces,
``report`` draws charts and ``cli`` exposes ``specrl simulate``.
"""

from specrl.sim.runner import ScenarioResult, run_scenario
from specrl.sim.scenario import Scenario, load_scenario

__all__ = ["Scenario", "ScenarioResult", "load_scenario", "run_scenario"]
