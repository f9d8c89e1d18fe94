"""Training data and EAGLE-2 draft heads: `python -m engine.jobs.train_eagle data|eagle`.

Two steps, each resumable, each writing only under its own output folder:

    python -m engine.jobs.train_eagle data  --model smollm2-135m-instruct --source teacher,greedy --num-prompts 768
    python -m engine.jobs.train_eagle eagle --model smollm2-135m-instruct --tokens 2000000 --out engine/heads/smollm2-135m-instruct

**Data** (`make_data`). The target runs over prompts of the training corpus (`train_corpus` in the data root:
disjoint from every benchmark, so nothing is fitted on the prompts it is evaluated on). Per prompt, one sample
per source:
- `teacher`: the prompt followed by the corpus's reference response, one prefill (fast);
- `greedy`: the prompt followed by the target's own greedy continuation (batched `generate`, left-padded),
  then one prefill over the whole sequence - the drafter imitates what it will verify (EAGLE §4; VocabTrim).
A sample stores its token ids, `loss_mask` (1 on response tokens), the target's last hidden states `hidden`
[L, d] (after the final norm: the input of its LM head, what `eagle` reads at decode time), the target's
top-k logits at every position (`topk_ids`, `topk_logits`), and with `--eagle3-features` the low / mid /
high layer features an EAGLE-3 head reads (layers 2, L/2 and L-3, as EAGLE-3 picks them). Samples are
grouped into shards `train-NNNNN.safetensors` / `heldout-NNNNN.safetensors` (a held-out split by prompt),
each written atomically (temp + rename) with its prompt ids in its metadata; `manifest.json` holds the
settings, and a rerun with the same settings skips every finished shard.

**Heads** (`train_eagle`). An EAGLE-1/2 head (`engine.drafters.eagle.EagleHead`: fc over [token embedding;
feature] and one Llama decoder layer shaped after the target; the target's embedding and LM head frozen and
not stored) trained with the EAGLE recipe (EAGLE §4.2-4.3):

    input at position i   (f_i + noise, x_{i+1})         f_i: target feature, x_{i+1}: the next token
    output h_i            regressed onto f_{i+1}          SmoothL1, features divided by their RMS
    logits W h_i          cross-entropy against the target's next-token distribution at i+1
    loss = w_reg * L_reg + w_cls * L_cls                  w_reg = 1, w_cls = 0.1 (EAGLE's weights)

Choices where EAGLE is silent or its setting does not transfer, each said beside its default in `TrainConfig`:
the noise is uniform U(-0.5, 0.5) x 0.2 x RMS(f) (EAGLE adds U-noise of scale 0.2 to features of unit scale;
scaled here so it means the same for every target); the classification target is the target's top-k
distribution (k = 16 stored in the shards, renormalised) rather than its full softmax, which saves a third of
the LM-head work on a 262k vocabulary and leaves the ranking of the tokens a draft tree uses unchanged; the
LM-head loss runs over chunks of rows with the gradient taken chunk by chunk (the fused linear + cross-entropy
of Liger-Kernel), so a 262k-row head never materialises more than one chunk of logits.

The learning curve - held-out top-1 agreement (teacher forced) and tau (mean tokens per step of real
speculative decoding with the head, greedy, on held-out prompts) against training tokens - is printed and
written as `learning_curve.parquet`. The head is saved in the EAGLE checkpoint layout (`config.json` +
`model.safetensors` with the official tensor names, `save_eagle_head`), with a `specvocab` block in its
config that names the target and its LM-head fingerprint (so loading it for another model fails clearly)
and a model card `README.md`. A run checkpoints its state every `save_every` steps and resumes from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from engine.artifacts import (FINGERPRINT_KEY, atomic_write, head_fingerprint, head_matches, save_safetensors,
                              save_torch)
from engine.config import SpecConfig
from engine.drafters.eagle import EagleDrafter, EagleHead, random_eagle_head, save_eagle_head
from engine.harness import generate, resolve_config
from engine.models import cache_root, eos_token_ids, load_model
from engine.prompts import Prompt, PromptError, encode_prompt, load_prompts
from engine.target import decoder, lm_logits

FORMAT = 1
SOURCES = ("teacher", "greedy")


class TrainError(ValueError):
    """Training data or a training run cannot be made as asked; the message names the problem and the fix."""


# ==========================================================================================================
# Data
# ==========================================================================================================

@dataclass(frozen=True)
class DataConfig:
    """What `make_data` runs. Defaults are sized for this 2-core CPU; a GPU user raises num_prompts."""

    model: str
    sources: tuple[str, ...] = ("teacher",)  # teacher | greedy (both: one sample of each per prompt)
    prompts: str = "train_corpus"           # the training corpus: disjoint from every benchmark
    languages: tuple[str, ...] | None = None
    tasks: tuple[str, ...] | None = None
    num_prompts: int = 512                  # prompts used (held-out ones included)
    heldout_prompts: int = 16               # the held-out split (learning curve), the first of the shuffled prompts
    max_tokens: int = 512                   # a sample is cut at this many tokens (prompt + response)
    system_prompt: bool = False             # render prompts with the benchmarks' system prompt (FR-Spec's): off,
                                            # since thousands of copies of one ~100-token preamble teach nothing
    max_prompt_tokens: int = 384            # prompts longer than this are skipped (no room for a response)
    greedy_new_tokens: int = 128            # the target's continuation per prompt (source `greedy`)
    greedy_batch: int = 8                   # prompts per batched `generate`
    prefill_tokens: int = 2048              # sequences per target forward: up to this many tokens (padded)
    prompts_per_shard: int = 32
    topk: int = 16                          # the target's top-k logits stored per position
    eagle3_features: bool = False           # also store the low / mid / high layer features (EAGLE-3 heads)
    feature_dtype: str = "bf16"             # storage of the features: bf16 halves the disk, error ~0.4% of RMS
    seed: int = 0
    out: str | None = None                  # default: <specvocab cache>/train/<model>
    dtype: str | None = None                # the target's compute dtype (None: the machine's default)
    device: str | None = None
    threads: int | None = None
    progress: bool = True

    def key(self) -> dict:
        """The settings a data folder depends on: a folder holds one of them."""
        keep = ("model", "sources", "prompts", "languages", "tasks", "num_prompts", "heldout_prompts", "max_tokens",
                "max_prompt_tokens", "greedy_new_tokens", "topk", "eagle3_features", "feature_dtype", "seed", "dtype", "system_prompt")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in ((k, getattr(self, k)) for k in keep)}

    def validate(self) -> "DataConfig":
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise TrainError(f"unknown data source(s) {bad or '(none)'}; choose from {list(SOURCES)}")
        if self.feature_dtype not in _DTYPES:
            raise TrainError(f"feature_dtype {self.feature_dtype!r}: choose one of {list(_DTYPES)}")
        for name in ("num_prompts", "max_tokens", "greedy_new_tokens", "greedy_batch", "prompts_per_shard", "topk"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.heldout_prompts < self.num_prompts:
            raise TrainError(f"heldout_prompts must be in [0, num_prompts), got {self.heldout_prompts} of "
                             f"{self.num_prompts}")
        return self


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def default_data_dir(model: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
    return cache_root() / "train" / safe


@dataclass
class Sample:
    """One training sequence. Position i holds token x_i and the target's feature after reading x_0..x_i."""

    prompt_id: str
    source: str
    input_ids: torch.Tensor          # [L] long
    loss_mask: torch.Tensor          # [L] bool: x_i is a response token
    hidden: torch.Tensor             # [L, d]
    topk_ids: torch.Tensor           # [L, k] long: the target's top-k next tokens after x_0..x_i
    topk_logits: torch.Tensor        # [L, k] fp32
    extra: dict[str, torch.Tensor] = field(default_factory=dict)   # hidden_low / hidden_mid / hidden_high


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The decoder layers whose outputs an EAGLE-3 head reads: low, middle, high (EAGLE-3 takes 2, L/2, L-3)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@torch.no_grad()
def target_features(model, ids: Sequence[int], *, topk: int, eagle3: bool = False) -> dict[str, torch.Tensor]:
    """One prefill of the target over ids: hidden [L, d] (its LM head's input), top-k logits [L, k] and, with
    eagle3, the three layer features. Tensors on the CPU."""
    return target_features_batch(model, [ids], topk=topk, eagle3=eagle3)[0]


