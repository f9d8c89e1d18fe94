"""A sweep: one TOML file naming a grid, expanded into a deterministic list of cells, validated up front.

`load_sweep(path)` / `parse_sweep(config)` -> `Sweep`, in a process without torch: this module
parses `[sweep]`, `[[models]]`, `[[prompts]]`, `[timeouts]` and `[testing]`; `sweeps.plan` the grid sections
and their cells; `sweeps.schema` holds the keys, defaults and parsed objects; `sweeps.checks.check_contexts`
the one check that needs tokenizers (below), which `sweeps.run` makes before anything runs.

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
    # calibration = "cal.json"           # bench cells of methods no [[calibrate]] entry covers take g* from this
                                         # calibration file (hashed in sweep.json); without it, the method's
                                         # uncalibrated default. The machine's own cache is never read.
    # draft_sizes = "calibrate"          # instead of that default: a calibrate cell per bench point that needs
                                         # one (default grid), its g* for the point's bench cells
    max_crashes = 3                      # actor deaths per model (after Ray's own restarts) before the sweep
                                         # stops that model: its remaining cells fail, naming the count
    timing = "exclusive"                 # on CPUs, the timed cells (calibrate, bench) run one at a time per
                                         # machine, with nothing else of the sweep beside them; "shared": as
                                         # many at once as it has slots - faster, but cells beside each other
                                         # share its memory bandwidth, which slows `ar` most (PERFORMANCE.md)

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
    policies = ["full", "frspec", "microspec"]    # drafters with an LM head only (engine.metrics.DRAFTERS)
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
(`engine.config.calibration_fields`: the method's tree parameters, the policy and its size, the
target's backend, ...); its parameters name that cell (`calibrate_cell`), and it fails, naming it, if that
cell has no result (`sweeps.model_cells.bench_cell`), rather than run at another size. A bench point of a
calibrated method that no calibrate cell matches is a config error naming the settings that differ. Bench
cells of methods the sweep does not calibrate take their g* from the calibration file `[sweep] calibration`
names (hashed in `sweep.json`; a cell whose key it lacks fails, naming the key), else the method's
uncalibrated default - never from the machine's calibration cache (`sweeps.plan.draft_size_source`; the
dry-run and the summary list each cell's source, its rows carry it as `draft_size_source`).

Run-time settings - `[timeouts]`, `[sweep] max_crashes` and `timing`, a model's `memory` and `num_cpus` - change how cells
are run, not what they compute: they are left out of the config hash (`sweep.json`), so an output folder
resumes under new values of them.

Checked before anything runs, each error naming the entry and the fix: by the parser, unknown keys, models,
methods, SpecConfig fields, policies, prompt sets, categories and languages; by `sweeps.checks.check_contexts`
(`sweeps.run` calls it first, `--dry-run` too), prompts that do not fit a model's context with the new tokens
its record / bench cells generate (every turn, earlier answers counted at max_new_tokens each; hub ids only
when their tokenizer and config are in the local Hugging Face cache). A config is parsed without loading a
tokenizer or torch; methods are checked against those whose drafter module ships in engine/drafters
(`engine.catalog.known_methods`), which is what a Ray worker can import.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from specvocab.engine.catalog import HUB_ID, RANDOM_MODELS, known_models
from specvocab.engine.prompts import PromptError, load_prompts
from specvocab.sweeps.cell import KINDS, SweepError, digest
from specvocab.sweeps.plan import expand_cells, plan  # noqa: F401 (plan: re-exported, the dry-run table)
from specvocab.sweeps.schema import (DTYPES, MAX_CRASHES, MEMORY_UNITS, RANDOM_OPTIONS, RUNTIME_KEYS, SECTION_KEYS, SPLITS,
                           TIMEOUT_DEFAULTS, TIMINGS, as_list, check_int, check_keys, check_params, suggest)
# the parsed objects and the words of the schema, re-exported: code and notebooks import them from here
from specvocab.sweeps.schema import ANALYSES, BY, COVERAGE_DEFAULTS, MODEL_KINDS, SOURCES, ModelSpec, PromptEntry, Sweep  # noqa: F401


# ----------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------

def _entry(spec: dict, i: int, section: str, key: str, hint: str) -> tuple[str, str]:
    """(where, name) of the i-th `[[section]]` entry: its keys checked, its `key` a non-empty string."""
    where = f"[[{section}]] #{i + 1}"
    check_keys(spec, SECTION_KEYS[section], where)
    name = spec.get(key)
    if not isinstance(name, str) or not name:
        raise SweepError(f"{where}: needs `{key}` ({hint})")
    return where, name


def _check_model(spec: dict, i: int) -> ModelSpec:
    where, name = _entry(spec, i, "models", "name", f"one of {known_models()}, a local folder or a hub id owner/name")
    if not (name in known_models() or Path(name).expanduser().is_dir() or HUB_ID.match(name)):
        raise SweepError(f"{where}: unknown model {name!r}{suggest(name, known_models())}: not a known name "
                         f"({', '.join(known_models())}), an existing folder or a hub id like "
                         f"meta-llama/Llama-3.1-8B-Instruct")
    options = spec.get("options", {})
    if options:
        if name not in RANDOM_MODELS:
            raise SweepError(f"{where}: `options` are for random models ({', '.join(RANDOM_MODELS)}) only; "
                             f"{name!r} takes none")
        check_keys(options, set(RANDOM_OPTIONS), f"{where} options")
        for k, v in options.items():
            check_int(v, f"{where} options.{k}", 0 if k == "seed" else 1)
    label = spec.get("label", name)
    if not isinstance(label, str) or not label:
        raise SweepError(f"{where}: `label` must be a non-empty string")
    params = {}
    for key, values in check_params(spec.get("params", {}), where).items():
        if len(values) != 1 or isinstance(spec["params"][key], list):
            raise SweepError(f"{where}.params.{key}: a model's params are single values (e.g. the layers its "
                             f"drafter skips) — put grid axes in a [[bench]] entry's params")
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
    raise SweepError(f"{where}: {value!r} is not a memory size — give bytes (an integer) or a string such as "
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


# ----------------------------------------------------------------------------------------------------------
# Prompt entries
# ----------------------------------------------------------------------------------------------------------

def _check_prompts(spec: dict, i: int) -> PromptEntry:
    where, name = _entry(spec, i, "prompts", "set",
                         "spec_bench, multilingual, humaneval, train_corpus or a .jsonl path")
    per = spec.get("per_category")
    if per is not None:
        check_int(per, f"{where}.per_category")
    cats = spec.get("categories")
    langs = spec.get("languages")
    cats = sorted(set(as_list(cats, f"{where}.categories", str))) if cats is not None else None
    langs = sorted(set(as_list(langs, f"{where}.languages", str))) if langs is not None else None
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
                         f"prompts (no prompt has both) — widen one of the two filters")
    if split == "none":
        values: tuple = (None,)
    else:
        values = tuple(sorted({getattr(p, split) for p in prompts}))
    return PromptEntry(i, name, per, tuple(cats) if cats else None, tuple(langs) if langs else None, split,
                       values, len(prompts), tuple(prompts))


# ----------------------------------------------------------------------------------------------------------
# Parsing
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
    check_keys(config, set(SECTION_KEYS), "the sweep config (top level)")
    top = config.get("sweep", {})
    check_keys(top, SECTION_KEYS["sweep"], "[sweep]")
    name = top.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise SweepError("[sweep].name must be a non-empty string")
    default_kinds = ["record", "coverage"] + [k for k in ("bench", "calibrate") if config.get(k)]
    kinds = as_list(top.get("kinds", default_kinds), "[sweep].kinds", str)
    for k in kinds:
        if k not in KINDS:
            raise SweepError(f"[sweep].kinds: unknown kind {k!r}{suggest(k, KINDS)} — choose from {list(KINDS)}")
    kinds = [k for k in KINDS if k in kinds]
    if "coverage" in kinds and "record" not in kinds:
        raise SweepError("[sweep].kinds has 'coverage' without 'record': coverage cells read the traces the "
                         "record cells write — add 'record'")
    max_new = check_int(top.get("max_new_tokens", 128), "[sweep].max_new_tokens")
    repeats = check_int(top.get("repeats", 1), "[sweep].repeats")
    warmup = check_int(top.get("warmup", 1), "[sweep].warmup", 0)
    seeds = as_list(top.get("seeds", [0]), "[sweep].seeds", int)
    dtype = top.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise SweepError(f"[sweep].dtype: {dtype!r} is not one of {list(DTYPES)} (leave it out for the device's "
                         f"default)")
    max_crashes = check_int(top.get("max_crashes", MAX_CRASHES), "[sweep].max_crashes")
    timing = top.get("timing", TIMINGS[0])
    if timing not in TIMINGS:
        raise SweepError(f"[sweep].timing: {timing!r} is not one of {list(TIMINGS)} (\"exclusive\": timed cells one "
                         f"at a time per machine; \"shared\": as many at once as it has slots)")
    timeouts = dict(TIMEOUT_DEFAULTS)
    tables = config.get("timeouts", {})
    check_keys(tables, SECTION_KEYS["timeouts"], "[timeouts]")
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

    calibration = top.get("calibration")
    if calibration is not None:
        if not isinstance(calibration, str) or not calibration:
            raise SweepError(f"[sweep].calibration: {calibration!r} is not a path — give the calibration.json a "
                             f"calibrate run wrote (its records give the bench cells' draft sizes)")
        calibration = str(Path(calibration).expanduser().resolve())
        if not Path(calibration).is_file():
            raise SweepError(f"[sweep].calibration: {calibration} does not exist — give the calibration.json a "
                             f"calibrate run wrote, or leave the key out")

    model_specs = config.get("models")
    if not isinstance(model_specs, list) or not model_specs:
        raise SweepError("the sweep needs at least one [[models]] entry with a `name`")
    models = [_check_model(m, i) for i, m in enumerate(model_specs)]
    labels = [m.label for m in models]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise SweepError(f"[[models]]: label(s) {dup} appear more than once — give each entry its own `label`")

    needs_prompts = any(k in kinds for k in ("record", "bench"))
    prompt_specs = config.get("prompts", [])
    if not isinstance(prompt_specs, list):
        raise SweepError("`prompts` must be an array of tables: [[prompts]]")
    if needs_prompts and not prompt_specs:
        raise SweepError("record and bench cells need at least one [[prompts]] entry with a `set`")
    entries = [_check_prompts(p, i) for i, p in enumerate(prompt_specs)]

    testing = config.get("testing", {})
    check_keys(testing, SECTION_KEYS["testing"], "[testing]")
    crash_once = testing.get("crash_once")
    crash = testing.get("crash", False)
    hang = tuple(as_list(testing.get("hang", []), "[testing].hang", str)) if testing.get("hang") else ()
    delay_s = testing.get("delay_s", 0.0)
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or delay_s < 0:
        raise SweepError(f"[testing].delay_s must be a number of seconds >= 0, got {delay_s!r}")

    draft_sizes = top.get("draft_sizes", "default")
    if draft_sizes not in ("default", "calibrate"):
        raise SweepError(f"[sweep].draft_sizes: {draft_sizes!r} is not \"default\" (a method no [[calibrate]] entry, "
                         f"calibration file or draft_size covers runs at its uncalibrated default) or \"calibrate\" "
                         f"(the sweep adds a calibrate cell for it)")
    cells = expand_cells(config, kinds, models, entries, max_new=max_new, repeats=repeats, warmup=warmup,
                         seeds=seeds, dtype=dtype, draft_sizes=draft_sizes)
    return Sweep(name=name, config=config, config_hash=digest(config_identity(config)), kinds=tuple(kinds),
                 models=tuple(models), cells=tuple(cells), dtype=dtype, calibration_cache=cal_cache,
                 crash_once=crash_once, delay_s=float(delay_s), timeouts=timeouts, max_crashes=max_crashes,
                 timing=timing,
                 calibration_cache_set="calibration_cache" in top, crash=bool(crash), hang=hang,
                 calibration=calibration, prompt_entries=tuple(entries))
