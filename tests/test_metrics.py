"""`engine.metrics`: Table 2 and the measures against bench rows computed by hand.

Each number below is worked out in the test from a handful of rows, and each test names the plausible wrong
definition it rules out (a mean of per-row ratios instead of a ratio of means, tau without the bonus token,
draft time per step instead of per drafted step, coverage unweighted, speedup against another model's ar).
No model runs: the rows are written by hand in ROW_SCHEMA's columns."""

from __future__ import annotations

import polars as pl
import pytest

from specvocab.engine import metrics
from specvocab.engine.metrics import ALL, AVG

# (model, method, run, policy, category, prompt_id, new_tokens, steps, wall_s, draft_s, backbone_s, coverage,
#  mean_active_vocab)
ROWS = [
    # ar: one token per step, tau 1
    ("m", "ar", "full", "full", "writing", "w1", 10, 10, 0.10, 0.0, None, None, None),
    ("m", "ar", "full", "full", "writing", "w2", 12, 12, 0.10, 0.0, None, None, None),
    ("m", "ar", "full", "full", "math", "m1", 8, 8, 0.10, 0.0, None, None, None),
    # pld: 150 and 210 tokens/s on writing, 160 on math
    ("m", "pld", "full", "full", "writing", "w1", 10, 4, 10 / 150, 0.004, None, None, None),
    ("m", "pld", "full", "full", "writing", "w2", 12, 5, 12 / 210, 0.006, None, None, None),
    ("m", "pld", "full", "full", "math", "m1", 8, 3, 8 / 160, 0.002, None, None, None),
    # layerskip with MicroSpec's window: phases timed, coverage per row
    ("m", "layerskip", "microspec", "microspec", "writing", "w1", 10, 5, 0.05, 0.020, 0.012, 0.5, 100.0),
    ("m", "layerskip", "microspec", "microspec", "writing", "w2", 30, 11, 0.10, 0.050, 0.030, 1.0, 400.0),
    ("m", "layerskip", "microspec", "microspec", "math", "m1", 8, 3, 0.04, 0.010, 0.006, 0.75, 200.0),
    ("m", "layerskip", "full", "full", "writing", "w1", 10, 5, 0.07, 0.060, 0.012, 1.0, 512.0),
    ("m", "layerskip", "full", "full", "writing", "w2", 30, 11, 0.15, 0.150, 0.030, 1.0, 512.0),
    ("m", "layerskip", "full", "full", "math", "m1", 8, 3, 0.06, 0.030, 0.006, 1.0, 512.0),
]


def bench_rows(rows=ROWS, model: str | None = None) -> pl.DataFrame:
    out = []
    for m, method, run, policy, cat, pid, new, steps, wall, draft, backbone, cov, vocab in rows:
        timed = backbone is not None
        out.append({"model": model or m, "prompt_set": "spec_bench", "method": method, "run": run, "policy": policy,
                    "vocab_size": 3072 if policy == "microspec" else None, "category": cat, "language": None,
                    "prompt_id": pid, "turn": 1, "repeat": 0, "new_tokens": new, "steps": steps, "wall_s": wall,
                    "tokens_per_s": new / wall, "tau": new / steps, "draft_s": draft, "draft_prefill_s": 0.001,
                    "uncharged_s": 0.0, "backbone_s": backbone, "router_s": 0.0 if timed else None,
                    "gather_s": 0.001 if timed else None, "lm_head_s": draft / 2 if timed else None,
                    "tree_s": 0.0 if timed else None, "draft_coverage": cov, "mean_active_vocab": vocab,
                    "temperature": 0.0, "output_ids": [1, 2, 3]})
    return pl.DataFrame(out, schema_overrides={"turn": pl.Int32, "repeat": pl.Int32, "vocab_size": pl.Int64})


def rows_of(frame: pl.DataFrame, **equal) -> pl.DataFrame:
    return frame.filter(pl.all_horizontal([pl.col(k) == v for k, v in equal.items()]))


def one(table: pl.DataFrame, **equal) -> dict:
    (row,) = rows_of(table, **equal).iter_rows(named=True)
    return row


