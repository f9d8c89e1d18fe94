"""Sweeps that meet trouble: a model that cannot load, Ray system errors, hung cells, actors that keep
crashing, a second driver on the same folder, damaged result files, a changed environment on resume, an
extended config, and the multi-node rules (`python -m specvocab.sweeps.run --address`). Each test names the failure
it guards against; the whole sweeps run on a real local Ray (2 CPUs, 127.0.0.1) with a tiny random model."""

from __future__ import annotations

import tomllib
from pathlib import Path

import polars as pl
import pytest
import ray

from specvocab.sweeps.cell import SweepError
from specvocab.sweeps.cluster import start_local
from specvocab.sweeps.config import load_sweep, parse_sweep
from specvocab.sweeps.results import cell_path, result_files
from specvocab.sweeps.run import run_sweep
from tests.sweeps_testing import tiny_toml, write_toml


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
        assert "the model could not load in its actor: specvocab.engine.models.ModelError: could not load a tokenizer" \
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


# ---- 6. one driver per output folder ---------------------------------------------------------------------

def test_a_second_driver_on_the_same_folder_is_refused_naming_the_first(tmp_path):
    """Before: two drivers on one folder both ran every unfinished cell (and raced on the manifest)."""
    import socket
    import subprocess
    import sys

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from specvocab.sweeps.results import lock_output; "
                               f"held = lock_output({str(out)!r}); print('locked', flush=True); time.sleep(120)"],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        sweep = _sweep(tiny_toml(kinds=("record",)))
        with pytest.raises(SweepError) as err:
            run_sweep(sweep, out, progress=False)
        msg = str(err.value)
        assert f"in use by another sweeps.run driver (pid {holder.pid} on host {socket.gethostname()}" in msg
        assert not (out / "sweep.json").exists()                 # refused before touching anything
    finally:
        holder.kill()
        holder.wait()
    from specvocab.sweeps.results import lock_output

    with lock_output(out):                                       # the OS released the dead holder's lock
        assert (out / ".sweep.lock.owner").is_file()
    assert not (out / ".sweep.lock.owner").exists()


# ---- 7. a damaged result file is set aside and its cell runs again -----------------------------------------

