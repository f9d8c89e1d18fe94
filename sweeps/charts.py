"""The figure notebooks' charts (altair): shared pieces, the chart builders, and `save_chart`.

Each builder takes tables from `sweeps.tables` (polars; the measures are `engine.metrics`') and returns an altair
chart; a notebook reads a sweep, calls a table builder and a chart builder, and saves and shows what it got. No
torch at import (tests/test_layering.py).

A sweep may hold several models (`paper.toml` has three): every chart that draws bench or coverage results
splits them - a facet row (`model_row`), or a row of panels, per model (and prompt set), the model named in its
header or title; axes are shared within a facet and titled with their units. Each panel names the tokens (or
drafted nodes) it rests on; each subtitle says how its measure averages (the unweighted mean over tasks, or
token-weighted: every task's generated tokens pooled); a drawn speed carries ar's reference (its bars, or a
dotted line); a figure whose split the sweep lacks is not drawn, and one printed line says why (`skip`).
Colours: tableau10 up to 10 series, category20 up to 20, and above 20 a second channel (the line's dash or
the point's shape, a bar's outline dash) that tells apart series of one colour (`series_channels`). Every
quantitative y axis has a title with its unit.

Over 600 lines on purpose: one builder per figure of the five notebooks, each short and independent, beside
the shared pieces they all use (splitting by notebook would duplicate those pieces or scatter them).

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


def skip(what: str, why: str) -> None:
    """Print the one line a notebook shows for a figure it does not draw, and return None."""
    print(f"skipped {what}: {why}")
    return None


def model_row(models: Sequence[str], labels: bool = True) -> alt.Row:
    """The facet row of a chart drawn per model: one row per model, labelled with its name (`labels`: off for
    the second and later facets of an hconcat, whose rows the first one's labels name)."""
    return alt.Row("model:N", sort=list(models), title=None,
                   header=alt.Header(labelFontWeight="bold", labelFontSize=13, labelOrient="left", labels=labels))


def model_task_grid(chart: alt.LayerChart, models: Sequence[str], columns: Sequence[str]) -> alt.FacetChart:
    """A layered panel of the standard size as a grid: a facet row per model (`model_row`), a column per task
    (the `column` field, `task_column`)."""
    return chart.properties(width=PANEL_W, height=PANEL_H).facet(
        row=model_row(models),
        column=alt.Column("column:N", sort=list(columns), title=None, header=alt.Header(labelFontWeight="bold")))


def token_note(n: int | None, what: str = "generated tokens") -> str:
    """The token count a panel rests on, as drawn in its corner ("12,345 generated tokens")."""
    return f"{int(n):,} {what}" if n is not None else f"? {what}"


def corner_text(width: int | None = None, height: int | None = None) -> alt.Chart:
    """A text mark pinned to a panel's top-left corner (right: `width`, the panel's width; bottom: `height`,
    its height) drawing `text` of the rows whose `layer` is "tokens": the token count the panel rests on."""
    return alt.Chart().transform_filter(alt.datum.layer == "tokens").mark_text(
        align="right" if width else "left", baseline="bottom" if height else "top", fontSize=10,
        color="rgb(68, 68, 68)").encode(x=alt.value(width - 4 if width else 4),
                                        y=alt.value(height - 4 if height else 4), text="text:N")


def task_column(frame: pl.DataFrame) -> pl.Expr:
    """The facet column of a per-task chart: the task, prefixed with the prompt set when there are several."""
    if frame["prompt_set"].n_unique() > 1:
        return pl.col("prompt_set") + " · " + pl.col("task")
    return pl.col("task")


def _where(**equal) -> alt.expr.core.Expression:
    """A filter predicate: every column equal to its value (`alt.datum.model == "tiny"` and so on)."""
    pred = None
    for col, value in equal.items():
        p = alt.datum[col] == value
        pred = p if pred is None else pred & p
    return pred


# ----------------------------------------------------------------------------------------------------------
# 01: coverage against vocabulary size (MicroSpec Fig. 1b), LRU against FIFO
# ----------------------------------------------------------------------------------------------------------

VOCAB_AXIS = "vocabulary (tokens, log)"               # short: a facet repeats it under every column
COVERAGE_AXIS = "coverage (%)"                          # of generated tokens: the subtitles say how it averages
TOKEN_WEIGHTED = ("token-weighted: generated tokens inside the vocabulary / all generated tokens of the task, "
                  "its prompts pooled")
STAR = "M0,-1L0.24,-0.33L0.95,-0.31L0.39,0.12L0.59,0.81L0,0.4L-0.59,0.81L-0.39,0.12L-0.95,-0.31L-0.24,-0.33Z"
PANEL_W, PANEL_H = 190, 140                                 # one task's panel in the per-task grids of 01


def _panel_tokens(frame: pl.DataFrame, keys: Sequence[str]) -> pl.DataFrame:
    """One "tokens" row per panel (`keys`): the generated tokens it rests on (the largest `tokens` of its
    rows: every point of a panel is computed over the same traces) as `text`."""
    return (frame.group_by(*keys).agg(pl.col("tokens").max())
            .with_columns(layer=pl.lit("tokens"),
                          text=pl.col("tokens").map_elements(token_note, return_dtype=pl.String)))


def window_points(table: pl.DataFrame) -> pl.DataFrame:
    """The window's points of `tables.coverage_vs_vocab`, one per distinct (mean active vocabulary,
    coverage) in each panel: w_max values whose windows never filled give the same point, drawn once and
    labelled with all of them (`w_max_label` "3072 = 8192", `merged` true)."""
    win = table.filter(pl.col("series") == tables.WINDOW).with_columns(
        _v=pl.col("vocab").round(3), _c=pl.col("coverage").round(6))
    return (win.sort("w_max").group_by("model", "prompt_set", "task", "column", "_v", "_c", maintain_order=True)
            .agg(pl.col("vocab", "coverage", "tokens", "series").first(), pl.col("w_max").min(),
                 w_max_label=pl.col("w_max").cast(pl.String).str.join(" = "), merged=pl.len() > 1)
            .drop("_v", "_c").sort("model", "column", "w_max"))


def coverage_vs_vocab(table: pl.DataFrame | None, coverage: pl.DataFrame | None,
                      record: pl.DataFrame | None = None):
    """MicroSpec Fig. 1(b) (`tables.coverage_vs_vocab`): coverage of generated tokens against the draft
    vocabulary size, a facet row per model and a column per task: the window's stars (one per w_max at its
    mean active vocabulary; w_max values giving the same point drawn once and labelled "3072 = 8192") and
    the static top-K shortlists (dashed); each panel names the generated tokens it rests on. None when the
    table is None (`tables.coverage_vs_vocab` printed why)."""
    if table is None:
        return None
    table = table.with_columns(column=task_column(table))
    models, columns = sorted(table["model"].unique()), sorted(table["column"].unique())
    stars = window_points(table).with_columns(layer=pl.lit("window"))
    labels = stars["w_max_label"].unique(maintain_order=True).to_list()
    data = pl.concat([table.filter(pl.col("series") == tables.STATIC).with_columns(layer=pl.lit("static")), stars,
                      _panel_tokens(table, ["model", "column"])], how="diagonal_relaxed")
    x = log2_axis("vocab:Q", VOCAB_AXIS)
    y = alt.Y("coverage:Q", title=COVERAGE_AXIS, scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"))
    tip = ["model", "column", "series", "w_max_label", "k", alt.Tooltip("vocab:Q", format=".0f"),
           alt.Tooltip("coverage:Q", format=".1%"), "tokens"]
    static = alt.Chart().transform_filter(alt.datum.layer == "static").mark_line(
        strokeDash=[6, 4], color="rgb(85, 85, 85)", point=alt.OverlayMarkDef(color="rgb(85, 85, 85)", size=18)
    ).encode(x=x, y=y, tooltip=tip)
    window = alt.Chart().transform_filter(alt.datum.layer == "window")
    trail = window.mark_line(color="#bbb", strokeWidth=1).encode(x=x, y=y, order="w_max:Q")
    star = window.mark_point(shape=STAR, filled=True, size=140, opacity=0.9).encode(
        x=x, y=y, tooltip=tip, color=alt.Color("w_max_label:N", sort=labels, title="window w_max (entries)",
                                               scale=color_scale(len(labels))))
    label = window.transform_filter(alt.datum.merged).mark_text(
        align="left", dx=7, dy=-9, fontSize=9, color="rgb(34, 34, 34)").encode(x=x, y=y, text="w_max_label:N")
    chart = model_task_grid(alt.layer(static, trail, star, label, corner_text(), data=data), models, columns)
    return chart.properties(title=title(
        "Coverage vs draft vocabulary size, per model and task (MicroSpec Fig. 1b)", coverage, record,
        notes=["stars: MicroSpec's window, one per w_max, at its mean active vocabulary; \"3072 = 8192\": the "
               "window never filled, both w_max give this point; dashed grey: static top-K shortlists (FR-Spec) "
               "ranked on the training corpus",
               f"coverage of generated tokens, {TOKEN_WEIGHTED}; top left: the generated tokens the panel rests on"]))


def lru_vs_fifo(miss: pl.DataFrame | None, coverage: pl.DataFrame | None, record: pl.DataFrame | None = None):
    """The miss ratio of an LRU vocabulary of C tokens against MicroSpec's FIFO window of the same mean size
    (`tables.miss_ratios`), a facet row per model and a column per task; each panel names the generated
    tokens it rests on. None when the table is None (`tables.miss_ratios` printed why)."""
    if miss is None:
        return None
    miss = miss.with_columns(column=task_column(miss))
    models, columns = sorted(miss["model"].unique()), sorted(miss["column"].unique())
    data = pl.concat([miss.with_columns(layer=pl.lit("curve")), _panel_tokens(miss, ["model", "column"])],
                     how="diagonal_relaxed")
    policies = [tables.FIFO, tables.LRU]
    lines = alt.Chart().transform_filter(alt.datum.layer == "curve").mark_line(point=True).encode(
        x=log2_axis("mean_active_vocab:Q", "mean active vocab (tokens, log)"),
        y=alt.Y("miss_ratio:Q", title="miss ratio (%)", axis=alt.Axis(format="%"),
                scale=alt.Scale(domainMin=0)),
        color=alt.Color("policy:N", title=None, scale=alt.Scale(domain=policies, range=["#1f77b4", "#d62728"]),
                        legend=alt.Legend(orient="top", symbolType="stroke", symbolStrokeWidth=3,
                                          symbolFillColor="transparent")),
        strokeDash=alt.StrokeDash("policy:N", title=None, scale=alt.Scale(domain=policies, range=[[1, 0], [6, 3]])),
        tooltip=["model", "column", "policy", "capacity", "w_max", alt.Tooltip("mean_active_vocab:Q", format=".0f"),
                 alt.Tooltip("miss_ratio:Q", format=".1%"), "tokens"])
    # LRU's dashes drawn over FIFO's solid line: where the two coincide both stay visible
    fifo, lru = (lines.transform_filter(alt.datum.policy == name) for name in policies)
    chart = model_task_grid(alt.layer(fifo, lru, corner_text(PANEL_W), data=data), models, columns)
    return chart.properties(title=title(
        "Miss ratio per model and task: LRU vocabulary vs FIFO window at equal mean size", coverage, record,
        notes=["LRU: the C most recently used tokens of the candidate stream; FIFO: MicroSpec's window, its w_max "
               "chosen to match the LRU's mean active vocabulary; where the curves coincide the red dashes lie on "
               "the blue line",
               "miss ratio: token-weighted, generated tokens outside the vocabulary / all generated tokens of the "
               "task, its prompts pooled; top right: the generated tokens the panel rests on"]))


# ----------------------------------------------------------------------------------------------------------
# 02: sensitivity to w_max, k_pre and k_ver (MicroSpec Fig. 5)
# ----------------------------------------------------------------------------------------------------------

W_MAX_AXIS = "w_max (candidate-stream entries)"


def wmax_sensitivity(window: pl.DataFrame | None, sweep: pl.DataFrame | None, bench: pl.DataFrame | None,
                     coverage: pl.DataFrame | None, record: pl.DataFrame | None = None):
    """MicroSpec Fig. 5, a facet row per model: the window's coverage against w_max (`tables.window_coverage`,
    with the bench drafts' draft_coverage where `tables.wmax_sweep` has it; y from 0 to 100%), then
    tokens/s and tau against w_max of each drafter with MicroSpec's window (solid), the same drafter with the
    full vocabulary (dashed) and ar (dotted), both y axes from 0. Each panel names the generated tokens it
    rests on. None (one printed line) when neither the coverage nor the bench sweep ran."""
    if window is None and sweep is None:
        return skip("the w_max sensitivity", "neither window coverage cells nor a bench w_max sweep in the results")
    models = sorted(set(window["model"] if window is not None else []) | set(sweep["model"] if sweep is not None
                                                                                else []))
    panels, notes = [], []
    x = log2_axis("w_max:Q", W_MAX_AXIS, ticks=POW2)
    size = dict(width=230, height=170)
    if window is not None:
        cov = window.select("model", "prompt_set", "w_max", "coverage", "tokens", source=pl.lit("traces"))
        if sweep is not None:
            drafts = sweep.select("model", "prompt_set", "w_max", pl.col("draft_coverage").alias("coverage"),
                                  pl.col("new_tokens").alias("tokens"), source=pl.lit("bench drafts"))
            cov = pl.concat([cov, drafts], how="vertical_relaxed")
        one_set = cov["prompt_set"].n_unique() == 1
        cov = cov.with_columns(layer=pl.lit("curve"), series=pl.col("source") if one_set
                               else pl.col("prompt_set") + " · " + pl.col("source"))
        counts = (cov.group_by("model", "source", "w_max").agg(pl.col("tokens").sum())
                  .group_by("model", "source").agg(pl.col("tokens").max()).sort("source", descending=True)
                  .group_by("model", maintain_order=True)
                  .agg(text=pl.lit("per w_max: ") + pl.format("{} {}", "source", pl.col("tokens").map_elements(
                      lambda n: f"{n:,}", return_dtype=pl.String)).str.join(", ") + pl.lit(" generated tokens"))
                  .with_columns(layer=pl.lit("tokens")))
        series = cov["series"].unique().sort().to_list()
        line = alt.Chart().transform_filter(alt.datum.layer == "curve").mark_line(point=True).encode(
            x=x, y=alt.Y("coverage:Q", title=COVERAGE_AXIS, axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1])),
            color=alt.Color("series:N", sort=series, title="coverage measured on",
                            scale=color_scale(len(series)), legend=alt.Legend(orient="bottom", direction="vertical")),
            strokeDash=alt.StrokeDash("source:N", title=None, legend=None, scale=alt.Scale(
                domain=["traces", "bench drafts"], range=[[1, 0], [6, 4]])),
            tooltip=["model", "prompt_set", "source", "w_max", alt.Tooltip("coverage:Q", format=".1%"), "tokens"])
        panels.append(alt.layer(line, corner_text(), data=pl.concat([cov, counts], how="diagonal_relaxed"))
                      .properties(**size).facet(row=model_row(models)).properties(title="window coverage"))
        notes.append("coverage: token-weighted, generated tokens inside the window / all generated tokens, every "
                     "task of the prompt set pooled (traces: the coverage cells; bench drafts: the bench's own "
                     "turns); the tables' draft_coverage likewise")
    if sweep is not None:
        one_set = sweep["prompt_set"].n_unique() == 1
        name = pl.col("drafter") if one_set else pl.col("drafter") + " · " + pl.col("prompt_set")
        ar_name = pl.lit("ar") if one_set else pl.lit("ar · ") + pl.col("prompt_set")
        refs = [tables.WINDOW, "full vocabulary", "ar (no drafter)"]
        keys = ["model", "prompt_set", "drafter", "w_max", "default", "rows", "new_tokens"]
        long = pl.concat([
            sweep.select(*keys, "tokens_per_s", "tau", series=name, reference=pl.lit(refs[0])),
            sweep.select(*keys, tokens_per_s="full_tokens_per_s", tau="full_tau", series=name,
                         reference=pl.lit(refs[1])),
            sweep.select(*keys, tokens_per_s="ar_tokens_per_s", tau=pl.lit(1.0), series=ar_name,
                         reference=pl.lit(refs[2])).unique(["model", "prompt_set", "w_max"], maintain_order=True),
        ], how="vertical_relaxed").filter(pl.col("tokens_per_s").is_not_null()).with_columns(layer=pl.lit("curve"))
        counts = (sweep.group_by("model", "w_max").agg(pl.col("new_tokens").sum()).group_by("model")
                  .agg(pl.col("new_tokens").max())
                  .select("model", layer=pl.lit("tokens"), text=pl.col("new_tokens").map_elements(
                      lambda n: "per w_max: " + token_note(n, "generated tokens (bench)"), return_dtype=pl.String)))
        data = pl.concat([long, counts], how="diagonal_relaxed")
        series = long["series"].unique(maintain_order=True).to_list()
        tip = ["model", "prompt_set", "drafter", "reference", "w_max", alt.Tooltip("tokens_per_s:Q", format=".1f"),
               alt.Tooltip("tau:Q", format=".2f"), "rows", "new_tokens"]
        enc = dict(x=x, color=alt.Color("series:N", sort=series, title="drafter", scale=color_scale(len(series)),
                                        legend=alt.Legend(orient="bottom", direction="vertical")),
                   strokeDash=alt.StrokeDash("reference:N", title="line", sort=refs, legend=stroke_legend(
                       orient="bottom", direction="vertical"), scale=alt.Scale(
                       domain=refs, range=[[1, 0], [6, 4], [2, 2]])), tooltip=tip)
        curve = alt.Chart().transform_filter(alt.datum.layer == "curve")
        for field, label in (("tokens_per_s", "tokens/s (new tokens per second)"),
                             ("tau", "tau (tokens per step)")):
            y = alt.Y(f"{field}:Q", title=label, scale=alt.Scale(zero=True, nice=True))
            lines = curve.mark_line(strokeWidth=2).encode(y=y, **enc)
            points = curve.transform_filter(alt.datum.reference == refs[0]).mark_point(filled=True, size=30).encode(
                x=x, y=y, color=enc["color"], tooltip=tip)
            best = curve.transform_filter((alt.datum.reference == refs[0]) & alt.datum.default).mark_point(
                shape="diamond", size=160, filled=True, color="rgb(34, 34, 34)").encode(x=x, y=y, tooltip=tip)
            panels.append(alt.layer(lines, points, best, corner_text(size["width"], size["height"]), data=data)
                          .properties(**size).facet(row=model_row(models, labels=not panels))
                          .properties(title=label.split(" (")[0]))
        notes.append("tokens/s: the mean over the bench turns of every task; tau: new tokens / steps, every task "
                     "pooled; solid: MicroSpec's window; dashed: the same drafter, full vocabulary; dotted: ar "
                     f"(tau 1); diamond: the paper's default w_max {tables.DEFAULTS.w_max}")
    return alt.hconcat(*panels).resolve_scale(color="independent", strokeDash="independent").properties(
        title=title("Sensitivity to the window size w_max (MicroSpec Fig. 5)",
                    bench if sweep is not None else coverage, record, notes=notes))


