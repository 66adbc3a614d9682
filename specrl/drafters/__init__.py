"""Training learned drafters (EAGLE-3 and MTP heads, a distilled draft model) on the target's
own rollouts.

``data`` builds examples (rollouts through the Engine, then the target's features recorded by a
teacher-forced forward), ``train`` fits a head with the training-time-test unroll (and holds the
loop both trainers share), ``distill`` distils a layer-prefix draft model on the target's
distributions, ``export`` writes a trained EAGLE-3 head or draft model in the layout vLLM loads,
``cli`` adds ``specrl train-drafter`` and ``specrl export-drafter``. The on-disk head format is
documented in ``specrl.models.heads``, the draft model's in ``distill``.
"""
