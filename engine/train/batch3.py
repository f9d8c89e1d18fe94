"""EAGLE-3's draft vocabulary and its training batches (the official `SafeAILab/EAGLE` `scandata` and
`eagle/traineagle3/cnets.py` `Model.forward`; `engine.train.eagle3` says what differs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specvocab.engine.drafters.eagle3 import DraftVocab
from specvocab.engine.train.sample import FEATURES, Sample, TrainError


def counted_tokens(s: Sample, how: str, loss_on: str = "all") -> torch.Tensor:
    """The tokens of one sample the draft vocabulary is counted over: `top1` = the target's top-1 next token at
    each pair's step-0 target (positions 1..L-1, those that get a loss), `response` = the response tokens."""
    if how == "response":
        return s.input_ids[s.loss_mask]
    if s.topk_ids is None:
        raise TrainError("vocab_count 'top1' needs the target's top-1 at every position, which a tokens-only data "
                         "folder does not store — pass --vocab-count response")
    top1 = s.topk_ids[1:, 0]
    return top1[s.loss_mask[1:]] if loss_on == "response" else top1


def draft_vocabulary(samples: Sequence[Sample], vocab_size: int, size: int, how: str = "top1",
                     loss_on: str = "all", coverage: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts): the `size` most frequent counted tokens (`counted_tokens`), most frequent first (ties: lower
    id first), clipped to the tokens seen at least once; with `coverage`, clipped further to the fewest of them
    whose counts cover that share of the counted tokens."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        counts += np.bincount(counted_tokens(s, how, loss_on).numpy(), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")
    k = min(size, vocab_size, int((counts > 0).sum()))
    if coverage is not None and counts.sum() > 0:
        covered = np.cumsum(counts[order]) / counts.sum()
        k = min(k, int(np.searchsorted(covered, coverage - 1e-12)) + 1)
    if k == 0:
        raise TrainError("the training data holds no counted tokens to choose a draft vocabulary from")
    return order[:k], counts[order[:k]]


@dataclass
class Batch3:
    """Packed pairs of several samples for `ttt_steps` steps. Row r = pair (g_p, x_{p+1}) of sequence seg[r] at
    local position p = pos[r]; step k of row r reads token x_{p+1+k} and is scored on the target's distribution
    after it."""

    feats: torch.Tensor        # [T, 3 d_t] g_p (low / mid / high)
    tokens: torch.Tensor       # [S, T] x_{p+1+k} (0 past the sequence's end)
    pos: torch.Tensor          # [T] p (step k runs at p + k)
    seg: torch.Tensor          # [T] the row's sequence in the batch
    draft_ids: torch.Tensor    # [S, T, k] the target's top-k as draft ids (0 where outside the draft vocabulary)
    p: torch.Tensor            # [S, T, k] the target's top-k within the draft vocabulary, renormalised (0 outside)
    mask: torch.Tensor         # [S, T] loss rows: inside the sequence, loss_on, top-1 in the draft vocabulary
    counted: torch.Tensor      # [S, T] rows of the accuracy: inside the sequence and loss_on
    top1: torch.Tensor         # [S, T] the target's top-1 (target id)

    @property
    def rows(self) -> int:
        return self.pos.numel()


def make_batch3(samples: Sequence[Sample], maps: DraftVocab, steps: int, loss_on: str = "all",
                dtype: torch.dtype = torch.float32) -> Batch3:
    """The TTT batch of packed samples (see `Batch3`); samples need the EAGLE-3 features."""
    parts = []
    for j, s in enumerate(x for x in samples if x.input_ids.numel() >= 2):
        if any(f not in s.extra for f in FEATURES):
            raise TrainError("the data folder holds no EAGLE-3 features (hidden_low / mid / high) — make it with "
                             "`python -m specvocab.engine.jobs.eagle_data --eagle3-features` into another --out")
        L = s.input_ids.numel()
        p = torch.arange(L - 1)
        idx = p[None] + 1 + torch.arange(steps)[:, None]                     # [S, n]
        inside = idx <= L - 1
        idx = idx.clamp(max=L - 1)
        lm = s.loss_mask[idx] if loss_on == "response" else torch.ones_like(inside)
        parts.append((torch.cat([s.extra[f][:-1] for f in FEATURES], dim=-1), torch.where(inside, s.input_ids[idx], 0),
                      p, torch.full_like(p, j), s.topk_ids[idx], s.topk_logits[idx].float(), inside & lm))
    if not parts:
        raise TrainError("a batch needs at least one sample of two or more tokens")
    cols = list(zip(*parts))
    feats, pos, seg = (torch.cat(cols[i]) for i in (0, 2, 3))                  # rows along dim 0
    tokens, ids, logits, counted = (torch.cat(cols[i], dim=1) for i in (1, 4, 5, 6))   # [S, T, ...]
    admitted = maps.t2d[ids]                                                  # [S, T, k]
    p = torch.softmax(logits.masked_fill(~admitted, float("-inf")), dim=-1)
    p = torch.where(admitted, p, torch.zeros_like(p))                         # rows with nothing admitted: 0, not nan
    return Batch3(feats=feats.to(dtype), tokens=tokens, pos=pos, seg=seg,
                  draft_ids=maps.row_of_target[ids].clamp(min=0), p=p, mask=counted & admitted[..., 0],
                  counted=counted, top1=ids[..., 0])