def _counts_text(frame: pl.DataFrame, keys: Sequence[str], prefix: str, what: str = "generated tokens",
                 tokens: str = "tokens") -> pl.DataFrame:
    """One "tokens" row per panel (`keys`): `prefix` and the largest `tokens` of its rows (every point of
    the panel is computed over the same traces) as `text`."""
    return (frame.group_by(*keys).agg(pl.col(tokens).max().alias("_n"))
            .select(*keys, layer=pl.lit("tokens"), text=pl.col("_n").map_elements(
                lambda n: prefix + token_note(n, what), return_dtype=pl.String)))


def kpre_kver_sensitivity(grid: pl.DataFrame | None, coverage: pl.DataFrame | None,
                          record: pl.DataFrame | None = None):
    """The window's coverage and mean active vocabulary against w_max for each (k_pre, k_ver)
    (`tables.window_coverage(..., at_default=False)`): a facet row per model, a column per prompt set; each
    panel names the generated tokens each point rests on. None when `grid` is None (`tables.window_coverage`
    printed why)."""
    if grid is None:
        return None
    models = sorted(grid["model"].unique())
    x = log2_axis("w_max:Q", W_MAX_AXIS, ticks=POW2)
    enc = dict(x=x, color=alt.Color("k_pre:O", title="k_pre", scale=alt.Scale(scheme="dark2")),
               strokeDash=alt.StrokeDash("k_ver:O", title="k_ver", legend=stroke_legend()),
               detail="stream:N",
               tooltip=["model", "prompt_set", "stream", "w_max", alt.Tooltip("coverage:Q", format=".1%"),
                        alt.Tooltip("mean_active_vocab:Q", format=".0f"), "tokens"])
    data = pl.concat([grid.with_columns(layer=pl.lit("curve")),
                      _counts_text(grid, ["model", "prompt_set"], "per point: ")], how="diagonal_relaxed")
    curve = alt.Chart().transform_filter(alt.datum.layer == "curve").mark_line(point=True)
    size = dict(width=260, height=200)
    facet = dict(row=model_row(models),
                 column=alt.Column("prompt_set:N", title=None, header=alt.Header(labelFontWeight="bold")))
    cov_chart = alt.layer(curve.encode(
        y=alt.Y("coverage:Q", title=COVERAGE_AXIS, axis=alt.Axis(format="%"), scale=alt.Scale(zero=False)), **enc),
        corner_text(size["width"], size["height"]), data=data).properties(**size).facet(**facet)
    vocab_chart = alt.layer(curve.encode(
        y=alt.Y("mean_active_vocab:Q", title="mean active vocabulary (tokens, log)", scale=alt.Scale(type="log")),
        **enc), corner_text(), data=data).properties(**size).facet(**facet)
    return alt.vconcat(cov_chart, vocab_chart).properties(title=title(
        "Window coverage and size for each k_pre, k_ver (a row per model)", coverage, record,
        notes=["k_pre: top-k rows of the prefill that enter the stream; k_ver: top-k rows of each verify step "
               "(MicroSpec §3.2)",
               "coverage: token-weighted, generated tokens inside the window / all generated tokens, every task "
               "of the prompt set pooled; mean active vocabulary: its token-weighted mean likewise; corner: the "
               "generated tokens each point rests on"]))