def test_tau_is_tokens_over_steps_with_the_bonus_token():
    table = metrics.summarize(bench_rows())
    # pld on writing: (10 + 12) / (4 + 5) = 2.444; not the mean of row taus (2.5 + 2.4) / 2 = 2.45, and not
    # the accepted draft tokens alone, (22 - 9) / 9 = 1.444 (the bonus token left out)
    assert one(table, task="writing", method="pld")["tau"] == pytest.approx(22 / 9)
    # ar commits one token per step: tau 1 exactly (the bonus-free count would give 0)
    assert {r["tau"] for r in rows_of(table, method="ar").iter_rows(named=True)} == {1.0}
    # over every row (ALL): (10 + 12 + 8) / (4 + 5 + 3)
    assert one(table, task=ALL, method="pld")["tau"] == pytest.approx(30 / 12)


def test_speedup_is_the_mean_tokens_per_s_over_ars_on_the_same_task():
    table = metrics.summarize(bench_rows())
    row = one(table, task="writing", method="pld")
    # mean tokens/s (150 + 210) / 2 = 180 over ar's (100 + 120) / 2 = 110
    assert row["tokens_per_s"] == pytest.approx(180.0)
    assert row["speedup"] == pytest.approx(180 / 110)
    # not the mean of per-row ratios (150/100 + 210/120) / 2 = 1.625, nor total tokens over total wall time
    assert row["speedup"] != pytest.approx((1.5 + 1.75) / 2, abs=1e-3)
    assert row["speedup"] != pytest.approx((22 / (10 / 150 + 12 / 210)) / (22 / 0.2), abs=1e-3)
    assert one(table, task="math", method="pld")["speedup"] == pytest.approx(160 / 80)
    # ALL pools the rows: (150 + 210 + 160) / 3 over (100 + 120 + 80) / 3
    assert one(table, task=ALL, method="pld")["speedup"] == pytest.approx((520 / 3) / 100)
    assert set(rows_of(table, method="ar")["speedup"]) == {1.0}


def test_table2_avg_is_the_mean_over_tasks_and_speedup_its_ratio():
    table = metrics.table2_summary(bench_rows())
    avg = one(table, task=AVG, method="pld")
    # Table 2's "Avg. Speed": the mean over tasks (180 + 160) / 2 = 170 over ar's (110 + 80) / 2 = 95; not the
    # rows pooled (520 / 3 over 100), not the mean of per-task speedups (180/110 + 2) / 2
    assert avg["tokens_per_s"] == pytest.approx(170.0)
    assert avg["speedup"] == pytest.approx(170 / 95)
    assert avg["speedup"] != pytest.approx((180 / 110 + 2.0) / 2, abs=1e-3)
    # "Avg. Len.": the mean over tasks of each task's tau, (22/9 + 8/3) / 2
    assert avg["tau"] == pytest.approx((22 / 9 + 8 / 3) / 2)
    # the per-task rows are summarize's, measure for measure
    per_task = metrics.summarize(bench_rows())
    for task in ("writing", "math"):
        for col in ("tokens_per_s", "speedup", "tau", "draft_ms", "draft_coverage", "mean_active_vocab"):
            got, want = (one(t, task=task, method="layerskip", run="microspec")[col] for t in (table, per_task))
            assert got == pytest.approx(want), (task, col)
    # ordered: ar first, the drafters last; AVG after the tasks
    assert rows_of(table, task="math")["method"].to_list() == ["ar", "pld", "layerskip", "layerskip"]
    assert table["task"].to_list()[-4:] == [AVG] * 4


def test_speedup_is_against_the_same_models_ar():
    fast = bench_rows(model="fast").with_columns(pl.col("tokens_per_s") * 2)         # every row twice as fast
    table = metrics.table2_summary(pl.concat([bench_rows(), fast]))
    # each model's pld against its own ar: the same speedup; against the other model's ar it would be 2x or 0.5x
    assert one(table, model="fast", task="writing", method="pld")["speedup"] == pytest.approx(180 / 110)
    assert one(table, model="m", task="writing", method="pld")["speedup"] == pytest.approx(180 / 110)
    assert one(table, model="fast", task=AVG, method="pld")["tokens_per_s"] == pytest.approx(340.0)


def test_draft_time_is_per_drafted_step_and_split_by_phase():
    table = metrics.summarize(bench_rows())
    row = one(table, task="writing", method="layerskip", run="microspec")
    # (0.020 - 0.001 + 0.050 - 0.001) s over (5 - 1) + (11 - 1) drafted steps: the prefill, step 0, drafts
    # nothing (per step, /16, would be 4.25 ms) and the drafter's pass over the prompt is not a step's
    assert row["draft_ms"] == pytest.approx(0.068 / 14 * 1e3)
    assert row["backbone_ms"] == pytest.approx(0.042 / 14 * 1e3)
    assert row["lm_head_ms"] == pytest.approx(0.035 / 14 * 1e3)
    assert row["router_ms"] == 0.0
    # methods that do not time their phases: null, not 0
    pld = one(table, task="writing", method="pld")
    assert pld["backbone_ms"] is None and pld["draft_ms"] == pytest.approx((0.003 + 0.005) / 7 * 1e3)


