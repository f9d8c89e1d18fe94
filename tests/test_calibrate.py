"""Device-aware calibration: fits on synthetic curves with a known optimum, the cache, the EAGLE anchor,
and one small measurement through the harness on a random model."""

import json
import warnings

import numpy as np
import polars as pl
import pytest
import torch

from engine import calibrate as cal
from engine.config import SpecConfig
from engine.models import load_model


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
    fit = cal.optimal_draft_size(grid, tau, s, mode="de")
    assert lo < g_star < hi
    assert abs(fit.g_star - g_star) <= 0.08 * (hi - lo), (fit, g_star)
    # the fitted throughput at g* is within 1.5% of the true maximum throughput
    best = tau_fn(g_star) / s_fn(g_star)
    assert tau_fn(fit.g_star) / s_fn(fit.g_star) >= 0.985 * best


def test_de_on_the_uneven_cpu_grid():
    """The CPU grid is uneven; with noisy step times the spline must not swing (it did with uniform knots)."""
    tau_fn = lambda g: 1 + 1.0 * (1 - np.exp(-g / 8))
    s_fn = lambda g: 0.075 + 0.0032 * g - 0.03 * np.exp(-g)          # a jump from 1 to 2 nodes, then linear
    grid = np.array(cal.DEFAULT_GRIDS["cpu"], dtype=float)
    g_star = true_optimum(tau_fn, s_fn, grid[0], grid[-1])
    rng = np.random.default_rng(3)
    for trial in range(5):
        s = s_fn(grid) * (1 + 0.05 * rng.standard_normal(grid.size))       # 5% timing noise
        fit = cal.optimal_draft_size(grid, tau_fn(grid), s, mode="de")
        assert fit.mode == "de"
        assert float(cal.fit_step_time(grid, s)(np.linspace(1, 32, 300)).min()) > 0.5 * s.min()
        assert tau_fn(fit.g_star) / s_fn(fit.g_star) >= 0.93 * tau_fn(g_star) / s_fn(g_star), (trial, fit)


def test_unusable_fit_falls_back_to_grid():
    g = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32], dtype=float)
    s = np.array([.149, .152, .108, .133, .146, .120, .139, .187, .237, .271])   # measured under load
    tau = np.array([1.09, 1.23, 1.29, 1.36, 1.50, 1.56, 1.68, 1.83, 1.93, 1.98])
    with pytest.warns(UserWarning, match="too noisy"):
        fit = cal.optimal_draft_size(g, tau, s, knots="uniform")
    assert fit.mode == "grid-fallback" and fit.g_star == 8
    assert cal.optimal_draft_size(g, tau, s).mode == "de"              # quantile knots cope


@pytest.mark.parametrize("name", sorted(CURVES))
def test_grid_mode_picks_best_measured_point(name):
    tau_fn, s_fn, lo, hi = CURVES[name]
    grid = np.linspace(lo, hi, 10).round()
    fit = cal.optimal_draft_size(grid, tau_fn(grid), s_fn(grid), mode="grid")
    g_star = true_optimum(tau_fn, s_fn, lo, hi)
    spacing = (hi - lo) / 9
    assert abs(fit.g_star - g_star) <= spacing
    assert fit.g_star in grid.astype(int).tolist()
    assert fit.predicted_tokens_per_s == pytest.approx(max(tau_fn(grid) / s_fn(grid)))


def test_fits_reproduce_smooth_curves():
    g = np.arange(16, 161, 16, dtype=float)
    s = 0.02 + 1e-6 * (g - 40) ** 2
    f_s = cal.fit_step_time(g, s)
    gg = np.linspace(16, 160, 50)
    np.testing.assert_allclose(f_s(gg), 0.02 + 1e-6 * (gg - 40) ** 2, rtol=1e-6)   # quadratic: exact
    tau = 1 + 0.03 * g - 1e-4 * g ** 2 + 2e-7 * g ** 3
    np.testing.assert_allclose(cal.fit_tau(g, tau)(gg), 1 + 0.03 * gg - 1e-4 * gg ** 2 + 2e-7 * gg ** 3, rtol=1e-8)


def test_few_points_still_fit():
    fit = cal.optimal_draft_size([4, 8, 16], [1.5, 1.8, 1.9], [0.06, 0.07, 0.1])
    assert 4 <= fit.g_star <= 16
    one = cal.optimal_draft_size([8], [1.7], [0.07])
    assert one.g_star == 8


def test_errors():
    with pytest.raises(cal.CalibrationError, match="empty"):
        cal.optimal_draft_size([], [], [])
    with pytest.raises(cal.CalibrationError, match="positive"):
        cal.optimal_draft_size([0, 4, 8], [1, 1.5, 1.7], [0.05, 0.06, 0.07])
    with pytest.raises(cal.CalibrationError, match="positive"):
        cal.optimal_draft_size([2, 4, 8], [1, 1.5, 1.7], [0.05, -0.06, 0.07])
    with pytest.raises(cal.CalibrationError, match="mode"):
        cal.optimal_draft_size([2, 4], [1, 1.5], [0.05, 0.06], mode="bayes")
    with pytest.raises(cal.CalibrationError, match="one per size"):
        cal.optimal_draft_size([2, 4], [1], [0.05, 0.06])


