"""Device-aware draft size g*: the pure fits, the calibration cache and `resolve_draft_size` (UniSpec §3, App. F).

    throughput(g) = tau(g) / s(g)              tau: tokens committed per decoding step (bonus included)
                                               s:   seconds per decoding step at draft size g
    g* = argmax_{g in [g_min, g_max]} f_tau(g) / f_s(g)                                   (UniSpec Eq. 1-4)

f_tau is a cubic polynomial, f_s a quadratic B-spline on 8 knots (the paper's
`SplineTransformer(degree=2, n_knots=8)` + `LinearRegression`, written with scipy; App. F.1, Table 14),
and the maximum is found by `scipy.optimize.differential_evolution(seed=42, maxiter=1000, atol=1e-6,
tol=1e-6)` inside the grid's bounds (never extrapolated). `mode="grid"` is the paper's comparison
(App. G.2): the best measured grid point.

Two pipelines (`PIPELINES`):
- "paper": the paper's own, literally - uniform knots, the spline coefficients exactly as scikit-learn's
  `LinearRegression` computes them (centred, minimum-norm least squares: with fewer measurements than
  basis functions the spline interpolates), forward-only step time, DE, g* = the DE optimum rounded to
  the nearest integer. Fed the paper's published grid (Table 16) it gives g* = 103 where the paper
  reports 111: the published s(g) are full steps (tau / real throughput), the paper's fit used forward
  times that it does not publish per grid point (Table 15 has two).
- "default" [C]: knots at quantiles of the grid (= uniform on an even grid; on the uneven CPU grid
  {1,2,3,4,6,8,12,16,24,32} uniform knots leave intervals nearly empty and the least-squares spline
  swings between measurements, down to negative step times), at most (points - degree) knots so the
  spline never interpolates noise, full decoding-step time (Eq. 1 divides by the whole step; Eq. 2's
  forward-only s assumes drafting is free, which a CPU does not grant), the better of floor/ceil of the
  optimum, and a fall-back to the grid when the spline dips far below every measurement.

Over 600 lines on purpose: the fits, the cache's keys and records, and the one resolution of a run's draft
size and its source read and write one record format, kept in one place.

Every drafting method (`DRAFTING_METHODS`) is calibrated the same way: each reads its draft size from the
one field `draft_size`, so the same grid measurement, fits and argmax give its g* (UniSpec §3 states Eq. 1-4
for any tree drafter; App. F's pipeline is the method-independent part). What g is, per method:
- unispec: the most draft nodes selected per step (top-g* by confidence, §3, Eq. 4; threshold pruning may
  propose fewer).
- recycling: the first g nodes of Token Recycling's static template in rank order (the chains through the
  top-ranked store slots, closed under ancestors: `engine.drafters.recycling`), g <= its 80 nodes - UniSpec
  Table 17's "+device-aware" Token Recycling. The template's shape is kept, not re-chosen: it is the
  method (Token Recycling's Fig. 5); calibration only decides how much of it this device can afford to
  verify, and a truncated template is a prefix of the same priority order, so one 1-D grid covers it.
- layerskip / eagle: EAGLE-2's total_tokens - 1 (the tree's nodes besides the root), at the config's
  `eagle_depth` and `eagle_topk`. Depth is not searched: it is a config field in the key, so each depth
  is its own calibration (`--set eagle_depth=D`), and comparing their records' predicted tokens/s picks a
  depth; App. F's fit is 1-D in g. A tree holds at most topk + topk^2 (depth - 1) candidates. EAGLE's own
  `total_token=-1` (below) picks this same number from a prior gain; here tau(g) is measured.
- pld / hf-prompt-lookup: the longest chain copied per step (transformers' `prompt_lookup_num_tokens`).
  A chain is as deep as it is long, so its grid stops below the native fixed-shape forward's 32-position
  block (`METHOD_GRIDS`).
The largest g a method (and the target's fixed verify rows) allows is `engine.harness.max_draft_size`;
a calibration drops grid points above it.

This module is pure apart from the cache (arrays in, g* out; no model is run here): measuring lives in
`engine.jobs.calibrate`, which runs `engine.harness.generate`; the harness imports this module to resolve a
run's draft size, so nothing here imports the harness.

The cache: `$SPECVOCAB_CACHE/calibration.json` (default `~/.cache/specvocab`; `$SPECVOCAB_CALIBRATION` names another file), one record per key
`model|device|dtype|method|fingerprint|build`. `build` is the kernel build that decodes (`kernel_build`: the C
kernels' ISA build on a CPU - so a machine with matrix units and one without, or one CPU under
`$SPECVOCAB_CPU_ISA=avx2`, keep their own g* - "torch" where they do not run, the device type elsewhere). The
fingerprint is a short hash of every config field that changes
tau(g) or s(g) for that method (`calibration_fields`, defined in engine.config without torch: r, k, depth,
confidence, the store's persistence, the drafter's layers, the vocabulary policy and its size, ...); the
fields themselves are stored in the record. A record also carries the `code_stamp` of the decoder that measured
it (a hash of engine/ and kernels/ sources and torch's version): s(g) is a property of that code as much as of
the device, so a g* measured before a kernel changed is stale. `resolve_draft_size` still takes a stale g* (a
better guess than the fallback) and warns once per key, naming the command that re-measures it. It never
calibrates itself: with no cached g* it warns once per key, naming the command that makes one
(`calibrate_command`), and falls back to the method's uncalibrated default - `FALLBACK_DRAFT_SIZE[device type]`
for unispec, what the harness passes for the others (`engine.config.DEFAULT_DRAFT_SIZE`, recycling's whole
template) - or raises with `on_missing="error"`. A run's resolution (`engine.resolve.resolve_run`) reading this
machine's cache calibrates on the spot instead, in seconds, and caches the record.

EAGLE's `total_token=-1` heuristic (`eagle_total_token`): EAGLE times 20 forwards of n random tokens
without a KV cache for n in {40, 48, 50, 56, 60}, divides each time by a fixed prior of the acceptance
gain {1, 1.05, 1.07, 1.1, 1.13}, and takes the n with the smallest ratio as its total tokens (root
included, so n - 1 draft tokens). It never looks outside 40-60 nodes and assumes the gain instead of
measuring it; `python -m specvocab.engine.jobs.calibrate` reports its choice next to g*.
"""

