"""Tidy tables for the figure notebooks (`notebooks/NN_*.py`), from the frames a sweep wrote; polars only.

(Over 600 lines on purpose: one small builder per figure of the five notebooks, over the same readers and
`describe`; split by notebook, each part would import the others'.)

Every table builder takes the frames a sweep wrote (`read(DIR, kind)`, i.e. `sweeps.load(DIR, kind)`
collected) and returns a small aggregated polars frame (altair refuses frames over 5,000 rows), or None
after printing why it cannot (a kind or an axis the sweep did not run). `sweeps.charts` draws them; the
notebooks only call the two. No torch and no altair at import (tests/test_layering.py): a results folder is
read and summarised in a process that never loads a model.

The measures - tokens/s, speedup over ar, tau (bonus token included, ar = 1.00), draft time per drafted
step and by phase, draft_coverage - are `engine.metrics`' (its docstring names each once); the bench tables
here (`method_summary`, the Table 2 of MicroSpec; `one_head_tables`, Table 2 on one head) are its summaries
with the sweep's run labels. Words as in `locality`'s glossary: the *window* is MicroSpec's FIFO suffix of the
candidate stream (MicroSpec §3.2, Eq. 4), its `w_max` counted in stream entries; a *static shortlist* is
FR-Spec's top-K of a token ranking counted on the training corpus (FR-Spec §3); *coverage* (the coverage
cells') = the fraction of generated tokens in the window or shortlist over a recorded trace.

`task` names what a paper calls a task (`engine.metrics.with_task`): the Spec-Bench category, or the language
for a prompt set split by language (the multilingual set), or both when a set has several of each; `panel`
adds the prompt set and the model when a sweep holds several. Every table keeps `model`: a sweep of several
models (`paper.toml`) is drawn per model (`sweeps.charts`).

Over 600 lines on purpose (about 700): one section per family of figures (coverage, bench,
UniSpec, DynaSpec's choices), each builder short and documented with the figure it feeds; split it by section
when one grows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import polars as pl

from specvocab.engine.config import SpecConfig
from specvocab.engine.metrics import (AVG, DRAFTERS, PHASE_MS, PHASES, compare_vocabs, comparison_lines, draft_coverage,
                            summarize, table2_summary, tau, tokens_per_s, with_task)
from specvocab.sweeps.cell import KINDS, SweepError
from specvocab.sweeps.results import load, paper_stream, results_path

# re-exported for the notebooks and for analysis by hand (defined in engine.metrics, sweeps.results)
__all__ = ["AVG", "PHASES", "with_task", "results_path", "paper_stream"]

# a record cell's scalar columns: enough to say what was recorded without reading the traces' token lists
RECORD_COLUMNS = ("model", "model_name", "prompt_set", "category", "language", "prompt_id", "turn",
                  "max_new_tokens", "topk", "dtype")
DEFAULTS = SpecConfig()                                     # the papers' defaults: w_max 3072, k_pre = k_ver = 3
WINDOW = "MicroSpec window"
STATIC = "static top-K (FR-Spec)"
LRU = "LRU vocabulary"
FIFO = "FIFO window (MicroSpec)"


# ----------------------------------------------------------------------------------------------------------
# Reading and describing a sweep's results
# ----------------------------------------------------------------------------------------------------------

def read(results_dir: str | Path, kind: str, columns: Sequence[str] | None = None) -> pl.DataFrame | None:
    """`sweeps.load(results_dir, kind)` collected (only `columns`, those present, when given), or None with
    a printed line when the sweep has no results of that kind - a notebook draws what it has."""
    if kind not in KINDS:
        raise ValueError(f"unknown result kind {kind!r}; choose from {list(KINDS)}")
    try:
        lazy = load(results_dir, kind)
    except SweepError as e:
        print(f"missing: {e}")
        return None
    if columns is not None:
        have = lazy.collect_schema().names()
        lazy = lazy.select([c for c in columns if c in have])
    return lazy.collect()


def _present(frame: pl.DataFrame | None, what: str, *columns: str) -> bool:
    """False (with a printed reason) when `frame` is None, empty or lacks `columns`."""
    if frame is None:
        print(f"skipped {what}: no results of the kind it needs")
        return False
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        print(f"skipped {what}: the results have no {missing} columns (an older sweep? run it again)")
        return False
    if frame.is_empty():
        print(f"skipped {what}: no rows")
        return False
    return True


def _values(frame: pl.DataFrame, column: str) -> list:
    if column not in frame.columns:
        return []
    return sorted(v for v in frame[column].unique().to_list() if v is not None)


def _span(values: list, unit: str) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return f"{lo} {unit}" if lo == hi else f"{lo}-{hi} {unit}"


def describe(frame: pl.DataFrame, record: pl.DataFrame | None = None) -> list[str]:
    """Subtitle lines saying what produced `frame`: the model(s), the prompt sets (turns, categories,
    languages), the new tokens per turn, and where timings were taken (device, dtype, the target's backend,
    threads).

    record: the record cells' rows (RECORD_COLUMNS), for frames that do not carry prompts and token limits
    themselves (coverage results are computed from those traces)."""
    src = frame
    if record is not None and not record.is_empty():
        src = record
        for col in ("model", "prompt_set"):
            if col in frame.columns and col in record.columns:
                src = src.filter(pl.col(col).is_in(_values(frame, col)))
    models = _values(frame, "model")
    names = _values(frame, "model_name")
    who = ", ".join(models) or "?"
    if names and names != models:
        who += f" ({', '.join(names)})"
    lines = [f"model: {who}"]
    sets = []
    for name in _values(src, "prompt_set"):
        part = src.filter(pl.col("prompt_set") == name)
        bits = []
        if {"prompt_id", "turn"} <= set(part.columns):
            bits.append(f"{part.select('prompt_id', 'turn').unique().height} turns")
        for col, word in (("category", "categories"), ("language", "languages")):
            n = len(_values(part, col))
            if n > 1:
                bits.append(f"{n} {word}")
        sets.append(f"{name} ({', '.join(bits)})" if bits else name)
    if sets:
        lines.append("prompts: " + "; ".join(sets))
    if not sets and {"curve", "prompts", "grid"} <= set(frame.columns):     # calibrate cells (engine.jobs.calibrate)
        grids = "; ".join(", ".join(map(str, json.loads(g))) for g in _values(frame, "grid") if g != "null")
        grids = grids or "the device's default grid"
        warm = _values(frame, "warmup")
        lines.append(f"prompts: {'/'.join(map(str, _values(frame, 'prompts')))} training-corpus prompts (English)"
                     + (f" after {'/'.join(map(str, warm))} warm-up" if warm else "") + f"; draft sizes g = {grids}")
    tokens = _span(_values(src, "max_new_tokens"), "new tokens per turn")
    if tokens:
        lines.append(tokens + (", greedy" if "temperature" not in frame.columns
                               or set(_values(frame, "temperature")) <= {0.0} else ""))
    where = []
    for col, fmt in (("device", "{}"), ("dtype", "{}"), ("backend", "{} target forward"),
                     ("threads", "torch threads: {}")):
        vals = _values(frame, col)
        if vals:
            where.append(fmt.format("/".join(str(v) for v in vals)))
    if "timed_alone" in frame.columns:            # sweeps.run: how each timed cell shared its machine
        alone = set(frame["timed_alone"].unique().to_list())
        if False in alone:
            where.append("cells timed beside other cells on their machine")
        elif alone == {True}:
            where.append("each cell timed alone on its machine")
        elif True in alone:
            where.append("cells timed alone, but older rows do not say how")
    if where:
        lines[0] += " on " + ", ".join(where)
    return lines


# ----------------------------------------------------------------------------------------------------------
# Coverage tables (model-free coverage cells)
# ----------------------------------------------------------------------------------------------------------

def _weighted(frame: pl.DataFrame, keys: Sequence[str], columns: Sequence[str], weight: str = "tokens"
              ) -> pl.DataFrame:
    """Per `keys`: `columns` averaged with weight `weight` (micro-averages over generated tokens), and the
    summed weight."""
    w = pl.col(weight)
    return (frame.group_by(*keys, maintain_order=True)
            .agg(*[((pl.col(c) * w).sum() / w.filter(pl.col(c).is_not_null()).sum()).alias(c) for c in columns],
                 w.sum().alias(weight)))


def _analysis(cov: pl.DataFrame | None, analysis: str, what: str, *columns: str) -> pl.DataFrame | None:
    if not _present(cov, what, "analysis"):
        return None
    rows = cov.filter(pl.col("analysis") == analysis)
    if rows.is_empty():
        print(f"skipped {what}: the sweep ran no {analysis!r} coverage cells ([coverage] analyses)")
        return None
    if not _present(rows, what, *columns):
        return None
    return with_task(rows)


def default_point(rows: pl.DataFrame) -> pl.DataFrame:
    """The rows at the papers' stream (k_pre = k_ver = 3, sources ctx+ext, MicroSpec §3.2) when the sweep
    has it, else at the sweep's largest k_pre / k_ver and first sources value (printed)."""
    want = {"k_pre": DEFAULTS.k_pre, "k_ver": DEFAULTS.k_ver, "sources": DEFAULTS.sources}
    for col, value in want.items():
        if col not in rows.columns:
            continue
        have = _values(rows, col)
        if value not in have and have:
            value = have[-1] if col != "sources" else have[0]
            print(f"note: no {col} = {want[col]!r} in this sweep; drawing {col} = {value!r}")
        rows = rows.filter(pl.col(col) == value)
    return rows


