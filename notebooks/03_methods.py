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
# * **Table 2 on one head** — for a drafter benched with several vocabulary policies (full, frspec, dynaspec,
#   microspec on the same head): per run tokens/s, speedup over ar, tau, mean active vocabulary, draft ms per
#   drafted step and its phases, lossless (text: "exact" - every output equals ar's; "near-tie" - some differ,
#   each where ar's top two logits were within rounding; "mismatch" - some differ with a clear margin, a bug, or
#   were never diagnosed against ar: `engine.jobs.bench.diagnose`), and the ratios against `full`
#   (`engine.jobs.bench.summarize` and `compare_vocabs`, the tables `python -m engine.jobs.bench` prints; also written
#   as `one_head_table.csv`).
# * **methods_speed** — the same as bars: tokens/s, speedup over ar and tau per task.
# * **draft_time_by_phase** — MicroSpec Fig. 4: draft time per drafted step, split into the drafter's phases
#   (backbone layers, DynaSpec's router, weight gather, LM head, tree building; a phase no run spent time in
#   is left out), per task.
# * **dynaspec_choices** — DynaSpec's unstated choices (`python -m engine.jobs.dynaspec_choices`, not a sweep kind: read
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
results_dir = "results/quick"
out_dir = ""                     # default: {results_dir}/figures
dynaspec_choices = ""            # a folder `python -m engine.jobs.dynaspec_choices --out` wrote; default:
                                 # {results_dir}/dynaspec_choices (none there: the figure is skipped)

# %%
# %load_ext autoreload
# %autoreload 2
from pathlib import Path

import altair as alt
import polars as pl

import engine.jobs.bench as eb
from sweeps import figures as fig

out_dir = out_dir or f"{results_dir}/figures"
bench = fig.read(results_dir, "bench")
summary = fig.method_summary(bench)

# %% [markdown]
# ## Table 2: tokens/s per task, average speedup and tau

# %%
if summary is not None:
    wide = fig.methods_wide(summary)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    wide.write_csv(f"{out_dir}/methods_table.csv")
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=250, fmt_str_lengths=40):
        print(wide)

# %%
if summary is not None:
    cells = fig.table_cells(summary)
    runs, columns = fig.run_order(summary), [t for t in fig.task_order(summary) if t != fig.AVG]
    columns += ["avg tokens/s (× ar)", "avg tau"]
    base = alt.Chart(cells).encode(
        x=alt.X("column:N", sort=columns, title=None, axis=alt.Axis(orient="top", labelAngle=-40)),
        y=alt.Y("run:N", sort=runs, title=None))
    rect = base.mark_rect().encode(color=alt.Color(
        "speedup:Q", title="speedup over ar",
        scale=alt.Scale(scheme="redyellowgreen", domainMid=1.0), legend=alt.Legend(format=".2f")))
    text = base.mark_text(fontSize=11).encode(text="text:N")
    # one table per prompt set (Vega-Lite cannot facet layers with independent axes)
    chart = (alt.vconcat(*[alt.layer(rect, text).transform_filter(alt.datum.prompt_set == s)
                           .properties(width=alt.Step(62), height=alt.Step(22), title=s)
                           for s in summary["prompt_set"].unique(maintain_order=True).to_list()])
             .properties(title=fig.title(
                 "Tokens/s per task, average speedup over ar and average tau (MicroSpec Table 2's layout)", bench,
                 notes=["cell colour: speedup over ar on that task; avg: the mean over tasks (tokens/s, tau)"])))
    fig.save_chart(chart, out_dir, "methods_table")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## Table 2 on one head: each drafter with every vocabulary policy it was benched with
# Per model and prompt set, the runs of a drafter benched with two or more policies, with ar as the speed and
# lossless reference: the overall rows of `engine.jobs.bench.summarize` (means over every prompt, turn, repeat) and
# its comparison lines (draft-time ratio, tau ratio, tokens/s ratio against `full`; microspec against frspec
# and dynaspec; dynaspec against frspec).

# %%
one_head = []
if bench is not None and {"policy", "vocab_size"} <= set(bench.columns):
    runs_of = fig.with_run(bench)
    for (model, prompt_set, method), part in runs_of.filter(pl.col("method").is_in(eb.DRAFTERS)).group_by(
            "model", "prompt_set", "method", maintain_order=True):
        if part["policy"].n_unique() < 2:
            continue
        rows = runs_of.filter((pl.col("model") == model) & (pl.col("prompt_set") == prompt_set)
                              & pl.col("method").is_in(["ar", method]))
        table = eb.summarize(rows).filter(pl.col("category") == "all")
        phase_cols = [f"{p}_ms" for p in eb.PHASES if (table[f"{p}_ms"].fill_null(0.0) > 0).any()]
        shown = table.select("run", "policy", "vocab_size", "rows", "tokens_per_s", "speedup", "tau",
                             "mean_active_vocab", "draft_ms", *phase_cols, "lossless")
        print(f"{model} · {prompt_set} · {method}")
        with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=250, fmt_str_lengths=60,
                       tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
            print(shown.with_columns(pl.col(pl.Float64).round(2)))
        for line in eb.comparison_lines(eb.compare_vocabs(table)):
            print(line)
        one_head.append(shown.select(pl.lit(model).alias("model"), pl.lit(prompt_set).alias("prompt_set"),
                                     pl.all()))
