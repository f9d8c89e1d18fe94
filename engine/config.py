"""One config dataclass with the papers' defaults, and named presets.

Every knob of every method lives here once, with the section of the paper that fixes its default.
`engine.generate(..., **overrides)`, the bench CLI and a Ray sweep cell all build a `SpecConfig` the same
way: `SpecConfig.preset(name).replace(**overrides)`.

Each set of allowed values is defined once, as the `Literal` type of its field (`POLICIES` is read from its
type), and `validate()` checks every `Literal` field against its own arguments; the methods are those
`engine.methods` describes (`METHODS`, read at each use, so a method registered at run time validates too).

Draft size: one field, `draft_size` = g, the draft tokens per step (root excluded), for every method.
`None` means the calibrated size of every drafter on this model, device, dtype and config (UniSpec §3,
App. F: `engine.calibration.resolve_draft_size`, made by `python -m specvocab.engine.jobs.calibrate --method <method>`), resolved
once where a run's config is resolved (`engine.harness.resolve_config`), never inside a drafter. With no
calibration cached, the method's uncalibrated default (`engine.methods.MethodSpec.default_draft_size`), with one
warning naming the command: unispec a per-device g, recycling its whole static template, pld and the
EAGLE-style drafters `DEFAULT_DRAFT_SIZE`.

Also here, without torch, so that a sweep's config is parsed and expanded into cells in a process that never
loads it: what the methods and policies are in the config's terms - `DRAFTING_METHODS`,
`HF_METHODS` (views of `engine.methods`' descriptions), each policy's size field `REQUESTED_SIZE` - and the
calibration key: the fields that change a method's tau(g) or s(g) (`calibration_fields`, `config_fingerprint`),
under which `engine.calibration` caches g* and a sweep links a bench cell to its calibrate cell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass
from typing import Literal

from specvocab.engine.methods import (MERGE_HEADS, MERGE_SOURCES, MethodNames, MethodTable,  # noqa: F401
                                      UnknownMethodError, method_spec)

Backend = Literal["auto", "native", "hf"]   # how the target runs (engine.target)
Policy = Literal["full", "frspec", "microspec", "oracle", "dynaspec"]     # draft vocabulary policies (engine.vocab)

POLICIES: tuple[str, ...] = typing.get_args(Policy)
# Views of the method descriptions (engine.methods), in display order, read at each use
METHODS = MethodNames(doc="every method")
DRAFTING_METHODS = MethodNames(lambda s: s.drafts, "the methods with a draft size to calibrate (all but ar)")
HF_METHODS = MethodNames(lambda s: s.runner == "hf", "run by transformers' generate, not through a drafter")
# the SpecConfig field that is a policy's size, read into a bench's vocab_size column (and set by a sweep's
# `vocab_sizes`); dynaspec's size is a token budget with no field of its own (engine.jobs.bench)
REQUESTED_SIZE = {"frspec": "frspec_k", "microspec": "w_max", "oracle": "w_max"}

# The draft size a method uses when `draft_size` is None and no calibration is cached for it, where it is a
# fixed number (each method's description, `MethodSpec.default_draft_size`, gives its source; recycling's
# whole template and unispec's per-device g are resolved in engine.harness.resolve_config)
DEFAULT_DRAFT_SIZE = MethodTable(lambda s: s.default_draft_size if isinstance(s.default_draft_size, int) else None)

_LABELS = {"method": "method", "vocab": "vocab policy"}      # how error messages name a field's values


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the valid range."""


