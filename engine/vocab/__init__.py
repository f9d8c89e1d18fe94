"""Draft-vocabulary policies: which rows of the LM head a drafter scores at each step.

Words as in the glossary (`locality.__doc__`). A policy wraps the drafter's LM head `weight [V, d]` and
answers `logits(h [r, d]) -> (logits [r, m] fp32, slot_to_token [m] or None)`: m slots, each standing
for one full-vocabulary token (None = slot i is token i). Drafters take their top-k over the slots and
map them back, so draft token ids are always full-vocabulary ids. Slots outside the active vocab are
-inf. Every policy reports `stats()`: `mean_active_vocab`, `max_active_vocab` (over steps) and the
coverage of the committed tokens by the vocabulary the drafter had at that step.

Policies (`cfg.vocab`):

- `full`      the whole head, m = V (EAGLE-2).
- `frspec`    FR-Spec: a static top-K of a frequency list (`cfg.frequency_file`, made by `engine.jobs.frequency`,
              whose `default_frequency_file` counts one on the training corpus for a tokenizer), K =
              `frspec_k` clipped to the ids the list ranks (never-seen ids are not ranked); the K rows are
              packed once.
- `microspec` MicroSpec (§3.2): the active vocab is the distinct tokens among the
              last `w_max` entries of the candidate stream S (Eq. 4), fed live:
                begin:      S_init = prompt ⊕ union of the target's top-k_pre at every prompt position (Eq. 2)
                each step:  S ⊕= C_draft (the draft tree's tokens) ⊕ C_ver (the target's top-k_ver at the
                            verify rows) (Eq. 3)
              switches: `sources` ctx+ext | ctx (S_init only) | ext (S_init = top-k_pre of the last prompt
              position, A6); `ver_rows` accepted_path | last | all_tree (A1); `draft_tree_tokens`
              final | all_expanded (A2); `window_mode` eq4_exact | fifo_unique (A4). Orders (A3): the
              prefill union keep-first in row-then-rank order (`prefill_order` "first", locality.stream's
              default; "last" = by last occurrence); C_draft in tree node order (root included), C_ver in
              row order then rank, both keep-first. Backed by `kernels.streams.PackedLMHead` (device
              window state, packed [w_max, d] buffer, gather on a copy stream, masked dense head).
- `oracle`    "acceptance of full at the cost of a tiny head" (spec section 3.7). Every head call runs a
              tiny head for real - the dense [w_max, d] packed head with its masked log-softmax and top-k,
              result discarded - and that is the time charged to `lm_head`. The proposals come from the
              full head, whose time is recorded apart as `oracle_uncharged` and subtracted from
              `lm_head` by the drafter; the oracle's end-to-end speed is tokens / (wall - oracle_uncharged).
              Its active vocab is reported as w_max (the charged head's rows).

- `dynaspec`  DynaSpec (§4.2-4.3): per draft row, the clusters a router picks (`engine.vocab.dynaspec`).

One module per policy: `base` (the protocol, full, oracle), `frspec`, `microspec`, `dynaspec`; this package
exports their API and `make_policy`. DynaSpec's fitting (`dynaspec_fit`: k-means, the router's rows, training
and held-out metrics) is not imported here; the jobs above the library run it and count FR-Spec's lists
(`engine.jobs.fit_dynaspec`, `engine.jobs.frequency`).
"""

from __future__ import annotations

import torch

from specvocab.engine.config import POLICIES
from specvocab.engine.vocab.base import (FullVocab, OracleVocab, VocabError, VocabPolicy, check_w_max, head_topk,
                               softcap)
from specvocab.engine.vocab.dynaspec import DynaSpecVocab
from specvocab.engine.vocab.frspec import (FrequencyError, FrSpecVocab, eagle3_maps, load_eagle3_maps, load_frequency_ranking,
                                 load_token_map, save_eagle3_maps, save_token_map)
from specvocab.engine.vocab.microspec import (MicroSpecVocab, ordered_unique, prefill_entries, replay_trace, step_entries,
                                    ver_row_index)

__all__ = ["DynaSpecVocab", "FrSpecVocab", "FrequencyError", "FullVocab", "MicroSpecVocab", "OracleVocab",
           "VocabError", "VocabPolicy", "check_w_max", "eagle3_maps", "head_topk", "load_eagle3_maps",
           "load_frequency_ranking", "load_token_map", "make_policy", "ordered_unique", "prefill_entries",
           "replay_trace", "save_eagle3_maps", "save_token_map", "softcap", "step_entries", "ver_row_index"]

_POLICIES = {"full": FullVocab, "frspec": FrSpecVocab, "microspec": MicroSpecVocab, "oracle": OracleVocab,
             "dynaspec": DynaSpecVocab}


def make_policy(cfg, weight: torch.Tensor, *, softcap: float | None = None, timer=None,
                drafter_key: dict | None = None, tokenizer: str | None = None) -> VocabPolicy:
    """The policy `cfg.vocab` over LM head `weight [V, d]`. What the drafter knows and a policy checks its files
    against: `drafter_key` (`engine.vocab.dynaspec.drafter_key` with the head's hash; dynaspec) and the target's
    `tokenizer` name (`engine.models.ModelInfo.tokenizer_name`; frspec refuses a list made for another)."""
    if cfg.vocab not in _POLICIES:
        raise VocabError(f"unknown vocab policy {cfg.vocab!r} — choose one of {list(POLICIES)}")
    extra = {"dynaspec": {"drafter_key": drafter_key}, "frspec": {"tokenizer": tokenizer}}.get(cfg.vocab, {})
    return _POLICIES[cfg.vocab](weight, cfg, softcap=softcap, timer=timer, **extra)
