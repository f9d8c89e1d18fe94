"""What a bench measured, defined once: the results schema, the measures, Table 2 and the policy comparisons.

Polars only (no torch, no transformers): the bench job (`engine.jobs.bench`), which runs decodes and prints,
and the sweeps' tables (`sweeps.tables`), which read a results folder to draw the figures, both summarise
through here, so a number in a printed table and the same number in a figure come from one expression. As
vLLM's `v1/spec_decode/metrics.py` defines acceptance length in one place, this module is the one place that
says what tau, speedup, draft time and coverage are. (Over 600 lines on purpose: that one place
holds every measure, its interval and the comparisons built on them.)

The results rows (`ROW_SCHEMA`, one per (method, run, prompt, turn, repeat), written by `engine.jobs.bench`)
keep their columns; a results folder written before still loads. The summaries name each measure once:

    tokens_per_s        mean over rows of the row's new_tokens / (wall_s - uncharged_s) (prefill included)
    speedup             tokens_per_s / ar's tokens_per_s on the same rows' group (same model, prompt set and
                        task): a ratio of the two means, not a mean of per-row ratios (MicroSpec Table 2)
    decode_tokens_per_s mean over rows of (new_tokens - 1) / (wall_s - prefill_s - begin_s - uncharged_s): the
                        steps after the prefill (which commits the first token) and the drafter's pass over
                        the prompt - the rate a long generation approaches. The papers generate up to 1024
                        tokens, where those one-time costs vanish; a CPU sweep's 32 spend ~30% of an `ar`
                        run in the prefill, which pulls `speedup` toward 1. Null for rows without begin_s
                        (written before it) or with one new token.
    decode_speedup      decode_tokens_per_s / ar's, as speedup
    speedup_lo, _hi     the central 95% (CI_LEVEL) of `speedup` over CI_DRAWS bootstrap draws that resample the
                        units the total's mean is taken over, each drawn unit keeping its ar pair (the run's and
                        ar's tokens/s of the same prompt turn, repeats averaged): a task's or ALL's rows ->
                        their prompt turns; AVG -> its tasks (the mean over tasks, so over the task set, not
                        within tasks: Spec-Bench's tasks hold 1-2 turns per prompt). Null for fewer than 2
                        units. It is the spread over prompts (or tasks) of one run's timings, not the drift of
                        the machine between runs, which it cannot see. decode_speedup_lo, _hi likewise.
    tau                 sum new_tokens / sum steps: tokens committed per step, the target's bonus token
                        included (the prefill is step 0 and commits one token: ar = 1.00) - the acceptance
                        length of vLLM's spec-decode metrics; `engine.harness.GenerateResult.tau` per row
    draft_ms            sum (draft_s - begin_s - uncharged_s) / sum (steps - 1), in ms: draft time per drafted
                        step (the prefill, step 0, drafts nothing; begin_s, the drafter's pass over the prompt,
                        is no step's; rows written before begin_s subtract draft_prefill_s, the LM-head
                        drafters' share of it)
    <phase>_ms          sum <phase>_s / sum (steps - 1), phase in PHASES (MicroSpec Fig. 4); null for a run
                        whose drafter does not time its phases
    mean_active_vocab   the draft vocabulary's mean size, over drafted steps (row means weighted by steps - 1)
    draft_coverage      the share of generated tokens inside the draft vocabulary, token-weighted (row values
                        weighted by new_tokens) - named as the rows' column; `coverage` is the coverage cells'
                        (a window over a recorded trace, `locality`), another measure
    lossless            "exact" | "near-tie" | "mismatch" (`row_verdicts`, `run_verdict`), null when outputs are
                        not comparable

A summary row is per `task`: what a paper calls a task, the row's Spec-Bench category, or its language in a
prompt set split by language, or "category/language" when a set has several of each (`with_task`; the rows
keep `category` and `language`). Two totals, named apart because they differ:

    ALL = "all"   every row pooled (`summarize`, what `python -m specvocab.engine.jobs.bench` prints)
    AVG = "avg"   the mean over tasks of each task's value (`table2_summary`, MicroSpec Table 2's
                  "Avg. Speed" and "Avg. Len."; speedup = the mean tokens/s over ar's mean tokens/s)

Per row, `step_sizes` lists the tokens each step committed (the prefill's step 0 commits one; they sum to
new_tokens and their mean is the row's tau): Spec-Bench's per-step `accept_lengths` (`engine.jobs.specbench`).
Rows without it (null) have no per-step sizes. A merged run's rows (`engine.drafters.merged`) also carry
`accepted_by_<source>`: the committed draft tokens each source (draft head, pld, unispec) placed in the tree; they
sum to the row's committed draft tokens (null for other methods; `sweeps.tables.tau_by_source` splits tau by them).

Earlier summaries said `category` for the task and `coverage` for draft_coverage (`summarize`); they were never
written to a results folder, so no reader needs the old names.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl

from specvocab.engine.config import POLICIES
from specvocab.engine.methods import MERGE_SOURCES, MethodNames, method_specs

# drafters with an LM head behind a vocabulary policy (`engine.methods.MethodSpec.lm_head`; a view read at each use)
DRAFTERS = MethodNames(lambda s: s.lm_head, "the drafters with an LM head behind a vocabulary policy")
PHASES = ("backbone", "router", "gather", "lm_head", "tree")   # drafter phases (engine.drafters.lmhead)
ROW_SCHEMA = {
    "model": pl.String, "device": pl.String, "dtype": pl.String, "backend": pl.String, "method": pl.String, "run": pl.String,
    "policy": pl.String, "vocab_size": pl.Int64, "dynaspec_k_max": pl.Int64, "draft_head": pl.String,
    "vocab_file": pl.String, "draft_size": pl.Int64, "draft_size_source": pl.String,
    # where the run's other open choices came from (`engine.resolve.ResolvedRun.columns`: given, shipped,
    # fitted, default) and the kernel build that decoded
    "draft_head_source": pl.String, "vocab_file_source": pl.String, "vocab_size_source": pl.String,
    "kernel_build": pl.String, "kernel_build_source": pl.String,
    "max_new_tokens": pl.Int64, "prompt_set": pl.String,
    "prompt_id": pl.String,
    "category": pl.String, "language": pl.String, "turn": pl.Int32,
    "repeat": pl.Int32, "prompt_tokens": pl.Int64, "new_tokens": pl.Int64, "steps": pl.Int64,
    "tau": pl.Float64, "g": pl.Float64, "wall_s": pl.Float64, "prefill_s": pl.Float64, "draft_s": pl.Float64,
    "verify_s": pl.Float64, "tokens_per_s": pl.Float64,
    **{f"{p}_s": pl.Float64 for p in PHASES}, "draft_prefill_s": pl.Float64, "begin_s": pl.Float64,
    "uncharged_s": pl.Float64,
    "mean_active_vocab": pl.Float64, "max_active_vocab": pl.Float64, "mean_union_vocab": pl.Float64,
    "draft_coverage": pl.Float64, "bonus_coverage": pl.Float64, "threads": pl.Int32, "stop_reason": pl.String,
    "temperature": pl.Float64,
    "seed": pl.Int64, "output_ids": pl.List(pl.Int64),
    "score_bins_proposed": pl.List(pl.Int64), "score_bins_accepted": pl.List(pl.Int64),
    "step_sizes": pl.List(pl.Int64),    # tokens each step committed (GenerateResult.step_sizes; may be null)
    # merged: the committed draft tokens each source placed (engine.drafters.merged); null for other methods
    **{f"accepted_by_{s}": pl.Int64 for s in MERGE_SOURCES},
    # against ar's row of the same (prompt_id, turn, repeat), greedy only (`engine.divergence`, `diagnose`)
    "verdict": pl.String, "first_divergence": pl.Int64, "ar_margin": pl.Float64, "ar_gap": pl.Float64,
    "prompt_differs": pl.Boolean,
}
RUN = ["method", "run"]                         # one benched configuration
VERDICTS = ("exact", "near-tie", "mismatch")    # a row's verdict against ar's output (`engine.divergence`)
ALL = "all"                                     # the task of the rows-pooled total (`summarize`)
AVG = "avg"                                     # the task of the mean over tasks (`table2_summary`)
PHASE_MS = [f"{p}_ms" for p in PHASES]
UNIT = ["prompt_id", "turn"]                    # a prompt turn: what the bootstrap draws (its repeats averaged)
CI_LEVEL, CI_DRAWS, CI_SEED = 0.95, 2000, 0     # speedup_lo / speedup_hi (module docstring); the seed: same table
# MicroSpec's claims against full of the same drafter, as targets: draft time per step cut several-fold
# (MicroSpec §4.4, Fig. 4), tau kept (§4.3), faster end to end (§4.2)
TARGET_DRAFT_RATIO, TARGET_TAU_RATIO, TARGET_SPEED_RATIO = 3.0, 0.95, 1.0
# pairs compared per drafter: (policy, base policy); `full` is every other policy's base
PAIRS = (("microspec", "frspec"), ("microspec", "dynaspec"), ("dynaspec", "frspec"))
# the order runs are listed in (`engine.methods.MethodSpec.order`): ar first, then training-free methods, then the
# drafters with an LM head
METHOD_ORDER = MethodNames(doc="every method, in display order")


class MetricsError(ValueError):
    """A frame lacks the columns a summary needs; the message says which."""


# --- the measures: one expression each (module docstring) ----------------------------------------------------

def drafted_steps() -> pl.Expr:
    """Per row: steps - 1, the steps that drafted (the prefill, step 0, drafts nothing)."""
    return (pl.col("steps") - 1).clip(lower_bound=0)


def tau() -> pl.Expr:
    """Aggregation: sum new_tokens / sum steps - tokens committed per step, the bonus token included (ar = 1)."""
    return pl.col("new_tokens").sum() / pl.col("steps").sum()


def tokens_per_s() -> pl.Expr:
    """Aggregation: the mean of the rows' tokens/s (each row: new_tokens / its wall time, prefill included)."""
    return pl.col("tokens_per_s").mean()


