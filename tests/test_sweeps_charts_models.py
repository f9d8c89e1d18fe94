"""The figures of a sweep that holds two models (`tests/charts_testing.py`: SmolLM2 and Gemma, four Spec-Bench
categories, ar / pld / unispec / eagle with the full vocabulary and MicroSpec's window): one facet row (or
row of panels) per model, every quantitative axis titled with its unit, each panel naming the tokens it rests
on, coincident window points drawn once and labelled, ar's reference wherever a speed is drawn, y axes from 0
where a reference would otherwise sit on the x axis, the draft size in the methods tables, and a figure whose
split is absent skipped with one line. The Vega-Lite specs are read as dicts; the expected numbers are
computed here from the synthetic rows."""

from __future__ import annotations

import polars as pl
import pytest

pytest.importorskip("altair", reason="the notebooks extra (pip install -e '.[notebooks]') is not installed")

from specvocab.sweeps import charts, tables  # noqa: E402
from tests.charts_testing import (DRAFT_SIZE, LANGUAGES, MODELS, NEVER_FILLS, W_MAX, bench_rows,  # noqa: E402
                                  calibrate_rows, choices_rows, coverage_rows, grid_rows, language_rows)


@pytest.fixture(scope="module")
def bench() -> pl.DataFrame:
    return bench_rows()


@pytest.fixture(scope="module")
def coverage() -> pl.DataFrame:
    return coverage_rows()


@pytest.fixture(scope="module")
def summary(bench) -> pl.DataFrame:
    return tables.method_summary(bench)


def walk(node, visit, key=None):
    """Call visit(key, dict) on every dict of a spec (key: the dict's key in its parent)."""
    if isinstance(node, dict):
        visit(key, node)
        for k, v in node.items():
            walk(v, visit, k)
    elif isinstance(node, list):
        for v in node:
            walk(v, visit, key)


def rows(spec: dict, **equal) -> list[dict]:
    """The inline data rows of a spec (every dataset) whose fields equal `equal`."""
    return [r for data in spec.get("datasets", {}).values() for r in data
            if all(r.get(k) == v for k, v in equal.items())]


def axes(spec: dict) -> list[dict]:
    """Every x / y encoding of a quantitative field in a spec."""
    out = []

    def visit(key, node):
        if key == "encoding":
            for channel in ("x", "y"):
                enc = node.get(channel)
                if isinstance(enc, dict) and "field" in enc and enc.get("type") == "quantitative":
                    out.append(enc)
    walk(spec, visit)
    return out


def token_text(frame: pl.DataFrame, keys: list[str]) -> dict[tuple, str]:
    return {tuple(r[:-1]): charts.token_note(r[-1]) for r in frame.group_by(*keys).agg(pl.col("tokens").sum()).rows()}


def test_coverage_figures_have_a_facet_row_per_model_and_name_their_tokens(coverage):
    """coverage_vs_vocab and lru_vs_fifo: a row facet on `model` and a column per task (no wrap that mixes
    models within a row); every panel's corner text is the generated tokens of its task's traces (summed
    over the task's prompts at one w_max / capacity, not over every point)."""
    built = {"window": (charts.coverage_vs_vocab(tables.coverage_vs_vocab(coverage), coverage), "w_max", W_MAX[0]),
             "miss_ratio": (charts.lru_vs_fifo(tables.miss_ratios(coverage), coverage), "capacity", 1024)}
    for analysis, (chart, axis, at) in built.items():
        spec = chart.to_dict()
        row, column = spec["facet"].get("row", {}), spec["facet"].get("column", {})
        assert (row.get("field"), row.get("sort")) == ("model", sorted(MODELS))
        assert column.get("field") == "column" and "columns" not in spec
        want = token_text(coverage.filter((pl.col("analysis") == analysis) & (pl.col(axis) == at)),
                          ["model", "category"])
        got = {(r["model"], r["column"]): r["text"] for r in rows(spec, layer="tokens")}
        assert got == want and len(got) == len(MODELS) * 4