@dataclass(frozen=True)
class SpecConfig:
    # --- decoding -------------------------------------------------------------------------------------
    method: str = "ar"                # a method `engine.methods` describes (METHODS)
    max_new_tokens: int = 128
    temperature: float = 0.0          # 0 = greedy (all papers' main setting)
    top_p: float = 1.0
    seed: int = 0
    record: bool = False              # keep per-step records (draft tree, accepted path, top-K)
    record_topk: int = 16             # K of recorded top-K rows (locality traces use K=16)
    draft_size: int | None = None     # g: draft tokens per step (root excluded), every method; None = the
                                      # method's default (module docstring), resolved by resolve_config

    # --- the target's forward (engine.target, engine.native) ---------------------------------------------
    backend: Backend = "auto"         # native where the family is supported, else transformers ("hf")
    fixed_shape: bool = True          # native: every decode forward at a bucket of rows, keys folded in logical
                                      # order, so a token's logits are bitwise those of an `ar` step
    verify_rows: int | None = None    # native + fixed_shape: rows of every decode forward; None = the next
                                      # bucket (power of two >= 4) of each step's tree
    compile: bool = False             # native + fixed_shape: torch.compile (inductor) the decode layer: fuses
                                      # the elementwise ops around the GEMMs (python -m specvocab.engine.jobs.forward
                                      # measures it); each bucket compiles once per process (~10 s on a CPU)
    cuda_graphs: bool = True          # native + fixed_shape on CUDA: replay the decode forward as CUDA graphs
                                      # (engine.native.GraphedDecode), one per BLOCK tokens of context; no-op
                                      # on a CPU
    cpu_kernels: bool = True           # native, bf16 on a CPU with AVX512-BF16: the decode's linears through
                                      # kernels.cpu (streams packed weights near the bandwidth bound;
                                      # row-invariant by construction); False = oneDNN (F.linear)

    # --- prompt lookup (Saxena 2023; transformers' prompt lookup) ----------------------------------------
    pld_max_ngram: int = 3
    pld_min_ngram: int = 1

    # --- Token Recycling / UniSpec (UniSpec App. A, Alg. 1) ----------------------------------------------
    store_k: int = 10                 # k: successors stored per token and nodes expanded per level
    tree_depth: int = 10              # d: maximum draft-tree depth
    threshold_r: float = 0.05         # r: confidence threshold for expanding a node (App. A, Table 12)
    confidence: Literal["path", "node"] = "path"   # node score: product along the path, or own stored prob
    broaden_first_level: bool = True  # first level also from the cached top-k at the token before the root
    store_persistence: Literal["deployment", "per_prompt"] = "deployment"
    recycling_tree: str = "tr-default"  # Token Recycling's static tree template
    threshold_scope: Literal["expand", "expand+select"] = "expand"   # r only stops expansion (Alg. 1
                                      # l.28), or also drops nodes under r from the draft (§3's motivation)
    cache_exclude_root: bool = True   # drop the root itself from the first-level cache C (Alg. 1 l.19-20):
                                      # C is the distribution that produced the root, so under greedy its
                                      # top-1 IS the root, scored with the root's own probability - not a
                                      # next-token estimate - and it outranks S[root]'s successors.
                                      # False = the paper read literally.

    # --- drafters with an LM head (MicroSpec §4.1; EAGLE-2 defaults) -------------------------------------
    drafter_layers: str = "skip:12,14,16,18"   # layerskip: which target layers the drafter drops/keeps
    eagle_depth: int = 5
    eagle_topk: int = 10
    eagle_head: str | None = None     # eagle: EAGLE-1/2 draft head - hub id, local dir, or "random" (tests)
    eagle3_head: str | None = None    # eagle3: EAGLE-3 draft head - hub id, local dir in the official layout, or
                                      # "random" (tests); None = the head shipped for the model (none ships yet)

    # --- draft vocabulary policy (MicroSpec §3.2, §4.1, App. A.3; FR-Spec §3) ----------------------------
    vocab: Policy = "full"
    k_pre: int = 3
    k_ver: int = 3
    w_max: int = 3072
    sources: Literal["ctx+ext", "ctx", "ext"] = "ctx+ext"
    ver_rows: Literal["accepted_path", "last", "all_tree"] = "accepted_path"   # rows of z_verify (§3.2)
    window_mode: Literal["eq4_exact", "fifo_unique"] = "eq4_exact"            # Eq. 4 literally, or dedup
    draft_tree_tokens: Literal["final", "all_expanded"] = "final"              # which tree feeds C_draft
    prefill_order: Literal["first", "last"] = "first"   # order of the Eq. 2 prefill union (first or
                                                       # last occurrence); "first" = locality.stream's default
    frspec_k: int = 32768
    frspec_budget: Literal["fixed", "position"] = "fixed"   # fixed = FR-Spec as published (the top frspec_k at
                                      # every draft step); position = FR-Spec-PA (DynaSpec App. A.1): the top
                                      # floor(frspec_k / (t + 1)) ids at draft step t (t = 0: the root's children)
    frequency_file: str | None = None
    # DynaSpec (engine.vocab.dynaspec): a fitted clusters + router file (`python -m specvocab.engine.jobs.fit_dynaspec`); None =
    # the newest one in the specvocab cache fitted for this LM head and drafter
    dynaspec_file: str | None = None
    dynaspec_k_max: int = 256         # clusters per row at draft steps 0-1 (DynaSpec §4.2); not stated in the
                                      # paper: 256 of M = 1024 clusters is the quarter of the vocabulary that
                                      # its FR-Spec baseline keeps (32k of Llama-3's 128k, Table 1)
    dynaspec_budget: Literal["position", "fixed"] = "position"   # DynaSpec-PA: k_max at t = 0, 1, then
                                      # floor(k_max / (2 (t + 1))) (§4.2, Alg. 1 l.7); fixed = DynaSpec-F (Fig. 2)
    dynaspec_k_min: int = 1           # floor of the decayed budget; the paper names k_min but never sets it

    # --- merged: one tree from several drafters (engine.drafters.merged) -----------------------------------
    merge_sources: str = "eagle3+pld+unispec"   # '+'-joined MERGE_SOURCES: at most one head (eagle3 or eagle)

    def replace(self, **overrides) -> "SpecConfig":
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown config field(s) {sorted(unknown)} — valid fields: "
                              f"{sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides).validate()

    @classmethod
    def preset(cls, name: str = "ar", **overrides) -> "SpecConfig":
        if name in PRESETS:
            return PRESETS[name].replace(**overrides)
        if name in METHODS:                                  # a method registered after PRESETS was built
            return cls(method=name).replace(**overrides)
        raise ConfigError(f"unknown method/preset {name!r} — choose one of {sorted({*PRESETS, *METHODS})}")

    def validate(self) -> "SpecConfig":
        if self.method not in METHODS:
            raise ConfigError(f"unknown {_LABELS['method']} {self.method!r} — choose one of {list(METHODS)} "
                              f"(field method; a new method is described with engine.methods.register_method)")
        for name, choices in LITERAL_FIELDS.items():
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"unknown {_LABELS.get(name, name)} {value!r} — choose one of {list(choices)} "
                                  f"(field {name})")
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0):
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.draft_size is not None and (isinstance(self.draft_size, bool) or self.draft_size <= 0):
            raise ConfigError(f"draft_size must be a positive number of draft tokens (root excluded), got "
                              f"{self.draft_size!r} — pass None for the method's default")
        if self.verify_rows is not None and (isinstance(self.verify_rows, bool) or self.verify_rows < 4):
            raise ConfigError(f"verify_rows must be >= 4 (the smallest row count whose GEMMs are row-invariant "
                              f"in fp32) or None for a bucket per step, got {self.verify_rows!r}")
        if self.w_max <= 0:
            raise ConfigError(f"w_max must be > 0 (the paper uses 3072), got {self.w_max}")
        for name in ("k_pre", "k_ver", "store_k", "tree_depth", "eagle_depth", "eagle_topk", "frspec_k",
                     "record_topk", "dynaspec_k_max", "dynaspec_k_min"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not (0 <= self.threshold_r < 1):
            raise ConfigError(f"threshold_r must be in [0, 1), got {self.threshold_r}")
        if not (1 <= self.pld_min_ngram <= self.pld_max_ngram):
            raise ConfigError(f"need 1 <= pld_min_ngram <= pld_max_ngram, got "
                              f"{self.pld_min_ngram}, {self.pld_max_ngram}")
        return self

    def require_draft_size(self) -> int:
        """`draft_size` of a resolved config; a clear error when it is still None (drafters call this)."""
        if self.draft_size is None:
            raise ConfigError(f"{self.method}: draft_size is None — the method's default is resolved by "
                              f"specvocab.engine.harness.resolve_config(cfg, model=target) - generate() does this - so "
                              f"resolve the config first or set draft_size")
        return int(self.draft_size)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _literal_fields() -> dict[str, tuple]:
    hints = typing.get_type_hints(SpecConfig)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(SpecConfig)
            if typing.get_origin(hints[f.name]) is Literal}