if one_head:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    pl.concat(one_head, how="diagonal_relaxed").write_csv(f"{out_dir}/one_head_table.csv")
else:
    print("skipped Table 2 on one head: no drafter was benched with two or more vocabulary policies")

# %% [markdown]
# ## The same as bars: tokens/s, speedup over ar and tau per task

# %%
if summary is not None:
    long = summary.unpivot(index=["prompt_set", "task", "run"], on=["tokens_per_s", "speedup", "tau"],
                           variable_name="measure").with_columns(pl.col("measure").replace_strict(
        {"tokens_per_s": "tokens/s", "speedup": "speedup over ar (×)", "tau": "tau (tokens per step)"}))
    runs = fig.run_order(summary)
    bars = alt.Chart(long).mark_bar().encode(
        x=alt.X("task:N", sort=fig.task_order(summary), title="task", axis=alt.Axis(labelAngle=-40)),
        xOffset=alt.XOffset("run:N", sort=runs),
        y=alt.Y("value:Q", title=None),
        color=alt.Color("run:N", sort=runs, title="method · vocabulary", scale=fig.color_scale(len(runs))),
        tooltip=["prompt_set", "task", "run", "measure", alt.Tooltip("value:Q", format=".2f")])
    one = alt.Chart(pl.DataFrame({"measure": ["speedup over ar (×)", "tau (tokens per step)"], "y": [1.0, 1.0]})
                    ).mark_rule(strokeDash=[4, 3], color="#333").encode(y="y:Q")
    rows = []
    for s in summary["prompt_set"].unique(maintain_order=True).to_list():
        rows.append(alt.vconcat(*[
            alt.layer(bars.transform_filter((alt.datum.prompt_set == s) & (alt.datum.measure == m)),
                      one.transform_filter(alt.datum.measure == m))
            .properties(width=alt.Step(7), height=150, title=f"{s}: {m}")
            for m in ("tokens/s", "speedup over ar (×)", "tau (tokens per step)")]))
    chart = alt.hconcat(*rows).properties(title=fig.title(
        "Method comparison per task: tokens/s, speedup over ar, tau", bench,
        notes=["dashed: 1.0 (ar's speed; one token per step); avg: the mean over tasks"]))
    fig.save_chart(chart, out_dir, "methods_speed")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## Draft time per drafted step by phase (MicroSpec Fig. 4)

# %%
phases = fig.phase_times(summary)
if phases is not None:      # the phases some run spent time in (router: dynaspec runs only)
    phases = phases.filter(pl.col("ms").fill_null(0.0).sum().over("phase") > 0)
if phases is not None and not phases.is_empty():
    runs = phases["run"].unique(maintain_order=True).to_list()
    bars = alt.Chart(phases).mark_bar().encode(
        x=alt.X("task:N", sort=fig.task_order(phases), title=None, axis=alt.Axis(labelAngle=-40)),
        y=alt.Y("ms:Q", title="ms per drafted step", stack=True),
        color=alt.Color("phase:N", sort=list(eb.PHASES), title="phase", scale=alt.Scale(scheme="set2")),
        order=alt.Order("phase_order:Q"),
        tooltip=["prompt_set", "task", "run", "phase", alt.Tooltip("ms:Q", format=".2f"),
                 alt.Tooltip("draft_ms:Q", format=".2f", title="draft ms (all)")])
    bars = bars.transform_calculate(phase_order=f"indexof({list(eb.PHASES)}, datum.phase)")
    sets = phases["prompt_set"].unique(maintain_order=True).to_list()
    chart = (alt.hconcat(*[
        bars.transform_filter(alt.datum.prompt_set == s).properties(width=alt.Step(18), height=110)
        .facet(row=alt.Row("run:N", sort=runs, title=None,
                           header=alt.Header(labelFontWeight="bold", labelAngle=0, labelAlign="left")))
        .properties(title=s) for s in sets])
             .properties(title=fig.title(
                 "Draft time per drafted step by drafter phase, per task (MicroSpec Fig. 4)", bench,
                 notes=["backbone: the drafter's layers; router: DynaSpec's cluster router (dynaspec runs); gather: "
                        "copying the window's LM-head rows; lm_head: the (restricted) head; tree: building the draft "
                        "tree"])))
    fig.save_chart(chart, out_dir, "draft_time_by_phase")
    display(chart)  # noqa: F821 (IPython)