from __future__ import annotations

import os

import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import platform
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import polars as pl
import torch
from scipy.interpolate import BSpline
from scipy.optimize import differential_evolution

from specvocab.engine.atomic import atomic_write
from specvocab.engine.target import cpu_kernels_run
from specvocab.kernels import cpu
from specvocab.kernels.hardware import isa_env
# The calibration key and the drafting methods are defined in engine.config (no torch); re-exported here, where
# users and tests have always read them (engine.calibration.calibration_fields, ...).
from specvocab.engine.config import (ADDED_AT_DEFAULT, CALIBRATION_FIELDS, DRAFTING_METHODS, NOT_CALIBRATION_FIELDS,  # noqa: F401
                           POLICY_FIELDS, SpecConfig, calibration_fields, config_fingerprint)
from specvocab.kernels.hardware import cache_root

DEFAULT_GRIDS = {"cpu": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32), "cuda": tuple(range(16, 161, 16))}
# [C] Per-method grids where the device's grid does not fit the method: a prompt-lookup chain is as deep as
# it is long and a native fixed-shape forward holds trees shallower than 32 positions (engine.native.BLOCK),
# so chain grids stop below 32; Token Recycling's template has 80 nodes, so its CUDA grid spans 8..80.
_CHAIN_GRIDS = {"cpu": (1, 2, 3, 4, 6, 8, 10, 12, 16, 24), "cuda": (2, 4, 6, 8, 10, 12, 16, 20, 24, 30)}
METHOD_GRIDS: dict[str, dict[str, tuple[int, ...]]] = {
    "pld": _CHAIN_GRIDS, "hf-prompt-lookup": _CHAIN_GRIDS,
    "recycling": {"cuda": tuple(range(8, 81, 8))},
}
# With no cached calibration: CPU 7 (the largest tree of the native path's 8-row bucket: 16 rows is where a
# tree forward starts to cost clearly more than one token on the small models this package runs on a CPU);
# CUDA 64 (a mid value of a 16-160 grid).
FALLBACK_DRAFT_SIZE = {"cpu": 7, "cuda": 64}
EAGLE_CANDIDATES = (40, 48, 50, 56, 60)             # EAGLE ea_model.py, total_token=-1
EAGLE_PRIOR_GAIN = (1.0, 1.05, 1.07, 1.1, 1.13)
DE_KWARGS = dict(seed=42, maxiter=1000, atol=1e-6, tol=1e-6)    # UniSpec Table 14


