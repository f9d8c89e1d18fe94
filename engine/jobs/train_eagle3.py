"""Train an EAGLE-3 draft head on a data folder made by `engine.jobs.eagle_data --eagle3-features`.

(Over 600 lines on purpose: the EAGLE-3 recipe - draft vocabulary, TTT batches and loss, the resumable loop, the
official-layout writer and the model card - read in one place, as `engine.jobs.train_eagle` holds EAGLE-2's.)

    python -m specvocab.engine.jobs.eagle_data --model smollm2-135m-instruct --source greedy --eagle3-features
    python -m specvocab.engine.jobs.train_eagle3 --model smollm2-135m-instruct --tokens 2000000 --out <dir>
    specvocab train eagle3 --model smollm2-135m-instruct ...                # the same

**The head** is `engine.drafters.eagle3.Eagle3Head` (fc over the target's low / mid / high features, one
midlayer over [embedding; hidden], norm, lm_head over the draft vocabulary, d2t / t2d), trained with the recipe of
the official `SafeAILab/EAGLE` code (`eagle/traineagle3/cnets.py` `Model.forward`, `main.py`):

**Draft vocabulary.** The `draft_vocab_size` most frequent tokens of the training data (official `scandata`:
`Counter` over the response tokens, `most_common(N)`, sorted ascending into d2t / t2d), here
`engine.vocab.frspec.eagle3_maps`. What is counted (`vocab_count`): `top1` (default) = the target's top-1 next
token at every position that gets a loss - the tokens the head is asked to predict and the verifier accepts, and
what the loss's position mask tests (below); `response` = the official choice, the response tokens. On the
target's own greedy continuations the two agree. Default size 32768 (EAGLE-3 ships 32k rows for Llama-3's 128k
vocabulary, the SGLang / SpecForge default), clipped to the vocabulary and to the number of distinct tokens the
data holds (ranking unseen tokens would be arbitrary; the official `most_common` does the same).

**Training-time test (TTT).** `ttt_steps` (default 7 = the official `self.length`) forward passes per batch.
Step 0 is EAGLE's: the pair (fc(g_i), x_{i+1}) at position i. Step k > 0 feeds back the head's own output: the
midlayer output of step k-1 at row i replaces fc(g) as the hidden input, the token is x_{i+1+k}, the position
i + k, and the row's query attends to the step-0 keys of its sequence up to i (causal) plus its own keys of
steps 1..k (the official attention keeps a list of per-step keys and adds the diagonal scores) - exactly the
attention a draft node at depth k sees in the tree (the committed context and its ancestors). Rows whose
shifted index leaves the sequence are masked (the official `padding(..., left=False)`).

**Loss.** At step k and row i the target is the target's next-token distribution after x_{i+1+k}, restricted to
the draft vocabulary and renormalised (official: `softmax(target_logits[..., t2d])`); the row counts only where
the target's top-1 is in the draft vocabulary (official `position_mask = t2d[argmax] * loss_mask`), so
out-of-vocabulary targets are masked, not mapped. Per step: -sum over masked rows of sum_j p_j log q_j, divided
by every row of the batch (the official `.mean()` over all positions); the total is sum_k 0.8^k loss_k (official
`ploss_weight`). No feature regression and no input noise (EAGLE-3 dropped both). Differences from the official
code, each said beside its default in `Train3Config`: the target distribution is the target's top-k (k stored in
the shards, 16 by default) within the draft vocabulary, not its full softmax (it saves the target's LM head at
training time and keeps the ranking a draft tree uses); learning rate, warmup and cosine decay as `train_eagle`
(the official 5e-5 with 12k warmup steps fine-tunes a 4096-wide layer over 40 epochs on 8 GPUs). The lm_head
starts random, as the official one (`lm_head_init="target"` starts it from the target's LM-head rows and norm
from the target's final-norm gain; on SmolLM2 that start was worse - cross-entropy 17 nats at step 0 against
7.7 for random rows over a 2k vocabulary - since the midlayer's untrained output makes the target's large rows
confidently wrong).

The learning curve (held-out loss, teacher-forced top-1 agreement at step 0 and at the last TTT step, and tau =
tokens per step of real greedy speculative decoding with the `eagle3` drafter on held-out prompts) is printed and
written as `learning_curve.parquet`. The head is saved in the official EAGLE-3 layout (`config.json` with
`draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`, `model.safetensors` with fc /
midlayer.* / norm / lm_head / d2t / t2d; the target's embedding is not stored) with a `specvocab` block naming
the target and its LM-head fingerprint, and a model card `README.md`. A run saves its state (head, optimiser,
step, RNG) every `save_every` steps; a rerun with the same settings resumes, bit-for-bit on the same machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from specvocab.engine.artifacts import FINGERPRINT_KEY, atomic_write, head_fingerprint, head_matches, save_safetensors, save_torch
from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters.eagle import eagle_config_dict, random_eagle_head
from specvocab.engine.drafters.eagle3 import (EAGLE3_ARCHITECTURE, DraftVocab, Eagle3Drafter, Eagle3Head,
                                    eagle3_feature_layers)
from specvocab.engine.harness import generate, resolve_config
from specvocab.engine.models import cache_root, eos_token_ids, load_model
from specvocab.engine.target import decoder
from specvocab.engine.vocab.frspec import eagle3_maps

from specvocab.engine.jobs.args import config_main, run_main
from specvocab.engine.jobs.eagle_data import DTYPES, Sample, TrainError, data_used, default_data_dir, load_split, read_manifest
from specvocab.engine.jobs.train_eagle import chunked_head_ce, pack_samples

FEATURES = ("hidden_low", "hidden_mid", "hidden_high")


@dataclass(frozen=True)
class Train3Config:
    """One EAGLE-3 head training run; the official settings where they transfer, else said why."""

    model: str
    data: str | None = None                 # a folder made by `eagle_data --eagle3-features` (default: default_data_dir)
    out: str | None = None                  # the checkpoint folder (default: <specvocab cache>/eagle3/<model>)
    tokens: int = 1_000_000                 # the budget: sequence tokens processed (all epochs together)
    max_epochs: int = 8                     # passes over the data at most (the budget usually ends first)
    batch_tokens: int = 2048                # tokens per optimiser step (whole sequences, packed)
    draft_vocab_size: int = 32768           # EAGLE-3's 32k (for 128k vocabularies); clipped to V and to the
                                            # distinct tokens the data holds
    vocab_count: str = "top1"               # top1 | response: what the draft vocabulary is counted over
                                            # (module docstring; official: response)
    ttt_steps: int = 7                      # the official `length`: forward passes with the head's own hidden; it
                                            # covers the drafter's default depth (eagle_depth 5); the cost of a
                                            # step grows about linearly with it (--ttt-steps 5 on a tight CPU)
    step_weight: float = 0.8                # loss of TTT step k weighted step_weight ** k (official 0.8)
    lr: float = 1e-3                        # AdamW; as train_eagle (a small layer from scratch), not the official
                                            # 5e-5 / 12k warmup of a 4096-wide layer
    warmup_steps: int = 50
    weight_decay: float = 0.0               # official
    betas: tuple[float, float] = (0.9, 0.95)    # official
    grad_clip: float = 0.5                  # official
    loss_on: str = "all"                    # all | response: as train_eagle (the official code masks the prompt;
                                            # the target's distribution is a valid target everywhere)
    lm_head_init: str = "random"            # random (official) | target: lm_head from the target's LM-head rows of
                                            # the draft vocabulary, norm from its final-norm gain (worse at the
                                            # start on SmolLM2; module docstring)
    head_dtype: str = "bf16"                # the LM-head matmul of the loss (fp32 softmax; fp32 master weights)
    head_chunk: int = 512                   # rows of draft logits materialised at once
    eval_every: int = 250_000               # tokens between learning-curve points
    eval_prompts: int = 8                   # held-out prompts decoded for tau at each point
    eval_new_tokens: int = 48
    save_every: int = 50                    # optimiser steps between resumable checkpoints
    seed: int = 0
    threads: int | None = None
    progress: bool = True

    def validate(self) -> "Train3Config":
        if self.vocab_count not in ("top1", "response"):
            raise TrainError(f"vocab_count must be 'top1' or 'response', got {self.vocab_count!r}")
        if self.loss_on not in ("all", "response"):
            raise TrainError(f"loss_on must be 'all' or 'response', got {self.loss_on!r}")
        if self.lm_head_init not in ("target", "random"):
            raise TrainError(f"lm_head_init must be 'target' or 'random', got {self.lm_head_init!r}")
        if self.head_dtype not in DTYPES:
            raise TrainError(f"head_dtype {self.head_dtype!r}: choose one of {list(DTYPES)}")
        for name in ("ttt_steps", "draft_vocab_size", "batch_tokens", "tokens", "save_every", "head_chunk"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.step_weight > 0:
            raise TrainError(f"step_weight must be > 0, got {self.step_weight}")
        return self


# --- the draft vocabulary ------------------------------------------------------------------------------------------

def counted_tokens(s: Sample, how: str, loss_on: str = "all") -> torch.Tensor:
    """The tokens of one sample the draft vocabulary is counted over: `top1` = the target's top-1 next token at
    each pair's step-0 target (positions 1..L-1, those that get a loss), `response` = the response tokens."""
    if how == "response":
        return s.input_ids[s.loss_mask]
    top1 = s.topk_ids[1:, 0]
    return top1[s.loss_mask[1:]] if loss_on == "response" else top1


