"""Device-aware calibration: fits on synthetic curves with a known optimum, the cache, the EAGLE anchor,
and one small measurement through the harness on a random model."""

import ast
import copy
import dataclasses
import shlex
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

import specvocab.engine.jobs.calibrate as cal
import specvocab.engine.measure as measure
import specvocab.engine.vocab.frspec_lists as frspec_lists
from specvocab.engine import calibration as calib
from specvocab.engine.config import METHODS, POLICIES, SpecConfig, parse_overrides
from specvocab.engine.harness import bucket_edge, generate, resolve_config
from specvocab.engine.models import load_model
from specvocab.engine.native import BLOCK
from specvocab.engine.target import pads_rows
from tests.calibration_testing import cache_dir, tiny  # noqa: F401 (fixtures)


def true_optimum(tau_fn, s_fn, lo, hi):
    g = np.linspace(lo, hi, 200001)
    return g[np.argmax(tau_fn(g) / s_fn(g))]


CURVES = {
    # saturating acceptance, verification cost flat then linear (a GPU-like knee): optimum inside
    "gpu": (lambda g: 1 + 1.9 * (1 - np.exp(-g / 40)),
            lambda g: 0.027 + 0.0004 * np.maximum(g - 60, 0) ** 1.5 / 10, 16, 160),
    # CPU-like: cost grows from the start
    "cpu": (lambda g: 1 + 1.2 * (1 - np.exp(-g / 6)),
            lambda g: 0.056 + 0.0025 * g, 1, 32),
}


@pytest.mark.parametrize("name", sorted(CURVES))
def test_de_recovers_known_optimum(name):
    tau_fn, s_fn, lo, hi = CURVES[name]
    g_star = true_optimum(tau_fn, s_fn, lo, hi)
    grid = np.linspace(lo, hi, 10).round()
    rng = np.random.default_rng(0)
    tau = tau_fn(grid) * (1 + 0.005 * rng.standard_normal(grid.size))   # a little measurement noise
    s = s_fn(grid) * (1 + 0.005 * rng.standard_normal(grid.size))
    fit = calib.optimal_draft_size(grid, tau, s, mode="de")
    assert lo < g_star < hi
    assert abs(fit.g_star - g_star) <= 0.08 * (hi - lo), (fit, g_star)
    # the fitted throughput at g* is within 1.5% of the true maximum throughput
    best = tau_fn(g_star) / s_fn(g_star)
    assert tau_fn(fit.g_star) / s_fn(fit.g_star) >= 0.985 * best


def test_de_on_the_uneven_cpu_grid():
    """The CPU grid is uneven; with noisy step times the spline must not swing (it did with uniform knots)."""
    tau_fn = lambda g: 1 + 1.0 * (1 - np.exp(-g / 8))
    s_fn = lambda g: 0.075 + 0.0032 * g - 0.03 * np.exp(-g)          # a jump from 1 to 2 nodes, then linear
    grid = np.array(calib.DEFAULT_GRIDS["cpu"], dtype=float)
    g_star = true_optimum(tau_fn, s_fn, grid[0], grid[-1])
    rng = np.random.default_rng(3)
    for trial in range(5):
        s = s_fn(grid) * (1 + 0.05 * rng.standard_normal(grid.size))       # 5% timing noise
        fit = calib.optimal_draft_size(grid, tau_fn(grid), s, mode="de")
        assert fit.mode == "de"
        assert float(calib.fit_step_time(grid, s)(np.linspace(1, 32, 300)).min()) > 0.5 * s.min()
        assert tau_fn(fit.g_star) / s_fn(fit.g_star) >= 0.93 * tau_fn(g_star) / s_fn(g_star), (trial, fit)


def test_unusable_fit_falls_back_to_grid():
    g = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32], dtype=float)
    s = np.array([.149, .152, .108, .133, .146, .120, .139, .187, .237, .271])   # measured under load
    tau = np.array([1.09, 1.23, 1.29, 1.36, 1.50, 1.56, 1.68, 1.83, 1.93, 1.98])
    with pytest.warns(UserWarning, match="too noisy"):
        fit = calib.optimal_draft_size(g, tau, s, knots="uniform")
    assert fit.mode == "grid-fallback" and fit.g_star == 8
    assert calib.optimal_draft_size(g, tau, s).mode == "de"              # quantile knots cope