@torch.no_grad()
def target_features_batch(model, seqs: Sequence[Sequence[int]], *, topk: int, eagle3: bool = False
                          ) -> list[dict[str, torch.Tensor]]:
    """`target_features` of several sequences in one forward: right-padded, so (causal attention) no real
    position sees a pad and each row's features are its own; pad rows are dropped. Short sequences batched
    run the matmuls at a useful size (the corpus's samples are ~200 tokens)."""
    device = model.get_output_embeddings().weight.device
    width = max(len(q) for q in seqs)
    x = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, q in enumerate(seqs):
        x[r, : len(q)] = torch.as_tensor(list(q))
    out = decoder(model)(input_ids=x.to(device), use_cache=False, output_hidden_states=eagle3)
    res = []
    for r, q in enumerate(seqs):
        hidden = out.last_hidden_state[r, : len(q)]
        vals, idx = [], []
        for a in range(0, hidden.shape[0], 256):                   # the LM head in chunks of rows
            v, i = lm_logits(model, hidden[a:a + 256]).topk(topk, dim=-1)
            vals.append(v)
            idx.append(i)
        f = {"hidden": hidden.cpu(), "topk_logits": torch.cat(vals).float().cpu(), "topk_ids": torch.cat(idx).cpu()}
        if eagle3:
            layers = eagle3_layers(len(out.hidden_states) - 1)
            for name, layer in zip(("hidden_low", "hidden_mid", "hidden_high"), layers):
                f[name] = out.hidden_states[layer + 1][r, : len(q)].cpu()   # [0] is the embedding output
        res.append(f)
    return res


