"""The figure notebooks: a small sweep of every kind on a tiny random model (a real local Ray, 2 CPUs on
127.0.0.1), then `sweeps.render` executes every notebook on it, and each must write its named figures as
PNG and self-contained HTML. Also: the tables the figures draw agree with the raw results, a sweep missing
a kind still renders what it can, and a folder without results is refused with a clear error. Notebook 3
also draws DynaSpec's unstated choices from `DIR/dynaspec_choices` (a tiny fit + `choices` sweep here), and
skips them, naming the command, when the folder is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import ray

# the notebooks extra (papermill, jupytext, altair, vl-convert): skip before importing what needs it
pytest.importorskip("papermill", reason="the notebooks extra (pip install -e '.[notebooks]') is not installed")

from specvocab.engine.jobs.dynaspec_choices import ChoicesConfig, sweep_choices  # noqa: E402
from specvocab.engine.jobs.fit_dynaspec import FitConfig, fit  # noqa: E402
from specvocab.engine.models import load_model  # noqa: E402
import altair as alt  # noqa: E402

from specvocab.sweeps import charts, tables  # noqa: E402
from specvocab.sweeps.cell import SweepError  # noqa: E402
from specvocab.sweeps.cluster import start_local  # noqa: E402
from specvocab.sweeps.config import load_sweep  # noqa: E402
from specvocab.sweeps.render import main as render_main, notebooks, render, spec_bench_answers  # noqa: E402
from specvocab.sweeps.results import load  # noqa: E402
from specvocab.sweeps.run import run_sweep  # noqa: E402
from tests.engine_testing import tiny_dynaspec_fit  # noqa: E402
from tests.sweeps_testing import tiny_toml, write_toml  # noqa: E402

# every figure each notebook must write (name.png + name.html)
FIGURES = {
    "01_coverage": ["coverage_vs_vocab", "lru_vs_fifo"],
    "02_sensitivity": ["wmax_sensitivity", "kpre_kver_sensitivity"],
    "03_methods": ["methods_table", "methods_speed", "draft_time_by_phase", "dynaspec_choices"],
    "04_unispec": ["acceptance_vs_confidence", "calibration_fits", "g_star_by_device", "speedup_by_language"],
    "05_languages": ["reuse_distance_by_language", "coverage_by_language"],
}

# the smallest sweep that gives every figure its data: both prompt sets (categories; languages), the
# coverage grid over several w_max, k_pre and k_ver, ar + speculative methods + the layer-skip drafter with
# the full vocabulary and MicroSpec's window at two w_max, and a calibration; two models (a second random
# Llama, other sizes), so that every chart must tell models apart
SECOND_MODEL = '''
[[models]]
name = "random-llama"
label = "tiny2"
options = { vocab_size = 512, hidden_size = 32, num_layers = 2 }
'''
MODELS = ("tiny", "tiny2")
SWEEP = tiny_toml(name="notebooks", coverage="k_pre = [1, 3]\nk_ver = [1, 3]", bench='''
[[bench]]
methods = ["ar", "pld", "unispec"]

[[bench]]
methods = ["layerskip"]
policies = ["full", "microspec"]
vocab_sizes = [64, 256]
params = { drafter_layers = "first:1" }
''', extra='''
[[prompts]]
set = "multilingual"
per_category = 1
categories = ["qa"]
languages = ["de", "ja"]
split = "language"
''').replace("[[prompts]]", SECOND_MODEL + "\n[[prompts]]", 1)


def dynaspec_choices(folder: Path, out: Path) -> Path:
    """A tiny DynaSpec fit on the random model and its sweep of M, router width and L into `out` (as
    `tests/test_vocab_dynaspec_fit.py`'s end-to-end test: 4 prompts, 16 clusters; here one epoch): 4 settings, one
    Parquet file each, every one at 4 token budgets."""
    fitted = folder / "fitted.safetensors"
    cfg = tiny_dynaspec_fit(folder, fitted, epochs=1)
    fit(cfg)
    vocab = load_model("random-llama")[0].get_output_embeddings().weight.shape[0]
    choices = ChoicesConfig(work_dir=f"{fitted}.work", out=str(out), num_clusters=(8, 16), router_width=(8,),
                               top_l=(1, 4), budget_tokens=(vocab // 8, vocab // 4, vocab // 2, vocab),
                               heldout=0.25, epochs=1, threads=None, progress=False)
    return sweep_choices(choices)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("nb_sweep")
    sweep = load_sweep(write_toml(folder, SWEEP, "notebooks.toml"))
    start_local(num_cpus=2)
    try:
        summary = run_sweep(sweep, folder / "out", progress=False, show=False)
    finally:
        ray.shutdown()
    assert summary.ok, summary.lines()
    dynaspec_choices(folder, folder / "out" / "dynaspec_choices")     # read by notebook 3 (not a sweep kind)
    return folder / "out"


def test_every_notebook_is_listed():
    assert [p.stem for p in notebooks()] == list(FIGURES)


@pytest.mark.timeout(300)
def test_every_notebook_writes_its_figures(results, capsys):
    out = results / "figures"
    assert render_main([str(results)]) == 0
    printed = capsys.readouterr().out
    for stem, names in FIGURES.items():
        assert (out / "notebooks" / f"{stem}.ipynb").is_file()
        for name in names:
            png, html = out / f"{name}.png", out / f"{name}.html"
            data = png.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, png
            page = html.read_text()
            assert "vega" in page and "cdn.jsdelivr" not in page, f"{html} is not self-contained"
            assert str(png) in printed
    assert sorted(p.stem for p in out.glob("*.png")) == sorted(n for ns in FIGURES.values() for n in ns)
    table = pl.read_csv(out / "methods_table.csv")
    assert {"run", "avg tokens/s", "speedup", "avg tau"} <= set(table.columns)


def test_tables_agree_with_the_raw_results(results):
    bench = tables.read(results, "bench")
    coverage = tables.read(results, "coverage")
    summary = tables.method_summary(bench)
    assert set(summary["model"]) == set(MODELS)
    # speedup is tokens/s over ar's on the same model and task; ar's is 1; tau = sum new tokens / sum steps
    # (2 models x (spec_bench: qa, writing, avg; multilingual: de, ja, avg))
    assert summary.filter(pl.col("method") == "ar")["speedup"].to_list() == pytest.approx([1.0] * 12)
    tiny = (pl.col("model") == "tiny") & (pl.col("category") == "writing")
    pld, ar = bench.filter(tiny & (pl.col("method") == "pld")), bench.filter(tiny & (pl.col("method") == "ar"))
    row = summary.filter((pl.col("model") == "tiny") & (pl.col("run") == "pld") & (pl.col("task") == "writing")
                         ).row(0, named=True)
    assert row["tau"] == pytest.approx(pld["new_tokens"].sum() / pld["steps"].sum())
    assert row["speedup"] == pytest.approx(pld["tokens_per_s"].mean() / ar["tokens_per_s"].mean())
    pld_sb = summary.filter((pl.col("model") == "tiny") & (pl.col("run") == "pld")
                            & (pl.col("prompt_set") == "spec_bench"))
    avg, tasks = pld_sb.filter(pl.col("task") == tables.AVG), pld_sb.filter(pl.col("task") != tables.AVG)
    assert avg["tokens_per_s"][0] == pytest.approx(tasks["tokens_per_s"].mean())
    assert set(summary["run"]) == {"ar", "pld", "unispec", "layerskip · full", "layerskip · microspec 64",
                                   "layerskip · microspec 256"}
    # languages are the multilingual set's tasks
    assert set(summary.filter(pl.col("prompt_set") == "multilingual")["task"]) == {"de", "ja", tables.AVG}

    # acceptance by confidence: every drafted node of the method counted once
    conf = tables.confidence_bins(bench)
    uni = bench.filter((pl.col("method") == "unispec") & (pl.col("model") == "tiny"))
    got = conf.filter((pl.col("method") == "unispec") & (pl.col("model") == "tiny"))
    assert got["proposed"].sum() == uni["score_bins_proposed"].list.sum().sum() > 0
    assert got["accepted"].sum() == uni["score_bins_accepted"].list.sum().sum()
    assert got["density"].sum() == pytest.approx(1.0)
    assert "pld" not in set(conf["method"])                   # no confidence score: every node in one bin

    # Fig. 1(b): one window point per w_max and one static point per K, per task
    vocab = tables.coverage_vs_vocab(coverage)
    per = vocab.group_by("model", "task", "series").len()
    assert set(per.filter(pl.col("series") == tables.WINDOW)["len"]) == {3}
    assert set(per.filter(pl.col("series") == tables.STATIC)["len"]) == {2}
    assert set(vocab["task"]) == {"qa", "writing", "de", "ja"} and set(vocab["model"]) == set(MODELS)
    sweep = tables.wmax_sweep(bench)
    assert sweep.group_by("model", "prompt_set").len()["len"].to_list() == [2, 2, 2, 2]
    grid = tables.window_coverage(coverage, at_default=False)
    assert grid.select("k_pre", "k_ver").unique().height == 4

    # DynaSpec's choices: the centre (the fit's M and L, FitConfig's width) in every factor's panel, each
    # setting's DynaSpec-PA rows, the static baseline of the centre's M in each panel
    raw = tables.read_choices(results / "dynaspec_choices")
    assert tables.choices_centre(raw) == (16, FitConfig.router_width, 4)            # as the job recorded it
    # a folder from before the job recorded its centre: the value shared by the most settings
    assert tables.choices_centre(raw.drop(*tables.CENTRE_COLUMNS)) == (16, FitConfig.router_width, 4)
    shaped = tables.dynaspec_choices(raw)
    panels = {f: sorted(set(part.filter(pl.col("series") == "router")["value"]))
              for (f,), part in shaped.group_by("factor")}
    assert panels == {"M (clusters)": [8, 16], "router width": [8, FitConfig.router_width],
                      "L (label top-L)": [1, 4]}
    assert shaped.filter(pl.col("centre"))["factor"].value_counts().height == 3
    static = shaped.filter(pl.col("series") == "static")
    assert set(static["num_clusters"]) == {16} and static.height == 3 * 4           # 3 panels x 4 budgets
    pa = raw.filter((pl.col("scorer") == "router") & (pl.col("budget") == "position"))
    small, large = raw["budget_tokens"].min(), raw["budget_tokens"].max()
    row = shaped.filter((pl.col("factor") == "M (clusters)") & (pl.col("value") == 8)
                        & (pl.col("budget_tokens") == small)).row(0, named=True)
    assert row["token_recall"] == pa.filter((pl.col("num_clusters") == 8) & (pl.col("budget_tokens") == small)
                                            )["token_recall"][0]
    table = tables.choices_table(shaped, near=8192)                     # V = 512: the largest budget is closest
    assert table["budget_tokens"].to_list() == [large] * 5 and table["varied"].to_list() == [
        "centre", "M (clusters)", "router width", "L (label top-L)", "static baseline"]


def _splits_by_model(spec, models) -> bool:
    """Whether a Vega-Lite spec tells `models` apart: a facet (row / column / facet) or a series encoding on
    `model`, or, for each model, a filter that keeps only that model's rows (one panel per model)."""
    fields, filters = set(), []

    def walk(node, key=None):
        if isinstance(node, dict):
            if key in ("facet", "row", "column", "color", "shape", "strokeDash", "xOffset", "detail") \
                    and isinstance(node.get("field"), str):
                fields.add(node["field"])
            for k, v in node.items():
                if k == "filter" and isinstance(v, str):          # datum.model or datum['model']
                    filters.append(v.replace('"', "'").replace("datum['model']", "datum.model"))
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)

    walk(spec)
    return "model" in fields or all(any("datum.model" in f and f"'{m}'" in f for f in filters) for m in models)


