"""The bench figures' tables (`sweeps.tables`), from a sweep's bench rows; polars only.

MicroSpec Table 2 (`method_summary`, laid out by `methods_wide` / `table_cells`), Table 2 on one head
(`one_head_tables`), the draft time by phase (Fig. 4, `phase_times`), the w_max sweep (Fig. 5, `wmax_sweep`),
the k_pre / k_ver bench sweep (`k_sweep`), UniSpec's speedup per language (Fig. 4, `language_speedup`) and the
merged drafter's tau by source (`tau_by_source`).
The measures - tokens/s, speedup over ar, tau (bonus token included, ar = 1.00), draft time per drafted step
and by phase, draft_coverage - are `engine.metrics`' (its docstring names each once); these tables are its
summaries with the sweep's run labels (`with_run`).
"""

from __future__ import annotations

import json

import polars as pl

from specvocab.engine.metrics import (AVG, DRAFTERS, PHASE_MS, PHASES, compare_vocabs, comparison_lines,
                                      draft_coverage, summarize, table2_summary, tau, tokens_per_s, with_task)
from specvocab.engine.methods import MERGE_SOURCES, method_specs
from specvocab.sweeps.tables_common import DEFAULTS, distinct_values, present


def _config_fields(text) -> dict:
    try:
        return json.loads(text) if isinstance(text, str) and text else {}
    except json.JSONDecodeError:
        return {}


def with_run(bench: pl.DataFrame) -> pl.DataFrame:
    """Add `run`: one label per benched configuration - the method's display name (`engine.methods`), and for a
    drafter with an LM head its vocabulary policy and requested size ("layerskip · full", "layerskip ·
    microspec 3072"), and the grid fields that vary between the method's cells ("k_pre=1").
    Also `task` and `panel` (`with_task`)."""
    frame = bench.drop("run", strict=False)
    size = pl.when(pl.col("vocab_size").is_not_null()).then(" " + pl.col("vocab_size").cast(pl.String)).otherwise(
        pl.lit(""))
    name = pl.col("method").replace({s.name: s.display for s in method_specs()})    # display names (engine.methods)
    policy = name + " · " + pl.col("policy").fill_null("full") + size
    base = pl.when(pl.col("method").is_in(DRAFTERS)).then(policy).otherwise(name)
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
    if not present(bench, "the method comparison", "method", "tokens_per_s", "tau", "new_tokens", "steps"):
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
    tasks = distinct_values(summary.filter(pl.col("task") != AVG), "task")
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
    if not present(bench, "the w_max sweep", "policy", "vocab_size"):
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
    if not present(bench, "the k_pre / k_ver bench sweep", "policy"):
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



TARGET_PART = "target"      # `tau_by_source`'s part of tau the target committed itself (each step's bonus token)


def tau_by_source(bench: pl.DataFrame | None) -> pl.DataFrame | None:
    """tau split by the source of its tokens, per model, prompt set, task and run, for the merged drafter's runs
    (`engine.drafters.merged`) beside the runs of its sources alone (pld, unispec, eagle, eagle3): columns
    model, prompt_set, task, run, method, source, tau_part, tau, steps. A merged run's part of source s is
    sum accepted_by_<s> / sum steps (the committed draft tokens s placed, per step); a single-source run's part
    is tau - 1 (its committed draft tokens per step, the prefill's step included); `TARGET_PART` is the rest,
    tau - the sources' parts (the bonus tokens). Task AVG: the mean over tasks of each part and of tau (Table 2's
    average). None (printed) without a merged run."""
    if not present(bench, "tau by source", "method", "new_tokens", "steps"):
        return None
    runs = with_run(bench).filter(pl.col("method").is_in(["merged", *MERGE_SOURCES]))
    if runs.filter(pl.col("method") == "merged").is_empty():
        print("skipped tau by source: no merged run in this bench")
        return None
    cols = {s: f"accepted_by_{s}" for s in MERGE_SOURCES if f"accepted_by_{s}" in runs.columns}
    keys = ["model", "prompt_set", "task", "run", "method"]
    agg = runs.group_by(keys).agg(steps=pl.col("steps").sum(), new_tokens=pl.col("new_tokens").sum(),
                                  **{s: pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).sum())   # sources it ran
                                     for s, c in cols.items()})
    parts = {s: pl.when(pl.col("method") == "merged").then(pl.col(s) / pl.col("steps") if s in cols else None)
             .when(pl.col("method") == s).then((pl.col("new_tokens") - pl.col("steps")) / pl.col("steps"))
             for s in MERGE_SOURCES}
    wide = agg.with_columns(tau=pl.col("new_tokens") / pl.col("steps")).with_columns(
        **{s: e.cast(pl.Float64) for s, e in parts.items()})
    wide = wide.with_columns(**{TARGET_PART: pl.col("tau") - pl.sum_horizontal(*[pl.col(s).fill_null(0.0)
                                                                                 for s in MERGE_SOURCES])})
    long = (wide.unpivot(index=[*keys, "tau", "steps"], on=[*MERGE_SOURCES, TARGET_PART], variable_name="source",
                         value_name="tau_part")
            .filter(pl.col("tau_part").is_not_null()))
    avg = (long.group_by("model", "prompt_set", "run", "method", "source")
           .agg(pl.col("tau_part").mean(), pl.col("tau").mean(), pl.col("steps").sum())
           .with_columns(task=pl.lit(AVG)))
    order = {s: i for i, s in enumerate([*MERGE_SOURCES, TARGET_PART])}
    return (pl.concat([long, avg.select(long.columns)])
            .with_columns(_o=pl.col("source").replace_strict(order, return_dtype=pl.Int64))
            .sort("model", "prompt_set", "task", "method", "run", "_o").drop("_o")
            .select("model", "prompt_set", "task", "run", "method", "source", "tau_part", "tau", "steps"))
