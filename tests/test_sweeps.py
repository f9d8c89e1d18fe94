"""Sweeps: config validation and expansion, the results layout and `sweeps.load`, and whole sweeps on a real
local Ray (2 CPUs, 127.0.0.1) with a tiny random model: every kind of cell, a model loaded once per actor,
an actor killed mid-sweep, and a rerun that skips what is finished."""

from __future__ import annotations

import hashlib
import os
import socket
import tomllib
from pathlib import Path

import polars as pl
import pytest
import ray

from specvocab import sweeps
from specvocab.engine.calibration import DRAFTING_METHODS, load_calibrations, model_key, resolve_draft_size
from specvocab.engine.config import SpecConfig
from specvocab.locality.trace import read_traces
from specvocab.sweeps.cell import Cell, SweepError
from specvocab.sweeps.checks import check_contexts
from specvocab.sweeps.cluster import attach, start_local
from specvocab.sweeps.config import load_sweep, parse_sweep
from specvocab.sweeps import bench as sweeps_bench, model_cells
from specvocab.sweeps.model_cells import ModelWorker
from specvocab.sweeps.results import cell_path, prepare_output, result_files, write_cell
from specvocab.sweeps import run as run_module
from specvocab.sweeps.run_models import with_calibrated_size
from specvocab.sweeps.run import main as run_main, run_sweep
from tests.sweeps_testing import tiny_toml, write_toml


def _sweep(text: str):
    return parse_sweep(tomllib.loads(text), default_name="tiny")


# ---- config ----------------------------------------------------------------------------------------------

def test_cells_are_deterministic_and_ids_follow_parameters(tmp_path):
    a = load_sweep(write_toml(tmp_path, tiny_toml()))
    b = load_sweep(write_toml(tmp_path, tiny_toml(), "again.toml"))
    assert [c.id for c in a.cells] == [c.id for c in b.cells]
    assert a.config_hash == b.config_hash
    kinds = [c.kind for c in a.cells]
    # 2 categories: record 2; bench (ar, pld, unispec, layerskip x 3 policies) x 2; calibrate 1; coverage 4
    assert {k: kinds.count(k) for k in set(kinds)} == {"record": 2, "bench": 12, "calibrate": 1, "coverage": 4}
    assert len({c.id for c in a.cells}) == len(a.cells)
    # one more token changes every model cell's id (and the config hash), nothing else about the layout
    c = _sweep(tiny_toml(max_new_tokens=9))
    assert c.config_hash != a.config_hash
    assert not {x.id for x in c.cells if x.kind == "bench"} & {x.id for x in a.cells if x.kind == "bench"}
    sized = [x for x in a.cells if x.kind == "bench" and x.params["policy"] == "microspec"]
    assert {x.params["vocab_size"] for x in sized} == {128}
    full = [x for x in a.cells if x.kind == "bench" and x.params["policy"] == "full"]
    assert {x.params["vocab_size"] for x in full} == {None}
    coverage = [x for x in a.cells if x.kind == "coverage"]
    records = {x.id for x in a.cells if x.kind == "record"}
    assert all(set(x.needs) == records for x in coverage)


def test_defaults_fill_grid_axes():
    s = _sweep(tiny_toml(bench='[[bench]]\nmethods = ["unispec"]\nparams = { threshold_r = [0.05, 0.1], '
                               'draft_size = [2, 4] }\n'))
    bench = [c for c in s.cells if c.kind == "bench"]
    assert len(bench) == 2 * 2 * 2                          # categories x threshold_r x draft_size
    assert {(c.params["config"]["threshold_r"], c.params["config"]["draft_size"]) for c in bench} == \
        {(0.05, 2), (0.05, 4), (0.1, 2), (0.1, 4)}