# ----------------------------------------------------------------------------------------------------------
# 03: methods (MicroSpec Table 2, Fig. 4) and DynaSpec's choices
# ----------------------------------------------------------------------------------------------------------

MEASURES = {"tokens_per_s": "tokens/s (new tokens per second)", "speedup": "speedup over ar (×)",
            "tau": "tau (tokens per step)"}
RUN_TITLE = "method · vocabulary"


ALL_RUNS = "generated tokens, all runs"             # what a bench figure's panel title counts


def _bench_tokens(bench: pl.DataFrame, keys: Sequence[str] = ("model", "prompt_set")) -> dict[tuple, int]:
    """Generated tokens per `keys` in the bench rows (every run), for the panel titles."""
    return {tuple(r[:-1]): r[-1] for r in bench.group_by(*keys).agg(pl.col("new_tokens").sum()).rows()}


def run_labels(summary: pl.DataFrame) -> dict[str, str]:
    """Each run's legend label: the run and its draft size (`tables.run_extras`: "eagle · full (draft 60)"),
    the run alone where no row says."""
    if "draft_size" not in summary.columns:
        return {r: r for r in tables.run_order(summary)}
    sizes = dict(summary.group_by("run").agg(pl.col("draft_size").drop_nulls().first()).rows())
    return {r: f"{r} (draft {sizes[r]})" if sizes.get(r) else r for r in tables.run_order(summary)}