def default_grid(method: str, device_type: str) -> tuple[int, ...]:
    """The grid of draft sizes a calibration of `method` measures on a device type ("cpu" / "cuda") unless
    it is given one: `METHOD_GRIDS[method]` where the method has its own, else `DEFAULT_GRIDS`."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    return METHOD_GRIDS.get(method, {}).get(kind, DEFAULT_GRIDS[kind])


class CalibrationError(ValueError):
    """Calibration inputs or results are unusable; the message says what and how to fix it."""


@dataclass(frozen=True)
class Pipeline:
    """How g* is computed from measured tau(g), s(g) (see the module docstring)."""

    knots: str        # f_s base knots: "quantile" or "uniform" over the measured sizes
    spline: str       # "adaptive": <= points - degree knots, intercept in the least squares;
                      # "sklearn": n_knots as given, scikit-learn LinearRegression's centred min-norm solution
    timing: str       # s(g): "step" (the whole decoding step) or "forward" (the tree forward)
    mode: str         # "de" (fits + differential evolution) or "grid" (best measured point)
    rounding: str     # "better" (floor or ceil, whichever the fit predicts faster) or "nearest"
    guard: bool       # fall back to the grid when the spline dips far below every measurement


PIPELINES: dict[str, Pipeline] = {
    "default": Pipeline(knots="quantile", spline="adaptive", timing="step", mode="de", rounding="better",
                        guard=True),
    "paper": Pipeline(knots="uniform", spline="sklearn", timing="forward", mode="de", rounding="nearest",
                      guard=False),
}


def pipeline_of(pipeline: str | Pipeline, **overrides) -> Pipeline:
    """A Pipeline by name (or as given), with the non-None `overrides` (mode=, knots=, timing=) applied."""
    if isinstance(pipeline, str):
        if pipeline not in PIPELINES:
            raise CalibrationError(f"unknown calibration pipeline {pipeline!r} — choose one of {sorted(PIPELINES)}")
        pipeline = PIPELINES[pipeline]
    p = dataclasses.replace(pipeline, **{k: v for k, v in overrides.items() if v is not None})
    for name, allowed in (("knots", ("quantile", "uniform")), ("spline", ("adaptive", "sklearn")),
                          ("timing", ("step", "forward")), ("mode", ("de", "grid")),
                          ("rounding", ("better", "nearest"))):
        if getattr(p, name) not in allowed:
            what = {"mode": "mode must be 'de' (fit + differential evolution) or 'grid'"}.get(
                name, f"{name} must be one of {list(allowed)}")
            raise CalibrationError(f"{what}, got {getattr(p, name)!r}")
    return p


# ---- pure fits -----------------------------------------------------------------------------------------

def _check_curve(g, y, what: str) -> tuple[np.ndarray, np.ndarray]:
    g = np.asarray(g, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if g.size == 0:
        raise CalibrationError(f"empty calibration grid for {what} — measure at least one draft size")
    if g.size != y.size:
        raise CalibrationError(f"{what}: {g.size} draft sizes but {y.size} measurements — pass one per size")
    if not np.all(np.isfinite(g)) or not np.all(np.isfinite(y)):
        raise CalibrationError(f"{what}: non-finite values in the grid or the measurements")
    if np.any(g <= 0):
        raise CalibrationError(f"{what}: draft sizes must be positive, got {g[g <= 0].tolist()}")
    return g, y


def fit_tau(g, tau, degree: int = 3) -> np.polynomial.Polynomial:
    """Least-squares polynomial f_tau (cubic, App. F.1; lower when there are fewer distinct sizes than 4)."""
    g, tau = _check_curve(g, tau, "tau")
    deg = min(degree, np.unique(g).size - 1)
    if deg <= 0:
        return np.polynomial.Polynomial([float(tau.mean())])
    return np.polynomial.Polynomial.fit(g, tau, deg)


class BSplineFit:
    """f_s: quadratic B-spline regression (sklearn `SplineTransformer` + `LinearRegression`, App. F.1).

    knots="uniform" spaces the n_knots base knots evenly over [min g, max g] (sklearn's default, the
    paper's), "quantile" puts them at quantiles of the distinct draft sizes (the same on an even grid).
    Base knots are extended by `degree` knots on each side at the boundary spacing, as sklearn does.
    solver="sklearn" keeps n_knots and solves as sklearn's LinearRegression does (centre the basis and
    the times, minimum-norm least squares, intercept from the means); solver="adaptive" lowers n_knots
    to (distinct sizes - degree) so there are fewer basis functions than measurements, and solves with
    the intercept as one more column."""

    def __init__(self, g, s, degree: int = 2, n_knots: int = 8, knots: str = "quantile",
                 solver: str = "adaptive"):
        g, s = _check_curve(g, s, "step time")
        if knots not in ("quantile", "uniform"):
            raise CalibrationError(f"knots must be 'quantile' or 'uniform', got {knots!r}")
        if solver not in ("adaptive", "sklearn"):
            raise CalibrationError(f"solver must be 'adaptive' or 'sklearn', got {solver!r}")
        distinct = np.unique(g)
        self.degree = degree
        if distinct.size < 2:
            self.constant = float(s.mean())
            return
        self.constant = None
        if solver == "adaptive":
            n_knots = max(2, min(n_knots, distinct.size - degree))
        if knots == "quantile":
            base = np.quantile(distinct, np.linspace(0, 1, n_knots))
        else:
            base = np.linspace(distinct[0], distinct[-1], n_knots)
        lo_step, hi_step = base[1] - base[0], base[-1] - base[-2]
        self.knots = np.concatenate([base[0] - lo_step * np.arange(degree, 0, -1), base,
                                     base[-1] + hi_step * np.arange(1, degree + 1)])
        basis = BSpline.design_matrix(g, self.knots, degree, extrapolate=True).toarray()  # [m, n_knots+degree-1]
        if solver == "sklearn":
            mean_b, mean_s = basis.mean(axis=0), s.mean()
            self.coef, *_ = np.linalg.lstsq(basis - mean_b, s - mean_s, rcond=None)   # min-norm
            self.intercept = float(mean_s - mean_b @ self.coef)
        else:
            design = np.hstack([basis, np.ones((g.size, 1))])
            sol, *_ = np.linalg.lstsq(design, s, rcond=None)
            self.coef, self.intercept = sol[:-1], float(sol[-1])
        self._spline = BSpline(self.knots, self.coef, degree, extrapolate=True)

    def __call__(self, g):
        g = np.asarray(g, dtype=np.float64)
        if self.constant is not None:
            return np.full_like(g, self.constant)
        return self._spline(g) + self.intercept


def fit_step_time(g, s, degree: int = 2, n_knots: int = 8, knots: str = "quantile",
                  solver: str = "adaptive") -> BSplineFit:
    return BSplineFit(g, s, degree, n_knots, knots, solver)


@dataclass
class DraftSizeFit:
    g_star: int                 # the calibrated draft size (root excluded)
    g_continuous: float         # the optimiser's (or grid's) value before rounding
    predicted_tau: float
    predicted_step_s: float
    predicted_tokens_per_s: float
    mode: str                   # "de", "grid", or "grid-fallback" (the fit was unusable)


def optimal_draft_size(g, tau, s, mode: str | None = None, knots: str | None = None, *,
                       pipeline: str | Pipeline = "default") -> DraftSizeFit:
    """g* = argmax tau(g)/s(g) over [min g, max g]. mode "de": fitted curves + differential evolution;
    "grid": the best measured point. `pipeline` (module docstring) sets the knots, the spline solver,
    the rounding and the guard; mode / knots override it. Pure."""
    p = pipeline_of(pipeline, mode=mode, knots=knots)
    g_arr, tau_arr = _check_curve(g, tau, "tau")
    _, s_arr = _check_curve(g, s, "step time")
    if np.any(s_arr <= 0):
        raise CalibrationError(f"step times must be positive seconds, got {s_arr.tolist()}")
    if p.mode == "grid":
        speed = tau_arr / s_arr
        i = int(np.argmax(speed))
        fit = DraftSizeFit(int(round(g_arr[i])), float(g_arr[i]), float(tau_arr[i]), float(s_arr[i]),
                           float(speed[i]), "grid")
    else:
        f_tau, f_s = fit_tau(g_arr, tau_arr), fit_step_time(g_arr, s_arr, knots=p.knots, solver=p.spline)
        lo, hi = float(g_arr.min()), float(g_arr.max())
        dense = np.linspace(lo, hi, 1001)
        if p.guard and float(f_s(dense).min()) < 0.5 * float(s_arr.min()):
            # the step-time fit dips far below every measurement: the optimiser would chase the dip
            warnings.warn(f"the step-time spline drops to {float(f_s(dense).min()):.3g} s (measured minimum "
                          f"{float(s_arr.min()):.3g} s): the measurements are too noisy for the fit; using "
                          f"the best measured grid point instead (remeasure with --repeats 2 on a quiet "
                          f"machine)", stacklevel=2)
            fit = optimal_draft_size(g_arr, tau_arr, s_arr, pipeline=dataclasses.replace(p, mode="grid"))
            fit.mode = "grid-fallback"
            return fit
        floor_s = 1e-3 * float(s_arr.min())          # never divide by ~0

        def neg_speed(x):
            return -float(f_tau(x[0])) / max(float(f_s(x[0])), floor_s)

        if hi > lo:
            x = float(differential_evolution(neg_speed, [(lo, hi)], **DE_KWARGS).x[0])
        else:
            x = lo
        clamp = (lambda c: min(max(c, math.ceil(lo)), math.floor(hi)))
        if p.rounding == "nearest":                  # the paper's int(round(x))
            best = clamp(int(round(x)))
        else:                                        # floor or ceil, whichever the fit predicts faster
            best = max(sorted({clamp(math.floor(x)), clamp(math.ceil(x))}), key=lambda c: -neg_speed([c]))
        tau_b, s_b = float(f_tau(best)), float(f_s(best))
        fit = DraftSizeFit(int(best), x, tau_b, s_b, tau_b / max(s_b, floor_s), "de")
    if fit.g_star <= 0:
        raise CalibrationError(f"calibration gave g* = {fit.g_star} <= 0 — the grid must hold positive sizes")
    return fit


def eagle_total_token(forward_s: Mapping[int, float], candidates: Sequence[int] = EAGLE_CANDIDATES,
                      prior_gain: Sequence[float] = EAGLE_PRIOR_GAIN) -> int:
    """EAGLE's `total_token=-1` choice: argmin over candidates of time(n) / prior_gain(n). Pure.
    Returns total tokens n (root included; the draft size is n - 1)."""
    if len(candidates) != len(prior_gain) or not candidates:
        raise CalibrationError("EAGLE's heuristic needs one prior gain per candidate size")
    missing = [n for n in candidates if n not in forward_s]
    if missing:
        raise CalibrationError(f"no forward time measured for {missing} tokens — time every candidate")
    ratios = [forward_s[n] / x for n, x in zip(candidates, prior_gain)]
    return int(candidates[int(np.argmin(ratios))])


# ---- the cache key ---------------------------------------------------------------------------------------
# Its config part (`calibration_fields`, `config_fingerprint` and their tables) is defined in engine.config,
# without torch, so that a sweep's config links its cells in a process without torch; imported above.


def device_name(device: torch.device | str) -> str:
    """A stable name of the hardware a timing belongs to (CPU model + threads, or the GPU's name). A CPU run as
    an AVX2 one (`SPECVOCAB_CPU_ISA=avx2`, kernels.cpu.isa) is another device: its timings are kept apart."""
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
    return f"cpu:{model}:{torch.get_num_threads()}threads" + (":avx2" if isa_env() == "avx2" else "")


def model_id(model) -> str:
    """The model's name for the cache key: its folder / hub name (`config._name_or_path`), else its
    architecture and shape (random test models). Derived from the model alone, so the harness (which
    only sees the model) and `calibrate` agree."""
    cfg = getattr(model, "config", None)
    name = Path(str(getattr(cfg, "_name_or_path", "") or "")).name
    if name:
        return name
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return (f"{getattr(text, 'model_type', 'model')}-V{getattr(text, 'vocab_size', '?')}"
            f"-d{getattr(text, 'hidden_size', '?')}-L{getattr(text, 'num_hidden_layers', '?')}")


def calibration_key(model_name: str, device: str, dtype, method: str, fingerprint: str, build: str) -> str:
    return f"{model_name}|{device}|{str(dtype).replace('torch.', '')}|{method}|{fingerprint}|{build}"


def kernel_build(model, cfg: SpecConfig) -> str:
    """The build that decodes cfg on model, as the calibration key names it: on a CPU, where the C kernels run
    (`engine.target.cpu_kernels_run`), the build of the chain that runs the model's linear (`kernels.cpu.provider`
    of "linear_bf16" or "linear_f32": "amx-bf16", "avx512-bf16", "avx512", "avx2"), else "torch"; on another
    device its type ("cuda"). s(g) is a property of the build as much as of the device."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        return p.device.type
    if not cpu_kernels_run(model, cfg.backend, cfg.cpu_kernels):
        return "torch"
    build = cpu.provider("linear_bf16" if p.dtype == torch.bfloat16 else "linear_f32")
    return "torch" if build is None else build.name