def coverage_vs_vocab(cov: pl.DataFrame | None) -> pl.DataFrame | None:
    """MicroSpec Fig. 1(b): per task, the window's coverage at its mean active vocabulary for every w_max
    (`series` = WINDOW, one row per w_max) and the static shortlist's coverage at every K (`series` =
    STATIC). Columns: model, prompt_set, task, panel, series, vocab, coverage, w_max, k, tokens."""
    what = "coverage vs vocabulary size"
    window = _analysis(cov, "window", what, "w_max", "coverage", "mean_active_vocab", "tokens")
    if window is None:
        return None
    keys = ["model", "prompt_set", "task", "panel"]
    win = _weighted(default_point(window), [*keys, "w_max"], ["coverage", "mean_active_vocab"])
    parts = [win.select(*keys, pl.lit(WINDOW).alias("series"), pl.col("mean_active_vocab").alias("vocab"),
                        "coverage", pl.col("w_max").cast(pl.Int64), pl.lit(None, pl.Int64).alias("k"), "tokens")]
    static = cov.filter(pl.col("analysis") == "shortlist")
    if static.is_empty() or "k" not in static.columns:
        print("note: no shortlist coverage cells: drawing the window only ([coverage] analyses += 'shortlist')")
    else:
        st = _weighted(with_task(static), [*keys, "k"], ["coverage"])
        parts.append(st.select(*keys, pl.lit(STATIC).alias("series"), pl.col("k").cast(pl.Float64).alias("vocab"),
                               "coverage", pl.lit(None, pl.Int64).alias("w_max"), pl.col("k").cast(pl.Int64),
                               "tokens"))
    return pl.concat(parts, how="vertical_relaxed").sort(*keys, "series", "vocab")


def miss_ratios(cov: pl.DataFrame | None) -> pl.DataFrame | None:
    """LRU vocabulary of C tokens against the FIFO window of equal mean size (`locality.miss_ratio_curves`),
    per task, long: policy (LRU | FIFO), mean_active_vocab, miss_ratio, capacity, w_max."""
    rows = _analysis(cov, "miss_ratio", "LRU vs FIFO", "capacity", "lru_miss_ratio", "fifo_miss_ratio", "tokens")
    if rows is None:
        return None
    keys = ["model", "prompt_set", "task", "panel", "capacity"]
    agg = _weighted(default_point(rows), keys, ["lru_mean_active_vocab", "lru_miss_ratio", "fifo_w_max",
                                                 "fifo_mean_active_vocab", "fifo_miss_ratio"])
    return pl.concat([
        agg.select(*keys, pl.lit(LRU).alias("policy"),
                   pl.col("lru_mean_active_vocab").alias("mean_active_vocab"),
                   pl.col("lru_miss_ratio").alias("miss_ratio"), pl.lit(None, pl.Float64).alias("w_max"), "tokens"),
        agg.select(*keys, pl.lit(FIFO).alias("policy"),
                   pl.col("fifo_mean_active_vocab").alias("mean_active_vocab"),
                   pl.col("fifo_miss_ratio").alias("miss_ratio"), pl.col("fifo_w_max").alias("w_max"), "tokens"),
    ])


