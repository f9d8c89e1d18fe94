"""EAGLE-3's training-time test (TTT): the head run on its own outputs for several steps, and its loss.

Step 0 is EAGLE's: the pair (fc(g_i), x_{i+1}) at position i. Step k > 0 feeds back the head's own output: the
midlayer output of step k-1 at row i replaces fc(g) as the hidden input, the token is x_{i+1+k}, the position
i + k, and the row's query attends to the step-0 keys of its sequence up to i (causal) plus its own keys of
steps 1..k (the official `SafeAILab/EAGLE` `eagle/traineagle3/cnets.py` keeps a list of per-step keys and adds
the diagonal scores) - the attention a draft node at depth k sees in the tree. The loss of step k is the
cross-entropy against the target's distribution within the draft vocabulary, weighted step_weight ** k
(`engine.train.eagle3` says which rows count).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from specvocab.engine.drafters.eagle3 import Eagle3Head
from specvocab.engine.train.batch3 import Batch3
from specvocab.engine.train.losses import chunked_head_ce


class _Padded:
    """Flat rows [T, ...] <-> per-sequence right-padded [B, Lmax, ...] (attention runs per sequence): row r sits
    in sequence seg[r] at slot slot[r]."""

    def __init__(self, seg: torch.Tensor, slot: torch.Tensor, B: int | None = None):
        self.B = (int(seg.max()) + 1 if seg.numel() else 0) if B is None else B
        self.Lmax = int(slot.max()) + 1 if slot.numel() else 0
        self.index = seg * self.Lmax + slot

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((self.B * self.Lmax, *x.shape[1:]))
        return out.index_copy(0, self.index, x).view(self.B, self.Lmax, *x.shape[1:])

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.B * self.Lmax, *x.shape[2:])[self.index]


def ttt_layer(head: Eagle3Head, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, pad: _Padded,
              past: list[tuple[torch.Tensor, torch.Tensor]], last_key: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One TTT step of the midlayer over flat rows (emb, h [T, d] at positions [T], laid out by `pad`) -> (h'
    [T, d], this step's (keys, values) [B, H, Lmax, hd]). past: the earlier steps' keys / values; past[0] (step
    0, one slot per position) is attended causally within each sequence, up to each row's `last_key` [T] (by
    default its slot: `pad` is step 0's layout), past[1:] and this step's own key only at the row itself (they
    share `pad`'s layout)."""
    ml = head.midlayer
    attn = ml.self_attn
    hd = attn.head_dim
    H, KV = head.config.num_attention_heads, head.config.num_key_value_heads
    x = torch.cat([ml.input_layernorm(emb), ml.hidden_norm(h)], dim=-1)               # [T, 2d]
    # the projections run on the T flat rows; only attention sees the padded [B, Lm] layout (a padded slot lies
    # past its sequence's end, so causally no real row attends to it: its zeros change nothing)
    q = pad.pad(attn.q_proj(x)).view(pad.B, pad.Lmax, H, hd).transpose(1, 2)           # [B, H, Lm, hd]
    k = pad.pad(attn.k_proj(x)).view(pad.B, pad.Lmax, KV, hd).transpose(1, 2)
    v = pad.pad(attn.v_proj(x)).view(pad.B, pad.Lmax, KV, hd).transpose(1, 2)
    cos, sin = head.rotary_emb(v, pad.pad(positions))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, H // KV), repeat_kv(v, H // KV)
    steps = past + [(k, v)]
    k0, v0 = steps[0]
    L0 = k0.shape[2]
    scores = (q @ k0.transpose(2, 3)) * attn.scaling                                 # [B, H, Lm, L0]
    if last_key is None:
        causal = torch.ones(pad.Lmax, L0, dtype=torch.bool, device=q.device).triu(1)
    else:                                  # a row attends to its sequence's step-0 keys 0..last_key
        causal = (torch.arange(L0, device=q.device)[None, None] > pad.pad(last_key)[:, :, None])[:, None]
    scores = scores.masked_fill(causal, float("-inf"))
    diag = [((q * kj).sum(-1) * attn.scaling)[..., None] for kj, _ in steps[1:]]       # [B, H, Lm, 1] each
    w = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = w[..., :L0] @ v0
    for j, (_, vj) in enumerate(steps[1:]):
        out = out + w[..., L0 + j, None] * vj
    h = h + attn.o_proj(pad.flat(out.transpose(1, 2).reshape(pad.B, pad.Lmax, H * hd)))
    return h + ml.mlp(ml.post_attention_layernorm(h)), (k, v)


def scored_rows(batch: Batch3, steps: int) -> torch.Tensor | None:
    """The rows steps 1.. must run: those scored (loss or agreement) at some step >= 1 - a row's step k reads
    only the step-0 keys and its own earlier steps, so the others feed nothing that counts. With the loss on
    the response only, a long prompt's rows drop out after step 0. None: every row."""
    if steps < 2:
        return None
    keep = batch.counted[1:steps].any(0)
    return None if bool(keep.all()) else keep.nonzero().flatten()


