"""The EAGLE-1/2 head's recipe: batches, loss and run (`train_eagle`), on the loop of `engine.train.loop`.

**Heads** (`train_eagle`). An EAGLE-1/2 head (`engine.drafters.eagle.EagleHead`: fc over [token embedding;
feature] and one Llama decoder layer shaped after the target; the target's embedding and LM head frozen and
not stored) trained with the EAGLE recipe (EAGLE §4.2-4.3):

    input at position i   (f_i + noise, x_{i+1})         f_i: target feature, x_{i+1}: the next token
    output h_i            regressed onto f_{i+1}          SmoothL1, features divided by their RMS
    logits W h_i          cross-entropy against the target's next-token distribution at i+1
    loss = w_reg * L_reg + w_cls * L_cls                  w_reg = 1, w_cls = 0.1 (EAGLE's weights)

Where this differs from EAGLE's own training code (SafeAILab/EAGLE, eagle/train/main.py), each said beside its
default in `TrainConfig`. Like EAGLE, the head is trained from scratch (EAGLE's `Model` is initialised fresh and
only its embedding is loaded from the target). Unlike it: the noise is U(-0.5, 0.5) x 0.2 x RMS(f), the same
for every sequence and scaled to the target's features, where EAGLE's `AddUniformNoise` adds U(-0.5, 0.5) x
0.2 x 512 / L in the features' own units, L the sequence's length (so short sequences get more); gradients
are clipped by their global norm (`clip_grad_norm_`, 0.5), where EAGLE clips every element by value
(`clip_grad_value_`, 0.5); the learning rate is larger (see `lr`); the classification target is the target's top-k
distribution (k = 16 stored in the shards, renormalised) rather than its full softmax, which saves a third of
the LM-head work on a 262k vocabulary and leaves the ranking of the tokens a draft tree uses unchanged; the
LM-head loss runs over chunks of rows with the gradient taken chunk by chunk (the fused linear + cross-entropy
of Liger-Kernel), so a 262k-row head never materialises more than one chunk of logits.

The learning curve - held-out top-1 agreement (teacher forced) and tau (mean tokens per step of real
speculative decoding with the head, greedy, on held-out prompts) against training tokens - is printed and
written as `learning_curve.parquet`. The head is saved in the EAGLE checkpoint layout (`config.json` +
`model.safetensors` with the official tensor names, `save_eagle_head`), with a `specvocab` block in its
config that names the target and its LM-head fingerprint (so loading it for another model fails clearly)
and a model card `README.md`. A run checkpoints and resumes as `engine.train.loop` says (the noise generator's state included), to the same
weights as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import polars as pl
import torch
import torch.nn.functional as F

from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters.eagle import EagleHead, random_eagle_head, save_eagle_head
from specvocab.engine.models import eos_token_ids
from specvocab.engine.train.cards import eagle2_card
from specvocab.engine.train.evaluate import heldout_tau
from specvocab.engine.train.loop import Recipe, RunSettings, pack_samples, prepare_run, run_key, train_loop
from specvocab.engine.train.losses import chunked_head_ce, top1_agreement
from specvocab.engine.train.sample import DTYPES, Sample, TrainError, data_used, heldout_prompts


@dataclass(frozen=True)
class TrainConfig(RunSettings):
    """One EAGLE-2 head training run; EAGLE's own settings where they transfer, else said why."""

    model: str
    data: str | None = None                 # a folder made by `make_data` (default: default_data_dir(model))
    out: str | None = None                  # the checkpoint folder (default: <specvocab cache>/eagle/<model>)
    tokens: int = 1_000_000                 # the budget: sequence tokens processed (all epochs together)
    max_epochs: int = 8                     # passes over the data at most (the budget usually ends first)
    batch_tokens: int = 2048                # tokens per optimiser step (whole sequences, packed)
    lr: float = 1e-3                        # AdamW. EAGLE trains from scratch too, at 3e-5 (2000 warmup steps,
                                            # linear decay over 800k steps) on 7B-sized layers; this head is ~100x
                                            # smaller and gets a few hundred steps on a CPU budget
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)   # EAGLE's
    grad_clip: float = 0.5                  # EAGLE's 0.5, but as a bound on the global gradient norm
                                            # (clip_grad_norm_); EAGLE clips each element by value
    w_reg: float = 1.0                      # EAGLE's v_w
    w_cls: float = 0.1                      # EAGLE's p_w
    noise: float = 0.2                      # U(-0.5, 0.5) x noise x RMS(f) on input features; EAGLE: U(-0.5, 0.5)
                                            # x 0.2 x 512 / L, L the sequence length, in the features' own units
    loss_on: str = "all"                    # all | response: positions that get a loss. EAGLE masks the prompt;
                                            # the target's next-token distribution is a valid target at every
                                            # position, and the corpus's references are short (median 35 chars),
                                            # so on a CPU budget the prompts' tokens are kept
    cls_rows: int | None = 512              # rows per step that get the cross-entropy, drawn at random (an
                                            # unbiased subsample; the regression sees every row): the full-vocab
                                            # head is ~90% of a step's cost on 262k tokens. None = every row
    head_dtype: str = "bf16"                # the loss's LM-head matmul (fp32 softmax): faster than fp32 on a
                                            # CPU with bf16 dot products (PERFORMANCE.md, section 6)
    head_chunk: int = 512                   # rows of LM-head logits materialised at once

    def validate(self) -> "TrainConfig":
        """The settings checked before anything loads; TrainError names the bad one."""
        if self.loss_on not in ("all", "response"):
            raise TrainError(f"loss_on must be 'all' or 'response', got {self.loss_on!r}")
        if self.head_dtype not in DTYPES:
            raise TrainError(f"head_dtype {self.head_dtype!r}: choose one of {list(DTYPES)}")
        for name in ("tokens", "max_epochs", "batch_tokens", "save_every", "head_chunk"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        return self


def _block_causal_bias(lengths: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, T] additive mask: causal within each packed sequence, nothing across them."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths)))
    pos = torch.arange(seg.numel())
    ok = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    return torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)[None, None]