def test_a_damaged_result_file_is_moved_aside_and_not_counted_finished(tmp_path):
    """Before: "finished" meant "the file exists": a truncated file counted as done forever (and broke
    `sweeps.load`)."""
    from specvocab.sweeps.results import finished, write_cell

    sweep = _sweep(tiny_toml(kinds=("record",)))
    a, b = sweep.cells[:2]
    out = tmp_path / "out"
    for c in (a, b):
        write_cell(out, c, pl.DataFrame({"x": [1, 2, 3]}), sweep.name)
    path = cell_path(out, b)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])                      # cut short, as by a full disk or a bad copy
    damaged: list = []
    assert finished(out, [a, b], damaged) == {a.id}
    assert not path.exists() and damaged == [(path, damaged[0][1])]
    moved = damaged[0][1]
    assert moved.parent == path.parent and moved.name.startswith(f"{path.name}.damaged-")
    assert moved.read_bytes() == data[: len(data) // 2]           # kept, not deleted
    assert result_files(out) == [cell_path(out, a)]               # and invisible to load


def test_publishing_a_result_fsyncs_the_file_and_every_folder_it_created(tmp_path, monkeypatch):
    import os

    from specvocab.sweeps import results

    synced: list = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sweep = _sweep(tiny_toml(kinds=("record",)))
    path = results.write_cell(tmp_path, sweep.cells[0], pl.DataFrame({"x": [1]}), sweep.name)
    # the file (under its temporary name), its folder, and the parents of the hive folders made for it
    assert any(".parquet" in s and s.endswith(".tmp") for s in synced)
    for folder in (path.parent, path.parent.parent, path.parent.parent.parent, tmp_path):
        assert str(folder) in synced, (folder, synced)


@pytest.mark.timeout(300)
def test_a_damaged_cell_runs_again(local_ray, tmp_path):
    sweep = load_sweep(write_toml(tmp_path, tiny_toml(kinds=("record",))))
    out = tmp_path / "out"
    assert run_sweep(sweep, out, progress=False).ok
    path = cell_path(out, sweep.cells[0])
    path.write_bytes(path.read_bytes()[:100])
    s = run_sweep(sweep, out, progress=False)
    assert s.ok and s.ran["record"] == 1 and s.skipped == len(sweep.cells) - 1
    assert "damaged result file" in "\n".join(s.lines())
    assert len(list(path.parent.glob(f"{path.name}.damaged-*"))) == 1
    pl.read_parquet(path)


# ---- 8. provenance ---------------------------------------------------------------------------------------

def test_provenance_is_recorded_and_a_changed_environment_is_named_on_resume(tmp_path, monkeypatch, capsys):
    """Before: sweep.json said nothing of the code, libraries or data that made the results."""
    import json

    from specvocab.sweeps import provenance
    from specvocab.sweeps.results import prepare_output

    sweep = _sweep(tiny_toml(kinds=("record",)))
    out = prepare_output(tmp_path / "out", sweep)
    prov = json.loads((out / "sweep.json").read_text())["provenance"]
    assert prov["specvocab"] and prov["torch"] and prov["transformers"]
    if provenance.checkout() is not None:
        assert len(prov["git_commit"]) == 40
    assert set(prov["data"]) >= {"spec_bench/question.jsonl", "train_corpus/prompts.jsonl"}
    assert all(len(v) == 16 for v in prov["data"].values())
    # a resume under another torch and other data: a warning naming both ...
    changed = {**prov, "torch": "0.0.1", "data": {**prov["data"], "spec_bench/question.jsonl": "0" * 16}}
    monkeypatch.setattr(provenance, "provenance", lambda s: changed)
    capsys.readouterr()
    prepare_output(out, sweep)
    err = capsys.readouterr().err
    assert f"torch {prov['torch']} -> 0.0.1" in err and "data file spec_bench/question.jsonl changed" in err
    # ... or, with --strict-provenance, an error (exit status 2 from the command line)
    with pytest.raises(SweepError, match=r"started under another environment: .*torch"):
        prepare_output(out, sweep, strict_provenance=True)
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["provenance"] == prov and manifest["runs"][-1]["provenance"]["torch"] == "0.0.1"


# ---- 9. --extend -----------------------------------------------------------------------------------------

def test_extend_takes_a_superset_config_into_the_folder_without_recomputing(tmp_path):
    """Before: any other config hash was refused, even one that only adds a seed or a window size."""
    import json

    from specvocab.sweeps.results import prepare_output, write_cell

    base = tiny_toml(kinds=("record", "coverage", "bench"), bench='[[bench]]\nmethods = ["ar"]\n')
    old = _sweep(base)
    out = prepare_output(tmp_path / "out", old)
    for c in old.cells:
        write_cell(out, c, pl.DataFrame({"x": [1]}), old.name)
    wider = _sweep(base.replace("warmup = 0", "warmup = 0\nseeds = [0, 1]").replace("w_max = [64, 256, 1024]",
                                                                                    "w_max = [64, 256, 1024, 2048]"))
    assert {c.id for c in old.cells if c.kind != "coverage"} < {c.id for c in wider.cells}
    with pytest.raises(SweepError, match="pass --extend"):
        prepare_output(out, wider)
    stamps = {f: f.stat().st_mtime_ns for f in result_files(out)}
    prepare_output(out, wider, extend=True)
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["config_hash"] == wider.config_hash and manifest["extended"][0]["config_hash"] == old.config_hash
    from specvocab.sweeps.results import finished

    done = finished(out, wider.cells)
    kept = {c.id for c in old.cells if c.id in {w.id for w in wider.cells}}
    assert done == kept                                        # old cells finished, nothing recomputed
    assert {f: stamps[f] for f in result_files(out)} == {f: f.stat().st_mtime_ns for f in result_files(out)}
    # the window cell with the shorter w_max list moved aside (its rows would count twice), not deleted
    window = [c for c in old.cells if c.kind == "coverage" and c.params["analysis"] == "window"]
    assert window and not any(cell_path(out, c).exists() for c in window)
    assert len(list((out / "_superseded").rglob("*.parquet"))) == len(window)
    assert prepare_output(out, wider) == out                  # the extended folder resumes as usual
    # not a superset (another max_new_tokens changes every model cell): refused, even with --extend
    with pytest.raises(SweepError, match="does not extend"):
        prepare_output(out, _sweep(base.replace("max_new_tokens = 8", "max_new_tokens = 9")), extend=True)


# ---- 10. multi-node --------------------------------------------------------------------------------------

def test_address_needs_an_absolute_out(tmp_path, capsys):
    """Before: a relative --out under `ray job submit` landed in the job's temporary copy of the working dir."""
    from specvocab.sweeps.run import main

    config = write_toml(tmp_path, tiny_toml(kinds=("record",)))
    assert main([str(config), "--out", "results/x", "--address", "auto"]) == 2
    assert "--out results/x is a relative path — with --address give an absolute one" in capsys.readouterr().err


def test_attaching_from_a_checkout_ships_it_unless_inside_a_ray_job(monkeypatch):
    from specvocab.sweeps import cluster, provenance

    for var in cluster.JOB_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECVOCAB_DATA", "/shared/data")
    monkeypatch.setattr(provenance, "checkout", lambda: Path("/src/specvocab"))
    env = cluster.checkout_runtime_env()
    assert env["working_dir"] == "/src/specvocab" and ".git" in env["excludes"]
    assert env["env_vars"] == {"SPECVOCAB_DATA": "/shared/data"}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")           # what `ray job submit` sets
    assert cluster.checkout_runtime_env() is None
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    monkeypatch.setattr(provenance, "checkout", lambda: None)         # an installed package
    assert cluster.checkout_runtime_env() is None


def test_models_request_memory_and_cpus_for_their_actors():
    text = tiny_toml(kinds=("record",)).replace("num_layers = 2 }", 'num_layers = 2 }\nmemory = "2GiB"\nnum_cpus = 2', 1)
    (m,) = _sweep(text).models
    assert (m.memory, m.num_cpus) == (2 * 2**30, 2.0)
    assert _sweep(text).config_hash == _sweep(tiny_toml(kinds=("record",))).config_hash   # run-time settings
    with pytest.raises(SweepError, match="is not a memory size"):
        _sweep(text.replace('"2GiB"', '"lots"'))
    with pytest.raises(SweepError, match="num_cpus must be a number of CPUs > 0"):
        _sweep(text.replace("num_cpus = 2", "num_cpus = 0"))


def test_calibration_cache_defaults_off_under_address(tmp_path, monkeypatch):
    from specvocab.sweeps import run as run_module

    seen = {}
    sweep = _sweep(tiny_toml(kinds=("calibrate",)).replace("calibration_cache = false\n", ""))
    assert sweep.calibration_cache is True and not sweep.calibration_cache_set

    class Stop(Exception):
        pass

    def driver(sweep, out, summary, bar, max_workers, calibration_cache=None):
        seen["cache"] = calibration_cache
        raise Stop

    monkeypatch.setattr(run_module, "connect", lambda address, num_cpus: False)
    monkeypatch.setattr(run_module, "_Driver", driver)
    with pytest.raises(Stop):
        run_sweep(sweep, tmp_path / "a", address="auto", progress=False)
    assert seen["cache"] is False
    with pytest.raises(Stop):
        run_sweep(sweep, tmp_path / "b", progress=False)
    assert seen["cache"] is True
    explicit = _sweep(tiny_toml(kinds=("calibrate",), calibration_cache=str(tmp_path / "cal")))
    with pytest.raises(Stop):
        run_sweep(explicit, tmp_path / "c", address="auto", progress=False)
    assert seen["cache"] == str((tmp_path / "cal").resolve())


def test_workers_get_their_prompts_from_the_driver(tmp_path, monkeypatch):
    """Before: record and bench cells loaded their prompt set from the worker's own data root (absent on
    another machine). Now the driver sends them: a worker whose data root is empty still runs both."""
    from specvocab.sweeps import model_cells
    from specvocab.sweeps.model_cells import SHIPPED, ModelWorker, shipped_prompts

    sweep = _sweep(tiny_toml(kinds=("record", "bench"), bench='[[bench]]\nmethods = ["ar"]\n'))
    cells = {c.kind: c for c in sweep.cells}
    sent = {k: {**c.params, SHIPPED: shipped_prompts(c.params)} for k, c in cells.items()}
    direct = {k: model_cells.load_selected(c.params) for k, c in cells.items()}
    empty = tmp_path / "empty-data"
    empty.mkdir()
    monkeypatch.setenv("SPECVOCAB_DATA", str(empty))                  # a worker node without the data sets
    with pytest.raises(Exception, match="missing from the data root"):
        model_cells.load_selected(cells["record"].params)
    spec = sweep.models[0]
    worker = ModelWorker(spec.name, spec.options, None, 1)
    record, _ = worker.run("record", "-", sent["record"])
    assert record.height == sum(len(p.turns) for p in direct["record"])
    bench, _ = worker.run("bench", "ar", sent["bench"])
    assert set(bench["prompt_set"]) == {"spec_bench"}
    assert set(bench["prompt_id"]) == {p.prompt_id for p in direct["bench"]}


def test_workers_get_the_training_corpus_from_the_driver(tmp_path, monkeypatch):
    """Before: calibrate cells drew their prompts, and FR-Spec its ranking, from the worker's own training
    corpus. Now the driver reads it (`data_files`) and the actor installs it as its own data root
    (`install_data`): a worker whose data root is empty runs a calibrate cell, a frspec bench cell and the
    token ranking, on the same prompts and counts as with the driver's root - and its data root holds the
    training corpus only, so no evaluation set can be read there."""
    from specvocab.engine.jobs.calibrate import calibration_prompts
    from specvocab.engine.prompts import DATA_ENV, data_root
    from specvocab.sweeps.model_cells import SHIPPED, ModelWorker, data_files, install_data, model_ranking, shipped_prompts

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))   # rankings and the installed data here
    sweep = _sweep(tiny_toml(kinds=("bench", "calibrate"), bench='''
[[bench]]
methods = ["layerskip"]
policies = ["frspec"]
vocab_sizes = [128]
params = { drafter_layers = "first:1", draft_size = 3 }
''', extra='''
[[calibrate]]
methods = ["pld"]
grid = [1, 2]
prompts = 1
warmup = 0
'''))
    cells = {c.kind: c for c in sweep.cells}
    files = data_files()
    assert set(files) == {"train_corpus/prompts.jsonl"}
    spec = sweep.models[0]
    here = ModelWorker(spec.name, spec.options, None, 1)
    want_prompts = calibration_prompts(None, here.loaded[2], n=1, warmup=0)
    want_ranking = model_ranking(here.loaded)
    sent = {**cells["bench"].params, SHIPPED: shipped_prompts(cells["bench"].params)}

    empty = tmp_path / "empty-data"
    empty.mkdir()
    monkeypatch.setenv(DATA_ENV, str(empty))                         # a worker node without the data sets
    worker = ModelWorker(spec.name, spec.options, None, 1, data=files)
    root = data_root()
    assert root != empty and root.is_relative_to(tmp_path / "cache")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == \
        ["train_corpus/prompts.jsonl"]
    assert [t.tolist() for t in calibration_prompts(None, worker.loaded[2], n=1, warmup=0)[0]] == \
        [t.tolist() for t in want_prompts[0]]
    assert model_ranking(worker.loaded).equals(want_ranking)
    cal, _ = worker.run("calibrate", "pld", cells["calibrate"].params)
    assert cal["g_star"].drop_nulls().len() > 0
    bench, _ = worker.run("bench", "layerskip", sent)
    assert set(bench["policy"]) == {"frspec"} and bench["vocab_file"].drop_nulls().len() == bench.height
    assert install_data(files) == root                                # a second actor reuses the installed root