BAD = [
    ('name = "random-llama"', 'name = "no-such-model"', "unknown model 'no-such-model'"),
    ('methods = ["ar", "pld", "unispec"]', 'methods = ["ar", "pdl"]', "unknown method 'pdl'"),
    ('drafter_layers = "first:1"', 'drafter_layer = "first:1"', "'drafter_layer' is not a SpecConfig field"),
    ('set = "spec_bench"', 'set = "spec_bnech"', "unknown prompt set 'spec_bnech'"),
    ('categories = ["qa", "writing"]', 'categories = ["qa", "poetry"]',
     "(prompt set 'spec_bench'): spec_bench has no categories ['poetry']"),
    ('categories = ["qa", "writing"]', 'categories = ["qa", "poetry"]', "correct `categories` / `languages`"),
    ('per_category = 1', 'per_category = 1\nlanguages = ["xx"]', "languages ['xx']"),
    ('capacities = [64, 256]', 'capacities = [64, 256]\nby = ["categroy"]', "'categroy' is not a recorded trace field"),
    ('calibration_cache = false', 'calibration_cache = 3', "[sweep].calibration_cache: 3 is not true"),
    ('policies = ["full", "frspec", "microspec"]', 'policies = ["full", "frsepc"]', "unknown vocabulary policy"),
    ('methods = ["ar", "pld", "unispec"]', 'methods = ["ar"]\npolicies = ["microspec"]', "has none"),
    ('params = { drafter_layers = "first:1" }', 'prompt_sets = ["humaneval"]', "not the set of any [[prompts]]"),
    ('num_layers = 2 }', 'num_layers = 2 }\nparams = { w_max = [1, 2] }', "a model's params are single values"),
    ('warmup = 0', 'warmup = 0\nrepeat = 2', "unknown key 'repeat'"),
    ('kinds = ["record", "coverage", "bench", "calibrate"]', 'kinds = ["coverage"]', "without 'record'"),
    ('kinds = ["record", "coverage", "bench", "calibrate"]', 'kinds = ["record", "timing"]', "unknown kind 'timing'"),
    ('topk = 8', 'topk = 2', "exceeds the recorded top-K"),
    ('drafter_layers = "first:1"', 'drafter_layers = "first:1", w_max = 0', "w_max must be > 0"),
    ('options = { vocab_size = 512', 'options = { vocab_sise = 512', "unknown key 'vocab_sise'"),
    ('methods = ["ar", "pld", "unispec"]', 'methods = ["eagle"]', "eagle needs a draft head for 'random-llama'"),
]