@pytest.mark.parametrize("name", sorted(CURVES))
def test_grid_mode_picks_best_measured_point(name):
    tau_fn, s_fn, lo, hi = CURVES[name]
    grid = np.linspace(lo, hi, 10).round()
    fit = calib.optimal_draft_size(grid, tau_fn(grid), s_fn(grid), mode="grid")
    g_star = true_optimum(tau_fn, s_fn, lo, hi)
    spacing = (hi - lo) / 9
    assert abs(fit.g_star - g_star) <= spacing
    assert fit.g_star in grid.astype(int).tolist()
    assert fit.predicted_tokens_per_s == pytest.approx(max(tau_fn(grid) / s_fn(grid)))


def test_fits_reproduce_smooth_curves():
    g = np.arange(16, 161, 16, dtype=float)
    s = 0.02 + 1e-6 * (g - 40) ** 2
    f_s = calib.fit_step_time(g, s)
    gg = np.linspace(16, 160, 50)
    np.testing.assert_allclose(f_s(gg), 0.02 + 1e-6 * (gg - 40) ** 2, rtol=1e-6)   # quadratic: exact
    tau = 1 + 0.03 * g - 1e-4 * g ** 2 + 2e-7 * g ** 3
    np.testing.assert_allclose(calib.fit_tau(g, tau)(gg), 1 + 0.03 * gg - 1e-4 * gg ** 2 + 2e-7 * gg ** 3, rtol=1e-8)


def test_few_points_still_fit():
    fit = calib.optimal_draft_size([4, 8, 16], [1.5, 1.8, 1.9], [0.06, 0.07, 0.1])
    assert 4 <= fit.g_star <= 16
    one = calib.optimal_draft_size([8], [1.7], [0.07])
    assert one.g_star == 8


def test_errors():
    with pytest.raises(calib.CalibrationError, match="empty"):
        calib.optimal_draft_size([], [], [])
    with pytest.raises(calib.CalibrationError, match="positive"):
        calib.optimal_draft_size([0, 4, 8], [1, 1.5, 1.7], [0.05, 0.06, 0.07])
    with pytest.raises(calib.CalibrationError, match="positive"):
        calib.optimal_draft_size([2, 4, 8], [1, 1.5, 1.7], [0.05, -0.06, 0.07])
    with pytest.raises(calib.CalibrationError, match="mode"):
        calib.optimal_draft_size([2, 4], [1, 1.5], [0.05, 0.06], mode="bayes")
    with pytest.raises(calib.CalibrationError, match="one per size"):
        calib.optimal_draft_size([2, 4], [1], [0.05, 0.06])


def test_eagle_heuristic():
    lin = {n: 0.001 * n for n in calib.EAGLE_CANDIDATES}           # CPU-like: time grows with n
    assert calib.eagle_total_token(lin) == 40
    flat = {n: 0.03 for n in calib.EAGLE_CANDIDATES}               # GPU-like: flat -> the prior gain wins
    assert calib.eagle_total_token(flat) == 60
    knee = {40: 0.030, 48: 0.0305, 50: 0.031, 56: 0.0345, 60: 0.036}
    assert calib.eagle_total_token(knee) == 50                    # 0.031 / 1.07 is the smallest ratio
    with pytest.raises(calib.CalibrationError, match="no forward time"):
        calib.eagle_total_token({40: 0.1})


def test_every_config_field_is_in_or_out_of_the_calibration_key():
    """A field added to SpecConfig must be classified: it changes tau(g)/s(g) of some method (part of the
    key) or of none. Otherwise a calibration would silently be reused across settings it does not fit."""
    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    keyed = {n for names in calib.CALIBRATION_FIELDS.values() for n in names}
    keyed |= {n for names in calib.POLICY_FIELDS.values() for n in names}
    assert fields == keyed | set(calib.NOT_CALIBRATION_FIELDS), fields ^ (keyed | set(calib.NOT_CALIBRATION_FIELDS))
    assert set(calib.CALIBRATION_FIELDS) == set(METHODS) and set(calib.POLICY_FIELDS) == set(POLICIES)


CHANGED = {"threshold_r": 0.1, "store_k": 8, "tree_depth": 6, "confidence": "node", "cache_exclude_root": False,
           "broaden_first_level": False, "threshold_scope": "expand+select", "store_persistence": "per_prompt",
           "temperature": 0.7, "top_p": 0.9}


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_unispec_key_changes_with_every_field_that_changes_tau(tiny, field):
    model, _ = tiny
    cfg = SpecConfig.preset("unispec")
    assert calib.model_key(model, cfg.replace(**{field: CHANGED[field]})) != calib.model_key(model, cfg)
    assert calib.calibration_fields(cfg)[field] == getattr(cfg, field)


