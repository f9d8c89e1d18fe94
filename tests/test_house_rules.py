"""The rules a file of the tree keeps: files a reader can hold (none over MAX_LINES but the exceptions listed here
with their reasons), one safe-filename rule (`engine.atomic.safe_filename`), and test files named by what they
test. Each rule's checker is also run on a synthetic tree that breaks it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from specvocab import locality

ROOT = Path(locality.__file__).parents[1]


# --- files a reader can hold: MAX_LINES, and the files allowed past it with their reasons ----------------------
# A file's own docstring cannot excuse it: an exception is an entry here, with the lines it may not pass (its
# size when listed plus a little, to the next 50) and why it is one file. The test fails on a file over
# MAX_LINES not listed, on a listed file over its own limit, and on an entry whose file is back under MAX_LINES
# or gone (the list only shrinks).

MAX_LINES = 600
OVERSIZE = {
    "sweeps/charts.py": (950, "one builder per figure of the five notebooks beside the shared pieces they all use "
                              "(split by notebook, each part would import the others' pieces)"),
    "engine/native.py": (850, "the decoder, its fixed-shape attention, the cache and the CUDA graphs that replay "
                              "the forward all read one packed layout and one cache layout"),
    "engine/calibration.py": (700, "the fits, the cache's keys and records, and the one resolution of a run's draft "
                                   "size and its source read and write one record format"),
    "engine/metrics.py": (650, "the one place that holds every measure, its interval and the comparisons built on "
                               "them (STYLE.md 14)"),
    "engine/jobs/bench.py": (700, "one bench: the runs it plans, the decode loop over prompts and runs, the "
                                  "diagnosis of rows that differ from ar's and the CLI share the Run records and "
                                  "the row schema"),
    "tests/test_jobs_bench.py": (850, "every behaviour of the bench job, on the one random model fixture it "
                                        "shares"),
    "tests/test_native.py": (850, "parity, row invariance and losslessness share the tree helpers above their "
                                  "tests"),
}


def line_counts(root: Path) -> dict[str, int]:
    """{path relative to `root`: lines} of every .py file in `root`'s folders (hidden folders, build/ and
    results/ left out)."""
    out = {}
    for path in sorted(root.glob("*/**/*.py")):
        rel = path.relative_to(root)
        if any(part.startswith(".") or part in ("build", "results") for part in rel.parts):
            continue
        out[rel.as_posix()] = path.read_text().count("\n")
    return out


def oversize(counts: dict[str, int], allowed: dict[str, tuple[int, str]], limit: int = MAX_LINES) -> list[str]:
    """What breaks the size rule: a file over `limit` not in `allowed`, a listed file over its own limit, a
    listed file no longer over `limit` (or gone)."""
    bad = [f"{p}: {n} lines > {limit} (split it, or list it in OVERSIZE with its reason)"
           for p, n in counts.items() if n > limit and p not in allowed]
    bad += [f"{p}: {counts[p]} lines > its listed {cap}" for p, (cap, _) in allowed.items()
            if p in counts and counts[p] > cap]
    bad += [f"{p}: listed in OVERSIZE but {counts.get(p, 'no')} lines: remove the entry" for p in allowed
            if counts.get(p, 0) <= limit]
    return bad


def test_no_file_over_max_lines_but_the_listed_exceptions():
    counts = line_counts(ROOT)
    assert "sweeps/tables.py" in counts and "tests/test_layering.py" in counts      # the walk sees the tree
    assert all(reason and cap > MAX_LINES for cap, reason in OVERSIZE.values())
    assert oversize(counts, OVERSIZE) == []


def test_the_size_rule_fails_an_oversize_file_whatever_its_docstring_says(tmp_path):
    """The rule's power, on a synthetic tree: a file one line over MAX_LINES fails even when its docstring
    pleads "Over 600 lines on purpose"; a file at MAX_LINES passes; a listed file fails past its own limit, and
    an entry whose file shrank back is stale."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    plea = '"""Over 600 lines on purpose: one reader holds it all."""\n'
    (tmp_path / "pkg" / "big.py").write_text(plea + "x = 1\n" * MAX_LINES)                 # MAX_LINES + 1 lines
    (tmp_path / "pkg" / "sub" / "edge.py").write_text("x = 1\n" * MAX_LINES)               # exactly MAX_LINES
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "skip.py").write_text("x = 1\n" * (MAX_LINES + 5))
    counts = line_counts(tmp_path)
    assert counts == {"pkg/big.py": MAX_LINES + 1, "pkg/sub/edge.py": MAX_LINES}
    assert [b.split(":")[0] for b in oversize(counts, {})] == ["pkg/big.py"]
    assert oversize(counts, {"pkg/big.py": (MAX_LINES + 1, "why")}) == []
    assert [b.split(":")[0] for b in oversize(counts, {"pkg/big.py": (MAX_LINES, "why")})] == ["pkg/big.py"]
    stale = oversize(counts, {"pkg/big.py": (700, "why"), "pkg/sub/edge.py": (700, "why"), "gone.py": (700, "why")})
    assert [b.split(":")[0] for b in stale] == ["pkg/sub/edge.py", "gone.py"]


# --- one rule for naming a file after a model, tokenizer or run: engine.atomic.safe_filename ----------------------

# a character filter that turns a name into a file name: `ch.isalnum() or ch in "-_."`, or a regex class of the
# safe characters `[^A-Za-z0-9...]`
FILENAME_RULE = re.compile(r"\.isalnum\(\)\s+or\s+\w+\s+in\s+['\"][-_.]+['\"]|\[\^A-Za-z0-9")


def filename_rules(root: Path) -> set[str]:
    """The files under `root`'s engine/, sweeps/, kernels/, locality/ that write the safe-filename rule again."""
    return {p.relative_to(root).as_posix() for d in ("engine", "sweeps", "kernels", "locality")
            for p in sorted((root / d).rglob("*.py")) if FILENAME_RULE.search(p.read_text())}


