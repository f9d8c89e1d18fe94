"""Measure tau(g) and s(g) through the harness and calibrate the draft size g* (UniSpec §3, App. F):
`calibrate(model, prompts, method)` and the CLI `python -m specvocab.engine.jobs.calibrate`.

The fits, the pipelines ("default", and "paper": the paper's own), the cache and `resolve_draft_size`
live in `engine.calibration` (pure; the harness imports them); the measurement through the harness in
`engine.measure`. This job measures `engine.harness.generate` with `draft_size=g` for every g of a grid, for
every drafting method (unispec, recycling, layerskip, eagle, pld, hf-prompt-lookup): every method reads its
draft size from the one field `draft_size`, so every calibration varies the tree it verifies (what g is per
method, and why recycling keeps its template and eagle its depth: `engine.calibration`). The config is resolved
as a run resolves it (`engine.resolve.resolve_run`: the head first, then frspec's list and dynaspec's fit), and
the record is cached under the key a run looks its size up with. A run with no record calibrates on the spot,
on a smaller grid (`engine.resolve.calibrate_here`); this job measures the full one.

Choices where the paper is silent [C]:
- tau(g) counts decoding steps only (the prefill's first token is left out); s(g) is the median over
  prompts (and repeats) of each prompt's seconds per step, so one prompt hit by a noisy neighbour on a
  shared machine does not move the fit. Both the full step and the tree forward are recorded
  (`s_step`, `s_forward`); the pipeline says which one is fitted.
- The store persists through calibration (Alg. 1 builds it first), but rerunning the same prompts at
  every g would let the store memorise their continuations. So the store is warmed once on separate
  warm-up prompts, snapshotted, and restored before every grid point: each g starts from the same state.
- Grids (`engine.calibration.default_grid`): CPU {1,2,3,4,6,8,12,16,24,32} (verification cost grows
  steeply with g on a CPU); CUDA {16,32,...,160}; prompt lookup's chains stop below 32 and recycling's CUDA
  grid at its 80 nodes (`METHOD_GRIDS`). Points above what the method and the target allow
  (`engine.harness.max_draft_size`) are dropped with a warning. The fitted g* is raised to its row bucket's
  edge (`engine.harness.bucket_edge`: on the CPU's per-step buckets the bucket's largest tree costs the same). Fewer than 4 points lower the polynomial degree.
- Calibration prompts come from the training corpus, never from a benchmark (`calibration_prompts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Sequence

import torch

from specvocab.engine.calibration import (EAGLE_CANDIDATES, NO_CALIBRATION, CalibrationError, Pipeline, code_stamp,
                                         device_name, eagle_total_token, fit_record, kernel_build, model_id, model_key,
                                         pipeline_of, refit, save_calibration)
from specvocab.engine.config import (DRAFTING_METHODS, SpecConfig, calibration_fields, config_fingerprint,
                           parse_overrides)
from specvocab.engine.jobs.args import add_debug, check_at_least, check_model, parse_ints, run_main
from specvocab.engine.harness import bucket_edge, max_draft_size
# the measurement is library code (the on-the-spot calibration runs it too); re-exported for this job's users
from specvocab.engine.measure import (calibration_grid, calibration_pool, calibration_prompts,  # noqa: F401
                                      measure_grid, round_robin, run_prompts, store_of, summarise)
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.resolve import resolve_run
from specvocab.kernels.hardware import parse_device, parse_dtype


def measure_forward(model, lengths: Sequence[int] = EAGLE_CANDIDATES, reps: int = 20) -> dict[int, float]:
    """EAGLE's timing: mean seconds of one forward of n random tokens, no KV cache, per n."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    out = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, max(1, vocab - 200), (1, n), generator=gen).to(device)
            model(ids)                                                   # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)                           # timing needs the queue drained
            t0 = time.perf_counter()
            for _ in range(reps):
                model(ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out[int(n)] = (time.perf_counter() - t0) / reps
    return out


def resolved_configs(cfg: SpecConfig, model, tokenizer=None, info=None, eos_ids=None) -> tuple[SpecConfig, SpecConfig]:
    """(keyed, run) of cfg, both without a draft size, from the run's one resolution (`engine.resolve.resolve_run`,
    as `engine.jobs.bench` resolves it): keyed, the config the record is keyed on - its head resolved (a shipped
    head for eagle_head / eagle3_head None), frspec's list and dynaspec's fit as given, as a bench looks its size
    up - and run, the config measured, with the list and fit resolved too (frspec's default ranking, dynaspec's
    newest fit)."""
    try:
        res = resolve_run(cfg.replace(draft_size=1), model, tokenizer=tokenizer, info=info, eos_ids=eos_ids,
                          calibration=NO_CALIBRATION, on_the_spot=False)
    except ValueError as e:                                    # FrequencyError, DynaSpecError: the message says
        raise CalibrationError(str(e)) from None
    return res.keyed.replace(draft_size=None), res.cfg.replace(draft_size=None)


def runnable_config(cfg: SpecConfig, model, tokenizer=None, info=None, eos_ids=None) -> SpecConfig:
    """cfg as a run measures it (`resolved_configs`' run)."""
    return resolved_configs(cfg, model, tokenizer, info, eos_ids)[1]


def calibrate(model, prompts: Sequence[torch.Tensor], method: str = "unispec", *, grid: Sequence[int] | None = None,
              pipeline: str | Pipeline = "default", mode: str | None = None, timing: str | None = None,
              cfg: SpecConfig | None = None, warmup_prompts: Sequence[torch.Tensor] = (), repeats: int = 1,
              eos_ids=None, save: bool = True, progress: bool = True, tokenizer=None, info=None) -> dict:
    """Measure the grid (`calibration_grid`), fit, maximise, and (save=True) cache g* of `method` - any of
    `engine.config.DRAFTING_METHODS` - under `engine.calibration.model_key`: (model, device, dtype,
    method, the config fields that change tau or s), where `resolve_config` finds it for draft_size=None.
    `pipeline`: "default" or "paper" (`engine.calibration.PIPELINES`); mode / timing override it.
    tokenizer, info: the model's, for frspec's default ranking (`runnable_config`). Returns the
    calibration record (UniSpec App. F: the grid, tau_i, s_i, the fits' g*, the config, the machine)."""
    if method not in DRAFTING_METHODS:
        raise CalibrationError(f"method {method!r} drafts nothing: there is no draft size to calibrate — choose one "
                               f"of {list(DRAFTING_METHODS)}")
    p = pipeline_of(pipeline, mode=mode, timing=timing)
    base = (cfg or SpecConfig.preset(method)).replace(method=method, draft_size=None)
    device = next(model.parameters()).device
    if grid is not None and len(grid) == 0:
        raise CalibrationError("empty calibration grid — give at least one draft size")
    if grid is not None and any(int(g) <= 0 for g in grid):
        raise CalibrationError(f"draft sizes must be positive, got {list(grid)}")
    base, run = resolved_configs(base, model, tokenizer, info, eos_ids)
    grid = calibration_grid(base, model, grid)
    t0 = time.perf_counter()
    rows = measure_grid(model, prompts, method, grid, cfg=run, warmup_prompts=warmup_prompts,
                        repeats=repeats, eos_ids=eos_ids, progress=progress)
    key = model_key(model, base)
    record = {
        "key": key, "model": model_id(model), "device": device_name(device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "method": method,
        "config": calibration_fields(base), "fingerprint": config_fingerprint(base),
        "kernel_build": kernel_build(model, base), "rows": rows,
        "prompts": len(prompts), "repeats": repeats,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "code": code_stamp(),
        "wallclock_s": time.perf_counter() - t0, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if run != base:
        record["ran_with"] = {k: v for k, v in dataclasses.asdict(run).items() if getattr(base, k) != v}
    record.update(fit_record(record, pipeline if isinstance(pipeline, str) else p, mode=mode, timing=timing))
    edge = bucket_edge(base, model, record["g_star"])          # the fit's g* runs at its bucket's largest tree
    if edge != record["g_star"]:
        record["g_star_fit"], record["g_star"] = record["g_star"], edge
    if save:
        save_calibration(key, record)
    return record


# ---- CLI -------------------------------------------------------------------------------------------------

def calibrate_model(model: str = "smollm2-135m-instruct", method: str = "unispec", grid: Sequence[int] | None = None,
         pipeline: str = "default", mode: str | None = None, timing: str | None = None, prompts: int = 5,
         warmup: int = 2, max_new_tokens: int = 96, repeats: int = 1, compare: bool = True, save: bool = True,
         threads: int | None = None, device: str | None = None, dtype: str | None = None, **overrides) -> dict:
    """Calibrate a drafting method's g* for a model on this machine; print tau(g), s(g), the fits, EAGLE's anchor.
    overrides: SpecConfig fields of the calibrated configuration (they are part of the cache key)."""
    if threads:
        torch.set_num_threads(threads)
    target, tok, info = load_model(model, device=parse_device(device), dtype=parse_dtype(dtype))
    cal, warm = calibration_prompts(tok, info, prompts, warmup, max_new_tokens)
    cfg = SpecConfig.preset(method, max_new_tokens=max_new_tokens, **overrides)
    eos = eos_token_ids(target, tok)
    rec = calibrate(target, cal, method, grid=grid, pipeline=pipeline, mode=mode, timing=timing, cfg=cfg,
                    warmup_prompts=warm, repeats=repeats, eos_ids=eos, save=save, tokenizer=tok, info=info)
    print(f"\n{rec['key']}  ({', '.join(f'{k}={v}' for k, v in rec['config'].items())})")
    print(f"{'g':>5} {'drafted':>7} {'tau':>6} {'s_step ms':>10} {'s_fwd ms':>9} {'tok/s':>7}")
    for r in rec["rows"]:
        print(f"{r['g']:>5} {r['g_measured']:>7.1f} {r['tau']:>6.2f} {1e3 * r['s_step']:>10.1f} "
              f"{1e3 * r['s_forward']:>9.1f} {r['tokens_per_s']:>7.1f}")
    fwd = measure_forward(target, EAGLE_CANDIDATES, reps=5)
    eagle_n = eagle_total_token(fwd)
    rec["eagle_total_token"] = eagle_n
    print(f"g* ({rec['pipeline']} pipeline: {rec['mode']}, {rec['timing']} time) = {rec['g_star']} (continuous "
          f"{rec['g_continuous']:.2f}); g* (grid) = {rec['g_star_grid']}; EAGLE total_token=-1 -> {eagle_n} "
          f"nodes = {eagle_n - 1} drafts")
    if compare:
        store = store_of(target, cfg, info.vocab_size)
        sizes = {"fit": rec["g_star"], "grid": rec["g_star_grid"], "eagle": eagle_n - 1}
        cap = max_draft_size(cfg, target)
        if cap is not None:
            sizes["eagle"] = min(sizes["eagle"], cap)
        run = runnable_config(cfg, target, tok, info, eos)
        cfgs = {label: run.replace(draft_size=g) for label, g in sizes.items()}
        cfgs["ar"] = cfg.replace(method="ar", draft_size=None)
        runs = round_robin(target, cal, cfgs, store=store, repeats=repeats, eos_ids=eos, desc="compare")
        rec["compare"] = {label: {"g": sizes.get(label, 0), **summarise(r)} for label, r in runs.items()}
        ar_speed = rec["compare"]["ar"]["tokens_per_s"]
        for label, r in rec["compare"].items():
            print(f"  {label:>5}: g = {r['g']:>3}  tau {r['tau']:.2f}  {r['tokens_per_s']:.1f} tok/s  "
                  f"({r['tokens_per_s'] / ar_speed:.2f}x ar)")
        best = max((r["tokens_per_s"], label) for label, r in rec["compare"].items() if label != "ar")
        if best[0] < ar_speed:
            print(f"  note: no draft size beats ar on this device ({best[1]} is the best at "
                  f"{best[0] / ar_speed:.2f}x): verifying a tree costs more than its accepted tokens save here")
        if save:
            save_calibration(rec["key"], rec)
    return rec


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.calibrate",
                                 description=calibrate_model.__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="unispec", choices=DRAFTING_METHODS,
                    help="the drafting method whose draft size g* to calibrate (default unispec)")
    ap.add_argument("--grid", default=None, help="comma-separated draft sizes (default: per device type)")
    ap.add_argument("--pipeline", default=None, choices=["default", "paper"],
                    help="default (the default), or paper: uniform knots, forward-only time, the paper's exact fit "
                         "(engine.calibration); with --refit: the record's own unless given")
    ap.add_argument("--mode", default=None, choices=["de", "grid"], help="override the pipeline's mode")
    ap.add_argument("--timing", default=None, choices=["step", "forward"], help="override the pipeline's timing")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: kernels.hardware)")
    ap.add_argument("--dtype", default=None, help="fp32 | fp16 | bf16 (default: kernels.hardware)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a SpecConfig field of the calibrated configuration, e.g. --set threshold_r=0.1")
    ap.add_argument("--no-compare", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--refit", action="store_true", help="recompute g* from the cached measurements only")
    add_debug(ap)
    a = ap.parse_args(argv)
    # every argument checked, and the prompts read, before a model loads
    check_model(a.model)
    for flag, value, least in (("--prompts", a.prompts, 1), ("--warmup", a.warmup, 0), ("--repeats", a.repeats, 1),
                               ("--max-new-tokens", a.max_new_tokens, 1), ("--threads", a.threads, 1)):
        check_at_least(flag, value, least)
    grid = parse_ints("--grid", a.grid)
    overrides = parse_overrides(a.set)
    SpecConfig.preset(a.method, max_new_tokens=a.max_new_tokens, **overrides)     # a bad --set value stops here
    device, dtype = parse_device(a.device), parse_dtype(a.dtype)
    if a.refit:
        if a.threads:
            torch.set_num_threads(a.threads)
        target = load_model(a.model, device=device, dtype=dtype)[0]
        cfg = SpecConfig.preset(a.method, **overrides)
        rec = refit(model_key(target, cfg), pipeline=a.pipeline, mode=a.mode, timing=a.timing, save=not a.no_save)
        print(f"{rec['key']}: g* = {rec['g_star']} ({rec['pipeline']}, {rec['mode']}), grid g* = {rec['g_star_grid']}")
        return rec
    calibration_pool()                                 # the data root and the training corpus, before the model
    return calibrate_model(model=a.model, method=a.method, grid=grid, pipeline=a.pipeline or "default", mode=a.mode, timing=a.timing,
         prompts=a.prompts, warmup=a.warmup, max_new_tokens=a.max_new_tokens, repeats=a.repeats,
         compare=not a.no_compare, save=not a.no_save, threads=a.threads, device=a.device, dtype=a.dtype,
         **overrides)


if __name__ == "__main__":
    sys.exit(run_main(main))