def test_coverage_and_active_vocabulary_are_weighted():
    row = one(metrics.summarize(bench_rows()), task="writing", method="layerskip", run="microspec")
    # draft_coverage weighted by generated tokens: (0.5 * 10 + 1.0 * 30) / 40 = 0.875, not (0.5 + 1.0) / 2
    assert row["draft_coverage"] == pytest.approx(0.875)
    # mean_active_vocab weighted by drafted steps: (100 * 4 + 400 * 10) / 14, not (100 + 400) / 2
    assert row["mean_active_vocab"] == pytest.approx(4400 / 14)
    # the measure's one name in every summary (the rows' column; `coverage` is the coverage cells')
    assert "draft_coverage" in metrics.table2_summary(bench_rows()).columns
    assert "coverage" not in metrics.summarize(bench_rows()).columns


def test_table2_layout_and_the_policy_comparison():
    summary = metrics.summarize(bench_rows())
    wide = metrics.table2(summary)
    assert wide.columns == ["method", "run", "math", "writing", "all", "speedup", "tau", "lossless"]
    assert one(wide, method="pld")["writing"] == pytest.approx(180.0)
    (cmp,) = metrics.compare_vocabs(summary).iter_rows(named=True)
    assert (cmp["run"], cmp["base"]) == ("microspec", "full")
    full, micro = one(summary, task=ALL, run="full", method="layerskip"), one(summary, task=ALL, run="microspec")
    # draft_ratio: how many times less draft time per step (base / run); tau and speed: run / base
    assert cmp["draft_ratio"] == pytest.approx(full["draft_ms"] / micro["draft_ms"]) and cmp["draft_ratio"] > 1
    assert cmp["tau_ratio"] == pytest.approx(micro["tau"] / full["tau"]) == 1.0
    assert cmp["speed_ratio"] == pytest.approx(micro["tokens_per_s"] / full["tokens_per_s"])
    (line,) = metrics.comparison_lines(metrics.compare_vocabs(summary))
    assert line.startswith("layerskip microspec vs full:") and "tau >= 0.95x met" in line


def test_lossless_against_ar_and_a_never_diagnosed_difference():
    rows = bench_rows()
    assert set(metrics.summarize(rows)["lossless"]) == {"exact"}
    broken = rows.with_columns(output_ids=pl.when((pl.col("method") == "pld") & (pl.col("prompt_id") == "m1"))
                               .then(pl.lit([1, 9], dtype=pl.List(pl.Int64))).otherwise(pl.col("output_ids")))
    table = metrics.summarize(broken)
    assert one(table, task="math", method="pld")["lossless"] == "mismatch"
    assert one(table, task=ALL, method="pld")["lossless"] == "mismatch"
    assert one(table, task="writing", method="pld")["lossless"] == "exact"
    (d,) = metrics.divergences(broken).iter_rows(named=True)
    assert (d["prompt_id"], d["first_divergence"], d["diagnosed"]) == ("m1", 1, False)


def test_task_is_the_language_of_a_set_split_by_language():
    rows = bench_rows().with_columns(category=pl.lit("qa"), language=pl.when(pl.col("prompt_id") == "m1")
                                     .then(pl.lit("de")).otherwise(pl.lit("ja")))
    assert set(metrics.summarize(rows)["task"]) == {"de", "ja", ALL}


def test_sweeps_tables_summarise_through_the_metrics():
    """The sweeps' Table 2 (`sweeps.tables.method_summary`) is `engine.metrics.table2_summary` with the sweep's run
    labels: the same numbers."""
    from specvocab.sweeps import tables

    rows = bench_rows()
    got = tables.method_summary(rows)
    want = metrics.table2_summary(rows)
    assert got.height == want.height
    label = {"full": "layerskip · full", "microspec": "layerskip · microspec 3072"}
    for r in want.iter_rows(named=True):
        run = label[r["run"]] if r["method"] == "layerskip" else r["method"]
        g = one(got, task=r["task"], method=r["method"], run=run)
        for col in ("tokens_per_s", "speedup", "tau", "draft_ms", "draft_coverage"):
            assert g[col] == pytest.approx(r[col], nan_ok=True) or g[col] is r[col] is None, (r["task"], run, col)


