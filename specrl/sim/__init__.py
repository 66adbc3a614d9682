"""specrl.sim: a performance simulator for RL post-training with speculative rollouts.

Contract: pure Python + numpy (matplotlib only when a PNG is written); imports no torch and no
other specrl package but the leaves ``specrl.errors``, ``specrl.fsutil`` and ``specrl.settings``
(scenarios and specs are settings sections, as the run config is; and, in ``cli``,
``specrl.cli_util``), which import nothing from specrl. Specs (models, hardware, drafters,
scenarios, the training efficiency table) are TOML data under ``data/``; ``cost`` prices engine
steps (drafting per kind, verify, sampler, MoE and collectives), ``acceptance`` turns acceptance
profiles into tokens per step, ``rollout`` simulates continuous batching, ``training`` prices the
trainer, ``pipeline`` and ``continuous`` schedule RL phases, ``runner`` ties a scenario together,
``calibrate`` fits hardware profiles to engine traces, ``report`` draws charts and ``cli``
exposes ``specrl simulate``. ``published`` (engine and trainer fits), ``paper`` (the table of
arXiv 2604.26779) and ``serving`` (held-out serving measurements) hold the measurements the
simulator is fitted on and validated against. ``validate`` checks a scenario before any work;
every bad input raises ``errors.SimInputError`` (one line).
"""

from specrl.sim.errors import SimInputError
from specrl.sim.runner import ScenarioResult, run_scenario
from specrl.sim.scenario import Scenario, load_scenario

__all__ = ["Scenario", "ScenarioResult", "SimInputError", "load_scenario", "run_scenario"]