def test_the_safe_filename_rule_is_written_once():
    assert filename_rules(ROOT) == set(), "call engine.atomic.safe_filename instead"
    assert "def safe_filename(" in (ROOT / "engine" / "atomic.py").read_text()


def test_the_filename_rule_check_sees_a_copy(tmp_path):
    (tmp_path / "engine" / "jobs").mkdir(parents=True)
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "engine" / "jobs" / "a.py").write_text(
        'safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)\n')
    (tmp_path / "sweeps" / "b.py").write_text('name = re.sub(r"[^A-Za-z0-9._-]", "-", str(value))\n')
    (tmp_path / "sweeps" / "c.py").write_text('from specvocab.engine.atomic import safe_filename\nx = "a".isalnum()\n')
    assert filename_rules(tmp_path) == {"engine/jobs/a.py", "sweeps/b.py"}


# --- test files named by what they test ------------------------------------------------------------------------

PARTS = ("engine", "kernels", "locality", "sweeps", "notebooks")
# suites that check one property across many modules, named by the property
PROPERTY_SUITES = {
    "test_cli_errors.py": "every CLI's bad input: one line naming the problem and its fix, before a model loads",
    "test_doctests.py": "the `>>>` examples of every docstring that has them",
    "test_exactness_trees.py": "bitwise rows in trees above 32 nodes, through the whole native path",
    "test_gpu.py": "the CUDA path of the decode, end to end",
    "test_install.py": "the wheel and its install beside other distributions",
    "test_house_rules.py": "file sizes, file names and the safe-filename rule over the whole tree",
    "test_layering.py": "the import graph of the whole tree",
    "test_real_models.py": "every method on the offline models, end to end",
    "test_transformers_api.py": "the transformers API the package calls, through every backend",
}


def module_names(root: Path) -> set[str]:
    """The names a test file may carry after `test_`: each module's and package's path below the parts, '/' as
    '_', without `engine/` (most tests are the engine's) and without `ops/` (a folder that only groups)."""
    names = set()
    for part in PARTS:
        for p in (root / part).rglob("*"):
            if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file()):
                rel = [x for x in p.relative_to(root).with_suffix("").parts if x not in ("ops", "__init__")]
                names.add("_".join(rel[1:] if rel[0] == "engine" else rel))
    return (names | set(PARTS)) - {"", "engine"}


def misnamed_tests(root: Path, suites: dict[str, str]) -> list[str]:
    """The test files of `root`/tests whose name is neither `test_<module>[_<aspect>].py` (`module_names`) nor a
    listed property suite."""
    names = module_names(root)
    return [t.name for t in sorted((root / "tests").glob("test_*.py")) if t.name not in suites
            and not any(t.stem[5:] == m or t.stem[5:].startswith(m + "_") for m in names)]


def test_test_files_are_named_by_what_they_test():
    assert misnamed_tests(ROOT, PROPERTY_SUITES) == [], ("name a test file test_<module>[_<aspect>].py after the "
                                                         "module it tests, or list a property suite with its reason")
    assert all(reason and (ROOT / "tests" / name).is_file() for name, reason in PROPERTY_SUITES.items())


def test_the_naming_check_sees_a_misnamed_file(tmp_path):
    for path in ("engine/drafters/__init__.py", "engine/drafters/pld.py", "kernels/cpu/ops/linear.py",
                 "sweeps/run.py", "tests/test_drafters_pld.py", "tests/test_kernels_cpu_linear_threads.py",
                 "tests/test_run.py", "tests/test_pld.py", "tests/test_sweeps_run.py", "tests/test_speed.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert misnamed_tests(tmp_path, {"test_speed.py": "a property"}) == ["test_pld.py", "test_run.py"]


def cross_test_imports(root: Path) -> list[str]:
    """The test modules of `root`/tests that import another test module (a shared check belongs in a
    tests/*_testing.py module, defined once)."""
    bad = []
    for t in sorted((root / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(t.read_text())):
            names = ([node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(re.match(r"tests\.test_", n) for n in names):
                bad.append(t.name)
                break
    return bad


def test_no_test_module_imports_another():
    assert cross_test_imports(ROOT) == [], "move the shared check into a tests/*_testing.py module"


def test_the_test_import_check_sees_one(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from tests.test_b import helper\n")
    (tmp_path / "tests" / "test_b.py").write_text("from tests import test_c\n")
    (tmp_path / "tests" / "test_c.py").write_text("from tests.engine_testing import drive_steps\nimport tests.x\n")
    assert cross_test_imports(tmp_path) == ["test_a.py", "test_b.py"]
