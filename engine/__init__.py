"""Decoders, harness, models and prompts. `generate(model, prompt_ids, method=...)` is the entry point:
one lossless draft-verify loop for every method (see `engine.harness`)."""

from engine.config import METHODS, SpecConfig
from engine.harness import ContextError, GenerateResult, HarnessError, forward_tree, generate

__all__ = ["METHODS", "ContextError", "GenerateResult", "HarnessError", "SpecConfig", "forward_tree", "generate"]