def head_forward(head: EagleHead, embed, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                 bias: torch.Tensor) -> torch.Tensor:
    """The head over packed pairs (feats [T, d], tokens [T]) -> h [T, d] (the same modules the drafter runs)."""
    x = head.fc(torch.cat([embed(tokens).to(feats.dtype), feats], dim=-1))[None]
    pos = positions[None]
    out = head.layers[0](x, attention_mask=bias, position_ids=pos, position_embeddings=head.rotary_emb(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    return out[0]


@dataclass
class Batch:
    tokens: torch.Tensor       # [T] x_{i+1}
    feats: torch.Tensor        # [T, d] f_i
    target: torch.Tensor       # [T, d] f_{i+1}
    top_ids: torch.Tensor      # [T, k] target's top-k after x_{i+1}
    top_p: torch.Tensor        # [T, k] renormalised
    mask: torch.Tensor         # [T] bool: loss here (x_{i+1} is a response token)
    positions: torch.Tensor    # [T]
    bias: torch.Tensor         # [1, 1, T, T]


def make_batch(samples: Sequence[Sample], dtype: torch.dtype = torch.float32, loss_on: str = "response") -> Batch:
    """Pairs (f_i, x_{i+1}) at position i -> targets at i+1, for packed samples (EAGLE §4.2). loss_on:
    "response" = a loss where x_{i+1} is a response token, "all" = everywhere."""
    if loss_on not in ("all", "response"):
        raise TrainError(f"loss_on must be 'all' or 'response', got {loss_on!r}")
    parts = [(s.input_ids[1:], s.hidden[:-1], s.hidden[1:], s.topk_ids[1:], s.topk_logits[1:],
              s.loss_mask[1:] if loss_on == "response" else torch.ones(s.input_ids.numel() - 1, dtype=torch.bool))
             for s in samples if s.input_ids.numel() >= 2]
    lengths = [p[0].numel() for p in parts]
    tok, f, tgt, ids, logit, mask = (torch.cat(c) for c in zip(*parts))
    return Batch(tokens=tok, feats=f.to(dtype), target=tgt.to(dtype), top_ids=ids,
                 top_p=torch.softmax(logit.float(), dim=-1), mask=mask,
                 positions=torch.cat([torch.arange(n) for n in lengths]),
                 bias=_block_causal_bias(lengths, dtype))


def eagle_loss(head: EagleHead, embed, weight: torch.Tensor, batch: Batch, *, feature_rms: float, noise: float,
               w_reg: float, w_cls: float, chunk: int, softcap: float | None = None,
               gen: torch.Generator | None = None, backward: bool = True, cls_rows: int | None = None
               ) -> dict[str, float]:
    """EAGLE's loss on one batch (see the module docstring); with backward, gradients land in head's params.
    weight: the LM head in the dtype its matmul runs in. cls_rows: the cross-entropy on that many random
    loss rows (None: all)."""
    feats = batch.feats
    if noise > 0:
        feats = feats + (torch.rand(feats.shape, generator=gen, dtype=feats.dtype) - 0.5) * (noise * feature_rms)
    h = head_forward(head, embed, batch.tokens, feats, batch.positions, batch.bias)
    m = batch.mask
    if not bool(m.any()):
        return {"loss": 0.0, "reg": 0.0, "cls": 0.0, "acc": float("nan"), "rows": 0}
    hm = h[m]
    reg = F.smooth_l1_loss(hm / feature_rms, batch.target[m] / feature_rms)
    rows = m.nonzero().flatten()
    if cls_rows is not None and rows.numel() > cls_rows:
        rows = rows[torch.randperm(rows.numel(), generator=gen)[:cls_rows]]
    hc = h[rows]
    if backward:
        cls, g_cls = chunked_head_ce(hc, weight, batch.top_ids[rows], batch.top_p[rows], chunk, softcap)
        full = torch.zeros_like(h)
        full[rows] = g_cls.to(h.dtype) * w_cls
        torch.autograd.backward([w_reg * reg, h], [None, full])          # one pass through the layer
        acc = float("nan")                                               # measured at the held-out points
    else:
        cls, _ = chunked_head_ce(hc.detach(), weight, batch.top_ids[rows], batch.top_p[rows], chunk, softcap,
                                 with_grad=False)
        acc = top1_agreement(hc.detach(), weight, batch.top_ids[rows][:, 0], chunk)
    reg = reg.detach()
    return {"loss": float(w_reg * reg + w_cls * cls), "reg": float(reg), "cls": float(cls), "acc": acc,
            "rows": int(rows.numel())}


def train_eagle(cfg: TrainConfig) -> Path:
    """Train an EAGLE-1/2 head for `cfg.model` on a data folder; returns the checkpoint folder."""
    cfg.validate()
    run = prepare_run(cfg, "eagle", eagle3=False)
    data, manifest, out, model, tokenizer, info = run.data, run.manifest, run.out, run.model, run.tokenizer, run.info
    weight, train, held, featured = run.weight, run.train, run.held, run.featured

    embed = model.get_input_embeddings()
    loss_weight = weight.to(DTYPES[cfg.head_dtype])
    softcap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    sample_rows = torch.cat([s.hidden[:256] for s in featured(train[:64])]).float()
    feature_rms = float(sample_rows.pow(2).mean().sqrt())
    head = random_eagle_head(model, cfg.seed).float().train()
    # the noise and the cross-entropy rows are drawn from this generator; the loop checkpoints its state
    gen = torch.Generator().manual_seed(cfg.seed)

    eos = eos_token_ids(model, tokenizer)
    held_prompts = heldout_prompts(held, manifest, cfg.eval_prompts)
    held_batches = [make_batch(featured([held[i] for i in b]), loss_on=cfg.loss_on)
                    for b in pack_samples([s.input_ids.numel() for s in held], range(len(held)), cfg.batch_tokens)]

    def evaluate(step: int, tokens_seen: int) -> dict:
        head.eval()
        with torch.no_grad():
            rows = [eagle_loss(head, embed, loss_weight, b, feature_rms=feature_rms, noise=0.0, w_reg=cfg.w_reg,
                               w_cls=cfg.w_cls, chunk=cfg.head_chunk, softcap=softcap, backward=False)
                    for b in held_batches]
        n = sum(r["rows"] for r in rows)
        acc = sum(r["acc"] * r["rows"] for r in rows) / n if n else float("nan")
        loss = sum(r["loss"] * r["rows"] for r in rows) / n if n else float("nan")
        # tau of the untrained head is ~1 by construction: not worth decoding the held-out prompts for
        tau = heldout_tau(model, tokenizer, info, head, held_prompts, cfg.eval_new_tokens, eos) \
            if held_prompts and step > 0 else float("nan")
        head.train()
        return {"step": step, "tokens": tokens_seen, "heldout_loss": loss, "heldout_top1": acc, "heldout_tau": tau}

    def step(batch: Batch) -> dict:
        return eagle_loss(head, embed, loss_weight, batch, feature_rms=feature_rms, noise=cfg.noise,
                          w_reg=cfg.w_reg, w_cls=cfg.w_cls, chunk=cfg.head_chunk, softcap=softcap, gen=gen,
                          cls_rows=cfg.cls_rows)

    recipe = Recipe(
        name="eagle", head=head, gen=gen, step=step, evaluate=evaluate,
        batch=lambda idx: make_batch(featured([train[i] for i in idx]), loss_on=cfg.loss_on),
        tokens=lambda batch, idx: int(batch.tokens.numel()),
        describe=lambda p: (f"held-out top-1 {p['heldout_top1']:.3f}, tau {p['heldout_tau']:.2f}, "
                            f"loss {p['heldout_loss']:.3f}"))
    res = train_loop(cfg, recipe, [s.input_ids.numel() for s in train], run_key(cfg, manifest), out, cfg.model)
    point = res.curve[-1]
    summary = {"target": cfg.model, "data": str(data), "data_settings": manifest["settings"],
               "data_used": data_used(train, held),
               "tokens_seen": res.tokens_seen, "steps": res.step, "finished": res.finished,
               "train_seconds_this_run": round(res.seconds_this_run, 1),
               "train_seconds_total": round(res.seconds_total, 1),
               "heldout_top1": point["heldout_top1"], "heldout_tau": point["heldout_tau"],
               "eval": {"prompts": len(held_prompts), "new_tokens": cfg.eval_new_tokens, "vocab": "full",
                        "eagle_depth": SpecConfig().eagle_depth, "eagle_topk": SpecConfig().eagle_topk},
               "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("progress",)}}
    save_eagle_head(head, out, target_name=cfg.model, target_weight=weight, training=summary)
    pl.DataFrame(res.curve).write_parquet(out / "learning_curve.parquet")
    (out / "README.md").write_text(eagle2_card(cfg, summary, res.curve))
    print(f"[train eagle] {cfg.model}: {res.tokens_seen:,} tokens, {res.step} steps; held-out top-1 "
          f"{point['heldout_top1']:.3f}, tau {point['heldout_tau']:.2f} -> {out}")
    return out
