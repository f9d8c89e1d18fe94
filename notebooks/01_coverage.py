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
#   never on the traces being scored. A facet row per model, a column per task; a window that never fills
#   gives the same point at two `w_max`: one star, labelled "3072 = 8192".
# * **lru_vs_fifo** — the miss ratio of an LRU vocabulary of C tokens against MicroSpec's FIFO window of the
#   same mean size (`locality.miss_ratio_curves`), a facet row per model.
#
# Coverage and miss ratio are token-weighted: generated tokens inside (outside) the vocabulary over all
# generated tokens of the task, its prompts pooled; each panel names the tokens it rests on.
#
# The window's stream is the papers' default (prompt, prefill top-3, verify top-3, MicroSpec §3.2) when the
# sweep has it. Run with `python -m specvocab.sweeps.render DIR`, or set `results_dir` below.

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

# %% [markdown]
# ## Coverage vs vocabulary size: dynamic window against static shortlists (MicroSpec Fig. 1b)

# %%
table = tables.coverage_vs_vocab(coverage)
chart = charts.coverage_vs_vocab(table, coverage, record)
if chart is not None:
    charts.save_chart(chart, out_dir, "coverage_vs_vocab")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# Per task: the smallest static shortlist and the smallest window reaching 90 % coverage (coverage
# token-weighted: generated tokens inside the vocabulary / all generated tokens of the task, its prompts pooled).

# %%
if table is not None:
    display(table.filter(pl.col("coverage") >= 0.9).group_by("model", "prompt_set", "task", "series")  # noqa: F821
            .agg(pl.col("vocab").min().round(0).alias("vocab at 90 %")).sort("model", "prompt_set", "task", "series"))

# %% [markdown]
# ## LRU vocabulary vs FIFO window at equal mean size

# %%
miss = tables.miss_ratios(coverage)
chart = charts.lru_vs_fifo(miss, coverage, record)
if chart is not None:
    charts.save_chart(chart, out_dir, "lru_vs_fifo")
    display(chart)  # noqa: F821 (IPython)