def ttt_forward(head: Eagle3Head, embed, batch: Batch3, steps: int | None = None) -> list[torch.Tensor]:
    """The midlayer outputs [T, d] of TTT steps 0..steps-1: step 0 on fc(target features), step k on the
    midlayer output of step k-1 (the head's own hidden), tokens and positions shifted by k. Steps >= 1 run only
    the rows `scored_rows` keeps; the others' outputs are zeros (nothing reads them)."""
    steps = batch.tokens.shape[0] if steps is None else steps
    pad = _Padded(batch.seg, batch.pos)
    h = head.fc(batch.feats)
    keep = scored_rows(batch, steps)
    rows, sub, T = None, pad, batch.rows
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs = []
    for k in range(steps):
        if k == 1 and keep is not None:         # the kept rows in their own layout: a row's slot is its rank
            # among its sequence's kept rows (a batch's rows are grouped by sequence, as make_batch3 packs them)
            seg = batch.seg[keep]
            counts = torch.bincount(seg, minlength=pad.B)
            sub = _Padded(seg, torch.arange(seg.numel()) - (counts.cumsum(0) - counts)[seg], B=pad.B)
            rows, h = keep, h[keep]
        if rows is not None and rows.numel() == 0:             # nothing scored past step 0
            outs.append(h.new_zeros((T, h.shape[1])))
            continue
        tokens, pos = batch.tokens[k], batch.pos
        if rows is not None:
            tokens, pos = tokens[rows], pos[rows]
        emb = embed(tokens).to(h.dtype)
        h, kv = ttt_layer(head, emb, h, pos + k, sub, past, last_key=None if rows is None else pos)
        past.append(kv)
        outs.append(h if rows is None else h.new_zeros((T, h.shape[1])).index_copy(0, rows, h))
    return outs


def ttt_loss(head: Eagle3Head, embed, batch: Batch3, *, step_weight: float = 0.8, head_dtype=torch.float32,
             chunk: int = 512, backward: bool = True) -> dict:
    """The EAGLE-3 loss (module docstring) of one batch; with backward, gradients land in head's params (lm_head
    included). Returns the total, the per-step losses and (without backward) per-step top-1 agreement."""
    S = batch.tokens.shape[0]
    T = batch.rows
    outs = ttt_forward(head, embed, batch, S)
    normed = [head.norm(o) for o in outs]
    W = head.lm_head.weight
    Wc = W.detach().to(head_dtype).requires_grad_(backward)        # the loss's matmul dtype; grad folded back below
    losses, grads, accs = [], [], []
    for k in range(S):
        wk = step_weight ** k
        rows = batch.mask[k].nonzero().flatten()
        n = rows.numel()
        if n == 0:
            losses.append(0.0)
            grads.append(torch.zeros_like(normed[k]))
        else:
            # chunked_head_ce averages over the rows it gets; p scaled by n * w_k / T makes it w_k * sum / T (the
            # loss is linear in p), and its per-chunk backward accumulates lm_head's gradient into Wc.grad
            scaled = batch.p[k][rows] * (n * wk / T)
            with torch.enable_grad() if backward else torch.no_grad():
                loss, g = chunked_head_ce(normed[k][rows].detach(), Wc, batch.draft_ids[k][rows], scaled, chunk,
                                          with_grad=backward)
            losses.append(float(loss) / wk)
            if backward:
                full = torch.zeros_like(normed[k])
                full[rows] = g.to(full.dtype)
                grads.append(full)
        if not backward:
            accs.append(_agreement(normed[k], Wc, batch, k, chunk))
    if backward:
        torch.autograd.backward(normed, grads)
        W.grad = Wc.grad.to(W.dtype) if W.grad is None else W.grad + Wc.grad.to(W.dtype)
    total = sum(step_weight ** k * l for k, l in enumerate(losses))
    return {"loss": total, "step_losses": losses, "acc": accs, "counted": [int(c.sum()) for c in batch.counted]}


@torch.no_grad()
def _agreement(hn: torch.Tensor, W: torch.Tensor, batch: Batch3, k: int, chunk: int) -> int:
    """Rows of step k (of the counted ones) where the head's top-1, mapped to a target id, is the target's top-1
    (a top-1 outside the draft vocabulary is a miss)."""
    rows = batch.counted[k].nonzero().flatten()
    hits = 0
    for a in range(0, rows.numel(), chunk):
        r = rows[a:a + chunk]
        best = (hn[r].to(W.dtype) @ W.T).argmax(-1)
        hits += int((best == batch.draft_ids[k][r, 0]).logical_and(batch.mask[k][r]).sum())
    return hits