def test_a_frame_without_the_run_key_is_refused():
    with pytest.raises(metrics.MetricsError, match="missing \\['prompt_id'\\]"):
        metrics.summarize(bench_rows().drop("prompt_id"))


def test_the_decode_phase_leaves_out_the_prefill_and_the_drafters_pass_over_the_prompt():
    """decode_tokens_per_s = mean over rows of (new_tokens - 1) / (wall_s - prefill_s - begin_s - uncharged_s);
    decode_speedup its ratio to ar's; draft_ms subtracts begin_s (every drafter's pass over the prompt) where
    a row has it. Rules out: new_tokens instead of new_tokens - 1 (the prefill's token), begin_s kept in,
    the prefill kept in (= tokens_per_s), a ratio of sums instead of the mean of the rows' rates."""
    base = bench_rows([r for r in ROWS if r[1] in ("ar", "pld")])
    timing = {  # (method, prompt_id): (prefill_s, begin_s)
        ("ar", "w1"): (0.02, 0.0), ("ar", "w2"): (0.04, 0.0), ("ar", "m1"): (0.03, 0.0),
        ("pld", "w1"): (0.02, 0.005), ("pld", "w2"): (0.04, 0.001), ("pld", "m1"): (0.03, 0.0)}
    frame = base.with_columns(
        prefill_s=pl.struct("method", "prompt_id").map_elements(lambda r: timing[(r["method"], r["prompt_id"])][0],
                                                                return_dtype=pl.Float64),
        begin_s=pl.struct("method", "prompt_id").map_elements(lambda r: timing[(r["method"], r["prompt_id"])][1],
                                                              return_dtype=pl.Float64))
    table = metrics.summarize(frame)
    ar_w = [(10 - 1) / (0.10 - 0.02), (12 - 1) / (0.10 - 0.04)]
    pld_w = [(10 - 1) / (10 / 150 - 0.02 - 0.005), (12 - 1) / (12 / 210 - 0.04 - 0.001)]
    ar, pld = one(table, task="writing", method="ar"), one(table, task="writing", method="pld")
    assert ar["decode_tokens_per_s"] == pytest.approx(sum(ar_w) / 2)
    assert pld["decode_tokens_per_s"] == pytest.approx(sum(pld_w) / 2)
    assert pld["decode_speedup"] == pytest.approx(sum(pld_w) / sum(ar_w))
    assert pld["decode_speedup"] != pytest.approx(pld["speedup"])
    # draft time: the rows' begin_s out, not draft_prefill_s (0.001 each)
    assert pld["draft_ms"] == pytest.approx(((0.004 - 0.005) + (0.006 - 0.001)) / (3 + 4) * 1e3)
    # a results file written before begin_s: no decode measure, draft_ms as before
    old = metrics.summarize(base)
    assert one(old, task="writing", method="pld")["decode_speedup"] is None
    # Table 2's average: the mean over tasks, and its ratio
    t2 = metrics.table2_summary(frame)
    avg_ar = one(t2, task=AVG, method="ar")["decode_tokens_per_s"]
    avg_pld = one(t2, task=AVG, method="pld")
    math_ar = (8 - 1) / (0.10 - 0.03)
    math_pld = (8 - 1) / (8 / 160 - 0.03)
    assert avg_ar == pytest.approx((sum(ar_w) / 2 + math_ar) / 2)
    assert avg_pld["decode_speedup"] == pytest.approx((sum(pld_w) / 2 + math_pld) / 2 / avg_ar)


# --- the speedup's interval (speedup_lo / speedup_hi) ------------------------------------------------------------

