"""Speed and losslessness of decoding methods on a prompt set: `python -m specvocab.engine.jobs.bench` / `run_bench(...)`.

    python -m specvocab.engine.jobs.bench --model smollm2-135m-instruct --methods ar,pld,hf-prompt-lookup \\
        --prompts spec_bench --per-category 1 --max-new-tokens 64 --repeats 1 --out runs/bench
    python -m specvocab.engine.jobs.bench --model gemma-3-270m --methods ar --drafter layerskip \\
        --vocab full,frspec,frspec:1024,microspec,oracle --set drafter_layers=first:4 --threads 1 --out runs/microspec
    python -m specvocab.engine.jobs.bench --model gemma-3-270m --drafter eagle --vocab full,frspec,dynaspec,microspec \\
        --set eagle_head=<EAGLE-1/2 head dir> --per-category 1 --max-new-tokens 64 --threads 1 --out runs/table2

A *run* is one (method, vocabulary policy) pair: every `--methods` entry (policy "full" for methods without
an LM head), plus, with `--drafter layerskip|eagle|eagle3`, the drafter once per `--vocab` entry (`engine.vocab`;
`ar` is added as the speed and lossless reference). Every run of the drafter uses the same head: eagle's
`eagle_head` (`--set eagle_head=DIR|hub id|random`; None = the drafter's own default) or layerskip's
`drafter_layers`. A policy may carry a size, `name:N`:

    frspec:K      K = the FR-Spec shortlist (top-K of the frequency list)
    microspec:W   W = w_max, the window over the candidate stream
    dynaspec:N    N = a token budget: the shortlist of a row at draft steps 0-1 holds about N tokens. DynaSpec's
                  own knob is k_max, a number of clusters (§4.2); N sets k_max = round(N * M / V), the clusters
                  of the mean size V / M that hold N tokens (at least 1, at most all M; M and V read from the
                  fitted file, `engine.vocab.dynaspec.k_max_for_tokens`), and the position-aware budget shrinks it
                  after step 1. So dynaspec:N is to the first draft steps what frspec:N is to every step; the
                  shortlist it really had is `mean_active_vocab`. `--set dynaspec_k_max=K` sets clusters directly.

Columns: `policy` (full | frspec | microspec | oracle | dynaspec), `vocab_size` (the requested size - frspec's
K, microspec's and oracle's w_max, dynaspec's N, or for an unsized dynaspec the tokens its k_max stands for,
round(k_max * V / M); null for full) and `run`, the `--vocab` label as given (`frspec:1024`), so several sizes
of one policy bench side by side. `dynaspec_k_max` is the k_max a dynaspec run used (null otherwise),
`vocab_file` the frspec ranking or fitted DynaSpec it read, `draft_head` the drafter's head (eagle's / eagle3's
checkpoint, `random`, or the shipped head's `specvocab:<model>`; layerskip: `drafter_layers`). Every run is
resolved once, before any prompt (`engine.resolve.resolve_run`), and its rows say where each choice came from:
`draft_size` is the run's draft size, `draft_size_source` its source ("config": `--set draft_size=N`;
"calibration-cache:<sha8>": this machine's calibration cache, sha8 the first 8 hex digits of its file's SHA-256;
"on-the-spot": no record there, so calibrated before the bench, in seconds, and cached; "default": the method's
uncalibrated default; in a sweep also "calibrate-cell" and "calibration-file:<sha8>"); `draft_head_source`,
`vocab_file_source`, `vocab_size_source` one of given, shipped, fitted, default; `kernel_build` the build that
decoded (`engine.calibration.kernel_build`) and `kernel_build_source` (given by `$SPECVOCAB_CPU_ISA`, else
default). `g` is the mean draft tokens per step a run actually proposed. `frspec` without `--set
frequency_file=...` counts a default ranking on the training corpus (`engine.vocab.frspec_lists`, cached) and
says which; `dynaspec` without `--set dynaspec_file=...` takes the newest fit for this head and drafter
(`engine.vocab.dynaspec.find_fitted`).

Writes `OUT/results.parquet`, one row per (method, run, prompt, turn, repeat) - `prompt_id` is the prompt
set's id, `turn` counts from 1 (MT-Bench prompts have two turns, each run answering the second turn after
its own first answer) - rewritten after every finished prompt so a crash loses nothing finished (`--resume`
skips the runs there: key `RUN_KEY`; a file in an older column layout is refused). Per row, besides the
harness' timings: the drafter's phases `backbone_s, router_s, gather_s, lm_head_s, tree_s` (summed over the
prompt, null for drafters without phases; `router` is DynaSpec's router, 0 for other policies),
`draft_prefill_s` (the drafter's pass over the prompt, no step's), `uncharged_s` (the oracle policy's full
head, which it does not charge), and the policy's `mean_active_vocab`, `max_active_vocab`, `draft_coverage`,
`bonus_coverage` (`VocabPolicy.stats`), `mean_union_vocab` (dynaspec: rows of the head read per call, the
union of a level's shortlists; its `mean_active_vocab` is the per-row shortlist, the paper's "vocab size"),
and `score_bins_proposed`, `score_bins_accepted`: draft nodes proposed and accepted per confidence-score bin
(`engine.harness.SCORE_BINS` equal bins over [0, 1], bin b = [b/20, (b+1)/20), 1.0 in the last; UniSpec Fig. 3).
What was compared rides on every row too: `model`, `device`, `dtype`, `threads`, `max_new_tokens`, `temperature`.

Every greedy row is checked against ar's row of the same (prompt_id, turn, repeat) as the bench goes
(`engine.divergence`): `verdict` "exact" (same tokens), "near-tie" (differs, where ar's top two logits were
within rounding of the run's dtype: `engine.divergence.near_tie_bound`) or "mismatch" (differs with a clear
margin: a bug); for a differing row `first_divergence` (the first differing index into the new tokens),
`ar_margin` (ar's token's logit minus the best other there, from one prefill over prompt + ar's tokens up to
it, through ar's backend: only differing rows pay that forward), `ar_gap` (ar's token's logit minus the
method's) and `prompt_differs` (a later turn after a diverged one: not compared, the earlier turn's verdict).
Rows benched without ar in the same call (a sweep's cells) are diagnosed afterwards with `diagnose`.

`tokens_per_s` = new_tokens / (wall_s - uncharged_s) (= new_tokens / wall_s except for oracle rows). `begin_s`
is the drafter's pass over the prompt (`Drafter.begin`: EAGLE's backbone over the prompt, UniSpec's store fill
from the prefill logits, MicroSpec's first window), part of `draft_s`; with `prefill_s` it is what the
decode-phase measures (`decode_tokens_per_s`, `decode_speedup` in `engine.metrics`) leave out.

Then prints (`print_summary`) what was compared (model, device, dtype, threads, prompts, tokens, each
drafter's head and runs), MicroSpec Table 2's layout (a row per run: tokens/s per task - the category, or the
language of a set split by language - then over all rows tokens/s with its speedup over ar, tau and lossless),
a compact table per task and the overall block, per run: tokens/s, speedup over ar (overall with its 95%
bootstrap interval over the prompt turns, speedup_lo / _hi, and the decode phase's), tau (bonus token included;
ar = 1.00), mean_active_vocab, the draft time per drafted step in ms and its split by phase, draft_coverage and
`lossless` (greedy only): "exact" if every output of the run equals `ar`'s, else "mismatch" if any row is a
mismatch, else "near-tie". Each measure is defined once, in `engine.metrics` (its docstring: the formulas,
e.g. draft_ms = sum (draft_s - begin_s - uncharged_s) / sum (steps - 1); `summarize`). Last, for a
drafter benched with several policies, one line per pair measured in this run (`compare_vocabs`): every other
policy against `full`, microspec against frspec and dynaspec, and dynaspec against frspec: draft-time ratio,
tau ratio and tokens/s ratio, with the papers' claims as targets; and for every output that differs from ar's a
line: run, prompt_id, turn, first divergent token, ar's margin there, verdict (`divergence_lines`).

`run_bench(**kwargs)` is what the CLI calls and what a Ray sweep cell calls: one call per cell.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import polars as pl
import torch
from tqdm.auto import tqdm

from specvocab.engine.artifacts import atomic_write
from specvocab.engine.config import POLICIES, REQUESTED_SIZE, ConfigError, SpecConfig, parse_overrides
from specvocab.engine.divergence import diagnose_rows, next_logits
from specvocab.engine.drafters import available_methods, make_drafter
from specvocab.engine.calibration import CalibrationSource
from specvocab.engine.harness import generate
from specvocab.engine.resolve import ResolvedRun, resolve_run
from specvocab.engine.models import eos_token_ids, load_model
from specvocab.engine.prompts import Prompt, decode_answer, encode_prompt, load_prompts
from specvocab.engine.target import backend_label
from specvocab.engine.jobs.args import add_debug, check_at_least, check_model, check_out, debugging, run_main
from specvocab.engine.specbench import tokenizer_decoder, write_answer_files
from specvocab.engine.metrics import (ALL, DRAFTERS, PHASES, ROW_SCHEMA, RUN, compare_vocabs, comparison_lines,  # noqa: F401
                            describe_bench, divergence_lines, divergences, policy, row_verdicts, summarize, table2)
from specvocab.kernels.hardware import HardwareError, parse_device, parse_dtype

RESULTS_FILE = "results.parquet"
RUN_KEY = ("method", "run", "prompt_id", "repeat")
DIAGNOSIS = ("verdict", "first_divergence", "ar_margin", "ar_gap", "prompt_differs")   # `diagnose`'s columns
LABEL_SIZE = {"frspec": "frspec_k", "microspec": "w_max"}  # the field N in `--vocab name:N` sets
SIZED = (*LABEL_SIZE, "dynaspec")                          # policies that take `name:N`


class BenchError(ValueError):
    """A bench argument is unusable; the message says which and what to pass instead."""


class RunsFailed(BenchError):
    """Some runs failed while the bench went on: raised after every other run's rows were written and summarised.
    `frame`: the rows that were benched; `failures`: one line per failed run (method, run label, cause)."""

    def __init__(self, frame: pl.DataFrame, failures: list[str]):
        self.frame, self.failures = frame, failures
        super().__init__(f"{len(failures)} run(s) failed, the others' rows were kept: " + "; ".join(failures))


@dataclass(frozen=True)
class Run:
    """One benched configuration: a method with one draft vocabulary policy ("full" for methods without a
    head). `label`: the `--vocab` entry as given ("frspec:1024"), the `run` column. `size`: dynaspec's token
    budget - N of `dynaspec:N`, or once the model is loaded the tokens its k_max stands for. `resolved`: the
    run's one resolution (`engine.resolve.resolve_run`, once the model is loaded): `cfg` is then its config."""

    method: str
    label: str
    cfg: SpecConfig
    size: int | None = None
    resolved: ResolvedRun | None = None

    @property
    def draft_head(self) -> str | None:
        """The drafter's head (eagle's / eagle3's checkpoint, layerskip's `drafter_layers`), once resolved."""
        return None if self.resolved is None else self.resolved.head

    @property
    def draft_size_source(self) -> str | None:
        """Where draft_size came from (`engine.resolve.ResolvedRun.draft_size_source`), once resolved."""
        return None if self.resolved is None else self.resolved.draft_size_source

    @property
    def policy(self) -> str:
        return self.cfg.vocab if self.method in DRAFTERS else "full"

    @property
    def vocab_size(self) -> int | None:
        """The requested vocabulary size (frspec's K, microspec's / oracle's w_max, dynaspec's token budget);
        None for full."""
        if self.policy == "dynaspec":
            return self.size
        field = REQUESTED_SIZE.get(self.policy)
        return None if field is None else int(getattr(self.cfg, field))

    @property
    def vocab_file(self) -> str | None:
        """The file the policy reads: frspec's ranking, dynaspec's fit (None until resolved)."""
        return {"frspec": self.cfg.frequency_file, "dynaspec": self.cfg.dynaspec_file}.get(self.policy)


