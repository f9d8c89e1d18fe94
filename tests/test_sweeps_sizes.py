"""Where a run's draft size comes from, and that a sweep never reads it from hidden state: every bench row
carries `draft_size` and `draft_size_source` (the bench job run directly too); a sweep's cells take theirs from
a calibrate cell, a calibration file the config names and `sweep.json` hashes, params.draft_size or the
method's uncalibrated default - never the machine's calibration cache; the dry-run and the summary list the
sources, `--strict` refuses models with different ones, and a worker's warnings reach the driver's console.
A tiny random Llama, a real local Ray for the one test that runs sweeps."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tomllib
import warnings
from pathlib import Path

import polars as pl
import pytest
import ray
import torch

from specvocab.engine.calibration import (NO_CALIBRATION, cache_file, calibration_source, code_stamp,
                                         load_calibrations, model_key, save_calibration)
from specvocab.engine.config import SpecConfig
from specvocab.engine.harness import default_draft_size
from specvocab.engine.jobs.bench import run_bench
from specvocab.engine.models import load_model
from specvocab.kernels.hardware import DEFAULT_DTYPE
from specvocab.sweeps.cell import SweepError
from specvocab.sweeps.cluster import start_local
from specvocab.sweeps.config import load_sweep, parse_sweep
from specvocab.sweeps.model_cells import CALIBRATION, ModelWorker, bench_cell, bench_config
from specvocab.sweeps.plan import draft_size_sources, mixed_sources
from specvocab.sweeps.results import load
from specvocab.sweeps.run import _Driver, Summary, main, run_sweep
from tests.sweeps_testing import TINY_MODEL, tiny_toml, write_toml

TINY = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2}        # TINY_MODEL's options
BENCH = '[[bench]]\nmethods = ["ar", "pld", "unispec"]\n'
SECOND = TINY_MODEL.replace('label = "tiny"', 'label = "tiny2"')


def _text(**kw) -> str:
    return tiny_toml(kinds=("bench", "calibrate"), categories=("qa",), bench=BENCH, **kw)


def _two_models(text: str, second: str = SECOND) -> str:
    return text.replace("[[prompts]]", f"[[models]]\n{second}\n\n[[prompts]]", 1)


def _sweep(text: str):
    return parse_sweep(tomllib.loads(text), default_name="tiny")


@pytest.fixture(scope="module")
def tiny():
    """The tiny model as a sweep's worker loads it (default dtype)."""
    return load_model("random-llama", dtype=DEFAULT_DTYPE, **TINY)


def _keys(model, cfg: SpecConfig) -> list[str]:
    """cfg's calibration key on this machine at every torch thread count a run here may use (an actor runs
    one thread, this process its own count)."""
    before, keys = torch.get_num_threads(), []
    try:
        for n in sorted({1, 2, before}):
            torch.set_num_threads(n)
            keys.append(model_key(model, cfg))
    finally:
        torch.set_num_threads(before)
    return keys


def _foreign(path: Path, model, cfgs: list[SpecConfig], g: int) -> Path:
    """A calibration file holding g* = g for each of cfgs' keys on this machine (as another run left it)."""
    for cfg in cfgs:
        for key in _keys(model, cfg):
            save_calibration(key, {"g_star": g, "key": key, "code": code_stamp()}, path)
    return path


# ---- 1. plan time: sources per cell, the dry-run, --strict ------------------------------------------------