def test_the_average_speedup_carries_its_interval_into_the_table_and_the_bars(results):
    """specvocab.engine.metrics' speedup_lo / _hi of each AVG row reach the methods table (csv columns, a "95% CI" cell
    with the same numbers) and the methods_speed bars (a rule from lo to hi), as the tests of engine.metrics
    define them; the interval holds the speedup (two tasks per prompt set here)."""
    bench = tables.read(results, "bench")
    summary = tables.method_summary(bench)
    avg = summary.filter((pl.col("task") == tables.AVG) & (pl.col("method") != "ar"))
    assert avg.height > 0 and avg["speedup_lo"].null_count() == 0 and avg["decode_speedup_lo"].null_count() == 0
    assert ((avg["speedup_lo"] <= avg["speedup"]) & (avg["speedup"] <= avg["speedup_hi"])).all()
    wide = tables.methods_wide(summary)
    cells = tables.table_cells(summary)
    for row in avg.iter_rows(named=True):
        where = (pl.col("model") == row["model"]) & (pl.col("prompt_set") == row["prompt_set"]) & (
            pl.col("run") == row["run"])
        (w,) = wide.filter(where).iter_rows(named=True)
        assert (w["speedup lo"], w["speedup hi"]) == (round(row["speedup_lo"], 2), round(row["speedup_hi"], 2))
        (text,) = cells.filter(where & (pl.col("column") == "95% CI (× ar)"))["text"].to_list()
        assert text == f"{row['speedup_lo']:.2f}-{row['speedup_hi']:.2f}"
    rules = []

    def walk(node):
        if isinstance(node, dict):
            enc = node.get("encoding", {})
            if enc.get("y2", {}).get("field") == "speedup_hi" and enc.get("y", {}).get("field") == "speedup_lo":
                rules.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(charts.methods_speed(summary, bench).to_dict())
    assert rules, "no interval drawn on the average's speedup bars"