def decode_rate() -> pl.Expr:
    """Per row: the decode phase's tokens/s, (new_tokens - 1) / (wall_s - prefill_s - begin_s - uncharged_s);
    null for a row without begin_s or with one new token (module docstring)."""
    rate = ((pl.col("new_tokens") - 1)
            / (pl.col("wall_s") - pl.col("prefill_s") - pl.col("begin_s") - pl.col("uncharged_s").fill_null(0.0)))
    return pl.when(pl.col("new_tokens") > 1).then(rate)


def decode_tokens_per_s() -> pl.Expr:
    """Aggregation: the mean of the rows' decode-phase tokens/s (`decode_rate`)."""
    return decode_rate().mean()


def per_drafted_step_ms(seconds: pl.Expr) -> pl.Expr:
    """Aggregation: sum `seconds` / sum (steps - 1), in ms; null where nothing was drafted."""
    drafted = drafted_steps().sum()
    return pl.when(drafted > 0).then(seconds.sum() / drafted * 1e3)


def draft_ms() -> pl.Expr:
    """Aggregation: draft time per drafted step in ms, the drafter's pass over the prompt and the oracle's
    uncharged full head left out."""
    return per_drafted_step_ms(pl.col("draft_s") - pl.coalesce("begin_s", "draft_prefill_s", pl.lit(0.0))
                               - pl.col("uncharged_s").fill_null(0.0))


