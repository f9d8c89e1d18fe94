"""Errors a person reads, found before a model loads.

- every verb (`specvocab <verb>`, `python -m <module>`) prints an error of the package as one line
  `error: <message>` on stderr and exits 2, without a traceback; `--debug` / `SPECVOCAB_DEBUG=1` print the
  traceback too; a bug (an exception the package does not define) keeps its traceback;
- every check of the arguments, the prompt set and the data root runs before a model loads: each loader the
  jobs call raises here (`no_model`), so a check that ran after a load fails with that loader's message, and a
  control per verb shows that a good command line does reach the loader.
"""

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specvocab.engine.jobs import args as job_args
from specvocab.sweeps import cli
from tests.sweeps_testing import tiny_toml, write_toml

ROOT = Path(__file__).resolve().parents[1]
LOADED = "a model was loaded before the command line was checked"
LOADERS = ("load_model", "load_architecture", "load_random_model")


def _verb_modules() -> list[str]:
    out = []
    for value in cli.VERBS.values():
        out += [m for m, _ in value.values()] if isinstance(value, dict) else [value[0]]
    return out


# every module a verb runs is imported now, so that `no_model` reaches the loader names they imported
VERB_MODULES = {name: importlib.import_module(name) for name in _verb_modules() if name != "specvocab.sweeps.render"}


@pytest.fixture
def no_model(monkeypatch):
    """Every model loader of the package raises AssertionError (not an error of the package: it propagates
    through `run_main`); the calls are counted."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError(LOADED)

    for name, module in list(sys.modules.items()):
        if name.startswith("specvocab."):
            for attr in LOADERS:
                if callable(getattr(module, attr, None)):
                    monkeypatch.setattr(module, attr, refuse)
    return calls


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv(job_args.DEBUG_ENV, raising=False)


def _refused(capsys, argv: list[str], *fragments: str) -> str:
    """`specvocab <argv>` exits 2 with one line `error: ...` holding every fragment, and no traceback."""
    status = cli.main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert status == 2, (status, err)
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


@pytest.fixture
def empty_root(tmp_path, monkeypatch):
    """A data root that exists and holds nothing."""
    root = tmp_path / "empty_data"
    root.mkdir()
    monkeypatch.setenv("SPECVOCAB_DATA", str(root))
    return root


@pytest.fixture
def missing_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_DATA", str(tmp_path / "no_such_folder"))


@pytest.fixture
def a_file(tmp_path) -> Path:
    """A plain file: an output folder under it cannot be made."""
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


# --- run_main: the package's errors are one line, exit 2; bugs keep their traceback ----------------------------

class FakePackageError(ValueError):
    """Stands for an error class of the package (its module is a `specvocab.` one)."""


FakePackageError.__module__ = "specvocab.engine.fake"


class Derived(FakePackageError):
    """A subclass defined outside the package of a package error class: still the package's error."""


def test_a_package_error_is_one_line_and_exit_2(capsys):
    def main(argv):
        raise FakePackageError("--x 3: too big — pass --x 2")
    assert job_args.run_main(main, []) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: --x 3: too big — pass --x 2\n" and captured.out == ""
    assert job_args.run_main(lambda argv: (_ for _ in ()).throw(Derived("d")), []) == 2
    assert capsys.readouterr().err == "error: d\n"


def test_a_bug_keeps_its_traceback():
    """An exception the package does not define propagates (Python prints its traceback, exit 1)."""
    for exc in (ValueError("plain"), TypeError("t"), KeyError("k"), AssertionError("a")):
        def main(argv, exc=exc):
            raise exc
        with pytest.raises(type(exc)):
            job_args.run_main(main, [])
    assert not job_args.is_package_error(ValueError("x"))
    assert job_args.is_package_error(FakePackageError("x")) and job_args.is_package_error(Derived("x"))


