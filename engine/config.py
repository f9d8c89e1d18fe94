"""One config dataclass with the papers' defaults, and named presets.

Every knob of every method lives here once, with the section of the paper (or of `shared/specs/`) that
fixes its default. `engine.generate(..., **overrides)`, the bench CLI and a Ray sweep cell all build a
`SpecConfig` the same way: `SpecConfig.preset(name).replace(**overrides)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

METHODS = ("ar", "pld", "hf-prompt-lookup", "recycling", "unispec", "layerskip", "eagle")
VOCABS = ("full", "frspec", "microspec", "oracle")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the valid range."""


@dataclass(frozen=True)
class SpecConfig:
    # --- decoding -------------------------------------------------------------------------------------
    method: str = "ar"
    max_new_tokens: int = 128
    temperature: float = 0.0          # 0 = greedy (all papers' main setting)
    top_p: float = 1.0
    seed: int = 0
    record: bool = False              # keep per-step records (draft tree, accepted path, top-K)
    record_topk: int = 16             # K of recorded top-K rows (locality traces use K=16)

    # --- prompt lookup (Saxena 2023; transformers' prompt_lookup_num_tokens=10) --------------------------
    pld_max_ngram: int = 3
    pld_min_ngram: int = 1
    pld_num_draft: int = 10

    # --- Token Recycling / UniSpec (unispec.md App. A; specs/unispec.md section 2, 4) ----------------------
    store_k: int = 10                 # k: successors stored per token and nodes expanded per level
    tree_depth: int = 10              # d: maximum draft-tree depth
    threshold_r: float = 0.05         # r: confidence threshold for expanding a node
    draft_size: int | None = None     # g: draft tokens per step (root excluded); None = calibrated g*
    confidence: Literal["path", "node"] = "path"   # node score: product along the path, or own stored prob
    broaden_first_level: bool = True  # first level also from the cached top-k at the token before the root
    store_persistence: Literal["deployment", "per_prompt"] = "deployment"
    recycling_tree: str = "tr-default"  # Token Recycling's static tree template
    threshold_scope: Literal["expand", "expand+select"] = "expand"   # r only stops expansion, or also
                                      # drops nodes under r from the draft (specs/unispec.md 4.3.4 [C])
    cache_exclude_root: bool = True   # drop the root itself from the first-level cache C (specs/unispec.md
                                      # 4.3.1 `C_exclude_top1` [C]; the spec's default is False = the paper
                                      # read literally). C is the distribution that produced the root, so
                                      # under greedy its top-1 IS the root, scored with the root's own
                                      # probability - not a next-token estimate - and it outranks S[root]'s
                                      # successors. Measured (gemma-3-270m, 5 calibration prompts x 96 tokens,
                                      # per-prompt store): tau 1.25 -> 1.48 at g=1, 1.59 -> 1.92 at g=3,
                                      # 2.06 -> 2.18 at g=8; without it UniSpec trails Token Recycling at
                                      # small g. False restores the literal algorithm.

    # --- drafters with an LM head (microspec.md section 4.1; EAGLE-2 defaults) ---------------------------
    drafter_layers: str = "skip:12,14,16,18"   # layerskip: which target layers the drafter drops/keeps
    eagle_depth: int = 5
    eagle_topk: int = 10
    eagle_total_tokens: int = 60
    eagle_head: str | None = None     # eagle: EAGLE-1/2 draft head - hub id, local dir, or "random" (tests)

    # --- draft vocabulary policy (microspec.md section 3.2, 4.1, A.3; fr-spec.md) ---------------------------
    vocab: str = "full"
    k_pre: int = 3
    k_ver: int = 3
    w_max: int = 3072
    sources: Literal["ctx+ext", "ctx", "ext"] = "ctx+ext"
    ver_rows: Literal["accepted_path", "last", "all_tree"] = "accepted_path"   # specs/microspec.md A1
    window_mode: Literal["eq4_exact", "fifo_unique"] = "eq4_exact"            # A4
    draft_tree_tokens: Literal["final", "all_expanded"] = "final"              # A2
    prefill_order: Literal["first", "last"] = "first"   # A3: order of the Eq. 2 prefill union (first or
                                                       # last occurrence); "first" = locality.stream's default
    frspec_k: int = 32768
    frequency_file: str | None = None

    def replace(self, **overrides) -> "SpecConfig":
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown config field(s) {sorted(unknown)}; valid fields: "
                              f"{sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides).validate()

    @classmethod
    def preset(cls, name: str = "ar", **overrides) -> "SpecConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown method/preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name].replace(**overrides)

    def validate(self) -> "SpecConfig":
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose one of {list(METHODS)}")
        if self.vocab not in VOCABS:
            raise ConfigError(f"unknown vocab policy {self.vocab!r}; choose one of {list(VOCABS)}")
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0):
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.draft_size is not None and self.draft_size <= 0:
            raise ConfigError(f"draft_size (g*) must be a positive number of draft tokens, got {self.draft_size}; "
                              f"pass None to calibrate it")
        if self.w_max <= 0:
            raise ConfigError(f"w_max must be > 0 (the paper uses 3072), got {self.w_max}")
        for name in ("k_pre", "k_ver", "store_k", "tree_depth", "eagle_depth", "eagle_topk",
                     "eagle_total_tokens", "pld_num_draft", "frspec_k", "record_topk"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.threshold_scope not in ("expand", "expand+select"):
            raise ConfigError(f"threshold_scope must be 'expand' or 'expand+select', got {self.threshold_scope!r}")
        if not (0 <= self.threshold_r < 1):
            raise ConfigError(f"threshold_r must be in [0, 1), got {self.threshold_r}")
        if not (1 <= self.pld_min_ngram <= self.pld_max_ngram):
            raise ConfigError(f"need 1 <= pld_min_ngram <= pld_max_ngram, got "
                              f"{self.pld_min_ngram}, {self.pld_max_ngram}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


PRESETS: dict[str, SpecConfig] = {
    "ar": SpecConfig(method="ar"),
    "pld": SpecConfig(method="pld"),
    "hf-prompt-lookup": SpecConfig(method="hf-prompt-lookup"),
    "recycling": SpecConfig(method="recycling"),
    "unispec": SpecConfig(method="unispec"),
    "layerskip": SpecConfig(method="layerskip"),
    "eagle": SpecConfig(method="eagle"),
    "microspec": SpecConfig(method="layerskip", vocab="microspec"),
    "frspec": SpecConfig(method="layerskip", vocab="frspec"),
}