def test_every_bench_and_coverage_chart_tells_the_models_apart(results):
    """With two models in the sweep, each chart that drew bench or coverage results without `model`
    has a panel or a facet per model (the charts of 01 facet on `panel`, which names the model)."""
    bench, coverage = tables.read(results, "bench"), tables.read(results, "coverage")
    record = tables.read(results, "record", tables.RECORD_COLUMNS)
    summary = tables.method_summary(bench)
    multilingual = tables.languages_only(coverage, "languages")
    built = {
        "methods_table": charts.methods_table(summary, bench),
        "methods_speed": charts.methods_speed(summary, bench),
        "draft_time_by_phase": charts.draft_time_by_phase(tables.phase_times(summary), bench),
        "wmax_sensitivity": charts.wmax_sensitivity(tables.window_coverage(coverage), tables.wmax_sweep(bench),
                                                    bench, coverage, record),
        "kpre_kver_sensitivity": charts.kpre_kver_sensitivity(tables.window_coverage(coverage, at_default=False),
                                                              coverage, record),
        "speedup_by_language": charts.speedup_by_language(tables.language_speedup(summary), bench),
        "coverage_by_language": charts.coverage_by_language(tables.window_coverage(multilingual, by=("task",)),
                                                            tables.coverage_vs_vocab(multilingual), multilingual,
                                                            record),
    }
    apart = {name: _splits_by_model(chart.to_dict(), MODELS) for name, chart in built.items()}
    assert apart == {name: True for name in built}
    # the check can fail: a chart over both models' rows with no model in it (as these charts were)
    blind = alt.Chart(summary).mark_bar().encode(x="task:N", y="tokens_per_s:Q", color="run:N")
    assert not _splits_by_model(blind.to_dict(), MODELS)
    one = blind.transform_filter(alt.datum.model == "tiny")                  # one model's panel only
    assert not _splits_by_model(one.to_dict(), MODELS)
    # above 20 series the colours get a second channel
    many = [f"run {i}" for i in range(25)]
    assert "strokeDash" in charts.series_channels("run", many, "run")
    assert "shape" in charts.series_channels("run", many, "run", mark="point")
    assert set(charts.series_channels("run", many[:20], "run")) == {"color"}