def _paired_rows(ratios, ar_rates, tasks=None, new=32) -> pl.DataFrame:
    """ar and pld rows of one prompt turn each: ar at ar_rates[i] tokens/s, pld at ratios[i] times that, with a
    prefill of a quarter of each row's time (so the decode phase has its own rates)."""
    rows = []
    for i, (r, a) in enumerate(zip(ratios, ar_rates)):
        task = tasks[i] if tasks else "writing"
        for method, rate, steps in (("ar", a, new), ("pld", a * r, new // 2)):
            wall = new / rate
            rows.append({"model": "m", "prompt_set": "spec_bench", "method": method, "run": "full", "policy": "full",
                         "category": task, "prompt_id": f"p{i}", "turn": 1, "repeat": 0, "new_tokens": new,
                         "steps": steps, "wall_s": wall, "tokens_per_s": rate, "prefill_s": wall / 4,
                         "begin_s": 0.0, "draft_s": 0.0, "uncharged_s": 0.0, "temperature": 0.0,
                         "output_ids": [1, 2, 3]})
    return pl.DataFrame(rows, schema_overrides={"turn": pl.Int32, "repeat": pl.Int32})


def test_the_speedup_interval_pairs_each_turn_with_ars():
    """The bootstrap draws prompt turns with their ar pair. A run exactly 1.5x ar on every turn, over turns whose
    speeds differ 10-fold, has the zero-width interval [1.5, 1.5]; drawing the run's and ar's turns apart (an
    unpaired bootstrap) would spread it over the turns' spread. ar's own interval is [1, 1]; the decode phase
    gets its own."""
    ar_rates = [20.0 * (1 + i) for i in range(10)]
    table = metrics.summarize(_paired_rows([1.5] * 10, ar_rates))
    pld = one(table, task=ALL, method="pld")
    assert pld["speedup"] == pytest.approx(1.5)
    assert pld["speedup_lo"] == pytest.approx(1.5) and pld["speedup_hi"] == pytest.approx(1.5)
    assert pld["decode_speedup_lo"] == pytest.approx(1.5) and pld["decode_speedup_hi"] == pytest.approx(1.5)
    ar = one(table, task=ALL, method="ar")
    assert (ar["speedup_lo"], ar["speedup_hi"]) == (pytest.approx(1.0), pytest.approx(1.0))
    # two ar runs (2/3 and 4/3 of the first's speed): their mean is what the run is against, as for speedup
    rows = _paired_rows([1.5] * 10, ar_rates)
    ars = rows.filter(pl.col("method") == "ar")
    two = pl.concat([rows.filter(pl.col("method") != "ar"),
                     ars.with_columns(run=pl.lit("slow"), tokens_per_s=pl.col("tokens_per_s") * 2 / 3),
                     ars.with_columns(run=pl.lit("fast"), tokens_per_s=pl.col("tokens_per_s") * 4 / 3)])
    pld2 = one(metrics.summarize(two), task=ALL, method="pld")
    assert pld2["speedup"] == pytest.approx(1.5)
    assert (pld2["speedup_lo"], pld2["speedup_hi"]) == (pytest.approx(1.5), pytest.approx(1.5))
    # a run whose ratio varies by turn: the interval holds the speedup, is not degenerate, and is the same on
    # every call (a seeded bootstrap: the same table twice)
    ratios = [1.1, 1.9, 1.3, 1.6, 1.2, 1.8, 1.4, 1.5, 1.0, 2.0]
    again = [metrics.summarize(_paired_rows(ratios, ar_rates)) for _ in range(2)]
    varied = one(again[0], task=ALL, method="pld")
    assert varied["speedup_lo"] < varied["speedup"] < varied["speedup_hi"]
    assert varied["speedup_hi"] - varied["speedup_lo"] > 0.1
    assert again[0].equals(again[1])
    # the interval is of the ratio of the means, not of the mean of the turns' ratios: fast turns (ar 200/s)
    # at 2x and slow ones (20/s) at 1x give a speedup of 4200 / 2200 = 1.91, inside [1.8, 1.97]; the turns'
    # ratios average 1.5, and their interval would hold 1.5 and not 1.91
    skewed = one(metrics.summarize(_paired_rows([2.0, 1.0] * 10, [200.0, 20.0] * 10)), task=ALL, method="pld")
    assert skewed["speedup"] == pytest.approx(4200 / 2200)
    assert 1.75 < skewed["speedup_lo"] < skewed["speedup"] < skewed["speedup_hi"] < 1.98
    # rows without the decode timings (begin_s null, written before it): no decode interval, as no decode_speedup
    old = metrics.summarize(_paired_rows(ratios, ar_rates).with_columns(begin_s=pl.lit(None, pl.Float64)))
    assert one(old, task=ALL, method="pld")["decode_speedup_lo"] is None


def test_the_interval_covers_the_true_speedup_at_its_level():
    """The power check of the interval itself: 300 sets of 40 turns drawn from a known population (ar speeds
    spread 3-fold, the run's ratio log-normal around 1.3); the true speedup E[m] / E[a] = E[r] sits inside the
    95% interval in 90-98.5% of the sets (binomial sd at 0.95: 1.3%). A 50% interval (the quartiles, 50%
    coverage), an unpaired bootstrap (ar and the run drawn apart: nearly always covers), or the interval of
    one draw's ratio per set all fall outside."""
    import numpy as np
    rng = np.random.default_rng(7)
    sigma, centre = 0.2, 1.3
    truth = centre * np.exp(sigma ** 2 / 2)
    covered = 0
    for s in range(300):
        a = rng.uniform(50, 150, 40)
        m = a * centre * np.exp(rng.normal(0, sigma, 40))
        lo, hi = metrics.ratio_interval(m, a, seed=s)
        covered += lo <= truth <= hi
    assert 0.90 <= covered / 300 <= 0.985, covered


def test_the_mean_over_tasks_draws_tasks():
    """AVG (the mean over tasks) resamples its tasks, each keeping its ar pair; a task of one turn has no
    interval of its own (fewer than 2 units). Two tasks of one turn each, pld 2x ar on one and 1x on the
    other: the interval spans the draws (A, A) -> 2 and (B, B) -> 1. Drawing turns within each task instead
    (strata) would give the zero-width interval at the point value."""
    frame = _paired_rows([2.0, 1.0], [100.0, 50.0], tasks=["writing", "math"])
    t2 = metrics.table2_summary(frame)
    avg = one(t2, task=AVG, method="pld")
    assert avg["speedup"] == pytest.approx((200 + 50) / (100 + 50))
    assert avg["speedup_lo"] == pytest.approx(1.0) and avg["speedup_hi"] == pytest.approx(2.0)
    assert one(t2, task="writing", method="pld")["speedup_lo"] is None
    # summarize's ALL pools the turns (the same two units here, so the same span)
    assert one(metrics.summarize(frame), task=ALL, method="pld")["speedup_hi"] == pytest.approx(2.0)


def test_a_policy_comparison_carries_the_paired_interval_of_its_speed_ratio():
    """compare_vocabs with the rows: speed_ratio_lo / _hi over the turns both runs ran, each paired with itself.
    layerskip microspec at exactly 2x full's tokens/s on every turn (turns 10x apart in speed): [2, 2] - a
    bootstrap that drew the two runs' turns apart would spread over the turns' spread; without the rows no
    interval, as before; the printed line shows it."""
    rows = []
    for i in range(10):
        for run, rate in (("full", 20.0 * (1 + i)), ("microspec", 40.0 * (1 + i))):
            rows.append({"model": "m", "prompt_set": "spec_bench", "method": "layerskip", "run": run, "policy": run,
                         "category": "writing", "prompt_id": f"p{i}", "turn": 1, "repeat": 0, "new_tokens": 32,
                         "steps": 16, "wall_s": 32 / rate, "tokens_per_s": rate, "draft_s": 0.01,
                         "temperature": 0.0, "output_ids": [1, 2]})
    frame = pl.DataFrame(rows, schema_overrides={"turn": pl.Int32, "repeat": pl.Int32})
    summary = metrics.summarize(frame)
    (cmp,) = metrics.compare_vocabs(summary, frame).iter_rows(named=True)
    assert cmp["speed_ratio"] == pytest.approx(2.0)
    assert (cmp["speed_ratio_lo"], cmp["speed_ratio_hi"]) == (pytest.approx(2.0), pytest.approx(2.0))
    (line,) = metrics.comparison_lines(metrics.compare_vocabs(summary, frame))
    assert "= 2.000x (95% 2.00-2.00)" in line
    (bare,) = metrics.compare_vocabs(summary).iter_rows(named=True)
    assert bare["speed_ratio_lo"] is None and "95%" not in metrics.comparison_lines(metrics.compare_vocabs(summary))[0]
    # a turn only one run ran is left out of the pairs (not paired with another turn)
    extra = frame.filter(pl.col("run") == "full").head(1).with_columns(prompt_id=pl.lit("lonely"),
                                                                         tokens_per_s=pl.lit(1.0))
    (cmp2,) = metrics.compare_vocabs(summary, pl.concat([frame, extra])).iter_rows(named=True)
    assert (cmp2["speed_ratio_lo"], cmp2["speed_ratio_hi"]) == (pytest.approx(2.0), pytest.approx(2.0))