# ---- timed actors on their own physical cores; the driver's work counted ---------------------------------

def _fake_sysfs(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cores.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_physical_cores_take_one_hardware_thread_per_core(tmp_path):
    """Two sockets x two cores x two hyper-threads (siblings numbered as Linux does: cpu n and n + 4 share a
    core): one CPU per core, the lowest; core ids repeat across sockets; a CPU without topology is its own."""
    from specvocab.sweeps.cluster import physical_cores

    topo = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)}
    sysfs = _fake_sysfs(tmp_path / "cpu", topo)
    assert physical_cores(set(range(8)), sysfs) == [0, 1, 2, 3]
    assert physical_cores({4, 5, 6, 7}, sysfs) == [4, 5, 6, 7]         # only the CPUs this process may use
    assert physical_cores({1, 5, 9}, sysfs) == [1, 9]                  # 1 and 5 share a core; 9 has no topology


def test_pin_process_pins_the_thread_and_the_threads_it_starts(tmp_path):
    """In a child process: after pin_process, the calling thread and a thread it starts later (as torch starts
    its compute threads) may run on the one CPU only; a thread started before keeps its CPUs."""
    import subprocess
    import sys

    code = '''
import os, threading
from specvocab.sweeps.model_cells import pin_process
seen = {}
def tid(name):
    seen[name] = threading.get_native_id()
    stop.wait()
stop = threading.Event()
before = threading.Thread(target=tid, args=("before",)); before.start()
cpus = sorted(os.sched_getaffinity(0))
print(pin_process([cpus[-1]]) == [cpus[-1]])
after = threading.Thread(target=tid, args=("after",)); after.start()
while len(seen) < 2: pass
print(os.sched_getaffinity(seen["after"]) == {cpus[-1]}, os.sched_getaffinity(seen["before"]) == set(cpus))
stop.set(); before.join(); after.join()
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]


@pytest.mark.timeout(300)
def test_timed_actors_get_distinct_physical_cores_and_the_driver_is_counted(local_ray, tmp_path):
    """On a local Ray (2 CPUs here): the actors that run timed cells each hold one physical core, no two the
    same while alive; the summary names the cores and the driver's own CPU time."""
    from specvocab.sweeps.cluster import physical_cores

    sweep = _sweep(tiny_toml(kinds=("bench",), bench='[[bench]]\nmethods = ["ar", "pld"]\n'))
    s = run_sweep(sweep, tmp_path / "out", progress=False, show=False)
    assert s.ok
    cores = physical_cores()
    assert s.actor_cores and all(len(c) == 1 and c[0] in cores for c in s.actor_cores.values())
    if len(cores) >= 2 and len(s.actor_cores) >= 2:
        assert len({tuple(c) for c in s.actor_cores.values()}) == len(s.actor_cores)   # one core each
    text = "\n".join(s.lines())
    assert "model actors pinned to physical cores" in text
    assert 0 < s.driver_cpu_s < s.wall_s and f"driver: {s.driver_cpu_s:.1f} s of CPU" in text


# ---- divergences diagnosed across cells -------------------------------------------------------------------

@pytest.mark.timeout(400)
def test_a_bench_row_that_differs_from_ar_in_another_cell_is_diagnosed(local_ray, tmp_path):
    """ar runs in a cell of its own, so a method's cell cannot diagnose its rows as it goes. The driver does it
    after the model's cells (and on a rerun, for rows an earlier run left): a pld row made to differ from ar's
    at its third token gets, through `sweeps.load`, first_divergence 2, ar's margin there and a verdict - the
    tampered token is not ar's top-2 near-tie, so "mismatch" - while the rows equal to ar's read "exact"."""
    from specvocab.engine.divergence import VERDICTS
    from specvocab.sweeps.results import diagnosis_path, load

    sweep = _sweep(tiny_toml(kinds=("bench",), bench='[[bench]]\nmethods = ["ar", "pld"]\n'))
    out = tmp_path / "out"
    first = run_sweep(sweep, out, progress=False, show=False)
    assert first.ok and first.diagnosed == 0 and not diagnosis_path(out, "tiny").exists()   # all lossless
    pld = next(c for c in sweep.cells if c.method == "pld")
    path = cell_path(out, pld)
    frame = pl.read_parquet(path)
    i = next(j for j, n in enumerate(frame["new_tokens"]) if n >= 4)
    ids = frame["output_ids"].to_list()
    ids[i] = ids[i][:2] + [(ids[i][2] + 1) % 256] + ids[i][3:]       # another byte at the third token
    frame.with_columns(pl.Series("output_ids", ids, dtype=frame.schema["output_ids"])).write_parquet(path)
    before = load(out, "bench").filter(pl.col("method") == "pld").collect()
    tampered = ((pl.col("prompt_id") == frame["prompt_id"][i]) & (pl.col("turn") == frame["turn"][i])
                & (pl.col("repeat") == frame["repeat"][i]))
    assert before.filter(tampered)["verdict"].to_list() == [None]                   # differs, not diagnosed yet
    assert set(before.filter(~tampered)["verdict"]) == {"exact"}                    # equal to ar's (sweeps.load)

    second = run_sweep(sweep, out, progress=False, show=False)
    assert second.ok and second.diagnosed >= 1 and sum(second.ran.values()) == 0      # nothing re-ran
    rows = load(out, "bench").filter(pl.col("cell_id") == pld.id).collect()
    hit = rows.filter(pl.col("prompt_id") == frame["prompt_id"][i], pl.col("turn") == frame["turn"][i],
                      pl.col("repeat") == frame["repeat"][i])
    assert hit["first_divergence"].to_list() == [2] and hit["verdict"].to_list() == ["mismatch"]
    assert hit["ar_margin"][0] >= 0 and hit["ar_gap"][0] > 0 and hit["verdict"][0] in VERDICTS
    judged = rows.filter(pl.col("verdict") != "exact")                # the tampered row, and later turns of its
    assert set(judged["prompt_id"]) == {frame["prompt_id"][i]}        # conversation (their prompt differs), only
    assert set(judged["turn"]) <= set(range(frame["turn"][i], 10)) and set(judged["repeat"]) == {frame["repeat"][i]}
    assert "diagnosed" in "\n".join(second.lines())
    third = run_sweep(sweep, out, progress=False, show=False)                         # nothing left to do
    assert third.ok and third.diagnosed == 0 and third.actors == 0