@torch.no_grad()
def greedy_continuations(model, prompts: Sequence[Sequence[int]], new_tokens: int, eos_ids: Sequence[int],
                         pad_id: int = 0) -> list[list[int]]:
    """The target's greedy continuation of each prompt (batched, left-padded), cut after the first eos."""
    device = model.get_output_embeddings().weight.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.as_tensor(list(p))
        mask[r, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                         do_sample=False, num_beams=1, pad_token_id=pad_id,
                         eos_token_id=list(eos_ids) or None, top_p=None, top_k=None, temperature=None)
    eos = set(int(e) for e in eos_ids)
    conts = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        conts.append(row[:cut])
    return conts


def _response_ids(tokenizer, info, reference: str, eos_ids: Sequence[int]) -> list[int]:
    if tokenizer is None:                       # random models: bytes, as their prompts are
        ids = list(reference.encode("utf-8", "surrogateescape"))
        ids = [i for i in ids if i < info.vocab_size]
    else:
        ids = tokenizer(reference, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids] + ([int(eos_ids[0])] if eos_ids else [])


def _training_prompts(cfg: DataConfig) -> list[Prompt]:
    try:
        prompts = load_prompts(cfg.prompts, languages=cfg.languages, tasks=cfg.tasks)
    except PromptError as e:
        raise TrainError(f"cannot load the training prompts {cfg.prompts!r}: {e}") from e
    if not prompts:
        raise TrainError(f"prompt set {cfg.prompts!r} (languages={cfg.languages}, tasks={cfg.tasks}) is empty; "
                         f"point --prompts at a non-empty training corpus or widen the filters")
    perm = np.random.default_rng(cfg.seed).permutation(len(prompts))      # spread over languages and tasks
    return [prompts[i] for i in perm]


