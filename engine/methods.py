"""The decoding methods, each described once: what the config, the harness, the bench and the tables must know
about a method, without importing its drafter (so without torch).

A `MethodSpec` says whether the method drafts (has a draft size g to calibrate), whether it drafts through an LM
head behind a vocabulary policy (`--vocab`, `--drafter`), who runs it (the harness with a drafter, or
transformers' own generate), its uncalibrated draft size and its own cap on g, the config fields that change
its tau(g) or s(g) (the calibration key, `engine.config.calibration_fields`), and its display name and order
(Table 2's rows, the figures' legends). As vLLM's speculative config maps each method name to its proposer in one
place, `method_spec(name)` is that place here: `engine.config` validates `method` against it, `engine.harness`
resolves draft sizes and caps from it, `engine.drafters.make_drafter` builds the drafter it names,
`engine.metrics` and `sweeps.tables` order and label rows by it.

Where the descriptions live: a method is one file. A shipped method's drafter module `engine/drafters/<name>.py`
('-' as '_') holds both its drafter (a `engine.tree.Drafter` subclass decorated `@register_drafter("<name>")`) and
its description, a module-level `METHOD = MethodSpec(...)`. The registry reads those descriptions without
importing the modules (they import torch; the config, a sweep's planner and the tables never do): on the first
registry read it parses each module's source (`drafter_sources`, found with `importlib.util.find_spec`, so a
wheel works as a checkout does) and evaluates its one `METHOD` expression among this module's public names
(`__all__`: MethodSpec, SAMPLING, TARGET, STORE, TREE, eagle_candidates, calibration_fields_of, ...) and no
builtins (`read_method`). A module without METHOD (lmhead.py, a helper) is skipped; a METHOD naming anything
else is an UnknownMethodError naming the file, the name and the fix. Importing the module later runs the same
expression: `module.METHOD == method_spec(name)`. The methods with no drafter module are described here
(`NO_DRAFTER`: hf-prompt-lookup, which transformers' generate runs).

Outside the package, one file does both - the drafter class, then

    register_method(MethodSpec("mine", order=45, drafter=MyDrafter, default_draft_size=8))

and `generate(..., method="mine")`, the bench and the Table 2 builders take it.

Callables of a description (`drafter`, `default_draft_size`, `max_draft_size`) may be given as "module:attribute"
strings, imported on first call, so that a description stays light while its code imports torch; a shipped
description names its own module's functions that way (recycling's template size).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

__all__ = ["DRAFTERS_PACKAGE", "MERGE_HEADS", "MERGE_SOURCES", "NO_DRAFTER", "RUNNERS", "SAMPLING", "STORE", "TARGET",
           "TREE", "MethodNames", "MethodSpec", "MethodTable", "UnknownMethodError", "calibration_fields_of",
           "drafter_sources", "eagle_candidates", "forget_method", "load", "method_names", "method_spec",
           "method_specs", "read_method", "register_method", "shipped_specs", "unispec_candidates"]

RUNNERS = ("harness", "hf")     # the harness's draft-verify loop with a drafter; transformers' own generate

# Config fields that change a method's tau(g) or s(g), grouped (the calibration key: engine.config)
SAMPLING = ("temperature", "top_p")
TARGET = ("backend", "fixed_shape", "verify_rows", "compile", "cuda_graphs", "cpu_kernels")  # how the target runs
STORE = ("store_k", "store_persistence")            # the successor store (Token Recycling, UniSpec)
TREE = ("eagle_depth", "eagle_topk")                # EAGLE-2's dynamic tree (layerskip, eagle, eagle3)


class UnknownMethodError(ValueError):
    """No method of that name is registered, or a description is inconsistent; the message says which and
    how to fix it."""


@dataclass(frozen=True)
class MethodSpec:
    """What the package must know about one decoding method (module docstring).

    name                the config's `method` value
    order               display order (Table 2's rows, figure legends): lower first; ar 0, the training-free
                        methods 10-40, the drafters with an LM head 60-80
    label               display name in run labels and legends; None = name
    drafts              proposes draft tokens, so has a draft size g (UniSpec §3, App. F); False for ar
    lm_head             drafts through an LM head behind a vocabulary policy (`cfg.vocab`, bench `--drafter`)
    runner              "harness" (`engine.harness`' loop with a drafter) or "hf" (transformers' generate, no
                        drafter: hf-prompt-lookup)
    drafter             factory(target, cfg) -> Drafter (a Drafter subclass), or "module:attribute"; None = the
                        class `engine/drafters/<name>.py` registers with `@register_drafter`
    default_draft_size  g when `cfg.draft_size` is None and no calibration is cached: an int, a function of the
                        config (or "module:attribute" of one); None = `engine.calibration`'s per-device fallback
    max_draft_size      the method's own largest g as a function of the config (or "module:attribute"), None
                        where it has none; the target's bounds are the harness's (`engine.harness.max_draft_size`)
    calibration_fields  SpecConfig fields that change tau(g) or s(g); "vocab" adds the policy's own fields
                        (`engine.config.POLICY_FIELDS`); None = every field but the run's bookkeeping
    """

    name: str
    order: int
    label: str | None = None
    drafts: bool = True
    lm_head: bool = False
    runner: Literal["harness", "hf"] = "harness"
    drafter: Callable | str | None = None
    default_draft_size: int | Callable | str | None = None
    max_draft_size: Callable | str | None = None
    calibration_fields: tuple[str, ...] | None = None

    def __post_init__(self):
        if not self.name or self.name != self.name.strip() or "," in self.name:
            raise UnknownMethodError(f"method name {self.name!r} must be a non-empty word without commas or spaces "
                                     f"at its ends (it is a --methods entry)")
        if self.runner not in RUNNERS:
            raise UnknownMethodError(f"method {self.name!r}: runner {self.runner!r} — choose one of {list(RUNNERS)}")
        if not self.drafts and (self.lm_head or self.default_draft_size is not None
                                or self.max_draft_size is not None):
            raise UnknownMethodError(f"method {self.name!r} drafts nothing (drafts=False) but describes a draft "
                                     f"(lm_head, default_draft_size or max_draft_size) — drop those or set "
                                     f"drafts=True")
        if self.runner == "hf" and (self.drafter is not None or self.lm_head):
            raise UnknownMethodError(f"method {self.name!r} runs transformers' generate (runner='hf'): it takes no "
                                     f"drafter and no LM head — use runner='harness'")

    @property
    def display(self) -> str:
        """The name tables and figures show (`label`, else `name`)."""
        return self.label or self.name

    def draft_size_default(self, cfg) -> int | None:
        """The uncalibrated g for cfg (`default_draft_size`); None where `engine.calibration` picks it (unispec's
        per-device fallback) or the method drafts nothing."""
        value = _loaded(self.default_draft_size)
        return value(cfg) if callable(value) else value

    def draft_size_cap(self, cfg) -> int | None:
        """The method's own largest g for cfg (`max_draft_size`), None where it has none."""
        value = _loaded(self.max_draft_size)
        return None if value is None else value(cfg)


def load(ref: str) -> Any:
    """The object "package.module:attribute" names (imported now: a description names code that loads torch)."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise UnknownMethodError(f"{ref!r} is not a 'package.module:attribute' reference")
    # a description names its code lazily (module docstring); allow-listed in tests/test_layering.py
    return getattr(importlib.import_module(module), attr)


def _loaded(value):
    return load(value) if isinstance(value, str) else value


# --- what a shipped description may name (its METHOD expression is evaluated among __all__) ----------------

def eagle_candidates(cfg) -> int:
    """EAGLE-2's candidates at the config's depth and top-k: topk + topk^2 (depth - 1) (layerskip, eagle, eagle3)."""
    return cfg.eagle_topk + cfg.eagle_topk ** 2 * (cfg.eagle_depth - 1)


def unispec_candidates(cfg) -> int:
    """UniSpec's candidate pool (App. A, Alg. 1): (2 with the broadened first level, else 1) k + k^2 (d - 1)."""
    return (2 if cfg.broaden_first_level else 1) * cfg.store_k + cfg.store_k ** 2 * (cfg.tree_depth - 1)


def calibration_fields_of(*methods: str) -> tuple[str, ...]:
    """The calibration fields of the named methods (`MethodSpec.calibration_fields`), each once, in order: what
    changes tau(g) or s(g) of a method that drafts through them (merged's sources). Reads their descriptions,
    a shipped one from its drafter's source on demand."""
    return tuple(dict.fromkeys(f for m in methods for f in method_spec(m).calibration_fields or ()))


# The sources a `merged` tree draws from (engine.drafters.merged, `merge_sources`): one draft head and the n-gram
# drafters; the bench rows count the accepted tokens of each (`accepted_by_<source>`, engine.metrics).
MERGE_HEADS = ("eagle3", "eagle")
MERGE_SOURCES = (*MERGE_HEADS, "pld", "unispec")

# The methods with no drafter module, described here: hf-prompt-lookup runs transformers' own generate. Its
# uncalibrated draft size: 10 = transformers' `prompt_lookup_num_tokens` (Saxena 2023's reference setting).
NO_DRAFTER: tuple[MethodSpec, ...] = (
    MethodSpec("hf-prompt-lookup", order=20, runner="hf", default_draft_size=10,
               calibration_fields=(*SAMPLING, "pld_max_ngram", "pld_min_ngram")),
)


# --- the registry ------------------------------------------------------------------------------------------

DRAFTERS_PACKAGE = "specvocab.engine.drafters"      # its modules' METHOD assignments are the shipped methods

_REGISTRY: dict[str, MethodSpec] = {}
_SOURCES: dict[str, Path] | None = None             # {module name: source} of DRAFTERS_PACKAGE, once discovered
_READ: dict[str, MethodSpec | None] = {}            # {module name: its METHOD, None without one}
_READING: list[str] = []                            # modules whose METHOD is being evaluated (a cycle check)


def drafter_sources() -> dict[str, Path]:
    """{module name: .py file} of every module of `engine/drafters/`, located without importing the package
    (its `__init__` loads torch): the folder `importlib.util.find_spec` gives, in a checkout or a wheel."""
    spec = importlib.util.find_spec(DRAFTERS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnknownMethodError(f"cannot locate {DRAFTERS_PACKAGE} — reinstall specvocab (pip install -e .)")
    return {p.stem: p for folder in spec.submodule_search_locations for p in sorted(Path(folder).glob("*.py"))
            if p.stem != "__init__"}


def read_method(path: Path | str) -> MethodSpec | None:
    """The `METHOD = MethodSpec(...)` a drafter module's source assigns at module level, without importing it:
    the one expression is evaluated among `engine.methods`' public names (`__all__`) and no builtins, so what a
    description names is data, these names, or "module:attribute" strings. None for a module with no METHOD
    (a helper such as lmhead.py). UnknownMethodError for a name outside that namespace, a second METHOD or a
    value that is not a MethodSpec."""
    path = Path(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    values = [node.value for node in tree.body if _assigns_method(node)]
    if not values:
        return None
    if len(values) > 1:
        raise UnknownMethodError(f"{path} assigns METHOD {len(values)} times — describe its method once")
    namespace = {"__builtins__": {}, **{name: globals()[name] for name in __all__}}
    try:
        spec = eval(compile(ast.Expression(values[0]), str(path), "eval"), namespace)  # noqa: S307 (package source)
    except NameError as e:
        raise UnknownMethodError(
            f"{path}: METHOD uses {e.name!r}, which a description read without importing its module cannot see — "
            f"write it as a literal, a 'module:attribute' string, or a public name of engine.methods "
            f"({', '.join(__all__)})") from None
    if not isinstance(spec, MethodSpec):
        raise UnknownMethodError(f"{path}: METHOD is a {type(spec).__name__}, not a MethodSpec — assign "
                                 f"METHOD = MethodSpec(...)")
    return spec


def _assigns_method(node: ast.stmt) -> bool:
    """A module-level `METHOD = ...` (or `METHOD: MethodSpec = ...`)."""
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == "METHOD" and node.value is not None
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "METHOD" for t in node.targets)


def _read_shipped(module: str) -> MethodSpec | None:
    """The METHOD of drafter module `module` (read once), registered; its description must name the method
    whose drafter it holds (`engine.drafters.drafter_factory` finds the module by the method's name)."""
    if module not in _READ:
        if module in _READING:
            raise UnknownMethodError(f"the descriptions of {' -> '.join([*_READING, module])} read each other — "
                                     f"let one of them list its fields itself")
        _READING.append(module)
        try:
            spec = read_method(_SOURCES[module])
        finally:
            _READING.pop()
        if spec is not None and spec.name.replace("-", "_") != module:
            raise UnknownMethodError(f"{_SOURCES[module]} describes method {spec.name!r} — name the file "
                                     f"{spec.name.replace('-', '_')}.py or the method {module!r}")
        if spec is not None:
            _add(spec)
        _READ[module] = spec
    return _READ[module]


def _registry() -> dict[str, MethodSpec]:
    """The registry, the shipped drafters' descriptions read into it on the first call (`drafter_sources`)."""
    global _SOURCES
    if _SOURCES is None:
        _SOURCES = drafter_sources()
        try:
            for module in _SOURCES:
                _read_shipped(module)
        except BaseException:
            _SOURCES = None                 # the next read reports the same error rather than a partial registry
            raise
    return _REGISTRY


def _add(spec: MethodSpec) -> MethodSpec:
    have = _REGISTRY.get(spec.name)
    if have is not None and have != spec:
        raise UnknownMethodError(f"method {spec.name!r} is described twice ({have} and {spec}) — rename one, or "
                                 f"forget_method({spec.name!r}) first")
    _REGISTRY[spec.name] = spec
    return spec


def shipped_specs() -> list[MethodSpec]:
    """The methods that ship with the package - `NO_DRAFTER` and each drafter module's METHOD - in display
    order."""
    _registry()
    shipped = [*NO_DRAFTER, *(s for s in _READ.values() if s is not None)]
    return sorted(shipped, key=lambda s: (s.order, s.name))


def register_method(spec: MethodSpec) -> MethodSpec:
    """Make `spec` a method of this process (`method_spec(spec.name)`); a second, different description of the
    same name (a shipped one included) is an error. Returns spec."""
    _registry()
    return _add(spec)


def forget_method(name: str) -> None:
    """Drop a method registered at run time (a test's toy method); the shipped ones stay."""
    if name in {s.name for s in shipped_specs()}:
        raise UnknownMethodError(f"method {name!r} ships with the package — only methods registered at run time "
                                 f"can be forgotten")
    _REGISTRY.pop(name, None)


def method_spec(name: str) -> MethodSpec:
    """The description of method `name`; UnknownMethodError naming the registered ones otherwise."""
    spec = _registry().get(name)
    if spec is None and _READING and name.replace("-", "_") in _SOURCES:
        spec = _read_shipped(name.replace("-", "_"))    # one description reads another's (merged its sources')
    if spec is None:
        raise UnknownMethodError(f"unknown method {name!r} — choose one of {list(method_names())} (a new method is "
                                 f"described with engine.methods.register_method)")
    return spec


def method_specs() -> list[MethodSpec]:
    """Every registered method, in display order (`order`, then name)."""
    return sorted(_registry().values(), key=lambda s: (s.order, s.name))


def method_names(where: Callable[[MethodSpec], bool] | None = None) -> tuple[str, ...]:
    """The names of the registered methods (those `where` accepts), in display order."""
    return tuple(s.name for s in method_specs() if where is None or where(s))


class MethodNames(Sequence):
    """A tuple-like view of the names of the registered methods that `where` accepts, in display order, read at
    each use (so a method registered later is in it): `engine.config.METHODS`, `DRAFTING_METHODS`,
    `HF_METHODS`, `engine.metrics.DRAFTERS`."""

    def __init__(self, where: Callable[[MethodSpec], bool] | None = None, doc: str = ""):
        self._where, self.__doc__ = where, doc or self.__doc__

    def _names(self) -> tuple[str, ...]:
        return method_names(self._where)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        spec = _registry().get(name) if isinstance(name, str) else None
        return spec is not None and (self._where is None or self._where(spec))

    def __eq__(self, other) -> bool:
        return isinstance(other, (tuple, list, MethodNames)) and tuple(self) == tuple(other)

    def __hash__(self):
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class MethodTable(Mapping):
    """A dict-like view {method name: value(spec)} over the registered methods whose value is not None, read at
    each use: `engine.config.CALIBRATION_FIELDS`, `DEFAULT_DRAFT_SIZE`."""

    def __init__(self, value: Callable[[MethodSpec], Any]):
        self._value = value

    def _items(self) -> dict[str, Any]:
        return {s.name: v for s in method_specs() if (v := self._value(s)) is not None}

    def __getitem__(self, name):
        return self._items()[name]

    def __iter__(self):
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


for _spec in NO_DRAFTER:
    _add(_spec)