def methods_table(summary: pl.DataFrame, bench: pl.DataFrame):
    """MicroSpec Table 2's layout as a drawn table (`tables.table_cells`), one per model and prompt set (a
    row of the figure each): a row per run, its draft size, tokens/s per task, the average with its speedup
    over ar and that speedup's 95% interval, the decode phase's speedup and its interval, the average tau;
    cells coloured by speedup; each table's title names the generated tokens it rests on."""
    cells = tables.table_cells(summary)
    runs, columns = tables.run_order(summary), [t for t in tables.task_order(summary) if t != AVG]
    columns = [tables.DRAFT_SIZE, *columns, "avg tokens/s (× ar)", "95% CI (× ar)", "decode × ar", "decode 95% CI",
               "avg tau"]
    base = alt.Chart(cells).encode(
        x=alt.X("column:N", sort=columns, title=None, axis=alt.Axis(orient="top", labelAngle=-40)),
        y=alt.Y("run:N", sort=runs, title=RUN_TITLE))
    rect = base.mark_rect().encode(color=alt.Color(
        "speedup:Q", title="speedup over ar (×)",
        scale=alt.Scale(scheme="redyellowgreen", domainMid=1.0), legend=alt.Legend(format=".2f")))
    text = base.mark_text(fontSize=11).encode(text="text:N")
    tokens = _bench_tokens(bench)
    # one table per model and prompt set (Vega-Lite cannot facet layers with independent axes)
    return (alt.vconcat(*[alt.layer(rect, text).transform_filter(_where(model=m, prompt_set=s))
                          .properties(width=alt.Step(62), height=alt.Step(22),
                                      title=f"{m} · {s} ({token_note(tokens.get((m, s)), ALL_RUNS)})")
                          for m, s in keys(summary, "model", "prompt_set")])
            .properties(title=title(
                "Tokens/s per task, average speedup over ar and average tau (MicroSpec Table 2's layout)", bench,
                notes=["cell colour: speedup over ar on that task; draft size: the nodes (tokens) a step drafts; "
                       "avg: the unweighted mean over tasks (tokens/s, tau), its speedup over ar's avg",
                       "95% CI: bootstrap over the tasks, each task's turns paired with ar's (the spread of "
                       "this run's timings, not the machine's drift between runs)",
                       "decode × ar: the same without the prefill and the drafter's pass over the prompt"])))


def methods_speed(summary: pl.DataFrame, bench: pl.DataFrame):
    """Table 2 as bars: tokens/s, speedup over ar and tau per task and run (ar included: the speed reference),
    a row of three panels per model and prompt set; runs labelled with their draft size (`run_labels`); the
    average's speedup bars carry their 95% interval."""
    labels = run_labels(summary)
    runs = [labels[r] for r in tables.run_order(summary)]
    summary = summary.with_columns(series=pl.col("run").replace_strict(labels))
    long = summary.unpivot(index=["model", "prompt_set", "task", "series"], on=list(MEASURES),
                           variable_name="measure").with_columns(pl.col("measure").replace_strict(MEASURES))
    bars = alt.Chart(long).mark_bar(**(BAR_OUTLINE if len(runs) > 20 else {})).encode(
        x=alt.X("task:N", sort=tables.task_order(summary), title="task", axis=alt.Axis(labelAngle=-40)),
        xOffset=alt.XOffset("series:N", sort=runs),
        **series_channels("series", runs, f"{RUN_TITLE} (draft size)", mark="bar", labelLimit=400),
        tooltip=["model", "prompt_set", "task", "series", "measure", alt.Tooltip("value:Q", format=".2f")])
    one = alt.Chart(pl.DataFrame({"measure": [MEASURES["speedup"], MEASURES["tau"]], "y": [1.0, 1.0]})
                    ).mark_rule(strokeDash=[4, 3], color="rgb(51, 51, 51)")
    # the average's 95% interval (engine.metrics speedup_lo / _hi: bootstrap over the tasks) on its speedup bar
    avg = summary.filter((pl.col("task") == AVG) & pl.col("speedup_lo").is_not_null()).select(
        "model", "prompt_set", "task", "series", "speedup_lo", "speedup_hi", measure=pl.lit(MEASURES["speedup"]))
    whiskers = alt.Chart(avg).mark_rule(color="rgb(17, 17, 17)", strokeWidth=1.5).encode(
        x=alt.X("task:N", sort=tables.task_order(summary)), xOffset=alt.XOffset("series:N", sort=runs),
        y=alt.Y("speedup_lo:Q", title=MEASURES["speedup"]), y2="speedup_hi:Q",
        tooltip=["series", alt.Tooltip("speedup_lo:Q", format=".2f"), alt.Tooltip("speedup_hi:Q", format=".2f")])
    tokens = _bench_tokens(bench)
    rows = []
    for m, s in keys(summary, "model", "prompt_set"):
        rows.append(alt.hconcat(*[
            alt.layer(bars.encode(y=alt.Y("value:Q", title=label, scale=alt.Scale(zero=True)))
                      .transform_filter(_where(model=m, prompt_set=s, measure=label)),
                      one.encode(y=alt.Y("y:Q", title=label)).transform_filter(alt.datum.measure == label),
                      *([whiskers.transform_filter(_where(model=m, prompt_set=s))]
                        if label == MEASURES["speedup"] and avg.height else []))
            .properties(width=alt.Step(6), height=150, title=label.split(" (")[0])
            for label in MEASURES.values()]).properties(title=alt.TitleParams(
                f"{m} · {s}", subtitle=token_note(tokens.get((m, s)), ALL_RUNS), fontSize=14, anchor="start")))
    return alt.vconcat(*rows).properties(title=title(
        "Method comparison per task: tokens/s, speedup over ar, tau (a row per model)", bench,
        notes=["ar: the speed reference (its bars; dashed: 1.0, ar's speedup and tau); avg: the unweighted mean "
               "over tasks, its speedup with the 95% interval (bootstrap over the tasks)"]))