def step_mean(column: str) -> pl.Expr:
    """Aggregation: a per-row mean over drafted steps, weighted by the row's drafted steps."""
    drafted = drafted_steps()
    return (pl.col(column) * drafted).sum() / drafted.filter(pl.col(column).is_not_null()).sum()


def draft_coverage() -> pl.Expr:
    """Aggregation: the share of generated tokens inside the draft vocabulary, rows weighted by new_tokens."""
    return ((pl.col("draft_coverage") * pl.col("new_tokens")).sum()
            / pl.col("new_tokens").filter(pl.col("draft_coverage").is_not_null()).sum())


def _finite(*columns: str) -> list[pl.Expr]:
    return [pl.when(pl.col(c).is_finite()).then(pl.col(c)).alias(c) for c in columns]


# --- rows ----------------------------------------------------------------------------------------------------

def with_schema(frame: pl.DataFrame, needs: Sequence[str] = ("category",)) -> pl.DataFrame:
    """`frame` with every ROW_SCHEMA column (null where a hand-made frame or an older file lacks one); a frame
    without the run key (method, run, prompt_id, turn, repeat) or `needs` is refused."""
    missing = [c for c in (*RUN, "prompt_id", "turn", "repeat", *needs) if c not in frame.columns]
    if missing:
        raise MetricsError(f"a bench summary needs engine.jobs.bench's columns; missing {missing} (a results file "
                           f"from an older engine.jobs.bench: bench again)")
    return frame.with_columns([pl.lit(None, dtype=dt).alias(col) for col, dt in ROW_SCHEMA.items()
                               if col not in frame.columns])


def with_task(frame: pl.DataFrame) -> pl.DataFrame:
    """Add `task` (category; language in a set split by language; "category/language" when a set has
    several of both) and `panel` (the task, prefixed with the prompt set and the model when the frame holds
    several)."""
    cat = pl.col("category").fill_null("-")
    lang = pl.col("language").fill_null("-") if "language" in frame.columns else pl.lit("-")
    over = "prompt_set" if "prompt_set" in frame.columns else None
    n_cat = cat.n_unique().over(over) if over else cat.n_unique()
    n_lang = lang.n_unique().over(over) if over else lang.n_unique()
    frame = frame.with_columns(task=pl.when(n_lang <= 1).then(cat).when(n_cat <= 1).then(lang)
                               .otherwise(cat + "/" + lang))
    panel = pl.col("task")
    if "prompt_set" in frame.columns and frame["prompt_set"].n_unique() > 1:
        panel = pl.col("prompt_set") + " · " + panel
    if "model" in frame.columns and frame["model"].n_unique() > 1:
        panel = pl.col("model") + " · " + panel
    return frame.with_columns(panel=panel)


def policy(label: str) -> str:
    """The vocabulary policy of a run label ("frspec:1024" -> "frspec")."""
    return label.partition(":")[0]