def test_eagle_heuristic():
    lin = {n: 0.001 * n for n in cal.EAGLE_CANDIDATES}           # CPU-like: time grows with n
    assert cal.eagle_total_token(lin) == 40
    flat = {n: 0.03 for n in cal.EAGLE_CANDIDATES}               # GPU-like: flat -> the prior gain wins
    assert cal.eagle_total_token(flat) == 60
    knee = {40: 0.030, 48: 0.0305, 50: 0.031, 56: 0.0345, 60: 0.036}
    assert cal.eagle_total_token(knee) == 50                    # 0.031 / 1.07 is the smallest ratio
    with pytest.raises(cal.CalibrationError, match="no forward time"):
        cal.eagle_total_token({40: 0.1})


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def tiny():
    model, _, info = load_model("random-llama", vocab_size=300, hidden_size=32, num_layers=1)
    return model, info


def test_cache_round_trip_and_resolve(cache_dir, tiny):
    model, info = tiny
    cfg = SpecConfig.preset("unispec")
    key = cal.model_key(model, "unispec")
    assert key.startswith("llama-V300-d32-L1|cpu:") and key.endswith("|float32|unispec")
    assert cal.cached_draft_size(key) is None
    with pytest.raises(cal.CalibrationError, match="engine.calibrate"):
        cal.resolve_draft_size(cfg, model, on_missing="error")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert cal.resolve_draft_size(cfg, model) == cal.FALLBACK_DRAFT_SIZE["cpu"]
    assert any("no calibrated draft size" in str(x.message) for x in w)
    path = cal.save_calibration(key, {"g_star": 13, "rows": [{"g": 13, "tau": 1.5}]})
    assert path == cache_dir / "calibration.json"
    cal.save_calibration("other|cpu|float32|recycling", {"g_star": 40})
    data = json.loads(path.read_text())
    assert data[key]["g_star"] == 13 and data["other|cpu|float32|recycling"]["g_star"] == 40
    assert cal.resolve_draft_size(cfg, model) == 13
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                      # the fallback warns once per key
        assert cal.resolve_draft_size(cfg, model, method="recycling") == cal.FALLBACK_DRAFT_SIZE["cpu"]
    assert cal.resolve_draft_size(cfg.replace(draft_size=5), model) == 5
    path.write_text("{not json")
    with pytest.raises(cal.CalibrationError, match="corrupt"):
        cal.cached_draft_size(key)


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
    assert rec["g_star"] in range(1, 5) and len(rec["rows"]) == 3
    assert cal.resolve_draft_size(cfg, model) == rec["g_star"]


def test_every_grid_point_starts_from_the_same_store(tiny, monkeypatch):
    """Round robin: each g keeps its own copy of the store, starting from the warmed-up state and
    evolving over the prompts; the deployment store is left in the warmed-up state."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (10,), generator=gen) for _ in range(2)]
    cfg = SpecConfig.preset("unispec", max_new_tokens=10)
    store = cal._store_of(model, cfg, 300)
    calls = []
    real = cal.run_prompts

    def spy(model_, prompts_, cfg_, **kw):
        before = (store.tok.clone(), store.con.clone())
        out = real(model_, prompts_, cfg_, **kw)
        calls.append((cfg_.draft_size, before, (store.tok.clone(), store.con.clone())))
        return out

    monkeypatch.setattr(cal, "run_prompts", spy)
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
    with pytest.raises(cal.CalibrationError, match="empty"):
        cal.measure_grid(model, prompts, "unispec", [], eos_ids=[], progress=False)
    with pytest.raises(cal.CalibrationError, match="positive"):
        cal.measure_grid(model, prompts, "unispec", [0, 2], eos_ids=[], progress=False)


def test_calibration_curves_frame():
    g = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    tau = [1 + 0.6 * np.log2(x + 1) for x in g]
    s = [0.05 + 0.002 * x ** 1.5 for x in g]
    rec = {"key": "m|cpu|float32|unispec", "timing": "step",
           "rows": [{"g": x, "tau": t, "s_step": st, "s_forward": st} for x, t, st in zip(g, tau, s)]}
    cur = cal.calibration_curves(rec, points=50)
    assert cur.group_by("kind").len().sort("kind").rows() == [("fit", 50), ("g_star", 1), ("measured", 10)]
    meas = cur.filter(pl.col("kind") == "measured")
    assert meas["g"].to_list() == g and np.allclose(meas["s_step_ms"].to_numpy(), np.array(s) * 1e3)
    assert np.allclose(meas["tokens_per_s"].to_numpy(), np.array(tau) / np.array(s))
    star = cur.filter(pl.col("kind") == "g_star").row(0, named=True)
    assert star["g"] == cal.optimal_draft_size(g, tau, s).g_star
    fit = cur.filter(pl.col("kind") == "fit")                  # the fitted curves pass near the measurements
    assert abs(np.interp(8, fit["g"].to_numpy(), fit["tau"].to_numpy()) - tau[5]) < 0.05


def test_calibrate_after_generate_on_the_same_model(tiny):
    """`generate` makes the deployment store inside inference mode; a later calibration (a notebook's
    next cell) must still be able to snapshot and restore it."""
    from engine.harness import generate

    model, info = tiny
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (10,), generator=gen) for _ in range(2)]
    generate(model, prompts[0], method="unispec", max_new_tokens=6, draft_size=2, eos_ids=[])
    rec = cal.calibrate(model, prompts, "unispec", grid=[1, 2], cfg=SpecConfig.preset("unispec", max_new_tokens=6),
                        eos_ids=[], save=False, progress=False)
    assert [r["g"] for r in rec["rows"]] == [1, 2]