def draft_time_by_phase(phases: pl.DataFrame | None, bench: pl.DataFrame):
    """MicroSpec Fig. 4: draft ms per drafted step, stacked by phase (`tables.phase_times`, the phases some
    run spent time in), per task: a row of panels per model and prompt set, a panel per run, each naming the
    generated tokens of its run's turns. None when `phases` is None (`tables.phase_times` printed why)."""
    if phases is None:
        return None
    runs = tables.run_order(phases)
    tokens = tables.with_run(bench).group_by("model", "prompt_set", "run").agg(pl.col("new_tokens").sum())
    # each panel's header: its run and the generated tokens of that run's turns
    data = phases.join(tokens, on=["model", "prompt_set", "run"], how="left").with_columns(
        head=pl.col("run") + "|" + pl.col("new_tokens").map_elements(token_note, return_dtype=pl.String))
    bars = alt.Chart(data).transform_calculate(
        phase_order=f"indexof({list(PHASES)}, datum.phase)").mark_bar().encode(
        x=alt.X("task:N", sort=tables.task_order(phases), title=None, axis=alt.Axis(labelAngle=-40)),
        y=alt.Y("ms:Q", title="draft time (ms per drafted step)", stack=True),
        color=alt.Color("phase:N", sort=list(PHASES), title="phase", scale=alt.Scale(scheme="set2")),
        order=alt.Order("phase_order:Q"),
        tooltip=["model", "prompt_set", "task", "run", "phase", alt.Tooltip("ms:Q", format=".2f"),
                 alt.Tooltip("draft_ms:Q", format=".2f", title="draft ms (all)"), "new_tokens"])
    rows = []
    for m, s in keys(phases, "model", "prompt_set"):
        heads = dict(data.filter(_model_set(m, s)).select("run", "head").unique().rows())
        rows.append(bars.transform_filter(_where(model=m, prompt_set=s))
                    .properties(width=alt.Step(24), height=130)
                    .facet(column=alt.Column("head:N", sort=[heads[r] for r in runs if r in heads], title=None,
                                             header=alt.Header(labelFontWeight="bold",
                                                               labelExpr="split(datum.value, '|')")))
                    .properties(title=alt.TitleParams(f"{m} · {s}", fontSize=14, anchor="start")))
    return alt.vconcat(*rows).properties(title=title(
        "Draft time per drafted step by drafter phase, per task (MicroSpec Fig. 4; a row per model)", bench,
        notes=["backbone: the drafter's layers; router: DynaSpec's cluster router (dynaspec runs); gather: copying "
               "the window's LM-head rows; lm_head: the (restricted) head; tree: building the draft tree",
               "ms per drafted step: the phase's seconds / the drafted steps (steps - 1), every turn of the task "
               "pooled (step-weighted); avg: the unweighted mean over tasks; under each run: the generated tokens "
               "of its turns"]))


def tau_by_source(parts: pl.DataFrame | None, bench: pl.DataFrame):
    """tau by source and task (`tables.tau_by_source`): per task a bar per run - the merged drafter's and its
    sources' alone - stacked by the source of the committed tokens (the target's bonus tokens at the bottom), a
    row per model and prompt set. None when `parts` is None (`tables.tau_by_source` printed why)."""
    if parts is None:
        return None
    sources = [*tables.MERGE_SOURCES, tables.TARGET_PART]
    runs = parts["run"].unique(maintain_order=True).to_list()
    bars = alt.Chart(parts).transform_calculate(
        source_order=f"indexof({sources[::-1]}, datum.source)").mark_bar().encode(
        x=alt.X("run:N", sort=runs, title=None, axis=alt.Axis(labelAngle=-40, labelLimit=120)),
        y=alt.Y("tau_part:Q", title="tau (tokens per step)", stack=True),
        color=alt.Color("source:N", sort=sources, title="committed by", scale=alt.Scale(scheme="set2")),
        order=alt.Order("source_order:Q"),
        tooltip=["model", "prompt_set", "task", "run", "source", alt.Tooltip("tau_part:Q", format=".2f"),
                 alt.Tooltip("tau:Q", format=".2f"), "steps"])
    tokens = _bench_tokens(bench)
    rows = [bars.transform_filter(_where(model=m, prompt_set=s)).properties(width=alt.Step(18), height=150)
            .facet(column=alt.Column("task:N", sort=tables.task_order(parts), title=None))
            .properties(title=alt.TitleParams(f"{m} · {s}", subtitle=token_note(tokens.get((m, s)), ALL_RUNS),
                                              fontSize=14, anchor="start"))
            for m, s in keys(parts, "model", "prompt_set")]
    return alt.vconcat(*rows).properties(title=title(
        "tau by source and task: the merged tree against its sources alone (a row per model)", bench,
        notes=["a source's part: the draft tokens it placed that the target committed, per step (every turn of the "
               "task pooled, step-weighted); target: the bonus tokens; the bar's height is the run's tau",
               "merged: one tree from the draft head and the n-gram sources under the same node budget; avg: the "
               "unweighted mean over tasks"]))


def _model_set(model: str, prompt_set: str) -> pl.Expr:
    return (pl.col("model") == model) & (pl.col("prompt_set") == prompt_set)


