# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · UniSpec: confidence scores, the device-aware draft size g*, speedup per language
# Reads a sweep's `bench` and `calibrate` cells with `sweeps.load` and draws:
#
# * **acceptance_vs_confidence** — UniSpec Fig. 3: the acceptance rate of draft nodes against their
#   confidence score (line, left axis) and the sample density, the share of all drafted nodes in each score
#   bin (bars, right axis, one scale in every panel), counted in every bench step (`score_bins_proposed`,
#   `score_bins_accepted`); a row per model; a bin's rate is drawn from 30 nodes and 0.5% of the panel's up.
# * **calibration_fits** — UniSpec App. F: the measured tau(g), step time s(g) and tau/s on the calibration
#   grid (points) with their fits (lines: cubic tau, B-spline s) and g*, the maximiser of tau/s (star).
# * **g_star_by_device** — UniSpec Fig. 5: the calibrated g* per model, method and device.
# * **speedup_by_language** — UniSpec Fig. 4: speedup over ar and tau per language (multilingual set; not
#   drawn, with one line saying why, for a sweep without a set split by language).

# %% tags=["parameters"]
results_dir = "results/quick"    # relative: under $SPECVOCAB_RESULTS, else the checkout's root
out_dir = ""                     # default: {results_dir}/figures

# %%
# %load_ext autoreload
# %autoreload 2
from specvocab.sweeps import charts, tables

results_dir = tables.results_path(results_dir, kinds=("bench", "calibrate"))
out_dir = str(tables.results_path(out_dir or f"{results_dir}/figures"))
bench = tables.read(results_dir, "bench")
calibrate = tables.read(results_dir, "calibrate")

# %% [markdown]
# ## Acceptance rate against confidence score, with sample density (UniSpec Fig. 3)

# %%
conf = tables.confidence_bins(bench)
chart = charts.acceptance_vs_confidence(conf, bench)
if chart is not None:
    charts.save_chart(chart, out_dir, "acceptance_vs_confidence")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## The calibration: tau(g), s(g), tau/s and g* (UniSpec App. F)

# %%
curves = tables.calibration_curves(calibrate)
chart = charts.calibration_fits(curves, calibrate, bench)
if chart is not None:
    charts.save_chart(chart, out_dir, "calibration_fits")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## g* per device (UniSpec Fig. 5)

# %%
stars = tables.g_stars(calibrate)
chart = charts.g_star_by_device(stars, calibrate)
if chart is not None:
    display(stars)  # noqa: F821 (IPython)
    charts.save_chart(chart, out_dir, "g_star_by_device")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## Speedup over ar per language (UniSpec Fig. 4)

# %%
langs = tables.language_speedup(tables.method_summary(bench))
chart = charts.speedup_by_language(langs, bench)
if chart is not None:
    charts.save_chart(chart, out_dir, "speedup_by_language")
    display(chart)  # noqa: F821 (IPython)
