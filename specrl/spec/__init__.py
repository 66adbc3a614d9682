"""Speculation: everything between "draft" and "accept".

- ``specrl.spec.verify``: the rejection sampler (a pure function over a ragged batch) that keeps
  the emitted tokens distributed exactly as the target's processed distribution.
- ``specrl.spec.proposers``: drafters behind one ``Proposer`` protocol, looked up by name.

This package depends on ``specrl.sampling`` (and, for learned drafters, ``specrl.models``); the
engine uses it, never the reverse.
"""