def _save_shard(samples: list[Sample], path: Path, feature_dtype: torch.dtype, meta: dict) -> None:
    lengths = [s.input_ids.numel() for s in samples]
    tensors = {
        "offsets": torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "hidden": torch.cat([s.hidden for s in samples]).to(feature_dtype).contiguous(),
        "topk_ids": torch.cat([s.topk_ids for s in samples]).to(torch.int32),
        "topk_logits": torch.cat([s.topk_logits for s in samples]).float(),
    }
    for name in samples[0].extra:
        tensors[name] = torch.cat([s.extra[name] for s in samples]).to(feature_dtype).contiguous()
    meta = {**meta, "prompt_ids": [s.prompt_id for s in samples], "sources": [s.source for s in samples]}
    save_safetensors(tensors, path, metadata={"specvocab": json.dumps(meta)})


def load_shard(path: str | Path) -> list[Sample]:
    """The samples of one shard; a damaged or foreign file raises TrainError naming it and the fix."""
    path = Path(path)
    fix = f"delete {path} and rerun `python -m engine.jobs.train_eagle data` with the same settings to write it again"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("specvocab", "null"))
        t = load_file(str(path))
    except Exception as e:   # safetensors raises several error types for a truncated or damaged file
        raise TrainError(f"training shard {path} is not readable ({type(e).__name__}: {e}); {fix}") from None
    need = {"offsets", "input_ids", "loss_mask", "hidden", "topk_ids", "topk_logits"}
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not need <= set(t):
        raise TrainError(f"{path} is not a specvocab training shard of format {FORMAT} (missing "
                         f"{sorted(need - set(t)) or 'metadata'}); {fix}")
    off = t["offsets"].tolist()
    n = t["input_ids"].numel()
    if off[0] != 0 or off[-1] != n or any(b <= a for a, b in zip(off, off[1:])) or len(off) - 1 != len(meta["prompt_ids"]) \
            or any(t[k].shape[0] != n for k in need - {"offsets"}):
        raise TrainError(f"{path}: offsets and tensor lengths disagree (a torn or edited shard); {fix}")
    extra = [k for k in ("hidden_low", "hidden_mid", "hidden_high") if k in t]
    out = []
    for j, (a, b) in enumerate(zip(off, off[1:])):
        out.append(Sample(prompt_id=meta["prompt_ids"][j], source=meta["sources"][j],
                          input_ids=t["input_ids"][a:b].long(), loss_mask=t["loss_mask"][a:b].bool(),
                          hidden=t["hidden"][a:b], topk_ids=t["topk_ids"][a:b].long(),
                          topk_logits=t["topk_logits"][a:b], extra={k: t[k][a:b] for k in extra}))
    return out