def window_coverage(cov: pl.DataFrame | None, by: Sequence[str] = (), at_default: bool = True
                    ) -> pl.DataFrame | None:
    """Window coverage and mean active vocabulary per w_max, micro-averaged over the tasks of each prompt
    set (or per `by`, e.g. ("task",)); `at_default=False` keeps every (k_pre, k_ver, sources) point of the
    grid with a `stream` label "k_pre=.., k_ver=..". Columns: model, prompt_set, *by, [stream, k_pre, k_ver,
    sources], w_max, coverage, mean_active_vocab, tokens."""
    rows = _analysis(cov, "window", "window coverage", "w_max", "coverage", "mean_active_vocab", "tokens")
    if rows is None:
        return None
    keys = ["model", "prompt_set", *by]
    if at_default:
        rows = default_point(rows)
    else:
        rows = rows.with_columns(stream=pl.format("k_pre={}, k_ver={}", "k_pre", "k_ver")
                                 + pl.when(pl.col("sources").n_unique() > 1).then(" · " + pl.col("sources"))
                                 .otherwise(pl.lit("")))
        keys += ["stream", "k_pre", "k_ver", "sources"]
    return _weighted(rows, [*keys, "w_max"], ["coverage", "mean_active_vocab"]).sort(*keys, "w_max")


def languages_only(frame: pl.DataFrame | None, what: str) -> pl.DataFrame | None:
    """The rows of prompt sets that hold several languages (the multilingual set), or None (printed)."""
    if not _present(frame, what, "prompt_set", "language"):
        return None
    sets = (frame.group_by("prompt_set").agg(pl.col("language").n_unique().alias("n"))
            .filter(pl.col("n") > 1)["prompt_set"].to_list())
    if not sets:
        print(f"skipped {what}: no prompt set with several languages (add the multilingual set, split = "
              f"\"language\")")
        return None
    return frame.filter(pl.col("prompt_set").is_in(sets))


def distances(cov: pl.DataFrame | None, multilingual: bool = True) -> pl.DataFrame | None:
    """Reuse / stack distance histograms (`locality.distance_histograms`, power-of-two bins) per task,
    counts summed over cells and re-normalised; `new_fraction` = tokens never seen before (no bin).
    `multilingual`: only the prompt sets with several languages. Columns: model, prompt_set, task, panel,
    stream, metric, bin_lo, bin_hi, count, fraction, cum_fraction, new_fraction, tokens (the generated
    tokens of the task's cells: every bin's count and the never-seen ones)."""
    rows = _analysis(cov, "distances", "reuse distances", "metric", "stream", "bin_lo", "count")
    if rows is None:
        return None
    if multilingual:
        rows = languages_only(rows, "reuse distances across languages")
        if rows is None:
            return None
    keys = ["model", "prompt_set", "task", "panel", "stream", "metric"]
    counts = (default_point(rows).group_by(*keys, "bin_lo", "bin_hi").agg(pl.col("count").sum())
              .with_columns(total=pl.col("count").sum().over(keys)))
    new = (counts.filter(pl.col("bin_lo").is_null())
           .select(*keys, (pl.col("count") / pl.col("total")).alias("new_fraction")))
    seen = (counts.filter(pl.col("bin_lo").is_not_null()).sort(*keys, "bin_lo")
            .with_columns(fraction=pl.col("count") / pl.col("total"))
            .with_columns(cum_fraction=pl.col("fraction").cum_sum().over(keys)))
    return (seen.join(new, on=keys, how="left").with_columns(pl.col("new_fraction").fill_null(0.0))
            .rename({"total": "tokens"}))


# ----------------------------------------------------------------------------------------------------------
# Bench tables
# ----------------------------------------------------------------------------------------------------------

def _config_fields(text) -> dict:
    try:
        return json.loads(text) if isinstance(text, str) and text else {}
    except json.JSONDecodeError:
        return {}


def with_run(bench: pl.DataFrame) -> pl.DataFrame:
    """Add `run`: one label per benched configuration - the method, and for a drafter with an LM head its
    vocabulary policy and requested size ("layerskip · full", "layerskip · microspec 3072"), and the grid
    fields that vary between the method's cells ("k_pre=1").
    Also `task` and `panel` (`with_task`)."""
    frame = bench.drop("run", strict=False)
    size = pl.when(pl.col("vocab_size").is_not_null()).then(" " + pl.col("vocab_size").cast(pl.String)).otherwise(
        pl.lit(""))
    policy = pl.col("method") + " · " + pl.col("policy").fill_null("full") + size
    base = pl.when(pl.col("method").is_in(DRAFTERS)).then(policy).otherwise(pl.col("method"))
    frame = frame.with_columns(run=base)
    if "config" in frame.columns:
        pairs = frame.select("method", "config").unique().to_dicts()
        fields = {(p["method"], p["config"]): _config_fields(p["config"]) for p in pairs}
        vary: dict[str, set] = {}
        for method in {m for m, _ in fields}:
            dicts = [d for (m, _), d in fields.items() if m == method]
            keys = set().union(*dicts) if dicts else set()
            vary[method] = {k for k in keys if len({json.dumps(d.get(k), sort_keys=True) for d in dicts}) > 1}
        extra = {key: ", ".join(f"{k}={d.get(k)}" for k in sorted(vary[key[0]])) for key, d in fields.items()}
        if any(extra.values()):
            lookup = pl.DataFrame({"method": [k[0] for k in extra], "config": [k[1] for k in extra],
                                   "_extra": list(extra.values())}, schema_overrides={"config": pl.String})
            frame = (frame.join(lookup, on=["method", "config"], how="left", nulls_equal=True)
                     .with_columns(run=pl.when(pl.col("_extra") != "").then(pl.col("run") + " (" + pl.col("_extra")
                                                                           + ")").otherwise(pl.col("run")))
                     .drop("_extra"))
    return with_task(frame)


