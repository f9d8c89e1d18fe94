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
# # 03 · Method comparison per task: tokens/s, speedup over ar, tau; draft time by phase
# Reads a sweep's `bench` cells with `sweeps.load` and draws, for every method and vocabulary policy the
# sweep ran (a *run*, built from the `method`, `policy` and `vocab_size` columns: "layerskip · microspec 3072"
# is the layer-skip drafter with MicroSpec's window of w_max 3072, "eagle · dynaspec 12288" the EAGLE head
# with DynaSpec's routed clusters at a budget of ~12288 tokens at draft steps 0-1, see `engine.jobs.bench`):
#
# * **methods_table** — MicroSpec Table 2's layout: tokens/s per task, the average over tasks with its
#   speedup over ar, and the average tau (also written as `methods_table.csv`).
# * **Table 2 on one head** — for each drafter benched with several vocabulary policies (full, frspec, dynaspec,
#   microspec on the same head; the quick sweep has two: the EAGLE-2 head `eagle` and the EAGLE-3 head `eagle3`,
#   whose `full` is its own draft vocabulary and whose policies work inside it): per run tokens/s, speedup over ar, tau, mean active vocabulary, draft ms per
#   drafted step and its phases, lossless (text: "exact" - every output equals ar's; "near-tie" - some differ,
#   each where ar's top two logits were within rounding; "mismatch" - some differ with a clear margin, a bug, or
#   were never diagnosed against ar: `engine.jobs.bench.diagnose`), and the ratios against `full`
#   (`sweeps.tables.one_head_tables`: `engine.metrics.summarize` and `compare_vocabs`, the tables
#   `python -m specvocab.engine.jobs.bench` prints; also written as `one_head_table.csv`).
# * **methods_speed** — the same as bars: tokens/s, speedup over ar and tau per task.
# * **draft_time_by_phase** — MicroSpec Fig. 4: draft time per drafted step, split into the drafter's phases
#   (backbone layers, DynaSpec's router, weight gather, LM head, tree building; a phase no run spent time in
#   is left out), per task.
# * **tau_by_source** — the merged drafter's tau split by the source of its committed tokens (the draft head,
#   PLD, UniSpec's store, the target's bonus tokens), beside each source's run alone, per task.
# * **dynaspec_choices** — DynaSpec's unstated choices (`python -m specvocab.engine.jobs.dynaspec_choices`, not a sweep kind: read
#   from `dynaspec_choices`, default `{results_dir}/dynaspec_choices`): held-out token recall against the mean
#   shortlist per row, one line per setting of the number of clusters M, the router's width and the L of its
#   top-L training labels, each varied alone around a centre setting (one panel per factor, the centre in black
#   in each), a point per token budget, DynaSpec-PA; dashed grey: the static baseline (clusters ranked by
#   training-label frequency) at the centre's M. Also a table at the budget closest to 8192 tokens: token
#   recall, top-1 hit, mean shortlist and router training seconds per setting.
#
# tokens/s = new tokens / wall time of a turn (prefill included), averaged over prompts, turns, repeats and
# seeds; tau = new tokens / steps (bonus included, ar = 1.00); speedup = tokens/s over ar's on the same task.

# %% tags=["parameters"]
results_dir = "results/quick"    # relative: under $SPECVOCAB_RESULTS, else the checkout's root
out_dir = ""                     # default: {results_dir}/figures
dynaspec_choices = ""            # a folder `python -m specvocab.engine.jobs.dynaspec_choices --out` wrote; default:
                                 # {results_dir}/dynaspec_choices (none there: the figure is skipped)

# %%
# %load_ext autoreload
# %autoreload 2
from pathlib import Path

import polars as pl

from specvocab.sweeps import charts, tables

results_dir = tables.results_path(results_dir, kinds=("bench",))
out_dir = str(tables.results_path(out_dir or f"{results_dir}/figures"))
bench = tables.read(results_dir, "bench")
summary = tables.method_summary(bench)

# %% [markdown]
# ## Table 2: tokens/s per task, average speedup and tau

