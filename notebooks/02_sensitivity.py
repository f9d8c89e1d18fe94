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
# # 02 · Sensitivity to the window size w_max and to the stream's k_pre, k_ver
# Reads a sweep's `coverage` cells (model-free) and `bench` cells with `sweeps.load` and draws:
#
# * **wmax_sensitivity** — MicroSpec Fig. 5: end-to-end tokens/s (solid green, left axis) and tau (dashed
#   blue, right axis) of the drafter with MicroSpec's window against `w_max` (1024 ... 8192; the star marks
#   the paper's default 3072, the dotted line the same drafter with the full vocabulary), beside the window's
#   coverage against `w_max`: measured on the traces (coverage cells) and on the bench's own drafts.
# * **kpre_kver_sensitivity** — the window's coverage and mean active vocabulary against `w_max` for every
#   (k_pre, k_ver) of the coverage grid: how many of the target's top-k rows (prefill, verify) enter the
#   candidate stream (MicroSpec §3.2, Eq. 4).

# %% tags=["parameters"]
results_dir = "results/quick"
out_dir = ""                     # default: {results_dir}/figures

# %%
# %load_ext autoreload
# %autoreload 2
import altair as alt
import polars as pl

from sweeps import figures as fig

out_dir = out_dir or f"{results_dir}/figures"
record = fig.read(results_dir, "record", fig.RECORD_COLUMNS)
coverage = fig.read(results_dir, "coverage")
bench = fig.read(results_dir, "bench")

# %% [markdown]
# ## w_max: coverage, tau and tokens/s (MicroSpec Fig. 5)

# %%
sweep = fig.wmax_sweep(bench)
window = fig.window_coverage(coverage)
panels = []
if window is not None:
    cov_long = window.select("prompt_set", "w_max", "coverage", source=pl.lit("traces (coverage cells)"))
    if sweep is not None:
        cov_long = pl.concat([cov_long, sweep.select("prompt_set", "w_max", pl.col("draft_coverage").alias("coverage"),
                                                     source=pl.lit("bench drafts"))], how="vertical_relaxed")
    panels.append(alt.Chart(cov_long).mark_line(point=True).encode(
        x=fig.log2_axis("w_max:Q", "w_max (candidate-stream entries)", ticks=fig.POW2),
        y=alt.Y("coverage:Q", title="coverage of generated tokens", axis=alt.Axis(format="%"),
                scale=alt.Scale(zero=False)),
        color=alt.Color("prompt_set:N", title="prompt set", scale=fig.color_scale(cov_long["prompt_set"].n_unique())),
        strokeDash=alt.StrokeDash("source:N", title="measured on", scale=alt.Scale(
            domain=["traces (coverage cells)", "bench drafts"], range=[[1, 0], [6, 4]]), legend=fig.stroke_legend()),
        tooltip=["prompt_set", "source", "w_max", alt.Tooltip("coverage:Q", format=".1%")])
        .properties(width=300, height=220, title="window coverage"))
