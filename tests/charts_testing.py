"""A synthetic two-model sweep for the chart tests: bench and coverage rows in the columns a sweep writes
(`engine.metrics.ROW_SCHEMA`, the coverage cells' analyses), no model run. Two models (SmolLM2, Gemma), four
Spec-Bench categories, two prompts each; bench: ar, pld, unispec and the eagle drafter with the full vocabulary
and MicroSpec's window at two w_max; coverage: the window at two w_max (one task where the window never
fills: both w_max give the same point), static shortlists, LRU against FIFO."""

from __future__ import annotations

import numpy as np
import polars as pl

from specvocab.sweeps import tables

MODELS = ("gemma-3-270m-it", "smollm2-135m-instruct")
CATEGORIES = ("coding", "math", "qa", "writing")
W_MAX = (3072, 8192)
NEVER_FILLS = ("gemma-3-270m-it", "qa")          # (model, task) whose window stays below 3072 entries
DRAFT_SIZE = 60                                  # the eagle runs' draft size
# (method, policy, vocab_size, tokens/s factor over ar, tau, draft size)
RUNS = [("ar", "full", None, 1.0, 1.0, None), ("pld", "full", None, 1.3, 1.8, 10),
        ("unispec", "full", None, 1.5, 2.2, 24), ("eagle", "full", None, 1.6, 2.6, DRAFT_SIZE),
        ("eagle", "microspec", 1024, 1.9, 2.4, DRAFT_SIZE), ("eagle", "microspec", 3072, 2.0, 2.5, DRAFT_SIZE)]
BINS = 10


LANGUAGES = ("de", "ja")


def bench_rows(draft_size: bool = True, languages: bool = False) -> pl.DataFrame:
    """Bench rows: every run on every model, category and prompt (2 per category) of `spec_bench` (English;
    with `languages` also a `multilingual` set, category qa in each of LANGUAGES), one turn, greedy, the same
    outputs as ar's (lossless); unispec and eagle count confidence bins, bin 0 sparse (2 nodes a row)."""
    sets = [("spec_bench", cat, "en") for cat in CATEGORIES]
    if languages:
        sets += [("multilingual", "qa", lang) for lang in LANGUAGES]
    rng = np.random.default_rng(0)
    out = []
    for mi, model in enumerate(MODELS):
        ar_speed = 40.0 + 30.0 * mi
        for ci, (prompt_set, cat, lang) in enumerate(sets):
            for p in range(2):
                for method, policy, size, factor, tau, g in RUNS:
                    new = int(40 + 8 * ci + 4 * p)
                    steps = max(1, round(new / tau))
                    speed = ar_speed * factor * (1 + 0.05 * rng.standard_normal())
                    wall = new / speed
                    scored = method in ("unispec", "eagle")
                    proposed = [2] + [int(v) for v in rng.integers(50, 400, BINS - 1)] if scored else None
                    accepted = ([2] + [int(n * (b + 1) / BINS) for b, n in enumerate(proposed[1:], 1)]
                                if scored else None)
                    out.append({
                        "model": model, "prompt_set": prompt_set, "method": method, "policy": policy,
                        "vocab_size": size, "category": cat, "language": lang, "prompt_id": f"{cat}-{lang}-{p}",
                        "turn": 1, "repeat": 0, "new_tokens": new, "steps": steps, "wall_s": wall,
                        "prefill_s": 0.1 * wall, "tokens_per_s": speed, "tau": new / steps,
                        "draft_s": 0.0 if method == "ar" else 0.2 * wall, "draft_size": g,
                        "draft_coverage": (0.80 if size == 1024 else 0.9) if policy == "microspec" else None,
                        "mean_active_vocab": float(size) * 0.8 if size else None, "temperature": 0.0,
                        "output_ids": [1, 2, 3], "score_bins_proposed": proposed, "score_bins_accepted": accepted,
                        "begin_s": 0.0, "uncharged_s": 0.0, "draft_prefill_s": 0.0, "device": "cpu",
                        "dtype": "bfloat16", "timed_alone": True})
    frame = pl.DataFrame(out, schema_overrides={"turn": pl.Int32, "repeat": pl.Int32, "vocab_size": pl.Int64,
                                                "draft_size": pl.Int64})
    return frame if draft_size else frame.drop("draft_size")


def coverage_rows() -> pl.DataFrame:
    """Coverage cells' rows at the papers' stream (k_pre = k_ver = 3, ctx+ext): `window` at each of W_MAX,
    `shortlist` at four K, `miss_ratio` at three capacities; two prompts per task, tokens differing per model."""
    rows = []
    d = tables.DEFAULTS
    stream = {"k_pre": d.k_pre, "k_ver": d.k_ver, "sources": d.sources}
    for mi, model in enumerate(MODELS):
        for ci, cat in enumerate(CATEGORIES):
            for p in range(2):
                key = {"model": model, "prompt_set": "spec_bench", "category": cat, "language": "en",
                       "prompt_id": f"{cat}-{p}", "tokens": 100 * (mi + 1) + 10 * ci + p}
                for w in W_MAX:
                    full = (model, cat) != NEVER_FILLS or w == W_MAX[0]
                    active = (0.9 if full else 0.9 * W_MAX[0] / w) * w       # a window that never fills: same size
                    rows.append({**key, **stream, "analysis": "window", "w_max": w,
                                 "mean_active_vocab": min(active, 0.9 * W_MAX[0]) if not full else active,
                                 "coverage": 0.6 + 0.1 * W_MAX.index(w) * full + 0.02 * ci})
                for k in (1024, 4096, 16384, 65536):
                    rows.append({**key, "analysis": "shortlist", "k": k, "coverage": 0.3 + 0.15 * np.log2(k / 1024) / 2})
                for c in (256, 1024, 4096):
                    rows.append({**key, **stream, "analysis": "miss_ratio", "capacity": c,
                                 "lru_miss_ratio": 0.5 / np.log2(c), "fifo_miss_ratio": 0.55 / np.log2(c),
                                 "lru_mean_active_vocab": float(c), "fifo_w_max": float(c * 2),
                                 "fifo_mean_active_vocab": float(c)})
    return pl.DataFrame(rows, infer_schema_length=None)