def test_key_ignores_what_does_not_change_tau(tiny):
    model, _ = tiny
    cfg = SpecConfig.preset("unispec")
    same = cfg.replace(max_new_tokens=7, seed=3, record=True, draft_size=4, pld_max_ngram=5, drafter_layers="all",
                       vocab="microspec", w_max=64)
    assert calib.model_key(model, same) == calib.model_key(model, cfg)
    ls = SpecConfig.preset("layerskip")                            # a drafter's policy and its size are keyed
    for change in (dict(vocab="microspec"), dict(drafter_layers="first:1"), dict(eagle_topk=4)):
        assert calib.model_key(model, ls.replace(**change)) != calib.model_key(model, ls), change
    mic = ls.replace(vocab="microspec")
    assert calib.model_key(model, mic.replace(w_max=64)) != calib.model_key(model, mic)
    assert calib.model_key(model, ls.replace(w_max=64)) == calib.model_key(model, ls)   # full ignores w_max


def test_resolve_uses_only_a_calibration_of_the_same_settings(cache_dir, tiny):
    model, _ = tiny
    r10 = SpecConfig.preset("unispec", threshold_r=0.1)
    calib.save_calibration(calib.model_key(model, r10), {"g_star": 21})
    assert calib.resolve_draft_size(r10, model) == 21
    with pytest.raises(calib.CalibrationError, match="no calibrated draft size"):
        calib.resolve_draft_size(SpecConfig.preset("unispec"), model, on_missing="error")


def test_calibration_imports_neither_the_harness_nor_the_measuring_module():
    """The harness resolves g* through engine.calibration, so it must not import the harness back."""
    tree = ast.parse(Path(calib.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.startswith(("specvocab.engine.harness", "specvocab.engine.jobs.calibrate", "specvocab.engine.drafters"))}


def test_measure_and_calibrate_through_harness(cache_dir, tiny):
    model, info = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (12,), generator=gen) for _ in range(2)]
    warm = [torch.randint(0, 300, (12,), generator=gen)]
    cfg = SpecConfig.preset("unispec", max_new_tokens=12)
    kw = dict(cfg=cfg, warmup_prompts=warm, eos_ids=[], progress=False)
    rows = cal.measure_grid(model, prompts, "unispec", [1, 4], **kw)
    assert [r["g"] for r in rows] == [1, 4]
    for r in rows:
        assert 1.0 <= r["tau"] <= r["g"] + 1 and r["s_step"] >= r["s_forward"] > 0
    rec = cal.calibrate(model, prompts, "unispec", grid=[1, 2, 4], **kw)
    # the fitted g* runs at its row bucket's largest tree (engine.harness.bucket_edge) where steps are padded:
    # 1..3 -> 3, 4..7 -> 7; unpadded (the CPU kernels) as fitted
    assert rec["g_star"] in ((3, 7) if pads_rows(model) else range(1, 5)) and len(rec["rows"]) == 3
    assert rec.get("g_star_fit", rec["g_star"]) in range(1, 5)
    assert rec["code"] == calib.code_stamp()                     # measured by this code: taken without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert calib.resolve_draft_size(cfg, model) == rec["g_star"]