def test_each_bench_cell_names_its_draft_size_source_before_it_runs(tmp_path, capsys):
    sweep = _sweep(_text())
    src = {(c.kind, c.method): s for c, s in zip(sweep.cells, draft_size_sources(sweep).values())}
    assert src == {("calibrate", "unispec"): None, ("bench", "ar"): None, ("bench", "pld"): "default",
                   ("bench", "unispec"): "calibrate-cell"}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"some|key": {"g_star": 3}}))
    sha8 = hashlib.sha256(cal.read_bytes()).hexdigest()[:8]
    text = _text(extra="").replace('calibration_cache = false', f'calibration_cache = false\ncalibration = "{cal}"')
    config = write_toml(tmp_path, text)
    filed = load_sweep(config)
    pld = next(c for c in filed.cells if c.method == "pld")
    assert draft_size_sources(filed)[pld.id] == f"calibration-file:{sha8}"
    # the dry-run lists them, per (kind, model, method) and in one line per source
    assert main([str(config), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"draft sizes from calibration-file:{sha8}: 1 bench cells (pld 1)" in out
    assert "draft sizes from calibrate-cell: 1 bench cells (unispec 1)" in out
    # a changed file changes what sweep.json records, so a resume names it
    from specvocab.sweeps.provenance import differences, provenance
    before = provenance(filed)
    assert before["calibration"] == {"path": str(cal), "sha256": hashlib.sha256(cal.read_bytes()).hexdigest()}
    cal.write_text(json.dumps({"some|key": {"g_star": 4}}))
    assert any("calibration file" in d and "changed" in d for d in differences(before, provenance(filed)))


def test_draft_sizes_calibrate_adds_a_calibrate_cell_per_uncovered_bench_point():
    """[sweep] draft_sizes = "calibrate": pld, which no [[calibrate]] entry covers, gets a calibrate cell of its
    own (default grid) on each model and its bench cells run at that cell's g*; unispec keeps its entry's."""
    text = _two_models(_text()).replace("calibration_cache = false",
                                        'calibration_cache = false\ndraft_sizes = "calibrate"')
    sweep = _sweep(text)
    cells = {c.id: c for c in sweep.cells}
    sources = draft_size_sources(sweep)
    for c in sweep.cells:
        if c.kind == "bench" and c.method != "ar":
            cal = cells[c.params["calibrate_cell"]]
            assert sources[c.id] == "calibrate-cell" and (cal.kind, cal.model, cal.method) == ("calibrate", c.model,
                                                                                               c.method)
    added = [c for c in sweep.cells if c.kind == "calibrate" and c.method == "pld"]
    assert sorted(c.model for c in added) == ["tiny", "tiny2"] and all(c.params["grid"] is None for c in added)
    assert mixed_sources(sweep) == []
    with pytest.raises(SweepError, match="draft_sizes"):
        _sweep(text.replace('draft_sizes = "calibrate"', 'draft_sizes = "cache"'))


def test_strict_refuses_models_whose_draft_sizes_come_from_different_sources(tmp_path, capsys):
    """pld: the uncalibrated default on tiny, params.draft_size on tiny2 - mixed; the dry-run says so, --strict
    refuses it (exit 2, naming the method and the sources) before Ray starts."""
    second = SECOND + "\nparams = { draft_size = 3 }"
    text = _two_models(tiny_toml(kinds=("bench",), categories=("qa",), bench='[[bench]]\nmethods = ["pld"]\n'),
                       second)
    config = write_toml(tmp_path, text)
    assert mixed_sources(load_sweep(config)) == ["pld: draft sizes from config (tiny2), default (tiny)"]
    assert main([str(config), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    assert "MIXED" in capsys.readouterr().out
    assert main([str(config), "--out", str(tmp_path / "out"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert "--strict" in err and "pld: draft sizes from config (tiny2), default (tiny)" in err
    assert not (tmp_path / "out").exists()                  # refused before anything was written
    # the same source on both models is not mixed
    same = _two_models(tiny_toml(kinds=("bench",), categories=("qa",), bench='[[bench]]\nmethods = ["pld"]\n'))
    assert mixed_sources(_sweep(same)) == []


# ---- 2. the bench job run directly: its rows say where the size came from ---------------------------------

def test_bench_rows_carry_draft_size_and_its_source(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECVOCAB_CALIBRATION", raising=False)  # the calibration under it
    model = tiny[0]
    common = dict(model="random-llama", prompts="spec_bench", per_category=1, categories=["qa"],
                  max_new_tokens=4, warmup=0, loaded=tiny, progress=False, show=False)
    # an empty cache: the size is calibrated on the spot (engine.resolve) and cached
    plain = run_bench(methods=["ar", "pld"], **common)
    rows = {r["method"]: r for r in plain.to_dicts()}
    assert rows["ar"]["draft_size_source"] is None and rows["pld"]["draft_size_source"] == "on-the-spot"
    cfg = SpecConfig.preset("pld", max_new_tokens=4)
    spot = load_calibrations()[model_key(model, cfg)]
    assert rows["pld"]["draft_size"] == spot["g_star"] <= spot["knee"]
    default = default_draft_size(cfg, model, calibration=NO_CALIBRATION)
    # a record in this machine's cache: the bench job takes it (its rows name the file's digest) ...
    _foreign(tmp_path / "cache" / "calibration.json", model, [cfg], g=24)
    cached = run_bench(methods=["pld"], **common).filter(pl.col("method") == "pld").row(0, named=True)
    sha8 = hashlib.sha256((tmp_path / "cache" / "calibration.json").read_bytes()).hexdigest()[:8]
    assert cached["draft_size_source"] == f"calibration-cache:{sha8}"
    assert cached["draft_size"] == default_draft_size(cfg.replace(draft_size=24), model) != default
    # ... unless told to read none, or given a size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none = run_bench(methods=["pld"], calibration=NO_CALIBRATION, **common).filter(pl.col("method") == "pld")
    assert none.row(0, named=True)["draft_size"] == default and none["draft_size_source"][0] == "default"
    given = run_bench(methods=["pld"], config={"draft_size": 2}, **common).filter(pl.col("method") == "pld")
    assert given["draft_size_source"][0] == "config"


def test_a_calibration_file_without_this_machines_key_is_refused(tiny, tmp_path):
    """A sweep's calibration file made on another device: the cell fails naming the key, not falls back."""
    sweep = _sweep(_text())
    pld = next(c for c in sweep.cells if c.method == "pld")
    cal = tmp_path / "cal.json"
    save_calibration("llama|cpu:Other CPU:1threads|float32|pld|0", {"g_star": 5}, cal)
    src = calibration_source(cal)
    params = {**pld.params, CALIBRATION: {"records": src.records, "label": src.label, "path": src.path}}
    with pytest.raises(SweepError, match=r"has no g\* for .*\|pld\|.*calibrated for another model, device"):
        bench_cell(params, tiny, "pld", 1, warmup=0)
    # with this machine's key it runs at the file's g*, and says so
    cfg = SpecConfig.preset("pld", **bench_config(pld.params))
    _foreign(cal, tiny[0], [cfg], g=24)
    src = calibration_source(cal)
    params[CALIBRATION] = {"records": src.records, "label": src.label, "path": src.path}
    row = bench_cell(params, tiny, "pld", 1, warmup=0).filter(pl.col("method") == "pld").row(0, named=True)
    sha8 = hashlib.sha256(cal.read_bytes()).hexdigest()[:8]
    assert row["draft_size_source"] == src.label == f"calibration-file:{sha8}"
    assert row["draft_size"] == default_draft_size(cfg.replace(draft_size=24), tiny[0])


# ---- 3. worker warnings reach the driver once ------------------------------------------------------------

def test_a_cells_warnings_come_back_with_it_and_the_driver_prints_each_once(capsys):
    class Warner(ModelWorker):
        def __init__(self):
            pass

        def _run(self, kind, method, params):
            warnings.warn("no calibrated draft size for pld (test)", UserWarning)
            warnings.warn("no calibrated draft size for pld (test)", UserWarning)
            return pl.DataFrame({"x": [1]}), {}

    frame, stats = Warner().run("bench", "pld", {})
    assert stats["warnings"] == ["UserWarning: no calibrated draft size for pld (test)"]
    driver = object.__new__(_Driver)                        # the bookkeeping alone, no Ray
    driver.warned, driver.summary = set(), Summary(out=Path("."), total=2)
    driver.bar = type("Bar", (), {"write": staticmethod(print)})()
    sweep = _sweep(_text())
    cell = next(c for c in sweep.cells if c.method == "pld")
    for _ in range(2):                                      # two cells (two actors) raising the same warning
        driver._warnings(cell, stats)
    assert capsys.readouterr().out.count("no calibrated draft size for pld (test)") == 1
    assert driver.summary.warnings == stats["warnings"]


# ---- 4. a real sweep, twice: the machine's cache changes nothing ------------------------------------------

@pytest.fixture(scope="module")
def worker_cache(tmp_path_factory):
    """$SPECVOCAB_CACHE for this process and the Ray workers it starts (they inherit the environment
    `ray.init` sees): the machine's calibration cache, as the sweep's actors find it."""
    old = os.environ.get("SPECVOCAB_CACHE")
    named = os.environ.pop("SPECVOCAB_CALIBRATION", None)       # the calibration under it, not the suite's file
    os.environ["SPECVOCAB_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield Path(os.environ["SPECVOCAB_CACHE"])
    if old is None:
        del os.environ["SPECVOCAB_CACHE"]
    else:
        os.environ["SPECVOCAB_CACHE"] = old
    if named is not None:
        os.environ["SPECVOCAB_CALIBRATION"] = named


@pytest.fixture(scope="module")
def local_ray(worker_cache):
    """A real local Ray: 2 CPUs, every process on 127.0.0.1, no dashboard; its workers' calibration cache is
    `worker_cache`."""
    start_local(num_cpus=2)
    yield
    ray.shutdown()


@pytest.mark.timeout(600)
def test_a_foreign_calibration_cache_changes_no_draft_size(local_ray, worker_cache, tiny, tmp_path, capsys):
    """Run 1 with an empty cache; then a calibration file from another run, holding g* = 24 for every bench
    key of this sweep, lands in the machine's cache and the bench cells run again: the same draft sizes,
    from the same sources (unispec from its calibrate cell, pld from its uncalibrated default)."""
    cache = ray.get(ray.remote(cache_file).remote())             # where a worker looks
    assert cache == worker_cache / "calibration.json" and not cache.exists()
    sweep = load_sweep(write_toml(tmp_path, _text()))
    out = tmp_path / "out"
    s = run_sweep(sweep, out, progress=False)
    assert s.ok, s.lines()
    printed = capsys.readouterr().out
    assert printed.count("warning from ") >= 1 and printed.count("no calibrated draft size for pld") == 1
    assert "draft sizes from default: 1 bench cells (pld 1)" in printed
    cols = ["method", "draft_size", "draft_size_source"]
    first = load(out, "bench").select(cols).collect().sort("method")
    assert first.rows() == [("ar", None, None), ("pld", first["draft_size"][1], "default"),
                            ("unispec", first["draft_size"][2], "calibrate-cell")]
    bench = [c for c in sweep.cells if c.kind == "bench" and c.method != "ar"]
    cfgs = [SpecConfig.preset(c.method, **{**bench_config(c.params), "draft_size": None}) for c in bench]
    _foreign(cache, tiny[0], cfgs, g=24)
    assert len(load_calibrations(cache)) >= 2
    shutil.rmtree(out / "kind=bench")                       # the bench cells run again; calibrate is finished
    s = run_sweep(sweep, out, progress=False, show=False)
    assert s.ok and dict(s.ran) == {"bench": 3}, s.lines()
    assert load(out, "bench").select(cols).collect().sort("method").equals(first)