def kernel_build_source() -> str:
    """Where the kernel build came from: "given" (`$SPECVOCAB_CPU_ISA` names one) or "default" (what the CPU has)."""
    return "default" if isa_env() == "auto" else "given"


def model_key(model, cfg: SpecConfig) -> str:
    """The cache key of (model, device, dtype, cfg.method, the fields of cfg that change tau or s, the kernel
    build that decodes: `kernel_build`)."""
    p = next(model.parameters())
    return calibration_key(model_id(model), device_name(p.device), p.dtype, cfg.method, config_fingerprint(cfg),
                           kernel_build(model, cfg))


# ---- the cache -------------------------------------------------------------------------------------------

def cache_file() -> Path:
    """This machine's calibration cache: `$SPECVOCAB_CALIBRATION` when set (a file path; the test suite points
    it at a fresh file so that no test reads or writes the user's records), else
    `$SPECVOCAB_CACHE/calibration.json`."""
    override = os.environ.get("SPECVOCAB_CALIBRATION")
    return Path(override).expanduser() if override else cache_root() / "calibration.json"


def load_calibrations(path: str | Path | None = None) -> dict:
    """{key: calibration record} from `path` (default: the cache, `cache_file()`); {} if there is none."""
    path = cache_file() if path is None else Path(path)
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CalibrationError(f"the calibration cache {path} is corrupt ({e}) — delete it and calibrate "
                               f"again") from e


