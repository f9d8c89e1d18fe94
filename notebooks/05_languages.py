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
# # 05 · Temporal locality across languages
# Reads a sweep's `coverage` cells on the multilingual prompt set (7 languages, one cell per language) with
# `sweeps.load` and draws:
#
# * **reuse_distance_by_language** — the distribution of reuse distances of generated tokens: how many
#   stream entries back a token last appeared (power-of-two bins, `locality.distance_histograms`), as the
#   share per bin and cumulatively. The cumulative share at distance d is the coverage of a FIFO window of
#   w_max = d; what stays below 100 % are tokens never seen before. Two streams: the generated tokens alone,
#   and MicroSpec's candidate stream (prompt, prefill top-k, verify top-k, §3.2).
# * **coverage_by_language** — the window's coverage per language against w_max, and against the
#   vocabulary size beside the static top-K shortlists ranked on the (English-heavy) training corpus.

# %% tags=["parameters"]
results_dir = "results/quick"    # relative: under $SPECVOCAB_RESULTS, else the checkout's root
out_dir = ""                     # default: {results_dir}/figures

# %%
# %load_ext autoreload
# %autoreload 2
import polars as pl

from specvocab.sweeps import charts, tables

results_dir = tables.results_path(results_dir, kinds=("coverage",))
out_dir = str(tables.results_path(out_dir or f"{results_dir}/figures"))
record = tables.read(results_dir, "record", tables.RECORD_COLUMNS)
coverage = tables.read(results_dir, "coverage")
multilingual = tables.languages_only(coverage, "temporal locality across languages")

# %% [markdown]
# ## Reuse distances per language

# %%
dist = tables.distances(multilingual)
chart = charts.reuse_distance_by_language(dist, multilingual, record)
if chart is not None:
    charts.save_chart(chart, out_dir, "reuse_distance_by_language")
    display(chart)  # noqa: F821 (IPython)
    reuse = dist.filter(pl.col("metric") == "reuse_distance")
    display(reuse.group_by("panel", "stream").agg(pl.col("new_fraction").first().alias("never seen before"))
            .sort("stream", "panel"))  # noqa: F821 (IPython)

# %% [markdown]
# ## Coverage per language: against w_max, and against vocabulary size beside static shortlists

# %%
by_lang = tables.window_coverage(multilingual, by=("task",))
vocab = tables.coverage_vs_vocab(multilingual)
if by_lang is not None and vocab is not None:
    chart = charts.coverage_by_language(by_lang, vocab, multilingual, record)
    charts.save_chart(chart, out_dir, "coverage_by_language")
    display(chart)  # noqa: F821 (IPython)