def test_window_points_that_coincide_are_drawn_once_and_labelled(coverage):
    """A window that never fills gives the same (vocabulary, coverage) at both w_max: one star labelled
    "3072 = 8192" (and a text mark drawing that label); elsewhere one star per w_max."""
    spec = charts.coverage_vs_vocab(tables.coverage_vs_vocab(coverage), coverage).to_dict()
    stars = rows(spec, layer="window")
    for model in MODELS:
        for task in {r["column"] for r in stars}:
            mine = sorted(r["w_max_label"] for r in stars if r["model"] == model and r["column"] == task)
            if (model, task) == NEVER_FILLS:
                assert mine == [" = ".join(map(str, W_MAX))]
            else:
                assert mine == sorted(map(str, W_MAX))
    texts = []
    walk(spec, lambda k, n: texts.append(n) if k == "encoding" and n.get("text", {}).get("field") == "w_max_label"
         else None)
    assert texts, "no text mark labels the merged window points"


def test_wmax_sensitivity_draws_ar_and_full_references_from_zero(bench, coverage):
    """A facet row per model in each of three panels (coverage, tokens/s, tau); tokens/s and tau axes start at
    0 and coverage spans 0-100%; the dotted ar line is ar's mean tokens/s on that model and the dashed full
    line the eagle drafter's with the full vocabulary, both computed here from the rows."""
    chart = charts.wmax_sensitivity(tables.window_coverage(coverage), tables.wmax_sweep(bench), bench, coverage)
    spec = chart.to_dict()
    assert len(spec["hconcat"]) == 3
    assert [p["facet"]["row"]["field"] for p in spec["hconcat"]] == ["model"] * 3
    scales = {enc["field"]: enc.get("scale", {}) for enc in axes(spec) if enc["field"] != "w_max"}
    assert scales["tokens_per_s"].get("zero") is True and scales["tau"].get("zero") is True
    assert scales["coverage"]["domain"] == [0, 1]
    for model in MODELS:
        mine = bench.filter(pl.col("model") == model)
        ar = rows(spec, model=model, reference="ar (no drafter)")
        assert ar and [r["tokens_per_s"] for r in ar] == pytest.approx(
            [mine.filter(pl.col("method") == "ar")["tokens_per_s"].mean()] * len(ar))
        full = rows(spec, model=model, reference="full vocabulary")
        assert full and [r["tokens_per_s"] for r in full] == pytest.approx(
            [mine.filter((pl.col("method") == "eagle") & (pl.col("policy") == "full"))["tokens_per_s"].mean()]
            * len(full))
        # each point of the panels rests on one w_max's turns (the same prompts at every w_max)
        bench_n = mine.filter(pl.col("policy") == "microspec").group_by("vocab_size").agg(
            pl.col("new_tokens").sum())["new_tokens"]
        traces_n = coverage.filter((pl.col("model") == model) & (pl.col("analysis") == "window")).group_by(
            "w_max").agg(pl.col("tokens").sum())["tokens"]
        assert bench_n.n_unique() == 1 and traces_n.n_unique() == 1
        assert sorted(r["text"] for r in rows(spec, model=model, layer="tokens")) == sorted([
            f"per w_max: traces {traces_n[0]:,}, bench drafts {bench_n[0]:,} generated tokens",
            "per w_max: " + charts.token_note(bench_n[0], "generated tokens (bench)")])


# ----------------------------------------------------------------------------------------------------------
# The figures of 02 (k_pre, k_ver), 03 (phases, DynaSpec's choices), 04 (calibration, g*) and 05 (languages)
# ----------------------------------------------------------------------------------------------------------

def notebook_figures(bench, summary) -> dict:
    """The figures of 02 (k_pre, k_ver), 03 (phases, choices), 04 (calibration, g*) and 05 (languages), built
    from the synthetic rows (`tests/charts_testing.py`)."""
    grid, cal, langs = grid_rows(), calibrate_rows(), tables.languages_only(language_rows(), "languages")
    return {
        "kpre_kver_sensitivity": charts.kpre_kver_sensitivity(tables.window_coverage(grid, at_default=False), grid),
        "draft_time_by_phase": charts.draft_time_by_phase(tables.phase_times(summary), bench),
        "dynaspec_choices": charts.dynaspec_choices(tables.dynaspec_choices(choices_rows())),
        "calibration_fits": charts.calibration_fits(tables.calibration_curves(cal), cal, bench),
        "g_star_by_device": charts.g_star_by_device(tables.g_stars(cal), cal),
        "reuse_distance_by_language": charts.reuse_distance_by_language(tables.distances(langs), langs),
        "coverage_by_language": charts.coverage_by_language(tables.window_coverage(langs, by=("task",)),
                                                            tables.coverage_vs_vocab(langs), langs),
    }