def read_manifest(folder: str | Path) -> dict:
    folder = Path(folder)
    path = folder / "manifest.json"
    if not path.is_file():
        raise TrainError(f"{folder} holds no training data (no manifest.json); make it with "
                         f"`python -m engine.jobs.train_eagle data --model <name> --out {folder}`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TrainError(f"{path} is not valid JSON ({e}); delete the folder and make the data again") from None


def load_split(folder: str | Path, split: str) -> list[Sample]:
    """Every sample of `split` (train | heldout) in a data folder, shards in order."""
    folder = Path(folder)
    read_manifest(folder)
    shards = sorted(folder.glob(f"{split}-*.safetensors"))
    return [s for path in shards for s in load_shard(path)]


def make_data(cfg: DataConfig) -> Path:
    """Run the target over the training prompts and write the shards (see the module docstring). Returns the
    data folder. Resumable: finished shards are kept; a folder made with other settings is refused."""
    cfg.validate()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser() if cfg.out else default_data_dir(cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, info = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    weight = model.get_output_embeddings().weight
    manifest = {"format": FORMAT, "settings": cfg.key(), "vocab_size": int(weight.shape[0]),
                "hidden_size": int(weight.shape[1]), FINGERPRINT_KEY: head_fingerprint(weight),
                "num_layers": info.num_layers}
    mpath = out / "manifest.json"
    if mpath.is_file():
        have = read_manifest(out)
        if have.get("settings") != manifest["settings"]:
            raise TrainError(f"{out} holds training data made with other settings ({mpath}); pass another --out "
                             f"or delete that folder")
    else:
        atomic_write(mpath, json.dumps(manifest, indent=1))
    eos = eos_token_ids(model, tokenizer)
    feature_dtype = _DTYPES[cfg.feature_dtype]

    # the prompts: encoded, too-long ones skipped, then split into held-out and train, then shards
    chosen: list[tuple[Prompt, list[int]]] = []
    skipped = 0
    for p in _training_prompts(cfg):
        if len(chosen) == cfg.num_prompts:
            break
        try:
            ids = encode_prompt(tokenizer, info, p.turns[:1], [], name=p.prompt_id,
                                system_prompt=p.system_prompt if cfg.system_prompt else None)
        except PromptError:
            skipped += 1
            continue
        if len(ids) > cfg.max_prompt_tokens or ("teacher" in cfg.sources and not p.reference):
            skipped += 1
            continue
        chosen.append((p, ids))
    if not chosen:
        raise TrainError(f"no prompt of {cfg.prompts!r} is usable (all longer than max_prompt_tokens="
                         f"{cfg.max_prompt_tokens}, or without a reference response for source 'teacher')")
    held, train = chosen[: cfg.heldout_prompts], chosen[cfg.heldout_prompts:]
    jobs = [(f"heldout-{i // cfg.prompts_per_shard:05d}", held[i:i + cfg.prompts_per_shard])
            for i in range(0, len(held), cfg.prompts_per_shard)]
    jobs += [(f"train-{i // cfg.prompts_per_shard:05d}", train[i:i + cfg.prompts_per_shard])
             for i in range(0, len(train), cfg.prompts_per_shard)]
    todo = [(name, part) for name, part in jobs if not (out / f"{name}.safetensors").is_file()]
    bar = tqdm(total=len(chosen), initial=len(chosen) - sum(len(p) for _, p in todo), unit="prompt",
               desc=f"train data {cfg.model}", disable=not cfg.progress)
    t0, tokens = time.perf_counter(), 0
    for name, part in todo:
        samples: list[Sample] = []
        conts: dict[int, list[int]] = {}
        if "greedy" in cfg.sources:
            for a in range(0, len(part), cfg.greedy_batch):
                batch = part[a:a + cfg.greedy_batch]
                for j, c in enumerate(greedy_continuations(model, [ids for _, ids in batch], cfg.greedy_new_tokens,
                                                           eos)):
                    conts[a + j] = c
        planned = []                             # (prompt, source, sequence, prompt length), in shard order
        for j, (p, ids) in enumerate(part):
            for source in cfg.sources:
                resp = conts[j] if source == "greedy" else _response_ids(tokenizer, info, p.reference, eos)
                seq = (ids + resp)[: cfg.max_tokens]
                if len(seq) - len(ids) >= 2:
                    planned.append((p, source, seq, len(ids)))
        feats: dict[int, dict] = {}
        order = sorted(range(len(planned)), key=lambda i: len(planned[i][2]))     # similar lengths together
        while order:
            width = len(planned[order[0]][2])
            take = 1
            while take < len(order) and (take + 1) * max(width, len(planned[order[take]][2])) <= cfg.prefill_tokens:
                width = max(width, len(planned[order[take]][2]))
                take += 1
            group, order = order[:take], order[take:]
            for i, f in zip(group, target_features_batch(model, [planned[i][2] for i in group], topk=cfg.topk,
                                                          eagle3=cfg.eagle3_features)):
                feats[i] = f
            tokens += sum(len(planned[i][2]) for i in group)
            bar.set_postfix(tokens=tokens, tok_per_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        for i, (p, source, seq, n_prompt) in enumerate(planned):
            f = feats.pop(i)
            mask = torch.zeros(len(seq), dtype=torch.bool)
            mask[n_prompt:] = True
            samples.append(Sample(prompt_id=str(p.prompt_id), source=source,
                                  input_ids=torch.as_tensor(seq, dtype=torch.long), loss_mask=mask,
                                  hidden=f.pop("hidden"), topk_ids=f.pop("topk_ids"),
                                  topk_logits=f.pop("topk_logits"), extra=f))
        bar.update(len(part))
        if samples:
            _save_shard(samples, out / f"{name}.safetensors", feature_dtype,
                        {"format": FORMAT, "model": cfg.model, "shard": name})
    bar.close()
    n_train, n_held = (len(list(out.glob(f"{s}-*.safetensors"))) for s in ("train", "heldout"))
    print(f"[train data] {out}: {n_train} train + {n_held} held-out shards, {len(chosen)} prompts "
          f"({skipped} skipped as too long or without a reference), sources {','.join(cfg.sources)}")
    return out


# ==========================================================================================================
# EAGLE head training
# ==========================================================================================================

@dataclass(frozen=True)
class TrainConfig:
    """One EAGLE-2 head training run; EAGLE's own settings where they transfer, else said why."""

    model: str
    data: str | None = None                 # a folder made by `make_data` (default: default_data_dir(model))
    out: str | None = None                  # the checkpoint folder (default: <specvocab cache>/eagle/<model>)
    tokens: int = 1_000_000                 # the budget: sequence tokens processed (all epochs together)
    max_epochs: int = 8                     # passes over the data at most (the budget usually ends first)
    batch_tokens: int = 2048                # tokens per optimiser step (whole sequences, packed)
    lr: float = 1e-3                        # AdamW; EAGLE's 3e-5 fine-tunes a 7B-sized layer, this one is
                                            # trained from scratch and ~100x smaller
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)   # EAGLE's
    grad_clip: float = 0.5                  # EAGLE's
    w_reg: float = 1.0                      # EAGLE's v_w
    w_cls: float = 0.1                      # EAGLE's p_w
    noise: float = 0.2                      # uniform noise on input features, x RMS(f) (EAGLE: U-noise 0.2)
    loss_on: str = "all"                    # all | response: positions that get a loss. EAGLE masks the prompt;
                                            # the target's next-token distribution is a valid target at every
                                            # position, and the corpus's references are short (median 35 chars),
                                            # so on a CPU budget the prompts' tokens are kept
    cls_rows: int | None = 512              # rows per step that get the cross-entropy, drawn at random (an
                                            # unbiased subsample; the regression sees every row): the full-vocab
                                            # head is ~90% of a step's cost on 262k tokens. None = every row
    head_dtype: str = "bf16"                # the loss's LM-head matmul (fp32 softmax): 2.8x faster than fp32 on
                                            # this CPU's avx512_bf16 (262k x 640: 191 vs 68 rows/s fwd+bwd)
    head_chunk: int = 512                   # rows of LM-head logits materialised at once
    eval_every: int = 250_000               # tokens between learning-curve points
    eval_prompts: int = 8                   # held-out prompts decoded for tau at each point
    eval_new_tokens: int = 48
    save_every: int = 50                    # optimiser steps between resumable checkpoints
    seed: int = 0
    threads: int | None = None
    progress: bool = True


def _pack(samples: list[Sample], order: Sequence[int], batch_tokens: int) -> list[list[int]]:
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
                         f"make data for this model with `python -m engine.jobs.train_eagle data --model {cfg.model}`")
    train = load_split(data, "train")
    held = load_split(data, "heldout")
    if not train:
        raise TrainError(f"{data} has no training shards; run `python -m engine.jobs.train_eagle data --model {cfg.model}`")
    embed = model.get_input_embeddings()
    if cfg.head_dtype not in _DTYPES:
        raise TrainError(f"head_dtype {cfg.head_dtype!r}: choose one of {list(_DTYPES)}")
    loss_weight = weight.to(_DTYPES[cfg.head_dtype])
    softcap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    sample_rows = torch.cat([s.hidden[:256] for s in train[:64]]).float()
    feature_rms = float(sample_rows.pow(2).mean().sqrt())

    head = random_eagle_head(model, cfg.seed).float().train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    def schedule():
        """Every optimiser step's samples: epoch e packs a permutation seeded by seed + e."""
        for epoch in range(cfg.max_epochs):
            yield from _pack(train, np.random.default_rng(cfg.seed + epoch).permutation(len(train)), cfg.batch_tokens)

    steps_per_epoch = len(_pack(train, range(len(train)), cfg.batch_tokens))
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
    step, tokens_seen, curve, next_eval = 0, 0, [], 0
    if state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state.get("run_key") != run_key:
            raise TrainError(f"{state_path} is the state of a run with other settings; pass another --out or delete it")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, tokens_seen, curve, next_eval = state["step"], state["tokens_seen"], state["curve"], state["next_eval"]
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
                    for b in _pack(held, range(len(held)), cfg.batch_tokens)]

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
                    "tokens_seen": tokens_seen, "curve": curve, "next_eval": next_eval}, state_path)

    gen = torch.Generator().manual_seed(cfg.seed + step)
    bar = tqdm(total=total_steps, initial=step, unit="step", desc=f"train eagle {cfg.model}",
               disable=not cfg.progress)
    t0 = time.perf_counter()
    recent: list[float] = []
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
               "data_used": {"train_samples": len(train), "train_prompts": len({s.prompt_id for s in train}),
                             "train_tokens": int(sum(s.input_ids.numel() for s in train)),
                             "heldout_samples": len(held), "heldout_prompts": len({s.prompt_id for s in held}),
                             "heldout_tokens": int(sum(s.input_ids.numel() for s in held))},
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
             f"python -m engine.jobs.train_eagle data --model {cfg.model} --source {','.join(d['sources'])} "
             f"--num-prompts {d['num_prompts']} --heldout-prompts {d['heldout_prompts']}"
             + (f" --dtype {d['dtype']}" if d.get("dtype") else ""),
             f"python -m engine.jobs.train_eagle eagle --model {cfg.model} --tokens {cfg.tokens} --batch-tokens "
             f"{cfg.batch_tokens} --lr {cfg.lr} --out <dir>", "```", "",
             "## Budget", "",
             f"- {summary['tokens_seen']:,} training tokens in {summary['steps']} steps of ~{cfg.batch_tokens} tokens; "
             f"{summary['train_seconds_this_run']:.0f} s of wall time in the run that finished it"
             + (f" ({cfg.threads} CPU threads)" if cfg.threads else ""),
             f"- loss: SmoothL1 on features / RMS x {cfg.w_reg} + cross-entropy on the target's top-k x {cfg.w_cls}; "
             f"AdamW lr {cfg.lr}, betas {list(cfg.betas)}, warmup {cfg.warmup_steps} steps, cosine; "
             f"feature noise U(-0.5, 0.5) x {cfg.noise} x RMS",
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