@pytest.mark.parametrize("old,new,message", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_config_names_the_problem(old, new, message):
    text = tiny_toml()
    assert old in text
    with pytest.raises(SweepError) as err:
        _sweep(text.replace(old, new, 1))
    assert message in str(err.value)


def test_prompts_longer_than_the_context_fail_the_check_before_the_run(tmp_path, capsys):
    """Before any cell runs: a random model of 1024 positions cannot hold Spec-Bench's summarization prompts
    (byte-level); the error names the prompt set, what does not fit and the fixes. The config parses (no
    tokenizer needed); `check_contexts` refuses it, and sweeps.run makes that check first, --dry-run too."""
    small = tiny_toml(categories=("qa", "summarization")).replace(
        "num_layers = 2 }", "num_layers = 2, max_context = 1024 }", 1)
    sweep = _sweep(small)
    with pytest.raises(SweepError) as err:
        check_contexts(sweep)
    msg = str(err.value)
    assert "[[prompts]] #1 (prompt set 'spec_bench') does not fit the context of tiny" in msg
    assert "categories ['summarization']" in msg and "(categories = ['qa'])" in msg
    assert "lower max_new_tokens" in msg and "options.max_context" in msg
    # a run stops there, exit status 2, nothing written; so does a dry run, and run_sweep called directly
    for extra in ([], ["--dry-run"]):
        assert run_main([str(write_toml(tmp_path, small)), "--out", str(tmp_path / "out"), *extra]) == 2
        assert "does not fit the context" in capsys.readouterr().err and not (tmp_path / "out").exists()
    with pytest.raises(SweepError, match="does not fit the context"):
        run_sweep(sweep, tmp_path / "out", progress=False, show=False)
    assert not (tmp_path / "out").exists()
    # the answers of earlier turns count: qa fits at 8 new tokens, not at 1000 (prompt + 1000 > 1024)
    check_contexts(_sweep(small.replace('"qa", "summarization"', '"qa"')))
    with pytest.raises(SweepError, match=r"categories \['qa'\] need up to"):
        check_contexts(_sweep(small.replace('"qa", "summarization"', '"qa"')
                              .replace("max_new_tokens = 8", "max_new_tokens = 1000")))


def test_the_shipped_configs_keep_their_cell_ids():
    """A cell's id is a hash of its parameters, and an output folder resumes by those ids: parsing, planning
    (sweeps.plan) and checking (sweeps.checks) keep every pinned id, in the same order (the digest: sha256 of
    the ids joined by newlines, in plan order). quick.toml's EAGLE-3 Table 2 adds 56 eagle3 cells and its merged
    tree 14 merged cells (a calibrate cell, a bench cell per Spec-Bench category) after the pinned ones: every
    pinned cell keeps its id."""
    pinned = {"quick": (208, "25a557472db1cbbf", "90f19de5c6653ab4e5642fb60aace3164a1d39693b5438229c566056f704c48c"),
              "paper": (2856, "be6ea3bfa136e3c1", "8c32de2820754df837b3819f88c76a44c0ddf2c8a7a8f1bda89ff13df0a853ac")}
    added = {"quick": 56 + 14, "paper": 0}
    for name, (n, config_hash, ids) in pinned.items():
        sweep = load_sweep(Path(sweeps.__file__).parent / "configs" / f"{name}.toml")
        got = [c.id for c in sweep.cells if c.method not in ("eagle3", "merged")]
        assert (len(got), sweep.config_hash) == (n, config_hash), name
        assert len(sweep.cells) - len(got) == added[name], name
        assert hashlib.sha256("\n".join(got).encode()).hexdigest() == ids, name


def test_model_params_and_prompt_sets():
    text = tiny_toml(kinds=("record", "bench"),
                     bench='[[bench]]\nmethods = ["layerskip"]\nprompt_sets = ["spec_bench"]\n'
                           '[[bench]]\nmethods = ["ar"]\nprompt_sets = ["multilingual"]\n',
                     extra='[[prompts]]\nset = "multilingual"\nper_category = 1\ncategories = ["qa"]\n'
                           'languages = ["de", "fr"]\nsplit = "language"\n')
    text = text.replace("num_layers = 2 }", 'num_layers = 2 }\nparams = { drafter_layers = "first:1" }', 1)
    bench = [c for c in _sweep(text).cells if c.kind == "bench"]
    assert {(c.method, c.params["prompt_set"], c.params["split_value"]) for c in bench} == {
        ("layerskip", "spec_bench", "qa"), ("layerskip", "spec_bench", "writing"),
        ("ar", "multilingual", "de"), ("ar", "multilingual", "fr")}
    # the model's params reach every grid point of every method
    assert all(c.params["config"] == {"drafter_layers": "first:1"} for c in bench)


def test_eagle_on_an_offline_model_uses_its_shipped_head():
    """No params.eagle_head: the offline models have a head in engine/heads/, so the cells are made."""
    text = tiny_toml(kinds=("bench",), bench='[[bench]]\nmethods = ["eagle"]\npolicies = ["full", "microspec"]\n')
    text = text.replace('name = "random-llama"', 'name = "smollm2-135m-instruct"', 1)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("options ="))
    bench = [c for c in _sweep(text).cells if c.kind == "bench"]
    assert bench and {c.method for c in bench} == {"eagle"}
    assert "eagle_head" not in bench[0].params["config"]