def test_every_axis_has_a_title_with_its_unit(bench, coverage, summary):
    langs = tables.method_summary(bench_rows(languages=True))
    built = {
        "coverage_vs_vocab": charts.coverage_vs_vocab(tables.coverage_vs_vocab(coverage), coverage),
        "lru_vs_fifo": charts.lru_vs_fifo(tables.miss_ratios(coverage), coverage),
        "wmax_sensitivity": charts.wmax_sensitivity(tables.window_coverage(coverage), tables.wmax_sweep(bench),
                                                    bench, coverage),
        "methods_speed": charts.methods_speed(summary, bench),
        "acceptance_vs_confidence": charts.acceptance_vs_confidence(tables.confidence_bins(bench), bench),
        "speedup_by_language": charts.speedup_by_language(tables.language_speedup(langs), bench),
        **notebook_figures(bench, summary),
    }
    assert all(chart is not None for chart in built.values())
    for name, chart in built.items():
        found = axes(chart.to_dict())
        assert found, name
        bad = [(e["field"], e.get("title")) for e in found
               if not isinstance(e.get("title"), str) or "(" not in e["title"] or ")" not in e["title"]]
        assert not bad, f"{name}: axes without a title naming a unit: {bad}"


def test_the_draft_size_reaches_the_methods_tables(bench, summary):
    wide = tables.methods_wide(summary)
    sizes = dict(wide.filter(pl.col("model") == MODELS[0]).select("run", tables.DRAFT_SIZE).rows())
    assert sizes["eagle · full"] == str(DRAFT_SIZE) and sizes["ar"] is None
    cells = tables.table_cells(summary)
    drawn = cells.filter((pl.col("column") == tables.DRAFT_SIZE) & (pl.col("run") == "eagle · microspec 3072"))
    assert drawn["text"].to_list() == [str(DRAFT_SIZE)] * len(MODELS)
    table = charts.methods_table(summary, bench).to_dict()
    xs = []
    walk(table, lambda k, n: xs.append(n["x"]["sort"]) if k == "encoding" and "sort" in n.get("x", {}) else None)
    assert xs and all(x[0] == tables.DRAFT_SIZE for x in xs)
    for _, one_head, _ in tables.one_head_tables(bench):
        assert dict(one_head.select("run", "draft_size").rows())["eagle · full"] == str(DRAFT_SIZE)
    legend = []
    walk(charts.methods_speed(summary, bench).to_dict(),
         lambda k, n: legend.append(n["sort"]) if k == "color" and n.get("field") == "series" else None)
    assert legend and f"eagle · full (draft {DRAFT_SIZE})" in legend[0] and "ar" in legend[0]


def test_the_draft_size_is_optional_and_names_its_source(bench):
    bare = tables.method_summary(bench_rows(draft_size=False))
    assert tables.methods_wide(bare)[tables.DRAFT_SIZE].null_count() == bare.select("model", "prompt_set",
                                                                                    "run").unique().height
    charts.methods_table(bare, bench).to_dict()                   # builds without the column
    sourced = bench.with_columns(draft_size_source=pl.when(pl.col("method") == "eagle").then(pl.lit("calibrated")))
    wide = tables.methods_wide(tables.method_summary(sourced))
    assert set(wide.filter(pl.col("run") == "eagle · full")[tables.DRAFT_SIZE]) == {f"{DRAFT_SIZE}, calibrated"}
    assert set(wide.filter(pl.col("run") == "pld")[tables.DRAFT_SIZE]) == {"10"}


