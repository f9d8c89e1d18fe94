"""The layers point one way: `locality` is pure (token ids and polars frames in, frames out) and loads
nothing from `engine` or `kernels`, nor torch or transformers; `engine` may use `locality`, not the reverse; the
library never imports the jobs above it, and no job imports another job (what two jobs share is library code).
Each rule's checker is also run on a synthetic tree that breaks it. The rules on files - sizes, names, the
safe-filename rule - are `tests/test_house_rules.py`."""

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

from specvocab import locality
FORBIDDEN = ("engine", "kernels", "torch", "transformers")

_PROBE = """
import importlib, json, sys
names = json.loads(sys.argv[1])
for name in names:
    importlib.import_module(name)
loaded = sorted({m.split(".")[1] if m.startswith("specvocab.") else m.split(".")[0] for m in sys.modules if m != "specvocab"}
                & set(json.loads(sys.argv[2])))
print(json.dumps(loaded))
"""


def _modules(package) -> list[str]:
    return [package.__name__] + [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]


def _loaded_by(names: list[str], forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    """Top-level packages among `forbidden` that importing `names` in a fresh interpreter loads."""
    root = Path(locality.__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(names), json.dumps(forbidden)], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_locality_module_imports_no_engine_kernels_torch_or_transformers():
    names = _modules(locality)
    assert {"specvocab.locality.stream", "specvocab.locality.coverage", "specvocab.locality.trace", "specvocab.locality.shortlist"} <= set(names)
    assert _loaded_by(names) == []


def test_the_probe_sees_a_forbidden_import():
    """The check can fail: importing an engine module is seen (it loads engine, kernels and torch)."""
    assert {"engine", "torch"} <= set(_loaded_by(["specvocab.engine.vocab"]))


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported module, at the top of the module?) for every import statement in a module's source."""
    path = Path(locality.__file__).parents[1] / module.removeprefix("specvocab.").replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, id(node) in top))
    return out


def test_vocab_policies_and_lmhead_drafters_import_one_way_at_the_top():
    """specvocab.engine.vocab (the policies, PhaseTimer from engine.timing) sits below engine.drafters.lmhead, which builds
    policies: no module of the vocab package imports the drafters, not even inside a function, and lmhead
    imports at the top."""
    modules = ["specvocab.engine.vocab", "specvocab.engine.vocab.base", "specvocab.engine.vocab.frspec", "specvocab.engine.vocab.microspec",
               "specvocab.engine.vocab.dynaspec"]
    for name in modules:
        assert not [m for m, _ in _imports(name) if m.startswith("specvocab.engine.drafters")], name
    assert ("specvocab.engine.timing", True) in _imports("specvocab.engine.vocab.base")
    lmhead = _imports("specvocab.engine.drafters.lmhead")
    assert ("specvocab.engine.vocab", True) in lmhead and all(top for _, top in lmhead)
    assert not [m for m, _ in _imports("specvocab.engine.timing") if m.startswith("specvocab.engine")]
    # importing the policies does not load the drafter module that builds them
    loaded = subprocess.run([sys.executable, "-c", "import sys, specvocab.engine.vocab; "
                             "print('specvocab.engine.drafters.lmhead' in sys.modules)"],
                            cwd=Path(locality.__file__).parents[1], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "False"


# --- engine/: the library never imports the jobs above it, imports at the top, and has no import cycle --------
# (STYLE.md 13). One parser for the three checks: every import statement of a module's source, with
# the function that holds it (None at module level), plus `importlib.import_module` / `__import__` calls.

ROOT = Path(locality.__file__).parents[1]
UPWARD = ("specvocab.engine.jobs", "specvocab.sweeps")            # what engine/ never imports (engine/jobs: sweeps only)
DYNAMIC = "<dynamic>"                         # importlib.import_module(<not a constant>)

# The imports inside functions that stay, each with its reason. Keys are (module, function, imported module).
# The test fails on any other such import, and on an entry here that no longer exists (the list only shrinks).
ALLOWED_IN_FUNCTIONS = {
    ("specvocab.engine", "__getattr__", DYNAMIC):
        "the package's lazy exports: an eager import would load engine.vocab and the others before "
        "`python -m specvocab.engine.<module>` runs that module",
    ("specvocab.engine.drafters", "drafter_factory", DYNAMIC):
        "the drafter registry: a method's module is imported on first use (adding a method = adding a file)",
    ("specvocab.engine.methods", "load", DYNAMIC):
        "a method's description names its code as 'module:attribute', imported on first use, so the "
        "descriptions load without torch (engine.config reads them)",
    ("specvocab.engine.catalog", "_gemma_gguf", DYNAMIC):
        "the offline model wheels are optional data packages, named in OFFLINE_MODELS: imported only to find "
        "their GGUF chunks when a model is converted",
    ("specvocab.engine.models", "_gguf_to_model", "transformers.modeling_gguf_pytorch_utils"):
        "transformers' GGUF reader costs ~0.2 s at import, for a conversion that runs once per machine and model",
}


def _engine_modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted name: file} of every module under `root`/engine/, subpackages included."""
    out = {}
    for path in sorted((root / "engine").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(["specvocab"] + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    return out


def _dynamic_target(call: ast.Call) -> str | None:
    """The module an `importlib.import_module(...)` / `import_module(...)` / `__import__(...)` call imports."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__"):
        return None
    arg = call.args[0] if call.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else DYNAMIC


