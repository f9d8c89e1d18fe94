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
# * **wmax_sensitivity** — MicroSpec Fig. 5, a row per model: the window's coverage against `w_max` (measured
#   on the traces of the coverage cells and on the bench's own drafts; token-weighted, every task pooled), then
#   end-to-end tokens/s and tau of the drafter with MicroSpec's window against `w_max` (solid; the diamond marks
#   the paper's default 3072), the same drafter with the full vocabulary (dashed) and ar (dotted), axes from 0.
# * **kpre_kver_sensitivity** — the window's coverage and mean active vocabulary against `w_max` for every
#   (k_pre, k_ver) of the coverage grid: how many of the target's top-k rows (prefill, verify) enter the
#   candidate stream (MicroSpec §3.2, Eq. 4).

# %% tags=["parameters"]
results_dir = "results/quick"    # relative: under $SPECVOCAB_RESULTS, else the checkout's root
out_dir = ""                     # default: {results_dir}/figures

# %%
# %load_ext autoreload
# %autoreload 2
from specvocab.sweeps import charts, tables

results_dir = tables.results_path(results_dir, kinds=("coverage", "bench"))
out_dir = str(tables.results_path(out_dir or f"{results_dir}/figures"))
record = tables.read(results_dir, "record", tables.RECORD_COLUMNS)
coverage = tables.read(results_dir, "coverage")
bench = tables.read(results_dir, "bench")

# %% [markdown]
# ## w_max: coverage, tau and tokens/s (MicroSpec Fig. 5)

# %%
sweep = tables.wmax_sweep(bench)
window = tables.window_coverage(coverage)
chart = charts.wmax_sensitivity(window, sweep, bench, coverage, record)
if chart is not None:
    charts.save_chart(chart, out_dir, "wmax_sensitivity")
    display(chart)  # noqa: F821 (IPython)
if sweep is not None:
    print("tokens_per_s: mean over the bench turns of every task; tau: new tokens / steps and draft_coverage: "
          "token-weighted, every task pooled")
    display(sweep)  # noqa: F821 (IPython)

# %% [markdown]
# ## k_pre and k_ver: how much of the target's top-k enters the stream

# %%
grid = tables.window_coverage(coverage, at_default=False)
if grid is not None:
    chart = charts.kpre_kver_sensitivity(grid, coverage, record)
    charts.save_chart(chart, out_dir, "kpre_kver_sensitivity")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# Where the bench grid itself varied k_pre or k_ver (`params = { k_pre = [1, 3] }`), their tau and tokens/s:

# %%
ks = tables.k_sweep(bench)
if ks is not None:
    display(ks)  # noqa: F821 (IPython)
