"""The layers point one way: `locality` is pure (token ids and polars frames in, frames out) and loads
nothing from `engine` or `kernels`, nor torch or transformers; `engine` may use `locality`, not the reverse."""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import locality

FORBIDDEN = ("engine", "kernels", "torch", "transformers")

_PROBE = """
import importlib, json, sys
names = json.loads(sys.argv[1])
for name in names:
    importlib.import_module(name)
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps(loaded))
"""


def _modules(package) -> list[str]:
    return [package.__name__] + [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]


def _loaded_by(names: list[str]) -> list[str]:
    """Top-level packages among FORBIDDEN that importing `names` in a fresh interpreter loads."""
    root = Path(locality.__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(names), json.dumps(FORBIDDEN)], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_locality_module_imports_no_engine_kernels_torch_or_transformers():
    names = _modules(locality)
    assert {"locality.stream", "locality.coverage", "locality.trace", "locality.shortlist"} <= set(names)
    assert _loaded_by(names) == []


def test_the_probe_sees_a_forbidden_import():
    """The check can fail: importing an engine module is seen (it loads engine, kernels and torch)."""
    assert {"engine", "torch"} <= set(_loaded_by(["engine.vocab"]))


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported module, at the top of the module?) for every import statement in a module's source."""
    path = Path(locality.__file__).parents[1] / (module.replace(".", "/") + ".py")
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
    """engine.vocab (the policies, PhaseTimer from engine.timing) sits below engine.drafters.lmhead, which builds
    policies: vocab imports nothing from the drafters, not even inside a function, and lmhead imports at the top."""
    vocab = _imports("engine.vocab")
    assert not [m for m, _ in vocab if m.startswith("engine.drafters")]
    assert ("engine.timing", True) in vocab
    lmhead = _imports("engine.drafters.lmhead")
    assert ("engine.vocab", True) in lmhead and all(top for _, top in lmhead)
    assert not [m for m, _ in _imports("engine.timing") if m.startswith("engine")]
    # importing the policies does not load the drafter module that builds them
    loaded = subprocess.run([sys.executable, "-c", "import sys, engine.vocab; "
                             "print('engine.drafters.lmhead' in sys.modules)"],
                            cwd=Path(locality.__file__).parents[1], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "False"
