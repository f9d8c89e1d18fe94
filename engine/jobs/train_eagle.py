"""Train an EAGLE-2 draft head on a data folder made by `engine.jobs.eagle_data`.

    python -m specvocab.engine.jobs.train_eagle --model smollm2-135m-instruct --tokens 2000000 --out engine/heads/smollm2-135m-instruct
    specvocab train eagle --model smollm2-135m-instruct ...                 # the same

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
and a model card `README.md`. A run checkpoints its state every `save_every` steps (head, optimiser, the noise
generator's state, the per-step losses) and resumes from it to the same weights as an uninterrupted run.
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
import torch.nn.functional as F
from tqdm.auto import tqdm

from specvocab.engine.artifacts import (head_matches, save_torch)
from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters.eagle import EagleDrafter, EagleHead, random_eagle_head, save_eagle_head
from specvocab.engine.harness import generate, resolve_config
from specvocab.engine.models import cache_root, eos_token_ids, load_model

from specvocab.engine.jobs.args import config_main, run_main
from specvocab.engine.jobs.eagle_data import DTYPES, Sample, TrainError, data_used, default_data_dir, load_split, read_manifest


@dataclass(frozen=True)
class TrainConfig:
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
    eval_every: int = 250_000               # tokens between learning-curve points
    eval_prompts: int = 8                   # held-out prompts decoded for tau at each point
    eval_new_tokens: int = 48
    save_every: int = 50                    # optimiser steps between resumable checkpoints
    seed: int = 0
    threads: int | None = None
    progress: bool = True

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


def pack_samples(samples: list[Sample], order: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive samples of `order` grouped so that each group holds about batch_tokens tokens."""
    batches, cur, size = [], [], 0
    for i in order:
        n = samples[i].input_ids.numel()
        if cur and size + n > batch_tokens:
            batches.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        batches.append(cur)
    return batches


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


