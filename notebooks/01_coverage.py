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
# # 01 · Coverage of the draft vocabulary against its size, per task
# Reads a sweep's `coverage` cells (model-free analyses of the `record` cells' greedy traces) with
# `sweeps.load` and draws:
#
# * **coverage_vs_vocab** — MicroSpec Fig. 1(b): the fraction of generated tokens inside the draft vocabulary
#   against its size. MicroSpec's window (stars, one per `w_max`, placed at the window's *mean active
#   vocabulary*) against FR-Spec's static top-K shortlists (dashed), ranked on the **training corpus**,
#   never on the traces being scored.
# * **lru_vs_fifo** — the miss ratio of an LRU vocabulary of C tokens against MicroSpec's FIFO window of the
#   same mean size (`locality.miss_ratio_curves`).
#
# The window's stream is the papers' default (prompt, prefill top-3, verify top-3, MicroSpec §3.2) when the
# sweep has it. Run with `python -m specvocab.sweeps.render DIR`, or set `results_dir` below.

# %% tags=["parameters"]
results_dir = "results/quick"
out_dir = ""                     # default: {results_dir}/figures

# %%
# %load_ext autoreload
# %autoreload 2
import altair as alt
import polars as pl

from specvocab.sweeps import charts, tables

out_dir = out_dir or f"{results_dir}/figures"
record = tables.read(results_dir, "record", tables.RECORD_COLUMNS)
coverage = tables.read(results_dir, "coverage")

# %% [markdown]
# ## Coverage vs vocabulary size: dynamic window against static shortlists (MicroSpec Fig. 1b)

# %%
table = tables.coverage_vs_vocab(coverage)
if table is not None:
    star = "M0,-1L0.24,-0.33L0.95,-0.31L0.39,0.12L0.59,0.81L0,0.4L-0.59,0.81L-0.39,0.12L-0.95,-0.31L-0.24,-0.33Z"
    base = alt.Chart(table).encode(
        x=charts.log2_axis("vocab:Q", "vocabulary size (tokens)"),
        y=alt.Y("coverage:Q", title="coverage of generated tokens", scale=alt.Scale(domain=[0, 1]),
                axis=alt.Axis(format="%")),
        tooltip=["panel", "series", "w_max", "k", alt.Tooltip("vocab:Q", format=".0f"),
                 alt.Tooltip("coverage:Q", format=".1%"), "tokens"])
    static = base.transform_filter(alt.datum.series == tables.STATIC).mark_line(
        strokeDash=[6, 4], color="rgb(85, 85, 85)", point=alt.OverlayMarkDef(color="rgb(85, 85, 85)", size=18)).encode(
        detail="series:N")
    window = base.transform_filter(alt.datum.series == tables.WINDOW).mark_point(
        shape=star, filled=True, size=140, opacity=0.9).encode(
        color=alt.Color("w_max:O", title="window w_max", scale=alt.Scale(scheme="viridis")))
    trail = base.transform_filter(alt.datum.series == tables.WINDOW).mark_line(color="#bbb", strokeWidth=1)
    chart = (alt.layer(static, trail, window).properties(width=170, height=130)
             .facet(facet=alt.Facet("panel:N", title=None, header=alt.Header(labelFontWeight="bold")), columns=5)
             .properties(title=charts.title(
                 "Coverage vs draft vocabulary size, per task (MicroSpec Fig. 1b)", coverage, record,
                 notes=["stars: MicroSpec's window, one per w_max, at its mean active vocabulary; dashed grey: "
                        "static top-K shortlists (FR-Spec) ranked on the training corpus"])))
    charts.save_chart(chart, out_dir, "coverage_vs_vocab")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# Per task: the smallest static shortlist and the smallest window reaching 90 % coverage.

# %%
if table is not None:
    display(table.filter(pl.col("coverage") >= 0.9).group_by("model", "prompt_set", "task", "series")  # noqa: F821
            .agg(pl.col("vocab").min().round(0).alias("vocab at 90 %")).sort("model", "prompt_set", "task", "series"))

# %% [markdown]
# ## LRU vocabulary vs FIFO window at equal mean size

# %%
miss = tables.miss_ratios(coverage)
if miss is not None:
    lines = alt.Chart(miss).mark_line(point=True).encode(
        x=charts.log2_axis("mean_active_vocab:Q", "mean active vocabulary (tokens)"),
        y=alt.Y("miss_ratio:Q", title="miss ratio", axis=alt.Axis(format="%")),
        color=alt.Color("policy:N", title=None, scale=alt.Scale(domain=[tables.LRU, tables.FIFO],
                                                                range=["#d62728", "#1f77b4"]),
                        legend=alt.Legend(orient="top", symbolType="stroke", symbolStrokeWidth=3,
                                          symbolFillColor="transparent")),
        strokeDash=alt.StrokeDash("policy:N", title=None, scale=alt.Scale(domain=[tables.LRU, tables.FIFO],
                                                                          range=[[6, 3], [1, 0]])),
        tooltip=["panel", "policy", "capacity", "w_max", alt.Tooltip("mean_active_vocab:Q", format=".0f"),
                 alt.Tooltip("miss_ratio:Q", format=".1%")])
    # LRU's dashes drawn over FIFO's solid line: where the two coincide both stay visible
    fifo, lru = (lines.transform_filter(alt.datum.policy == name) for name in (tables.FIFO, tables.LRU))
    chart = (alt.layer(fifo, lru).properties(width=170, height=130)
             .facet(facet=alt.Facet("panel:N", title=None, header=alt.Header(labelFontWeight="bold")), columns=5)
             .properties(title=charts.title(
                 "Miss ratio per task: LRU vocabulary vs FIFO window at equal mean size", coverage, record,
                 notes=["LRU: the C most recently used tokens of the candidate stream; FIFO: MicroSpec's window, "
                        "its w_max chosen to match the LRU's mean active vocabulary; where the curves coincide "
                        "the red dashes lie on the blue line"])))
    charts.save_chart(chart, out_dir, "lru_vs_fifo")
    display(chart)  # noqa: F821 (IPython)
