"""One resolution per run: `resolve_run(cfg, model, ...) -> ResolvedRun`, every open choice of a run turned into a
value once, before the decode, with where each value came from.

What a config may leave open, in the order it is resolved (each step reads the ones before it):

    head         eagle's `eagle_head` / eagle3's `eagle3_head` None -> the head shipped for this target
                 (`engine.shipped`, matched by its LM head); layerskip's head is its `drafter_layers`
    vocabulary   frspec's `frequency_file` None -> the default list counted on the training corpus
                 (`engine.vocab.frspec_lists.with_default_ranking`); dynaspec's `dynaspec_file` None -> the
                 newest fit for this head and drafter (`engine.vocab.dynaspec.find_fitted`), and its size in both
                 units (`dynaspec:N` tokens -> k_max clusters, or k_max -> the tokens it stands for)
    draft size   `draft_size` None -> the g* of this model, device, dtype, config and kernel build (UniSpec §3,
                 App. F) in the calibration records read (default: this machine's cache); with none there for a
                 run reading this machine's cache, calibrated on the spot (`calibrate_here`) and cached; else the
                 method's uncalibrated default. Keyed on the config with its head resolved and its list / fit as
                 given (what `engine.jobs.calibrate` keys its records with), measured with both resolved.
    kernel build the build that decodes (`engine.calibration.kernel_build`: the C kernels' ISA build on a CPU)

Sources (`ResolvedRun.provenance`): "given" (the config set it), "calibrated" (a calibration record, a sweep's
calibrate cell, or measured on the spot), "shipped" (a head or fit that ships with the package), "fitted" (a
fit of this machine's cache, or a size read off a fit), "default" (the package's default: an uncalibrated
draft size, the default frequency list, the CPU's own kernel build). The draft size keeps its finer label in
`draft_size_source`: "config" (or the label a caller gives a size it set: a sweep's "calibrate-cell"),
"calibration-cache:<sha8>", "calibration-file:<sha8>", "on-the-spot", "default".

Drafters, policies, the bench, the calibration and the sweeps receive the resolved config and look nothing up;
the bench writes `ResolvedRun.columns()` into every row (`engine.metrics.ROW_SCHEMA`). `engine.harness.generate`
on a config left open resolves the head and the draft size alone (`resolve_config`: records or the default).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from specvocab.engine.calibration import (FALLBACK_DRAFT_SIZE, CalibrationError, CalibrationSource, calibrate_command,
                                         calibration_source,
                                         code_stamp, device_name, fit_record, kernel_build, kernel_build_source,
                                         model_id, model_key, require_record, save_calibration)
from specvocab.engine.config import REQUESTED_SIZE, SpecConfig, calibration_fields, config_fingerprint
from specvocab.engine.drafters import make_drafter
from specvocab.engine.drafters.merged import parse_sources, source_config
from specvocab.engine.harness import bucket_edge, default_draft_size
from specvocab.engine.measure import (calibration_grid, calibration_prompts, round_robin, run_prompts, store_of,
                                      summarise)
from specvocab.engine.methods import TARGET, SAMPLING, method_spec
from specvocab.engine.prompts import PromptError
from specvocab.engine.shipped import default_eagle3_head, default_eagle_head
from specvocab.engine.vocab import frspec_lists
from specvocab.engine.vocab.dynaspec import SHIPPED_FITS, find_fitted, fitted_sizes, k_max_for_tokens, tokens_for_k_max

SOURCES = ("given", "calibrated", "shipped", "fitted", "default")
ON_THE_SPOT = "on-the-spot"            # draft_size_source of a size calibrated by this resolution
# the bench row columns of a resolution (`ResolvedRun.columns`; `draft_size`, `draft_head`, `vocab_file` and
# `vocab_size` hold the values)
COLUMNS = ("draft_size_source", "draft_head_source", "vocab_file_source", "vocab_size_source", "kernel_build",
           "kernel_build_source")
# On-the-spot calibration [C]: a few draft sizes, 2 training-corpus prompts of 32 new tokens each (about 10-20 s
# for SmolLM2 on a 2-core CPU); `python -m specvocab.engine.jobs.calibrate` measures the full grid
SPOT_GRIDS = {"cpu": (1, 3, 7, 15), "cuda": (16, 32, 64, 96)}
SPOT_PROMPTS = 2
SPOT_NEW_TOKENS = 32
BUDGET_WORDS = {"position": "position-aware budget (DynaSpec-PA)", "fixed": "fixed budget (DynaSpec-F)"}


@dataclass(frozen=True)
class ResolvedRun:
    """A run's config with every open choice filled in (`cfg`), and where each came from (module docstring).

    cfg                  the config a decode runs: draft_size, eagle_head / eagle3_head, frequency_file,
                         dynaspec_file and dynaspec_k_max resolved
    draft_size_source    "config" (or the caller's label), "calibration-cache:<sha8>", "calibration-file:<sha8>",
                         "on-the-spot", "default"; None for a method that drafts nothing
    head                 the drafter's head: eagle's / eagle3's checkpoint, layerskip's `drafter_layers`; None
                         without one
    vocab_file           frspec's list, dynaspec's fit; None for other policies
    vocab_size           the requested vocabulary size: frspec's K, microspec's / oracle's w_max, dynaspec's
                         token budget (`engine.vocab.dynaspec.tokens_for_k_max`); None for full
    kernel_build         the build that decodes (`engine.calibration.kernel_build`)
    keyed                the config its draft size is keyed on (`engine.calibration.model_key`): the head
                         resolved, the list and fit as given - what `engine.jobs.calibrate` keys a record with
    """

    cfg: SpecConfig
    draft_size_source: str | None
    head: str | None
    head_source: str | None
    vocab_file: str | None
    vocab_file_source: str | None
    vocab_size: int | None
    vocab_size_source: str | None
    kernel_build: str
    kernel_build_source: str
    keyed: SpecConfig | None = None

    @property
    def draft_size(self) -> int | None:
        return self.cfg.draft_size

    @property
    def policy(self) -> str:
        """The draft vocabulary policy: cfg.vocab for a method with an LM head, else "full"."""
        return self.cfg.vocab if method_spec(self.cfg.method).lm_head else "full"

    def provenance(self) -> dict[str, str | None]:
        """{choice: source} over `SOURCES` (None: the run has no such choice)."""
        return {"draft_size": draft_size_kind(self.draft_size_source), "head": self.head_source,
                "vocab_file": self.vocab_file_source, "vocab_size": self.vocab_size_source,
                "kernel_build": self.kernel_build_source}

    def columns(self) -> dict[str, str | None]:
        """The provenance columns of a bench row (`COLUMNS`, `engine.metrics.ROW_SCHEMA`)."""
        return {"draft_size_source": self.draft_size_source, "draft_head_source": self.head_source,
                "vocab_file_source": self.vocab_file_source, "vocab_size_source": self.vocab_size_source,
                "kernel_build": self.kernel_build, "kernel_build_source": self.kernel_build_source}


def draft_size_kind(source: str | None) -> str | None:
    """A `draft_size_source` label as one of `SOURCES`: "config" given, "default" default, every other label
    (a calibration record, a calibrate cell, on the spot) calibrated."""
    if source is None:
        return None
    return {"config": "given", "default": "default"}.get(source, "calibrated")


def resolve_run(cfg: SpecConfig, model, *, tokenizer=None, info=None, eos_ids=None,
                calibration: CalibrationSource | None = None, draft_size_source: str | None = None,
                vocab_tokens: int | None = None, on_the_spot: bool = True, show: bool = False,
                label: str | None = None) -> ResolvedRun:
    """Resolve every open choice of `cfg` on `model` once (module docstring), in order: head, vocabulary list or
    fit and its size, draft size, kernel build.

    tokenizer, info, eos_ids: the model's (`load_model`), for frspec's default list and the on-the-spot
    calibration's training-corpus prompts. calibration: the records a size is looked up in (default this
    machine's cache; `engine.calibration.NO_CALIBRATION`: none, the uncalibrated default); only a run reading
    this machine's cache calibrates on the spot (`on_the_spot`), so a sweep's cells never do.
    draft_size_source: the label of a draft size cfg sets (default "config"). vocab_tokens: dynaspec's token
    budget N of `dynaspec:N` (sets k_max). show: print the one-line notes (the fit read, an on-the-spot
    calibration); label names the run in them. Errors (a missing head file, no fit, no data root for frspec's
    list) are ValueErrors naming the fix."""
    cfg = cfg.validate()
    spec = method_spec(cfg.method)
    eos = [int(e) for e in (eos_ids or ())]
    label = label or cfg.method
    cfg, head, head_source = _resolve_head(cfg, model)
    if cfg.method == "merged" and calibration is None and on_the_spot:
        _calibrate_merge_sources(cfg, model, tokenizer, info, eos, show, label)
    run, vocab_file, file_source, size, size_source = _resolve_vocab(cfg, model, spec.lm_head, tokenizer, info, eos,
                                                                     vocab_tokens, show, label)
    g, g_source = _resolve_draft_size(cfg, run, model, calibration, draft_size_source, on_the_spot, tokenizer, info,
                                      eos, show, label)
    if g is not None:
        run = run.replace(draft_size=g)
    return ResolvedRun(cfg=run, draft_size_source=g_source, head=head, head_source=head_source,
                       vocab_file=vocab_file, vocab_file_source=file_source, vocab_size=size,
                       vocab_size_source=size_source, kernel_build=kernel_build(model, run),
                       kernel_build_source=kernel_build_source(), keyed=cfg)


# --- the head -------------------------------------------------------------------------------------------------

def _resolve_head(cfg: SpecConfig, model) -> tuple[SpecConfig, str | None, str | None]:
    if cfg.method in ("eagle", "eagle3"):
        field = "eagle_head" if cfg.method == "eagle" else "eagle3_head"
        given = getattr(cfg, field)
        if given is not None:
            return cfg, str(given), "given"
        shipped = default_eagle_head(model) if cfg.method == "eagle" else default_eagle3_head(model)
        if shipped is None:
            return cfg, None, None                      # the drafter names the fix
        return cfg.replace(**{field: shipped}), shipped, "shipped"
    if cfg.method == "layerskip":
        return cfg, cfg.drafter_layers, _given_or_default(cfg, "drafter_layers")
    return cfg, None, None


def _given_or_default(cfg: SpecConfig, field: str) -> str:
    return "default" if getattr(cfg, field) == getattr(SpecConfig.preset(cfg.method), field) else "given"


# --- the vocabulary: FR-Spec's list, DynaSpec's fit, the size ----------------------------------------------------

def _resolve_vocab(cfg, model, lm_head, tokenizer, info, eos, tokens, show, label):
    """(the config to run, vocab_file, its source, vocab_size, its source)."""
    policy = cfg.vocab if lm_head else "full"
    if policy == "frspec":
        if cfg.frequency_file is not None:
            return cfg, cfg.frequency_file, "given", cfg.frspec_k, _given_or_default(cfg, "frspec_k")
        run = frspec_lists.with_default_ranking(cfg, tokenizer, info, eos)     # says which corpus
        return run, run.frequency_file, "default", cfg.frspec_k, _given_or_default(cfg, "frspec_k")
    if policy == "dynaspec":
        return _resolve_dynaspec(cfg, model, tokens, show, label)
    field = REQUESTED_SIZE.get(policy)
    if field is None:
        return cfg, None, None, None, None
    return cfg, None, None, int(getattr(cfg, field)), _given_or_default(cfg, field)


def _resolve_dynaspec(cfg, model, tokens, show, label):
    """The fitted file (`dynaspec_file`, else the newest fit for this head and drafter) and the size in both
    units: a token budget N sets k_max = round(N * M / V); else the run keeps its k_max and reports the tokens
    it stands for, round(k_max * V / M). The head is the target's LM head, or for eagle3 the EAGLE-3 head's
    own lm_head (V = its draft vocabulary). An EAGLE / EAGLE-3 fit is matched by the hash of the head's weights
    (`engine.vocab.dynaspec.drafter_key`), read from the drafter, so a head retrained in place reuses no fit."""
    head, key = model.get_output_embeddings().weight, None
    if cfg.method in ("eagle", "eagle3"):                        # eagle3's fit partitions its draft vocabulary
        drafter = make_drafter(model, cfg.replace(vocab="full", draft_size=cfg.draft_size or 1))
        head, key = drafter.head_weight, drafter.drafter_key()
    if cfg.dynaspec_file:
        path, source = Path(cfg.dynaspec_file).expanduser(), "given"
    else:
        path = find_fitted(head, cfg, key=key)
        source = "shipped" if Path(path).resolve().is_relative_to(Path(SHIPPED_FITS).resolve()) else "fitted"
    m, v = fitted_sizes(path)
    if tokens is not None:
        cfg, size, size_source = cfg.replace(dynaspec_k_max=k_max_for_tokens(tokens, m, v)), int(tokens), "given"
    else:
        size, size_source = tokens_for_k_max(cfg.dynaspec_k_max, m, v), "fitted"
    if show:
        print(f"[specvocab] {label}: DynaSpec {path} (M = {m} clusters, {v / m:.0f} tokens each on average): "
              f"k_max = {cfg.dynaspec_k_max} clusters per row at draft steps 0-1 (~{size} tokens), "
              f"{BUDGET_WORDS.get(cfg.dynaspec_budget, cfg.dynaspec_budget + ' budget')}", flush=True)
    return cfg.replace(dynaspec_file=str(path)), str(path), source, size, size_source


# --- the draft size -------------------------------------------------------------------------------------------

def _resolve_draft_size(cfg, run, model, calibration, given_label, on_the_spot, tokenizer, info, eos, show, label):
    """(g, draft_size_source): keyed on cfg (head resolved, list / fit as given), measured on run."""
    if not method_spec(cfg.method).drafts:
        return None, None
    if cfg.draft_size is not None:
        return int(cfg.draft_size), given_label or "config"
    here = calibration is None                                  # this machine's cache
    source = calibration_source() if here else calibration
    require_record(source, model_key(model, cfg), cfg.method)   # a sweep's file: its key or a clear error
    failed = None
    if here and on_the_spot and model_key(model, cfg) not in source.records:
        try:
            rec = calibrate_here(model, cfg, run, tokenizer=tokenizer, info=info, eos_ids=eos, show=show,
                                 label=label)
            return int(rec["g_star"]), ON_THE_SPOT
        except (CalibrationError, PromptError) as e:
            failed = e
    with warnings.catch_warnings():
        if failed is not None:
            warnings.simplefilter("ignore")                    # said below, with the size that runs
        g, g_source = default_draft_size(cfg, model, calibration=source, with_source=True)
    if here and g_source == "default" and next(model.parameters()).device.type == "cpu":
        g = min(g, bucket_edge(cfg, model, FALLBACK_DRAFT_SIZE["cpu"]))     # never a GPU-sized tree on a CPU
    if failed is not None:
        warnings.warn(f"{label}: no calibrated draft size, and none could be measured on the spot ({failed}); using "
                      f"g = {g}, the uncalibrated default (on a CPU at most its {FALLBACK_DRAFT_SIZE['cpu']}-node "
                      f"tree) — make one with `{calibrate_command(cfg, model)}`", stacklevel=3)
    return g, g_source


def _calibrate_merge_sources(cfg, model, tokenizer, info, eos, show, label):
    """A merged run shares its node budget by each source's acceptance profile, read from that source's
    calibration record (`engine.drafters.merged.calibrated_profile`): reading this machine's cache, a source with
    no record is calibrated on the spot first (a head that does not ship is left to the drafter, which names it)."""
    records = calibration_source().records
    for name in parse_sources(cfg.merge_sources):
        sub = source_config(cfg, name, model).replace(draft_size=None)
        if getattr(sub, {"eagle": "eagle_head", "eagle3": "eagle3_head"}.get(name, "method")) is None:
            continue
        if model_key(model, sub) not in records:
            try:
                calibrate_here(model, sub, tokenizer=tokenizer, info=info, eos_ids=eos, show=show,
                               label=f"{label}: source {name}")
            except (CalibrationError, PromptError) as e:
                warnings.warn(f"{label}: source {name} has no calibrated acceptance profile and none could be "
                              f"measured on the spot ({e}); its share starts from the uncalibrated prior",
                              stacklevel=3)


def spot_grid(cfg: SpecConfig, model) -> list[int]:
    """The draft sizes an on-the-spot calibration measures: `SPOT_GRIDS` of the device type, without the sizes
    the method and the target do not allow (`engine.measure.calibration_grid`), each raised to its row bucket's
    edge (`engine.harness.bucket_edge`: the largest tree at that forward's cost), once each."""
    kind = "cuda" if next(model.parameters()).device.type == "cuda" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                         # points above the cap: dropped, said by no one
        sizes = calibration_grid(cfg, model, SPOT_GRIDS[kind])
    return sorted({bucket_edge(cfg, model, g) for g in sizes})


def knee(rows: list[dict], ar_s_forward: float) -> int:
    """The largest measured g whose tree forward pays for itself: verify(g) / verify(1) <= tau(g), the forward's
    cost over ar's one-token forward against the tokens a step commits (drafting taken as free); the smallest g
    where none does. rows: `measure` rows with g, tau, s_forward (seconds)."""
    paying = [r["g"] for r in rows if r["s_forward"] / ar_s_forward <= r["tau"]]
    return int(max(paying)) if paying else int(min(r["g"] for r in rows))


def calibrate_here(model, cfg: SpecConfig, run: SpecConfig | None = None, *, tokenizer=None, info=None, eos_ids=(),
                   prompts=None, grid=None, save: bool = True, show: bool = True, label: str | None = None) -> dict:
    """Calibrate cfg's draft size on the spot, in seconds: ar and the drafter at each size of `spot_grid` on
    `SPOT_PROMPTS` training-corpus prompts (`engine.measure.calibration_prompts`, never an evaluation set) of
    `SPOT_NEW_TOKENS` new tokens each (the shortest of the pool: a prefill is no part of s(g)), interleaved (`engine.measure.round_robin`). The forward's cost
    verify(g) / verify(1) is each size's tree forward over ar's one-token forward; the drafter's acceptance
    profile is tau(g). g* is the default pipeline's fit (`engine.calibration.fit_record`) over the sizes at or
    below the `knee` - the largest g whose forward pays for itself - so it never exceeds the knee.

    cfg: the config keyed (`engine.calibration.model_key`), run: the config measured (default cfg; its
    vocabulary list or fit resolved). prompts / grid: instead of the training corpus's and `spot_grid`'s.
    save: cache the record (`engine.calibration.cache_file()`), where later runs find it. show: say so in one
    line. Returns the record: calibrate's fields plus `knee`, `ar` (ar's measurement), `on_the_spot`."""
    t0 = time.perf_counter()
    base = cfg.replace(draft_size=None)
    run = (run or cfg).replace(max_new_tokens=SPOT_NEW_TOKENS, draft_size=None)
    label = label or cfg.method
    if prompts is None:
        if info is None:
            raise CalibrationError("the model's tokenizer info is needed for training-corpus prompts — pass info= "
                                   "(what load_model returns)")
        prompts, _ = calibration_prompts(tokenizer, info, n=SPOT_PROMPTS, warmup=0, max_new_tokens=SPOT_NEW_TOKENS,
                                         shortest=True)
    sizes = sorted({int(g) for g in grid}) if grid is not None else spot_grid(base, model)
    ar = SpecConfig.preset("ar", max_new_tokens=SPOT_NEW_TOKENS,
                           **{f: getattr(run, f) for f in (*TARGET, *SAMPLING)})
    vocab = model.get_output_embeddings().weight.shape[0]
    store = store_of(model, run, vocab)
    run_prompts(model, prompts[:1], run.replace(draft_size=sizes[len(sizes) // 2]), eos_ids=eos_ids)   # warm-up
    cfgs = {0: ar, **{g: run.replace(draft_size=g) for g in sizes}}
    runs = round_robin(model, prompts, cfgs, store=store, eos_ids=eos_ids, progress=False, desc="on the spot")
    ar_row = summarise(runs.pop(0))
    rows = [{"g": g, **summarise(r)} for g, r in runs.items()]
    for r in rows:
        r["verify_ratio"] = r["s_forward"] / ar_row["s_forward"]
    k = knee(rows, ar_row["s_forward"])
    p = next(model.parameters())
    key = model_key(model, base)
    record = {"key": key, "model": model_id(model), "device": device_name(p.device),
              "dtype": str(p.dtype).replace("torch.", ""), "method": cfg.method, "config": calibration_fields(base),
              "fingerprint": config_fingerprint(base), "kernel_build": kernel_build(model, base), "rows": rows,
              "ar": ar_row, "knee": k, "on_the_spot": True, "prompts": len(prompts), "repeats": 1,
              "code": code_stamp(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}
    record.update(fit_record({"rows": [r for r in rows if r["g"] <= k]}, "default"))
    record["g_star"] = min(bucket_edge(base, model, record["g_star"]), k)
    record["wallclock_s"] = time.perf_counter() - t0
    path = save_calibration(key, record) if save else None
    if show:
        where = f"cached in {path}" if path else "not cached"
        print(f"[specvocab] {label}: no calibrated draft size for this model, device, dtype, config and kernel build "
              f"({record['kernel_build']}); calibrated on the spot in {record['wallclock_s']:.1f} s on "
              f"{len(prompts)} training-corpus prompts: g = {record['g_star']} (trees pay up to g = {k}), {where}",
              flush=True)
    return record