# ==========================================================================================================
# CLI
# ==========================================================================================================

def _add_fields(p, cls, skip):
    for fld in dataclasses.fields(cls):
        if fld.name in skip:
            continue
        default = fld.default
        flag = "--" + fld.name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            p.add_argument(flag, type=type(default), default=default, help=f"default {default}")
        elif isinstance(default, tuple) or fld.name in ("languages", "tasks"):
            p.add_argument(flag, default=default, help=f"comma-separated; default {default}")
        else:
            typ = int if fld.type.startswith("int") else float if fld.type.startswith("float") else str
            p.add_argument(flag, type=typ, default=default, help=f"default {default}")


def _split(v):
    return tuple(x for x in v.split(",") if x) if isinstance(v, str) else v


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engine.jobs.train_eagle", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="run the target over training prompts and write feature shards")
    d.add_argument("--model", required=True)
    d.add_argument("--source", default="teacher", help="teacher | greedy | teacher,greedy")
    _add_fields(d, DataConfig, {"model", "sources", "progress"})
    d.add_argument("--no-progress", action="store_true")
    e = sub.add_parser("eagle", help="train an EAGLE-2 head on a data folder")
    e.add_argument("--model", required=True)
    _add_fields(e, TrainConfig, {"model", "betas", "progress"})
    e.add_argument("--no-progress", action="store_true")
    args = vars(ap.parse_args(argv))
    cmd = args.pop("cmd")
    progress = not args.pop("no_progress")
    try:
        if cmd == "data":
            args["sources"] = _split(args.pop("source"))
            for k in ("languages", "tasks"):
                args[k] = _split(args[k]) if args[k] else None
            make_data(DataConfig(**args, progress=progress))
        else:
            train_eagle(TrainConfig(**args, progress=progress))
    except TrainError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
