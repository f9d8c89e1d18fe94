"""Device-aware calibration of the draft size g* (UniSpec section 3, App. F; specs/unispec.md section 5).

    throughput(g) = tau(g) / s(g)              tau: tokens committed per decoding step (bonus included)
                                               s:   seconds per decoding step at draft size g
    g* = argmax_{g in [g_min, g_max]} f_tau(g) / f_s(g)

f_tau is a cubic polynomial, f_s a quadratic B-spline on 8 knots (what the paper's
`SplineTransformer(degree=2, n_knots=8)` + `LinearRegression` computes, written with scipy: the knots
extend `degree` intervals past the data, the coefficients are the least-squares/min-norm solution;
knots at quantiles of the grid, which equals the paper's uniform knots on an even grid, see
`BSplineFit`),
and the maximum is found by `scipy.optimize.differential_evolution(seed=42, maxiter=1000, atol=1e-6,
tol=1e-6)` inside the grid's bounds (never extrapolated), then rounded. `mode="grid"` is the paper's
comparison (App. G.2): the best measured grid point.

The fits are pure (`fit_tau`, `fit_step_time`, `optimal_draft_size`: arrays in, g* out). Measuring runs
`engine.harness.generate` with `draft_size=g` for any method; g* is cached per (model, device, dtype,
method) in `$SPECVOCAB_CACHE/calibration.json` (default `~/.cache/specvocab`).

Choices where the paper is silent [C]:
- s(g) is the full decoding step (drafting + tree forward + acceptance + store update) per step, because
  that is what Eq. 1 divides by; the paper's forward-only s (Eq. 2 assumes drafting is free, which a CPU
  does not grant) is `timing="forward"`. Both are recorded.
- tau(g) counts decoding steps only (the prefill's first token is left out); s(g) is the median over
  prompts (and repeats) of each prompt's seconds per step, so one prompt hit by a noisy neighbour on a
  shared machine does not move the fit.
- The store persists through calibration (Alg. 1 builds it first), but rerunning the same prompts at
  every g would let the store memorise their continuations. So the store is warmed once on separate
  warm-up prompts, snapshotted, and restored before every grid point: each g starts from the same state.
- Grids: CPU {1,2,3,4,6,8,12,16,24,32} (verification cost grows steeply with g on a CPU, FACTS.md);
  CUDA {16,32,...,160} (spec 5.2). Fewer than 4 points lower the polynomial degree, fewer than 10 the
  number of knots (n_knots <= points - 1) rather than fit an interpolant through noise.
- `resolve_draft_size` never calibrates silently: with no cached g* it warns and falls back to
  `FALLBACK_DRAFT_SIZE[device type]` (CPU 8, CUDA 64; see the module constants), or raises with
  `on_missing="error"`. Calibrate with `python -m engine.calibrate --model ... --method unispec`.

EAGLE's `total_token=-1` heuristic, the anchor (`eagle_total_token`): EAGLE times 20 forwards of n
random tokens without a KV cache for n in {40, 48, 50, 56, 60}, divides each time by a fixed prior of the
acceptance gain {1, 1.05, 1.07, 1.1, 1.13}, and takes the n with the smallest ratio as its total tokens
(root included, so n - 1 draft tokens). It never looks outside 40-60 nodes and assumes the gain
instead of measuring it. `main` reports its choice next to g* and measures tokens/s at each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from engine.config import SpecConfig

DEFAULT_GRIDS = {"cpu": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32), "cuda": tuple(range(16, 161, 16))}
# With no cached calibration: CPU 8 (the knee of the SmolLM2 / Gemma-3 verification costs in FACTS.md:
# 8 nodes cost ~1.4-1.7x one token, 32 nodes ~2.2-2.4x); CUDA 64 (a mid value of the paper's 16-160 grid).
FALLBACK_DRAFT_SIZE = {"cpu": 8, "cuda": 64}
EAGLE_CANDIDATES = (40, 48, 50, 56, 60)             # EAGLE ea_model.py, total_token=-1
EAGLE_PRIOR_GAIN = (1.0, 1.05, 1.07, 1.1, 1.13)
DE_KWARGS = dict(seed=42, maxiter=1000, atol=1e-6, tol=1e-6)    # UniSpec Table 14


class CalibrationError(ValueError):
    """Calibration inputs or results are unusable; the message says what and how to fix it."""


# ---- pure fits -----------------------------------------------------------------------------------------

def _check_curve(g, y, what: str) -> tuple[np.ndarray, np.ndarray]:
    g = np.asarray(g, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if g.size == 0:
        raise CalibrationError(f"empty calibration grid for {what}; measure at least one draft size")
    if g.size != y.size:
        raise CalibrationError(f"{what}: {g.size} draft sizes but {y.size} measurements; pass one per size")
    if not np.all(np.isfinite(g)) or not np.all(np.isfinite(y)):
        raise CalibrationError(f"{what}: non-finite values in the grid or the measurements")
    if np.any(g <= 0):
        raise CalibrationError(f"{what}: draft sizes must be positive, got {g[g <= 0].tolist()}")
    return g, y


def fit_tau(g, tau, degree: int = 3) -> np.polynomial.Polynomial:
    """Least-squares polynomial f_tau (cubic; lower when there are fewer distinct sizes than 4)."""
    g, tau = _check_curve(g, tau, "tau")
    deg = min(degree, np.unique(g).size - 1)
    if deg <= 0:
        return np.polynomial.Polynomial([float(tau.mean())])
    return np.polynomial.Polynomial.fit(g, tau, deg)


class BSplineFit:
    """f_s: quadratic B-spline regression (sklearn `SplineTransformer` + `LinearRegression` semantics).

    knots="quantile" (default) puts the n_knots base knots at quantiles of the distinct draft sizes,
    "uniform" spaces them evenly over [min g, max g] (sklearn's default, the paper's). On an evenly
    spaced grid - the paper's - the two are the same; on the CPU grid {1,2,3,4,6,8,12,16,24,32}
    uniform knots leave knot intervals nearly empty and the least-squares spline swings between
    measurements (measured: negative predicted step times between g = 16 and 32), so quantile is the
    default [C]. Base knots are extended by `degree` knots on each side at the boundary spacing."""

    def __init__(self, g, s, degree: int = 2, n_knots: int = 8, knots: str = "quantile"):
        from scipy.interpolate import BSpline

        g, s = _check_curve(g, s, "step time")
        distinct = np.unique(g)
        self.degree = degree
        if distinct.size < 2:
            self.constant = float(s.mean())
            return
        self.constant = None
        # basis functions (n_knots + degree - 1) < distinct sizes: no interpolating fit through noise
        n_knots = max(2, min(n_knots, distinct.size - degree))
        if knots == "quantile":
            base = np.quantile(distinct, np.linspace(0, 1, n_knots))
        elif knots == "uniform":
            base = np.linspace(distinct[0], distinct[-1], n_knots)
        else:
            raise CalibrationError(f"knots must be 'quantile' or 'uniform', got {knots!r}")
        lo_step, hi_step = base[1] - base[0], base[-1] - base[-2]
        self.knots = np.concatenate([base[0] - lo_step * np.arange(degree, 0, -1), base,
                                     base[-1] + hi_step * np.arange(1, degree + 1)])
        basis = BSpline.design_matrix(g, self.knots, degree, extrapolate=True).toarray()  # [m, n_knots+degree-1]
        design = np.hstack([basis, np.ones((g.size, 1))])                     # + intercept, as the paper's
        self.coef, *_ = np.linalg.lstsq(design, s, rcond=None)               # min-norm least squares
        self._spline = BSpline(self.knots, self.coef[:-1], degree, extrapolate=True)

    def __call__(self, g):
        g = np.asarray(g, dtype=np.float64)
        if self.constant is not None:
            return np.full_like(g, self.constant)
        return self._spline(g) + self.coef[-1]


def fit_step_time(g, s, degree: int = 2, n_knots: int = 8, knots: str = "quantile") -> BSplineFit:
    return BSplineFit(g, s, degree, n_knots, knots)


@dataclass
class DraftSizeFit:
    g_star: int                 # the calibrated draft size (root excluded)
    g_continuous: float         # the optimiser's (or grid's) value before rounding
    predicted_tau: float
    predicted_step_s: float
    predicted_tokens_per_s: float
    mode: str                   # "de", "grid", or "grid-fallback" (the fit was unusable)


def optimal_draft_size(g, tau, s, mode: str = "de", knots: str = "quantile") -> DraftSizeFit:
    """g* = argmax tau(g)/s(g) over [min g, max g]. mode "de": fitted curves + differential evolution;
    "grid": the best measured point. Pure."""
    g_arr, tau_arr = _check_curve(g, tau, "tau")
    _, s_arr = _check_curve(g, s, "step time")
    if np.any(s_arr <= 0):
        raise CalibrationError(f"step times must be positive seconds, got {s_arr.tolist()}")
    if mode == "grid":
        speed = tau_arr / s_arr
        i = int(np.argmax(speed))
        fit = DraftSizeFit(int(round(g_arr[i])), float(g_arr[i]), float(tau_arr[i]), float(s_arr[i]),
                           float(speed[i]), "grid")
    elif mode == "de":
        from scipy.optimize import differential_evolution

        f_tau, f_s = fit_tau(g_arr, tau_arr), fit_step_time(g_arr, s_arr, knots=knots)
        lo, hi = float(g_arr.min()), float(g_arr.max())
        dense = np.linspace(lo, hi, 1001)
        if float(f_s(dense).min()) < 0.5 * float(s_arr.min()):
            # the step-time fit dips far below every measurement: the optimiser would chase the dip
            warnings.warn(f"the step-time spline drops to {float(f_s(dense).min()):.3g} s (measured minimum "
                          f"{float(s_arr.min()):.3g} s): the measurements are too noisy for the fit; using "
                          f"the best measured grid point instead (remeasure with --repeats 2 on a quiet "
                          f"machine)", stacklevel=2)
            fit = optimal_draft_size(g_arr, tau_arr, s_arr, mode="grid")
            fit.mode = "grid-fallback"
            return fit
        floor_s = 1e-3 * float(s_arr.min())          # never divide by ~0

        def neg_speed(x):
            return -float(f_tau(x[0])) / max(float(f_s(x[0])), floor_s)

        if hi > lo:
            res = differential_evolution(neg_speed, [(lo, hi)], **DE_KWARGS)
            x = float(res.x[0])
        else:
            x = lo
        # round, then keep the better neighbour (spec 5.3: "optionally evaluate floor/ceil")
        cands = sorted({min(max(c, math.ceil(lo)), math.floor(hi)) for c in (math.floor(x), math.ceil(x))})
        best = max(cands, key=lambda c: -neg_speed([c]))
        tau_b, s_b = float(f_tau(best)), float(f_s(best))
        fit = DraftSizeFit(int(best), x, tau_b, s_b, tau_b / max(s_b, floor_s), "de")
    else:
        raise CalibrationError(f"mode must be 'de' (fit + differential evolution) or 'grid', got {mode!r}")
    if fit.g_star <= 0:
        raise CalibrationError(f"calibration gave g* = {fit.g_star} <= 0; the grid must hold positive sizes")
    return fit


def eagle_total_token(forward_s: Mapping[int, float], candidates: Sequence[int] = EAGLE_CANDIDATES,
                      prior_gain: Sequence[float] = EAGLE_PRIOR_GAIN) -> int:
    """EAGLE's `total_token=-1` choice: argmin over candidates of time(n) / prior_gain(n). Pure.
    Returns total tokens n (root included; the draft size is n - 1)."""
    if len(candidates) != len(prior_gain) or not candidates:
        raise CalibrationError("EAGLE's heuristic needs one prior gain per candidate size")
    missing = [n for n in candidates if n not in forward_s]
    if missing:
        raise CalibrationError(f"no forward time measured for {missing} tokens; time every candidate")
    ratios = [forward_s[n] / x for n, x in zip(candidates, prior_gain)]
    return int(candidates[int(np.argmin(ratios))])


# ---- measuring -------------------------------------------------------------------------------------------

def device_name(device: torch.device | str) -> str:
    """A stable name of the hardware a timing belongs to (CPU model + threads, or the GPU's name)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}:{torch.get_num_threads()}threads"


def model_id(model) -> str:
    """The model's name for the cache key: its folder / hub name (`config._name_or_path`), else its
    architecture and shape (random test models). Derived from the model alone, so the drafters (which
    only see the model) and `calibrate` agree."""
    cfg = getattr(model, "config", None)
    name = Path(str(getattr(cfg, "_name_or_path", "") or "")).name
    if name:
        return name
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return (f"{getattr(text, 'model_type', 'model')}-V{getattr(text, 'vocab_size', '?')}"
            f"-d{getattr(text, 'hidden_size', '?')}-L{getattr(text, 'num_hidden_layers', '?')}")


def calibration_key(model_name: str, device: str, dtype, method: str) -> str:
    return f"{model_name}|{device}|{str(dtype).replace('torch.', '')}|{method}"


def model_key(model, method: str) -> str:
    """The cache key of (model, device, dtype, method)."""
    p = next(model.parameters())
    return calibration_key(model_id(model), device_name(p.device), p.dtype, method)


def cache_file() -> Path:
    root = Path(os.environ.get("SPECVOCAB_CACHE") or Path.home() / ".cache" / "specvocab").expanduser()
    return root / "calibration.json"


def load_calibrations(path: str | Path | None = None) -> dict:
    """{key: calibration record} from `path` (default: the cache, `cache_file()`); {} if there is none."""
    path = cache_file() if path is None else Path(path)
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CalibrationError(f"the calibration cache {path} is corrupt ({e}); delete it and calibrate "
                               f"again") from e


def save_calibration(key: str, record: dict) -> Path:
    """Add or replace one record in the JSON cache (atomic rename)."""
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_calibrations()
    data[key] = record
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def cached_draft_size(key: str) -> int | None:
    rec = load_calibrations().get(key)
    return None if rec is None else int(rec["g_star"])


_warned: set[str] = set()


def resolve_draft_size(cfg: SpecConfig, model=None, *, method: str | None = None,
                       on_missing: str = "fallback") -> int:
    """The draft size a drafter uses: `cfg.draft_size` if set, else the cached g* for (model, device,
    dtype, method), else FALLBACK_DRAFT_SIZE for the device type (with a one-time warning), or a
    CalibrationError when `on_missing="error"`."""
    if cfg.draft_size is not None:
        return int(cfg.draft_size)
    method = method or cfg.method
    if model is None:
        raise CalibrationError("resolve_draft_size needs the target model (for its device and dtype) when "
                               "cfg.draft_size is None; pass model=... or set draft_size")
    key = model_key(model, method)
    g = cached_draft_size(key)
    if g is not None:
        return g
    dev_type = next(model.parameters()).device.type
    fallback = FALLBACK_DRAFT_SIZE.get(dev_type, FALLBACK_DRAFT_SIZE["cuda"])
    msg = (f"no calibrated draft size for {key} in {cache_file()}; run `python -m engine.calibrate "
           f"--model <name> --method {method}` (a few minutes), or pass draft_size=")
    if on_missing == "error":
        raise CalibrationError(msg)
    if on_missing != "fallback":
        raise CalibrationError(f"on_missing must be 'fallback' or 'error', got {on_missing!r}")
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{msg}; using the {dev_type} default g = {fallback}", stacklevel=2)
    return fallback


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


# methods whose draft size is another config field than `draft_size`
SIZE_FIELD = {"pld": "pld_num_draft", "eagle": "eagle_total_tokens"}


def with_draft_size(cfg: SpecConfig, g: int) -> SpecConfig:
    """cfg with its method's draft size set to g."""
    return cfg.replace(**{SIZE_FIELD.get(cfg.method, "draft_size"): int(g)})


def _store_of(model, cfg: SpecConfig, vocab: int):
    """The deployment store the drafter of cfg.method will use, or None if the method has none."""
    if cfg.method not in ("unispec", "recycling") or cfg.store_persistence != "deployment":
        return None
    from engine.store import deployment_store
    return deployment_store(model, cfg.method, vocab, cfg.store_k, next(model.parameters()).device)


def run_prompts(model, prompts: Sequence[torch.Tensor], cfg: SpecConfig, *, eos_ids=None) -> dict:
    """Generate every prompt with cfg; tau over all decoding steps, step times per prompt."""
    from engine.harness import generate

    new = steps = 0
    step_s, verify_s = [], []                       # [prompts] seconds per decoding step
    for p in prompts:
        r = generate(model, p, cfg, eos_ids=eos_ids)
        n_steps = r.steps - 1                       # decoding steps only: the prefill's token is left out
        if n_steps == 0:
            continue
        new += r.new_tokens - 1
        steps += n_steps
        verify_s.append(r.verify_s / n_steps)
        step_s.append((r.wall_s - r.prefill_s) / n_steps)
    if steps == 0:
        raise CalibrationError("no decoding steps ran (every prompt stopped at its first token); use longer "
                               "max_new_tokens or other prompts, or pass eos_ids=[]")
    return dict(tau=new / steps, s_forward=verify_s, s_step=step_s, steps=steps, new_tokens=new)


def _summarise(runs: list[dict]) -> dict:
    """Pool runs of one g: tau = committed tokens / steps; s = the median per-prompt seconds per step
    (a shared machine's spikes hit single prompts; the median ignores them)."""
    new = sum(r["new_tokens"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    s_step = float(np.median([x for r in runs for x in r["s_step"]]))
    s_fwd = float(np.median([x for r in runs for x in r["s_forward"]]))
    return dict(tau=new / steps, s_step=s_step, s_forward=s_fwd, tokens_per_s=new / steps / s_step,
                steps=steps, new_tokens=new, runs=len(runs))


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
    from tqdm.auto import tqdm

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


def measure_grid(model, prompts: Sequence[torch.Tensor], method: str, grid: Sequence[int], *,
                 cfg: SpecConfig | None = None, warmup_prompts: Sequence[torch.Tensor] = (), repeats: int = 1,
                 eos_ids=None, progress: bool = True) -> list[dict]:
    """tau(g) and s(g) for every g in grid (one row per g), measured through `engine.harness.generate`.

    The store is warmed on `warmup_prompts` (untimed; also warms allocator and kernels); every g then
    starts from that state (`round_robin`). Per g: tau over all decoding steps, s = median over prompts
    and repeats of the seconds per decoding step."""
    if len(grid) == 0:
        raise CalibrationError("empty calibration grid; give at least one draft size")
    if any(int(g) <= 0 for g in grid):
        raise CalibrationError(f"draft sizes must be positive, got {list(grid)}")
    if not prompts:
        raise CalibrationError("no calibration prompts")
    base = (cfg or SpecConfig.preset(method)).replace(method=method)
    vocab = model.get_output_embeddings().weight.shape[0]
    store = _store_of(model, base, vocab)
    mid = int(sorted(grid)[len(grid) // 2])
    run_prompts(model, list(warmup_prompts) or list(prompts[:1]), with_draft_size(base, mid), eos_ids=eos_ids)
    cfgs = {int(g): with_draft_size(base, g) for g in sorted(set(int(g) for g in grid))}
    runs = round_robin(model, prompts, cfgs, store=store, repeats=repeats, eos_ids=eos_ids, progress=progress,
                       desc=f"calibrate {method}")
    return [{"g": g, **_summarise(r)} for g, r in runs.items()]


def calibrate(model, prompts: Sequence[torch.Tensor], method: str = "unispec", *, grid: Sequence[int] | None = None,
              mode: str = "de", timing: str = "step", cfg: SpecConfig | None = None,
              warmup_prompts: Sequence[torch.Tensor] = (), repeats: int = 1, eos_ids=None, save: bool = True,
              progress: bool = True) -> dict:
    """Measure the grid, fit, maximise, and (save=True) cache g* for (model, device, dtype, method).
    Returns the calibration record (spec section 3.5)."""
    if timing not in ("step", "forward"):
        raise CalibrationError(f"timing must be 'step' (full decoding step) or 'forward', got {timing!r}")
    device = next(model.parameters()).device
    grid = list(DEFAULT_GRIDS["cuda" if device.type == "cuda" else "cpu"] if grid is None else grid)
    if method == "recycling":
        grid = [g for g in grid if g <= 80] or grid     # the static template has 80 nodes
    t0 = time.perf_counter()
    rows = measure_grid(model, prompts, method, grid, cfg=cfg, warmup_prompts=warmup_prompts,
                        repeats=repeats, eos_ids=eos_ids, progress=progress)
    g = [r["g"] for r in rows]
    tau = [r["tau"] for r in rows]
    s = [r["s_step" if timing == "step" else "s_forward"] for r in rows]
    fit = optimal_draft_size(g, tau, s, mode=mode)
    grid_fit = optimal_draft_size(g, tau, s, mode="grid")
    key = model_key(model, method)
    record = {
        "key": key, "model": model_id(model), "device": device_name(device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "method": method,
        "g_star": fit.g_star, "g_continuous": fit.g_continuous, "mode": fit.mode, "timing": timing,
        "g_star_grid": grid_fit.g_star, "predicted_tokens_per_s": fit.predicted_tokens_per_s,
        "rows": rows, "prompts": len(prompts), "repeats": repeats,
        "threshold_r": (cfg or SpecConfig()).threshold_r,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "wallclock_s": time.perf_counter() - t0, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if save:
        save_calibration(key, record)
    return record


def refit(key: str, mode: str = "de", timing: str | None = None, save: bool = True) -> dict:
    """Recompute g* of a cached record from its measured rows (e.g. after a change to the fits)."""
    rec = load_calibrations().get(key)
    if rec is None:
        raise CalibrationError(f"no calibration {key!r} in {cache_file()}; run `python -m engine.calibrate`")
    timing = timing or rec.get("timing", "step")
    rows = rec["rows"]
    g = [r["g"] for r in rows]
    tau = [r["tau"] for r in rows]
    s = [r["s_step" if timing == "step" else "s_forward"] for r in rows]
    fit = optimal_draft_size(g, tau, s, mode=mode)
    rec.update(g_star=fit.g_star, g_continuous=fit.g_continuous, mode=fit.mode, timing=timing,
               g_star_grid=optimal_draft_size(g, tau, s, mode="grid").g_star,
               predicted_tokens_per_s=fit.predicted_tokens_per_s)
    if save:
        save_calibration(key, rec)
    return rec


def calibration_curves(record: dict, mode: str = "de", points: int = 200) -> "pl.DataFrame":
    """A calibration record as one tidy frame for plotting: the measured grid (`kind="measured"`) and the
    fitted curves over [min g, max g] (`kind="fit"`: cubic f_tau, B-spline f_s, their ratio), with columns
    `key, kind, g, tau, s_step_ms, tokens_per_s`, plus one `kind="g_star"` row at the record's g*. Pure:
    refits from the record's rows (the same fits `calibrate` used)."""
    import polars as pl

    rows = record["rows"]
    timing = record.get("timing", "step")
    g = np.array([r["g"] for r in rows], dtype=np.float64)
    tau = np.array([r["tau"] for r in rows], dtype=np.float64)
    s = np.array([r["s_step" if timing == "step" else "s_forward"] for r in rows], dtype=np.float64)
    f_tau, f_s = fit_tau(g, tau), fit_step_time(g, s)
    dense = np.linspace(g.min(), g.max(), points)
    fit = optimal_draft_size(g, tau, s, mode=mode)
    parts = [("measured", g, tau, s), ("fit", dense, f_tau(dense), f_s(dense)),
             ("g_star", np.array([fit.g_star], dtype=np.float64), np.array([fit.predicted_tau]),
              np.array([fit.predicted_step_s]))]
    return pl.concat([pl.DataFrame({"key": record["key"], "kind": kind, "g": x, "tau": t, "s_step_ms": 1e3 * st,
                                    "tokens_per_s": t / st}) for kind, x, t, st in parts])


# ---- CLI -------------------------------------------------------------------------------------------------

def calibration_prompts(tokenizer, info, n: int = 5, warmup: int = 2, max_new_tokens: int = 96,
                        seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """n calibration + `warmup` warm-up prompts from Spec-Bench, one per category, drawn with `seed`
    (UltraChat, the paper's calibration set, is not available offline)."""
    from engine.prompts import encode_prompt, load_prompts

    pool = load_prompts("spec_bench", per_category=1, seed=seed)
    rng = np.random.default_rng(seed)
    pick = [pool[i] for i in rng.permutation(len(pool))[: n + warmup]]
    enc = [torch.tensor(encode_prompt(tokenizer, info, p.turns[:1], [], max_new_tokens=max_new_tokens))
           for p in pick]
    return enc[:n], enc[n:]


def main(model: str = "smollm2-135m-instruct", method: str = "unispec", grid: Sequence[int] | None = None,
         mode: str = "de", timing: str = "step", prompts: int = 5, warmup: int = 2, max_new_tokens: int = 96,
         repeats: int = 1, compare: bool = True, save: bool = True, threads: int | None = None,
         **overrides) -> dict:
    """Calibrate g* for a model on this machine and print tau(g), s(g), the fits and EAGLE's anchor."""
    from engine.models import eos_token_ids, load_model

    if threads:
        torch.set_num_threads(threads)
    target, tok, info = load_model(model)
    cal, warm = calibration_prompts(tok, info, prompts, warmup, max_new_tokens)
    cfg = SpecConfig.preset(method, max_new_tokens=max_new_tokens, **overrides)
    eos = eos_token_ids(target, tok)
    rec = calibrate(target, cal, method, grid=grid, mode=mode, timing=timing, cfg=cfg,
                    warmup_prompts=warm, repeats=repeats, eos_ids=eos, save=save)
    print(f"\n{rec['key']}")
    print(f"{'g':>5} {'tau':>6} {'s_step ms':>10} {'s_fwd ms':>9} {'tok/s':>7}")
    for r in rec["rows"]:
        print(f"{r['g']:>5} {r['tau']:>6.2f} {1e3 * r['s_step']:>10.1f} {1e3 * r['s_forward']:>9.1f} "
              f"{r['tokens_per_s']:>7.1f}")
    fwd = measure_forward(target, EAGLE_CANDIDATES, reps=5)
    eagle_n = eagle_total_token(fwd)
    rec["eagle_total_token"] = eagle_n
    print(f"g* (fit + DE, {timing} time) = {rec['g_star']} (continuous {rec['g_continuous']:.2f}); "
          f"g* (grid) = {rec['g_star_grid']}; EAGLE total_token=-1 -> {eagle_n} nodes = {eagle_n - 1} drafts")
    if compare:
        store = _store_of(target, cfg, info.vocab_size)
        sizes = {"de": rec["g_star"], "grid": rec["g_star_grid"], "eagle": eagle_n - 1}
        if method == "recycling":
            sizes["eagle"] = min(sizes["eagle"], 80)
        cfgs = {label: with_draft_size(cfg, g) for label, g in sizes.items()}
        cfgs["ar"] = cfg.replace(method="ar", draft_size=None)
        runs = round_robin(target, cal, cfgs, store=store, repeats=repeats, eos_ids=eos, desc="compare")
        rec["compare"] = {label: {"g": sizes.get(label, 0), **_summarise(r)} for label, r in runs.items()}
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


def _cli(argv=None):
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="unispec")
    ap.add_argument("--grid", default=None, help="comma-separated draft sizes (default: per device type)")
    ap.add_argument("--mode", default="de", choices=["de", "grid"])
    ap.add_argument("--timing", default="step", choices=["step", "forward"])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-compare", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--refit", action="store_true", help="recompute g* from the cached measurements only")
    a = ap.parse_args(argv)
    if a.refit:
        from engine.models import load_model

        if a.threads:
            torch.set_num_threads(a.threads)
        rec = refit(model_key(load_model(a.model)[0], a.method), mode=a.mode, save=not a.no_save)
        print(f"{rec['key']}: g* = {rec['g_star']} ({rec['mode']}), grid g* = {rec['g_star_grid']}")
        return
    grid = None if a.grid is None else [int(x) for x in a.grid.split(",")]
    main(model=a.model, method=a.method, grid=grid, mode=a.mode, timing=a.timing, prompts=a.prompts,
         warmup=a.warmup, max_new_tokens=a.max_new_tokens, repeats=a.repeats, compare=not a.no_compare,
         save=not a.no_save, threads=a.threads)


if __name__ == "__main__":
    _cli()