def method_summary(bench: pl.DataFrame | None) -> pl.DataFrame | None:
    """MicroSpec Table 2 / Fig. 4 in tidy form: `engine.metrics.table2_summary` of the bench rows with the
    sweep's run labels (`with_run`) - per model, prompt set, task and run: rows, tokens_per_s, tau, speedup
    over ar on the same model, prompt set and task, draft_ms and <phase>_ms per drafted step, draft_coverage,
    and one more row per (model, prompt set, run) with task = AVG, the mean over tasks (Table 2's "Avg. Speed"
    and "Avg. Len.")."""
    if not _present(bench, "the method comparison", "method", "tokens_per_s", "tau", "new_tokens", "steps"):
        return None
    if bench.filter(pl.col("method") == "ar").is_empty():
        print("note: no ar runs in this sweep: speedup is not defined (add \"ar\" to a [[bench]] entry)")
    return table2_summary(with_run(bench)).join(run_extras(bench), on=["model", "prompt_set", "run"], how="left")


def run_extras(bench: pl.DataFrame) -> pl.DataFrame:
    """Per (model, prompt set, run): `draft_size`, the draft size the run's rows drafted with as text ("60",
    "48-60" where cells differ, "60, config" with the rows' `draft_size_source`; null where no row says,
    e.g. ar or a bench from before the column), and `languages`, the distinct languages of the prompt set's
    rows (a set split by language has several: its tasks are languages)."""
    frame = with_run(bench)
    size = (pl.col("draft_size").cast(pl.Int64) if "draft_size" in frame.columns else pl.lit(None, pl.Int64))
    source = (pl.col("draft_size_source").cast(pl.String) if "draft_size_source" in frame.columns
              else pl.lit(None, pl.String))
    lang = pl.col("language") if "language" in frame.columns else pl.lit(None, pl.String)
    frame = frame.with_columns(_size=size, _source=source, _lang=lang)
    per = frame.group_by("model", "prompt_set", "run").agg(
        lo=pl.col("_size").min(), hi=pl.col("_size").max(),
        source=pl.col("_source").drop_nulls().unique().sort().str.join("/"))
    text = (pl.when(pl.col("lo") == pl.col("hi")).then(pl.col("lo").cast(pl.String))
            .otherwise(pl.format("{}-{}", "lo", "hi")))
    text = pl.when(pl.col("source") != "").then(pl.format("{}, {}", text, "source")).otherwise(text)
    langs = frame.group_by("model", "prompt_set").agg(languages=pl.col("_lang").drop_nulls().n_unique())
    return (per.select("model", "prompt_set", "run", draft_size=pl.when(pl.col("lo").is_not_null()).then(text))
            .join(langs, on=["model", "prompt_set"], how="left"))


def one_head_tables(bench: pl.DataFrame | None) -> list[tuple[str, pl.DataFrame, list[str]]]:
    """Table 2 on one head: per model, prompt set and drafter (DRAFTERS) benched with two or more vocabulary
    policies, `engine.metrics.summarize` of its runs and ar's over every row (the ALL rows: run, policy,
    vocab_size, draft_size (`run_extras`), rows, tokens_per_s, speedup, tau, mean_active_vocab, draft_ms, the
    phases some run spent time in, lossless) and `comparison_lines` (draft-time, tau and tokens/s ratios against
    full; microspec against frspec and dynaspec; dynaspec against frspec). A list of ("model · prompt set ·
    drafter", table with model and prompt_set first, lines); empty (printed) when no drafter ran two policies."""
    out = []
    if bench is not None and {"policy", "vocab_size"} <= set(bench.columns):
        runs = with_run(bench)
        for (model, prompt_set, method), part in runs.filter(pl.col("method").is_in(DRAFTERS)).group_by(
                "model", "prompt_set", "method", maintain_order=True):
            if part["policy"].n_unique() < 2:
                continue
            rows = runs.filter((pl.col("model") == model) & (pl.col("prompt_set") == prompt_set)
                               & pl.col("method").is_in(["ar", method]))
            table = summarize(rows).filter(pl.col("task") == "all")
            phases = [c for c in PHASE_MS if (table[c].fill_null(0.0) > 0).any()]
            sizes = run_extras(rows).select("run", "draft_size")
            shown = table.join(sizes, on="run", how="left").select(
                pl.lit(model).alias("model"), pl.lit(prompt_set).alias("prompt_set"), "run", "policy", "vocab_size",
                "draft_size", "rows", "tokens_per_s", "speedup", "tau", "mean_active_vocab", "draft_ms", *phases,
                "lossless")
            out.append((f"{model} · {prompt_set} · {method}", shown, comparison_lines(compare_vocabs(table, rows))))
    if not out:
        print("skipped Table 2 on one head: no drafter was benched with two or more vocabulary policies")
    return out


def run_order(summary: pl.DataFrame) -> list[str]:
    """The runs in `method_summary`'s order (ar first, then training-free methods, then drafters)."""
    return summary["run"].unique(maintain_order=True).to_list()


def task_order(summary: pl.DataFrame) -> list[str]:
    """The tasks sorted, AVG last."""
    tasks = _values(summary.filter(pl.col("task") != AVG), "task")
    return tasks + ([AVG] if AVG in set(summary["task"].to_list()) else [])


DRAFT_SIZE = "draft size"          # the column of `methods_wide` / `table_cells` naming each run's draft size


