"""The words of a sweep config (`sweeps.config` documents the file): its sections and keys, their defaults, the
parsed objects (`ModelSpec`, `PromptEntry`, `Sweep`) and the small checks that name a problem in a value.

Shared by the parser (`sweeps.config`), the cell plan (`sweeps.plan`) and the pre-run checks (`sweeps.checks`);
without torch, like the first two.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from dataclasses import dataclass

from specvocab.engine.config import ConfigError, SpecConfig
from specvocab.sweeps.cell import Cell, SweepError

# the kinds of cell are one list, sweeps.cell.KINDS (results readers take it from there without the config)
MODEL_KINDS = ("record", "calibrate", "bench")          # cells run on an actor holding the model
ANALYSES = ("window", "shortlist", "distances", "miss_ratio")
SPLITS = ("category", "language", "none")
DTYPES = ("float32", "bfloat16", "float16")
RANDOM_OPTIONS = ("vocab_size", "hidden_size", "num_layers", "max_context", "seed")
# SpecConfig fields a sweep sets through its own keys, never through `params`
RESERVED_FIELDS = {"method": "methods", "vocab": "policies", "max_new_tokens": "max_new_tokens",
                   "seed": "[sweep] seeds", "record": "(bench rows are not records)",
                   "record_topk": "[record] topk"}

SECTION_KEYS = {
    "sweep": {"name", "kinds", "max_new_tokens", "repeats", "seeds", "warmup", "dtype", "calibration_cache",
              "max_crashes", "timing", "calibration", "draft_sizes"},
    "models": {"name", "label", "options", "params", "memory", "num_cpus"},
    "prompts": {"set", "per_category", "categories", "languages", "split"},
    "record": {"topk", "max_new_tokens"},
    "coverage": {"analyses", "w_max", "k_pre", "k_ver", "sources", "by", "shortlist_k", "capacities"},
    "bench": {"methods", "policies", "vocab_sizes", "params", "max_new_tokens", "prompt_sets"},
    "calibrate": {"methods", "grid", "prompts", "warmup", "max_new_tokens", "params", "policies", "vocab_sizes"},
    "timeouts": {"load", "record", "calibrate", "bench", "coverage"},
    "testing": {"crash_once", "crash", "delay_s", "hang"},
}
TIMEOUT_DEFAULTS = {"load": 3600.0, "record": 3600.0, "calibrate": 7200.0, "bench": 3600.0, "coverage": 600.0}
MAX_CRASHES = 3
# [sweep] timing: "exclusive" - the timed cells (calibrate, bench) of a CPU sweep run one at a time per machine;
# "shared" - as many at once as the machine has slots (`sweeps.run`)
TIMINGS = ("exclusive", "shared")
TIMED_KINDS = ("calibrate", "bench")
# run-time settings, left out of the config hash (a folder resumes under new values): section -> keys, "*" all
RUNTIME_KEYS = {"timeouts": "*", "sweep": {"max_crashes", "timing"}, "models": {"memory", "num_cpus"}}
MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
                "gib": 2**30, "tib": 2**40}
COVERAGE_DEFAULTS = {
    "analyses": list(ANALYSES), "w_max": [1024, 2048, 3072, 4096, 8192], "k_pre": [3], "k_ver": [3],
    "sources": ["ctx+ext"], "by": ["category", "language"],
    "shortlist_k": [512, 1024, 2048, 4096, 8192, 16384, 32768],
    "capacities": [64, 128, 256, 512, 1024, 2048, 3072, 4096],
}
SOURCES = ("ctx+ext", "ctx", "ext")
BY = ("prompt_set", "category", "language", "prompt_id", "turn")     # trace fields coverage can group by


@dataclass(frozen=True)
class ModelSpec:
    name: str
    label: str
    options: dict
    params: dict            # SpecConfig fields under every bench / calibrate grid point of this model
    memory: int | None = None           # Ray `memory` (bytes) each of its actors reserves
    num_cpus: float | None = None       # Ray CPUs per actor (default 1); also torch's threads on CPUs


@dataclass(frozen=True)
class PromptEntry:
    index: int
    set: str
    per_category: int | None
    categories: tuple[str, ...] | None
    languages: tuple[str, ...] | None
    split: str
    values: tuple[str | None, ...]       # the split values (one record / bench cell each)
    prompts: int                         # how many prompts the entry selects
    selected: tuple = dataclasses.field(default=(), repr=False, compare=False)   # those prompts

    def selection(self, value: str | None) -> dict:
        """The load_prompts arguments of one split value (canonical: lists sorted, absent = None)."""
        cats = list(self.categories) if self.categories else None
        langs = list(self.languages) if self.languages else None
        if self.split == "category":
            cats = [value]
        elif self.split == "language":
            langs = [value]
        return {"prompt_set": self.set, "per_category": self.per_category, "categories": cats,
                "languages": langs, "split": self.split, "split_value": value}


@dataclass(frozen=True)
class Sweep:
    name: str
    config: dict                        # the parsed TOML, as given
    config_hash: str
    kinds: tuple[str, ...]
    models: tuple[ModelSpec, ...]
    cells: tuple[Cell, ...]
    dtype: str | None = None            # the models' dtype; None = kernels.hardware's default
    calibration_cache: bool | str = True    # where calibrate cells also save g* (model_cells.calibration_file)
    crash_once: str | None = None       # tests only: [testing] crash_once, crash, delay_s, hang
    delay_s: float = 0.0
    timeouts: dict = dataclasses.field(default_factory=lambda: dict(TIMEOUT_DEFAULTS))   # kind -> s (0: none)
    max_crashes: int = MAX_CRASHES      # actor deaths per model before its remaining cells fail
    timing: str = "exclusive"           # [sweep] timing (TIMINGS)
    calibration_cache_set: bool = True  # [sweep] calibration_cache given (else its default depends on --address)
    crash: bool = False
    hang: tuple[str, ...] = ()
    calibration: str | None = None      # [sweep] calibration: a calibration file bench cells take g* from
    # the [[prompts]] entries with the prompts they select (what sweeps.checks.check_contexts measures)
    prompt_entries: tuple[PromptEntry, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def by_kind(self, kind: str) -> list[Cell]:
        return [c for c in self.cells if c.kind == kind]


# ----------------------------------------------------------------------------------------------------------
# Small checks that name the problem
# ----------------------------------------------------------------------------------------------------------

def suggest(name: str, choices) -> str:
    """The hint " (did you mean 'x'?)" naming the choice closest to a misspelt `name`, else ""."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(table: dict, allowed: set[str], where: str) -> None:
    if not isinstance(table, dict):
        raise SweepError(f"{where} must be a table, got {type(table).__name__}")
    for key in table:
        if key not in allowed:
            raise SweepError(f"{where}: unknown key {key!r}{suggest(key, allowed)} — valid keys: {sorted(allowed)}")


