"""The figure notebooks' charts (altair): shared pieces, the chart builders, and `save_chart`.

Each builder takes tables from `sweeps.tables` (polars; the measures are `engine.metrics`') and returns an altair
chart; a notebook reads a sweep, calls a table builder and a chart builder, and saves and shows what it got. No
torch at import (tests/test_layering.py).

A sweep may hold several models (`paper.toml` has three): every chart that draws bench or coverage results
splits them - one panel, or one facet row, per model (and prompt set), the model named in its title.
Colours: tableau10 up to 10 series, category20 up to 20, and above 20 a second channel (the line's dash or
the point's shape, a bar's outline dash) that tells apart series of one colour (`series_channels`). Every
quantitative y axis has a title with its unit.

Figures are written as PNG (`vl-convert-python`, offline) and self-contained HTML (`inline=True`: altair's
default HTML loads JavaScript from a CDN an offline machine cannot reach); `save_chart` prints FIGURE_LINE +
the PNG's path, which `sweeps.render` collects. Papers' figures drawn: MicroSpec Fig. 1(b), 4, 5 and Table 2;
UniSpec Fig. 3, 4, 5 and App. F; DynaSpec's unstated choices (§4.2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import altair as alt
import polars as pl

from specvocab.engine.metrics import AVG, PHASES
from specvocab.sweeps import tables

FIGURE_LINE = "figure: "                                    # how save_chart announces a written PNG
TEN = "tableau10"
TWENTY = "category20"
DASHES = [[1, 0], [6, 3], [2, 2], [8, 3, 2, 3]]             # solid, dashed, dotted, dash-dot
SHAPES = ["circle", "square", "triangle-up", "diamond", "cross", "triangle-down"]


# ----------------------------------------------------------------------------------------------------------
# Titles, colours, axes
# ----------------------------------------------------------------------------------------------------------

def title(what: str, frame: pl.DataFrame, record: pl.DataFrame | None = None, notes: Sequence[str] = ()
          ) -> alt.TitleParams:
    """A chart title: `what` the figure shows; the subtitle: `notes` (how to read it), then
    `sweeps.tables.describe`'s lines (what was run)."""
    return alt.TitleParams(what, subtitle=[*notes, *tables.describe(frame, record)], anchor="start", fontSize=15,
                           subtitleColor="rgb(68, 68, 68)", subtitleFontSize=12)


def stroke_legend(**kwargs) -> alt.Legend:
    """A legend that draws line dashes (a strokeDash encoding), visible also on lines with point markers."""
    return alt.Legend(symbolType="stroke", symbolStrokeColor="rgb(51, 51, 51)", symbolStrokeWidth=2,
                      symbolFillColor="transparent", **kwargs)


def color_scale(n: int, **kwargs) -> alt.Scale:
    """10 distinguishable colours, or 20 when there are more series (13 Spec-Bench categories); above 20 the
    colours repeat: add `series_channels`' second channel."""
    return alt.Scale(scheme=TEN if n <= 10 else TWENTY, **kwargs)