def methods_wide(summary: pl.DataFrame) -> pl.DataFrame:
    """MicroSpec Table 2's layout: one row per (model, prompt set, run), its draft size (`run_extras`),
    tokens/s per task, then the average - the unweighted mean over tasks - of tokens/s, its speedup over ar
    with its 95% bootstrap interval over the tasks (lo, hi), the decode phase's speedup (`engine.metrics`: the
    prefill and the drafter's pass over the prompt left out) with its interval, and the average tau."""
    tasks = [t for t in task_order(summary) if t != AVG]
    keys = ["model", "prompt_set", "run"]
    wide = (summary.filter(pl.col("task") != AVG).pivot("task", index=keys, values="tokens_per_s",
                                                        aggregate_function="first")
            .select(*keys, *[pl.col(t).round(1) for t in tasks if t in summary["task"].to_list()]))
    if "draft_size" in summary.columns:
        sizes = summary.group_by(keys).agg(pl.col("draft_size").first().alias(DRAFT_SIZE))
        wide = sizes.join(wide, on=keys, how="right").select(*keys, DRAFT_SIZE, pl.exclude(*keys, DRAFT_SIZE))
    avg = summary.filter(pl.col("task") == AVG).select(
        *keys, pl.col("tokens_per_s").round(1).alias("avg tokens/s"), pl.col("speedup").round(2),
        pl.col("speedup_lo").round(2).alias("speedup lo"), pl.col("speedup_hi").round(2).alias("speedup hi"),
        pl.col("decode_speedup").round(2).alias("decode speedup"),
        pl.col("decode_speedup_lo").round(2).alias("decode lo"), pl.col("decode_speedup_hi").round(2).alias("decode hi"),
        pl.col("tau").round(2).alias("avg tau"))
    order = pl.DataFrame({"run": run_order(summary)}).with_row_index("_r")
    return wide.join(avg, on=keys, how="left").join(order, on="run").sort("model", "prompt_set", "_r").drop("_r")


def table_cells(summary: pl.DataFrame) -> pl.DataFrame:
    """`methods_wide` as long cells for a drawn table: column ("draft size", "<task>" tokens/s, "avg tokens/s
    (× ar)", "95% CI (× ar)", "decode × ar", "decode 95% CI", "avg tau"), text and the speedup that colours
    the cell (the decode phase's for its columns, null for draft size and tau). The intervals are
    `engine.metrics`' speedup_lo / _hi: bootstrap over the tasks."""
    cells = summary.select(
        "model", "prompt_set", "run", "task", "speedup",
        column=pl.when(pl.col("task") == AVG).then(pl.lit("avg tokens/s (× ar)")).otherwise(pl.col("task")),
        text=pl.when(pl.col("task") == AVG).then(
            pl.format("{} ({}×)", pl.col("tokens_per_s").round(1), pl.col("speedup").round(2).fill_null(float("nan"))))
        .otherwise(pl.col("tokens_per_s").round(1).cast(pl.String)))
    avg = summary.filter(pl.col("task") == AVG)
    decode = avg.select(
        "model", "prompt_set", "run", task=pl.lit("decode × ar"), speedup=pl.col("decode_speedup"),
        column=pl.lit("decode × ar"),
        text=pl.format("{}×", pl.col("decode_speedup").round(2).fill_null(float("nan"))))
    tau = avg.select(
        "model", "prompt_set", "run", task=pl.lit("avg tau"), speedup=pl.lit(None, pl.Float64),
        column=pl.lit("avg tau"), text=pl.col("tau").round(2).cast(pl.String))

    def interval(name: str, column: str, measure: str) -> pl.DataFrame:
        lo, hi = (pl.col(f"{measure}_{e}").map_elements(lambda v: f"{v:.2f}", return_dtype=pl.String)
                  .fill_null("-") for e in ("lo", "hi"))
        return avg.select("model", "prompt_set", "run", task=pl.lit(name), speedup=pl.col(measure),
                          column=pl.lit(column), text=pl.format("{}-{}", lo, hi))
    size = avg.select("model", "prompt_set", "run", task=pl.lit(DRAFT_SIZE), speedup=pl.lit(None, pl.Float64),
                      column=pl.lit(DRAFT_SIZE),
                      text=(pl.col("draft_size") if "draft_size" in avg.columns else pl.lit(None, pl.String))
                      .fill_null("-"))
    return pl.concat([size, cells, interval("ci", "95% CI (× ar)", "speedup"), decode,
                      interval("decode ci", "decode 95% CI", "decode_speedup"), tau], how="vertical_relaxed")


def phase_times(summary: pl.DataFrame | None) -> pl.DataFrame | None:
    """MicroSpec Fig. 4: draft ms per drafted step by phase (backbone, gather, lm_head, tree), long, for the
    runs of drafters that time their phases (layerskip, eagle)."""
    if summary is None:
        return None
    cols = [f"{p}_ms" for p in PHASES]
    # drafters with a backbone and an LM head (a tree-only drafter such as unispec has nothing to split)
    rows = summary.filter((pl.col("backbone_ms").fill_null(0) + pl.col("lm_head_ms").fill_null(0)) > 0)
    if rows.is_empty():
        print("skipped the draft-time breakdown: no drafter with phase timings ran (bench layerskip or eagle)")
        return None
    return (rows.unpivot(index=["model", "prompt_set", "task", "panel", "run", "method", "policy", "vocab_size",
                                "draft_ms"], on=cols, variable_name="phase", value_name="ms")
            .with_columns(pl.col("phase").str.strip_suffix("_ms")))


def wmax_sweep(bench: pl.DataFrame | None) -> pl.DataFrame | None:
    """MicroSpec Fig. 5: per model, prompt set and drafter (method and its grid fields), the microspec runs
    at every w_max (`vocab_size`): tokens_per_s (the mean over rows), tau, draft_coverage (token-weighted: the
    share of all generated tokens, every task pooled, inside the draft vocabulary), rows and new_tokens (their
    sum), with the same drafter's full-vocabulary tokens_per_s and tau as `full_tokens_per_s`, `full_tau` and
    ar's on the same model and prompt set as `ar_tokens_per_s` (null when not benched). Only where at least
    two w_max values ran."""
    if not _present(bench, "the w_max sweep", "policy", "vocab_size"):
        return None
    frame = with_run(bench)
    drafter = pl.col("method") + pl.col("run").str.extract(r"(\(.*\))$").fill_null("")
    frame = frame.with_columns(drafter=drafter)
    keys = ["model", "prompt_set", "drafter"]
    per = (lambda f: f.agg(tokens_per_s=tokens_per_s(), tau=tau(), draft_coverage=draft_coverage(), rows=pl.len(),
                           new_tokens=pl.col("new_tokens").sum()))
    micro = per(frame.filter(pl.col("policy") == "microspec").group_by(*keys, "vocab_size"))
    micro = micro.filter(pl.col("vocab_size").n_unique().over(keys) >= 2)
    if micro.is_empty():
        print("skipped the w_max sweep: no drafter benched with microspec at two or more w_max values "
              "([[bench]] policies = [\"microspec\"], vocab_sizes = [1024, 2048, 3072, 4096, 8192])")
        return None
    full = per(frame.filter(pl.col("policy") == "full").group_by(*keys)).select(
        *keys, full_tokens_per_s="tokens_per_s", full_tau="tau")
    ar = frame.filter(pl.col("method") == "ar").group_by("model", "prompt_set").agg(ar_tokens_per_s=tokens_per_s())
    return (micro.join(full, on=keys, how="left").join(ar, on=["model", "prompt_set"], how="left")
            .rename({"vocab_size": "w_max"})
            .with_columns(default=pl.col("w_max") == DEFAULTS.w_max).sort(*keys, "w_max"))


