"""The coverage figures' tables (`sweeps.tables`), from the model-free coverage cells; polars only.

MicroSpec Fig. 1(b) (`coverage_vs_vocab`: the window against FR-Spec's static shortlist), LRU against FIFO
(`miss_ratios`), the window's coverage per w_max and per (k_pre, k_ver) point (`window_coverage`, notebook 2)
and the reuse distances across languages (`distances`, notebook 5). Words as in `locality`'s glossary: the
*window* is MicroSpec's FIFO suffix of the candidate stream (§3.2, Eq. 4), its `w_max` counted in stream
entries; a *static shortlist* is FR-Spec's top-K of a token ranking counted on the training corpus (§3);
*coverage* = the fraction of generated tokens in the window or shortlist over a recorded trace. Averages are
micro-averages over generated tokens.
"""

from __future__ import annotations

from typing import Sequence

import polars as pl

from specvocab.engine.metrics import with_task
from specvocab.sweeps.tables_common import DEFAULTS, distinct_values, present

WINDOW = "MicroSpec window"
STATIC = "static top-K (FR-Spec)"
LRU = "LRU vocabulary"
FIFO = "FIFO window (MicroSpec)"


def _weighted(frame: pl.DataFrame, keys: Sequence[str], columns: Sequence[str], weight: str = "tokens"
              ) -> pl.DataFrame:
    """Per `keys`: `columns` averaged with weight `weight` (micro-averages over generated tokens), and the
    summed weight."""
    w = pl.col(weight)
    return (frame.group_by(*keys, maintain_order=True)
            .agg(*[((pl.col(c) * w).sum() / w.filter(pl.col(c).is_not_null()).sum()).alias(c) for c in columns],
                 w.sum().alias(weight)))


def _analysis(cov: pl.DataFrame | None, analysis: str, what: str, *columns: str) -> pl.DataFrame | None:
    if not present(cov, what, "analysis"):
        return None
    rows = cov.filter(pl.col("analysis") == analysis)
    if rows.is_empty():
        print(f"skipped {what}: the sweep ran no {analysis!r} coverage cells ([coverage] analyses)")
        return None
    if not present(rows, what, *columns):
        return None
    return with_task(rows)


def default_point(rows: pl.DataFrame) -> pl.DataFrame:
    """The rows at the papers' stream (k_pre = k_ver = 3, sources ctx+ext, MicroSpec §3.2) when the sweep
    has it, else at the sweep's largest k_pre / k_ver and first sources value (printed)."""
    want = {"k_pre": DEFAULTS.k_pre, "k_ver": DEFAULTS.k_ver, "sources": DEFAULTS.sources}
    for col, value in want.items():
        if col not in rows.columns:
            continue
        have = distinct_values(rows, col)
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
    if not present(frame, what, "prompt_set", "language"):
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