def test_a_sweep_without_bench_or_calibrate_cells_still_renders(results, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(results, partial, ignore=shutil.ignore_patterns("figures"))
    for kind in ("bench", "calibrate"):
        shutil.rmtree(partial / f"kind={kind}")
    shutil.rmtree(partial / "dynaspec_choices")
    done = render(partial, only=["02", "03"], show=False)
    assert [r.error for r in done] == [None, None]
    # the coverage figures (the window's coverage against w_max; k_pre, k_ver) without the bench's panels
    assert sorted(p.name for p in done[0].figures) == ["kpre_kver_sensitivity.png", "wmax_sensitivity.png"]
    assert "no 'bench' results" in done[0].executed.read_text()
    # notebook 3 draws nothing, and says how to make the DynaSpec choices
    assert done[1].figures == []
    assert "python -m specvocab.engine.jobs.dynaspec_choices --work-dir FITWORK" in done[1].executed.read_text()


def test_a_folder_without_results_is_refused(tmp_path, capsys):
    with pytest.raises(SweepError, match="holds no sweep results"):
        render(tmp_path)
    assert render_main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(SweepError, match="no such notebook"):
        notebooks(only=["99"])


def test_the_sweeps_bench_cells_become_spec_bench_answer_files(results, tmp_path):
    """`sweeps.render` writes Spec-Bench answer files of the bench cells: one per model label x prompt
    set x method x run x vocabulary size (a sweep's run is the bare policy), the bench cells of every split value of a prompt entry in one file (one line per
    question), each a lossless run's answers equal to ar's, and ar's accept lengths all 1."""
    written = spec_bench_answers(results, tmp_path, show=False)
    rows = load(results, "bench").collect()
    keys = rows.select("model", "prompt_set", "method", "run", "vocab_size", "config").unique()
    assert len(written) == keys.height
    for model in MODELS:
        mine = sorted(p.stem for p in written if p.parent.parent.name == model)
        assert {"ar", "pld", "layerskip", "layerskip-microspec-64", "layerskip-microspec-256"} <= set(mine), mine
    for path in written:
        model, prompt_set = path.parent.parent.name, path.parent.name
        answers = [json.loads(line) for line in path.read_text().splitlines()]
        want = rows.filter(pl.col("model") == model, pl.col("prompt_set") == prompt_set)["prompt_id"].unique()
        assert sorted(str(a["question_id"]) for a in answers) == sorted(want.to_list())
        ar = [json.loads(line) for line in (path.parent / "ar.jsonl").read_text().splitlines()]
        verdicts = rows.filter(pl.col("model") == model, pl.col("prompt_set") == prompt_set,
                               pl.col("method") == path.stem.split("-")[0])["verdict"].drop_nulls().unique()
        if set(verdicts.to_list()) <= {"exact"}:
            assert [a["choices"][0]["turns"] for a in answers] == [a["choices"][0]["turns"] for a in ar]
        for a in answers:
            c = a["choices"][0]
            assert sum(c["accept_lengths"]) == sum(c["new_tokens"]) and len(c["accept_lengths"]) == sum(c["decoding_steps"])
        if path.stem == "ar":
            assert all(set(a["choices"][0]["accept_lengths"]) == {1} for a in answers)


def _run_as_jupyterlab_does(notebook: Path) -> str:
    """Execute `notebook` unchanged (its own parameters cell, no papermill injection) in a kernel started in
    the notebooks folder, as JupyterLab's Run All does; returns everything its cells printed."""
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(notebook)
    NotebookClient(nb, kernel_name="python3", timeout=240,
                   resources={"metadata": {"path": str(notebook.parent)}}).execute()
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.mark.timeout(600)
def test_run_all_from_the_notebooks_folder_finds_the_results(tmp_path, monkeypatch):
    """A notebook's default `results_dir = "results/quick"` is found under $SPECVOCAB_RESULTS (else the
    checkout's root) though the kernel starts in notebooks/: 01 draws its figures into results/quick/figures
    there, and 02, whose bench panels have no bench cells here, says in one line which kind is missing and
    which config keys make it. Coverage cells written without Ray (`tests.load_testing`)."""
    from tests.load_testing import write_coverage_sweep

    quick = tmp_path / "results" / "quick"
    write_coverage_sweep(tmp_path, quick)
    monkeypatch.setenv("SPECVOCAB_RESULTS", str(tmp_path))          # the kernel inherits this environment
    by_stem = {p.stem: p for p in notebooks()}
    printed = _run_as_jupyterlab_does(by_stem["01_coverage"])
    for name in FIGURES["01_coverage"]:
        assert (quick / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (by_stem["01_coverage"].parent / "results").exists()       # nothing written beside the notebook
    assert "missing in" not in printed
    printed = _run_as_jupyterlab_does(by_stem["02_sensitivity"])
    (line,) = [s for s in printed.splitlines() if s.startswith(f"missing in {quick}")]
    assert "bench cells" in line and "[[bench]]" in line and "coverage cells" not in line
    assert {p.stem for p in (quick / "figures").glob("*.png")} == {*FIGURES["01_coverage"], "wmax_sensitivity",
                                                                    "kpre_kver_sensitivity"}
