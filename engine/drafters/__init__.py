"""Drafters: one per method, found by `make_drafter(target, cfg)` through `cfg.method`'s description
(`engine.methods.method_spec`).

Adding a method: a shipped method is one file, `engine/drafters/<method>.py` (a '-' in the method name becomes
'_'), holding its drafter - a `Drafter` subclass decorated with `@register_drafter("<method>")`, imported by
`make_drafter` on first use - and its description, a module-level `METHOD = MethodSpec(...)` near the top that
`engine.methods` reads from the source without importing the module (so the config, a sweep's planner and the
tables learn the method without torch). The expression may use only `engine.methods`' public names, literals and
"module:attribute" strings for the module's own functions:

    from specvocab.engine.drafters import register_drafter
    from specvocab.engine.methods import SAMPLING, STORE, TARGET, MethodSpec
    from specvocab.engine.tree import Drafter

    METHOD = MethodSpec("recycling", order=30, default_draft_size="specvocab.engine.drafters.recycling:whole_template",
                        calibration_fields=(*SAMPLING, *TARGET, *STORE, "recycling_tree"))

    @register_drafter("recycling")
    class RecyclingDrafter(Drafter):
        ...

A module without METHOD is a helper (lmhead.py: the LM-head drafters' base). A description may instead name its
drafter (`MethodSpec.drafter`: a factory, or "module:attribute"), as a method registered at run time does
(`engine.methods.register_method`). `hf-prompt-lookup` has no drafter: `engine.generate` hands it to
transformers' own `generate`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from specvocab.engine.catalog import known_methods
from specvocab.engine.config import HF_METHODS
from specvocab.engine.methods import UnknownMethodError, load, method_names, method_spec
from specvocab.engine.tree import Drafter

_REGISTRY: dict[str, Callable] = {}


def register_drafter(name: str):
    """Class decorator (or factory decorator): `factory(target, cfg) -> Drafter` serves method `name`."""
    def deco(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise UnknownMethodError(f"method {name!r} is registered twice ({_REGISTRY[name]} and {factory}) — "
                                     f"rename one of them")
        _REGISTRY[name] = factory
        if isinstance(factory, type) and getattr(factory, "name", "base") == "base":
            factory.name = name
        return factory
    return deco


def _module_name(method: str) -> str:
    return f"{__name__}.{method.replace('-', '_')}"


def available_methods() -> list[str]:
    """Methods that can run now in this process: described methods with a module here and HF ones
    (`engine.catalog.known_methods`, which a sweep's config is checked against), described methods that name
    their drafter (`MethodSpec.drafter`), and any drafter registered here."""
    named = method_names(lambda s: s.drafter is not None)
    return sorted(set(_REGISTRY) | set(known_methods()) | set(named))


def drafter_factory(name: str) -> Callable:
    """The factory(target, cfg) -> Drafter of method `name`: the one its description names
    (`engine.methods.MethodSpec.drafter`), else the class `engine/drafters/<name>.py` registers."""
    if name not in method_names():
        raise UnknownMethodError(
            f"method {name!r} has no drafter yet (no description) — available: {available_methods()}. To add it, "
            f"describe it with engine.methods.register_method(MethodSpec({name!r}, order=...)) and write its "
            f"drafter: engine/drafters/{name.replace('-', '_')}.py with a Drafter subclass decorated "
            f"@register_drafter({name!r}), or MethodSpec(drafter=...)")
    spec = method_spec(name)
    if spec.runner == "hf":
        raise UnknownMethodError(f"{name!r} runs transformers' own generate and has no drafter — "
                                 f"call engine.generate(model, prompt_ids, method={name!r})")
    if spec.drafter is not None:
        return load(spec.drafter) if isinstance(spec.drafter, str) else spec.drafter
    if name not in _REGISTRY:
        module = _module_name(name)
        try:
            # the registry: a method's module is imported on first use (adding a method = adding a file), the
            # one import inside a function here (allow-listed in tests/test_layering.py)
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise                                            # the module exists but an import inside failed
            raise UnknownMethodError(
                f"method {name!r} has no drafter yet (no module {module}) — available: {available_methods()}. "
                f"To add it, write engine/drafters/{name.replace('-', '_')}.py with a Drafter subclass "
                f"decorated @register_drafter({name!r}), or name it in its MethodSpec (drafter=)") from None
        if name not in _REGISTRY:
            raise UnknownMethodError(f"{module} was imported but registers no drafter for {name!r} — decorate its "
                                     f"Drafter subclass with @register_drafter({name!r})")
    return _REGISTRY[name]


def make_drafter(target, cfg) -> Drafter:
    """The drafter of `cfg.method` for target model `target` (`drafter_factory`)."""
    return drafter_factory(cfg.method)(target, cfg)


__all__ = ["HF_METHODS", "UnknownMethodError", "available_methods", "drafter_factory", "make_drafter", "register_drafter"]