def parse_imports(source: str, module: str, is_package: bool = False,
                  known: frozenset[str] = frozenset()) -> list[tuple[str, str | None, int]]:
    """(imported module, qualified name of the function holding the import or None at module level, line) for
    every import in `source`. `from X import name` also yields `X.name` when that is a module in `known`;
    relative imports are resolved against `module`; `if TYPE_CHECKING:` blocks are skipped (never run)."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST, function: str | None, scope: str) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, (ast.Name, ast.Attribute)) and \
                (getattr(node.test, "id", None) or getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child, function, scope)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, function, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, function, node.lineno))
            out.extend((f"{base}.{a.name}", function, node.lineno) for a in node.names if f"{base}.{a.name}" in known)
        elif isinstance(node, ast.Call) and (target := _dynamic_target(node)) is not None:
            out.append((target, function, node.lineno))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            name = f"{scope}.{getattr(node, 'name', '<lambda>')}".lstrip(".")
            for child in ast.iter_child_nodes(node):
                visit(child, name, name)
            return
        if isinstance(node, ast.ClassDef):          # a class body runs at import time: still module level
            for child in ast.iter_child_nodes(node):
                visit(child, function, f"{scope}.{node.name}".lstrip("."))
            return
        for child in ast.iter_child_nodes(node):
            visit(child, function, scope)

    visit(ast.parse(source), None, "")
    return out


def _engine_imports(root: Path = ROOT) -> dict[str, list[tuple[str, str | None, int]]]:
    modules = _engine_modules(root)
    known = frozenset(modules)
    return {m: parse_imports(p.read_text(), m, p.name == "__init__.py", known) for m, p in modules.items()}


def _upward(imports: list[tuple[str, str | None, int]], upward: tuple[str, ...] = UPWARD) -> list[str]:
    return [f"{m} (line {line})" for m, _, line in imports if any(m == u or m.startswith(u + ".") for u in upward)]


def test_no_engine_module_imports_the_jobs_or_the_sweeps():
    """engine/ is what a decode reads; engine/jobs and sweeps/ run it from above and nothing imports them back,
    not even inside a function (a job may use another job, never the sweeps)."""
    found = {m: _upward(imps, ("specvocab.sweeps",) if m.startswith("specvocab.engine.jobs") else UPWARD)
             for m, imps in _engine_imports().items()}
    assert {"specvocab.engine.harness", "specvocab.engine.drafters.eagle", "specvocab.engine.jobs.forward"} <= set(found)     # subpackages too
    assert {m: bad for m, bad in found.items() if bad} == {}


def test_the_upward_check_sees_jobs_and_sweeps_imports():
    src = ("import torch\nfrom specvocab.engine.jobs.forward import main\nimport specvocab.sweeps\n"
           "def f():\n    from specvocab.sweeps.results import load\n    importlib.import_module('specvocab.engine.jobs.forward')\n")
    assert [b.split(" ")[0] for b in _upward(parse_imports(src, "specvocab.engine.fake"))] == \
        ["specvocab.engine.jobs.forward", "specvocab.sweeps", "specvocab.sweeps.results", "specvocab.engine.jobs.forward"]


# --- jobs stand on the library alone: no job imports another job -----------------------------------------------
# What two jobs share is library code, and lives in engine/ below them. The one module of engine/jobs a job may
# import is listed with its reason.

JOBS = "specvocab.engine.jobs"
JOB_HELPERS = {
    "specvocab.engine.jobs.args":
        "the jobs' command-line layer - a flag per config field, the checks of paths, model names and numbers "
        "that run before a model loads, `run_main`'s one-line errors - which every job's `main` shares; it is "
        "no code a decode reads, and imports no job",
}


def job_to_job(imports: dict[str, list[tuple[str, str | None, int]]],
               helpers: dict[str, str] = JOB_HELPERS) -> set[tuple[str, str]]:
    """(job, other job it imports) for every import - at the top, inside a function or by a constant
    `import_module` - from one module of engine/jobs of another (a job may be a package: its modules are one
    job); importing a module of `helpers` is allowed (the helper itself importing a job is not)."""
    out = set()
    for module, imps in imports.items():
        if not module.startswith(JOBS + "."):
            continue
        own = ".".join(module.split(".")[:4])                           # specvocab.engine.jobs.<job>
        for target, _, _ in imps:
            if target.startswith(JOBS + "."):
                job = ".".join(target.split(".")[:4])
                if job != own and job not in helpers:
                    out.add((own, job))
    return out


def test_no_job_imports_another_job():
    imports = _engine_imports()
    assert {f"{JOBS}.bench", f"{JOBS}.fit_dynaspec", f"{JOBS}.args"} <= set(imports)      # the jobs are seen
    assert job_to_job(imports) == set(), "move what the jobs share into the library (engine/)"
    assert [t for t, _, _ in imports[f"{JOBS}.args"] if t.startswith(JOBS + ".")] == []  # the helper imports no job


def test_the_job_check_sees_a_job_importing_a_job(tmp_path):
    """The rule's power, on a synthetic engine/jobs: each way of importing another job is seen (at the top,
    `from the package import a job`, relative, inside a function, `import_module`), a job importing only the
    listed helper and the library passes, and the helper itself may import no job."""
    jobs = tmp_path / "engine" / "jobs"
    jobs.mkdir(parents=True)
    for name, src in {
        "__init__.py": "",
        "args.py": "import argparse\n",
        "b.py": "from specvocab.engine.jobs.args import run_main\nfrom specvocab.engine import harness\n",
        "a.py": "from specvocab.engine.jobs.b import main\n",
        "c.py": "from specvocab.engine.jobs import b\n",
        "d.py": "from . import b\n",
        "e.py": "def main():\n    from specvocab.engine.jobs.b import main\n",
        "f.py": "import importlib\nimportlib.import_module('specvocab.engine.jobs.b')\n",
        "g/__init__.py": "from specvocab.engine.jobs.g.inner import run\n",        # a job that is a package
        "g/inner.py": "from specvocab.engine.jobs.g import run\nfrom specvocab.engine.jobs.args import run_main\n",
        "h.py": "from specvocab.engine.jobs.g.inner import run\n",
    }.items():
        (jobs / name).parent.mkdir(exist_ok=True)
        (jobs / name).write_text(src)
    imports = _engine_imports(tmp_path)
    assert job_to_job(imports) == {(f"{JOBS}.{j}", f"{JOBS}.b") for j in "acdef"} | {(f"{JOBS}.h", f"{JOBS}.g")}
    (jobs / "args.py").write_text("from specvocab.engine.jobs.b import main\n")
    assert (f"{JOBS}.args", f"{JOBS}.b") in job_to_job(_engine_imports(tmp_path))
    assert (f"{JOBS}.b", f"{JOBS}.args") in job_to_job(imports, helpers={})     # args is allowed only as listed


def _in_functions(imports: dict[str, list[tuple[str, str | None, int]]]) -> dict[tuple[str, str, str], int]:
    return {(m, fn, target): line for m, imps in imports.items() for target, fn, line in imps if fn is not None}


def test_no_import_inside_a_function_in_engine_but_the_allow_list():
    """Imports sit at the top of engine's modules, where the layering above can see them; the exceptions are
    listed with their reasons, and an entry that no longer exists must leave the list."""
    found = _in_functions(_engine_imports())
    unexpected = {f"{m}.{fn}:{line} imports {t}" for (m, fn, t), line in found.items()
                  if (m, fn, t) not in ALLOWED_IN_FUNCTIONS}
    assert unexpected == set(), "move these imports to the top of their module (or allow-list one with its reason)"
    assert set(ALLOWED_IN_FUNCTIONS) - set(found) == set(), "stale allow-list entries: remove them"


def test_the_policies_load_neither_the_harness_nor_the_registry_nor_the_fitting():
    """The decode-time DynaSpec (engine.vocab.dynaspec) loads with the policies; the fitting (the library's
    engine.vocab.dynaspec_fit, and the job that drives the harness and the drafter registry with it,
    engine.jobs.fit_dynaspec) does not."""
    probe = ('specvocab.engine.vocab.dynaspec', 'specvocab.engine.harness', 'specvocab.engine.drafters', 'specvocab.engine.jobs',
             'specvocab.engine.jobs.fit_dynaspec', 'specvocab.engine.vocab.dynaspec_fit')
    out = subprocess.run([sys.executable, "-c", "import json, sys, specvocab.engine.vocab; print(json.dumps(sorted(m for m in "
                          f"{probe!r} if m in sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["specvocab.engine.vocab.dynaspec"]


def test_the_function_check_sees_an_import_inside_a_function():
    src = ("import os\nfrom specvocab.engine import kv\n"
           "class C:\n    import json\n    def m(self):\n        from specvocab.engine.harness import generate\n"
           "def f():\n    g = lambda: importlib.import_module(name)\n    import numpy as np\n")
    found = _in_functions({"specvocab.engine.fake": parse_imports(src, "specvocab.engine.fake", known=frozenset({"specvocab.engine.kv"}))})
    assert set(found) == {("specvocab.engine.fake", "C.m", "specvocab.engine.harness"), ("specvocab.engine.fake", "f.<lambda>", DYNAMIC),
                          ("specvocab.engine.fake", "f", "numpy")}
    top = [t for t, fn, _ in parse_imports(src, "specvocab.engine.fake", known=frozenset({"specvocab.engine.kv"})) if fn is None]
    assert top == ["os", "specvocab.engine", "specvocab.engine.kv", "json"]


def import_graph(imports: dict[str, list[tuple[str, str | None, int]]], *, functions: bool = False
                 ) -> dict[str, set[str]]:
    """{module: engine modules it imports} (at the top; with `functions`, inside functions too, dynamic imports
    aside). Importing a module runs its parent packages first, so they count as imported too."""
    graph: dict[str, set[str]] = {m: set() for m in imports}
    for m, imps in imports.items():
        for target, fn, _ in imps:
            if fn is not None and not functions or target == DYNAMIC:
                continue
            parts = target.split(".")
            # the target's parent packages run first, so they count too; but not the module's own ancestors,
            # which ran before the module itself (a package's __init__ exporting its submodules' API is no
            # cycle). An explicit import of an ancestor (the target itself) still counts.
            own = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
            parents = {".".join(parts[:i]) for i in range(1, len(parts))} - own
            graph[m] |= {p for p in parents | {target} if p in graph and p != m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as [a, b, ..., a] (depth first, in sorted order: a stable message), or None."""
    state: dict[str, int] = {}                                   # 1: on the current path, 2: finished
    for root in sorted(graph):
        if state.get(root):
            continue
        state[root], path, stack = 1, [root], [iter(sorted(graph[root]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_engine_import_graph_has_no_cycle():
    """Nothing below a module imports it back: no cycle among engine's modules through top-level imports, nor
    when the allow-listed imports inside functions are counted too (a circle such as dynaspec -> harness (in a
    function) -> shipped -> dynaspec is one of those)."""
    imports = _engine_imports()
    top = import_graph(imports)
    assert {"specvocab.engine.target", "specvocab.engine.shipped", "specvocab.engine.drafters"} <= top["specvocab.engine.harness"]     # the parser sees edges
    assert top["specvocab.engine.atomic"] == set()                         # the bottom: imports nothing from engine
    assert top["specvocab.engine.artifacts"] == {"specvocab.engine.atomic"}
    cycle = find_cycle(top)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    cycle = find_cycle(import_graph(imports, functions=True))
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle)


def test_the_cycle_finder_reports_a_cycle_with_its_path():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    # a package exporting its submodule's API is no cycle; the submodule importing the package back is one
    pkg = {"specvocab.engine.p": [("specvocab.engine.p.sub", None, 1)], "specvocab.engine.p.sub": [("specvocab.engine.q", None, 1)], "specvocab.engine.q": []}
    assert find_cycle(import_graph(pkg)) is None
    pkg["specvocab.engine.p.sub"].append(("specvocab.engine.p", None, 2))
    assert find_cycle(import_graph(pkg)) == ["specvocab.engine.p", "specvocab.engine.p.sub", "specvocab.engine.p"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    # an arrow back down-up: engine.catalog (below the policies) importing the DynaSpec policy closes a circle
    graph = import_graph(_engine_imports(), functions=True)
    assert "specvocab.engine.catalog" in graph["specvocab.engine.vocab.dynaspec"]
    graph["specvocab.engine.catalog"].add("specvocab.engine.vocab.dynaspec")
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and {"specvocab.engine.vocab.dynaspec", "specvocab.engine.catalog"} <= set(cycle), cycle


def test_engine_config_imports_without_torch():
    """The config (presets, `--set` parsing) loads in a process without torch: a driver or a notebook can build
    and check configs cheaply. The probe's power: test_the_probe_sees_a_forbidden_import."""
    assert _loaded_by(["specvocab.engine.config"]) == ["engine"]


def test_the_metrics_and_the_sweeps_tables_and_charts_import_without_torch():
    """What summarises a bench (engine.metrics: tau, speedup, draft time, Table 2) and what reads a sweep's results
    and draws them (sweeps.tables, sweeps.charts) load in a process without torch or transformers; the tables not even
    altair. The probe's power: test_the_probe_sees_a_forbidden_import."""
    heavy = ("torch", "transformers", "safetensors", "altair", "kernels")
    assert _loaded_by(["specvocab.engine.metrics"], heavy) == []
    assert _loaded_by(["specvocab.sweeps.results", "specvocab.sweeps.tables"], heavy) == []
    assert _loaded_by(["specvocab.sweeps.charts"], heavy) == ["altair"]
    assert "altair" in _loaded_by(["specvocab.sweeps.charts"], heavy)               # the probe sees altair


def test_a_sweep_config_parses_and_plans_without_torch():
    """Parsing a sweep config and expanding it into cells (sweeps.config, sweeps.plan, sweeps.schema) loads
    neither torch nor transformers: the names they check against live in engine.catalog and
    engine.config. The check that needs tokenizers (sweeps.checks) does load them - the probe sees it."""
    heavy = ("torch", "transformers", "safetensors", "altair", "kernels")
    assert _loaded_by(["specvocab.engine.catalog"], heavy) == []
    assert _loaded_by(["specvocab.sweeps.config", "specvocab.sweeps.plan", "specvocab.sweeps.schema"], heavy) == []
    assert {"torch", "transformers"} <= set(_loaded_by(["specvocab.sweeps.checks"], heavy))
    # and a whole parse, prompt sets read and cells expanded, in a fresh process
    out = subprocess.run([sys.executable, "-c", "import sys; from specvocab.sweeps.config import load_sweep; "
                          "s = load_sweep('sweeps/configs/quick.toml'); "
                          "print(len(s.cells), sorted({'torch', 'transformers'} & set(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "[]" and int(out.stdout.split()[0]) > 0, out.stdout


def test_the_sweep_kinds_are_one_list():
    """specvocab.sweeps.tables reads the kinds from sweeps.cell (light); sweeps.config takes the same list from there,
    not a copy of its own (it used to keep one when it loaded torch), and its model kinds are among them."""
    import specvocab.sweeps.cell as cell
    import specvocab.sweeps.config as config

    assert config.KINDS is cell.KINDS
    assert set(config.MODEL_KINDS) < set(cell.KINDS)


def test_the_tables_module_exports_every_builder_of_its_parts_and_defines_none():
    """`sweeps.tables` is the one name the notebooks import; the builders live one family of figures per module
    (sweeps/tables_*.py). Every public name of a part is reachable as `tables.<name>` and listed in `__all__`,
    and the facade defines no function of its own (a builder added to it would be a second home)."""
    import inspect

    import specvocab.sweeps.tables as tables
    parts = sorted(p.stem for p in (ROOT / "sweeps").glob("tables_*.py"))
    assert parts == ["tables_bench", "tables_choices", "tables_common", "tables_coverage", "tables_unispec"]
    for part in parts:
        module = importlib.import_module(f"specvocab.sweeps.{part}")
        body = ast.parse((ROOT / "sweeps" / f"{part}.py").read_text()).body
        own = [n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        own += [x.id for n in body if isinstance(n, ast.Assign) for x in n.targets if isinstance(x, ast.Name)]
        own = [n for n in own if not n.startswith("_") and n not in ("present", "distinct_values")]  # the parts' checks
        assert own, part
        missing = [n for n in own if n not in tables.__all__ or getattr(tables, n) is not getattr(module, n)]
        assert missing == [], (part, missing)
    assert [n for n, v in vars(tables).items() if inspect.isfunction(v) and v.__module__ == tables.__name__] == []
    assert all(hasattr(tables, n) for n in tables.__all__)


def _private_imports(paths) -> list[str]:
    """`from <package module> import _name` across modules of the package's own folders (a private helper used
    from another module should be public, with a name that says what it is)."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith("specvocab.")):
                out += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_helper():
    paths = [p for d in ("engine", "sweeps", "kernels", "locality") for p in sorted((ROOT / d).rglob("*.py"))]
    assert _private_imports(paths) == []


def test_the_private_import_check_sees_one(tmp_path):
    (tmp_path / "m.py").write_text("from specvocab.engine.drafters.eagle import EagleHead, _helper\nfrom os import _exit\n")
    assert _private_imports([tmp_path / "m.py"]) == ["m.py: specvocab.engine.drafters.eagle._helper"]
