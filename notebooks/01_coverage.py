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
# # 01 · Coverage and temporal locality of recorded traces
# Reads traces written by `python -m locality.record` and draws MicroSpec's window coverage against
# `w_max` per category (paper Fig. 1b / Fig. 5), the static FR-Spec shortlist at equal size, LRU vs the FIFO
# window at equal mean size, and UniSpec's successor store replayed as a stream. Tables come from
# `locality`; this notebook only filters and encodes.

# %% tags=["parameters"]
traces_path = "runs/quickstart/traces.parquet"
out_dir = "runs/quickstart/figures"
w_max = [64, 128, 256, 512, 1024, 2048, 3072, 4096, 8192]
shortlist_k = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]

# %%
# %load_ext autoreload
# %autoreload 2
import polars as pl

import locality
from sweeps.figures import line_chart, save_chart

traces = locality.read_traces(traces_path)
print(f"{len(traces)} traces, {sum(len(t.generated) for t in traces)} generated tokens")

# %% [markdown]
# ## Window coverage vs `w_max` (MicroSpec stream: prompt, prefill top-3, verify top-3)

# %%
cov = locality.coverage_by(traces, by=["category"], w_max=w_max)
chart = line_chart(cov, "w_max", "coverage", "category", x_title="w_max (stream entries)",
                   tooltip=["category", "w_max", "coverage", "mean_active_vocab"],
                   title="Coverage of the next generated token by the window")
save_chart(chart, out_dir, "coverage_vs_wmax")
chart

# %% [markdown]
# ## Sources ablation (Table 3): context only, extension only, both

# %%
abl = pl.concat([locality.coverage(traces, w_max=w_max, sources=s).with_columns(pl.lit(s).alias("sources"))
                 for s in ("ctx+ext", "ctx", "ext")])
chart = line_chart(abl, "mean_active_vocab", "coverage", "sources", x_title="mean active vocab",
                   title="Coverage vs mean vocabulary, by stream source")
save_chart(chart, out_dir, "coverage_sources")
chart

# %% [markdown]
# ## Static shortlist (FR-Spec) at equal size — ranking counted from the same traces (an upper bound)

# %%
vocab_size = int(max(max(t.prompt.max(), t.generated.max(initial=0), t.step_topk.max(initial=0)) for t in traces)) + 1
ranking = locality.ranking_from_traces(traces, vocab_size)
static = locality.shortlist_coverage(ranking, traces, k=shortlist_k).rename({"k": "vocab"}).with_columns(
    pl.lit("frspec (static top-K)").alias("policy"))
window = locality.coverage(traces, w_max=w_max).select(
    pl.col("mean_active_vocab").alias("vocab"), "coverage").with_columns(pl.lit("microspec window").alias("policy"))
both = pl.concat([static.select("vocab", "coverage", "policy"), window], how="vertical_relaxed")
chart = line_chart(both, "vocab", "coverage", "policy", x_title="(mean) vocabulary size",
                   title="Dynamic window vs static shortlist")
save_chart(chart, out_dir, "window_vs_static")
chart

# %% [markdown]
# ## LRU vocabulary vs FIFO window at equal mean size

# %%
mrc = locality.miss_ratio_curves(traces, by=["category"])
long = pl.concat([
    mrc.select("category", pl.col("lru_mean_active_vocab").alias("mean_active_vocab"),
               pl.col("lru_miss_ratio").alias("miss_ratio")).with_columns(pl.lit("LRU").alias("policy")),
    mrc.select("category", pl.col("fifo_mean_active_vocab").alias("mean_active_vocab"),
               pl.col("fifo_miss_ratio").alias("miss_ratio")).with_columns(pl.lit("FIFO window").alias("policy")),
])
chart = line_chart(long, "mean_active_vocab", "miss_ratio", "policy", facet="category", unit_y=False,
                   title="Miss ratio", width=160, height=120)
save_chart(chart, out_dir, "lru_vs_fifo")
chart

# %% [markdown]
# ## UniSpec's successor store replayed as a stream

# %%
succ = locality.successor_coverage(traces, persist=True)
chart = line_chart(succ, "k", "coverage", log_x=False, x_title="successors stored per token (k)",
                   title="Coverage of generated[t] by store[generated[t-1]][:k]")
save_chart(chart, out_dir, "successor_store")
chart