def test_hub_ids_and_offline_names_are_accepted_without_loading():
    text = tiny_toml(kinds=("record",)).replace(
        "[[models]]", '[[models]]\nname = "meta-llama/Llama-3.1-8B-Instruct"\n\n[[models]]', 1)
    s = _sweep(text)
    assert {m.name for m in s.models} == {"meta-llama/Llama-3.1-8B-Instruct", "random-llama"}


def test_output_folder_of_another_config_is_refused_and_kept(tmp_path):
    a, b = _sweep(tiny_toml()), _sweep(tiny_toml(max_new_tokens=9))
    out = prepare_output(tmp_path / "out", a)
    cell = a.cells[0]
    write_cell(out, cell, pl.DataFrame({"x": [1]}), a.name)
    with pytest.raises(SweepError, match="different sweep config"):
        prepare_output(out, b)
    assert cell_path(out, cell).is_file()                                   # nothing deleted
    assert prepare_output(out, a) == out                                    # the same config resumes
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SweepError, match="not a sweep output folder"):
        prepare_output(tmp_path / "other", a)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_address_is_named():
    port = _free_port()
    with pytest.raises(SweepError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        attach(f"127.0.0.1:{port}")
    with pytest.raises(SweepError, match="not `auto`"):
        attach("127.0.0.1")


# ---- results layout and load -----------------------------------------------------------------------------

def test_load_unions_cells_with_different_columns(tmp_path):
    cells = [Cell("bench", "meta-llama/Llama-3.1-8B-Instruct", "ar", {"seed": 0}),
             Cell("bench", "tiny", "layerskip", {"seed": 1, "config": {"w_max": 1024}}),
             Cell("bench", "tiny", "pld", {"seed": 2})]
    write_cell(tmp_path, cells[0], pl.DataFrame({"tau": [1], "wall_s": [0.5]}), "s")       # int tau
    write_cell(tmp_path, cells[1], pl.DataFrame({"tau": [2.5], "gather_s": [0.1]}), "s")   # float tau, new column
    write_cell(tmp_path, cells[2], pl.DataFrame({"tau": [1.5], "gather_s": [None]}), "s")  # all-null column
    files = result_files(tmp_path, "bench")
    assert len(files) == 3 and all("%2F" in str(f) or "model=tiny" in str(f) for f in files)
    with pytest.raises(Exception):                           # what a plain hive scan does with these files
        pl.scan_parquet(files, hive_partitioning=True).collect()
    got = sweeps.load(tmp_path, "bench").sort("seed").collect()
    assert got["model"].to_list() == ["meta-llama/Llama-3.1-8B-Instruct", "tiny", "tiny"]
    assert got["method"].to_list() == ["ar", "layerskip", "pld"]
    assert got["tau"].to_list() == [1.0, 2.5, 1.5]
    assert got["gather_s"].to_list() == [None, 0.1, None]
    assert got["w_max"].to_list() == [None, 1024, None]     # a grid point's fields are columns
    assert got["cell_id"].to_list() == [c.id for c in cells]
    only = sweeps.load(tmp_path, "bench").filter(pl.col("model") == "tiny").collect()
    assert only.height == 2
    with pytest.raises(SweepError, match="no 'coverage' results"):
        sweeps.load(tmp_path, "coverage")


def test_load_survives_a_column_changing_type(tmp_path):
    a, b = Cell("coverage", "m", "-", {"i": 0}), Cell("coverage", "m", "-", {"i": 1})
    write_cell(tmp_path, a, pl.DataFrame({"group": [1]}), "s")
    write_cell(tmp_path, b, pl.DataFrame({"group": ["x"]}), "s")
    got = sweeps.load(tmp_path, "coverage").sort("i").collect()
    assert got["group"].to_list() == ["1", "x"]


# ---- the worker ------------------------------------------------------------------------------------------

def test_worker_loads_once_and_warms_up_once_per_configuration(monkeypatch):
    sweep = _sweep(tiny_toml(kinds=("bench",), bench='[[bench]]\nmethods = ["ar", "pld"]\n'))
    before = model_cells._LOADS
    spec = sweep.models[0]
    worker = ModelWorker(spec.name, spec.options, None, 1)
    assert model_cells._LOADS == before + 1
    warmups = []
    monkeypatch.setattr(model_cells, "bench_cell", lambda p, loaded, method, threads, warmup=None:
                        warmups.append((method, p["split_value"], warmup)) or pl.DataFrame({"x": [1]}))
    for c in sweep.cells:
        frame, stats = worker.run(c.kind, c.method, c.params)
        assert stats["loads"] == before + 1 and stats["pid"] == os.getpid()
    # ar on qa warms up (the cell's own warmup), ar on writing does not; pld is another configuration
    assert warmups == [("ar", "qa", None), ("ar", "writing", 0), ("pld", "qa", None), ("pld", "writing", 0)]


def test_calibrate_cell_saves_g_star_where_generate_finds_it(tmp_path, monkeypatch):
    """A calibrate cell writes its record to the results and, as `python -m specvocab.engine.jobs.calibrate` does, to the
    calibration cache ($SPECVOCAB_CACHE here), where `resolve_draft_size` - unispec's default draft size in
    `generate` - takes it."""
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    sweep = _sweep(tiny_toml(kinds=("calibrate",)))
    (cell,) = sweep.cells
    spec = sweep.models[0]
    worker = ModelWorker(spec.name, spec.options, None, None, calibration_cache=True)
    model = worker.loaded[0]
    cfg = SpecConfig.preset("unispec", **cell.params["config"])
    assert load_calibrations() == {}
    frame, stats = worker.run(cell.kind, cell.method, cell.params)
    path = tmp_path / "cache" / "calibration.json"
    assert stats["calibration_cache"] == str(path) and set(frame["calibration_cache"]) == {str(path)}
    (key, record), = load_calibrations(path).items()
    assert key == model_key(model, cfg) and record["g_star"] == frame["g_star"][0]
    assert resolve_draft_size(cfg, model, on_missing="error") == frame["g_star"][0]
    # where the sweep says: a folder's calibration.json, or nowhere (results only)
    assert model_cells.calibration_file(str(tmp_path / "elsewhere")) == tmp_path / "elsewhere" / "calibration.json"
    assert model_cells.calibration_file(False) is None and model_cells.calibration_file(True) == path
    assert _sweep(tiny_toml()).calibration_cache is False
    assert _sweep(tiny_toml().replace("calibration_cache = false\n", "")).calibration_cache is True


# ---- whole sweeps on a local Ray -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray: 2 CPUs, every process on 127.0.0.1, no dashboard."""
    start_local(num_cpus=2)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    yield
    ray.shutdown()


@pytest.mark.timeout(600)
def test_sweep_end_to_end_and_rerun_skips(local_ray, tmp_path):
    cache = tmp_path / "calibrations"
    sweep = load_sweep(write_toml(tmp_path, tiny_toml(calibration_cache=str(cache))))
    out = tmp_path / "out"
    s = run_sweep(sweep, out, progress=False)
    assert s.ok, s.lines()
    assert s.files == len(sweep.cells) == len(result_files(out))
    assert dict(s.ran) == {"record": 2, "bench": 12, "calibrate": 1, "coverage": 4}
    # one model load per actor process, and each actor served several cells
    assert s.actors == 2 and s.restarts == 0
    assert sorted(s.loads.values()) == [1, 1]
    assert sum(len(v) for v in s.cell_s.values()) > s.actors

    record = sweeps.load(out, "record").collect()
    traces = read_traces(result_files(out, "record"))
    assert record.height == len(traces) == 3                 # qa: 1 turn, writing: 2 turns
    assert set(record["split_value"]) == {"qa", "writing"} and set(record["model"]) == {"tiny"}
    bench = sweeps.load(out, "bench").collect()
    assert set(zip(bench["method"], bench["policy"])) == {
        ("ar", "full"), ("pld", "full"), ("unispec", "full"), ("layerskip", "full"), ("layerskip", "frspec"),
        ("layerskip", "microspec")}
    assert bench.filter(pl.col("policy") == "microspec")["vocab_size"].to_list() == [128] * 3
    assert set(bench.filter(pl.col("method") == "layerskip")["drafter_layers"]) == {"first:1"}
    assert (bench["turn"].min(), bench["turn"].max()) == (1, 2)
    cov = sweeps.load(out, "coverage").collect()
    assert set(cov["analysis"]) == {"window", "shortlist", "distances", "miss_ratio"}
    window = cov.filter(pl.col("analysis") == "window")
    assert sorted(set(window["w_max"])) == [64, 256, 1024]
    assert window["coverage"].is_between(0, 1).all()
    # a window's coverage never falls as it grows (MicroSpec Eq. 4: a longer suffix holds every shorter one)
    for _, g in window.group_by("category"):
        assert g.sort("w_max")["coverage"].diff().drop_nulls().min() >= 0
    shortlist = cov.filter(pl.col("analysis") == "shortlist")
    assert sorted(set(shortlist["k"])) == [64, 256] and set(shortlist["policy"]) == {"frspec"}
    cal = sweeps.load(out, "calibrate").collect()
    # the fit's g* lies in the grid's span 1..4; where steps pad to row buckets (no CPU kernels) it then runs
    # at its bucket's largest tree (engine.harness.bucket_edge: 1-3 -> 3, 4 -> 7); which g the fit picks is
    # timing on a tiny model
    assert set(cal["curve"]) == {"measured", "fit", "g_star"} and cal["g_star"].is_in([1, 2, 3, 4, 7]).all()
    # unispec's bench cells ran at the g* this sweep calibrated, and say so
    uni = bench.filter(pl.col("method") == "unispec")
    assert set(uni["draft_size"]) == {cal["g_star"][0]}
    assert set(uni["draft_size_from"]) == {f"calibrate:{cal['cell_id'][0]}"}
    assert bench.filter(pl.col("method") != "unispec")["draft_size_from"].is_null().all()
    # the calibrate cell's actor also saved its record in the calibration cache the sweep named
    (record,) = load_calibrations(cache / "calibration.json").values()
    assert record["g_star"] == cal["g_star"][0] and s.calibration_saved == {str(cache / "calibration.json")}

    stamps = {f: f.stat().st_mtime_ns for f in result_files(out)}
    again = run_sweep(sweep, out, progress=False)
    assert again.ok and again.skipped == len(sweep.cells) and sum(again.ran.values()) == 0
    assert {f: f.stat().st_mtime_ns for f in result_files(out)} == stamps       # nothing recomputed


@pytest.mark.timeout(600)
def test_killed_actor_is_restarted_and_every_cell_finishes(local_ray, tmp_path):
    marker = tmp_path / "crashed"
    text = tiny_toml(kinds=("record", "bench"), testing=f'crash_once = "{marker}"',
                     bench='[[bench]]\nmethods = ["ar", "pld"]\n')
    sweep = load_sweep(write_toml(tmp_path, text))
    s = run_sweep(sweep, tmp_path / "out", progress=False)
    assert marker.is_file(), "no actor was killed"
    dead = int(marker.read_text())
    assert s.ok, s.lines()
    assert s.files == len(sweep.cells) == 6
    assert s.restarts >= 1
    assert all(dead not in pids for pids in s.actor_pids.values())     # its cell finished on the restarted actor
    assert set(s.loads.values()) == {1}                                 # the restarted process loaded once too


@pytest.mark.timeout(600)
def test_machinery_benchmark_runs_and_reports_what_it_compared(local_ray, tmp_path, capsys):
    res = sweeps_bench.main(out=tmp_path / "bench", k=1, per_category=1, max_new_tokens=16)
    assert res["cells"] == 3                                  # k_pre = k_ver = 1, three sources
    assert set(res["loads"].values()) == {1}                  # one model load per actor process
    for key in ("direct_s", "one_worker_s", "two_workers_s", "plain_two_s"):
        assert res[key] > 0
    printed = capsys.readouterr().out
    for what in ("direct calls", "2 plain processes", "run_sweep, 1 worker", "run_sweep, 2 workers", "target"):
        assert what in printed


# ---- calibrated draft sizes ------------------------------------------------------------------------------

CALIBRATE_LAYERSKIP = '''
[[calibrate]]
methods = ["pld", "layerskip"]
params = { drafter_layers = "first:1" }
grid = [1, 2]
prompts = 1
warmup = 0
'''
CALIBRATE_POLICIES = '''
[[calibrate]]
methods = ["layerskip"]
policies = ["frspec", "microspec"]
vocab_sizes = [128]
params = { drafter_layers = "first:1" }
grid = [1, 2]
prompts = 1
warmup = 0
'''


def _calibrated_sweep(extra: str = CALIBRATE_LAYERSKIP + CALIBRATE_POLICIES, bench: str | None = None):
    return _sweep(tiny_toml(extra=extra, bench=bench))


def test_bench_cells_name_the_calibrate_cell_of_their_own_settings():
    """A bench cell of a calibrated method without a draft size names the calibrate cell whose settings
    (policy and its size included) are its own; hand-set sizes, ar and uncalibrated methods name none."""
    text = tiny_toml(extra=CALIBRATE_LAYERSKIP + CALIBRATE_POLICIES)
    s = _sweep(text.replace('[[bench]]\nmethods = ["ar", "pld", "unispec"]\n',
                            '[[bench]]\nmethods = ["ar", "pld", "unispec"]\n\n[[bench]]\nmethods = ["unispec"]\n'
                            'params = { draft_size = 3 }\n', 1))
    cal = {c.id: c for c in s.cells if c.kind == "calibrate"}
    assert sorted((c.method, c.params["policy"], c.params["vocab_size"]) for c in cal.values()) == [
        ("layerskip", "frspec", 128), ("layerskip", "full", None), ("layerskip", "microspec", 128),
        ("pld", "full", None), ("unispec", "full", None)]
    by_policy = {c.params["policy"]: c for c in cal.values() if c.method == "layerskip"}
    assert by_policy["microspec"].params["config"] == {"drafter_layers": "first:1", "vocab": "microspec", "w_max": 128}
    assert by_policy["full"].params["config"] == {"drafter_layers": "first:1"}
    for c in (c for c in s.cells if c.kind == "bench"):
        linked = c.params.get("calibrate_cell")
        if c.method == "ar" or c.params["config"].get("draft_size") is not None:
            assert linked is None, c.describe()
            continue
        src = cal[linked]
        assert (src.method, src.params["policy"], src.params["vocab_size"]) == \
            (c.method, c.params["policy"], c.params["vocab_size"]), c.describe()
    # without calibrate cells for a method, its bench cells take the engine's default (named by none)
    plain = _sweep(tiny_toml())
    assert {c.method for c in plain.cells if c.kind == "bench" and c.params.get("calibrate_cell")} == {"unispec"}


def test_a_calibrated_method_without_a_calibrate_cell_of_its_settings_is_a_config_error():
    with pytest.raises(SweepError) as err:
        _calibrated_sweep(extra=CALIBRATE_LAYERSKIP)          # layerskip full only; the bench has frspec too
    msg = str(err.value)
    assert "[[bench]] #2" in msg and "calibrates 'layerskip'" in msg and "vocab = 'frspec' here, 'full' there" in msg
    assert "add a [[calibrate]] entry" in msg and "params.draft_size" in msg
    with pytest.raises(SweepError, match="draft_size is what a calibration measures"):
        _sweep(tiny_toml(extra='[[calibrate]]\nmethods = ["pld"]\nparams = { draft_size = 4 }\n'))
    with pytest.raises(SweepError, match="'ar' drafts nothing"):
        _sweep(tiny_toml(extra='[[calibrate]]\nmethods = ["ar"]\n'))
    with pytest.raises(SweepError, match=r"put it in its own \[\[calibrate\]\] entry"):
        _sweep(tiny_toml(extra='[[calibrate]]\nmethods = ["pld"]\npolicies = ["microspec"]\n'))


def _driver_for(sweep, out):
    """The driver's bookkeeping without a cluster (its `_calibrated` reads finished calibrate cells' files)."""
    driver = run_module._Driver.__new__(run_module._Driver)
    driver.sweep, driver.out = sweep, out
    return driver


def test_bench_cells_get_their_own_calibrate_cells_g_star_or_fail_naming_it(tmp_path):
    """The driver gives each bench cell the g* of the calibrate cell with its settings (so the policy
    counts); a bench cell whose calibrate cell has no result fails, naming it, instead of running at
    another size."""
    s = _calibrated_sweep()
    cal = [c for c in s.cells if c.kind == "calibrate"]
    g_of = {c.id: 2 + i for i, c in enumerate(cal)}
    for c in cal:
        write_cell(tmp_path, c, pl.DataFrame({"g_star": [g_of[c.id]]}), s.name)
    spec = s.models[0]
    calibrated = _driver_for(s, tmp_path)._calibrated(spec)
    linked = [c for c in s.cells if c.kind == "bench" and c.params.get("calibrate_cell")]
    assert {c.method for c in linked} == {"pld", "unispec", "layerskip"}
    for c in linked:
        params, source = with_calibrated_size(c, calibrated)
        assert params["config"]["draft_size"] == g_of[c.params["calibrate_cell"]], c.describe()
        assert source == f"calibrate:{c.params['calibrate_cell']}"
    # the microspec calibrate cell failed: its bench cells fail and name it; the others still run
    failed = next(c for c in cal if c.params["policy"] == "microspec")
    cell_path(tmp_path, failed).unlink()
    calibrated = _driver_for(s, tmp_path)._calibrated(spec)
    for c in linked:
        params, source = with_calibrated_size(c, calibrated)
        if c.params["calibrate_cell"] != failed.id:
            assert params["config"]["draft_size"] == g_of[c.params["calibrate_cell"]]
            continue
        assert source is None and "draft_size" not in params["config"]
        with pytest.raises(SweepError, match=f"calibrate cell {failed.id}.*has no result"):
            model_cells.bench_cell(params, None, c.method, 1)


def test_quick_sweep_benches_every_drafter_at_a_calibrated_size():
    """The README's main job: every bench cell of a drafting method runs at the g* of a calibrate cell of
    the same sweep with its method, policy and size (none at a hand-set size)."""
    s = load_sweep(Path(__file__).parents[1] / "sweeps" / "configs" / "quick.toml")
    cal = {c.id: c for c in s.cells if c.kind == "calibrate"}
    bench = [c for c in s.cells if c.kind == "bench"]
    drafting = [c for c in bench if c.method in DRAFTING_METHODS]
    assert {c.method for c in drafting} == {"pld", "recycling", "unispec", "eagle", "eagle3", "merged"}
    for c in drafting:
        assert "draft_size" not in c.params["config"], c.describe()
        src = cal[c.params["calibrate_cell"]]
        assert (src.method, src.params["policy"], src.params["vocab_size"]) == \
            (c.method, c.params["policy"], c.params["vocab_size"]), c.describe()
        assert src.params["config"].get("eagle_depth") == c.params["config"].get("eagle_depth")
    assert set(c.params["calibrate_cell"] for c in drafting) == set(cal)     # no calibrate cell left unused
    assert all(len(c.params["grid"]) <= 4 and c.params["prompts"] <= 2 for c in cal.values())   # quick stays quick