def k_sweep(bench: pl.DataFrame | None) -> pl.DataFrame | None:
    """tau and tokens/s of the microspec runs against k_pre and k_ver, where the bench grid varied them
    (`params = { k_pre = [1, 3] }`); None (printed) when it did not."""
    if not _present(bench, "the k_pre / k_ver bench sweep", "policy"):
        return None
    have = [k for k in ("k_pre", "k_ver") if k in bench.columns]
    rows = bench.filter(pl.col("policy") == "microspec")
    axes = [k for k in have if rows[k].drop_nulls().n_unique() > 1] if have else []
    if rows.is_empty() or not axes:
        print("note: the bench grid does not vary k_pre or k_ver (coverage cells show them model-free below)")
        return None
    frame = with_run(rows)
    out = []
    for k in axes:
        out.append(frame.group_by("model", "prompt_set", "vocab_size", pl.col(k).cast(pl.Int64).alias("k"))
                   .agg(tokens_per_s=tokens_per_s(), tau=tau())
                   .with_columns(parameter=pl.lit(k)))
    return pl.concat(out).sort("model", "prompt_set", "parameter", "vocab_size", "k")


def language_speedup(summary: pl.DataFrame | None) -> pl.DataFrame | None:
    """UniSpec Fig. 4: `method_summary`'s rows of the prompt sets with several languages (task = the
    language), speedup over ar and tau per run, the AVG rows included; a vocabulary policy benched at several
    sizes shows its default size only (the paper's w_max 3072, FR-Spec's K 32768) when that ran. None (one
    printed line) when no prompt set holds several languages (`run_extras`' `languages`; the tasks of a
    Spec-Bench set are categories)."""
    if summary is None:
        return None
    many = pl.col("languages").fill_null(0) > 1 if "languages" in summary.columns else pl.lit(True)
    langs = summary.filter((pl.col("task") != AVG) & many).group_by("prompt_set").agg(n=pl.col("task").n_unique())
    bench_sets = [s for s in langs.filter(pl.col("n") > 1)["prompt_set"].to_list()]
    rows = summary.filter(pl.col("prompt_set").is_in(bench_sets))
    if "multilingual" in bench_sets:
        rows = rows.filter(pl.col("prompt_set") == "multilingual")
    if rows.is_empty():
        print("skipped speedup per language: no bench cells on a prompt set with several languages (add the "
              "multilingual set, split = \"language\")")
        return None
    # a policy benched at several sizes (the w_max sweep, drawn in 02): only its default size, if it ran
    default = pl.col("policy").replace_strict({"frspec": DEFAULTS.frspec_k, "microspec": DEFAULTS.w_max,
                                               "oracle": DEFAULTS.w_max}, default=None, return_dtype=pl.Int64)
    group = ["model", "method", "policy"]
    swept = (pl.col("vocab_size").n_unique().over(group) > 1) & (default == pl.col("vocab_size")).any().over(group)
    return rows.filter(~swept | (pl.col("vocab_size") == default))


# ----------------------------------------------------------------------------------------------------------
# UniSpec: acceptance by confidence, calibration
# ----------------------------------------------------------------------------------------------------------

def confidence_bins(bench: pl.DataFrame | None) -> pl.DataFrame | None:
    """UniSpec Fig. 3: per model and method, draft nodes proposed and accepted per confidence-score bin
    (`engine.harness.SCORE_BINS` equal bins over [0, 1], as many as the rows' lists hold) summed over every
    bench row: acceptance_rate = accepted / proposed, density = proposed / all proposed. Methods whose every
    node sits in one bin (no confidence score, e.g. pld) are left out (printed)."""
    if not _present(bench, "acceptance vs confidence", "score_bins_proposed", "score_bins_accepted"):
        return None
    rows = bench.filter(pl.col("score_bins_proposed").is_not_null())
    if rows.is_empty():
        print("skipped acceptance vs confidence: no bench row counted confidence bins")
        return None
    frame = (rows.select("model", "method", "score_bins_proposed", "score_bins_accepted",
                         n_bins=pl.col("score_bins_proposed").list.len())
             .with_columns(bin=pl.int_ranges(0, pl.col("n_bins")))
             .explode("score_bins_proposed", "score_bins_accepted", "bin")
             .group_by("model", "method", "n_bins", "bin")
             .agg(proposed=pl.col("score_bins_proposed").sum(), accepted=pl.col("score_bins_accepted").sum()))
    frame = frame.with_columns(bin_lo=pl.col("bin") / pl.col("n_bins"), bin_hi=(pl.col("bin") + 1) / pl.col("n_bins"),
                               acceptance_rate=pl.when(pl.col("proposed") > 0)
                               .then(pl.col("accepted") / pl.col("proposed")),
                               density=pl.col("proposed") / pl.col("proposed").sum().over("model", "method"))
    spread = frame.filter(pl.col("proposed") > 0).group_by("model", "method").agg(n=pl.len())
    keep = spread.filter(pl.col("n") > 1).select("model", "method")
    dropped = sorted(set(spread.filter(pl.col("n") <= 1)["method"].to_list()))
    if dropped:
        print(f"note: {dropped} propose every node at one score (no confidence estimate): left out")
    out = frame.join(keep, on=["model", "method"]).sort("model", "method", "bin")
    if out.is_empty():
        print("skipped acceptance vs confidence: no method with confidence scores drafted anything")
        return None
    return out