def test_a_main_refusing_with_a_message_exits_2_and_its_status_passes(capsys):
    def refuse(argv):
        raise SystemExit("error: no good — do this")   # the prefix is not doubled
    assert job_args.run_main(refuse, []) == 2
    assert capsys.readouterr().err == "error: no good — do this\n"
    with pytest.raises(SystemExit) as e:               # argparse's own exit(2), or sys.exit(3): as they are
        job_args.run_main(lambda argv: sys.exit(3), [])
    assert e.value.code == 3
    assert job_args.run_main(lambda argv: 1, []) == 1
    assert job_args.run_main(lambda argv: [Path("x")], []) == 0 and job_args.run_main(lambda argv: True, []) == 0


def test_debug_prints_the_traceback_then_the_line(capsys, monkeypatch):
    def main(argv):
        raise FakePackageError("bad — fix")
    for argv, env in ((["--debug"], None), ([], "1")):
        if env:
            monkeypatch.setenv(job_args.DEBUG_ENV, env)
        assert job_args.run_main(main, argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "FakePackageError: bad — fix" in err
        assert err.splitlines()[-1] == "error: bad — fix"
    monkeypatch.setenv(job_args.DEBUG_ENV, "0")            # 0 means off
    assert job_args.run_main(main, []) == 2 and "Traceback" not in capsys.readouterr().err
    # after `--` it is an argument of the job, not the flag
    monkeypatch.delenv(job_args.DEBUG_ENV)
    assert job_args.run_main(main, ["--", "--debug"]) == 2 and "Traceback" not in capsys.readouterr().err


def test_debug_is_global_reaches_nested_mains_and_is_taken_out_of_the_verbs_arguments(monkeypatch):
    """`specvocab --debug <verb>` and `specvocab <verb> --debug`: the verb's main gets its arguments without the
    flag (locality's parser does not know it) and sees SPECVOCAB_DEBUG=1 while it runs; afterwards it is unset."""
    fit = VERB_MODULES["specvocab.engine.jobs.fit_dynaspec"]
    seen = []
    monkeypatch.setattr(fit, "main", lambda argv: seen.append((argv, os.environ.get(job_args.DEBUG_ENV))) or 0)
    assert cli.main(["--debug", "dynaspec", "fit", "--model", "m"]) == 0
    assert cli.main(["dynaspec", "fit", "--model", "m", "--debug"]) == 0
    assert cli.main(["dynaspec", "fit", "--model", "m"]) == 0
    assert seen == [(["--model", "m"], "1"), (["--model", "m"], "1"), (["--model", "m"], None)]
    assert job_args.DEBUG_ENV not in os.environ


def test_debug_through_the_cli_shows_the_traceback(capsys, no_model):
    assert cli.main(["--debug", "bench", "--model", "random-llama", "--prompts", "no_such_set"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "PromptError: unknown prompt set 'no_such_set'" in err
    assert err.strip().splitlines()[-1].startswith("error: unknown prompt set 'no_such_set'")


def test_a_bug_inside_a_verb_propagates(monkeypatch, no_model):
    bench = VERB_MODULES["specvocab.engine.jobs.bench"]

    def broken(*args, **kwargs):
        raise TypeError("a bug")
    monkeypatch.setattr(bench, "run_bench", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["bench", "--model", "random-llama"])


# --- every check before a model loads: verb by verb ------------------------------------------------------------

def test_the_loaders_are_intercepted_for_a_good_command_line(tmp_path, no_model):
    """The control: with good arguments each verb gets as far as loading a model - so the refusals below, which
    never reach the loader, were made before it."""
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"turns": ["hello world"]}) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"settings": {"eagle3_features": True}}))
    good = [
        ["bench", "--model", "random-llama", "--methods", "ar", "--per-category", "1", "--out", str(tmp_path / "b")],
        ["record", "--model", "random-llama", "--prompts", "spec_bench", "--per-category", "1",
         "--out", str(tmp_path / "r")],
        ["calibrate", "--model", "random-llama", "--method", "pld", "--grid", "1,2"],
        ["frequency", "--model", "random-llama", "--corpus", "--texts", str(texts), "--out-dir", str(tmp_path / "f")],
        ["forward", "--model", "random-llama", "--dtype", "fp32", "--sizes", "1"],
        ["train", "data", "--model", "random-llama", "--out", str(tmp_path / "d")],
        ["train", "eagle", "--model", "random-llama", "--data", str(data), "--out", str(tmp_path / "e")],
        ["train", "eagle3", "--model", "random-llama", "--data", str(data), "--out", str(tmp_path / "e3")],
        ["dynaspec", "fit", "--model", "random-llama", "--out", str(tmp_path / "fit.safetensors")],
    ]
    for argv in good:
        before = len(no_model)
        with pytest.raises(AssertionError, match=LOADED):
            cli.main(argv)
        assert len(no_model) == before + 1, argv