def _names(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    return [m.strip() for m in (value.split(",") if isinstance(value, str) else value) if m.strip()]


def _methods(methods: str | Sequence[str]) -> list[str]:
    names = _names(methods)
    if not names:
        raise BenchError("no methods given — pass e.g. --methods ar,pld")
    have = available_methods()
    missing = [m for m in names if m not in have]
    if missing:
        raise BenchError(f"method(s) {missing} cannot run yet (no drafter registered) — available: {have}")
    return list(dict.fromkeys(names))


def parse_vocab(label: str) -> tuple[dict, int | None]:
    """A --vocab entry -> (SpecConfig fields, dynaspec's token budget or None): "microspec" ->
    ({vocab: microspec}, None); sized variants "frspec:1024" -> ({vocab: frspec, frspec_k: 1024}, None),
    "microspec:1024" -> ({vocab: microspec, w_max: 1024}, None), "dynaspec:4096" -> ({vocab: dynaspec},
    4096) - N tokens at draft steps 0-1, turned into k_max once the fitted file is known (module docstring).
    The label stays the run's `run` column, so several sizes of one policy bench side by side."""
    name, sep, size = label.partition(":")
    if not sep:
        return {"vocab": name}, None
    if name not in SIZED:
        raise BenchError(f"--vocab {label!r}: only {list(SIZED)} take a size (name:N)")
    if not size.isdigit() or int(size) <= 0:
        raise BenchError(f"--vocab {label!r}: the size after ':' must be a positive integer, e.g. {name}:1024")
    if name == "dynaspec":
        return {"vocab": name}, int(size)
    return {"vocab": name, LABEL_SIZE[name]: int(size)}, None


def plan_runs(methods: str | Sequence[str] | None, drafter: str | None = None,
              vocab: str | Sequence[str] | None = None, config: dict | None = None) -> list[Run]:
    """The runs of a bench: each of `methods` (default: ar,pld,hf-prompt-lookup; just ar with a drafter) with
    the vocab its config says, then `drafter` once per `vocab` policy (default full); ar is added when a
    drafter is benched without it. `config`: SpecConfig fields for every run."""
    config = dict(config or {})
    vocabs = _names(vocab)
    if drafter is None and vocabs:
        raise BenchError(f"--vocab {','.join(vocabs)} needs --drafter: the vocabulary policies restrict a "
                         f"drafter's LM head — pass --drafter {' or --drafter '.join(DRAFTERS)}")
    if drafter is not None and drafter not in DRAFTERS:
        raise BenchError(f"unknown drafter {drafter!r} — --drafter takes one of {list(DRAFTERS)} (drafters with an "
                         f"LM head; other methods go in --methods)")
    bad = [v for v in vocabs if policy(v) not in POLICIES]
    if bad:
        raise BenchError(f"unknown vocab(s) {bad} — --vocab takes a comma list of {list(POLICIES)}, "
                         f"optionally sized: frspec:K (top-K shortlist), microspec:W (w_max) or dynaspec:N "
                         f"(about N tokens per row at draft steps 0-1)")
    # eagle's head (`eagle_head`, None = the drafter's default) is checked by building the drafter once the
    # model is loaded (`_check_drafter`): the drafter knows which heads it has, not the plan
    if methods is None or (isinstance(methods, str) and not methods.strip() and drafter is not None):
        methods = "ar" if drafter is not None else "ar,pld,hf-prompt-lookup"
    names = _methods(methods)
    if drafter is not None and "ar" not in names:
        names = ["ar", *names]                                   # the speed and lossless reference
    try:
        runs = []
        for m in names:
            cfg = SpecConfig.preset(m, **config)
            runs.append(Run(m, cfg.vocab if m in DRAFTERS else "full", cfg))
        for v in (vocabs or ["full"]) if drafter is not None else []:
            fields, tokens = parse_vocab(v)
            runs.append(Run(drafter, v, SpecConfig.preset(drafter, **{**config, **fields}), size=tokens))
    except ConfigError as e:
        raise BenchError(f"bad configuration: {e}") from e
    unique: dict[tuple[str, str], Run] = {}
    for r in runs:
        unique.setdefault((r.method, r.label), r)               # --methods layerskip + --vocab full: once
    return list(unique.values())


def _write(frame: pl.DataFrame, path: Path) -> None:
    atomic_write(path, frame.write_parquet)                      # the file at `path` is always complete


def _frame(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame([{k: r.get(k) for k in ROW_SCHEMA} for r in rows], schema=ROW_SCHEMA)


def _drafter_columns(res) -> dict:
    """The drafter's phases (seconds over the prompt) and its policy's statistics, for one row."""
    t, st = res.drafter_timings, res.drafter_stats
    out = {f"{p}_s": (float(t.get(p, 0.0)) if t else None) for p in PHASES}
    out["draft_prefill_s"] = float(t.get("draft_prefill", 0.0)) if t else None
    out["uncharged_s"] = float(t.get("oracle_uncharged", 0.0))
    out.update(mean_active_vocab=st.get("mean_active_vocab"), max_active_vocab=st.get("max_active_vocab"),
               mean_union_vocab=st.get("mean_union_vocab"), draft_coverage=st.get("coverage"),
               bonus_coverage=st.get("bonus_coverage"))
    out.update({c: int(st[c]) for c in ROW_SCHEMA if c.startswith("accepted_by_") and c in st})   # merged's sources
    return out


def _resolve(run: Run, loaded, eos, calibration: CalibrationSource | None, size_source: str | None,
             show: bool) -> Run:
    """The run with its one resolution (`engine.resolve.resolve_run`: head, FR-Spec list or DynaSpec fit and
    size, draft size, kernel build); a ValueError (no head, no fit, no list) becomes a BenchError naming the run."""
    target, tokenizer, info = loaded
    try:
        res = resolve_run(run.cfg, target, tokenizer=tokenizer, info=info, eos_ids=eos, calibration=calibration,
                          draft_size_source=size_source, vocab_tokens=run.size, show=show,
                          label=f"{run.method} {run.label}")
    except ValueError as e:                                      # DynaSpecError, FrequencyError, ConfigError, ...
        raise BenchError(f"{run.method} {run.label}: {e}") from e
    size = res.vocab_size if run.policy == "dynaspec" else run.size
    return replace(run, cfg=res.cfg, size=size, resolved=res)


def _check_drafter(run: Run, target) -> Run:
    """Build the run's drafter once, from its resolved config, before any prompt runs: a missing or mismatched
    head, ranking or fit fails here, named, not after the first prompts. Each prompt still builds its own
    drafter, as `generate` does."""
    try:
        make_drafter(target, run.cfg)
    except ValueError as e:                                      # DrafterError, VocabError, DynaSpecError, ...
        raise BenchError(f"{run.method} {run.label}: {e}") from e
    return run


def run_bench(model: str = "smollm2-135m-instruct", methods: str | Sequence[str] | None = None,
              prompts: str = "spec_bench", *, drafter: str | None = None, vocab: str | Sequence[str] | None = None,
              per_category: int | None = None, categories: Sequence[str] | None = None,
              languages: Sequence[str] | None = None, max_new_tokens: int = 128, repeats: int = 1,
              warmup: int = 1, out: str | Path | None = None, temperature: float = 0.0, top_p: float = 1.0,
              seed: int = 0, device: str | None = None, dtype=None, threads: int | None = None,
              config: dict | None = None, loaded=None, resume: bool = False, progress: bool = True,
              show: bool = True, calibration: CalibrationSource | None = None,
              draft_size_source: str | None = None) -> pl.DataFrame:
    """Run every run (see `plan_runs`) on every prompt `repeats` times; returns (and writes) one row per run,
    prompt, turn and repeat.

    model: a name for `load_model`, or pass `loaded=(model, tokenizer, info)` to reuse a loaded one.
    methods: default ar,pld,hf-prompt-lookup, or just ar with a drafter. drafter: layerskip | eagle | eagle3, benched
    once per `vocab` (comma list of full, frspec, microspec, oracle, dynaspec, sized as frspec:K, microspec:W,
    dynaspec:N - module docstring; default full), every run on the same head (config's eagle_head or
    drafter_layers).
    threads: torch.set_num_threads for the bench (restored afterwards); recorded per row.
    device / dtype: for `load_model` (None: `kernels.hardware`'s defaults; strings as `--dtype`).
    config: further SpecConfig fields for every run (e.g. {"draft_size": 5, "drafter_layers": "first:4"}).
    calibration: where a run without draft_size looks up its g* (default this machine's calibration cache, and
    with no record there it is calibrated on the spot and cached: `engine.resolve.calibrate_here`;
    `engine.calibration.NO_CALIBRATION`: the method's uncalibrated default); every row's `draft_size_source`
    says which ("config", "calibration-cache:<sha8>", "calibration-file:<sha8>", "on-the-spot", "default").
    draft_size_source: the label of a draft size `config` sets (default "config"; a sweep's "calibrate-cell").
    Each run is resolved once (`engine.resolve.resolve_run`) before any prompt; its provenance rides on every
    row (`engine.resolve.COLUMNS`).
    """
    if repeats < 1 or warmup < 0:
        raise BenchError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BenchError(f"threads must be an int >= 1, got {threads!r}")
    config = dict(config or {})
    runs = plan_runs(methods, drafter, vocab, {**config, "max_new_tokens": max_new_tokens,
                                               "temperature": temperature, "top_p": top_p, "seed": seed})
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(runs, model, prompts, per_category=per_category, categories=categories, languages=languages,
                      max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup, out=out, device=device,
                      dtype=dtype, loaded=loaded, resume=resume, progress=progress, show=show,
                      calibration=calibration, draft_size_source=draft_size_source)
    finally:
        torch.set_num_threads(old_threads)


def _bench(runs: list[Run], model, prompts, *, per_category, categories, languages, max_new_tokens, repeats,
           warmup, out, device, dtype, loaded, resume, progress, show, calibration=None,
           draft_size_source=None) -> pl.DataFrame:
    # the prompts first: an unknown set, a bad filter or a missing data root stops the bench before a model loads
    prompt_list = load_prompts(prompts, per_category=per_category, categories=categories, languages=languages)
    if not prompt_list:
        raise BenchError(f"prompt set {prompts!r} with these filters is empty")
    if loaded is None:
        try:
            device, dtype = parse_device(device), parse_dtype(dtype)
        except HardwareError as e:
            raise BenchError(str(e)) from None
        loaded = load_model(model, device=device, dtype=dtype)
    target, tokenizer, info = loaded
    param = next(target.parameters())
    dev, dtype_name = str(param.device), str(param.dtype).removeprefix("torch.")
    eos = eos_token_ids(target, tokenizer)
    # each run resolved once, here (engine.resolve): the decode below looks nothing up
    runs = [_resolve(r, loaded, eos, calibration, draft_size_source, show) for r in runs]
    runs = [_check_drafter(r, target) if r.method in DRAFTERS else r for r in runs]

    path = None if out is None else Path(out) / RESULTS_FILE
    rows: list[dict] = []
    done: set[tuple] = set()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.exists():
            old = pl.read_parquet(path)
            missing = [c for c in (*RUN_KEY, "policy", "vocab_size", "turn") if c not in old.columns]
            if missing or "question_id" in old.columns:
                raise BenchError(f"cannot resume {path}: it was written by an older engine.jobs.bench (columns "
                                 f"question_id / vocab, turns from 0; missing {missing}) — bench into a new "
                                 f"--out folder, or delete the file to start over")
            rows = old.to_dicts()
            done = {tuple(str(r[k]) for k in RUN_KEY) for r in rows}

    def run_turns(p, run: Run, repeat: int, cfg: SpecConfig, limit: int | None = None) -> list[dict]:
        outputs, got = [], []
        for turn in range(1, len(p.turns) + 1):                 # MT-Bench's "turn 1", "turn 2"
            # each turn after this run's own earlier answers (`turn_prompt`; `diagnose` rebuilds it alike)
            ids = turn_prompt(tokenizer, info, p, turn, outputs, cfg.max_new_tokens, eos)
            res = generate(target, ids, cfg.replace(seed=cfg.seed + repeat), tokenizer=tokenizer, info=info,
                           eos_ids=eos)
            outputs.append(res.output_ids.tolist())
            extra = _drafter_columns(res)
            got.append({
                "model": info.name, "device": dev, "dtype": dtype_name,
                "backend": backend_label(target, cfg.backend, cfg.fixed_shape, cfg.compile,
                                         cfg.cuda_graphs, cfg.cpu_kernels), "method": run.method, "run": run.label,
                "policy": run.policy, "vocab_size": run.vocab_size,
                "dynaspec_k_max": cfg.dynaspec_k_max if run.policy == "dynaspec" else None,
                "draft_head": run.draft_head, "vocab_file": run.vocab_file, "draft_size": cfg.draft_size,
                **run.resolved.columns(),
                "max_new_tokens": cfg.max_new_tokens, "prompt_set": p.prompt_set, "prompt_id": str(p.prompt_id),
                "category": p.category, "language": p.language, "turn": turn, "repeat": repeat,
                "prompt_tokens": len(ids),
                "new_tokens": res.new_tokens, "steps": res.steps, "tau": res.tau, "g": res.g, "wall_s": res.wall_s,
                "prefill_s": res.prefill_s, "draft_s": res.draft_s, "verify_s": res.verify_s,
                "begin_s": res.begin_s,
                "tokens_per_s": res.new_tokens / (res.wall_s - extra["uncharged_s"]), **extra,
                "threads": torch.get_num_threads(), "stop_reason": res.stop_reason,
                "temperature": cfg.temperature, "seed": cfg.seed + repeat, "output_ids": res.output_ids.tolist(),
                "score_bins_proposed": res.score_bins_proposed, "score_bins_accepted": res.score_bins_accepted,
                "step_sizes": res.step_sizes})
            if limit is not None:
                break
        return got

    failed: dict[tuple[str, str], str] = {}                     # (method, run label) -> one line: what failed

    def attempt(run: Run, p: Prompt, call) -> list[dict]:
        # a run that raises is reported in one line and skipped from then on; the other runs go on
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - any failure of one run; the bench raises RunsFailed at the end
            cause = (str(e).strip().splitlines() or [""])[0]
            failed[(run.method, run.label)] = line = (f"{run.method} {run.label} failed on prompt {p.prompt_id}: "
                                                      f"{type(e).__name__}: {cause}")
            print(f"[specvocab] bench: {line}; its other prompts are skipped, the other runs go on",
                  file=sys.stderr, flush=True)
            if debugging():
                traceback.print_exc()
            return []

    first = prompt_list[0]
    for _ in range(warmup):                                      # untimed: first calls allocate and compile
        for run in runs:
            if (run.method, run.label) not in failed:
                attempt(run, first, lambda: run_turns(first, run, 0, run.cfg.replace(
                    max_new_tokens=min(16, max_new_tokens)), limit=1))

    todo = [(p, r, run) for p in prompt_list for r in range(repeats) for run in runs
            if (run.method, run.label, str(p.prompt_id), str(r)) not in done]
    # ar's margin where an output parted from ar's is measured with ar's own backend, outside every timing
    ar_cfg = next((run.cfg for run in runs if run.method == "ar"), runs[0].cfg)
    if rows:                                                     # --resume: a file from before the diagnosis
        _diagnose_rows(rows, loaded, prompt_list, ar_cfg, eos, only_missing=True)
    for p, r, run in tqdm(todo, desc=f"bench {info.name}", unit="run", disable=not progress):
        if (run.method, run.label) in failed:
            continue
        got = attempt(run, p, lambda: run_turns(p, run, r, run.cfg))
        if not got:
            continue
        rows.extend(got)
        # rows without a verdict whose ar row is there now (ar may run after a method, or come from --resume);
        # rows equal to ar's cost a list comparison, only differing ones a forward
        _diagnose_rows(rows, loaded, prompt_list, ar_cfg, eos, only_missing=True)
        if path is not None:
            _write(_frame(rows), path)
    frame = _frame(rows)
    if show and rows:
        print_summary(frame)
    if failed:
        raise RunsFailed(frame, list(failed.values()))
    return frame


def turn_prompt(tokenizer, info, p: Prompt, turn: int, earlier_outputs: Sequence[Sequence[int]],
                max_new_tokens: int, eos: Sequence[int]) -> list[int]:
    """The prompt ids of `p`'s turn `turn` (from 1) after a run's own answers to its earlier turns (their
    output ids, decoded as FR-Spec feeds them into the next turn: `decode_answer`)."""
    answers = [decode_answer(tokenizer, list(o), eos) for o in earlier_outputs]
    return encode_prompt(tokenizer, info, p.turns[:turn], answers, max_new_tokens=max_new_tokens,
                         system_prompt=p.system_prompt, name=p.name)


def _diagnose_rows(rows: list[dict], loaded, prompt_list: Sequence[Prompt], cfg: SpecConfig, eos,
                   only_missing: bool) -> int:
    """`engine.divergence.diagnose_rows` on bench rows with this model: prompts rebuilt by `turn_prompt` from
    the prompt set's `Prompt`s, logits from one prefill through `cfg`'s backend (ar's)."""
    target, tokenizer, info = loaded
    by_id = {str(p.prompt_id): p for p in prompt_list}

    def prompt_ids(row: dict, earlier: list[list[int]]) -> list[int] | None:
        p = by_id.get(str(row["prompt_id"]))
        if p is None or int(row["turn"]) > len(p.turns):
            return None                                          # not this prompt set's prompt: undiagnosed
        return turn_prompt(tokenizer, info, p, int(row["turn"]), earlier, int(row.get("max_new_tokens") or 0), eos)

    dtype = str(next(target.parameters()).dtype)
    logits = (lambda ids: next_logits(target, ids, backend=cfg.backend, fixed_shape=cfg.fixed_shape,
                                      rows=cfg.verify_rows))
    return diagnose_rows(rows, prompt_ids=prompt_ids, next_logits=logits, dtype=dtype, only_missing=only_missing)


def diagnose(frame: pl.DataFrame, loaded, prompts: str | Path | Sequence[Prompt] | None = None, *,
             config: dict | None = None) -> pl.DataFrame:
    """`frame` (bench rows, e.g. a results.parquet) with `verdict`, `first_divergence`, `ar_margin`, `ar_gap` and
    `prompt_differs` diagnosed afresh against its ar rows (`engine.divergence`): one prefill forward of
    `loaded`'s target per row that differs from ar's, none for equal rows. `run_bench` does this as it goes;
    call it for rows benched without their ar run in the same call (a sweep's cells) or edited by hand.

    loaded: (model, tokenizer, info) of the model the rows were benched with. prompts: the prompt set (name or
    .jsonl path) or its `Prompt`s, to rebuild each turn's prompt (default: each `prompt_set` of the rows).
    config: SpecConfig fields for ar's forward (backend, fixed_shape, verify_rows; default SpecConfig's)."""
    target, tokenizer, _ = loaded
    try:
        if prompts is None:
            sets = frame["prompt_set"].drop_nulls().unique(maintain_order=True).to_list() \
                if "prompt_set" in frame.columns else []
            prompt_list = [p for name in sets for p in load_prompts(name)]
        elif isinstance(prompts, (str, Path)):
            prompt_list = load_prompts(str(prompts))
        else:
            prompt_list = list(prompts)
    except ValueError as e:                                      # PromptError: an unknown set or a bad file
        raise BenchError(f"diagnose cannot rebuild the rows' prompts: {e} — pass prompts= (the prompt set's name "
                         f"or the .jsonl file the bench read)") from e
    try:
        cfg = SpecConfig.preset("ar", **(config or {}))
    except ConfigError as e:
        raise BenchError(f"bad configuration: {e}") from e
    rows = frame.to_dicts()
    _diagnose_rows(rows, loaded, prompt_list, cfg, eos_token_ids(target, tokenizer), only_missing=False)
    # the frame's other columns kept as they are (a sweep's hive columns too); these five set or added
    return frame.with_columns([pl.Series(c, [r.get(c) for r in rows], dtype=ROW_SCHEMA[c]) for c in DIAGNOSIS])


# --- printing (the summaries are engine.metrics') ------------------------------------------------------

def print_summary(frame: pl.DataFrame) -> pl.DataFrame:
    """Prints what was compared (`engine.metrics.describe_bench`), MicroSpec Table 2's layout (`table2`), a
    compact table per task (a row per run: tokens/s, speedup, tau, mean active vocab, draft ms per drafted step
    and its phases, lossless), the overall block (ALL) with every column, and the policy comparisons
    (`compare_vocabs`). Phase columns no run spent time in, and columns no run has, are left out. Returns
    `engine.metrics.summarize`'s table."""
    full = summarize(frame)
    num = ["tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "decode_speedup", "decode_speedup_lo",
           "decode_speedup_hi", "tau", "g", "draft_ms", *[f"{p}_ms" for p in PHASES]]
    table = full.with_columns(pl.col(num).round(2), pl.col("mean_active_vocab", "mean_union_vocab").round(0),
                              pl.col("draft_coverage").round(3))
    phases = [f"{p}_ms" for p in PHASES if (full[f"{p}_ms"].fill_null(0.0) > 0).any()]
    shown = (lambda cols: [c for c in cols if full[c].null_count() < full.height])
    per_task = shown(["tokens_per_s", "speedup", "tau", "mean_active_vocab", "draft_ms", *phases, "lossless"])
    overall = shown(["policy", "vocab_size", "dynaspec_k_max", "rows", "tokens_per_s", "speedup", "speedup_lo",
                     "speedup_hi", "decode_speedup", "decode_speedup_lo", "decode_speedup_hi", "tau", "g",
                     "mean_active_vocab", "mean_union_vocab", "draft_ms", *phases, "draft_coverage", "lossless"])
    for line in describe_bench(frame):
        print(line)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True,
                   tbl_width_chars=330, fmt_str_lengths=60):
        print(f"MicroSpec Table 2's layout: tokens/s per task; {ALL}: over every row, with its speedup over ar, "
              "tau and lossless")
        print(table2(table))
        print("per task; draft time in ms per drafted step (steps - 1), split by drafter phase:")
        for task in table.filter(pl.col("task") != ALL)["task"].unique(maintain_order=True).to_list():
            print(f"{task}:")
            print(table.filter(pl.col("task") == task).select(*RUN, *per_task))
        print("overall:")
        print(table.filter(pl.col("task") == ALL).select(*RUN, *overall))
    for line in comparison_lines(compare_vocabs(full, frame)):
        print(line)
    differ = divergence_lines(frame)
    if differ:
        print("outputs that differ from ar's: the first divergent new token, ar's logit margin there (its token "
              "minus the best other) and the gap to the method's token; near-tie: within rounding "
              "(engine.divergence.near_tie_bound), mismatch: a bug")
        for line in differ:
            print(line)
    return full


def main(argv: Sequence[str] | None = None) -> pl.DataFrame:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default=None,
                    help="comma-separated method names (default: ar,pld,hf-prompt-lookup; ar with --drafter)")
    ap.add_argument("--drafter", default=None,
                    help=f"a drafter with an LM head ({' | '.join(DRAFTERS)}), benched once per --vocab")
    ap.add_argument("--vocab", default=None,
                    help=f"with --drafter: comma list of draft vocabularies ({','.join(POLICIES)}; default full); "
                         f"frspec:K sets the shortlist, microspec:W w_max, dynaspec:N about N tokens per row at "
                         f"draft steps 0-1 (k_max = round(N * clusters / V))")
    ap.add_argument("--prompts", default="spec_bench", help="a prompt set name or a .jsonl path")
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    ap.add_argument("--languages", default=None, help="comma-separated languages (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: kernels.hardware)")
    ap.add_argument("--dtype", default=None, help="fp32 | fp16 | bf16 (default: kernels.hardware)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the bench")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a further SpecConfig field for every run, e.g. --set drafter_layers=first:4, "
                         "--set eagle_head=DIR (the eagle drafter's head), --set dynaspec_file=PATH")
    ap.add_argument("--out", default=None, help="folder for results.parquet")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in OUT/results.parquet")
    ap.add_argument("--specbench-answers", default=None, metavar="DIR",
                    help="also write Spec-Bench model-answer .jsonl files there, one per run "
                         "(engine.jobs.specbench; Spec-Bench's evaluation/speed.py and equal.py read them)")
    add_debug(ap)
    a = ap.parse_args(argv)
    check_model(a.model)
    check_at_least("--per-category", a.per_category, 1)
    for flag, folder in (("--out", a.out), ("--specbench-answers", a.specbench_answers)):
        if folder:
            check_out(flag, folder)
    split = (lambda s: None if s is None else [x for x in s.split(",") if x])
    failed = None
    try:
        frame = run_bench(model=a.model, methods=a.methods, prompts=a.prompts, drafter=a.drafter, vocab=a.vocab,
                          per_category=a.per_category, categories=split(a.categories), languages=split(a.languages),
                          max_new_tokens=a.max_new_tokens, repeats=a.repeats, warmup=a.warmup, out=a.out,
                          temperature=a.temperature, top_p=a.top_p, seed=a.seed, device=a.device, dtype=a.dtype,
                          threads=a.threads, config=_parse_sets(a.set), resume=a.resume)
    except RunsFailed as e:                                      # the other runs' answers are written too
        frame, failed = e.frame, e
    if a.specbench_answers and frame.height:
        for path in write_answer_files(frame, a.specbench_answers, tokenizer_decoder()):
            print(f"Spec-Bench answers: {path}")
    if failed is not None:
        raise failed
    return frame


def _parse_sets(items: list[str]) -> dict:
    try:
        return parse_overrides(items)
    except ConfigError as e:
        raise BenchError(str(e)) from None


if __name__ == "__main__":
    sys.exit(run_main(main))