def test_a_figure_whose_split_is_absent_is_skipped_with_one_line(summary, bench, capsys):
    """No prompt set split by language: Spec-Bench's categories are not drawn as languages."""
    capsys.readouterr()
    assert tables.language_speedup(summary) is None
    assert charts.speedup_by_language(None, bench) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("skipped speedup per language: ")
    assert charts.wmax_sensitivity(None, None, bench, None) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("skipped the w_max sensitivity: ")
    # with a set split by language: its languages only, a row of panels per model, slanted labels
    with_langs = bench_rows(languages=True)
    langs = tables.language_speedup(tables.method_summary(with_langs))
    assert set(langs["task"]) == {*LANGUAGES, tables.AVG} and set(langs["prompt_set"]) == {"multilingual"}
    spec = charts.speedup_by_language(langs, with_langs).to_dict()
    assert len(spec["vconcat"]) == len(MODELS)
    for row, model in zip(spec["vconcat"], sorted(MODELS)):
        assert row["title"]["text"].startswith(model)
        angles = []
        walk(row, lambda k, n: angles.append(n["axis"]["labelAngle"]) if k == "x" and "axis" in n else None)
        assert angles and all(a != 0 for a in angles)


def test_acceptance_vs_confidence_shares_its_density_axis_and_hides_sparse_bins(bench):
    conf = tables.confidence_bins(bench)
    spec = charts.acceptance_vs_confidence(conf, bench).to_dict()
    assert len(spec["vconcat"]) == len(MODELS)
    for row, model in zip(spec["vconcat"], sorted(MODELS)):
        assert all(p["title"].startswith(f"{model} · ") for p in row["hconcat"])
    domains = [e.get("scale", {}).get("domain") for e in axes(spec) if e["field"] == "density"]
    assert len(domains) == conf.select("model", "method").unique().height
    assert all(d == [0, pytest.approx(conf["density"].max())] for d in domains)
    drawn = rows(spec)
    sparse = [r for r in drawn if r["proposed"] < charts.MIN_NODES or r["density"] < charts.MIN_SHARE]
    dense = [r for r in drawn if r not in sparse]
    assert sparse and all(r["shown_rate"] is None for r in sparse)
    assert dense and all(r["shown_rate"] == pytest.approx(r["accepted"] / r["proposed"]) for r in dense)
    assert all(e["field"] != "acceptance_rate" for e in axes(spec))        # the line draws shown_rate only



def test_the_notebook_figures_have_a_row_per_model_and_say_how_they_average(bench, summary):
    """A facet row on `model` (or a row of panels titled with each model, in order); the subtitle says how
    the drawn measure averages (token-, step- or row-weighted, or pooled)."""
    for name, chart in notebook_figures(bench, summary).items():
        spec = chart.to_dict()
        notes = " ".join(spec["title"]["subtitle"])
        assert any(w in notes for w in ("token-weighted", "step-weighted", "row-weighted")), name
        titled = [r.get("title") for r in spec.get("vconcat", [])]
        if titled and not any(titled) and all("hconcat" in r for r in spec["vconcat"]):
            # a row of panels per model (or per fit), each panel titled with its model
            named = [{m for m in MODELS for p in r["hconcat"] if m in str(p["title"])} for r in spec["vconcat"]]
            assert named == [{m} for m in sorted(MODELS)], name
            assert all(any(m in str(p["title"]) for m in MODELS) for r in spec["vconcat"] for p in r["hconcat"])
        elif titled and all(titled):                    # a row of panels per model, titled "model · ..."
            text = [t["text"] if isinstance(t, dict) else t for t in titled]
            assert [t.split(" · ")[0] for t in text] == sorted(MODELS), name
        else:
            facets = [spec] if "facet" in spec else spec.get("vconcat", []) + spec.get("hconcat", [])
            assert facets, name
            for f in facets:
                row = f["facet"]["row"]
                assert row["field"] in ("model", "head") and f["facet"].get("column", {}).get("field") != "model"
                labels = row["sort"] if row["field"] == "model" else [h.split("|")[0] for h in row["sort"]]
                assert labels == sorted(MODELS), name


