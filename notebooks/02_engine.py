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
# # 02 · Speed, tau and draft time of the decoding methods; the draft-size calibration
# Reads a `python -m engine.bench` results table and the calibration cache written by
# `python -m engine.calibrate`, and draws: speedup over `ar` and tau per category and run (UniSpec Table 2,
# MicroSpec Fig. 3), draft time per drafted step split by drafter phase (MicroSpec Fig. 4), and tau(g),
# s(g) and tau/s with their fits and g* (UniSpec App. F). Tables come from `engine`; this notebook only
# filters and encodes.

# %% tags=["parameters"]
results_path = "runs/bench_smollm2/results.parquet"
calibration_file = None          # None: the cache ($SPECVOCAB_CACHE/calibration.json)
out_dir = "runs/bench_smollm2/figures"

# %%
# %load_ext autoreload
# %autoreload 2
import polars as pl

from engine.bench import PHASES, summarize
from engine.calibrate import calibration_curves, load_calibrations
from sweeps.figures import bar_chart, line_chart, save_chart

results = pl.read_parquet(results_path)
table = summarize(results).with_columns(run=pl.col("method") + "/" + pl.col("vocab"))
print(f"{results.height} rows; runs: {table['run'].unique(maintain_order=True).to_list()}")
table.filter(pl.col("category") == "all").select("run", "rows", "tokens_per_s", "speedup", "tau", "draft_ms", "lossless")

# %% [markdown]
# ## Speedup over `ar` and tau, per category

# %%
chart = bar_chart(table, "category", "speedup", "run", rule=1.0, y_title="tokens/s over ar",
                  tooltip=["run", "category", "tokens_per_s", "speedup", "tau"], title="Speedup over ar")
save_chart(chart, out_dir, "speedup_by_category")
chart

# %%
chart = bar_chart(table, "category", "tau", "run", rule=1.0, y_title="tau (tokens per step)",
                  tooltip=["run", "category", "tau", "g"], title="Mean accepted length tau (bonus included)")
save_chart(chart, out_dir, "tau_by_category")
chart

# %% [markdown]
# ## Draft time per drafted step, by drafter phase (drafters with a backbone and an LM head)

# %%
phases = (table.filter((pl.col("category") == "all") & (pl.col("backbone_ms") > 0))
          .unpivot(index="run", on=[f"{p}_ms" for p in PHASES], variable_name="phase", value_name="ms")
          .with_columns(pl.col("phase").str.strip_suffix("_ms")))
if phases.height:
    chart = bar_chart(phases, "run", "ms", "phase", stack=True, y_title="ms per drafted step",
                      tooltip=["run", "phase", "ms"], title="Draft time split")
    save_chart(chart, out_dir, "draft_time_split")
    display(chart)  # noqa: F821 (IPython)
else:
    print("no drafter with phases in these results (bench with --drafter layerskip|eagle to draw this)")

# %% [markdown]
# ## Calibration of the draft size g* (every cached record)

# %%
records = load_calibrations(calibration_file)
if records:
    curves = pl.concat([calibration_curves(r) for r in records.values() if r.get("rows")])
    lines = (curves.filter(pl.col("kind") != "g_star")
             .with_columns(series=pl.col("key").str.split("|").list.get(0) + " " + pl.col("key").str.split("|").list.get(-1)
                           + " · " + pl.col("kind"))
             .unpivot(index=["series", "key", "kind", "g"], on=["tau", "s_step_ms", "tokens_per_s"],
                      variable_name="quantity"))
    chart = line_chart(lines, "g", "value", "series", facet="quantity", log_x=False, unit_y=False,
                       x_title="draft size g (nodes, root excluded)", title="tau(g), s(g), tau/s: measured and fitted",
                       tooltip=["key", "kind", "g", "value"], width=220, height=160).resolve_scale(y="independent")
    save_chart(chart, out_dir, "calibration")
    display(chart)  # noqa: F821 (IPython)
    print(curves.filter(pl.col("kind") == "g_star").select("key", "g", "tau", "s_step_ms", "tokens_per_s"))
else:
    print("no calibration cached yet: python -m engine.calibrate --model ... --method unispec")