def save_calibration(key: str, record: dict, path: str | Path | None = None) -> Path:
    """Add or replace one record in the JSON cache (default `cache_file()`; atomic rename). Writers on one
    machine take turns (a lock file beside it), so two processes calibrating at once keep both records."""
    path = cache_file() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)               # released when the file closes
        data = load_calibrations(path)
        data[key] = record
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True, default=str))
    return path


def cached_draft_size(key: str) -> int | None:
    rec = load_calibrations().get(key)
    return None if rec is None else int(rec["g_star"])


_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("engine", "kernels")      # the decoder: what a step costs and what it accepts (engine/jobs excluded)


def code_files(root: str | Path = _PACKAGE_ROOT) -> list[Path]:
    """The sources `code_stamp` hashes under `root`: engine/ and kernels/ (.py and .c), without engine/jobs
    (the command lines around the decoder), in a stable order."""
    root = Path(root)
    files = [f for d in CODE_DIRS for f in (root / d).rglob("*") if f.suffix in (".py", ".c") and f.is_file()]
    return sorted((f for f in files if "jobs" not in f.relative_to(root).parts[1:2]),
                  key=lambda f: f.relative_to(root).as_posix())


@functools.lru_cache(maxsize=None)
def _stamp_of(root: Path) -> str:
    h = hashlib.sha1(torch.__version__.encode())
    for f in code_files(root):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def code_stamp(root: str | Path | None = None) -> str:
    """A short hash of the decoder's sources (`code_files`) and torch's version: what a calibration record's
    `code` field holds, so that `resolve_draft_size` can tell a g* measured by other code (computed once per
    process and root)."""
    return _stamp_of(Path(root).resolve() if root is not None else _PACKAGE_ROOT)


