"""Reading a sweep's results for analysis (`sweeps.results`): `results_path` resolves a notebook's relative
results_dir the same wherever its kernel starts and names the kinds a folder lacks; `load(DIR, "coverage",
analysis=..., stream=...)` gives one tidy frame per analysis; bench rows equal to ar's carry verdict "exact" as
the tables count them. No Ray and no model: cells are computed on random traces (`tests.load_testing`) or
written by hand."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from specvocab.engine.metrics import row_verdicts
from specvocab.sweeps.cell import Cell, SweepError
from specvocab.sweeps.results import (RESULTS_ENV, cell_path, diagnosis_path, load, paper_stream, results_path,
                                      undiagnosed, write_cell, write_frame)
from specvocab.sweeps.schema import ANALYSES
from tests.load_testing import TASKS, write_coverage_sweep

CHECKOUT = Path(__file__).resolve().parents[1]            # the repository checkout holding these tests


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, list]:
    folder = tmp_path_factory.mktemp("load")
    cells = write_coverage_sweep(folder, folder / "out")
    return folder / "out", cells


# ----------------------------------------------------------------------------------------------------------
# results_path
# ----------------------------------------------------------------------------------------------------------

def test_a_relative_results_dir_is_under_the_checkout_wherever_the_kernel_starts(tmp_path, monkeypatch):
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    for cwd in (tmp_path, CHECKOUT / "notebooks"):            # JupyterLab starts a kernel in notebooks/
        monkeypatch.chdir(cwd)
        assert results_path("results/quick") == CHECKOUT / "results" / "quick"
    assert results_path(tmp_path / "abs") == tmp_path / "abs"          # an absolute path (papermill's) as given


def test_specvocab_results_moves_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    monkeypatch.chdir(CHECKOUT / "notebooks")
    assert results_path("results/quick") == tmp_path / "results" / "quick"
    assert results_path(CHECKOUT / "x") == CHECKOUT / "x"


def test_a_folder_without_the_kinds_a_notebook_draws_says_which_and_how(sweep, tmp_path, capsys):
    out, _ = sweep
    assert results_path(out, kinds=("coverage",)) == out
    assert capsys.readouterr().out == ""                       # nothing missing: nothing printed
    results_path(out, kinds=("coverage", "bench", "calibrate"))
    (line,) = capsys.readouterr().out.splitlines()
    assert "bench cells" in line and "[[bench]]" in line and "calibrate cells" in line and "[[calibrate]]" in line
    assert "coverage cells" not in line and str(out) in line
    unfinished = tmp_path / "unfinished"                      # bench in the config, no bench cell finished
    unfinished.mkdir()
    (unfinished / "sweep.json").write_text('{"kinds": ["record", "coverage", "bench"]}')
    results_path(unfinished, kinds=("bench",))
    (line,) = capsys.readouterr().out.splitlines()
    assert "bench cells" in line and "none finished" in line and "[[bench]]" not in line
    results_path(tmp_path / "nowhere", kinds=("coverage",))
    (line,) = capsys.readouterr().out.splitlines()
    assert "no folder" in line and str(tmp_path / "nowhere") in line


# ----------------------------------------------------------------------------------------------------------
# load(DIR, "coverage", analysis=..., stream=...)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("analysis", ANALYSES)
def test_one_tidy_frame_per_analysis(sweep, analysis):
    out, cells = sweep
    tidy = load(out, "coverage", analysis=analysis).collect()
    raw = load(out, "coverage").collect()                      # the old call: every analysis in one frame
    mine = [c for c in cells if c.params["analysis"] == analysis]
    written = set().union(*(pl.read_parquet_schema(cell_path(out, c)) for c in mine))
    # that analysis's rows, and only the columns its cells wrote (plus task), none of the other analyses'
    assert tidy.height == raw.filter(pl.col("analysis") == analysis).height > 0
    assert set(tidy.columns) == written | {"task"}
    assert tidy.columns[:3] == ["model", "prompt_set", "task"]
    # the task is the category or the language, whichever the prompt set is split by
    assert set(zip(tidy["prompt_set"], tidy["task"])) == TASKS
    assert tidy.schema["by"] == pl.List(pl.String)
    assert set(map(tuple, tidy["by"].to_list())) == {tuple(c.params["by"]) for c in mine}
    assert set(raw.columns) - set(tidy.columns)                # the old frame still holds every analysis


def test_the_papers_stream(sweep):
    out, _ = sweep
    every = load(out, "coverage", analysis="window").collect()
    assert every.select("k_pre", "k_ver").unique().height == 4          # the grid: k_pre, k_ver in {1, 3}
    paper = load(out, "coverage", analysis="window", stream="paper").collect()
    assert set(paper.select("k_pre", "k_ver", "sources").rows()) == {(3, 3, "ctx+ext")}
    key = ["prompt_set", "task", "w_max"]
    assert paper.sort(key)["coverage"].to_list() == every.filter(
        (pl.col("k_pre") == 3) & (pl.col("k_ver") == 3)).sort(key)["coverage"].to_list()
    assert paper.height == every.filter(paper_stream()).height == every.height // 4
    # a shortlist has no stream: all its rows stay
    assert load(out, "coverage", analysis="shortlist", stream="paper").collect().height == \
        load(out, "coverage", analysis="shortlist").collect().height


def test_bad_selections_are_refused_with_the_fix(sweep, tmp_path):
    out, _ = sweep
    with pytest.raises(SweepError, match="choose one of"):
        load(out, "coverage", analysis="windows")
    with pytest.raises(SweepError, match="stream='paper'"):
        load(out, "coverage", analysis="window", stream="default")
    other = tmp_path / "other"                                 # a sweep at k_pre = k_ver = 1, window only
    write_coverage_sweep(tmp_path, other, 'analyses = ["window"]\nk_pre = [1]\nk_ver = [1]')
    with pytest.raises(SweepError, match=r"no 'window' rows at the papers' stream.*\(1, 1, 'ctx\+ext'\)"):
        load(other, "coverage", analysis="window", stream="paper")
    with pytest.raises(SweepError, match=r"no 'shortlist' coverage cells.*\['window'\].*\[coverage\] analyses"):
        load(other, "coverage", analysis="shortlist")


# ----------------------------------------------------------------------------------------------------------
# verdict "exact" on the bench rows equal to ar's
# ----------------------------------------------------------------------------------------------------------

def _bench_cell(out: Path, method: str, temperature: float, rows: list[tuple]) -> Cell:
    """A bench cell of `method` holding rows (prompt_id, turn, seed, output_ids, verdict)."""
    cell = Cell("bench", "tiny", method, {"prompt_set": "spec_bench", "temperature": temperature})
    frame = pl.DataFrame([{"method": method, "run": method, "prompt_set": "spec_bench", "prompt_id": p, "turn": t, "repeat": 0,
                           "seed": s, "max_new_tokens": 8, "temperature": temperature, "output_ids": o,
                           "verdict": v, "first_divergence": None, "ar_margin": None, "ar_gap": None,
                           "prompt_differs": None} for p, t, s, o, v in rows],
                         schema_overrides={"output_ids": pl.List(pl.Int64), "verdict": pl.String,
                                           "first_divergence": pl.Int64, "ar_margin": pl.Float64,
                                           "ar_gap": pl.Float64, "prompt_differs": pl.Boolean})
    write_cell(out, cell, frame, "hand")
    return cell


def test_every_row_equal_to_ar_reads_exact_as_the_tables_count_it(tmp_path):
    out = tmp_path / "out"
    _bench_cell(out, "ar", 0.0, [("p1", 1, 0, [1, 2, 3], "exact"), ("p2", 1, 0, [4, 5, 6], "exact"),
                                 ("p3", 1, 0, [7, 8], "exact"), ("p3", 2, 0, [9, 10], "exact"),
                                 ("p4", 1, 0, [1, 1], "exact")])
    pld = _bench_cell(out, "pld", 0.0, [("p1", 1, 0, [1, 2, 3], None),      # equal to ar's: exact
                                        ("p2", 1, 0, [4, 5, 0], None),      # differs, never diagnosed
                                        ("p3", 1, 0, [7, 0], None),         # differs, diagnosed a near tie
                                        ("p3", 2, 0, [9, 10], None),        # equal, after a diverged turn 1
                                        ("p4", 1, 1, [1, 1], None)])        # equal to ar's of another seed
    _bench_cell(out, "recycling", 0.7, [("p1", 1, 0, [1, 2, 3], None)])     # sampled: not comparable
    write_frame(pl.DataFrame({"cell_id": [pld.id] * 2, "prompt_id": ["p3", "p3"], "turn": [1, 2], "repeat": [0, 0],
                              "verdict": ["near-tie", "near-tie"], "first_divergence": [1, 0],
                              "ar_margin": [0.01, None], "ar_gap": [0.01, None], "prompt_differs": [False, True]},
                             schema_overrides={"turn": pl.Int64, "repeat": pl.Int64}),
                diagnosis_path(out, "tiny"))
    rows = load(out, "bench").collect()
    got = {(r["method"], r["prompt_id"], r["turn"], r["seed"]): r["verdict"] for r in rows.iter_rows(named=True)}
    assert got == {("ar", "p1", 1, 0): "exact", ("ar", "p2", 1, 0): "exact", ("ar", "p3", 1, 0): "exact",
                   ("ar", "p3", 2, 0): "exact", ("ar", "p4", 1, 0): "exact",
                   ("pld", "p1", 1, 0): "exact", ("pld", "p2", 1, 0): None, ("pld", "p3", 1, 0): "near-tie",
                   ("pld", "p3", 2, 0): "near-tie", ("pld", "p4", 1, 1): None,
                   ("recycling", "p1", 1, 0): None}
    # the tables' verdicts (engine.metrics.row_verdicts, the one-head table's `lossless`) agree wherever a
    # row has one; the undiagnosed difference is still the driver's to diagnose
    greedy = rows.filter((pl.col("temperature") == 0) & (pl.col("seed") == 0))
    table = row_verdicts(greedy).filter(pl.col("verdict").is_not_null())
    assert table["row_verdict"].to_list() == table["verdict"].to_list() and table.height == 8
    ((cell_id, todo),) = undiagnosed(rows)
    assert cell_id == pld.id and ["p2"] == todo.filter(pl.col("method") == "pld")["prompt_id"].to_list()