def test_the_notebook_figures_name_the_tokens_each_panel_rests_on(bench, summary):
    """Every panel's count computed here from the synthetic rows: the generated tokens of one point of
    the (k_pre, k_ver) grid, of a run's turns, of one w_max per language figure, of the calibration's
    measured points; the held-out rows DynaSpec's choices were scored on."""
    built = {name: chart.to_dict() for name, chart in notebook_figures(bench, summary).items()}
    grid = grid_rows()
    per_point = grid.group_by("model", "k_pre", "k_ver", "w_max").agg(pl.col("tokens").sum())
    assert per_point.group_by("model").agg(pl.col("tokens").n_unique())["tokens"].to_list() == [1, 1]
    for model in MODELS:
        n = per_point.filter(pl.col("model") == model)["tokens"][0]
        got = {r["text"] for r in rows(built["kpre_kver_sensitivity"], model=model, layer="tokens")}
        assert got == {"per point: " + charts.token_note(n)}
    # draft time: each run's panel header names the generated tokens of that run's turns
    runs = tables.with_run(bench).group_by("model", "run").agg(pl.col("new_tokens").sum())
    for row, model in zip(built["draft_time_by_phase"]["vconcat"], sorted(MODELS)):
        want = [f"{r}|{charts.token_note(n)}" for r, n in runs.filter(pl.col("model") == model)
                .select("run", "new_tokens").rows() if r.startswith("eagle")]
        assert sorted(row["facet"]["column"]["sort"]) == sorted(want)
    # DynaSpec's choices: the held-out rows of the fit, in every panel's subtitle
    held = dict(choices_rows().group_by("model").agg(pl.col("rows").max()).rows())
    for row in built["dynaspec_choices"]["vconcat"]:
        for panel in row["hconcat"]:
            model = panel["title"]["text"].split(" · ")[1]
            assert panel["title"]["subtitle"].endswith(charts.token_note(held[model], "held-out draft rows"))
    # calibration and g*: the generated tokens of the measured points
    cal = calibrate_rows().filter(pl.col("curve") == "measured").group_by("model").agg(
        pl.col("measured_new_tokens").sum())
    for (model, n), row in zip(cal.sort("model").rows(), built["calibration_fits"]["vconcat"]):
        assert row["title"]["text"] == model and row["title"]["subtitle"].startswith(charts.token_note(n))
    assert built["g_star_by_device"]["facet"]["row"]["sort"] == [
        f"{m}|{charts.token_note(n, 'generated tokens (calibration)')}" for m, n in cal.sort("model").rows()]
    # the language figures: every prompt of every language, once (not once per bin, stream or w_max)
    prompts = language_rows().unique(["model", "prompt_id"]).group_by("model").agg(pl.col("tokens").sum())
    for model, n in prompts.rows():
        assert {r["text"] for r in rows(built["reuse_distance_by_language"], model=model, layer="tokens")} \
            == {charts.token_note(n)}
        assert {r["text"] for r in rows(built["coverage_by_language"], model=model, layer="tokens")} \
            == {"per w_max: " + charts.token_note(n), "per point: " + charts.token_note(n)}


def test_the_calibration_draws_ar_where_it_draws_a_speed(bench):
    """tau/s (a speed) carries ar's mean tokens/s over the bench turns on the model, tau carries ar's 1."""
    cal = calibrate_rows()
    spec = charts.calibration_fits(tables.calibration_curves(cal), cal, bench).to_dict()
    for model in MODELS:
        ar = bench.filter((pl.col("model") == model) & (pl.col("method") == "ar"))["tokens_per_s"].mean()
        refs = {r["quantity"]: r["y"] for r in rows(spec, model=model) if "y" in r}
        assert refs == {tables.QUANTITIES["tau"]: 1.0, tables.QUANTITIES["tokens_per_s"]: pytest.approx(ar)}


def test_the_notebook_figures_skip_an_absent_split_with_one_line(bench, capsys):
    """A table builder that printed why returns None, and the chart then draws nothing and prints nothing
    more; distances without the reuse metric print one line."""
    capsys.readouterr()
    assert tables.distances(coverage_rows()) is None                # no distances cells: one printed line
    for chart in (charts.kpre_kver_sensitivity(None, None), charts.draft_time_by_phase(None, bench),
                  charts.calibration_fits(None, calibrate_rows()), charts.g_star_by_device(None, calibrate_rows()),
                  charts.reuse_distance_by_language(None, None), charts.coverage_by_language(None, None, None)):
        assert chart is None
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    langs = tables.languages_only(language_rows(), "languages")
    stack = tables.distances(langs).with_columns(metric=pl.lit("stack_distance"))
    assert charts.reuse_distance_by_language(stack, langs) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("skipped reuse distances per language: ")