def dynaspec_choices(shaped: pl.DataFrame):
    """DynaSpec's unstated choices (`tables.dynaspec_choices`): per fit a row of three panels (M, router width,
    L varied alone around the centre, drawn black in each): held-out token recall against the mean shortlist
    per row, a point per token budget, DynaSpec-PA; dashed grey: the static baseline at the centre's M. A
    row per fit (the model named in its panels' titles when there are several), each panel naming the
    held-out draft rows it rests on."""
    lo, hi = shaped["mean_row_vocab"].min(), shaped["mean_row_vocab"].max()
    x = log2_axis("mean_row_vocab:Q", "mean shortlist per row (tokens, log)",
                  POW2 if hi / max(lo, 1.0) <= 2 ** 7 else POW4)
    y = alt.Y("token_recall:Q", title="held-out token recall (%)", scale=alt.Scale(domain=[0, 1]),
              axis=alt.Axis(format="%"))
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
            # every setting is scored on the fit's held-out rows: the panel rests on the most any point used
            held = token_note(panel["rows"].max() if "rows" in panel.columns else None, "held-out draft rows")
            panels.append(alt.layer(static, lines).properties(
                width=260, height=220, title=alt.TitleParams(
                    factor + (f" · {fit_name}" if len(fits) > 1 else ""), subtitle=f"{fixed} fixed · {held}")))
        rows.append(alt.hconcat(*panels).resolve_scale(color="independent"))
    drafters = ", ".join(shaped["drafter"].unique(maintain_order=True).to_list())
    return alt.vconcat(*rows).properties(title=title(
        f"DynaSpec's unstated choices on {', '.join(shaped['model'].unique(maintain_order=True).to_list())} "
        f"({drafters}): held-out token recall vs shortlist size, M, router width and L varied one at a time",
        shaped, notes=[
            f"centre (black in every panel): {'; '.join(centres)}; lines: DynaSpec-PA, a point per token budget "
            f"({', '.join(map(str, sorted(shaped['budget_tokens'].unique().to_list())))} tokens at draft steps 0-1)",
            "dashed grey: the static baseline at the centre M (clusters ranked by their training-label frequency)",
            "token recall: per held-out draft row, the share of the full head's top-L tokens inside its shortlist, "
            "averaged over the rows (row-weighted, every held-out prompt pooled); shortlist: its mean over the "
            "rows"]))


# ----------------------------------------------------------------------------------------------------------
# 04: UniSpec's speedup per language (Fig. 4)
# ----------------------------------------------------------------------------------------------------------

def speedup_by_language(langs: pl.DataFrame | None, bench: pl.DataFrame):
    """UniSpec Fig. 4 (`tables.language_speedup`): speedup over ar and tau per language and run (ar included:
    1.0), a row per model and prompt set. None when `langs` is None (the sweep has no set split by language;
    `tables.language_speedup` printed why)."""
    if langs is None:
        return None
    labels = run_labels(langs)
    runs = [labels[r] for r in tables.run_order(langs)]
    langs = langs.with_columns(series=pl.col("run").replace_strict(labels))
    base = alt.Chart(langs).mark_bar(**(BAR_OUTLINE if len(runs) > 20 else {})).encode(
        x=alt.X("task:N", sort=tables.task_order(langs), title="language",
                axis=alt.Axis(labelAngle=-40, labelLimit=90)),
        xOffset=alt.XOffset("series:N", sort=runs),
        **series_channels("series", runs, f"{RUN_TITLE} (draft size)", mark="bar", labelLimit=400),
        tooltip=["model", "prompt_set", "task", "series", alt.Tooltip("speedup:Q", format=".2f"),
                 alt.Tooltip("tau:Q", format=".2f"), alt.Tooltip("tokens_per_s:Q", format=".1f"), "rows"])
    one = alt.Chart(pl.DataFrame({"y": [1.0]})).mark_rule(strokeDash=[4, 3], color="rgb(51, 51, 51)")
    tokens = _bench_tokens(bench)
    rows = []
    for m, s in keys(langs, "model", "prompt_set"):
        part = base.transform_filter(_where(model=m, prompt_set=s))
        speed, tau = (alt.layer(part.encode(y=alt.Y(f"{field}:Q", title=MEASURES[field], scale=alt.Scale(zero=True))),
                                one.encode(y=alt.Y("y:Q", title=MEASURES[field]))) for field in ("speedup", "tau"))
        rows.append(alt.hconcat(speed.properties(width=alt.Step(6), height=170, title="speedup over ar"),
                                tau.properties(width=alt.Step(6), height=170, title="tau")).properties(
            title=alt.TitleParams(f"{m} · {s}", subtitle=token_note(tokens.get((m, s)), ALL_RUNS), fontSize=14,
                                  anchor="start")))
    return alt.vconcat(*rows).properties(title=title(
        "Speedup over ar and tau per language (UniSpec Fig. 4; a row per model)",
        bench.filter(pl.col("prompt_set").is_in(langs["prompt_set"].unique().to_list())),
        notes=["dashed: 1.0 (ar's speedup and tau); speedup: a run's mean tokens/s over ar's on the same language; "
               "avg: the unweighted mean over languages"]))


# ----------------------------------------------------------------------------------------------------------
# 04: UniSpec's calibration (App. F) and g* per device (Fig. 5)
# ----------------------------------------------------------------------------------------------------------

CAL_AXES = {"tau": "tau(g) (tokens per step)", "s_step_ms": "s(g) (ms per step)",
            "tokens_per_s": "tau/s (tokens per second)"}                 # the y title of each quantity's panel
CAL_NOTE = ("tau(g): generated tokens / steps, the calibration prompts pooled (token-weighted); s(g): the median "
            "over the prompts of each prompt's seconds per step; tau/s: their ratio")


def _calibration_tokens(calibrate: pl.DataFrame) -> dict[str, int]:
    """Per model: the generated tokens of the calibration's measured points (`measured_new_tokens`, summed
    over every setting and g), None where the cells do not say."""
    if "measured_new_tokens" not in calibrate.columns:
        return {}
    rows = calibrate.filter(pl.col("curve") == "measured")
    return dict(rows.group_by("model").agg(pl.col("measured_new_tokens").sum()).rows())