def first_divergence(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """The first index where `output` differs from `reference` (ar's), None if they are equal; where one is a
    prefix of the other, the shorter length (one stopped where the other chose another token)."""
    reference, output = list(reference), list(output)
    for i, (a, b) in enumerate(zip(reference, output)):
        if a != b:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


def run_verdict(verdict: pl.Expr) -> pl.Expr:
    """A polars aggregation of row verdicts into one for a run: "exact" if every row is exact, else
    "mismatch" if any row is one (a bug anywhere outweighs rounding elsewhere), else "near-tie". Null rows
    (nothing to compare with) are left out; null if all are."""
    return (pl.when(verdict.eq("mismatch").any()).then(pl.lit("mismatch"))
            .when(verdict.eq("near-tie").any()).then(pl.lit("near-tie"))
            .when(verdict.eq("exact").any()).then(pl.lit("exact")))


def row_verdicts(frame: pl.DataFrame) -> pl.DataFrame | None:
    """`frame` with `ar_output` (ar's output for the row's prompt_id, turn, repeat) and `row_verdict`, the
    verdict `summarize` counts: null without an ar row; "exact" where the output equals ar's (whatever an
    older `verdict` said: a stale one from before a hand edit is not trusted), except a later turn whose
    prompt already differed (`prompt_differs`: it keeps the verdict of the turn where the conversation
    parted); else the row's diagnosed `verdict` (near-tie | mismatch); a differing row never diagnosed (an
    older results file, ar benched in another call: `engine.jobs.bench.diagnose`) counts as a mismatch -
    nothing shows that rounding explains it. None when outputs are not token-comparable: no ar rows, or any
    row sampled."""
    frame = with_schema(frame, ())
    key = ["prompt_id", "turn", "repeat"]
    ar_out = (frame.filter(pl.col("method") == "ar").unique(key, keep="first", maintain_order=True)
              .select(*key, ar_output=pl.col("output_ids")))
    if not ar_out.height or not bool((frame["temperature"] == 0).all()):
        return None
    stored = pl.col("verdict")
    diverged = stored.is_in(list(VERDICTS[1:]))
    return (frame.join(ar_out, on=key, how="left", maintain_order="left")
            .with_columns(row_verdict=pl.when(pl.col("ar_output").is_null()).then(pl.lit(None, dtype=pl.String))
                          .when(pl.col("prompt_differs") & diverged).then(stored)
                          .when(pl.col("output_ids") == pl.col("ar_output")).then(pl.lit("exact"))
                          .when(diverged).then(stored)
                          .otherwise(pl.lit("mismatch"))))


def divergences(frame: pl.DataFrame) -> pl.DataFrame:
    """The rows whose `row_verdicts` verdict is not exact, one per (method, run, prompt_id, turn, repeat):
    first_divergence (from the outputs where the row was never diagnosed), ar_margin, ar_gap, prompt_differs,
    verdict, and `diagnosed` (whether `engine.divergence` measured it)."""
    schema = {"method": pl.String, "run": pl.String, "prompt_id": pl.String, "turn": pl.Int32, "repeat": pl.Int32,
              "first_divergence": pl.Int64, "ar_margin": pl.Float64, "ar_gap": pl.Float64,
              "prompt_differs": pl.Boolean, "verdict": pl.String, "diagnosed": pl.Boolean}
    rows = row_verdicts(frame)
    if rows is None:
        return pl.DataFrame(schema=schema)
    out = []
    differ = rows.filter(pl.col("row_verdict").is_not_null() & (pl.col("row_verdict") != "exact"))
    for r in differ.iter_rows(named=True):
        diagnosed = r["verdict"] in VERDICTS[1:]
        pos = r["first_divergence"] if diagnosed else first_divergence(r["ar_output"], r["output_ids"])
        out.append({**{k: r[k] for k in ("method", "run", "prompt_id", "turn", "repeat")}, "first_divergence": pos,
                    "ar_margin": r["ar_margin"] if diagnosed else None, "ar_gap": r["ar_gap"] if diagnosed else None,
                    "prompt_differs": r["prompt_differs"] if diagnosed else None, "verdict": r["row_verdict"],
                    "diagnosed": diagnosed})
    return pl.DataFrame(out, schema=schema)


def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def divergence_lines(frame: pl.DataFrame) -> list[str]:
    """One line per `divergences` row: run, prompt_id, turn (and repeat), the first divergent new token, ar's
    margin there (and the gap to the method's token), the verdict."""
    lines = []
    for r in divergences(frame).iter_rows(named=True):
        who = r["run"] if r["run"].startswith(r["method"]) else f"{r['method']} {r['run']}"
        where = f"{who}: prompt {r['prompt_id']}, turn {r['turn']}, repeat {r['repeat']}: "
        if r["prompt_differs"]:
            what = "prompt differs (an earlier turn diverged; its verdict)"
        elif not r["diagnosed"]:
            what = f"first divergent token {r['first_divergence']}, ar margin n/a (not diagnosed: `diagnose`)"
        else:
            what = (f"first divergent token {r['first_divergence']}, ar margin {_fmt(r['ar_margin'], '.4g')}, "
                    f"gap to the method's token {_fmt(r['ar_gap'], '.4g')}")
        lines.append(where + what + f" -> {r['verdict']}")
    return lines


# --- summaries -----------------------------------------------------------------------------------------------

def run_measures(frame: pl.DataFrame, keys: Sequence[str]) -> pl.DataFrame:
    """Per (*keys, method, run): policy, vocab_size, dynaspec_k_max, draft_head (the run's), rows and every
    measure of the module docstring but speedup and lossless. `frame` holds ROW_SCHEMA's columns
    (`with_schema`)."""
    agg = (frame.group_by(*keys, *RUN)
           .agg(policy=pl.col("policy").first(), vocab_size=pl.col("vocab_size").first(),
                dynaspec_k_max=pl.col("dynaspec_k_max").first(), draft_head=pl.col("draft_head").first(),
                rows=pl.len(), tokens_per_s=tokens_per_s(), decode_tokens_per_s=decode_tokens_per_s(), tau=tau(),
                g=pl.col("g").mean(),
                mean_active_vocab=step_mean("mean_active_vocab"), mean_union_vocab=step_mean("mean_union_vocab"),
                draft_ms=draft_ms(), **{f"{p}_ms": per_drafted_step_ms(pl.col(f"{p}_s")) for p in PHASES},
                draft_coverage=draft_coverage(), has_phases=pl.col("backbone_s").is_not_null().any()))
    agg = agg.with_columns([pl.when(pl.col("has_phases")).then(pl.col(c)).alias(c) for c in PHASE_MS]
                           ).drop("has_phases")
    return agg.with_columns(_finite("mean_active_vocab", "mean_union_vocab", "draft_coverage"))


def with_speedup(table: pl.DataFrame, keys: Sequence[str]) -> pl.DataFrame:
    """`table` (one row per (*keys, method, run)) with `speedup`: tokens_per_s over ar's on the same `keys`
    (the mean of ar's runs' there, when several); null where ar did not run."""
    ar = (table.filter(pl.col("method") == "ar").group_by(*keys)
          .agg(_ar_tokens_per_s=pl.col("tokens_per_s").mean(), _ar_decode=pl.col("decode_tokens_per_s").mean()))
    return (table.join(ar, on=list(keys), how="left", nulls_equal=True)
            .with_columns(speedup=pl.col("tokens_per_s") / pl.col("_ar_tokens_per_s"),
                          decode_speedup=pl.col("decode_tokens_per_s") / pl.col("_ar_decode"))
            .drop("_ar_tokens_per_s", "_ar_decode"))


def ratio_interval(run: np.ndarray, ar: np.ndarray, level: float = CI_LEVEL, draws: int = CI_DRAWS,
                   seed: int = CI_SEED) -> tuple[float, float] | None:
    """The percentile bootstrap interval of mean(run) / mean(ar) over paired units (run[i] and ar[i] measured
    on the same unit): every draw resamples the units with replacement, the same indices for both sides (the
    pairing), and the interval is the central `level` of the draws' ratios. None for fewer than 2 units. A
    total over tasks passes the tasks' means as its units (`with_intervals`)."""
    run, ar = np.asarray(run, dtype=float), np.asarray(ar, dtype=float)
    if len(run) < 2:
        return None
    pick = np.random.default_rng(seed).integers(0, len(run), size=(draws, len(run)))
    lo, hi = np.quantile(run[pick].mean(axis=1) / ar[pick].mean(axis=1), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


INTERVALS = {"speedup": "tokens_per_s", "decode_speedup": "_decode_rate"}   # measure: the rows' rate it divides


def with_intervals(table: pl.DataFrame, frame: pl.DataFrame, keys: Sequence[str],
                   over_tasks: bool = False) -> pl.DataFrame:
    """`table` (one row per (*keys, method, run), from `with_speedup`) with speedup_lo / speedup_hi and
    decode_speedup_lo / decode_speedup_hi (module docstring), from `frame`, the rows it summarises. The units:
    prompt turns (UNIT, repeats averaged; ar's runs averaged too, as `with_speedup` averages them), paired by
    (*keys, UNIT); over_tasks: the rows' tasks instead (each task's mean over its turns), paired by (*keys,
    task) - the unit of the mean over tasks (AVG): then `keys` leave the task out and `table` holds the AVG
    rows."""
    frame = frame.with_columns(_decode_rate=decode_rate())
    unit = ["task"] if over_tasks else UNIT
    rates = list(INTERVALS.values())
    per = frame.group_by(*keys, *RUN, *UNIT, *(["task"] if over_tasks else [])).agg(pl.col(rates).mean())
    if over_tasks:                                             # then each task's mean over its turns
        per = per.group_by(*keys, *RUN, "task").agg(pl.col(rates).mean())
    ar = (per.filter(pl.col("method") == "ar").group_by(*keys, *unit)
          .agg(**{f"_ar{c}": pl.col(c).mean() for c in rates}))
    # in unit order, so the seeded draws pick the same units on every call (group_by's order is not fixed)
    pairs = per.join(ar, on=[*keys, *unit], how="inner", nulls_equal=True).sort(*unit, nulls_last=True)
    out: dict[str, list] = {c: [] for c in [*keys, *RUN]}
    for name in INTERVALS:
        out[f"{name}_lo"], out[f"{name}_hi"] = [], []
    for group_key, part in pairs.group_by(*keys, *RUN, maintain_order=True):
        for c, v in zip([*keys, *RUN], group_key):
            out[c].append(v)
        for name, rate in INTERVALS.items():
            ok = part.filter(pl.col(rate).is_not_null() & pl.col(f"_ar{rate}").is_not_null()
                             & (pl.col(f"_ar{rate}") > 0))
            got = ratio_interval(ok[rate].to_numpy(), ok[f"_ar{rate}"].to_numpy())
            out[f"{name}_lo"].append(None if got is None else got[0])
            out[f"{name}_hi"].append(None if got is None else got[1])
    schema = {c: table.schema[c] for c in [*keys, *RUN]}
    schema.update({f"{n}_{e}": pl.Float64 for n in INTERVALS for e in ("lo", "hi")})
    intervals = pl.DataFrame(out, schema=schema)
    return table.join(intervals, on=[*keys, *RUN], how="left", nulls_equal=True)


SUMMARY_COLUMNS = ("task", *RUN, "policy", "vocab_size", "dynaspec_k_max", "draft_head", "rows", "tokens_per_s",
                   "speedup", "speedup_lo", "speedup_hi", "decode_tokens_per_s", "decode_speedup",
                   "decode_speedup_lo", "decode_speedup_hi", "tau", "g", "mean_active_vocab",
                   "mean_union_vocab", "draft_ms", *PHASE_MS,
                   "draft_coverage", "lossless")


def summarize(frame: pl.DataFrame) -> pl.DataFrame:
    """One bench's rows (one model, one prompt set) summarised per (task incl. ALL, method, run): policy,
    vocab_size, dynaspec_k_max, draft_head, rows, tokens_per_s, speedup over ar, tau, g, mean_active_vocab and
    mean_union_vocab, draft_ms and the per-phase ms, draft_coverage (module docstring), and `lossless`, a
    string: "exact" - every output equals ar's token for token; "near-tie" - some differ, each where the
    target's top two logits were within rounding (`engine.divergence.near_tie_bound`); "mismatch" - some output
    differs where ar's token led clearly, a bug (or was never diagnosed: `row_verdicts`); null when outputs
    are not comparable (no ar rows, or sampling). Tasks in sorted order, ALL last; runs in the rows' order."""
    frame = with_task(with_schema(frame)).drop("panel")
    both = pl.concat([frame, frame.with_columns(task=pl.lit(ALL))], how="vertical_relaxed")
    agg = with_intervals(with_speedup(run_measures(both, ["task"]), ["task"]), both, ["task"])
    verdicts = row_verdicts(frame)
    if verdicts is not None:
        verdicts = pl.concat([verdicts, verdicts.with_columns(task=pl.lit(ALL))])
        lossless = verdicts.group_by("task", *RUN).agg(lossless=run_verdict(pl.col("row_verdict")))
        agg = agg.join(lossless, on=["task", *RUN], how="left")
    else:                                                        # no ar rows, or sampling: not token-comparable
        agg = agg.with_columns(lossless=pl.lit(None, dtype=pl.String))
    runs = frame.select(RUN).unique(maintain_order=True).with_row_index("_r")
    return (agg.join(runs, on=RUN, how="left").with_columns(_all=pl.col("task") == ALL)
            .sort("_all", "task", "_r").drop("_all", "_r").select(SUMMARY_COLUMNS))


def table2_summary(frame: pl.DataFrame) -> pl.DataFrame:
    """MicroSpec Table 2 / Fig. 4 in tidy form from a sweep's bench rows (several models and prompt sets): per
    model, prompt set, task (and `panel`, `with_task`) and run, `run_measures` and speedup over ar on the same
    model, prompt set and task. One more row per (model, prompt set, run) with task = panel = AVG: the mean
    over tasks of every measure, speedup = that mean tokens/s over ar's (Table 2's "Avg. Speed" and "Avg.
    Len."; decode_speedup likewise). Rows in the order models, prompt sets, tasks (AVG last), then
    METHOD_ORDER, POLICIES, size."""
    frame = with_schema(frame, ("model", "prompt_set", "category"))
    if "task" not in frame.columns or "panel" not in frame.columns:
        frame = with_task(frame)
    keys = ["model", "prompt_set"]
    agg = run_measures(frame, [*keys, "task", "panel"])
    means = ["tokens_per_s", "decode_tokens_per_s", "tau", "g", "mean_active_vocab", "mean_union_vocab", "draft_ms",
             *PHASE_MS, "draft_coverage"]
    avg = (agg.group_by(*keys, *RUN)
           .agg(pl.col("policy", "vocab_size", "dynaspec_k_max", "draft_head").first(), rows=pl.col("rows").sum(),
                **{c: pl.col(c).mean() for c in means})
           .with_columns(task=pl.lit(AVG), panel=pl.lit(AVG)))
    both = with_speedup(pl.concat([agg, avg], how="diagonal_relaxed"), [*keys, "task"])
    tasks = with_intervals(both.filter(pl.col("task") != AVG), frame, [*keys, "task", "panel"])
    avgs = with_intervals(both.filter(pl.col("task") == AVG), frame, keys, over_tasks=True)
    both = pl.concat([tasks, avgs], how="diagonal_relaxed").with_columns(_finite("draft_coverage"))
    order = {s.name: s.order for s in method_specs()}
    policies = {p: i for i, p in enumerate(POLICIES)}
    last = max(order.values(), default=0) + 1
    both = both.with_columns(_m=pl.col("method").replace_strict(order, default=last, return_dtype=pl.Int64),
                             _p=pl.col("policy").replace_strict(policies, default=len(policies), return_dtype=pl.Int64),
                             _avg=pl.col("task") == AVG)
    return (both.sort(*keys, "_avg", "task", "_m", "_p", "vocab_size", "run", nulls_last=True)
            .drop("_m", "_p", "_avg"))


def table2(summary: pl.DataFrame) -> pl.DataFrame:
    """MicroSpec Table 2's layout from `summarize`: a row per run, tokens/s per task, then over all rows (ALL)
    tokens/s, its speedup over ar, tau and lossless."""
    keep = pl.col("task") != ALL
    wide = summary.filter(keep).pivot("task", index=RUN, values="tokens_per_s", aggregate_function="first")
    total = summary.filter(~keep).select(*RUN, all=pl.col("tokens_per_s"), speedup=pl.col("speedup"),
                                         tau=pl.col("tau"), lossless=pl.col("lossless"))
    order = summary.select(RUN).unique(maintain_order=True).with_row_index("_r")
    return order.join(wide, on=RUN, how="left").join(total, on=RUN, how="left").sort("_r").drop("_r")


# --- the policy comparisons ----------------------------------------------------------------------------------

def _policy_of(row: dict) -> str:
    """A summary row's policy: its `policy` column, else read from the run label ("frspec:1024")."""
    return row.get("policy") or policy(row["run"])


COMPARISON_SCHEMA = {"method": pl.String, "run": pl.String, "base": pl.String, "policy": pl.String,
                     "base_policy": pl.String,
                     **{c: pl.Float64 for c in ("draft_ms", "base_draft_ms", "draft_ratio", "tau", "base_tau",
                                                "tau_ratio", "tokens_per_s", "base_tokens_per_s", "speed_ratio",
                                                "speed_ratio_lo", "speed_ratio_hi",
                                                "speedup", "mean_active_vocab", "base_mean_active_vocab")}}


def unit_rates(frame: pl.DataFrame, method: str, run: str) -> pl.DataFrame:
    """One run's tokens/s per prompt turn (UNIT), its repeats averaged: what the bootstrap intervals draw."""
    return (frame.filter((pl.col("method") == method) & (pl.col("run") == run))
            .group_by(*UNIT).agg(pl.col("tokens_per_s").mean()))


def pair_interval(frame: pl.DataFrame, method: str, run: str, base: str) -> tuple[float, float] | None:
    """The 95% paired bootstrap interval (`ratio_interval`) of run's tokens/s over base's, both runs of
    `method`, over the prompt turns both ran (in unit order: the seeded draws are the same on every call)."""
    both = (unit_rates(frame, method, run).join(unit_rates(frame, method, base), on=UNIT, suffix="_base")
            .drop_nulls().sort(*UNIT))
    return ratio_interval(both["tokens_per_s"].to_numpy(), both["tokens_per_s_base"].to_numpy())


def compare_vocabs(summary: pl.DataFrame, frame: pl.DataFrame | None = None) -> pl.DataFrame:
    """From `summarize`'s ALL rows: per drafter, each non-full run against every `full` run of the same
    drafter, then every microspec run against every frspec and dynaspec run, and every dynaspec run against
    every frspec run (e.g. frspec and frspec:1024, to compare tau at an equal or smaller mean vocabulary).
    Policies come from the `policy` column (else the run label). Ratios: draft_ratio = base draft_ms /
    draft_ms (how many times less draft time per step), tau_ratio = tau / base tau, speed_ratio =
    tokens_per_s / base tokens_per_s; `speedup` is the run's own over ar. With `frame`, the rows `summary`
    summarises: speed_ratio_lo / _hi, the ratio's 95% interval over the prompt turns both runs ran, each turn
    paired with itself (`pair_interval`); null without."""
    allrows = summary.filter(pl.col("task") == ALL)
    frame = None if frame is None else with_schema(frame)
    out = []
    for method in allrows["method"].unique(maintain_order=True).to_list():
        mine = {r["run"]: r for r in allrows.filter(pl.col("method") == method).iter_rows(named=True)}
        of = (lambda name: [v for v, r in mine.items() if _policy_of(r) == name])
        pairs = [(v, b) for b in of("full") for v, r in mine.items() if _policy_of(r) != "full"]
        pairs += [(v, b) for a, base in PAIRS for v in of(a) for b in of(base)]
        for v, base in pairs:
            a, b = mine[v], mine[base]
            ratio = (lambda x, y: x / y if x is not None and y else None)
            ci = None if frame is None else pair_interval(frame, method, v, base)
            out.append({"method": method, "run": v, "base": base, "policy": _policy_of(a),
                        "base_policy": _policy_of(b), "draft_ms": a["draft_ms"],
                        "base_draft_ms": b["draft_ms"], "draft_ratio": ratio(b["draft_ms"], a["draft_ms"]),
                        "tau": a["tau"], "base_tau": b["tau"], "tau_ratio": ratio(a["tau"], b["tau"]),
                        "tokens_per_s": a["tokens_per_s"], "base_tokens_per_s": b["tokens_per_s"],
                        "speed_ratio": ratio(a["tokens_per_s"], b["tokens_per_s"]),
                        "speed_ratio_lo": ci and ci[0], "speed_ratio_hi": ci and ci[1], "speedup": a.get("speedup"),
                        "mean_active_vocab": a["mean_active_vocab"], "base_mean_active_vocab": b["mean_active_vocab"]})
    return pl.DataFrame(out, schema=COMPARISON_SCHEMA)


def comparison_lines(cmp: pl.DataFrame) -> list[str]:
    """One line per `compare_vocabs` row, with the papers' claims as targets where one applies:
    microspec vs full (MicroSpec §4.2-4.4: draft time TARGET_DRAFT_RATIO x less, tau kept within
    TARGET_TAU_RATIO, faster than full and than ar), microspec vs frspec (higher tau at no larger vocab,
    faster; MicroSpec Table 2), microspec vs dynaspec (faster; MicroSpec Table 2), dynaspec vs frspec (higher
    tau at no larger vocab; DynaSpec Table 1)."""
    met = (lambda ok: "n/a" if ok is None else ("met" if ok else "MISSED"))
    ge = (lambda x, t: None if x is None else x >= t)
    gt = (lambda x, t: None if x is None else x > t)
    lines = []
    for r in cmp.iter_rows(named=True):
        who = r["run"] if r["run"].startswith(r["method"]) else f"{r['method']} {r['run']}"   # sweep labels
        line = (f"{who} vs {r['base']}: draft {_fmt(r['draft_ms'])} vs "
                f"{_fmt(r['base_draft_ms'])} ms/step = {_fmt(r['draft_ratio'])}x less; tau {_fmt(r['tau'])} vs "
                f"{_fmt(r['base_tau'])} = {_fmt(r['tau_ratio'], '.3f')}x; tokens/s {_fmt(r['tokens_per_s'])} vs "
                f"{_fmt(r['base_tokens_per_s'])} = {_fmt(r['speed_ratio'], '.3f')}x"
                + (f" (95% {_fmt(r['speed_ratio_lo'])}-{_fmt(r['speed_ratio_hi'])})"
                   if r.get("speed_ratio_lo") is not None else "") + "; mean active vocab "
                f"{_fmt(r['mean_active_vocab'], '.0f')} vs {_fmt(r['base_mean_active_vocab'], '.0f')}")
        pol = r.get("policy") or policy(r["run"])
        base = r.get("base_policy") or policy(r["base"])
        smaller = (None if r["mean_active_vocab"] is None or r["base_mean_active_vocab"] is None
                   else r["mean_active_vocab"] <= r["base_mean_active_vocab"])
        better = gt(r["tau_ratio"], 1.0)
        tau_at_vocab = met(None if better is None or smaller is None else better and smaller)
        if (pol, base) == ("microspec", "full"):
            line += (f"  | targets: draft >= {TARGET_DRAFT_RATIO:g}x less "
                     f"{met(ge(r['draft_ratio'], TARGET_DRAFT_RATIO))}"
                     f", tau >= {TARGET_TAU_RATIO:g}x {met(ge(r['tau_ratio'], TARGET_TAU_RATIO))}"
                     f", tokens/s > full {met(gt(r['speed_ratio'], TARGET_SPEED_RATIO))}"
                     f", tokens/s > ar {met(gt(r.get('speedup'), 1.0))}")
        elif (pol, base) == ("microspec", "frspec"):
            line += (f"  | targets: tau > frspec at <= its vocab {tau_at_vocab}"
                     f", tokens/s > frspec {met(gt(r['speed_ratio'], TARGET_SPEED_RATIO))}")
        elif (pol, base) == ("microspec", "dynaspec"):
            line += f"  | target: tokens/s > dynaspec {met(gt(r['speed_ratio'], TARGET_SPEED_RATIO))}"
        elif (pol, base) == ("dynaspec", "frspec"):
            line += f"  | target (DynaSpec Table 1): tau > frspec at <= its vocab {tau_at_vocab}"
        lines.append(line)
    return lines


# --- what a bench compared -----------------------------------------------------------------------------------

def _values(frame: pl.DataFrame, col: str) -> list:
    return [] if col not in frame.columns else [v for v in frame[col].unique(maintain_order=True).to_list()
                                                 if v is not None]


def describe_bench(frame: pl.DataFrame) -> list[str]:
    """What a bench compared, from its rows: model, device, dtype, threads; the prompts (set, prompts, turns,
    categories, languages, repeats); the tokens (max_new_tokens, generated, greedy or sampled); each drafter's
    head and the runs benched on it, with their sizes and files; the other methods."""
    join = (lambda col, sep="/": sep.join(str(v) for v in _values(frame, col)))
    where = [join("device"), join("dtype")]
    if _values(frame, "backend"):
        where.append(f"{join('backend')} target forward")
    if _values(frame, "threads"):
        where.append(f"{join('threads')} torch thread(s)")
    lines = [f"bench: {join('model', ', ') or '?'} on {', '.join(w for w in where if w) or '?'}"]
    for name in _values(frame, "prompt_set"):
        part = frame.filter(pl.col("prompt_set") == name)
        bits = [f"{part['prompt_id'].n_unique()} prompts", f"{part.select('prompt_id', 'turn').unique().height} turns"]
        bits += [f"{len(_values(part, c))} {w}" for c, w in (("category", "categories"), ("language", "languages"))
                 if len(_values(part, c)) > 1]
        bits.append(f"{part['repeat'].n_unique()} repeat(s)")
        lines.append(f"prompts: {name} ({', '.join(bits)})")
    temps = _values(frame, "temperature")
    mode = "greedy" if set(temps) <= {0.0} else f"sampling at temperature {'/'.join(map(str, temps))}"
    lines.append(f"tokens: max_new_tokens {join('max_new_tokens') or '?'} per turn, {int(frame['new_tokens'].sum())} "
                 f"generated in all; {mode}")
    others = []
    for method in _values(frame, "method"):
        rows = frame.filter(pl.col("method") == method)
        if method not in DRAFTERS:
            g = _values(rows, "draft_size") if method != "ar" else []
            others.append(method + (f" (draft_size {'/'.join(map(str, g))})" if g else ""))
            continue
        heads = "/".join(map(str, _values(rows, "draft_head"))) or "?"
        sizes = "/".join(map(str, _values(rows, "draft_size"))) or "?"
        lines.append(f"drafter: {method}, {'layers' if method == 'layerskip' else 'head'} {heads}, "
                     f"draft_size {sizes}; runs:")
        for run in _values(rows, "run"):
            r = rows.filter(pl.col("run") == run).row(0, named=True)
            bits = [f"policy {r['policy']}"] if r.get("policy") not in (None, policy(run)) else []
            if r.get("vocab_size") is not None:
                bits.append(f"vocab_size {r['vocab_size']}")
            if r.get("dynaspec_k_max") is not None:
                bits.append(f"k_max {r['dynaspec_k_max']} clusters")
            if r.get("vocab_file"):
                bits.append(str(r["vocab_file"]))
            lines.append(f"  {run}" + (f": {', '.join(bits)}" if bits else ""))
    if others:
        lines.append("methods: " + ", ".join(others))
    return lines