def test_bench_refuses_before_the_model(capsys, no_model, a_file, monkeypatch, tmp_path):
    base = ["bench", "--model", "smollm2-135m-instruct"]
    _refused(capsys, ["bench", "--model", "no-such-model"], "--model 'no-such-model': unknown model", "pass one of")
    _refused(capsys, base + ["--prompts", "no_such_set"], "unknown prompt set 'no_such_set'", "spec_bench")
    _refused(capsys, base + ["--prompts", "spec_bench", "--categories", "nope"], "has no categories ['nope']")
    _refused(capsys, base + ["--per-category", "0"], "--per-category 0", "--per-category 1")
    _refused(capsys, base + ["--set", "draft_sise=3"], "--set 'draft_sise=3'", "FIELD one of")
    _refused(capsys, base + ["--methods", "ar", "--set", "draft_size=-2"], "draft_size")
    _refused(capsys, base + ["--methods", "ar,nope"], "['nope']", "available")
    _refused(capsys, base + ["--drafter", "layerskip", "--vocab", "full,frpsec"], "unknown vocab(s) ['frpsec']")
    _refused(capsys, base + ["--drafter", "pld"], "unknown drafter 'pld'")
    _refused(capsys, base + ["--dtype", "fp8"], "unknown dtype 'fp8'")
    _refused(capsys, base + ["--out", str(a_file / "sub")], f"--out {a_file / 'sub'}", "not a folder")
    _refused(capsys, base + ["--specbench-answers", str(a_file)], "--specbench-answers")
    monkeypatch.setenv("SPECVOCAB_DATA", str(tmp_path / "nowhere"))
    _refused(capsys, base, "SPECVOCAB_DATA", "is not a folder")
    monkeypatch.setenv("SPECVOCAB_DATA", str(a_file.parent))     # a data root without spec_bench/
    _refused(capsys, base, "is missing from the data root", "Spec-Bench")
    assert no_model == []


def test_record_refuses_before_the_model(capsys, no_model, a_file, empty_root, tmp_path, monkeypatch):
    base = ["record", "--model", "smollm2-135m-instruct", "--out", str(tmp_path / "r")]
    _refused(capsys, base + ["--prompts", "spec_bench"], "is missing from the data root")      # empty root
    monkeypatch.delenv("SPECVOCAB_DATA")
    _refused(capsys, base + ["--prompts", "specbench"], "unknown prompt set 'specbench'")
    _refused(capsys, base + ["--prompts", "spec_bench", "--per-category", "0"], "--per-category 0")
    _refused(capsys, base + ["--prompts", "spec_bench", "--topk", "0"], "--topk 0")
    _refused(capsys, ["record", "--model", "smollm2", "--prompts", "spec_bench", "--out", "x"], "unknown model")
    _refused(capsys, ["record", "--model", "random-llama", "--prompts", "spec_bench", "--out", str(a_file)],
             "not a folder")
    assert no_model == []


def test_calibrate_refuses_before_the_model(capsys, no_model, missing_root, monkeypatch):
    base = ["calibrate", "--model", "random-llama", "--method", "pld"]
    _refused(capsys, base, "SPECVOCAB_DATA")                                 # the training corpus is not there
    monkeypatch.delenv("SPECVOCAB_DATA")
    _refused(capsys, base + ["--grid", "1,two"], "--grid '1,two'", "comma-separated integers")
    _refused(capsys, base + ["--grid", "0,2"], "--grid '0,2'", ">= 1")
    _refused(capsys, base + ["--set", "pld_max_ngram=0"], "pld_max_ngram")
    _refused(capsys, base + ["--set", "ngram=3"], "--set 'ngram=3'")
    _refused(capsys, base + ["--prompts", "0"], "--prompts 0")
    _refused(capsys, ["calibrate", "--model", "nope"], "unknown model")
    _refused(capsys, base + ["--refit", "--device", "tpu"], "unknown device 'tpu'")
    assert no_model == []


