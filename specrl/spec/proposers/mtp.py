"""MTP drafting (DeepSeek-V3 style depth-1 module, reused autoregressively for k > 1).

Contract: as ``Eagle3Proposer`` (see ``eagle3``) with a ``DraftHead`` of kind ``mtp``: it reads
the output of the target's last layer (``hidden_layers = (L-1,)``), combines RMSNorm of it with
RMSNorm of the next token's embedding (2H -> H), runs one block and predicts with the shared LM
head; further drafts feed the module's own output back.
"""

from __future__ import annotations

from specrl.spec.proposers import register_proposer
from specrl.spec.proposers.eagle3 import Eagle3Proposer


@register_proposer("mtp")
class MtpProposer(Eagle3Proposer):
    """The MTP module as a drafter (same machinery as EAGLE-3, different head input)."""

    kind = "mtp"