def draft_vocabulary(samples: Sequence[Sample], vocab_size: int, size: int, how: str = "top1",
                     loss_on: str = "all") -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts): the `size` most frequent counted tokens (`counted_tokens`), most frequent first (ties: lower
    id first), clipped to the tokens seen at least once."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        counts += np.bincount(counted_tokens(s, how, loss_on).numpy(), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")
    k = min(size, vocab_size, int((counts > 0).sum()))
    if k == 0:
        raise TrainError("the training data holds no counted tokens to choose a draft vocabulary from")
    return order[:k], counts[order[:k]]


# --- batches --------------------------------------------------------------------------------------------------------

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
            raise TrainError("the data folder holds no EAGLE-3 features (hidden_low / mid / high); make it with "
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


# --- the TTT forward -----------------------------------------------------------------------------------------------

class _Padded:
    """Flat rows [T, ...] <-> per-sequence right-padded [B, Lmax, ...] (attention runs per sequence)."""

    def __init__(self, seg: torch.Tensor, pos: torch.Tensor):
        self.B = int(seg.max()) + 1 if seg.numel() else 0
        self.Lmax = int(pos.max()) + 1 if pos.numel() else 0
        self.index = seg * self.Lmax + pos

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((self.B * self.Lmax, *x.shape[1:]))
        return out.index_copy(0, self.index, x).view(self.B, self.Lmax, *x.shape[1:])

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.B * self.Lmax, *x.shape[2:])[self.index]


