"""tau(g) and s(g) measured through the harness (UniSpec §3, App. F): what a calibration of the draft size runs.

`measure_grid(model, prompts, method, grid)` runs `engine.harness.generate` with `draft_size=g` for every g of a
grid, on calibration prompts from the training corpus (`calibration_prompts`, never a benchmark's), and returns
one row per g: tau (committed tokens per decoding step, the prefill's first token left out), s_step and
s_forward (the median over prompts and repeats of each prompt's seconds per decoding step, and of its tree
forward's), g_measured (draft tokens per decoding step). The fits and the cache are `engine.calibration`'s; a
full calibration is the job `engine.jobs.calibrate`, the on-the-spot one `engine.resolve.calibrate_here`.

Choices where the paper is silent [C]:
- s(g) is a median, so one prompt hit by a noisy neighbour on a shared machine does not move the fit.
- The store persists through calibration (Alg. 1 builds it first), but rerunning the same prompts at every g
  would let the store memorise their continuations. So the store is warmed once on separate warm-up prompts,
  snapshotted, and restored before every grid point: each g starts from the same state (`round_robin`).
- Grid points above what the method and the target allow (`engine.harness.max_draft_size`) are dropped with a
  warning (`calibration_grid`).
"""

from __future__ import annotations

import warnings
from typing import Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from specvocab.engine.calibration import CalibrationError, default_grid
from specvocab.engine.config import SpecConfig
from specvocab.engine.harness import generate, max_draft_size
from specvocab.engine.prompts import encode_prompt, load_prompts
from specvocab.engine.store import deployment_store


def store_of(model, cfg: SpecConfig, vocab: int):
    """The deployment store the drafter of cfg.method will use, or None if the method has none."""
    if cfg.method not in ("unispec", "recycling") or cfg.store_persistence != "deployment":
        return None
    return deployment_store(model, cfg.method, vocab, cfg.store_k, next(model.parameters()).device)


def run_prompts(model, prompts: Sequence[torch.Tensor], cfg: SpecConfig, *, eos_ids=None) -> dict:
    """Generate every prompt with cfg; tau over all decoding steps, step times per prompt, and the mean
    draft tokens per decoding step (`g_measured`: what the drafter actually proposed)."""
    new = steps = drafted = 0
    step_s, verify_s = [], []                       # [prompts] seconds per decoding step
    for p in prompts:
        r = generate(model, p, cfg, eos_ids=eos_ids)
        n_steps = r.steps - 1                       # decoding steps only: the prefill's token is left out
        if n_steps == 0:
            continue
        new += r.new_tokens - 1
        steps += n_steps
        drafted += r.draft_tokens
        verify_s.append(r.verify_s / n_steps)
        step_s.append((r.wall_s - r.prefill_s) / n_steps)
    if steps == 0:
        raise CalibrationError("no decoding steps ran (every prompt stopped at its first token) — use longer "
                               "max_new_tokens or other prompts, or pass eos_ids=[]")
    return dict(tau=new / steps, s_forward=verify_s, s_step=step_s, steps=steps, new_tokens=new,
                draft_tokens=drafted)