def as_list(value, where: str, kind=None) -> list:
    """A scalar or a list of scalars -> a non-empty list (of `kind`, if given)."""
    out = value if isinstance(value, list) else [value]
    if not out:
        raise SweepError(f"{where} is an empty list — give at least one value or leave the key out")
    if kind is not None:
        for v in out:
            if isinstance(v, bool) or not isinstance(v, kind):
                want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
                raise SweepError(f"{where}: {v!r} is not a {want}")
    return out


def check_choices(value, where: str, allowed, what: str) -> list[str]:
    """A string or a list of strings, each one of `allowed` -> the list."""
    out = as_list(value, where, str)
    for v in out:
        if v not in allowed:
            raise SweepError(f"{where}: {v!r} is not {what}{suggest(v, allowed)} — choose from {list(allowed)}")
    return out


def positive_ints(value, where: str) -> list[int]:
    out = as_list(value, where, int)
    bad = [v for v in out if v <= 0]
    if bad:
        raise SweepError(f"{where}: values must be positive integers, got {bad}")
    return out


def check_int(value, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SweepError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def check_params(params: dict, where: str) -> dict[str, list]:
    """SpecConfig fields -> {field: [values]} (a list is an axis of the grid, a scalar one value)."""
    if not isinstance(params, dict):
        raise SweepError(f"{where}.params must be a table of SpecConfig fields")
    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    out = {}
    for key, value in params.items():
        if key in RESERVED_FIELDS:
            raise SweepError(f"{where}.params: {key!r} is set by the sweep itself ({RESERVED_FIELDS[key]}), "
                             f"not through params")
        if key not in fields:
            raise SweepError(f"{where}.params: {key!r} is not a SpecConfig field{suggest(key, fields)} — valid "
                             f"fields: {sorted(fields - set(RESERVED_FIELDS))}")
        out[key] = as_list(value, f"{where}.params.{key}")
    return out


def grid_points(axes: dict[str, list]) -> list[dict]:
    """Every combination of the axes' values, as {field: value}, fields and values in a fixed order."""
    keys = sorted(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def spec_config(method: str, fields: dict, where: str) -> SpecConfig:
    """`SpecConfig.preset(method, **fields)`; its ConfigError as a SweepError naming `where`."""
    try:
        return SpecConfig.preset(method, **fields)
    except ConfigError as e:
        raise SweepError(f"{where}: {e}") from None