if sweep is not None:
    base = alt.Chart(sweep).encode(x=fig.log2_axis("w_max:Q", "w_max (candidate-stream entries)",
                                                   ticks=sorted(sweep["w_max"].unique())))
    tip = ["prompt_set", "drafter", "w_max", alt.Tooltip("tokens_per_s:Q", format=".1f"),
           alt.Tooltip("tau:Q", format=".2f"), alt.Tooltip("full_tokens_per_s:Q", format=".1f"), "rows"]
    speed = base.mark_line(color="#2ca02c", strokeWidth=2.5, point=alt.OverlayMarkDef(color="#2ca02c")).encode(
        y=alt.Y("tokens_per_s:Q", title="tokens/s (solid)", scale=alt.Scale(zero=False),
                axis=alt.Axis(titleColor="#2ca02c")), tooltip=tip)
    best = base.transform_filter(alt.datum.default).mark_point(
        shape="diamond", size=180, filled=True, color="#2ca02c").encode(y="tokens_per_s:Q", tooltip=tip)
    full = alt.Chart(sweep).mark_rule(color="#2ca02c", strokeDash=[2, 2], opacity=0.8).encode(
        y="mean(full_tokens_per_s):Q")
    tau = base.mark_line(color="#1f77b4", strokeDash=[6, 4], strokeWidth=2.5,
                         point=alt.OverlayMarkDef(color="#1f77b4")).encode(
        y=alt.Y("tau:Q", title="tau, tokens per step (dashed)", scale=alt.Scale(domainMin=1),
                axis=alt.Axis(titleColor="#1f77b4", orient="right")), tooltip=tip)
    # one panel per prompt set and drafter: Vega-Lite cannot facet layers with independent y axes
    keys = sweep.select("prompt_set", "drafter").unique().sort("prompt_set", "drafter").rows()
    panels += [alt.layer(alt.layer(speed, full, best), tau)
               .transform_filter((alt.datum.prompt_set == s) & (alt.datum.drafter == d))
               .resolve_scale(y="independent").properties(width=300, height=220, title=f"{d} on {s}")
               for s, d in keys]
if panels:
    notes = "left: the window's coverage"
    if sweep is not None:
        notes += ("; right: tokens/s (solid green, left axis) and tau (dashed blue, right axis) of the drafter with "
                  "MicroSpec's window; diamond: the paper's default w_max 3072")
        if sweep["full_tokens_per_s"].is_not_null().any():
            notes += "; dotted green: the same drafter, full vocabulary"
    chart = alt.hconcat(*panels).resolve_scale(color="independent", strokeDash="independent").properties(
        title=fig.title("Sensitivity to the window size w_max (MicroSpec Fig. 5)",
                        bench if sweep is not None else coverage, record, notes=[notes]))
    fig.save_chart(chart, out_dir, "wmax_sensitivity")
    display(chart)  # noqa: F821 (IPython)
if sweep is not None:
    display(sweep)  # noqa: F821 (IPython)

# %% [markdown]
# ## k_pre and k_ver: how much of the target's top-k enters the stream

# %%
grid = fig.window_coverage(coverage, at_default=False)
if grid is not None:
    enc = dict(x=fig.log2_axis("w_max:Q", "w_max (candidate-stream entries)", ticks=fig.POW2),
               color=alt.Color("k_pre:O", title="k_pre", scale=alt.Scale(scheme="dark2")),
               strokeDash=alt.StrokeDash("k_ver:O", title="k_ver", legend=fig.stroke_legend()),
               detail="stream:N",
               tooltip=["prompt_set", "stream", "w_max", alt.Tooltip("coverage:Q", format=".1%"),
                        alt.Tooltip("mean_active_vocab:Q", format=".0f")])
    facet = alt.Column("prompt_set:N", title=None, header=alt.Header(labelFontWeight="bold"))
    cov_chart = alt.Chart(grid).mark_line(point=True).encode(
        y=alt.Y("coverage:Q", title="coverage of generated tokens", axis=alt.Axis(format="%"),
                scale=alt.Scale(zero=False)), **enc).properties(width=260, height=200).facet(column=facet)
    vocab_chart = alt.Chart(grid).mark_line(point=True).encode(
        y=alt.Y("mean_active_vocab:Q", title="mean active vocabulary (tokens)", scale=alt.Scale(type="log")),
        **enc).properties(width=260, height=200).facet(column=facet)
    chart = alt.vconcat(cov_chart, vocab_chart).properties(title=fig.title(
        "Window coverage and size for each k_pre, k_ver", coverage, record,
        notes=["k_pre: top-k rows of the prefill that enter the stream; k_ver: top-k rows of each verify step "
               "(MicroSpec §3.2)"]))
    fig.save_chart(chart, out_dir, "kpre_kver_sensitivity")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# Where the bench grid itself varied k_pre or k_ver (`params = { k_pre = [1, 3] }`), their tau and tokens/s:

# %%
ks = fig.k_sweep(bench)
if ks is not None:
    display(ks)  # noqa: F821 (IPython)