def calibration_fits(curves: pl.DataFrame | None, calibrate: pl.DataFrame, bench: pl.DataFrame | None = None):
    """UniSpec App. F (`tables.calibration_curves`): per model a row of three panels, the measured tau(g),
    s(g) and tau/s (points), their fits (lines) and g* (diamond), a colour per method and device; the row's
    title names the calibration's generated tokens; ar's reference where the bench ran it on the model: its
    mean tokens/s (dotted, tau/s panel) and tau 1 (dotted). None when `curves` is None
    (`tables.calibration_curves` printed why)."""
    if curves is None:
        return None
    tokens = _calibration_tokens(calibrate)
    ar = ({} if bench is None or "method" not in bench.columns else
          dict(bench.filter(pl.col("method") == "ar").group_by("model").agg(pl.col("tokens_per_s").mean()).rows()))
    refs = pl.DataFrame([{"model": m, "quantity": tables.QUANTITIES[q], "y": v}
                         for m in curves["model"].unique().to_list()
                         for q, v in (("tau", 1.0), ("tokens_per_s", ar.get(m))) if v is not None],
                        schema={"model": pl.String, "quantity": pl.String, "y": pl.Float64})
    rows = []
    for (m,) in keys(curves, "model"):
        part = curves.filter(pl.col("model") == m)
        settings = part["setting"].unique(maintain_order=True).to_list()
        series = series_channels("setting", settings, "model · method · device", orient="bottom",
                                 direction="vertical", labelLimit=600)
        base = alt.Chart(part).encode(x=alt.X("g:Q", title="draft size g (nodes per step, root excluded)"),
                                      color=series.pop("color"))
        tip = ["setting", "curve", alt.Tooltip("g:Q", format=".1f"), alt.Tooltip("value:Q", format=".3f"), "g_star"]
        panels = []
        for q, label in tables.QUANTITIES.items():
            y = alt.Y("value:Q", title=CAL_AXES[q], scale=alt.Scale(zero=q != "s_step_ms"))
            mine = base.transform_filter(alt.datum.quantity == label)
            fit = mine.transform_filter(alt.datum.curve == "fit").mark_line(strokeWidth=2).encode(
                y=y, detail="setting:N", **series)
            measured = mine.transform_filter(alt.datum.curve == "measured").mark_point(size=60, filled=True).encode(
                y=y, tooltip=tip)
            star = mine.transform_filter(alt.datum.curve == "g_star").mark_point(
                shape="diamond", size=220, filled=True, stroke="black", strokeWidth=1).encode(y=y, tooltip=tip)
            ref = alt.Chart(refs.filter((pl.col("model") == m) & (pl.col("quantity") == label))).mark_rule(
                strokeDash=[2, 2], color="rgb(51, 51, 51)").encode(y=alt.Y("y:Q", title=CAL_AXES[q]))
            panels.append(alt.layer(fit, measured, star, ref).properties(width=240, height=190,
                                                                         title=label.split(": ")[0]))
        rows.append(alt.hconcat(*panels).properties(title=alt.TitleParams(
            m, subtitle=token_note(tokens.get(m), "generated tokens (calibration, every setting and g)"),
            fontSize=14, anchor="start")))
    return alt.vconcat(*rows).properties(title=title(
        "Device-aware calibration: measured and fitted tau(g), s(g), tau/s; g* maximises tau/s (UniSpec App. F; "
        "a row per model)", calibrate,
        notes=["points: measured on the calibration prompts; lines: the fits; diamond: g* as it runs (on a CPU: at "
               "its row bucket's largest tree); dotted: ar (tau 1; its mean tokens/s over the bench turns on the "
               "model, where the bench ran ar)", CAL_NOTE]))


def g_star_by_device(stars: pl.DataFrame | None, calibrate: pl.DataFrame):
    """UniSpec Fig. 5 (`tables.g_stars`): the calibrated g* per device and setting (a bar each, g* written on
    it), a facet row per model naming the calibration's generated tokens. None when `stars` is None
    (`tables.g_stars` printed why)."""
    if stars is None:
        return None
    tokens = _calibration_tokens(calibrate)
    settings = stars["setting"].unique(maintain_order=True).to_list()
    heads = {m: f"{m}|{token_note(tokens.get(m), 'generated tokens (calibration)')}" for m in stars["model"].unique()}
    data = stars.with_columns(head=pl.col("model").replace_strict(heads))
    base = alt.Chart(data).encode(
        x=alt.X("device:N", title="device (torch threads in the name on CPUs)",
                axis=alt.Axis(labelAngle=0, labelLimit=300)),
        xOffset=alt.XOffset("setting:N", sort=settings), y=alt.Y("g_star:Q", title="g* (draft nodes per step)"),
        **series_channels("setting", settings, "model · method · device", mark="bar", orient="bottom",
                          direction="vertical", labelLimit=600),
        tooltip=["setting", "g_star", *[c for c in ("g_continuous", "predicted_tokens_per_s") if c in stars.columns]])
    chart = alt.layer(base.mark_bar(**(BAR_OUTLINE if len(settings) > 20 else {})),
                      base.mark_text(dy=-8, fontSize=13).encode(text="g_star:Q")).properties(
        width=alt.Step(60), height=200).facet(row=alt.Row(
            "head:N", sort=[heads[m] for m in sorted(heads)], title=None,
            header=alt.Header(labelFontWeight="bold", labelFontSize=13, labelOrient="left",
                              labelExpr="split(datum.value, '|')"))).resolve_scale(xOffset="independent")
    return chart.properties(title=title(
        "Calibrated optimal draft size g* per device (UniSpec Fig. 5; a row per model)", calibrate,
        notes=["g*: the draft size of the largest fitted tau/s, " + CAL_NOTE.replace("tau(g)", "tau")
               + "; each row names the calibration's generated tokens"]))


MIN_NODES, MIN_SHARE = 30, 0.005   # a confidence bin's acceptance rate is drawn from this many proposed nodes
                                    # and this share of its panel's nodes up: rarer bins swing 0 <-> 100%


