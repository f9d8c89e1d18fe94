"""`pld`: prompt lookup decoding (Saxena 2023) - copy what followed the latest earlier occurrence of the
last n committed tokens.

For n = pld_max_ngram down to pld_min_ngram: find earlier occurrences of the last n committed tokens
(root included) in prompt + output; the first n with a match wins and the tokens that followed the match
form a chain draft of up to `draft_size` tokens (default 10, transformers' prompt_lookup_num_tokens).
Which occurrence: the most recent one that is followed by a full `draft_size` tokens, else (all matches
run into the end, as in a run of repeats) the earliest one, whose continuation is the longest. No match:
a root-only tree (the step is plain decoding).
"""

from __future__ import annotations

import torch

from specvocab.engine.drafters import register_drafter
from specvocab.engine.methods import SAMPLING, TARGET, MethodSpec
from specvocab.engine.tree import DraftTree, Drafter

# the method's description (engine.methods: read from this source without importing it); its drafter:
# PromptLookupDrafter. Uncalibrated g: 10 = transformers' `prompt_lookup_num_tokens` (Saxena 2023's setting).
METHOD = MethodSpec("pld", order=10, default_draft_size=10,
                    calibration_fields=(*SAMPLING, *TARGET, "pld_max_ngram", "pld_min_ngram"))


def prompt_lookup(ids: torch.Tensor, min_ngram: int, max_ngram: int, num_draft: int) -> torch.Tensor:
    """Draft tokens [g] (0 <= g <= num_draft) for committed ids [N] (last = root), on ids' device.

    Vectorised: one unfold + compare per n-gram size, one host sync for all sizes together.
    """
    n_total = ids.numel()
    sizes = [n for n in range(max_ngram, min_ngram - 1, -1) if n < n_total]
    if not sizes:
        return ids[:0]
    body = ids[:-1]                                              # [N-1] an earlier window must end before the root
    found = []
    for n in sizes:
        windows = body.unfold(0, n, 1)                           # [N-n, n] window s = ids[s : s+n]
        hits = (windows == ids[-n:]).all(1)                      # [N-n]
        starts = torch.arange(hits.numel(), device=ids.device)   # [N-n]
        full = hits & (starts + n + num_draft <= n_total)        # followed by num_draft committed tokens
        found.append(torch.where(full, starts, -1).max())        # most recent full match, -1 if none
        found.append(torch.where(hits, starts, n_total).min())   # earliest match, N if none
    found = torch.stack(found).tolist()                          # host sync: which size matched, and where
    for i, n in enumerate(sizes):
        latest_full, earliest = found[2 * i], found[2 * i + 1]
        s = latest_full if latest_full >= 0 else earliest
        if s < n_total:
            return ids[s + n: s + n + num_draft]
    return ids[:0]


@register_drafter("pld")
class PromptLookupDrafter(Drafter):
    uses_prefill_logits = False                                  # begin() gets only the last row

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.draft_size = cfg.require_draft_size()

    def propose(self, ids: torch.Tensor) -> DraftTree:
        cfg = self.cfg
        draft = prompt_lookup(ids, cfg.pld_min_ngram, cfg.pld_max_ngram, self.draft_size)
        tokens = torch.cat([ids[-1:], draft]).cpu()              # [1+g] root + chain; trees live on the host
        return DraftTree(tokens, torch.arange(-1, tokens.numel() - 1))