def summarise(runs: list[dict]) -> dict:
    """Pool runs of one g: tau = committed tokens / steps; s = the median per-prompt seconds per step
    (a shared machine's spikes hit single prompts; the median ignores them); g_measured = draft tokens
    per decoding step."""
    new = sum(r["new_tokens"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    s_step = float(np.median([x for r in runs for x in r["s_step"]]))
    s_fwd = float(np.median([x for r in runs for x in r["s_forward"]]))
    return dict(tau=new / steps, s_step=s_step, s_forward=s_fwd, tokens_per_s=new / steps / s_step,
                g_measured=sum(r["draft_tokens"] for r in runs) / steps, steps=steps, new_tokens=new,
                runs=len(runs))


def round_robin(model, prompts: Sequence[torch.Tensor], cfgs: Mapping, *, store=None, repeats: int = 1,
                eos_ids=None, progress: bool = True, desc: str = "calibrate") -> dict:
    """Run every config of `cfgs` ({label: SpecConfig}) on every prompt, interleaved: for each prompt
    all configs back to back (ascending labels, then descending for the next prompt), so a noisy
    neighbour slows all configs alike. With a store, each config keeps its own copy, starting from
    the store's current state and evolving over the prompts as in a deployment; the store is left
    as it was. Returns {label: [run_prompts dicts, one per (repeat, prompt)]}."""
    with torch.inference_mode():          # the store may hold inference tensors (made inside `generate`)
        return _round_robin(model, prompts, cfgs, store, repeats, eos_ids, progress, desc)


def _round_robin(model, prompts, cfgs, store, repeats, eos_ids, progress, desc) -> dict:
    labels = list(cfgs)
    start = None if store is None else (store.tok.clone(), store.con.clone())
    states = {lab: start for lab in labels}
    runs: dict = {lab: [] for lab in labels}
    plan = []
    for rep in range(repeats):
        for i in range(len(prompts)):
            plan += [(lab, i) for lab in (labels if (rep * len(prompts) + i) % 2 == 0 else labels[::-1])]
    for lab, i in tqdm(plan, desc=desc, disable=not progress):
        if store is not None:
            store.tok.copy_(states[lab][0])
            store.con.copy_(states[lab][1])
        runs[lab].append(run_prompts(model, [prompts[i]], cfgs[lab], eos_ids=eos_ids))
        if store is not None:
            states[lab] = (store.tok.clone(), store.con.clone())
    if store is not None:
        store.tok.copy_(start[0])
        store.con.copy_(start[1])
    return runs


def calibration_grid(cfg: SpecConfig, model, grid: Sequence[int] | None = None) -> list[int]:
    """The draft sizes a calibration of cfg measures: `grid` (default `engine.calibration.default_grid` of
    the method and the model's device type), sorted, without the points above `max_draft_size(cfg, model)`
    (a warning names them; if none is left, the largest allowed size alone). The grid is measured as given
    (tau(g) curves are read off it); the fitted g* is then raised to its row bucket's edge (`calibrate`)."""
    device = next(model.parameters()).device
    grid = sorted({int(g) for g in (default_grid(cfg.method, device.type) if grid is None else grid)})
    cap = max_draft_size(cfg, model)
    if cap is not None and grid[-1] > cap:
        kept = [g for g in grid if g <= cap] or [cap]
        warnings.warn(f"{cfg.method} proposes at most {cap} draft tokens with this config and target "
                      f"(engine.harness.max_draft_size); calibrating at {kept} instead of {grid}", stacklevel=2)
        grid = kept
    return grid


def measure_grid(model, prompts: Sequence[torch.Tensor], method: str, grid: Sequence[int], *,
                 cfg: SpecConfig | None = None, warmup_prompts: Sequence[torch.Tensor] = (), repeats: int = 1,
                 eos_ids=None, progress: bool = True) -> list[dict]:
    """tau(g) and s(g) for every g in grid (one row per g), measured through `engine.harness.generate`
    with `draft_size=g`.

    The store is warmed on `warmup_prompts` (untimed; also warms allocator and kernels); every g then
    starts from that state (`round_robin`). Per g: tau over all decoding steps, s = median over prompts
    and repeats of the seconds per decoding step, g_measured = draft tokens per decoding step."""
    if len(grid) == 0:
        raise CalibrationError("empty calibration grid — give at least one draft size")
    if any(int(g) <= 0 for g in grid):
        raise CalibrationError(f"draft sizes must be positive, got {list(grid)}")
    if not prompts:
        raise CalibrationError("no calibration prompts")
    base = (cfg or SpecConfig.preset(method)).replace(method=method)
    vocab = model.get_output_embeddings().weight.shape[0]
    store = store_of(model, base, vocab)
    mid = int(sorted(grid)[len(grid) // 2])
    run_prompts(model, list(warmup_prompts) or list(prompts[:1]), base.replace(draft_size=mid), eos_ids=eos_ids)
    cfgs = {int(g): base.replace(draft_size=int(g)) for g in sorted(set(int(g) for g in grid))}
    runs = round_robin(model, prompts, cfgs, store=store, repeats=repeats, eos_ids=eos_ids, progress=progress,
                       desc=f"calibrate {method}")
    return [{"g": g, **summarise(r)} for g, r in runs.items()]


def calibration_pool(seed: int = 1) -> list:
    """The `Prompt`s `calibration_prompts` draws from: one English training-corpus prompt per task."""
    return load_prompts("train_corpus", languages=["en"], per_category=1, seed=seed)


def calibration_prompts(tokenizer, info, n: int = 5, warmup: int = 2, max_new_tokens: int = 96,
                        seed: int = 1, shortest: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """n calibration + `warmup` warm-up prompts from the training corpus (English, one per task, drawn with
    `seed`; `shortest`: the shortest once encoded, whose prefills cost least), never from the benchmark a
    calibrated g* is measured on. UniSpec App. F calibrates on UltraChat, not available offline; the training
    corpus is its stand-in."""
    pool = calibration_pool(seed)
    rng = np.random.default_rng(seed)
    order = [pool[i] for i in rng.permutation(len(pool))]
    enc = [torch.tensor(encode_prompt(tokenizer, info, p.turns[:1], [], max_new_tokens=max_new_tokens))
           for p in (order if shortest else order[: n + warmup])]
    if shortest:
        enc = sorted(enc, key=len)[: n + warmup]               # stable: ties keep the seeded order
    return enc[:n], enc[n:]
