"""specrl.costmodel: the step-cost model and its fit, below both of its users.

The speculation controller (``specrl.spec.controller``, on the engine's path) and the simulator
(``specrl.sim``) price an engine step with one model: ``specs`` (models, hardware and drafters
as data, from the TOML files under ``specrl/sim/data``), ``drafters`` (the forward each drafter
kind runs), ``cost`` (``StepCostModel``: seconds of a prefill, decode, draft or verify step) and
``fit`` (a hardware profile's rates fitted to timed forwards, ``Record``). A bad input raises
``errors.SimInputError`` (one line). Pure Python + numpy; of specrl only the leaves ``errors``
and ``settings``, never ``specrl.sim`` (its spec files are read as files, no module of it is
imported). Details: docs/internals.md.
"""