def calibrate_command(cfg: SpecConfig, model) -> str:
    """The `python -m specvocab.engine.jobs.calibrate` command that calibrates cfg's key on this machine: the model, the
    method, the device, dtype and (CPU) threads of the key, and a `--set` for every calibration field where
    cfg differs from the method's preset."""
    p = next(model.parameters())
    preset = calibration_fields(SpecConfig.preset(cfg.method)) if cfg.method in DRAFTING_METHODS else {}
    parts = ["python -m specvocab.engine.jobs.calibrate", f"--model {shlex.quote(model_id(model))}", f"--method {cfg.method}",
             f"--device {p.device}", f"--dtype {str(p.dtype).replace('torch.', '')}"]
    if p.device.type == "cpu":
        parts.append(f"--threads {torch.get_num_threads()}")
    for name, value in calibration_fields(cfg).items():
        if name not in preset or value != preset[name]:
            text = value if isinstance(value, str) else json.dumps(value)
            parts.append(f"--set {shlex.quote(f'{name}={text}')}")
    return " ".join(parts)


_warned: set[tuple] = set()


@dataclass(frozen=True)
class CalibrationSource:
    """Where a run's draft size is looked up when its config has none: `records` ({key: calibration record},
    as `load_calibrations` returns) and the `label` its rows carry as `draft_size_source` -
    "calibration-cache:<sha8>" (this machine's cache), "calibration-file:<sha8>" (a file a sweep names;
    sha8: the first 8 hex digits of the file's SHA-256) or "default" (no records: the method's uncalibrated
    default, whatever the machine's cache holds). `path`: the file read, for messages. `required`: a key the
    records lack is an error (`MissingCalibration`), not the uncalibrated default (a sweep's calibration file)."""

    records: dict
    label: str
    path: str | None = None
    required: bool = False


class MissingCalibration(CalibrationError):
    """A calibration file that must hold the run's key (`CalibrationSource.required`) lacks it; the message names
    the key and the records it has for the method."""


def require_record(source: CalibrationSource, key: str, method: str) -> None:
    """MissingCalibration unless `source` holds `key` (or does not require one)."""
    if source.required and key not in source.records:
        near = sorted(k for k in source.records if k.split("|")[3:4] == [method])
        raise MissingCalibration(f"the calibration file {source.path} ({source.label}) has no g* for {key}: it was "
                                 f"calibrated for another model, device, dtype, config or kernel build ({len(near)} "
                                 f"{method} records: {near[:2]})")