# %% [markdown]
# ## DynaSpec's unstated choices: M, router width, L (`python -m engine.jobs.dynaspec_choices`)
# Offline, on the held-out prompts of one fit's logged rows: token recall = the share of the full-vocabulary
# drafter's top-L tokens (the L the fit logged) inside a row's shortlist; a row at recall 1 proposes what the full
# head proposes. Each factor is varied alone around the centre setting (`fig.choices_centre`: per factor, the
# value shared by the most settings - with one factor at a time that is the centre's); the centre is drawn in
# every panel. Lines: DynaSpec-PA (position-aware budget), a point per token budget at draft steps 0-1
# (k_max = round(budget * M / V)); the x axis is the mean shortlist per row those budgets gave.

# %%
choices_dir = dynaspec_choices or f"{results_dir}/dynaspec_choices"
choices = fig.read_choices(choices_dir)
shaped = fig.dynaspec_choices(choices)
if shaped is not None:
    lo, hi = shaped["mean_row_vocab"].min(), shaped["mean_row_vocab"].max()
    x = fig.log2_axis("mean_row_vocab:Q", "mean shortlist per row (tokens, log)",
                      fig.POW2 if hi / max(lo, 1.0) <= 2 ** 7 else fig.POW4)
    y = alt.Y("token_recall:Q", title="held-out token recall", scale=alt.Scale(domain=[0, 1]))
    tips = ["setting:N", "budget_tokens:Q", "k_max:Q", alt.Tooltip("mean_row_vocab:Q", format=".0f"),
            alt.Tooltip("token_recall:Q", format=".3f"), alt.Tooltip("top1_hit:Q", format=".3f")]
    short = {"num_clusters": "M", "router_width": "width", "top_l": "L"}
    fits, rows, centres = shaped["fit"].unique(maintain_order=True).to_list(), [], []
    for fit_name in fits:
        part = shaped.filter(pl.col("fit") == fit_name)
        c = part.filter(pl.col("centre")).select(*fig.CHOICE_FACTORS).row(0, named=True)
        centres.append(f"M {c['num_clusters']}, router width {c['router_width']}, L {c['top_l']}"
                       + (f" ({fit_name})" if len(fits) > 1 else ""))
        panels = []
        for factor in fig.CHOICE_FACTORS.values():
            panel = part.filter(pl.col("factor") == factor)
            router = panel.filter(pl.col("series") == "router")
            settings = router.sort("value")["setting"].unique(maintain_order=True).to_list()
            centre = router.filter(pl.col("centre"))["setting"][0]
            lines = alt.Chart(router).mark_line(point=True, strokeWidth=2).encode(
                x=x, y=y, detail="setting:N", tooltip=tips,
                color=alt.Color("setting:N", sort=settings, title=factor, scale=fig.highlight_scale(settings, centre),
                                legend=alt.Legend(orient="bottom", direction="vertical")))
            static = alt.Chart(panel.filter(pl.col("series") == "static")).mark_line(
                color="#888", strokeDash=[5, 4], point=alt.OverlayMarkDef(color="#888", size=20)).encode(
                x=x, y=y, tooltip=tips)
            fixed = ", ".join(f"{short[k]} {c[k]}" for k, name in fig.CHOICE_FACTORS.items() if name != factor)
            panels.append(alt.layer(static, lines).properties(
                width=260, height=220, title=alt.TitleParams(
                    factor + (f" · {fit_name}" if len(fits) > 1 else ""), subtitle=f"{fixed} fixed")))
        rows.append(alt.hconcat(*panels).resolve_scale(color="independent"))
    drafters = ", ".join(shaped["drafter"].unique(maintain_order=True).to_list())
    chart = alt.vconcat(*rows).properties(title=fig.title(
        f"DynaSpec's unstated choices on {', '.join(shaped['model'].unique(maintain_order=True).to_list())} "
        f"({drafters}): held-out token recall vs shortlist size, M, router width and L varied one at a time",
        shaped, notes=[
            f"centre (black in every panel): {'; '.join(centres)}; lines: DynaSpec-PA, a point per token budget "
            f"({', '.join(map(str, sorted(shaped['budget_tokens'].unique().to_list())))} tokens at draft steps 0-1)",
            "dashed grey: the static baseline at the centre M (clusters ranked by their training-label frequency)"]))
    fig.save_chart(chart, out_dir, "dynaspec_choices")
    display(chart)  # noqa: F821 (IPython)

    table = fig.choices_table(shaped, near=8192)
    print("DynaSpec-PA at the token budget closest to 8192 (train_s: seconds to train the router):")
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=40,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(table.with_columns(pl.col("token_recall", "top1_hit").round(3),
                                 pl.col("mean_row_vocab", "train_s").round(1)))