QUANTITIES = {"tau": "τ(g): tokens per step", "s_step_ms": "s(g): ms per step",
              "tokens_per_s": "τ/s: tokens per second"}


FIT_POINTS = 50        # points per fitted curve in the calibration figure


def calibration_curves(cal: pl.DataFrame | None) -> pl.DataFrame | None:
    """UniSpec App. F / Fig. 5: the calibrate cells' measured tau(g), s(g), tau/s and their fits, long
    (`quantity` one of QUANTITIES' labels, `value`), `curve` measured | fit | g_star, `setting` = model ·
    method · device (dtype)."""
    if not _present(cal, "the calibration fits", "curve", "g", "tau", "s_step_ms", "tokens_per_s"):
        return None
    frame = cal.with_columns(setting=_setting(cal))
    # the fits are smooth: FIT_POINTS per setting draw them, and keep a sweep with many calibrate cells under
    # Vega-Lite's inline row limit (altair's MaxRowsError at 5000 rows)
    step = (pl.len().over("setting", "curve") // FIT_POINTS).clip(lower_bound=1)
    frame = frame.filter((pl.col("curve") != "fit") | (pl.int_range(pl.len()).over("setting", "curve") % step == 0))
    return (frame.unpivot(index=["setting", "model", "method", "device", "curve", "g", "g_star"],
                          on=list(QUANTITIES), variable_name="quantity", value_name="value")
            .with_columns(pl.col("quantity").replace_strict(QUANTITIES)).sort("setting", "quantity", "curve", "g"))


def _setting(frame: pl.DataFrame | None = None) -> pl.Expr:
    """"model · method[ · policy[:size]] · device (dtype)": calibrate cells of one method differ by their
    vocabulary policy (eagle full / frspec / microspec:3072 ...), so the label names it where the frame has it."""
    policy = pl.lit("")
    if frame is not None and "policy" in frame.columns:
        size = (pl.lit(":") + pl.col("vocab_size").cast(pl.Int64).cast(pl.Utf8)) if "vocab_size" in frame.columns \
            else pl.lit("")
        policy = pl.when(pl.col("policy").is_null() | (pl.col("policy") == "full")).then(pl.lit("")).otherwise(
            pl.lit(" · ") + pl.col("policy") + size.fill_null(""))
    return pl.format("{} · {}{} · {} ({})", pl.col("model"), pl.col("method"), policy,
                     pl.col("device").fill_null("?"), pl.col("dtype").fill_null("default dtype"))


def g_stars(cal: pl.DataFrame | None) -> pl.DataFrame | None:
    """UniSpec Fig. 5: g* per model, method and device (one row per calibrate cell), with the predicted
    tokens/s at g*."""
    if not _present(cal, "g* per device", "g_star", "device"):
        return None
    cols = [c for c in ("predicted_tokens_per_s", "g_continuous", "threads") if c in cal.columns]
    keys = ["model", "method", "device", "dtype", *[c for c in ("policy", "vocab_size") if c in cal.columns],
            "cell_id"]
    out = cal.group_by(keys).agg(pl.col("g_star").first(), *[pl.col(c).first() for c in cols])
    return out.with_columns(setting=_setting(out)).sort("model", "method", "device", "setting")


# ----------------------------------------------------------------------------------------------------------
# DynaSpec: the choices the paper leaves open (`python -m specvocab.engine.jobs.dynaspec_choices`)
# ----------------------------------------------------------------------------------------------------------

# the factors `engine.jobs.dynaspec_choices.choice_settings` varies one at a time, and their facet titles
CHOICE_FACTORS = {"num_clusters": "M (clusters)", "router_width": "router width", "top_l": "L (label top-L)"}
CHOICES_COMMAND = "python -m specvocab.engine.jobs.dynaspec_choices --work-dir FITWORK --out {folder}"
CHOICES_COLUMNS = ("model", "drafter", *CHOICE_FACTORS, "logged_top_l", "scorer", "budget", "budget_tokens",
                   "k_max", "token_recall", "top1_hit", "mean_row_vocab", "train_s", "kmeans_s")


def read_choices(folder: str | Path) -> pl.DataFrame | None:
    """The Parquet files `python -m specvocab.engine.jobs.dynaspec_choices --out FOLDER` wrote (one per setting), or None with
    one printed line saying how to make them."""
    files = sorted(Path(folder).expanduser().glob("*.parquet"))
    if not files:
        print(f"skipped the DynaSpec choices: no Parquet files in {folder}; make them with `"
              f"{CHOICES_COMMAND.format(folder=folder)}` (FITWORK: the work dir of `python -m specvocab.engine.jobs.fit_dynaspec`, "
              f"<fitted file>.work)")
        return None
    frame = pl.read_parquet(files)
    return frame if _present(frame, "the DynaSpec choices", *CHOICES_COLUMNS) else None


CENTRE_COLUMNS = ("centre_num_clusters", "centre_router_width", "centre_top_l")   # written by the choices job


def choices_centre(frame: pl.DataFrame) -> tuple[int, int, int]:
    """The centre (M, router width, L) a choices sweep varied its factors around (one fit's rows).

    Read from the rows where the job wrote it (CENTRE_COLUMNS: `engine.jobs.dynaspec_choices` records the fit's
    M and L and the width it centred on). In a folder written before those columns: one factor at a time, the
    centre's value of a factor is in every setting of the other factors' groups, so it is the value shared by
    the most distinct settings. A tie happens only when no other factor varied; then L is the fit's logged L
    (`logged_top_l`, the L the job centres on) and M the fit's own clusters (kmeans_s == 0: reused, not re-run),
    each when present, else (and for the width) the smallest tied value."""
    if set(CENTRE_COLUMNS) <= set(frame.columns):
        centres = frame.select(*CENTRE_COLUMNS).drop_nulls().unique()
        if centres.height == 1:
            return tuple(int(v) for v in centres.row(0))
    settings = frame.group_by(*CHOICE_FACTORS).agg(kmeans_s=pl.col("kmeans_s").max(),
                                                   logged=pl.col("logged_top_l").max())
    prefer = {"num_clusters": set(settings.filter(pl.col("kmeans_s") == 0)["num_clusters"].to_list()),
              "router_width": set(), "top_l": set(settings["logged"].to_list())}
    centre = []
    for col in CHOICE_FACTORS:
        counts = settings.group_by(col).len()
        tied = sorted(counts.filter(pl.col("len") == pl.col("len").max())[col].to_list())
        centre.append(next((v for v in tied if v in prefer[col]), tied[0]) if len(tied) > 1 else tied[0])
    return tuple(centre)


def _fits(frame: pl.DataFrame) -> list[tuple[str, str]]:
    return [tuple(r) for r in frame.select("model", "drafter").unique(maintain_order=True).iter_rows()]


def dynaspec_choices(choices: pl.DataFrame | None, centre: tuple[int, int, int] | None = None
                     ) -> pl.DataFrame | None:
    """DynaSpec's unstated choices (M, router width, L), one factor at a time around the centre
    (`choices_centre` per fit, or `centre` = (M, width, L) for every fit): per fit and `factor`
    (CHOICE_FACTORS' titles), the held-out token recall of each setting at every token budget, DynaSpec-PA
    (scorer "router", budget "position"; `series` = "router"), the centre in every factor, and the static
    baseline of the centre's M and L (`series` = "static", clusters ranked by training-label frequency).
    Settings that differ from the centre in two or more factors are left out (printed). Columns: model,
    drafter, fit, factor, num_clusters, router_width, top_l, value (the factor's), setting (its label, the
    centre's marked), centre, series, budget_tokens, k_max, mean_row_vocab, token_recall, top1_hit,
    cluster_recall, train_s (the router's training seconds; null for the static baseline), rows; None
    (printed) when no fit has rows at its centre, and for None (`read_choices` printed why)."""
    if choices is None or not _present(choices, "the DynaSpec choices", *CHOICES_COLUMNS):
        return None
    parts = []
    for model, drafter in _fits(choices):
        rows = choices.filter((pl.col("model") == model) & (pl.col("drafter") == drafter))
        c = dict(zip(CHOICE_FACTORS, centre or choices_centre(rows)))
        off = sum((pl.col(k) != v).cast(pl.Int32) for k, v in c.items())
        dropped = rows.filter(off > 1).select(*CHOICE_FACTORS).unique().sort(*CHOICE_FACTORS)
        if not dropped.is_empty():
            print(f"note: {model} · {drafter}: {dropped.height} settings differ from the centre "
                  f"(M {c['num_clusters']}, width {c['router_width']}, L {c['top_l']}) in two or more factors: "
                  f"left out ({dropped.rows()})")
        pa = pl.col("budget") == "position"
        at_centre = pl.all_horizontal([pl.col(k) == v for k, v in c.items()])
        if rows.filter(pa & (pl.col("scorer") == "router") & at_centre).is_empty():
            print(f"skipped the DynaSpec choices of {model} · {drafter}: no DynaSpec-PA rows at the centre (M "
                  f"{c['num_clusters']}, width {c['router_width']}, L {c['top_l']})")
            continue
        static = rows.filter(pa & (pl.col("scorer") == "static") & (pl.col("num_clusters") == c["num_clusters"])
                             & (pl.col("top_l") == c["top_l"]))
        widths = static["router_width"].to_list()            # the static scores do not depend on the width
        static = static.filter(pl.col("router_width") == (c["router_width"] if c["router_width"] in widths
                                                            else min(widths, default=0)))
        for order, (col, name) in enumerate(CHOICE_FACTORS.items()):
            others = [pl.col(k) == v for k, v in c.items() if k != col]
            router = rows.filter(pa & (pl.col("scorer") == "router") & pl.all_horizontal(others))
            is_centre = pl.col(col) == c[col]
            label = pl.col(col).cast(pl.String) + pl.when(is_centre).then(pl.lit(" (centre)")).otherwise(pl.lit(""))
            parts.append(router.with_columns(factor=pl.lit(name), factor_order=pl.lit(order), value=pl.col(col),
                                             centre=is_centre, series=pl.lit("router"), setting=label))
            parts.append(static.with_columns(
                factor=pl.lit(name), factor_order=pl.lit(order), value=pl.col(col), centre=pl.lit(False),
                series=pl.lit("static"), setting=pl.lit(f"static baseline (M {c['num_clusters']})"),
                train_s=pl.lit(None, pl.Float64)))                 # no router was trained for it
    if not parts:
        return None
    out = pl.concat(parts, how="diagonal_relaxed").with_columns(fit=pl.format("{} · {}", "model", "drafter"))
    cols = ["model", "drafter", "fit", "factor", "factor_order", *CHOICE_FACTORS, "value", "setting", "centre",
            "series", "budget_tokens", "k_max", "mean_row_vocab", "token_recall", "top1_hit", "cluster_recall",
            "train_s", "rows"]
    return out.select([c for c in cols if c in out.columns]).sort("fit", "factor_order", "series", "value",
                                                                   "budget_tokens")


def choices_table(shaped: pl.DataFrame, near: int = 8192) -> pl.DataFrame:
    """`dynaspec_choices`' rows at the token budget closest to `near` (per fit), one row per setting (the
    centre once, first) and the static baseline last: token_recall, top1_hit, mean_row_vocab, train_s."""
    at = (shaped.group_by("fit").agg(pl.col("budget_tokens").unique())
          .explode("budget_tokens").with_columns(d=(pl.col("budget_tokens") - near).abs())
          .sort("fit", "d", "budget_tokens").group_by("fit", maintain_order=True).first().drop("d"))
    rows = shaped.join(at, on=["fit", "budget_tokens"])
    rows = rows.with_columns(pl.when(pl.col("centre")).then(pl.lit("centre"))
                             .when(pl.col("series") == "static").then(pl.lit("static baseline"))
                             .otherwise(pl.col("factor")).alias("varied"),
                             _o=pl.when(pl.col("centre")).then(-1).when(pl.col("series") == "static").then(9)
                             .otherwise(pl.col("factor_order")))
    return (rows.unique(["fit", "series", *CHOICE_FACTORS], keep="first", maintain_order=True)
            .sort("fit", "_o", "value")
            .select("fit", "budget_tokens", "varied", *CHOICE_FACTORS, "k_max", "token_recall", "top1_hit",
                    "mean_row_vocab", "train_s"))
