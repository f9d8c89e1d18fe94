"""`ar`: autoregressive decoding through the same harness - every step proposes a root-only tree."""

from __future__ import annotations

import torch

from specvocab.engine.drafters import register_drafter
from specvocab.engine.methods import SAMPLING, TARGET, MethodSpec
from specvocab.engine.tree import DraftTree, Drafter

# the method's description (engine.methods: read from this source without importing it); its drafter: ARDrafter
METHOD = MethodSpec("ar", order=0, drafts=False, calibration_fields=(*SAMPLING, *TARGET))


@register_drafter("ar")
class ARDrafter(Drafter):
    """No draft tokens: the target verifies the root alone and emits one bonus token per step (tau = 1)."""

    uses_prefill_logits = False                                  # begin() gets only the last row

    def propose(self, ids: torch.Tensor) -> DraftTree:
        return DraftTree(ids[-1:].cpu(), torch.tensor([-1]))     # host copy of one id (trees live on the host)