# {field name: allowed values} for every `Literal` field of SpecConfig, read from the types themselves
LITERAL_FIELDS: dict[str, tuple] = _literal_fields()


def parse_overrides(items: list[str]) -> dict:
    """`FIELD=VALUE` strings (a CLI's repeated `--set`) -> SpecConfig overrides. VALUE is read as JSON
    (numbers, true/false, null), else kept as a string (`--set vocab=microspec`)."""
    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


PRESETS: dict[str, SpecConfig] = {
    **{m: SpecConfig(method=m) for m in METHODS},
    "microspec": SpecConfig(method="layerskip", vocab="microspec"),
    "frspec": SpecConfig(method="layerskip", vocab="frspec"),
}


# ---- the calibration key (engine.calibration caches g* under it) ------------------------------------------

# Config fields that change tau(g) or s(g), per method (`engine.methods.MethodSpec.calibration_fields`, a view
# read at each use); the vocabulary policy's own fields follow `POLICY_FIELDS` of the policy in use.
CALIBRATION_FIELDS = MethodTable(lambda s: s.calibration_fields)
POLICY_FIELDS: dict[str, tuple[str, ...]] = {
    "full": (),
    "frspec": ("frspec_k", "frequency_file", "frspec_budget"),
    "microspec": ("w_max", "k_pre", "k_ver", "sources", "ver_rows", "window_mode", "draft_tree_tokens",
                  "prefill_order"),
    "oracle": ("w_max",),
    "dynaspec": tuple(f.name for f in dataclasses.fields(SpecConfig) if f.name.startswith("dynaspec_")),
}
# Fields that change neither tau(g) nor s(g) of a calibration: g itself, the method (in the key on its
# own), the run's length, seed and bookkeeping.
NOT_CALIBRATION_FIELDS = ("method", "draft_size", "max_new_tokens", "seed", "record", "record_topk")


def calibration_fields(cfg: SpecConfig) -> dict:
    """{field: value} of every config field that changes tau(g) or s(g) of cfg.method (every field but
    `NOT_CALIBRATION_FIELDS` for a method whose description lists none)."""
    try:
        names = method_spec(cfg.method).calibration_fields
    except UnknownMethodError as e:
        raise ConfigError(str(e)) from None
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cfg) if f.name not in NOT_CALIBRATION_FIELDS)
    elif "vocab" in names:
        names = (*names, *POLICY_FIELDS.get(cfg.vocab, ()))
    return {n: getattr(cfg, n) for n in names
            if not (n in ADDED_AT_DEFAULT and getattr(cfg, n) == ADDED_AT_DEFAULT[n])}


# Fields added after calibrations were cached, left out of the key at their default so those keys stay valid
# (the default is the behaviour the cached calibrations were measured with).
ADDED_AT_DEFAULT = {"frspec_budget": "fixed", "cuda_graphs": True}


def config_fingerprint(cfg: SpecConfig) -> str:
    """A stable short hash of `calibration_fields(cfg)`."""
    text = json.dumps(calibration_fields(cfg), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]