def test_frequency_refuses_before_the_model(capsys, no_model, a_file, tmp_path, monkeypatch):
    base = ["frequency", "--model", "random-llama", "--out-dir", str(tmp_path / "f")]
    _refused(capsys, base + ["--corpus", "nope"], "unknown corpus 'nope'")
    _refused(capsys, base + ["--corpus", "--texts", str(tmp_path / "missing.jsonl")], "does not exist")
    _refused(capsys, base + ["--corpus", "multilingual"], "evaluation set")
    _refused(capsys, base + ["--languages", "xx"], "has no languages ['xx']")
    _refused(capsys, base + ["--sizes", "0"], "list sizes must be >= 1")
    _refused(capsys, base + ["--export", "sglang"], "unknown export(s) ['sglang']")
    _refused(capsys, ["frequency", "--model", "random-llama", "--out-dir", str(a_file)], "--out-dir", "not a folder")
    _refused(capsys, ["frequency", "--model", "nope", "--out-dir", "x"], "unknown model")
    monkeypatch.setenv("SPECVOCAB_DATA", str(tmp_path / "nowhere"))
    _refused(capsys, base, "SPECVOCAB_DATA")
    with pytest.raises(SystemExit) as e:                  # argparse's form, before the model too
        cli.main(base + ["--corpus"])
    assert e.value.code == 2 and "nothing to count" in capsys.readouterr().err
    assert no_model == []


def test_forward_refuses_before_the_first_model(capsys, no_model, a_file):
    base = ["forward", "--model", "random-llama"]
    _refused(capsys, base + ["--dtype", "fp32,fp8"], "unknown dtype 'fp8'")        # the second dtype
    _refused(capsys, base + ["--sizes", "1,x"], "--sizes '1,x'")
    _refused(capsys, base + ["--threads", "1,0"], "--threads '1,0'")
    _refused(capsys, base + ["--repeats", "0"], "--repeats 0")
    _refused(capsys, base + ["--out", str(a_file.parent)], "is a folder")
    _refused(capsys, ["forward", "--model", "no/such/model"], "unknown model")
    assert no_model == []


def test_train_refuses_before_the_model(capsys, no_model, a_file, empty_root, tmp_path, monkeypatch):
    _refused(capsys, ["train", "data", "--model", "random-llama"], "train_corpus", "missing from the data root")
    monkeypatch.delenv("SPECVOCAB_DATA")
    _refused(capsys, ["train", "data", "--model", "random-llama", "--prompts", "nope"], "unknown prompt set 'nope'")
    _refused(capsys, ["train", "data", "--model", "random-llama", "--languages", "xx"], "languages ['xx']")
    _refused(capsys, ["train", "data", "--model", "random-llama", "--source", "teachr"], "['teachr']")
    _refused(capsys, ["train", "data", "--model", "random-llama", "--num-prompts", "0"], "num_prompts must be >= 1")
    _refused(capsys, ["train", "data", "--model", "gpt5"], "unknown model")
    _refused(capsys, ["train", "data", "--model", "random-llama", "--out", str(a_file)], "not a folder")
    for verb in ("eagle", "eagle3"):
        base = ["train", verb, "--model", "random-llama", "--out", str(tmp_path / verb)]
        _refused(capsys, base + ["--data", str(tmp_path / "none")], "holds no training data")
        _refused(capsys, base + ["--head-dtype", "fp8"], "head_dtype 'fp8'")
        _refused(capsys, base + ["--loss-on", "prompt"], "loss_on must be")
        _refused(capsys, ["train", verb, "--model", "nope"], "unknown model")
        _refused(capsys, ["train", verb, "--model", "random-llama", "--out", str(a_file)], "not a folder")
    assert no_model == []