def test_every_grid_point_starts_from_the_same_store(tiny, monkeypatch):
    """Round robin: each g keeps its own copy of the store, starting from the warmed-up state and
    evolving over the prompts; the deployment store is left in the warmed-up state."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (10,), generator=gen) for _ in range(2)]
    cfg = SpecConfig.preset("unispec", max_new_tokens=10)
    store = cal.store_of(model, cfg, 300)
    calls = []
    real = cal.run_prompts

    def spy(model_, prompts_, cfg_, **kw):
        before = (store.tok.clone(), store.con.clone())
        out = real(model_, prompts_, cfg_, **kw)
        calls.append((cfg_.draft_size, before, (store.tok.clone(), store.con.clone())))
        return out

    monkeypatch.setattr(measure, "run_prompts", spy)
    cal.measure_grid(model, prompts, "unispec", [1, 3, 6], cfg=cfg, eos_ids=[], progress=False)
    assert [g for g, _, _ in calls] == [3, 1, 3, 6, 6, 3, 1]          # warm-up at the middle g, then interleaved
    warmed = calls[0][2]
    same = lambda a, b: torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for g, before, _ in calls[1:4]:                                   # first prompt: every g from the warm state
        assert same(before, warmed), g
    first_after = {g: after for g, _, after in calls[1:4]}
    for g, before, _ in calls[4:]:                                    # second prompt: g's own evolved store
        assert same(before, first_after[g]), g
    assert not same(first_after[1], warmed)                           # the runs did write the store
    assert same((store.tok, store.con), warmed)


def test_errors_of_measurement(tiny):
    model, _ = tiny
    prompts = [torch.arange(5)]
    with pytest.raises(calib.CalibrationError, match="empty"):
        cal.measure_grid(model, prompts, "unispec", [], eos_ids=[], progress=False)
    with pytest.raises(calib.CalibrationError, match="positive"):
        cal.measure_grid(model, prompts, "unispec", [0, 2], eos_ids=[], progress=False)


def test_calibration_curves_frame():
    g = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    tau = [1 + 0.6 * np.log2(x + 1) for x in g]
    s = [0.05 + 0.002 * x ** 1.5 for x in g]
    rec = {"key": "m|cpu|float32|unispec", "timing": "step",
           "rows": [{"g": x, "tau": t, "s_step": st, "s_forward": st} for x, t, st in zip(g, tau, s)]}
    cur = calib.calibration_curves(rec, points=50)
    assert cur.group_by("kind").len().sort("kind").rows() == [("fit", 50), ("g_star", 1), ("measured", 10)]
    meas = cur.filter(pl.col("kind") == "measured")
    assert meas["g"].to_list() == g and np.allclose(meas["s_step_ms"].to_numpy(), np.array(s) * 1e3)
    assert np.allclose(meas["tokens_per_s"].to_numpy(), np.array(tau) / np.array(s))
    star = cur.filter(pl.col("kind") == "g_star").row(0, named=True)
    assert star["g"] == calib.optimal_draft_size(g, tau, s).g_star     # no g* recorded: the fit's
    fit = cur.filter(pl.col("kind") == "fit")                  # the fitted curves pass near the measurements
    assert abs(np.interp(8, fit["g"].to_numpy(), fit["tau"].to_numpy()) - tau[5]) < 0.05
    # a recorded g* (the fit's raised to its row bucket's edge) is the diamond, on the fitted curves
    recorded = calib.calibration_curves({**rec, "g_star": 7}, points=50)
    star = recorded.filter(pl.col("kind") == "g_star").row(0, named=True)
    assert star["g"] == 7 and abs(star["tau"] - np.interp(7, fit["g"].to_numpy(), fit["tau"].to_numpy())) < 0.01


def test_calibrate_after_generate_on_the_same_model(tiny):
    """`generate` makes the deployment store inside inference mode; a later calibration (a notebook's
    next cell) must still be able to snapshot and restore it."""
    from specvocab.engine.harness import generate

    model, info = tiny
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (10,), generator=gen) for _ in range(2)]
    generate(model, prompts[0], method="unispec", max_new_tokens=6, draft_size=2, eos_ids=[])
    rec = cal.calibrate(model, prompts, "unispec", grid=[1, 2], cfg=SpecConfig.preset("unispec", max_new_tokens=6),
                        eos_ids=[], save=False, progress=False)
    assert [r["g"] for r in rec["rows"]] == [1, 2]


# --- every drafter's calibration varies its draft size ------------------------------------------------------

DRAFTERS = {
    "layerskip": dict(drafter_layers="all"),
    "eagle": dict(eagle_head="random", eagle_depth=3, eagle_topk=4),
    "pld": dict(),
    "recycling": dict(),
    "unispec": dict(),
}


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_calibrating_any_drafter_measures_different_tree_sizes(tiny, method):
    """Every drafter reads `draft_size`, so a grid of g measures different trees (it once measured the same
    layerskip configuration at every g)."""
    model, _ = tiny
    pattern = torch.arange(20, 32)
    prompts = [torch.cat([pattern, pattern, pattern[:5]]), torch.cat([pattern.flip(0)] * 3)]
    cfg = SpecConfig.preset(method, max_new_tokens=16, **DRAFTERS[method])
    rows = cal.measure_grid(model, prompts, method, [1, 8], cfg=cfg, eos_ids=[], progress=False)
    small, large = rows
    assert 0 < small["g_measured"] <= 1 and large["g_measured"] <= 8
    assert large["g_measured"] > small["g_measured"] + 0.5, rows


# --- the paper's pipeline on the paper's published measurements -------------------------------------------

# UniSpec App. G.2, Table 16 (Llama-3-8B-Instruct, A100): the grid search of step 25.
T16_G = np.array([25, 50, 75, 100, 125], dtype=float)
T16_TOKENS_PER_S = np.array([72.17, 81.93, 86.68, 89.49, 89.49])
T16_TAU = np.array([2.24, 2.56, 2.74, 2.83, 2.94])
T16_S = T16_TAU / T16_TOKENS_PER_S            # seconds per step: Eq. 2 solved for s(g)
# The same fit computed by the paper's own code (App. F.1, Table 14: SplineTransformer(degree=2, n_knots=8) +
# LinearRegression, PolynomialFeatures(degree=3) + LinearRegression, differential_evolution(seed=42, ...))
# with scikit-learn 1.9.1 and SciPy 1.17.1, at g = 25, 35, ..., 125.
SKLEARN_F_S = [0.03103782735208536, 0.031061203561400224, 0.031164710598202985, 0.03134594314202403,
               0.03151360535662247, 0.0316105214582372, 0.0316294008701768, 0.03160403282897428,
               0.03180159108248342, 0.03253539465496623, 0.03285283271873953]
SKLEARN_F_TAU = [2.2391428571443073, 2.3923200000014653, 2.513360000001186, 2.607382857143563, 2.6795085714286886,
                 2.734857142856656, 2.7785485714275584, 2.8157028571414893, 2.851439999998541, 2.8908799999988073,
                 2.9391428571423814]
SKLEARN_G_CONTINUOUS = 103.21690972


def test_paper_pipeline_on_the_papers_published_grid():
    """The paper's pipeline (uniform knots, its exact spline regression, nearest rounding) on Table 16
    reproduces its own code's fit exactly; that gives g* = 103, not the reported 111, because the
    published s(g) are full steps (tau / real throughput) while the paper fitted forward-only times it
    does not publish per grid point. What the paper claims of the comparison still holds: the grid's
    best points tie at 100 and 125, and the fitted optimum lies between them and beats both."""
    dense = np.linspace(25, 125, 11)
    p = calib.PIPELINES["paper"]
    assert (p.knots, p.timing, p.mode) == ("uniform", "forward", "de")
    f_s = calib.fit_step_time(T16_G, T16_S, knots=p.knots, solver=p.spline)
    np.testing.assert_allclose(f_s(dense), SKLEARN_F_S, rtol=1e-9)
    np.testing.assert_allclose(calib.fit_tau(T16_G, T16_TAU)(dense), SKLEARN_F_TAU, rtol=1e-9)
    fit = calib.optimal_draft_size(T16_G, T16_TAU, T16_S, pipeline="paper")
    assert fit.mode == "de" and fit.g_continuous == pytest.approx(SKLEARN_G_CONTINUOUS, abs=1e-3)
    assert fit.g_star == 103
    grid = calib.optimal_draft_size(T16_G, T16_TAU, T16_S, pipeline="paper", mode="grid")
    assert grid.g_star == 100 and grid.predicted_tokens_per_s == pytest.approx(89.49)   # tie with 125
    assert 100 < fit.g_continuous < 125 and fit.predicted_tokens_per_s > grid.predicted_tokens_per_s
    # our default pipeline (fewer knots than points: no interpolation through the noise) on the same data
    ours = calib.optimal_draft_size(T16_G, T16_TAU, T16_S)
    assert 100 <= ours.g_star <= 125


def test_paper_pipeline_is_selectable_in_calibrate(tiny):
    model, _ = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (12,), generator=gen) for _ in range(2)]
    rec = cal.calibrate(model, prompts, "unispec", grid=[1, 2, 4], pipeline="paper", eos_ids=[], save=False,
                        progress=False, cfg=SpecConfig.preset("unispec", max_new_tokens=10))
    assert rec["pipeline"] == "paper" and rec["timing"] == "forward"
    g, tau, s_fwd = ([r[k] for r in rec["rows"]] for k in ("g", "tau", "s_forward"))
    fit = calib.optimal_draft_size(g, tau, s_fwd, pipeline="paper").g_star
    assert rec.get("g_star_fit", rec["g_star"]) == fit                  # the fit's g* ...
    assert rec["g_star"] == bucket_edge(SpecConfig.preset("unispec"), model, fit)    # ... run at its bucket's edge
    assert rec["config"] == calib.calibration_fields(SpecConfig.preset("unispec"))
    assert rec["key"] == calib.model_key(model, SpecConfig.preset("unispec"))
    with pytest.raises(calib.CalibrationError, match="pipeline"):
        calib.optimal_draft_size(g, tau, s_fwd, pipeline="bayes")


# --- draft_size=None is the calibrated size of every drafter ------------------------------------------------

# every drafting method on the tiny model: what its drafter needs there (eagle an untrained head, a small tree)
CALIBRATED = {
    "unispec": dict(), "recycling": dict(), "pld": dict(), "hf-prompt-lookup": dict(),
    "layerskip": dict(drafter_layers="all"),
    "eagle": dict(eagle_head="random", eagle_depth=2, eagle_topk=3),
    "eagle3": dict(eagle3_head="random", eagle_depth=2, eagle_topk=3),
    "merged": dict(merge_sources="eagle3+pld+unispec", eagle3_head="random", eagle_depth=2, eagle_topk=3),
}
UNCALIBRATED = {"unispec": calib.FALLBACK_DRAFT_SIZE["cpu"], "recycling": 80, "pld": 10, "hf-prompt-lookup": 10,
                "layerskip": 59, "eagle": 59, "eagle3": 59, "merged": calib.FALLBACK_DRAFT_SIZE["cpu"]}


def _repetitive_prompts():
    pattern = torch.arange(20, 32)
    return [torch.cat([pattern, pattern, pattern[:5]]), torch.cat([pattern.flip(0)] * 3)]


def test_drafting_methods_are_every_method_that_drafts():
    assert set(calib.DRAFTING_METHODS) == set(METHODS) - {"ar"} == set(CALIBRATED) == set(UNCALIBRATED)


@pytest.mark.parametrize("method", calib.DRAFTING_METHODS)
def test_calibrating_a_method_makes_its_calibrated_size_the_default(cache_dir, tiny, method):
    """Calibrating X writes a record under X's own key; `resolve_config(preset(X))` then runs at its g* - a
    size of the grid {1, 2, 3}, never X's uncalibrated default - without the missing-calibration warning."""
    model, _ = tiny
    cfg = SpecConfig.preset(method, **CALIBRATED[method])
    rec = cal.calibrate(model, _repetitive_prompts(), method, grid=[1, 2, 3], cfg=cfg.replace(max_new_tokens=10),
                        eos_ids=[], progress=False)
    assert rec["method"] == method and rec["key"].split("|")[3] == method
    assert rec["key"] == calib.model_key(model, cfg) and set(calib.load_calibrations()) == {rec["key"]}
    assert [r["g"] for r in rec["rows"]] == [1, 2, 3] and rec["g_star"] in (1, 2, 3)
    assert UNCALIBRATED[method] not in (1, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_config(SpecConfig.preset(method, **CALIBRATED[method]), model=model).draft_size == rec["g_star"]
    assert resolve_config(cfg.replace(draft_size=7), model=model).draft_size == 7          # a hand-set size wins


def test_each_method_takes_only_its_own_calibration(cache_dir, tiny):
    """With only unispec calibrated, no other method takes unispec's g*: each keeps its uncalibrated default
    (with the warning); once each is calibrated, each resolves to its own g*."""
    model, _ = tiny
    cfgs = {m: SpecConfig.preset(m, **CALIBRATED[m]) for m in calib.DRAFTING_METHODS}
    calib.save_calibration(calib.model_key(model, cfgs["unispec"]), {"g_star": 5})
    edge = lambda m, g: bucket_edge(cfgs[m], model, g)            # what runs: g at its row bucket's edge
    for m, cfg in cfgs.items():
        if m != "unispec":
            with pytest.warns(UserWarning, match=f"no calibrated draft size for {m} "):
                assert resolve_config(cfg, model=model).draft_size == edge(m, UNCALIBRATED[m]), m
    assert resolve_config(cfgs["unispec"], model=model).draft_size == edge("unispec", 5) == (7 if pads_rows(model)
                                                                                             else 5)
    own = {m: 11 + i for i, m in enumerate(cfgs)}
    for m, g in own.items():
        calib.save_calibration(calib.model_key(model, cfgs[m]), {"g_star": g})
    assert {m: resolve_config(cfg, model=model).draft_size for m, cfg in cfgs.items()} == \
        {m: edge(m, g) for m, g in own.items()}


def test_a_calibration_is_not_taken_for_another_dtype_backend_threads_or_tree(cache_dir, tiny):
    model, _ = tiny
    eagle = SpecConfig.preset("eagle", **CALIBRATED["eagle"])
    calib.save_calibration(calib.model_key(model, eagle), {"g_star": 6})
    at6 = 7 if pads_rows(model) else 6                                       # 6 at its row bucket's edge, if any
    assert resolve_config(eagle, model=model).draft_size == at6
    for change in (dict(backend="hf"), dict(fixed_shape=False), dict(verify_rows=16), dict(eagle_depth=3),
                   dict(eagle_topk=4), dict(vocab="microspec")):
        with pytest.warns(UserWarning, match="no calibrated draft size for eagle"):
            # the uncalibrated default, within the rows of a fixed-shape forward (engine.target.max_tree_nodes)
            expect = min(UNCALIBRATED["eagle"], change.get("verify_rows", 10 ** 9) - 1)
            cfg = eagle.replace(**change)
            assert resolve_config(cfg, model=model).draft_size == bucket_edge(cfg, model, expect), change
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert calib.model_key(half, eagle).split("|")[2] == "bfloat16"
    with pytest.warns(UserWarning, match="no calibrated draft size for eagle"):
        assert resolve_config(eagle, model=half).draft_size == UNCALIBRATED["eagle"]
    threads = torch.get_num_threads()
    try:                                                    # a CPU's key holds its thread count
        torch.set_num_threads(threads + 1)
        with pytest.warns(UserWarning, match="no calibrated draft size for eagle"):
            assert resolve_config(eagle, model=model).draft_size == UNCALIBRATED["eagle"]
    finally:
        torch.set_num_threads(threads)
    assert resolve_config(eagle, model=model).draft_size == at6


def test_the_missing_calibration_warning_names_the_command_once(cache_dir, tiny):
    """One warning per key, naming the command that makes exactly the missing record: its --set options
    give back the same key."""
    model, _ = tiny
    cfg = SpecConfig.preset("eagle", **CALIBRATED["eagle"])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            assert resolve_config(cfg, model=model).draft_size == 59
    msgs = [str(x.message) for x in w if "no calibrated draft size" in str(x.message)]
    assert len(msgs) == 1
    cmd = calib.calibrate_command(cfg, model)
    assert cmd in msgs[0] and msgs[0].endswith("using eagle's uncalibrated default g = 59")
    args = shlex.split(cmd)
    assert args[:3] == ["python", "-m", "specvocab.engine.jobs.calibrate"]
    opts = dict(zip(args[3::2], args[4::2]))
    assert opts["--model"] == calib.model_id(model) and opts["--method"] == "eagle"
    assert (opts["--device"], opts["--dtype"], opts["--threads"]) == ("cpu", "float32", str(torch.get_num_threads()))
    sets = parse_overrides([v for k, v in zip(args[3::2], args[4::2]) if k == "--set"])
    assert sets == CALIBRATED["eagle"]
    assert calib.model_key(model, SpecConfig.preset("eagle", **sets)) == calib.model_key(model, cfg)
    with pytest.raises(calib.CalibrationError, match="drafts nothing"):
        calib.resolve_draft_size(SpecConfig.preset("ar"), model)
    assert resolve_config(SpecConfig.preset("ar"), model=model).draft_size is None


def test_grids_stay_within_what_each_method_and_target_can_draft(cache_dir, tiny):
    model, _ = tiny                                          # a llama: the native fixed-shape path
    assert cal.max_draft_size(SpecConfig.preset("recycling"), model) == 80
    assert cal.max_draft_size(SpecConfig.preset("eagle", eagle_depth=3, eagle_topk=4)) == 4 + 16 * 2
    assert cal.max_draft_size(SpecConfig.preset("layerskip", eagle_depth=1, eagle_topk=6)) == 6
    assert cal.max_draft_size(SpecConfig.preset("unispec", store_k=3, tree_depth=2)) == 2 * 3 + 9
    assert cal.max_draft_size(SpecConfig.preset("pld")) is None
    assert cal.max_draft_size(SpecConfig.preset("pld"), model) is None   # a chain of any depth verifies (tail_blocks)
    assert cal.max_draft_size(SpecConfig.preset("pld", backend="hf"), model) is None
    assert cal.max_draft_size(SpecConfig.preset("hf-prompt-lookup"), model) is None
    assert cal.max_draft_size(SpecConfig.preset("unispec", verify_rows=8), model) == 7
    for method in calib.DRAFTING_METHODS:                    # every default grid fits its method's default config
        cap = cal.max_draft_size(SpecConfig.preset(method), model)
        for device in ("cpu", "cuda"):
            grid = calib.default_grid(method, device)
            assert len(grid) >= 4 and (cap is None or max(grid) <= cap), (method, device, grid, cap)
    # no depth bound: a pld chain deeper than a block verifies in one fixed-shape forward
    prompt = torch.cat([torch.arange(20, 60)] * 3)
    generate(model, prompt, method="pld", max_new_tokens=40, draft_size=BLOCK + 8, eos_ids=[])
    # a grid point above the bound (fixed verify_rows=8: 7 draft nodes) is dropped, with a warning, instead of
    # failing the calibration
    with pytest.warns(UserWarning, match="at most 7 draft tokens"):
        rec = cal.calibrate(model, _repetitive_prompts(), "pld", grid=[2, 4, 40],
                            cfg=SpecConfig.preset("pld", max_new_tokens=8, verify_rows=8), eos_ids=[], save=False,
                            progress=False)
    assert [r["g"] for r in rec["rows"]] == [2, 4]
    with pytest.raises(calib.CalibrationError, match="drafts nothing"):
        cal.calibrate(model, _repetitive_prompts(), "ar", grid=[1, 2], eos_ids=[], save=False, progress=False)


def test_frspec_is_calibrated_on_its_default_ranking_and_keyed_as_a_bench_resolves_it(cache_dir, tiny, monkeypatch):
    """A bench resolves the draft size with frequency_file None and only then fills in the default ranking;
    the calibration runs on that ranking and keys the record with None, so the bench finds it."""
    model, info = tiny
    ranking = []
    monkeypatch.setattr(frspec_lists, "default_frequency_file", lambda tok, name, vocab, eos_ids=(): ranking.append(vocab)
                        or "ranking.pt")
    ran = []
    monkeypatch.setattr(cal, "measure_grid", lambda model, prompts, method, grid, cfg, **kw: ran.append(cfg) or [
        {"g": g, "tau": 1 + g / 4, "s_step": 0.01 * (1 + g / 8), "s_forward": 0.01} for g in grid])
    cfg = SpecConfig.preset("layerskip", drafter_layers="all", vocab="frspec")
    with pytest.raises(calib.CalibrationError, match="tokenizer= and info="):
        cal.calibrate(model, [torch.arange(5)], "layerskip", grid=[1, 2, 3], cfg=cfg, eos_ids=[], progress=False)
    rec = cal.calibrate(model, [torch.arange(5)], "layerskip", grid=[1, 2, 3], cfg=cfg, eos_ids=[], progress=False,
                        tokenizer=None, info=info)
    assert ranking == [300] and ran[-1].frequency_file == "ranking.pt"
    assert rec["ran_with"] == {"frequency_file": "ranking.pt"}
    assert rec["config"]["frequency_file"] is None and rec["key"] == calib.model_key(model, cfg)
    assert resolve_config(cfg, model=model).draft_size == rec["g_star"]


def test_cli_calibrates_eagle_end_to_end(cache_dir, capsys):
    """`python -m specvocab.engine.jobs.calibrate --method eagle` measures the grid through the harness, fits, prints and caches
    the record under eagle's key, where resolve_config finds it."""
    overrides = ["eagle_head=random", "eagle_depth=2", "eagle_topk=3"]
    cal.main(["--model", "random-llama", "--method", "eagle", "--dtype", "fp32", "--grid", "1,2,3", "--prompts", "2",
              "--warmup", "1", "--max-new-tokens", "8", "--no-compare", *(x for o in overrides for x in ("--set", o))])
    (key, rec), = calib.load_calibrations().items()
    assert key.split("|")[3] == "eagle" and rec["method"] == "eagle" and [r["g"] for r in rec["rows"]] == [1, 2, 3]
    printed = capsys.readouterr().out
    assert f"g* (default pipeline: {rec['mode']}, step time) = {rec['g_star']}" in printed
    model = load_model("random-llama", dtype="fp32")[0]
    assert rec["dtype"] == "float32"
    eagle = SpecConfig.preset("eagle", **parse_overrides(overrides))
    assert resolve_config(eagle, model=model).draft_size == rec["g_star"]
    with pytest.raises(SystemExit):
        cal.main(["--model", "random-llama", "--method", "ar"])


def test_a_draft_size_runs_at_its_row_buckets_largest_tree(cache_dir, tiny):
    """`engine.harness.bucket_edge`: on the CPU's per-step row buckets a tree of g + 1 nodes costs its
    bucket's forward, so a calibrated or default g runs at the bucket's largest tree, within what the method
    can draft; where rows are fixed or not bucketed (hf, verify_rows, fixed_shape=False) g stays.
    Mutants checked: no raise (the 2 -> 3 assert), raising past the method's cap (recycling, pld), raising
    on the hf backend or at fixed rows."""
    model, _ = tiny
    uni = SpecConfig.preset("unispec", cpu_kernels=False)              # fp32 on oneDNN: every step padded
    assert [bucket_edge(uni, model, g) for g in (1, 2, 3, 4, 7, 8, 16)] == [3, 3, 3, 7, 7, 15, 31]
    if not pads_rows(model):                                           # the fp32 kernel: unpadded, g stays
        assert [bucket_edge(uni.replace(cpu_kernels=True), model, g) for g in (1, 2, 3, 4, 7)] == [1, 2, 3, 4, 7]
    for change in (dict(backend="hf"), dict(verify_rows=16), dict(fixed_shape=False)):
        assert bucket_edge(uni.replace(**change), model, 5) == 5, change
    padded = dict(cpu_kernels=False)
    assert bucket_edge(SpecConfig.preset("recycling", **padded), model, 70) == 80   # its template's 80 nodes
    assert bucket_edge(SpecConfig.preset("pld", **padded), model, 20) == BLOCK - 1  # its bucket's edge: 32 rows
    calib.save_calibration(calib.model_key(model, uni), {"g_star": 2})
    assert resolve_config(uni, model=model).draft_size == 3
    assert resolve_config(uni.replace(draft_size=2), model=model).draft_size == 2   # a size given is kept
