"""specrl on one GPU: the library behind ``specrl bench gpu`` (docs/gpu.md).

Contract: ``check.run_check(cfg, target, command)`` runs the GPU check's sections (floors,
exactness, engine, learner, grpo; ``cfg.check.sections``) on ``target.device`` and writes one
JSON to ``target.out`` after each section (layout: docs/gpu.md; a section that fails is recorded
as ``"error"`` and the others still run); ``calibrate.run_calibrate(cfg, target)`` times the
engine's forward over a grid of shapes and writes a calibration trace for ``specrl simulate
calibrate``. Both take a ``specrl.config_gpubench.GpuBenchCfg``; ``common.prepare(cfg)`` resolves
its device and result path first, or raises ``GpuBenchError`` (one line): no CUDA without
``run.smoke``, an unwritable path, a smoke run aimed at a committed result. ``run.smoke`` runs
every path with tiny sizes on the CPU (a CI test). Nothing here imports reasoning-gym, gguf,
vLLM or Ray (absent on the GPU machine; the check records any that got imported).

Modules: ``common`` (clock, timing, the target), ``shapes`` (the random models' shapes),
``trace`` (calibration traces), ``oracle`` (the drafters the sections time), ``engine``,
``learner``, ``grpo`` (sections), ``check`` (the run), ``calibrate`` (the grid). A unit at the
pipelines' level: it may import pipelines, backends, engine, sim and below; only CLI modules
import it. Importing this package imports nothing (no torch).
"""
