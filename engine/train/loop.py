"""The one training loop of the draft heads: packing, schedule, checkpoints, resume, learning curve.

A head's recipe (`Recipe`: `engine.train.eagle2` for EAGLE-1/2, `engine.train.eagle3` for EAGLE-3) says how a
batch is made from samples, what one optimiser step's loss is, how the head is evaluated on held-out data and
how a curve point is printed; `train_loop` does the rest the same way for both:

- each epoch e packs the training samples, shuffled by a generator seeded by seed + e, into batches of about
  `batch_tokens` tokens of similar-length sequences (`length_grouped_batches`); the run stops at `tokens` or
  after `max_epochs`;
- AdamW with linear warmup and cosine decay (`lr_at`), gradients clipped by their global norm; each step's
  forward and backward under autocast in `compute_dtype` (`step_dtype`: bf16 where the machine has bf16 dot
  products), with fp32 master weights and optimiser state;
- a curve point (`Recipe.evaluate`) at step 0, every `eval_every` tokens and at the end, each written at once
  to `<out>/learning_curve.parquet`;
- every `save_every` steps the state - head, optimiser, step, tokens, curve, per-step losses, the recipe's
  generator and torch's RNG, wall seconds - goes to `<out>/train_state.pt` (atomically). A run started again
  with the same settings resumes from it and ends where the uninterrupted run ends, bit for bit on one machine;
  other settings are refused. The state file carries everything, so a run moves between machines with it;
- `run_minutes` slices a long run: the loop stops after that many minutes and ends as at its budget (a curve
  point, the state, the head written), so the head so far can be measured while the run goes on later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from specvocab.engine.artifacts import head_matches, save_torch
from specvocab.engine.models import load_model
from specvocab.kernels.hardware import CPU_BF16
from specvocab.engine.train.data import featurizer
from specvocab.engine.train.sample import DTYPES, Sample, TrainError, cache_dir, default_data_dir
from specvocab.engine.train.shards import load_split, read_manifest

# settings that do not change what a run computes: a run resumed with other values of these continues
# (the data folder by its manifest's hash, not its path: a run moves between machines with its folder; how often
# it checkpoints may change between runs)
NOT_IN_RUN_KEY = ("data", "out", "threads", "progress", "eval_prompts", "eval_new_tokens", "save_every",
                  "run_minutes")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The loop's settings both heads share; a head's config adds its own fields before these."""

    eval_every: int = 250_000               # tokens between learning-curve points
    eval_prompts: int = 8                   # held-out prompts decoded for tau at each point
    eval_new_tokens: int = 48
    save_every: int = 50                    # optimiser steps between resumable checkpoints
    seed: int = 0
    compute_dtype: str | None = None        # the head's matmuls in a training step, under torch.autocast (fp32
                                            # master weights, softmax and loss): bf16 | fp32; None = bf16 on a
                                            # CPU with bf16 dot products or a GPU, else fp32
    group_batches: int = 64                 # batches per length-sorted group (`length_grouped_batches`); 0 =
                                            # random packing
    threads: int | None = None
    progress: bool = True
    run_minutes: float | None = None        # stop this run after this many minutes of steps, as if its budget
                                            # ended there (a curve point, the state, the head and its card as of
                                            # that step); run again to continue. 0: write the head of the last
                                            # checkpoint now. None: run to the budget


@dataclass
class RunInputs:
    """What a training run reads before its loop: folders, the target (fp32, frozen), the data's splits, and
    `featured` (samples -> samples with features; computed now for a tokens-only folder)."""

    data: Path
    manifest: dict
    out: Path
    model: Any
    tokenizer: Any
    info: Any
    weight: torch.Tensor        # [V, d] the target's LM head
    train: list[Sample]
    held: list[Sample]
    featured: Callable[[Sequence[Sample]], list[Sample]]


