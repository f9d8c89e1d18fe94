"""Decoders, harness, models and prompts. `generate(model, prompt_ids, method=...)` is the entry point:
one lossless draft-verify loop for every method (see `engine.harness`).

The names below are imported on first use, so `python -m specvocab.engine.<module>` runs that module once (an eager
import of the harness here would load `engine.vocab` and the others before runpy executes them)."""

import importlib

_EXPORTS = {"METHODS": "specvocab.engine.config", "SpecConfig": "specvocab.engine.config", "ContextError": "specvocab.engine.harness",
            "GenerateResult": "specvocab.engine.harness", "HarnessError": "specvocab.engine.harness", "forward_tree": "specvocab.engine.harness",
            "generate": "specvocab.engine.harness"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:     # imported here, on first use (see above; allow-listed in tests/test_layering.py)
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