def acceptance_vs_confidence(conf: pl.DataFrame | None, bench: pl.DataFrame, min_nodes: int = MIN_NODES,
                             min_share: float = MIN_SHARE):
    """UniSpec Fig. 3 (`tables.confidence_bins`): per model (a row each) and method (a panel each), the
    acceptance rate of draft nodes against their confidence score (line, left axis, 0-100%) where a bin holds
    at least `min_nodes` proposed nodes and `min_share` of the panel's, and the share of all drafted nodes per
    bin (bars, right axis, one domain for every panel); each panel names its drafted nodes. None when `conf`
    is None."""
    if conf is None:
        return None
    top = float(conf["density"].max() or 1.0)
    conf = conf.with_columns(shown_rate=pl.when((pl.col("proposed") >= min_nodes) & (pl.col("density") >= min_share))
                             .then(pl.col("acceptance_rate")))
    x = alt.X("bin_lo:Q", title="confidence score of the draft node (bin)", scale=alt.Scale(domain=[0, 1]))
    tip = ["model", "method", alt.Tooltip("bin_lo:Q", title="score from"), alt.Tooltip("bin_hi:Q", title="score to"),
           "proposed", "accepted", alt.Tooltip("acceptance_rate:Q", format=".1%"),
           alt.Tooltip("density:Q", format=".1%")]
    base = alt.Chart(conf)
    density = base.mark_bar(color="#bbb", opacity=0.8, binSpacing=1).encode(
        x=x, x2="bin_hi:Q", y=alt.Y("density:Q", title="share of drafted nodes (%, bars)",
                                    scale=alt.Scale(domain=[0, top], nice=True),
                                    axis=alt.Axis(format="%", orient="right", grid=False)),
        y2=alt.datum(0), tooltip=tip)
    rate = base.transform_filter("isValid(datum.shown_rate)").transform_calculate(
        mid="(datum.bin_lo + datum.bin_hi) / 2").mark_line(
        color="#d62728", strokeWidth=2.5, point=alt.OverlayMarkDef(color="#d62728", size=40)).encode(
        x=alt.X("mid:Q", title="confidence score of the draft node (bin)", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("shown_rate:Q", title="acceptance rate (%, line)", scale=alt.Scale(domain=[0, 1]),
                axis=alt.Axis(format="%", titleColor="#d62728")), tooltip=tip)
    nodes = {(m, d): n for m, d, n in conf.group_by("model", "method").agg(pl.col("proposed").sum()).rows()}
    rows = []
    for (m,) in keys(conf, "model"):
        # one panel per method: Vega-Lite cannot facet layers with independent y axes
        rows.append(alt.hconcat(*[
            alt.layer(density, rate).transform_filter(_where(model=m, method=d)).resolve_scale(y="independent")
            .properties(width=260, height=180, title=f"{m} · {d} ({token_note(nodes[(m, d)], 'drafted nodes')})")
            for (d,) in keys(conf.filter(pl.col("model") == m), "method")]))
    return alt.vconcat(*rows).properties(title=title(
        "Acceptance rate against the draft node's confidence score (UniSpec Fig. 3; a row per model)", bench,
        notes=[f"line: accepted / proposed nodes per score bin, every bench step pooled (node-weighted), drawn where "
               f"a bin holds at least {min_nodes} nodes and {min_share:.1%} of the panel's; bars: the bin's share "
               f"of the panel's drafted nodes (one scale, 0-{top:.0%}, in every panel)"]))


# ----------------------------------------------------------------------------------------------------------
# 05: languages
# ----------------------------------------------------------------------------------------------------------

def reuse_distance_by_language(dist: pl.DataFrame | None, multilingual: pl.DataFrame,
                               record: pl.DataFrame | None = None):
    """The reuse-distance distribution per language (`tables.distances`, metric reuse_distance): the share of
    generated tokens per power-of-two bin (top) and its cumulative share (bottom, = the coverage of a FIFO
    window that long), a facet row per model and a column per stream; each panel names the generated tokens
    it rests on. None when `dist` is None (`tables.distances` printed why)."""
    if dist is None:
        return None
    reuse = dist.filter(pl.col("metric") == "reuse_distance").with_columns(
        stream=pl.col("stream").replace({"generated": "generated tokens only",
                                         "candidate": "MicroSpec candidate stream"}))
    if reuse.is_empty():
        return skip("reuse distances per language", "the distances cells hold no reuse_distance metric")
    models, langs = sorted(reuse["model"].unique()), reuse["task"].unique().sort().to_list()
    counts = (reuse.group_by("model", "stream", "task").agg(pl.col("tokens").first())
              .group_by("model", "stream").agg(pl.col("tokens").sum())
              .select("model", "stream", layer=pl.lit("tokens"),
                      text=pl.col("tokens").map_elements(token_note, return_dtype=pl.String)))
    data = pl.concat([reuse.with_columns(layer=pl.lit("curve")), counts], how="diagonal_relaxed")
    enc = dict(x=log2_axis("bin_hi:Q", "reuse distance (stream entries, log; bin upper edge)", ticks=POW2),
               **series_channels("task", langs, "language"),
               tooltip=["model", "task", "stream", "bin_lo", "bin_hi", "count", "tokens",
                        alt.Tooltip("fraction:Q", format=".1%"), alt.Tooltip("cum_fraction:Q", format=".1%"),
                        alt.Tooltip("new_fraction:Q", format=".1%", title="never seen before")])
    facet = dict(row=model_row(models), column=alt.Column("stream:N", title=None, header=alt.Header(
        labelFontWeight="bold", labelFontSize=13)))
    curve = alt.Chart().transform_filter(alt.datum.layer == "curve")
    size = dict(width=300, height=180)
    share = alt.layer(curve.mark_line(point=True).encode(
        y=alt.Y("fraction:Q", title="share of generated tokens (%)", axis=alt.Axis(format="%")), **enc),
        corner_text(size["width"], size["height"]), data=data).properties(**size).facet(**facet)
    cdf = alt.layer(curve.mark_line(point=True, interpolate="step-after").encode(
        y=alt.Y("cum_fraction:Q", title="cumulative share (%)", axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1])), **enc),
        corner_text(size["width"], size["height"]), data=data).properties(**size).facet(**facet)
    return alt.vconcat(share, cdf).properties(title=title(
        "Reuse-distance distributions of generated tokens, per language (a row per model)", multilingual, record,
        notes=["reuse distance: stream entries since the token's last occurrence; top: share per power-of-two bin; "
               "bottom: cumulative, = the coverage of a FIFO window that long (never-seen tokens keep it below 100%)",
               "shares: token-weighted, every prompt of the language pooled; corner: the generated tokens of the "
               "panel's languages"]))


def coverage_by_language(by_lang: pl.DataFrame | None, vocab: pl.DataFrame | None, multilingual: pl.DataFrame,
                         record: pl.DataFrame | None = None):
    """Coverage of generated tokens per language, a row per model: against w_max (`tables.window_coverage`
    by task), and against vocabulary size beside the static shortlists (`tables.coverage_vs_vocab`); each
    panel names the generated tokens each of its points rests on. None when either table is None (its
    builder printed why)."""
    if by_lang is None or vocab is None:
        return None
    langs = by_lang["task"].unique().sort().to_list()
    series = series_channels("task", langs, "language")
    y = alt.Y("coverage:Q", title=COVERAGE_AXIS, axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1]))
    size = dict(width=330, height=240)
    left_data = pl.concat([by_lang.with_columns(layer=pl.lit("curve")),
                           _counts_text(by_lang.group_by("model", "w_max").agg(pl.col("tokens").sum()), ["model"],
                                        "per w_max: ")], how="diagonal_relaxed")
    right_data = pl.concat([vocab.with_columns(layer=pl.lit("curve")),
                            _counts_text(vocab.group_by("model", "series", "vocab").agg(pl.col("tokens").sum()),
                                         ["model"], "per point: ")], how="diagonal_relaxed")
    curve = alt.Chart().transform_filter(alt.datum.layer == "curve")
    left = curve.mark_line(point=True).encode(
        x=log2_axis("w_max:Q", W_MAX_AXIS, ticks=POW2), y=y,
        **series, tooltip=["model", "task", "w_max", alt.Tooltip("coverage:Q", format=".1%"),
                           alt.Tooltip("mean_active_vocab:Q", format=".0f"), "tokens"])
    right = curve.mark_line(point=True).encode(
        x=log2_axis("vocab:Q", "vocabulary size (tokens, log; window: mean active)"), y=y,
        color=series["color"],
        strokeDash=alt.StrokeDash("series:N", title=None, legend=stroke_legend(),
                                  scale=alt.Scale(domain=[tables.WINDOW, tables.STATIC], range=[[1, 0], [6, 4]])),
        detail="series:N",
        tooltip=["model", "task", "series", "w_max", "k", alt.Tooltip("vocab:Q", format=".0f"),
                 alt.Tooltip("coverage:Q", format=".1%"), "tokens"])
    rows = [alt.hconcat(
        alt.layer(left, corner_text(size["width"], size["height"]), data=left_data)
        .transform_filter(_where(model=m)).properties(**size, title=f"MicroSpec window vs w_max · {m}"),
        alt.layer(right, corner_text(size["width"], size["height"]), data=right_data)
        .transform_filter(_where(model=m)).properties(
            **size, title=f"window (solid) vs static top-K of the training corpus (dashed) · {m}"))
        for (m,) in keys(by_lang, "model")]
    return alt.vconcat(*rows).properties(title=title(
        "Coverage of generated tokens per language (a row per model)", multilingual, record,
        notes=[f"coverage: {TOKEN_WEIGHTED.replace('the task', 'the language')}; corner: the generated tokens "
               "each point rests on (every language of the model)"]))