def ttt_layer(head: Eagle3Head, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, pad: _Padded,
              past: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One TTT step of the midlayer over flat rows (emb, h [T, d] at positions [T]) -> (h' [T, d], this step's
    (keys, values) [B, H, Lmax, hd]). past: the earlier steps' keys / values; past[0] (step 0) is attended
    causally within each sequence, past[1:] and this step's own key only at the row itself."""
    ml = head.midlayer
    attn = ml.self_attn
    hd = attn.head_dim
    H, KV = head.config.num_attention_heads, head.config.num_key_value_heads
    x = torch.cat([ml.input_layernorm(emb), ml.hidden_norm(h)], dim=-1)               # [T, 2d]
    xp = pad.pad(x)                                                                  # [B, Lm, 2d]
    pp = pad.pad(positions)
    q = attn.q_proj(xp).view(pad.B, pad.Lmax, H, hd).transpose(1, 2)                # [B, H, Lm, hd]
    k = attn.k_proj(xp).view(pad.B, pad.Lmax, KV, hd).transpose(1, 2)
    v = attn.v_proj(xp).view(pad.B, pad.Lmax, KV, hd).transpose(1, 2)
    cos, sin = head.rotary_emb(xp, pp)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, H // KV), repeat_kv(v, H // KV)
    steps = past + [(k, v)]
    k0, v0 = steps[0]
    scores = (q @ k0.transpose(2, 3)) * attn.scaling                                 # [B, H, Lm, Lm]
    causal = torch.ones(pad.Lmax, pad.Lmax, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    diag = [((q * kj).sum(-1) * attn.scaling)[..., None] for kj, _ in steps[1:]]       # [B, H, Lm, 1] each
    w = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = w[..., : pad.Lmax] @ v0
    for j, (_, vj) in enumerate(steps[1:]):
        out = out + w[..., pad.Lmax + j, None] * vj
    out = attn.o_proj(out.transpose(1, 2).reshape(pad.B, pad.Lmax, H * hd))
    h = h + pad.flat(out)
    return h + ml.mlp(ml.post_attention_layernorm(h)), (k, v)


def ttt_forward(head: Eagle3Head, embed, batch: Batch3, steps: int | None = None) -> list[torch.Tensor]:
    """The midlayer outputs [T, d] of TTT steps 0..steps-1: step 0 on fc(target features), step k on the
    midlayer output of step k-1 (the head's own hidden), tokens and positions shifted by k."""
    steps = batch.tokens.shape[0] if steps is None else steps
    pad = _Padded(batch.seg, batch.pos)
    h = head.fc(batch.feats)
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs = []
    for k in range(steps):
        emb = embed(batch.tokens[k]).to(h.dtype)
        h, kv = ttt_layer(head, emb, h, batch.pos + k, pad, past)
        past.append(kv)
        outs.append(h)
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


# --- the head --------------------------------------------------------------------------------------------------------

def new_eagle3_head(model, d2t: torch.Tensor, t2d: torch.Tensor, seed: int = 0, lm_head_init: str = "random"
                    ) -> Eagle3Head:
    """An untrained head shaped after the target over the draft vocabulary of (d2t, t2d); lm_head_init="target":
    lm_head = the target's LM-head rows of the draft vocabulary, norm = the target's final-norm gain."""
    like = random_eagle_head(model, seed)                       # the Llama config shaped after the target
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = Eagle3Head(like.config, draft_vocab_size=d2t.numel())
        for p in head.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    if lm_head_init == "target":
        target_ids = torch.arange(d2t.numel()) + d2t
        with torch.no_grad():
            head.lm_head.weight.copy_(model.get_output_embeddings().weight[target_ids].float())
            final = getattr(decoder(model), "norm", None)
            if final is not None:
                d = head.hidden_size
                eps = getattr(final, "eps", None) or getattr(final, "variance_epsilon", 1e-6)
                ones = torch.ones(1, d, dtype=model.get_output_embeddings().weight.dtype)
                gain = final(ones).float()[0] * math.sqrt(1 + eps)      # g from norm(1) = g / sqrt(1 + eps)
                if gain.shape == head.norm.weight.shape and torch.isfinite(gain).all():
                    head.norm.weight.copy_(gain)
    return head


def eagle3_config_dict(head: Eagle3Head, feature_layers: Sequence[int]) -> dict:
    """config.json of an EAGLE-3 head as the official checkpoints write it (Llama-style, `draft_vocab_size`),
    with the feature layers under `eagle_config` as SGLang / vLLM read them."""
    c = eagle_config_dict(head)
    c.pop("bias", None)
    c.update(architectures=[EAGLE3_ARCHITECTURE], draft_vocab_size=head.draft_vocab_size, tie_word_embeddings=False,
             eagle_config={"eagle_aux_hidden_state_layer_ids": [int(i) for i in feature_layers]})
    if head.target_hidden_size != head.hidden_size:
        c["target_hidden_size"] = head.target_hidden_size
    return c


def save_eagle3_head(head: Eagle3Head, folder: str | Path, *, target_name: str, target_weight: torch.Tensor,
                     feature_layers: Sequence[int], training: dict | None = None,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Write `folder/config.json` + `folder/model.safetensors` in the official EAGLE-3 layout (fc, midlayer.*,
    norm, lm_head, d2t int64, t2d bool; the target's embedding not stored), each atomically, with the `specvocab`
    block of `save_eagle_head` (target, vocabulary, hidden size, LM-head fingerprint, training)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
             for k, v in head.state_dict().items() if not k.startswith(("rotary_emb.", "embed_tokens."))}
    config = eagle3_config_dict(head, feature_layers)
    config["torch_dtype"] = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    config["specvocab"] = {"target": target_name, "vocab_size": int(target_weight.shape[0]),
                           "hidden_size": int(target_weight.shape[1]),
                           FINGERPRINT_KEY: head_fingerprint(target_weight), "training": training or {}}
    save_safetensors(state, folder / "model.safetensors", metadata={"format": "pt"})
    atomic_write(folder / "config.json", json.dumps(config, indent=1))
    return folder


def heldout_tau3(model, tokenizer, info, head: Eagle3Head, prompts: Sequence[Sequence[int]], new_tokens: int,
                 eos: Sequence[int], head_dir: str | None = None) -> float:
    """tau of greedy decoding with the `eagle3` drafter (full draft vocabulary) on held-out prompts, with `head`
    (or, with head_dir, the checkpoint saved there)."""
    cfg = resolve_config(SpecConfig.preset("eagle3", vocab="full", max_new_tokens=new_tokens,
                                           eagle3_head=head_dir or "random"), model=model)
    was_training = head.training if head is not None else False
    tokens = steps = 0
    for ids in prompts:
        drafter = Eagle3Drafter(model, cfg, head=None if head_dir else head)
        res = generate(model, torch.as_tensor(list(ids)), cfg, drafter=drafter, tokenizer=tokenizer, info=info,
                       eos_ids=eos)
        del drafter
        tokens += res.new_tokens
        steps += res.steps
    if head is not None:
        head.train(was_training)
    return tokens / max(steps, 1)


def default_head_dir(model: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
    return cache_root() / "eagle3" / safe


def heldout_prompts(held: Sequence[Sample], manifest: dict, n: int) -> list[list[int]]:
    """The prompts (the part before the loss positions) of the first n held-out samples; with teacher data in the
    folder, its teacher samples only (one per prompt)."""
    out = []
    for s in held:
        if len(out) == n:
            break
        if s.source == "teacher" or "teacher" not in manifest["settings"]["sources"]:
            out.append(s.input_ids[: int((~s.loss_mask).sum())].tolist())
    return out


# --- the run ---------------------------------------------------------------------------------------------------------

def train_eagle3(cfg: Train3Config) -> Path:
    """Train an EAGLE-3 head for `cfg.model` on a data folder; returns the checkpoint folder."""
    cfg.validate()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    data = Path(cfg.data).expanduser() if cfg.data else default_data_dir(cfg.model)
    manifest = read_manifest(data)
    if not manifest["settings"].get("eagle3_features"):
        raise TrainError(f"the data in {data} has no EAGLE-3 features; make it with `python -m specvocab.engine.jobs.eagle_data "
                         f"--model {cfg.model} --eagle3-features --out <another folder>`")
    out = Path(cfg.out).expanduser() if cfg.out else default_head_dir(cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, info = load_model(cfg.model, dtype="fp32")
    model.requires_grad_(False)
    weight = model.get_output_embeddings().weight.detach()
    if not head_matches(manifest, weight):
        raise TrainError(f"the data in {data} was made for model {manifest['settings']['model']!r} (vocabulary "
                         f"{manifest['vocab_size']}, hidden {manifest['hidden_size']}), not for {cfg.model!r}; "
                         f"make data for this model with `python -m specvocab.engine.jobs.eagle_data --model {cfg.model} "
                         f"--eagle3-features`")
    train = load_split(data, "train")
    held = load_split(data, "heldout")
    if not train:
        raise TrainError(f"{data} has no training shards; run `python -m specvocab.engine.jobs.eagle_data --model {cfg.model} "
                         f"--eagle3-features`")
    V = weight.shape[0]
    vocab_ids, vocab_counts = draft_vocabulary(train, V, cfg.draft_vocab_size, cfg.vocab_count, cfg.loss_on)
    total_counted = int(sum(counted_tokens(s, cfg.vocab_count, cfg.loss_on).numel() for s in train))
    d2t, t2d = eagle3_maps(vocab_ids, V)
    embed = model.get_input_embeddings()
    layers = eagle3_feature_layers(info.num_layers)

    head = new_eagle3_head(model, d2t, t2d, cfg.seed, cfg.lm_head_init).float().train()
    maps = DraftVocab.of(head, "cpu")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def schedule():
        for epoch in range(cfg.max_epochs):
            yield from pack_samples(train, np.random.default_rng(cfg.seed + epoch).permutation(len(train)),
                                    cfg.batch_tokens)

    steps_per_epoch = len(pack_samples(train, range(len(train)), cfg.batch_tokens))
    total_steps = max(1, min(sum(1 for _ in schedule()),
                             math.ceil(cfg.tokens / max(1, sum(s.input_ids.numel() for s in train) / steps_per_epoch))))

    def lr_at(step):
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) /
                                                          max(1, total_steps - cfg.warmup_steps))))

    run_key = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()
               if k not in ("out", "threads", "progress", "eval_prompts", "eval_new_tokens")}
    run_key["data_manifest"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    state_path = out / "train_state.pt"
    step, tokens_seen, curve, next_eval, seconds_before = 0, 0, [], 0, 0.0
    if state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state.get("run_key") != run_key:
            raise TrainError(f"{state_path} is the state of a run with other settings; pass another --out or delete it")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["torch_rng"])
        step, tokens_seen, curve, next_eval = state["step"], state["tokens_seen"], state["curve"], state["next_eval"]
        seconds_before = state.get("seconds", 0.0)
        print(f"[train eagle3] resuming {out} at step {step} ({tokens_seen:,} tokens)", flush=True)

    eos = eos_token_ids(model, tokenizer)
    held_prompts = heldout_prompts(held, manifest, cfg.eval_prompts)
    head_dtype = DTYPES[cfg.head_dtype]
    held_batches = [make_batch3([held[i] for i in b], maps, cfg.ttt_steps, cfg.loss_on)
                    for b in pack_samples(held, range(len(held)), cfg.batch_tokens)]

    def evaluate():
        head.eval()
        with torch.no_grad():
            rows = [(b, ttt_loss(head, embed, b, step_weight=cfg.step_weight, head_dtype=head_dtype,
                                 chunk=cfg.head_chunk, backward=False)) for b in held_batches]
        n = sum(b.rows for b, _ in rows)
        counted = [sum(r["counted"][k] for _, r in rows) for k in range(cfg.ttt_steps)]
        acc = [sum(r["acc"][k] for _, r in rows) / max(counted[k], 1) for k in range(cfg.ttt_steps)]
        loss = sum(r["loss"] * b.rows for b, r in rows) / n if n else float("nan")
        # tau of the untrained head is ~1 by construction: not worth decoding the held-out prompts for
        tau = heldout_tau3(model, tokenizer, info, head, held_prompts, cfg.eval_new_tokens, eos) \
            if held_prompts and step > 0 else float("nan")
        head.train()
        return {"step": step, "tokens": tokens_seen, "heldout_loss": loss, "heldout_top1": acc[0] if acc else float("nan"),
                "heldout_top1_last_step": acc[-1] if acc else float("nan"), "heldout_top1_by_step": acc,
                "heldout_tau": tau}

    t0 = time.perf_counter()

    def save_state():
        save_torch({"run_key": run_key, "head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                    "tokens_seen": tokens_seen, "curve": curve, "next_eval": next_eval,
                    "torch_rng": torch.get_rng_state(), "seconds": seconds_before + time.perf_counter() - t0},
                   state_path)

    bar = tqdm(total=total_steps, initial=step, unit="step", desc=f"train eagle3 {cfg.model}",
               disable=not cfg.progress)
    recent: list[float] = []
    for b in itertools.islice(schedule(), step, total_steps):      # a resumed run skips the steps it made
        if tokens_seen >= next_eval:
            point = evaluate()
            curve.append(point)
            tqdm.write(f"[train eagle3] {tokens_seen:>10,} tokens: held-out top-1 {point['heldout_top1']:.3f} "
                       f"(step {cfg.ttt_steps - 1}: {point['heldout_top1_last_step']:.3f}), tau "
                       f"{point['heldout_tau']:.2f}, loss {point['heldout_loss']:.3f}")
            next_eval = tokens_seen + cfg.eval_every
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = make_batch3([train[i] for i in b], maps, cfg.ttt_steps, cfg.loss_on)
        opt.zero_grad(set_to_none=True)
        r = ttt_loss(head, embed, batch, step_weight=cfg.step_weight, head_dtype=head_dtype, chunk=cfg.head_chunk)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        tokens_seen += sum(train[i].input_ids.numel() for i in b)
        recent = (recent + [r["loss"]])[-20:]
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(recent):.3f}", tokens=f"{tokens_seen:,}")
        if step % cfg.save_every == 0:
            save_state()
    bar.close()
    point = evaluate()
    curve.append(point)
    save_state()
    seconds = time.perf_counter() - t0
    summary = {"target": cfg.model, "data": str(data), "data_settings": manifest["settings"],
               "data_used": data_used(train, held),
               "draft_vocab": {"size": int(d2t.numel()), "requested": cfg.draft_vocab_size, "counted": cfg.vocab_count,
                               "coverage": float(vocab_counts.sum() / max(total_counted, 1)),
                               "distinct_seen": int(len(vocab_ids)) if len(vocab_ids) < cfg.draft_vocab_size else None},
               "feature_layers": list(layers),
               "tokens_seen": tokens_seen, "steps": step, "train_seconds_this_run": round(seconds, 1),
               "train_seconds_total": round(seconds_before + seconds, 1),
               "heldout_top1": point["heldout_top1"], "heldout_top1_by_step": point["heldout_top1_by_step"],
               "heldout_tau": point["heldout_tau"],
               "eval": {"prompts": len(held_prompts), "new_tokens": cfg.eval_new_tokens, "vocab": "full",
                        "eagle_depth": SpecConfig().eagle_depth, "eagle_topk": SpecConfig().eagle_topk},
               "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("progress",)}}
    save_eagle3_head(head, out, target_name=cfg.model, target_weight=weight, feature_layers=layers, training=summary)
    pl.DataFrame(curve).write_parquet(out / "learning_curve.parquet")
    (out / "README.md").write_text(model_card(cfg, summary, curve))
    print(learning_curve_table(curve))
    print(f"[train eagle3] {cfg.model}: {tokens_seen:,} tokens, {step} steps, draft vocabulary {d2t.numel():,} "
          f"(covers {summary['draft_vocab']['coverage']:.1%} of the counted tokens); held-out top-1 "
          f"{point['heldout_top1']:.3f}, tau {point['heldout_tau']:.2f} -> {out}")
    return out


def learning_curve_table(curve: list[dict]) -> str:
    lines = ["| tokens | held-out top-1 (step 0) | held-out top-1 (last TTT step) | held-out tau | held-out loss |",
             "|---|---|---|---|---|"]
    lines += [f"| {p['tokens']:,} | {p['heldout_top1']:.3f} | {p['heldout_top1_last_step']:.3f} | "
              f"{p['heldout_tau']:.2f} | {p['heldout_loss']:.3f} |" for p in curve]
    return "\n".join(lines)


def model_card(cfg: Train3Config, summary: dict, curve: list[dict]) -> str:
    d, u, dv = summary["data_settings"], summary["data_used"], summary["draft_vocab"]
    sources = "; ".join(x for x in (
        "teacher = the prompt + the corpus's reference response" if "teacher" in d["sources"] else "",
        f"greedy = the prompt + the target's own greedy continuation, {d['greedy_new_tokens']} tokens"
        if "greedy" in d["sources"] else "") if x)
    lines = [f"# EAGLE-3 draft head for `{cfg.model}`", "",
             "An EAGLE-3 head (fc over the target's low / mid / high layer features "
             f"(the residual stream entering decoder layers {summary['feature_layers']}), one midlayer over "
             "[embedding; hidden], norm, lm_head over its own draft vocabulary with d2t / t2d; the target's "
             "embedding is used frozen and not stored), in the official EAGLE-3 checkpoint layout. Made by "
             "`specvocab` (`engine.jobs.train_eagle3`).", "",
             "## Data", "",
             f"- prompts: `{d['prompts']}` (the training corpus of the data root; disjoint from every benchmark), "
             f"shuffled with seed {d['seed']}; used: {u['train_prompts']} prompts / {u['train_tokens']:,} tokens "
             f"for training, {u['heldout_prompts']} prompts / {u['heldout_tokens']:,} tokens held out",
             f"- sources: {', '.join(d['sources'])} ({sources})",
             f"- sequences cut at {d['max_tokens']} tokens; prompts over {d['max_prompt_tokens']} tokens skipped", "",
             "## Draft vocabulary", "",
             f"- {dv['size']:,} ids (asked: {dv['requested']:,}"
             + (f"; the data holds only {dv['distinct_seen']:,} distinct counted tokens" if dv["distinct_seen"] else "")
             + f"), the most frequent {'target top-1 tokens at the loss positions' if dv['counted'] == 'top1' else 'response tokens'} "
             f"of the training split; they cover {dv['coverage']:.1%} of those tokens. Positions whose target top-1 "
             "is outside it get no loss (as EAGLE-3's training).", "",
             "## Command", "", "```",
             f"python -m specvocab.engine.jobs.eagle_data --model {cfg.model} --source {','.join(d['sources'])} --eagle3-features "
             f"--num-prompts {d['num_prompts']} --heldout-prompts {d['heldout_prompts']}"
             + (f" --dtype {d['dtype']}" if d.get("dtype") else ""),
             f"python -m specvocab.engine.jobs.train_eagle3 --model {cfg.model} --tokens {cfg.tokens} --batch-tokens "
             f"{cfg.batch_tokens} --draft-vocab-size {cfg.draft_vocab_size} --ttt-steps {cfg.ttt_steps} --lr {cfg.lr} "
             f"--out <dir>", "```", "",
             "## Budget", "",
             f"- {summary['tokens_seen']:,} training tokens in {summary['steps']} steps of ~{cfg.batch_tokens} tokens, "
             f"each with {cfg.ttt_steps} training-time-test steps; {summary['train_seconds_total']:.0f} s of wall time "
             f"over all runs" + (f" ({cfg.threads} CPU threads)" if cfg.threads else ""),
             f"- loss: sum over TTT steps k of {cfg.step_weight}^k x cross-entropy against the target's top-k "
             f"within the draft vocabulary (renormalised); AdamW lr {cfg.lr}, betas {list(cfg.betas)}, warmup "
             f"{cfg.warmup_steps} steps, cosine; grad clip {cfg.grad_clip}; loss on "
             f"{'every position' if cfg.loss_on == 'all' else 'response positions'}; LM-head matmul in "
             f"{cfg.head_dtype}; lm_head initialised from {'the target LM head rows' if cfg.lm_head_init == 'target' else 'random'}", "",
             "## Result (held-out prompts of the training corpus)", "",
             f"- top-1 agreement with the target (teacher forced, step 0): {summary['heldout_top1']:.3f}; by TTT "
             f"step: {', '.join(f'{a:.3f}' for a in summary['heldout_top1_by_step'])}",
             f"- tau (tokens per draft-verify step, greedy, the `eagle3` drafter, full draft vocabulary, depth "
             f"{summary['eval']['eagle_depth']}, top-k {summary['eval']['eagle_topk']}, default draft size, "
             f"{summary['eval']['prompts']} prompts x {summary['eval']['new_tokens']} tokens): "
             f"{summary['heldout_tau']:.2f}", "", learning_curve_table(curve), "",
             "## What differs from EAGLE's own training code", "",
             "- the target distribution is the target's top-k stored in the data shards (renormalised within the "
             "draft vocabulary), not its full softmax;",
             *(["- lm_head / norm start from the target's LM head and final norm (the official head starts "
                "random);"] if cfg.lm_head_init == "target" else []),
             "- learning rate, warmup and cosine schedule sized for a small head trained from scratch on a CPU "
             "(official: 5e-5, 12k warmup steps, linear decay, fp16, 40 epochs);",
             *(["- the loss covers the prompt's positions too (official: the response's only);"]
               if cfg.loss_on == "all" else []),
             *(["- the draft vocabulary is counted over the target's top-1 next tokens at the loss positions "
                "(official: the response tokens; the same tokens on the target's own greedy continuations);"]
               if dv["counted"] == "top1" else []),
             "- config.json adds `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang / vLLM read it) and a "
             "`specvocab` block; `embed_tokens.weight` is not stored (EAGLE's `ea_model.py` reads the target's "
             "embedding itself, `load_emb=True`, and loads the head with strict=False; not tried in EAGLE's code "
             "here).", "",
             "## Reproducing", "",
             "The same commands make the same data and the same schedule; a run interrupted and resumed gives the "
             "same head bit for bit on one machine, not across machines or thread counts (CPU matmul reductions).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    return config_main(argv, prog="python -m specvocab.engine.jobs.train_eagle3", description=__doc__.split("\n")[0], cls=Train3Config, run=train_eagle3,
                       skip={"model", "betas", "progress"})


if __name__ == "__main__":
    sys.exit(run_main(main))
