"""Sweeps that meet trouble: a model that cannot load, Ray system errors, hung cells, actors that keep
crashing, a second driver on the same folder, damaged result files, a changed environment on resume, an
extended config, and the multi-node rules (`python -m sweeps.run --address`). Each test names the failure
it guards against; the whole sweeps run on a real local Ray (2 CPUs, 127.0.0.1) with a tiny random model."""

from __future__ import annotations

import tomllib
from pathlib import Path

import polars as pl
import pytest
import ray

from sweeps.cluster import start_local
from sweeps.config import load_sweep, parse_sweep
from sweeps.results import cell_path, result_files
from sweeps.run import run_sweep
from tests.sweeps_testing import TINY_MODEL, tiny_toml, write_toml


def _sweep(text: str):
    return parse_sweep(tomllib.loads(text), default_name="tiny")


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray: 2 CPUs, every process on 127.0.0.1, no dashboard."""
    start_local(num_cpus=2)
    yield
    ray.shutdown()


def _broken_model(tmp_path: Path) -> str:
    """A [[models]] entry whose load raises in the actor's constructor: an existing folder (so the config
    check accepts it) that holds no model."""
    folder = tmp_path / "not-a-model"
    folder.mkdir(exist_ok=True)
    (folder / "README.md").write_text("no weights here")
    return f'[[models]]\nname = "{folder}"\nlabel = "broken"\n'


# ---- 1. a model that fails to load ---------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_a_model_that_cannot_load_fails_its_cells_and_the_sweep_goes_on(local_ray, tmp_path):
    """Ray does not restart an actor whose constructor raised. Before: the record phase dropped the dead
    actors, the bench phase started with none, and `while queue or inflight` spun forever on `ray.wait([])`."""
    text = tiny_toml(kinds=("record", "bench"), bench='[[bench]]\nmethods = ["ar"]\n')
    text = text.replace("[[prompts]]", _broken_model(tmp_path) + "\n[[prompts]]", 1)
    sweep = load_sweep(write_toml(tmp_path, text))
    broken = [c for c in sweep.cells if c.model == "broken"]
    assert {c.kind for c in broken} == {"record", "bench"}
    s = run_sweep(sweep, tmp_path / "out", progress=False)
    assert not s.ok
    assert {f.cell.id for f in s.failed} == {c.id for c in broken}          # only the broken model's cells
    assert s.files == len(sweep.cells) - len(broken)                        # the tiny model's all finished
    for f in s.failed:
        assert "the model could not load in its actor: engine.models.ModelError: could not load a tokenizer" \
            in f.error, f.error
    assert "broken" in s.stopped and "STOPPED model broken" in "\n".join(s.lines())


# ---- 2. any Ray system error fails a cell, never the sweep ---------------------------------------------

@pytest.mark.timeout(300)
def test_ray_system_errors_fail_cells_not_the_sweep(local_ray, tmp_path, monkeypatch):
    """Before: only RayTaskError / RayActorError were caught, so an OutOfMemoryError of a model cell or a
    WorkerCrashedError of a coverage task ended the whole sweep with a traceback."""
    from ray.exceptions import OutOfMemoryError, WorkerCrashedError

    sweep = load_sweep(write_toml(tmp_path, tiny_toml(kinds=("record", "coverage", "bench"),
                                                      bench='[[bench]]\nmethods = ["ar", "pld"]\n')))
    real_get, hit = ray.get, {"bench": 0, "coverage": 0}

    def get(ref, *a, **kw):
        value = real_get(ref, *a, **kw)
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict) and "pid" in value[1] \
                and not hit["bench"] and "draft_size" in value[0].columns:
            hit["bench"] += 1
            raise OutOfMemoryError("Task was killed due to the node running low on memory.")
        if isinstance(value, list) and not hit["coverage"]:
            hit["coverage"] += 1
            raise WorkerCrashedError()
        return value

    monkeypatch.setattr(ray, "get", get)
    s = run_sweep(sweep, tmp_path / "out", progress=False)
    assert hit == {"bench": 1, "coverage": 1}
    errors = {f.cell.kind: f.error for f in s.failed}
    assert set(errors) == {"bench", "coverage"}, s.lines()
    assert "OutOfMemoryError: Task was killed due to the node running low on memory" in errors["bench"]
    assert "actor crash 1 of at most 3" in errors["bench"]
    assert errors["coverage"].startswith("WorkerCrashedError")
    assert s.files == len(sweep.cells) - len(s.failed)
    for f in s.failed:                                  # the full error is kept, and the summary names it
        assert f.details == tmp_path / "out" / "_errors" / f"{f.cell.id}.txt" and f.details.is_file()
        assert str(f.details) in "\n".join(s.lines())
    monkeypatch.setattr(ray, "get", real_get)
    again = run_sweep(sweep, tmp_path / "out", progress=False)           # a rerun finishes them
    assert again.ok, again.lines()
    assert not list((tmp_path / "out" / "_errors").iterdir())           # their old errors are gone


# ---- 3. a hung cell times out ----------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_hung_cell_times_out_and_the_sweep_goes_on(local_ray, tmp_path):
    """Before: no per-cell limit - a cell that never returned held the sweep forever."""
    text = tiny_toml(kinds=("record", "bench"), bench='[[bench]]\nmethods = ["ar", "pld"]\n',
                     testing='hang = ["pld"]', extra="[timeouts]\nbench = 3\n")
    sweep = load_sweep(write_toml(tmp_path, text))
    assert sweep.timeouts["bench"] == 3 and sweep.timeouts["record"] == 3600
    s = run_sweep(sweep, tmp_path / "out", progress=False)
    pld = {c.id for c in sweep.cells if c.method == "pld"}
    assert {f.cell.id for f in s.failed} == pld, s.lines()
    for f in s.failed:
        assert "timed out: the cell took more than 3 s ([timeouts] bench = 3)" in f.error
    assert s.files == len(sweep.cells) - len(pld)
    # run-time settings are not part of the config hash: the folder resumes with the hang gone and more time
    fixed = load_sweep(write_toml(tmp_path, text.replace('hang = ["pld"]', "").replace("bench = 3", "bench = 60"),
                                  "fixed.toml"))
    assert fixed.config_hash != sweep.config_hash      # [testing] counts; [timeouts] does not:
    assert load_sweep(write_toml(tmp_path, text.replace("bench = 3", "bench = 60"), "t.toml")).config_hash \
        == sweep.config_hash


# ---- 4. actor crashes are bounded per model --------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_model_whose_actors_keep_dying_is_stopped_after_max_crashes(local_ray, tmp_path):
    """Before: every death of an actor (after Ray's restarts) started a new one, for as long as cells were
    left - a model that always crashes cost (restarts + 1) process deaths per cell."""
    text = tiny_toml(kinds=("record", "bench"), categories=("qa", "writing", "math_reasoning"),
                     bench='[[bench]]\nmethods = ["ar"]\n', testing="crash = true")
    text = text.replace("calibration_cache = false", "calibration_cache = false\nmax_crashes = 2")
    sweep = load_sweep(write_toml(tmp_path, text))
    assert sweep.max_crashes == 2
    s = run_sweep(sweep, tmp_path / "out", progress=False, max_workers=1)
    assert s.files == 0 and len(s.failed) == len(sweep.cells) == 6
    assert s.crashes["tiny"] == 2 and s.actors == 2
    crashed = [f for f in s.failed if "its actor died" in f.error]
    assert [f.error.split("; ")[-1] for f in crashed] == ["actor crash 1 of at most 2 for tiny",
                                                            "actor crash 2 of at most 2 for tiny"]
    rest = [f for f in s.failed if f not in crashed]
    assert rest and all("its actors died 2 times ([sweep] max_crashes = 2" in f.error for f in rest)