def prepare_run(cfg, kind: str, *, eagle3: bool) -> RunInputs:
    """The inputs of a `kind` ("eagle" | "eagle3") head's run of cfg (model, data, out, threads): the data
    folder (default `default_data_dir`), checked against the target and the head's needs; the output folder
    (default `<specvocab cache>/<kind>/<model>`), created. TrainError names what is wrong and the fix."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    make = f"python -m specvocab.engine.jobs.eagle_data --model {cfg.model}" + (" --eagle3-features" if eagle3 else "")
    data = Path(cfg.data).expanduser() if cfg.data else default_data_dir(cfg.model)
    manifest = read_manifest(data)
    if eagle3 and not manifest["settings"].get("eagle3_features"):
        raise TrainError(f"the data in {data} has no EAGLE-3 features — make it with `{make} --out <another folder>`")
    out = Path(cfg.out).expanduser() if cfg.out else cache_dir(kind, cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, info = load_model(cfg.model, dtype="fp32")
    model.requires_grad_(False)
    weight = model.get_output_embeddings().weight.detach()
    if not head_matches(manifest, weight):
        raise TrainError(f"the data in {data} was made for model {manifest['settings']['model']!r} (vocabulary "
                         f"{manifest['vocab_size']}, hidden {manifest['hidden_size']}), not for {cfg.model!r} — "
                         f"make data for this model with `{make}`")
    train, held = load_split(data, "train"), load_split(data, "heldout")
    if not train:
        raise TrainError(f"{data} has no training shards — run `{make}`")
    return RunInputs(data=data, manifest=manifest, out=out, model=model, tokenizer=tokenizer, info=info,
                     weight=weight, train=train, held=held,
                     featured=featurizer(manifest, cfg.model, eagle3, cfg.loss_on))


def pack_samples(lengths: Sequence[int], order: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive indices of `order` grouped so that each group holds about batch_tokens tokens (whole
    sequences; lengths[i] = tokens of sample i)."""
    batches, cur, size = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and size + n > batch_tokens:
            batches.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        batches.append(cur)
    return batches


def length_grouped_batches(lengths: Sequence[int], rng: np.random.Generator, batch_tokens: int,
                           group_batches: int) -> list[list[int]]:
    """One epoch's batches of about batch_tokens tokens whose sequences have similar lengths (the "group by
    length" sampler of fairseq and transformers' Trainer): a permutation of the samples is cut into groups of
    about group_batches * batch_tokens tokens, each group is sorted by length and packed (`pack_samples`), and
    the batches of the epoch are shuffled. Attention pads each sequence of a batch to the batch's longest, so
    this cuts the padded rows and attention scores (PERFORMANCE.md, "Training the heads").
    group_batches <= 0: plain random packing."""
    order = rng.permutation(len(lengths))
    if group_batches <= 0:
        return pack_samples(lengths, order, batch_tokens)
    lengths = np.asarray(lengths)
    group_of = (np.cumsum(lengths[order]) - 1) // (group_batches * batch_tokens)      # nondecreasing along order
    batches = []
    for group in np.split(order, np.flatnonzero(np.diff(group_of)) + 1):
        batches += pack_samples(lengths, group[np.argsort(lengths[group], kind="stable")], batch_tokens)
    return [batches[i] for i in rng.permutation(len(batches))]


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to 0 at total_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))))