# %%
if summary is not None:
    wide = tables.methods_wide(summary)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    wide.write_csv(f"{out_dir}/methods_table.csv")
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=250, fmt_str_lengths=40):
        print(wide)

# %%
if summary is not None:
    chart = charts.methods_table(summary, bench)
    charts.save_chart(chart, out_dir, "methods_table")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## Table 2 on one head: each drafter with every vocabulary policy it was benched with
# Per model and prompt set, the runs of a drafter benched with two or more policies, with ar as the speed and
# lossless reference: the overall rows of `engine.metrics.summarize` (means over every prompt, turn, repeat) and
# its comparison lines (draft-time ratio, tau ratio, tokens/s ratio against `full`; microspec against frspec
# and dynaspec; dynaspec against frspec).

# %%
one_head = tables.one_head_tables(bench)
for name, table, lines in one_head:
    print(name)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=250, fmt_str_lengths=60,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(table.drop("model", "prompt_set").with_columns(pl.col(pl.Float64).round(2)))
    for line in lines:
        print(line)
if one_head:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    pl.concat([t for _, t, _ in one_head], how="diagonal_relaxed").write_csv(f"{out_dir}/one_head_table.csv")

# %% [markdown]
# ## The same as bars: tokens/s, speedup over ar and tau per task

# %%
if summary is not None:
    chart = charts.methods_speed(summary, bench)
    charts.save_chart(chart, out_dir, "methods_speed")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## Draft time per drafted step by phase (MicroSpec Fig. 4)

# %%
phases = tables.phase_times(summary)
if phases is not None:      # the phases some run spent time in (router: dynaspec runs only)
    phases = phases.filter(pl.col("ms").fill_null(0.0).sum().over("phase") > 0)
if phases is not None and not phases.is_empty():
    chart = charts.draft_time_by_phase(phases, bench)
    charts.save_chart(chart, out_dir, "draft_time_by_phase")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## tau by source and task: the merged tree against its sources alone
# The merged drafter (`engine.drafters.merged`) verifies one tree from the draft head's candidates and the n-gram
# candidates (PLD, UniSpec's store) under one node budget; its rows count the committed draft tokens each source
# placed (`accepted_by_<source>`). Each bar is a run's tau split by who committed its tokens: a source's part is
# its committed draft tokens per step, `target` the bonus tokens (`sweeps.tables.tau_by_source`). Skipped when
# the sweep ran no merged cell.

# %%
parts = tables.tau_by_source(bench)
if parts is not None:
    chart = charts.tau_by_source(parts, bench)
    charts.save_chart(chart, out_dir, "tau_by_source")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## DynaSpec's unstated choices: M, router width, L (`python -m specvocab.engine.jobs.dynaspec_choices`)
# Offline, on the held-out prompts of one fit's logged rows: token recall = the share of the full-vocabulary
# drafter's top-L tokens (the L the fit logged) inside a row's shortlist; a row at recall 1 proposes what the full
# head proposes. Each factor is varied alone around the centre setting (`tables.choices_centre`: the centre the
# choices job recorded on every row); the centre is drawn in
# every panel. Lines: DynaSpec-PA (position-aware budget), a point per token budget at draft steps 0-1
# (k_max = round(budget * M / V)); the x axis is the mean shortlist per row those budgets gave.

# %%
choices_dir = tables.results_path(dynaspec_choices or f"{results_dir}/dynaspec_choices")
choices = tables.read_choices(choices_dir)
shaped = tables.dynaspec_choices(choices)
if shaped is not None:
    chart = charts.dynaspec_choices(shaped)
    charts.save_chart(chart, out_dir, "dynaspec_choices")
    display(chart)  # noqa: F821 (IPython)

    table = tables.choices_table(shaped, near=8192)
    print("DynaSpec-PA at the token budget closest to 8192 (train_s: seconds to train the router):")
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=40,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(table.with_columns(pl.col("token_recall", "top1_hit").round(3),
                                 pl.col("mean_row_vocab", "train_s").round(1)))