def test_dynaspec_refuses_before_the_model(capsys, no_model, a_file, missing_root, tmp_path, monkeypatch):
    base = ["dynaspec", "fit", "--model", "random-llama"]
    _refused(capsys, base, "SPECVOCAB_DATA")
    monkeypatch.delenv("SPECVOCAB_DATA")
    _refused(capsys, base + ["--prompts", "nope"], "unknown prompt set 'nope'")
    _refused(capsys, base + ["--drafter", "pld"], "drafter 'pld' has no LM head")
    _refused(capsys, base + ["--set", "eagle_dept=3"], "--set 'eagle_dept=3'")       # main's own sys.exit
    _refused(capsys, base + ["--set", "eagle_depth=0"], "eagle_depth")
    _refused(capsys, base + ["--num-clusters", "0"], "num_clusters must be >= 1, got 0")
    _refused(capsys, base + ["--heldout", "1.5"], "heldout must be a fraction in [0, 1), got 1.5")
    _refused(capsys, base + ["--kmeans-init", "kmeans"], "unknown k-means init 'kmeans'")
    _refused(capsys, base + ["--work-dir", str(a_file / "w")], "--work-dir")
    _refused(capsys, ["dynaspec", "fit", "--model", "nope"], "unknown model")
    choices = ["dynaspec", "choices", "--work-dir", str(tmp_path), "--out", str(tmp_path / "o")]
    _refused(capsys, choices + ["--num-clusters", "256,x"], "--num-clusters '256,x'")
    _refused(capsys, choices + ["--top-l", "0"], "--top-l '0'")
    _refused(capsys, choices, "is not a DynaSpec fit's work dir")
    _refused(capsys, ["dynaspec", "choices", "--work-dir", str(tmp_path), "--out", str(a_file)], "not a folder")
    work = tmp_path / "fit"                   # a fit's work dir stopped before it wrote its held-out split
    work.mkdir()
    (work / "fit.json").write_text(json.dumps({"model": "smollm2-135m-instruct", "num_clusters": 8, "top_l": 10}))
    for i in range(2):
        (work / f"log-{i:05d}.safetensors").write_bytes(b"")
    _refused(capsys, ["dynaspec", "choices", "--work-dir", str(work), "--out", str(tmp_path / "o")],
             "has no split.json")
    assert no_model == []


def test_specbench_refuses_before_a_tokenizer(capsys, no_model, a_file, tmp_path):
    _refused(capsys, ["specbench", str(tmp_path), "--out", str(tmp_path / "a")], "no results.parquet")
    _refused(capsys, ["specbench", str(tmp_path), "--out", str(a_file)], "--out", "not a folder")
    assert no_model == []


def test_a_sweep_checks_prompts_and_data_root_before_any_cell(capsys, no_model, monkeypatch, tmp_path):
    run = VERB_MODULES["specvocab.sweeps.run"]
    started = []
    monkeypatch.setattr(run, "run_sweep", lambda *a, **k: started.append(a) or pytest.fail("a cell ran"))
    monkeypatch.setattr(run, "check_contexts", lambda *a, **k: started.append(a) or pytest.fail("checked contexts"))
    config = write_toml(tmp_path, tiny_toml().replace('set = "spec_bench"', 'set = "specbench"'))
    _refused(capsys, ["sweep", str(config), "--out", str(tmp_path / "out")], "unknown prompt set 'specbench'")
    assert cli.main(["--debug", "sweep", str(config), "--out", str(tmp_path / "out")]) == 2     # its own catch too
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: [[prompts]]")
    monkeypatch.setenv("SPECVOCAB_DATA", str(tmp_path / "nowhere"))
    _refused(capsys, ["sweep", str(write_toml(tmp_path, tiny_toml(), "ok.toml")), "--out", str(tmp_path / "out")],
             "SPECVOCAB_DATA")
    assert started == [] and no_model == [] and not (tmp_path / "out").exists()


# --- the module form: a fresh interpreter that cannot load the model -------------------------------------------