def step_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The autocast dtype of a training step (`RunSettings.compute_dtype`): the named one, else bf16 on a GPU or
    a CPU with bf16 dot products (`kernels.hardware.CPU_BF16`) and fp32 elsewhere (bf16 GEMMs are emulated
    there)."""
    if name is not None:
        if name not in ("bf16", "fp32"):
            raise TrainError(f"compute_dtype {name!r} is not a training dtype — pass bf16 or fp32")
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" or CPU_BF16 else torch.float32


def run_key(cfg, manifest: dict) -> dict:
    """What a run's result depends on: its settings (tuples as lists) and its data folder's manifest hash."""
    key = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()
           if k not in NOT_IN_RUN_KEY}
    key["data_manifest"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    return key


@dataclass
class Recipe:
    """What differs between heads. `batch(indices)` -> a batch of those training samples; `step(batch)` -> the
    loss's floats ({"loss": ...}) with gradients in `params`; `tokens(batch, indices)` -> the training tokens
    the step counts; `evaluate(step, tokens)` -> a curve point ({"step", "tokens", "heldout_top1",
    "heldout_tau", ...}); `describe(point)` -> its printed line."""

    name: str                                   # "eagle" | "eagle3": the log's prefix
    head: torch.nn.Module
    batch: Callable[[list[int]], Any]
    step: Callable[[Any], dict]
    tokens: Callable[[Any, list[int]], int]
    evaluate: Callable[[int, int], dict]
    describe: Callable[[dict], str]
    gen: torch.Generator | None = None          # the recipe's random draws (noise, sampled rows); checkpointed


@dataclass
class LoopResult:
    step: int
    tokens_seen: int
    curve: list[dict]
    losses: list[float]
    seconds_this_run: float
    seconds_total: float
    finished: bool = True                       # False: `run_minutes` stopped the run before its budget


def train_loop(cfg, recipe: Recipe, lengths: Sequence[int], key: dict, out: Path, model_name: str) -> LoopResult:
    """Train recipe.head on the samples of `lengths` as the module docstring says; returns where it ended.
    cfg: a head's training config (tokens, max_epochs, batch_tokens, lr, warmup_steps, weight_decay, betas,
    grad_clip, eval_every, save_every, seed, progress)."""
    head = recipe.head
    params = [p for p in head.parameters() if p.requires_grad]
    device, autocast = params[0].device, step_dtype(cfg.compute_dtype, params[0].device)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def schedule():
        """Every optimiser step's samples: epoch e's batches drawn with the generator seeded by seed + e."""
        for epoch in range(cfg.max_epochs):
            yield from length_grouped_batches(lengths, np.random.default_rng(cfg.seed + epoch), cfg.batch_tokens,
                                              cfg.group_batches)

    steps_per_epoch = len(pack_samples(lengths, range(len(lengths)), cfg.batch_tokens))
    tokens_per_step = max(1, sum(int(n) for n in lengths) / steps_per_epoch)
    total_steps = max(1, min(sum(1 for _ in schedule()), math.ceil(cfg.tokens / tokens_per_step)))

    state_path = out / "train_state.pt"
    step, tokens_seen, curve, next_eval, losses, seconds_before = 0, 0, [], 0, [], 0.0
    if state_path.is_file():
        try:
            state = torch.load(state_path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise TrainError(f"{state_path} is not readable ({type(e).__name__}: {e}) — delete it to start the "
                             f"run again") from None
        if state.get("run_key") != key:
            raise TrainError(f"{state_path} is the state of a run with other settings — pass another --out or "
                             f"delete it")
        if recipe.gen is not None and state.get("rng") is None:
            raise TrainError(f"{state_path} holds no generator state, so its noise cannot be continued — delete it "
                             f"to start the run again")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["torch_rng"])
        if recipe.gen is not None:
            recipe.gen.set_state(state["rng"])
        step, tokens_seen, curve, next_eval = state["step"], state["tokens_seen"], state["curve"], state["next_eval"]
        losses, seconds_before = list(state.get("losses", [])), state.get("seconds", 0.0)
        print(f"[train {recipe.name}] resuming {out} at step {step} ({tokens_seen:,} tokens)", flush=True)

    t0 = time.perf_counter()

    def save_state():
        save_torch({"run_key": key, "head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                    "tokens_seen": tokens_seen, "curve": curve, "next_eval": next_eval, "losses": losses,
                    "rng": recipe.gen.get_state() if recipe.gen is not None else None,
                    "torch_rng": torch.get_rng_state(), "seconds": seconds_before + time.perf_counter() - t0},
                   state_path)

    bar = tqdm(total=total_steps, initial=step, unit="step", desc=f"train {recipe.name} {model_name}",
               disable=not cfg.progress)
    t_run, tokens_run = time.perf_counter(), 0
    for b in itertools.islice(schedule(), step, total_steps):      # a resumed run skips the steps it made
        if tokens_seen >= next_eval:
            point = recipe.evaluate(step, tokens_seen)
            curve.append(point)
            tqdm.write(f"[train {recipe.name}] {tokens_seen:>10,} tokens: {recipe.describe(point)}")
            pl.DataFrame(curve).write_parquet(out / "learning_curve.parquet")     # the curve so far
            next_eval = tokens_seen + cfg.eval_every
        if cfg.run_minutes is not None and time.perf_counter() - t_run >= 60 * cfg.run_minutes:
            tqdm.write(f"[train {recipe.name}] stopping after {cfg.run_minutes:g} min at step {step} of "
                       f"{total_steps} — run the same command again to continue")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=total_steps)
        batch = recipe.batch(b)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast != torch.float32):
            r = recipe.step(batch)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        n = recipe.tokens(batch, b)
        tokens_seen += n
        tokens_run += n
        losses.append(r["loss"])
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", tokens=f"{tokens_seen:,}",
                        tok_per_s=f"{tokens_run / (time.perf_counter() - t_run):.0f}")
        if step % cfg.save_every == 0:
            save_state()
    bar.close()
    if not curve or curve[-1]["step"] != step:                     # a stop right after a point: no second one
        curve.append(recipe.evaluate(step, tokens_seen))
    save_state()
    seconds = time.perf_counter() - t0
    print(f"[train {recipe.name}] this run: {tokens_run:,} training tokens in {time.perf_counter() - t_run:.1f} s "
          f"= {tokens_run / max(time.perf_counter() - t_run, 1e-9):,.1f} tokens/s", flush=True)
    return LoopResult(step=step, tokens_seen=tokens_seen, curve=curve, losses=losses, seconds_this_run=seconds,
                      seconds_total=seconds_before + seconds, finished=step >= total_steps)