def chunked_head_ce(h: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, target_p: torch.Tensor,
                    chunk: int, softcap: float | None = None, with_grad: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean over rows of the cross-entropy -sum_j p_j log softmax(W h)[id_j], and (with_grad) its gradient
    w.r.t. h, computed chunk by chunk so that at most [chunk, V] logits exist at once. Returns (loss, dloss/dh)."""
    grad = torch.zeros_like(h) if with_grad else None
    total = torch.zeros((), dtype=torch.float32)
    n = h.shape[0]
    for a in range(0, n, chunk):
        with torch.enable_grad() if with_grad else torch.no_grad():
            hc = h[a:a + chunk].detach().requires_grad_(with_grad)
            logits = (hc.to(weight.dtype) @ weight.T).float()
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            logp = torch.log_softmax(logits, dim=-1)
            loss = -(target_p[a:a + chunk] * logp.gather(1, target_ids[a:a + chunk])).sum() / n
            if with_grad:
                loss.backward()
                grad[a:a + chunk] = hc.grad
        total += loss.detach()
    return total, grad


def reference_head_ce(h: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, target_p: torch.Tensor,
                      softcap: float | None = None) -> torch.Tensor:
    """The plain reference of `chunked_head_ce` (all logits at once, autograd through everything)."""
    logits = (h @ weight.T).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return -(target_p * torch.log_softmax(logits, dim=-1).gather(1, target_ids)).sum() / h.shape[0]


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
        acc = _top1_agreement(hc.detach(), weight, batch.top_ids[rows][:, 0], chunk)
    reg = reg.detach()
    return {"loss": float(w_reg * reg + w_cls * cls), "reg": float(reg), "cls": float(cls), "acc": acc,
            "rows": int(rows.numel())}


def _top1_agreement(h: torch.Tensor, weight: torch.Tensor, target_top1: torch.Tensor, chunk: int) -> float:
    hits = sum(int(((h[a:a + chunk].to(weight.dtype) @ weight.T).argmax(-1) == target_top1[a:a + chunk]).sum())
               for a in range(0, h.shape[0], chunk))
    return hits / max(h.shape[0], 1)


def heldout_tau(model, tokenizer, info, head: EagleHead, prompts: Sequence[Sequence[int]], new_tokens: int,
                eos: Sequence[int]) -> float:
    """tau (new tokens per draft-verify step) of greedy EAGLE-2 decoding with `head` on held-out prompts."""
    cfg = resolve_config(SpecConfig.preset("eagle", vocab="full", max_new_tokens=new_tokens, eagle_head="random"),
                         model=model)
    was_training = head.training
    tokens = steps = 0
    for ids in prompts:
        drafter = EagleDrafter(model, cfg, head=head)
        res = generate(model, torch.as_tensor(list(ids)), cfg, drafter=drafter, tokenizer=tokenizer, info=info,
                       eos_ids=eos)
        tokens += res.new_tokens
        steps += res.steps
    head.train(was_training)
    return tokens / max(steps, 1)


def default_head_dir(model: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
    return cache_root() / "eagle" / safe


def train_eagle(cfg: TrainConfig) -> Path:
    """Train an EAGLE-1/2 head for `cfg.model` on a data folder; returns the checkpoint folder."""
    cfg.validate()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    data = Path(cfg.data).expanduser() if cfg.data else default_data_dir(cfg.model)
    manifest = read_manifest(data)
    out = Path(cfg.out).expanduser() if cfg.out else default_head_dir(cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, info = load_model(cfg.model, dtype="fp32")
    model.requires_grad_(False)
    weight = model.get_output_embeddings().weight.detach()
    if not head_matches(manifest, weight):
        raise TrainError(f"the data in {data} was made for model {manifest['settings']['model']!r} (vocabulary "
                         f"{manifest['vocab_size']}, hidden {manifest['hidden_size']}), not for {cfg.model!r}; "
                         f"make data for this model with `python -m specvocab.engine.jobs.eagle_data --model {cfg.model}`")
    train = load_split(data, "train")
    held = load_split(data, "heldout")
    if not train:
        raise TrainError(f"{data} has no training shards; run `python -m specvocab.engine.jobs.eagle_data --model {cfg.model}`")
    embed = model.get_input_embeddings()
    loss_weight = weight.to(DTYPES[cfg.head_dtype])
    softcap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    sample_rows = torch.cat([s.hidden[:256] for s in train[:64]]).float()
    feature_rms = float(sample_rows.pow(2).mean().sqrt())

    head = random_eagle_head(model, cfg.seed).float().train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    def schedule():
        """Every optimiser step's samples: epoch e packs a permutation seeded by seed + e."""
        for epoch in range(cfg.max_epochs):
            yield from pack_samples(train, np.random.default_rng(cfg.seed + epoch).permutation(len(train)), cfg.batch_tokens)

    steps_per_epoch = len(pack_samples(train, range(len(train)), cfg.batch_tokens))
    total_steps = max(1, min(sum(1 for _ in schedule()),
                             math.ceil(cfg.tokens / max(1, sum(s.input_ids.numel() for s in train) / steps_per_epoch))))

    def lr_at(step):
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) /
                                                          max(1, total_steps - cfg.warmup_steps))))

    run_key = {k: v for k, v in dataclasses.asdict(cfg).items()
               if k not in ("out", "threads", "progress", "eval_prompts", "eval_new_tokens")}
    run_key["data_manifest"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    state_path = out / "train_state.pt"
    step, tokens_seen, curve, next_eval, losses = 0, 0, [], 0, []
    # the noise and the cross-entropy rows are drawn from this generator; its state is checkpointed with the
    # head and the optimiser, so a resumed run draws what the uninterrupted run would have drawn
    gen = torch.Generator().manual_seed(cfg.seed)
    if state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state.get("run_key") != run_key:
            raise TrainError(f"{state_path} is the state of a run with other settings; pass another --out or delete it")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, tokens_seen, curve, next_eval = state["step"], state["tokens_seen"], state["curve"], state["next_eval"]
        losses = list(state.get("losses", []))
        if "rng" in state:
            gen.set_state(state["rng"])
        else:                                    # a checkpoint from before the generator was saved
            gen.manual_seed(cfg.seed + step)
            print(f"[train eagle] {state_path} holds no generator state: the resumed run's noise differs from "
                  f"an uninterrupted run's", flush=True)
        print(f"[train eagle] resuming {out} at step {step} ({tokens_seen:,} tokens)", flush=True)

    eos = eos_token_ids(model, tokenizer)
    held_prompts = []
    for s in held:
        if len(held_prompts) == cfg.eval_prompts:
            break
        if s.source == "teacher" or "teacher" not in manifest["settings"]["sources"]:
            prompt_len = int((~s.loss_mask).sum())
            held_prompts.append(s.input_ids[:prompt_len].tolist())
    held_batches = [make_batch([held[i] for i in b], loss_on=cfg.loss_on)
                    for b in pack_samples(held, range(len(held)), cfg.batch_tokens)]

    def evaluate():
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

    def save_state():
        save_torch({"run_key": run_key, "head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                    "tokens_seen": tokens_seen, "curve": curve, "next_eval": next_eval, "losses": losses,
                    "rng": gen.get_state()}, state_path)

    bar = tqdm(total=total_steps, initial=step, unit="step", desc=f"train eagle {cfg.model}",
               disable=not cfg.progress)
    t0 = time.perf_counter()
    recent: list[float] = losses[-20:]
    for b in itertools.islice(schedule(), step, total_steps):      # a resumed run skips the steps it made
        if tokens_seen >= next_eval:
            point = evaluate()
            curve.append(point)
            tqdm.write(f"[train eagle] {tokens_seen:>10,} tokens: held-out top-1 {point['heldout_top1']:.3f}, "
                       f"tau {point['heldout_tau']:.2f}, loss {point['heldout_loss']:.3f}")
            next_eval = tokens_seen + cfg.eval_every
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = make_batch([train[i] for i in b], loss_on=cfg.loss_on)
        opt.zero_grad(set_to_none=True)
        r = eagle_loss(head, embed, loss_weight, batch, feature_rms=feature_rms, noise=cfg.noise,
                       w_reg=cfg.w_reg, w_cls=cfg.w_cls, chunk=cfg.head_chunk, softcap=softcap, gen=gen,
                       cls_rows=cfg.cls_rows)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        tokens_seen += int(batch.tokens.numel())
        losses.append(r["loss"])
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
               "tokens_seen": tokens_seen, "steps": step, "train_seconds_this_run": round(seconds, 1),
               "heldout_top1": point["heldout_top1"], "heldout_tau": point["heldout_tau"],
               "eval": {"prompts": len(held_prompts), "new_tokens": cfg.eval_new_tokens, "vocab": "full",
                        "eagle_depth": SpecConfig().eagle_depth, "eagle_topk": SpecConfig().eagle_topk},
               "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("progress",)}}
    save_eagle_head(head, out, target_name=cfg.model, target_weight=weight, training=summary)
    pl.DataFrame(curve).write_parquet(out / "learning_curve.parquet")
    (out / "README.md").write_text(model_card(cfg, summary, curve))
    print(f"[train eagle] {cfg.model}: {tokens_seen:,} tokens, {step} steps; held-out top-1 "
          f"{point['heldout_top1']:.3f}, tau {point['heldout_tau']:.2f} -> {out}")
    return out


def model_card(cfg: TrainConfig, summary: dict, curve: list[dict]) -> str:
    d, u = summary["data_settings"], summary["data_used"]
    lines = [f"# EAGLE-2 draft head for `{cfg.model}`", "",
             "An EAGLE-1/2 head (fc over [token embedding; target feature] + one Llama decoder layer without input "
             "norm; the target's embedding and LM head are used frozen and not stored), in the official EAGLE "
             "checkpoint layout. Made by `specvocab` (`engine.jobs.train_eagle`).", "",
             "## Data", "",
             f"- prompts: `{d['prompts']}` (the training corpus of the data root; disjoint from every benchmark), "
             f"shuffled with seed {d['seed']}; used: {u['train_prompts']} prompts / {u['train_tokens']:,} tokens "
             f"for training, {u['heldout_prompts']} prompts / {u['heldout_tokens']:,} tokens held out",
             f"- sources: {', '.join(d['sources'])} ("
             + "; ".join(x for x in ("teacher = the prompt + the corpus's reference response" if "teacher" in d["sources"] else "",
                                     f"greedy = the prompt + the target's own greedy continuation, {d['greedy_new_tokens']} "
                                     f"tokens" if "greedy" in d["sources"] else "") if x) + ")",
             f"- sequences cut at {d['max_tokens']} tokens; prompts over {d['max_prompt_tokens']} tokens skipped", "",
             "## Command", "", "```",
             f"python -m specvocab.engine.jobs.eagle_data --model {cfg.model} --source {','.join(d['sources'])} "
             f"--num-prompts {d['num_prompts']} --heldout-prompts {d['heldout_prompts']}"
             + (f" --dtype {d['dtype']}" if d.get("dtype") else ""),
             f"python -m specvocab.engine.jobs.train_eagle --model {cfg.model} --tokens {cfg.tokens} --batch-tokens "
             f"{cfg.batch_tokens} --lr {cfg.lr} --out <dir>", "```", "",
             "## Budget", "",
             f"- {summary['tokens_seen']:,} training tokens in {summary['steps']} steps of ~{cfg.batch_tokens} tokens; "
             f"{summary['train_seconds_this_run']:.0f} s of wall time in the run that finished it"
             + (f" ({cfg.threads} CPU threads)" if cfg.threads else ""),
             f"- loss: SmoothL1 on features / RMS x {cfg.w_reg} + cross-entropy on the target's top-k x {cfg.w_cls}; "
             f"AdamW lr {cfg.lr}, betas {list(cfg.betas)}, warmup {cfg.warmup_steps} steps, cosine; "
             f"feature noise U(-0.5, 0.5) x {cfg.noise} x RMS (EAGLE's code: x 0.2 x 512 / sequence length); "
             f"gradients clipped to global norm {cfg.grad_clip} (EAGLE's code clips each element to +-0.5); "
             f"trained from scratch, as EAGLE's heads are",
             f"- loss on {'every position' if cfg.loss_on == 'all' else 'response positions'}; cross-entropy on "
             f"{cfg.cls_rows or 'all'} random rows per step, LM-head matmul in {cfg.head_dtype}; the data's "
             f"target ran in {d.get('dtype') or 'the default dtype'}", "",
             "## Result (held-out prompts of the training corpus)", "",
             f"- top-1 agreement with the target (teacher forced): {summary['heldout_top1']:.3f}",
             f"- tau (tokens per draft-verify step, greedy, full vocabulary, depth {summary['eval']['eagle_depth']}, "
             f"top-k {summary['eval']['eagle_topk']}, default draft size, {summary['eval']['prompts']} prompts x "
             f"{summary['eval']['new_tokens']} tokens): {summary['heldout_tau']:.2f}", "",
             "| tokens | held-out top-1 | held-out tau | held-out loss |", "|---|---|---|---|"]
    lines += [f"| {p['tokens']:,} | {p['heldout_top1']:.3f} | {p['heldout_tau']:.2f} | {p['heldout_loss']:.3f} |"
              for p in curve]
    lines += ["", "## Reproducing", "",
              "The same commands make the same data (fixed seeds, greedy decoding) and the same schedule; the head "
              "is not bit-identical across machines or thread counts (CPU matmul reductions), so held-out top-1 "
              "and tau are the figures to compare.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    return config_main(argv, prog="python -m specvocab.engine.jobs.train_eagle", description=__doc__.split("\n")[0], cls=TrainConfig, run=train_eagle,
                       skip={"model", "betas", "progress"})


if __name__ == "__main__":
    sys.exit(run_main(main))