def series_channels(field: str, domain: Sequence, title_: str, *, mark: str = "line", **legend) -> dict:
    """Encodings that tell `domain`'s series apart: `color` (`color_scale`), and above 20 series a second
    channel on the same field, constant over each block of 20 colours - `strokeDash` for a line or a bar (its
    outline: draw bars with `BAR_OUTLINE`), `shape` for a point - so every (colour, dash / shape) pair is one
    series. `legend`: alt.Legend options for the colour legend."""
    domain = list(domain)
    out = {"color": alt.Color(f"{field}:N", sort=domain, title=title_, scale=color_scale(len(domain)),
                              legend=alt.Legend(**legend) if legend else alt.Undefined)}
    if len(domain) > 20:
        block = [i // 20 for i in range(len(domain))]
        if mark == "point":
            out["shape"] = alt.Shape(f"{field}:N", sort=domain, title=title_,
                                     scale=alt.Scale(domain=domain, range=[SHAPES[b % len(SHAPES)] for b in block]))
        else:
            out["strokeDash"] = alt.StrokeDash(f"{field}:N", sort=domain, title=title_, legend=stroke_legend(),
                                               scale=alt.Scale(domain=domain,
                                                               range=[DASHES[b % len(DASHES)] for b in block]))
    return out


BAR_OUTLINE = {"stroke": "rgb(34, 34, 34)", "strokeWidth": 1}          # mark_bar(**BAR_OUTLINE): a dash channel shows


def highlight_scale(domain: Sequence[str], highlight: str, color: str = "rgb(34, 34, 34)") -> alt.Scale:
    """A colour scale over `domain` (in order) that draws `highlight` in `color` (near-black) and the rest in
    tableau10's colours: one series (a centre setting, a default) reads the same in every panel."""
    others = iter(["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6",
                   "#9d755d", "#bab0ac"] * (len(domain) // 10 + 1))
    return alt.Scale(domain=list(domain), range=[color if d == highlight else next(others) for d in domain])


POW4 = [4 ** k for k in range(1, 10)]                       # 4 ... 262144: log-2 axis ticks that do not crowd
POW2 = [2 ** k for k in range(1, 19)]                       # 2 ... 262144: for short ranges (w_max 64 ... 8192)


def log2_axis(field: str, title_: str, ticks: Sequence[int] = POW4, **kwargs) -> alt.X:
    """A log-2 x axis (window and vocabulary sizes), ticks at `ticks`, labelled 64, 256, 1k, 4k, 16k."""
    label = "datum.value >= 1024 ? format(datum.value / 1024, '~g') + 'k' : format(datum.value, '~g')"
    return alt.X(field, title=title_, scale=alt.Scale(type="log", base=2),
                 axis=alt.Axis(values=list(ticks), labelExpr=label), **kwargs)


def save_chart(chart, out_dir: str | Path, name: str, scale: float = 2.0) -> dict[str, Path]:
    """Write `out_dir/name.png` (vl-convert, offline) and `out_dir/name.html` (self-contained: the
    JavaScript inline, no CDN), print the PNG's path; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, html = out / f"{name}.png", out / f"{name}.html"
    chart.save(str(png), scale_factor=scale)
    chart.save(str(html), inline=True)
    print(f"{FIGURE_LINE}{png}")                    # `sweeps.render` lists what each notebook wrote from these
    return {"png": png, "html": html}


def keys(frame: pl.DataFrame, *columns: str) -> list[tuple]:
    """The distinct values of `columns` in `frame`, sorted: one panel each."""
    return frame.select(*columns).unique().sort(*columns).rows()


def _where(**equal) -> alt.expr.core.Expression:
    """A filter predicate: every column equal to its value (`alt.datum.model == "tiny"` and so on)."""
    pred = None
    for col, value in equal.items():
        p = alt.datum[col] == value
        pred = p if pred is None else pred & p
    return pred


# ----------------------------------------------------------------------------------------------------------
# 02: sensitivity to w_max, k_pre and k_ver (MicroSpec Fig. 5)
# ----------------------------------------------------------------------------------------------------------

W_MAX_AXIS = "w_max (candidate-stream entries)"


def wmax_sensitivity(window: pl.DataFrame | None, sweep: pl.DataFrame | None, bench: pl.DataFrame | None,
                     coverage: pl.DataFrame | None, record: pl.DataFrame | None = None):
    """MicroSpec Fig. 5, per model: the window's coverage against w_max (`tables.window_coverage`, with the
    bench drafts' draft_coverage where `tables.wmax_sweep` has it), then per model, prompt set and drafter
    tokens/s (left axis) and tau (right axis) of the drafter with MicroSpec's window; None when neither ran."""
    panels = []
    if window is not None:
        cov_long = window.select("model", "prompt_set", "w_max", "coverage", source=pl.lit("traces (coverage cells)"))
        if sweep is not None:
            cov_long = pl.concat([cov_long, sweep.select("model", "prompt_set", "w_max",
                                                         pl.col("draft_coverage").alias("coverage"),
                                                         source=pl.lit("bench drafts"))], how="vertical_relaxed")
        line = alt.Chart(cov_long).mark_line(point=True).encode(
            x=log2_axis("w_max:Q", W_MAX_AXIS, ticks=POW2),
            y=alt.Y("coverage:Q", title="coverage of generated tokens (%)", axis=alt.Axis(format="%"),
                    scale=alt.Scale(zero=False)),
            color=alt.Color("prompt_set:N", title="prompt set",
                            scale=color_scale(cov_long["prompt_set"].n_unique())),
            strokeDash=alt.StrokeDash("source:N", title="measured on", scale=alt.Scale(
                domain=["traces (coverage cells)", "bench drafts"], range=[[1, 0], [6, 4]]), legend=stroke_legend()),
            tooltip=["model", "prompt_set", "source", "w_max", alt.Tooltip("coverage:Q", format=".1%")])
        panels += [line.transform_filter(_where(model=m)).properties(width=300, height=220,
                                                                    title=f"window coverage · {m}")
                   for (m,) in keys(cov_long, "model")]
    if sweep is not None:
        base = alt.Chart(sweep).encode(x=log2_axis("w_max:Q", W_MAX_AXIS, ticks=sorted(sweep["w_max"].unique())))
        tip = ["model", "prompt_set", "drafter", "w_max", alt.Tooltip("tokens_per_s:Q", format=".1f"),
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
        # one panel per model, prompt set and drafter: Vega-Lite cannot facet layers with independent y axes
        panels += [alt.layer(alt.layer(speed, full, best), tau)
                   .transform_filter(_where(model=m, prompt_set=s, drafter=d))
                   .resolve_scale(y="independent").properties(width=300, height=220, title=f"{d} on {s} · {m}")
                   for m, s, d in keys(sweep, "model", "prompt_set", "drafter")]
    if not panels:
        return None
    notes = "first: the window's coverage, per model"
    if sweep is not None:
        notes += ("; then: tokens/s (solid green, left axis) and tau (dashed blue, right axis) of the drafter with "
                  "MicroSpec's window; diamond: the paper's default w_max 3072")
        if sweep["full_tokens_per_s"].is_not_null().any():
            notes += "; dotted green: the same drafter, full vocabulary"
    return alt.hconcat(*panels).resolve_scale(color="independent", strokeDash="independent").properties(
        title=title("Sensitivity to the window size w_max (MicroSpec Fig. 5)",
                    bench if sweep is not None else coverage, record, notes=[notes]))


def kpre_kver_sensitivity(grid: pl.DataFrame, coverage: pl.DataFrame, record: pl.DataFrame | None = None):
    """The window's coverage and mean active vocabulary against w_max for each (k_pre, k_ver)
    (`tables.window_coverage(..., at_default=False)`): a facet row per model, a column per prompt set."""
    enc = dict(x=log2_axis("w_max:Q", W_MAX_AXIS, ticks=POW2),
               color=alt.Color("k_pre:O", title="k_pre", scale=alt.Scale(scheme="dark2")),
               strokeDash=alt.StrokeDash("k_ver:O", title="k_ver", legend=stroke_legend()),
               detail="stream:N",
               tooltip=["model", "prompt_set", "stream", "w_max", alt.Tooltip("coverage:Q", format=".1%"),
                        alt.Tooltip("mean_active_vocab:Q", format=".0f")])
    facet = dict(row=alt.Row("model:N", title=None, header=alt.Header(labelFontWeight="bold")),
                 column=alt.Column("prompt_set:N", title=None, header=alt.Header(labelFontWeight="bold")))
    cov_chart = alt.Chart(grid).mark_line(point=True).encode(
        y=alt.Y("coverage:Q", title="coverage of generated tokens (%)", axis=alt.Axis(format="%"),
                scale=alt.Scale(zero=False)), **enc).properties(width=260, height=200).facet(**facet)
    vocab_chart = alt.Chart(grid).mark_line(point=True).encode(
        y=alt.Y("mean_active_vocab:Q", title="mean active vocabulary (tokens)", scale=alt.Scale(type="log")),
        **enc).properties(width=260, height=200).facet(**facet)
    return alt.vconcat(cov_chart, vocab_chart).properties(title=title(
        "Window coverage and size for each k_pre, k_ver", coverage, record,
        notes=["k_pre: top-k rows of the prefill that enter the stream; k_ver: top-k rows of each verify step "
               "(MicroSpec §3.2)"]))


# ----------------------------------------------------------------------------------------------------------
# 03: methods (MicroSpec Table 2, Fig. 4) and DynaSpec's choices
# ----------------------------------------------------------------------------------------------------------

MEASURES = {"tokens_per_s": "tokens/s", "speedup": "speedup over ar (×)", "tau": "tau (tokens per step)"}
RUN_TITLE = "method · vocabulary"


def methods_table(summary: pl.DataFrame, bench: pl.DataFrame):
    """MicroSpec Table 2's layout as a drawn table (`tables.table_cells`), one per model and prompt set: a row
    per run, tokens/s per task, the average with its speedup over ar and that speedup's 95% interval, the
    decode phase's speedup and its interval, the average tau; cells coloured by speedup."""
    cells = tables.table_cells(summary)
    runs, columns = tables.run_order(summary), [t for t in tables.task_order(summary) if t != AVG]
    columns += ["avg tokens/s (× ar)", "95% CI (× ar)", "decode × ar", "decode 95% CI", "avg tau"]
    base = alt.Chart(cells).encode(
        x=alt.X("column:N", sort=columns, title=None, axis=alt.Axis(orient="top", labelAngle=-40)),
        y=alt.Y("run:N", sort=runs, title=RUN_TITLE))
    rect = base.mark_rect().encode(color=alt.Color(
        "speedup:Q", title="speedup over ar",
        scale=alt.Scale(scheme="redyellowgreen", domainMid=1.0), legend=alt.Legend(format=".2f")))
    text = base.mark_text(fontSize=11).encode(text="text:N")
    # one table per model and prompt set (Vega-Lite cannot facet layers with independent axes)
    return (alt.vconcat(*[alt.layer(rect, text).transform_filter(_where(model=m, prompt_set=s))
                          .properties(width=alt.Step(62), height=alt.Step(22), title=f"{m} · {s}")
                          for m, s in keys(summary, "model", "prompt_set")])
            .properties(title=title(
                "Tokens/s per task, average speedup over ar and average tau (MicroSpec Table 2's layout)", bench,
                notes=["cell colour: speedup over ar on that task; avg: the mean over tasks (tokens/s, tau)",
                       "95% CI: bootstrap over the tasks, each task's turns paired with ar's (the spread of "
                       "this run's timings, not the machine's drift between runs)",
                       "decode × ar: the same without the prefill and the drafter's pass over the prompt"])))


def methods_speed(summary: pl.DataFrame, bench: pl.DataFrame):
    """Table 2 as bars: tokens/s, speedup over ar and tau per task and run, a column of three panels per
    model and prompt set; the average's speedup bars carry their 95% interval."""
    long = summary.unpivot(index=["model", "prompt_set", "task", "run"], on=list(MEASURES),
                           variable_name="measure").with_columns(pl.col("measure").replace_strict(MEASURES))
    runs = tables.run_order(summary)
    bars = alt.Chart(long).mark_bar(**(BAR_OUTLINE if len(runs) > 20 else {})).encode(
        x=alt.X("task:N", sort=tables.task_order(summary), title="task", axis=alt.Axis(labelAngle=-40)),
        xOffset=alt.XOffset("run:N", sort=runs),
        **series_channels("run", runs, RUN_TITLE, mark="bar"),
        tooltip=["model", "prompt_set", "task", "run", "measure", alt.Tooltip("value:Q", format=".2f")])
    one = alt.Chart(pl.DataFrame({"measure": [MEASURES["speedup"], MEASURES["tau"]], "y": [1.0, 1.0]})
                    ).mark_rule(strokeDash=[4, 3], color="rgb(51, 51, 51)").encode(y="y:Q")
    # the average's 95% interval (engine.metrics speedup_lo / _hi: bootstrap over the tasks) on its speedup bar
    avg = summary.filter((pl.col("task") == AVG) & pl.col("speedup_lo").is_not_null()).select(
        "model", "prompt_set", "task", "run", "speedup_lo", "speedup_hi", measure=pl.lit(MEASURES["speedup"]))
    whiskers = alt.Chart(avg).mark_rule(color="rgb(17, 17, 17)", strokeWidth=1.5).encode(
        x=alt.X("task:N", sort=tables.task_order(summary)), xOffset=alt.XOffset("run:N", sort=runs),
        y="speedup_lo:Q", y2="speedup_hi:Q",
        tooltip=["run", alt.Tooltip("speedup_lo:Q", format=".2f"), alt.Tooltip("speedup_hi:Q", format=".2f")])
    columns = []
    for m, s in keys(summary, "model", "prompt_set"):
        columns.append(alt.vconcat(*[
            alt.layer(bars.encode(y=alt.Y("value:Q", title=label))
                      .transform_filter(_where(model=m, prompt_set=s, measure=label)),
                      one.transform_filter(alt.datum.measure == label),
                      *([whiskers.transform_filter(_where(model=m, prompt_set=s))]
                        if label == MEASURES["speedup"] and avg.height else []))
            .properties(width=alt.Step(7), height=150, title=f"{m} · {s}: {label}")
            for label in MEASURES.values()]))
    return alt.hconcat(*columns).properties(title=title(
        "Method comparison per task: tokens/s, speedup over ar, tau", bench,
        notes=["dashed: 1.0 (ar's speed; one token per step); avg: the mean over tasks, its speedup with the "
               "95% interval (bootstrap over the tasks)"]))


def draft_time_by_phase(phases: pl.DataFrame, bench: pl.DataFrame):
    """MicroSpec Fig. 4: draft ms per drafted step, stacked by phase (`tables.phase_times`, the phases some
    run spent time in), per task; a facet row per run, a column per model and prompt set."""
    runs = phases["run"].unique(maintain_order=True).to_list()
    bars = alt.Chart(phases).mark_bar().encode(
        x=alt.X("task:N", sort=tables.task_order(phases), title=None, axis=alt.Axis(labelAngle=-40)),
        y=alt.Y("ms:Q", title="ms per drafted step", stack=True),
        color=alt.Color("phase:N", sort=list(PHASES), title="phase", scale=alt.Scale(scheme="set2")),
        order=alt.Order("phase_order:Q"),
        tooltip=["model", "prompt_set", "task", "run", "phase", alt.Tooltip("ms:Q", format=".2f"),
                 alt.Tooltip("draft_ms:Q", format=".2f", title="draft ms (all)")])
    bars = bars.transform_calculate(phase_order=f"indexof({list(PHASES)}, datum.phase)")
    return (alt.hconcat(*[
        bars.transform_filter(_where(model=m, prompt_set=s)).properties(width=alt.Step(18), height=110)
        .facet(row=alt.Row("run:N", sort=runs, title=None,
                           header=alt.Header(labelFontWeight="bold", labelAngle=0, labelAlign="left")))
        .properties(title=f"{m} · {s}") for m, s in keys(phases, "model", "prompt_set")])
            .properties(title=title(
                "Draft time per drafted step by drafter phase, per task (MicroSpec Fig. 4)", bench,
                notes=["backbone: the drafter's layers; router: DynaSpec's cluster router (dynaspec runs); gather: "
                       "copying the window's LM-head rows; lm_head: the (restricted) head; tree: building the draft "
                       "tree"])))


def dynaspec_choices(shaped: pl.DataFrame):
    """DynaSpec's unstated choices (`tables.dynaspec_choices`): per fit a row of three panels (M, router width,
    L varied alone around the centre, drawn black in each): held-out token recall against the mean shortlist
    per row, a point per token budget, DynaSpec-PA; dashed grey: the static baseline at the centre's M."""
    lo, hi = shaped["mean_row_vocab"].min(), shaped["mean_row_vocab"].max()
    x = log2_axis("mean_row_vocab:Q", "mean shortlist per row (tokens, log)",
                  POW2 if hi / max(lo, 1.0) <= 2 ** 7 else POW4)
    y = alt.Y("token_recall:Q", title="held-out token recall (share)", scale=alt.Scale(domain=[0, 1]))
    tips = ["setting:N", "budget_tokens:Q", "k_max:Q", alt.Tooltip("mean_row_vocab:Q", format=".0f"),
            alt.Tooltip("token_recall:Q", format=".3f"), alt.Tooltip("top1_hit:Q", format=".3f")]
    short = {"num_clusters": "M", "router_width": "width", "top_l": "L"}
    fits, rows, centres = shaped["fit"].unique(maintain_order=True).to_list(), [], []
    for fit_name in fits:
        part = shaped.filter(pl.col("fit") == fit_name)
        c = part.filter(pl.col("centre")).select(*tables.CHOICE_FACTORS).row(0, named=True)
        centres.append(f"M {c['num_clusters']}, router width {c['router_width']}, L {c['top_l']}"
                       + (f" ({fit_name})" if len(fits) > 1 else ""))
        panels = []
        for factor in tables.CHOICE_FACTORS.values():
            panel = part.filter(pl.col("factor") == factor)
            router = panel.filter(pl.col("series") == "router")
            settings = router.sort("value")["setting"].unique(maintain_order=True).to_list()
            centre = router.filter(pl.col("centre"))["setting"][0]
            lines = alt.Chart(router).mark_line(point=True, strokeWidth=2).encode(
                x=x, y=y, detail="setting:N", tooltip=tips,
                color=alt.Color("setting:N", sort=settings, title=factor, scale=highlight_scale(settings, centre),
                                legend=alt.Legend(orient="bottom", direction="vertical")))
            static = alt.Chart(panel.filter(pl.col("series") == "static")).mark_line(
                color="rgb(136, 136, 136)", strokeDash=[5, 4], point=alt.OverlayMarkDef(color="rgb(136, 136, 136)", size=20)).encode(
                x=x, y=y, tooltip=tips)
            fixed = ", ".join(f"{short[k]} {c[k]}" for k, name in tables.CHOICE_FACTORS.items() if name != factor)
            panels.append(alt.layer(static, lines).properties(
                width=260, height=220, title=alt.TitleParams(
                    factor + (f" · {fit_name}" if len(fits) > 1 else ""), subtitle=f"{fixed} fixed")))
        rows.append(alt.hconcat(*panels).resolve_scale(color="independent"))
    drafters = ", ".join(shaped["drafter"].unique(maintain_order=True).to_list())
    return alt.vconcat(*rows).properties(title=title(
        f"DynaSpec's unstated choices on {', '.join(shaped['model'].unique(maintain_order=True).to_list())} "
        f"({drafters}): held-out token recall vs shortlist size, M, router width and L varied one at a time",
        shaped, notes=[
            f"centre (black in every panel): {'; '.join(centres)}; lines: DynaSpec-PA, a point per token budget "
            f"({', '.join(map(str, sorted(shaped['budget_tokens'].unique().to_list())))} tokens at draft steps 0-1)",
            "dashed grey: the static baseline at the centre M (clusters ranked by their training-label frequency)"]))


# ----------------------------------------------------------------------------------------------------------
# 04: UniSpec's speedup per language (Fig. 4)
# ----------------------------------------------------------------------------------------------------------

def speedup_by_language(langs: pl.DataFrame, bench: pl.DataFrame):
    """UniSpec Fig. 4 (`tables.language_speedup`): speedup over ar and tau per language and run, a column per
    model and prompt set."""
    runs = tables.run_order(langs)
    base = alt.Chart(langs).mark_bar(**(BAR_OUTLINE if len(runs) > 20 else {})).encode(
        x=alt.X("task:N", sort=tables.task_order(langs), title="language", axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("run:N", sort=runs),
        **series_channels("run", runs, RUN_TITLE, mark="bar"),
        tooltip=["model", "prompt_set", "task", "run", alt.Tooltip("speedup:Q", format=".2f"),
                 alt.Tooltip("tau:Q", format=".2f"), alt.Tooltip("tokens_per_s:Q", format=".1f"), "rows"])
    one = alt.Chart(pl.DataFrame({"y": [1.0]})).mark_rule(strokeDash=[4, 3], color="rgb(51, 51, 51)").encode(y="y:Q")
    columns = []
    for m, s in keys(langs, "model", "prompt_set"):
        part = base.transform_filter(_where(model=m, prompt_set=s))
        speed = alt.layer(part.encode(y=alt.Y("speedup:Q", title=MEASURES["speedup"])), one)
        tau = alt.layer(part.encode(y=alt.Y("tau:Q", title=MEASURES["tau"])), one)
        columns.append(alt.vconcat(speed.properties(width=alt.Step(8), height=200, title=f"{m} · {s}"),
                                   tau.properties(width=alt.Step(8), height=150)))
    return alt.hconcat(*columns).properties(title=title(
        "Speedup over ar and tau per language (UniSpec Fig. 4)",
        bench.filter(pl.col("prompt_set").is_in(langs["prompt_set"].unique().to_list())),
        notes=["dashed: 1.0 (ar); avg: the mean over languages"]))


# ----------------------------------------------------------------------------------------------------------
# 05: languages
# ----------------------------------------------------------------------------------------------------------

def coverage_by_language(by_lang: pl.DataFrame, vocab: pl.DataFrame, multilingual: pl.DataFrame,
                         record: pl.DataFrame | None = None):
    """Coverage of generated tokens per language, a row per model: against w_max (`tables.window_coverage`
    by task), and against vocabulary size beside the static shortlists (`tables.coverage_vs_vocab`)."""
    langs = by_lang["task"].unique().sort().to_list()
    series = series_channels("task", langs, "language")
    left = alt.Chart(by_lang).mark_line(point=True).encode(
        x=log2_axis("w_max:Q", W_MAX_AXIS, ticks=POW2),
        y=alt.Y("coverage:Q", title="coverage of generated tokens (%)", axis=alt.Axis(format="%"),
                scale=alt.Scale(zero=False)),
        **series, tooltip=["model", "task", "w_max", alt.Tooltip("coverage:Q", format=".1%"),
                           alt.Tooltip("mean_active_vocab:Q", format=".0f"), "tokens"])
    right = alt.Chart(vocab).mark_line(point=True).encode(
        x=log2_axis("vocab:Q", "vocabulary size (tokens; window: mean active)"),
        y=alt.Y("coverage:Q", title="coverage of generated tokens (%)", axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1])),
        color=series["color"],
        strokeDash=alt.StrokeDash("series:N", title=None, legend=stroke_legend(),
                                  scale=alt.Scale(domain=[tables.WINDOW, tables.STATIC], range=[[1, 0], [6, 4]])),
        detail="series:N",
        tooltip=["model", "task", "series", "w_max", "k", alt.Tooltip("vocab:Q", format=".0f"),
                 alt.Tooltip("coverage:Q", format=".1%")])
    rows = [alt.hconcat(
        left.transform_filter(_where(model=m)).properties(width=330, height=240,
                                                          title=f"MicroSpec window vs w_max · {m}"),
        right.transform_filter(_where(model=m)).properties(
            width=330, height=240, title=f"window (solid) vs static top-K of the training corpus (dashed) · {m}"))
        for (m,) in keys(by_lang, "model")]
    return alt.vconcat(*rows).properties(title=title("Coverage of generated tokens per language", multilingual,
                                                     record))
