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
import altair as alt

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
if curves is not None:
    settings = curves["setting"].unique(maintain_order=True).to_list()
    # above 20 settings a second channel: the fits' dash (`charts.series_channels`)
    series = charts.series_channels("setting", settings, "model · method · device", orient="bottom",
                                    direction="vertical", labelLimit=600)
    base = alt.Chart(curves).encode(x=alt.X("g:Q", title="draft size g (nodes per step, root excluded)"),
                                    color=series.pop("color"))
    tip = ["setting", "curve", alt.Tooltip("g:Q", format=".1f"), alt.Tooltip("value:Q", format=".3f"), "g_star"]
    fit = base.transform_filter(alt.datum.curve == "fit").mark_line(strokeWidth=2).encode(
        y=alt.Y("value:Q", scale=alt.Scale(zero=False)), detail="setting:N", **series)
    measured = base.transform_filter(alt.datum.curve == "measured").mark_point(size=60, filled=True).encode(
        y="value:Q", tooltip=tip)
    star = base.transform_filter(alt.datum.curve == "g_star").mark_point(
        shape="diamond", size=220, filled=True, stroke="black", strokeWidth=1).encode(y="value:Q", tooltip=tip)
    # the y title of each panel: its quantity with its unit (tokens per step, ms per step, tokens per second)
    chart = alt.hconcat(*[alt.layer(fit.encode(y=alt.Y("value:Q", title=q, scale=alt.Scale(zero=False))),
                                    measured, star).transform_filter(alt.datum.quantity == q)
                          .properties(width=260, height=200, title=q) for q in tables.QUANTITIES.values()]
                        ).properties(title=charts.title(
        "Device-aware calibration: measured and fitted tau(g), s(g), tau/s; g* maximises tau/s (UniSpec App. F)",
        calibrate, notes=["points: measured on the calibration prompts; lines: the fits; "
                          "diamond: g* as it runs (on a CPU: at its row bucket's largest tree)"]))
    charts.save_chart(chart, out_dir, "calibration_fits")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## g* per device (UniSpec Fig. 5)

# %%
stars = tables.g_stars(calibrate)
if stars is not None:
    display(stars)  # noqa: F821 (IPython)
    base = alt.Chart(stars).encode(
        x=alt.X("device:N", title="device (torch threads in the name on CPUs)", axis=alt.Axis(labelAngle=0,
                                                                                               labelLimit=300)),
        xOffset="setting:N", y=alt.Y("g_star:Q", title="g* (draft nodes per step)"),
        color=alt.Color("setting:N", title="model · method · device", scale=charts.color_scale(stars.height),
                        legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=600)))
    chart = alt.layer(base.mark_bar(), base.mark_text(dy=-8, fontSize=13).encode(text="g_star:Q")).properties(
        width=alt.Step(60), height=220, title=charts.title("Calibrated optimal draft size g* per device (UniSpec Fig. 5)",
                                                        calibrate))
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