NO_CALIBRATION = CalibrationSource({}, "default")


def file_sha(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def calibration_source(path: str | Path | None = None) -> CalibrationSource:
    """The records of a calibration file (`path`, labelled "calibration-file:<sha8>") or of this machine's
    cache (None: `cache_file()`, "calibration-cache:<sha8>"; an absent cache reads as no records)."""
    file = cache_file() if path is None else Path(path)
    kind = "calibration-cache" if path is None else "calibration-file"
    if not file.is_file():
        if path is not None:
            raise CalibrationError(f"calibration file {file} does not exist — give the calibration.json a "
                                   f"calibrate run wrote (`python -m specvocab.engine.jobs.calibrate`)")
        return CalibrationSource({}, f"{kind}:none", str(file))
    return CalibrationSource(load_calibrations(file), f"{kind}:{file_sha(file)[:8]}", str(file))


def resolve_draft_size(cfg: SpecConfig, model, *, on_missing: str = "fallback", fallback: int | None = None) -> int:
    """`cfg.draft_size` if set, else the cached g* of (model, device, dtype, cfg.method, cfg's calibration
    fields) - for every method in `DRAFTING_METHODS` (UniSpec §3, App. F; what g means per method: the
    module docstring) - else the uncalibrated default, with one warning per cache and key naming the
    command that calibrates it (`calibrate_command`): `fallback` when given (the harness passes each
    method's: `engine.config.DEFAULT_DRAFT_SIZE`, recycling's whole template), else unispec's
    FALLBACK_DRAFT_SIZE for the device type. `on_missing="error"` raises a CalibrationError instead."""
    return resolve_draft_size_source(cfg, model, on_missing=on_missing, fallback=fallback)[0]


def resolve_draft_size_source(cfg: SpecConfig, model, *, on_missing: str = "fallback", fallback: int | None = None,
                              source: CalibrationSource | None = None) -> tuple[int, str]:
    """`resolve_draft_size` and where its g came from: "config" (`cfg.draft_size`), `source.label` (a record
    of `source`, default this machine's cache: `calibration_source()`) or "default" (the uncalibrated
    fallback). With `source` given, only its records are read, never the machine's cache."""
    if on_missing not in ("fallback", "error"):
        raise CalibrationError(f"on_missing must be 'fallback' or 'error', got {on_missing!r}")
    if cfg.draft_size is not None:
        return int(cfg.draft_size), "config"
    if cfg.method not in DRAFTING_METHODS:
        raise CalibrationError(f"method {cfg.method!r} drafts nothing, so it has no draft size to resolve — the "
                               f"drafting methods are {list(DRAFTING_METHODS)}")
    if model is None:
        raise CalibrationError("resolve_draft_size needs the target model (for its device and dtype) when "
                               "cfg.draft_size is None — pass the model or set draft_size")
    key = model_key(model, cfg)
    source = calibration_source() if source is None else source
    where = source.path or "no calibration file (this run reads none, not even this machine's cache)"
    rec = source.records.get(key)
    if rec is not None:
        g, code = int(rec["g_star"]), rec.get("code")
        if code != code_stamp() and (where, key, "stale") not in _warned:     # once per file and key
            _warned.add((where, key, "stale"))
            made = f"code stamp {code}" if code else "no code stamp (an older version)"
            warnings.warn(f"the calibrated draft size g = {g} for {cfg.method} ({key}) was measured by other code "
                          f"({made}; this decoder's is {code_stamp()}): using it, but a kernel or drafter change "
                          f"moves g* — re-measure with `{calibrate_command(cfg, model)}`", stacklevel=2)
        return g, source.label
    dev_type = next(model.parameters()).device.type
    if fallback is None:
        fallback, what = FALLBACK_DRAFT_SIZE.get(dev_type, FALLBACK_DRAFT_SIZE["cuda"]), f"the {dev_type} default"
    else:
        what = f"{cfg.method}'s uncalibrated default"
    msg = (f"no calibrated draft size for {cfg.method} on this model, device, dtype and config ({key}) in "
           f"{where} — make one with `{calibrate_command(cfg, model)}` (a few minutes; UniSpec App. F), "
           f"or pass draft_size=")
    if on_missing == "error":
        raise CalibrationError(msg)
    if (where, key) not in _warned:                         # once per file and key
        _warned.add((where, key))
        warnings.warn(f"{msg}; using {what} g = {fallback}", stacklevel=2)
    return int(fallback), "default"


# ---- records ---------------------------------------------------------------------------------------------

def _curves(rec: dict, timing: str) -> tuple[list, list, list]:
    rows = rec["rows"]
    return ([r["g"] for r in rows], [r["tau"] for r in rows],
            [r["s_step" if timing == "step" else "s_forward"] for r in rows])


def fit_record(rec: dict, pipeline: str | Pipeline, mode: str | None = None, timing: str | None = None) -> dict:
    """The g* fields of a calibration record from its measured rows: g_star, g_continuous, mode, timing,
    pipeline, g_star_grid, predicted_tokens_per_s. Pure."""
    p = pipeline_of(pipeline, mode=mode, timing=timing)
    g, tau, s = _curves(rec, p.timing)
    fit = optimal_draft_size(g, tau, s, pipeline=p)
    return dict(g_star=fit.g_star, g_continuous=fit.g_continuous, mode=fit.mode, timing=p.timing,
                pipeline=pipeline if isinstance(pipeline, str) else dataclasses.asdict(p),
                g_star_grid=optimal_draft_size(g, tau, s, pipeline=dataclasses.replace(p, mode="grid")).g_star,
                predicted_tokens_per_s=fit.predicted_tokens_per_s)


def _record_pipeline(rec: dict) -> tuple[str | Pipeline, str | None, str | None]:
    """(pipeline, mode, timing) a record was fitted with."""
    pipe = rec.get("pipeline", "default")
    mode = rec.get("mode")
    return (pipe if isinstance(pipe, str) else Pipeline(**pipe), mode if mode in ("de", "grid") else None,
            rec.get("timing"))


def refit(key: str, pipeline: str | None = None, mode: str | None = None, timing: str | None = None,
          save: bool = True) -> dict:
    """Recompute g* of a cached record from its measured rows (e.g. after a change to the fits, or with
    the other pipeline). Without `pipeline`, the record's own pipeline, mode and timing (unless given)."""
    rec = load_calibrations().get(key)
    if rec is None:
        raise CalibrationError(f"no calibration {key!r} in {cache_file()} — run "
                               f"`python -m specvocab.engine.jobs.calibrate`")
    if pipeline is None:
        pipeline, rec_mode, rec_timing = _record_pipeline(rec)
        mode, timing = mode or rec_mode, timing or rec_timing
    rec.update(fit_record(rec, pipeline, mode=mode, timing=timing))
    if save:
        save_calibration(key, rec)
    return rec


def calibration_curves(record: dict, points: int = 200) -> pl.DataFrame:
    """A calibration record as one tidy frame for plotting: the measured grid (`kind="measured"`) and the
    fitted curves over [min g, max g] (`kind="fit"`: cubic f_tau, B-spline f_s, their ratio), with columns
    `key, model, method, kind, g, tau, s_step_ms, tokens_per_s`, plus one `kind="g_star"` row at the
    record's g* (the size that runs). Pure: refits from the record's rows with the record's pipeline and
    timing. (`s_step_ms` is the timing the record was fitted on: the forward time under timing="forward".)"""
    pipe, mode, timing = _record_pipeline(record)
    p = pipeline_of(pipe, mode=mode, timing=timing)
    g, tau, s = (np.asarray(x, dtype=np.float64) for x in _curves(record, p.timing))
    f_tau, f_s = fit_tau(g, tau), fit_step_time(g, s, knots=p.knots, solver=p.spline)
    dense = np.linspace(g.min(), g.max(), points)
    fit = optimal_draft_size(g, tau, s, pipeline=p)
    # the g* that runs: the record's (the fit's raised to its row bucket's edge, engine.harness.bucket_edge),
    # drawn on the fits where they were fitted, else at the fit's own prediction (the bucket's forward cost)
    run_g = float(record.get("g_star", fit.g_star))
    inside = g.min() <= run_g <= g.max()
    star_tau = float(f_tau(run_g)) if inside else fit.predicted_tau
    star_s = float(f_s(run_g)) if inside else fit.predicted_step_s
    parts = [("measured", g, tau, s), ("fit", dense, f_tau(dense), f_s(dense)),
             ("g_star", np.array([run_g]), np.array([star_tau]), np.array([star_s]))]
    key = record["key"]
    model = record.get("model", key.split("|")[0])
    method = record.get("method", key.split("|")[3] if key.count("|") >= 3 else "")
    return pl.concat([pl.DataFrame({"key": key, "model": model, "method": method, "kind": kind, "g": x, "tau": t,
                                    "s_step_ms": 1e3 * st, "tokens_per_s": t / st})
                      for kind, x, t, st in parts])
