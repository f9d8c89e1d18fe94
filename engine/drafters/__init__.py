"""Drafters: one per method, found by `make_drafter(target, cfg)` through `cfg.method`.

Adding a method = adding a module `engine/drafters/<method>.py` (a '-' in the method name becomes '_')
whose `Drafter` subclass is decorated with `@register_drafter("<method>")`, and the method name in
`engine.config.METHODS`. `make_drafter` imports that module on first use, so nothing else changes.

    from specvocab.engine.drafters import register_drafter
    from specvocab.engine.tree import Drafter

    @register_drafter("recycling")
    class RecyclingDrafter(Drafter):
        ...

`hf-prompt-lookup` has no drafter: `engine.generate` hands it to transformers' own `generate`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from specvocab.engine.catalog import known_methods
from specvocab.engine.config import HF_METHODS
from specvocab.engine.tree import Drafter

_REGISTRY: dict[str, Callable] = {}


class UnknownMethodError(ValueError):
    """No drafter is registered for a method; the message lists the available ones and how to add one."""


def register_drafter(name: str):
    """Class decorator (or factory decorator): `factory(target, cfg) -> Drafter` serves method `name`."""
    def deco(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise UnknownMethodError(f"method {name!r} is registered twice ({_REGISTRY[name]} and {factory}); "
                                     f"rename one of them")
        _REGISTRY[name] = factory
        if isinstance(factory, type) and getattr(factory, "name", "base") == "base":
            factory.name = name
        return factory
    return deco


def _module_name(method: str) -> str:
    return f"{__name__}.{method.replace('-', '_')}"


def available_methods() -> list[str]:
    """Methods that can run now in this process: configured methods with a module here and HF ones
    (`engine.catalog.known_methods`, which a sweep's config is checked against), and any registered here."""
    return sorted(set(_REGISTRY) | set(known_methods()))


def make_drafter(target, cfg) -> Drafter:
    """The drafter of `cfg.method` for target model `target`."""
    name = cfg.method
    if name in HF_METHODS:
        raise UnknownMethodError(f"{name!r} runs transformers' own generate and has no drafter; "
                                 f"call engine.generate(model, prompt_ids, method={name!r})")
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
                f"method {name!r} has no drafter yet (no module {module}); available: {available_methods()}. "
                f"To add it, write engine/drafters/{name.replace('-', '_')}.py with a Drafter subclass "
                f"decorated @register_drafter({name!r})") from None
        if name not in _REGISTRY:
            raise UnknownMethodError(f"{module} was imported but registers no drafter for {name!r}; decorate its "
                                     f"Drafter subclass with @register_drafter({name!r})")
    return _REGISTRY[name](target, cfg)


__all__ = ["HF_METHODS", "UnknownMethodError", "available_methods", "make_drafter", "register_drafter"]
