"""Speculation: everything between "draft" and "accept".

- ``specrl.spec.verify``: the rejection sampler (a pure function over a ragged batch) that keeps
  the emitted tokens distributed exactly as the target's processed distribution.
- ``specrl.spec.proposers``: drafters subclassing one ``Proposer`` base class, looked up by name.

This package depends on ``specrl.sampling`` (and, for learned drafters, ``specrl.models``; for
the controller's step costs, ``specrl.costmodel``, never the simulator); the engine uses it,
never the reverse.
"""