def _run(args: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """`python <args>` where loading smollm2 is impossible: its cache root is a file (no conversion can be
    written there) and the hub is offline."""
    blocked = tmp_path / "cache_is_a_file"
    blocked.write_text("")
    full = {k: v for k, v in os.environ.items() if k not in (job_args.DEBUG_ENV, "SPECVOCAB_DATA")}
    full.update(SPECVOCAB_CACHE=str(blocked), HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)


def test_module_form_refuses_in_one_line_before_the_model(tmp_path):
    out = _run(["-m", "specvocab.engine.jobs.bench", "--model", "smollm2-135m-instruct", "--prompts", "nope"],
               tmp_path)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""
    assert out.stderr.startswith("error: unknown prompt set 'nope' — use one of ('spec_bench',")
    # an error class defined by the module run as __main__ (its BenchError) is the package's too
    out = _run(["-m", "specvocab.engine.jobs.bench", "--model", "random-llama", "--methods", "nope"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: method(s) ['nope'] cannot run yet")
    # the control: a good command line does try to load the model, and fails on the blocked cache
    out = _run(["-m", "specvocab.engine.jobs.record", "--model", "smollm2-135m-instruct", "--prompts", "spec_bench",
                "--per-category", "1", "--out", str(tmp_path / "r")], tmp_path)
    assert out.returncode != 0 and "cache_is_a_file" in out.stderr


def test_cli_entry_and_debug_in_a_fresh_interpreter(tmp_path):
    out = _run(["-m", "specvocab.sweeps.cli", "train", "data", "--model", "random-llama", "--prompts", "nope"],
               tmp_path, SPECVOCAB_DEBUG="1")
    assert out.returncode == 2 and out.stderr.startswith("Traceback"), out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: cannot load the training prompts 'nope'")


def test_render_refuses_in_one_line_and_debug_shows_the_traceback(capsys, tmp_path):
    _refused(capsys, ["render", str(tmp_path / "nowhere")], "is not a folder", "sweeps.run")
    assert cli.main(["render", str(tmp_path / "nowhere"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "SweepError" in err and err.strip().splitlines()[-1].startswith("error: ")


# --- every message names the problem, then " — ", then the fix -------------------------------------------------

LIBRARY = ("engine", "kernels", "locality", "sweeps", "specvocab", "notebooks")
FIX_WORDS = ("pass", "run", "use", "set", "choose", "install", "delete", "make", "give", "drop", "rename", "add",
             "check", "remove", "call", "start", "build", "fit", "train", "name", "put", "load", "resolve")
OLD_SEPARATOR = re.compile(r"; (?:%s)\b" % "|".join(FIX_WORDS))


def _message(node: ast.expr) -> str | None:
    """The text of a message written as a literal, an f-string (each {expression} as "{}") or a sum of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message(node.left), _message(node.right)
        return None if left is None or right is None else left + right
    return None


def library_messages() -> list[tuple[str, str]]:
    """(file:line, text) of every exception the library builds with a literal or f-string message: a call of a
    name ending in Error or Exception, or SystemExit, whose first argument is that message."""
    found = []
    for top in LIBRARY:
        assert (ROOT / top).is_dir(), f"{top}/ is gone from the checkout - update LIBRARY in this test"
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name.endswith(("Error", "Exception")) or name == "SystemExit":
                    text = _message(node.args[0])
                    if text is not None:
                        found.append((f"{path.relative_to(ROOT)}:{node.lineno}", text))
    return found


def test_error_messages_separate_the_problem_from_its_fix_with_a_dash():
    """`error: <what> — <the fix>`: no message of the library puts its fix after "; " (a "; " between facts
    stays). The walk itself must see the messages: those raised in engine/harness.py, engine/jobs/args.py
    and sweeps/results.py are among them, and an f-string over several lines reads as one text."""
    call = ast.parse('raise E(f"{x} is empty; "\n        f"pass {y}" + "!")').body[0].exc
    assert _message(call.args[0]) == "{} is empty; pass {}!" and OLD_SEPARATOR.search(_message(call.args[0]))
    messages = library_messages()
    files = {where.rsplit(":", 1)[0] for where, _ in messages}
    assert {"engine/harness.py", "engine/jobs/args.py", "sweeps/results.py"} <= files, sorted(files)[:20]
    assert any(" — " in text for _, text in messages)
    offenders = [f"{where}: ...{text[max(0, m.start() - 30):m.end() + 20]}..." for where, text in messages
                 for m in OLD_SEPARATOR.finditer(text)]
    assert not offenders, ('these messages put their fix after "; " - write " — " instead:\n'
                           + "\n".join(offenders))
