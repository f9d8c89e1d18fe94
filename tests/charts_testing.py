"""A synthetic two-model sweep for the chart tests: bench and coverage rows in the columns a sweep writes
(`engine.metrics.ROW_SCHEMA`, the coverage cells' analyses), no model run. Two models (SmolLM2, Gemma), four
Spec-Bench categories, two prompts each; bench: ar, pld, unispec and the eagle drafter with the full vocabulary
and MicroSpec's window at two w_max; coverage: the window at two w_max (one task where the window never
fills: both w_max give the same point), static shortlists, LRU against FIFO; eagle's rows time their drafter
phases. Beside them: a (k_pre, k_ver) grid of window cells, a multilingual set's coverage and reuse-distance
cells, calibrate cells and a DynaSpec choices sweep, each in the columns its job writes."""

from __future__ import annotations

import numpy as np
import polars as pl

from specvocab.engine.metrics import PHASES
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


def phase_seconds(method: str, policy: str, wall: float) -> dict:
    """The drafter phases' seconds of a bench row: eagle times its phases (gather only with MicroSpec's
    window, no router), the other methods none (null)."""
    if method != "eagle":
        return {f"{p}_s": None for p in PHASES}
    return {"backbone_s": 0.08 * wall, "router_s": None, "gather_s": 0.02 * wall if policy == "microspec" else None,
            "lm_head_s": (0.02 if policy == "microspec" else 0.07) * wall, "tree_s": 0.03 * wall}


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
                        **phase_seconds(method, policy, wall),
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


K_GRID = (1, 3)                                  # k_pre = k_ver values of the (k_pre, k_ver) grid


def grid_rows() -> pl.DataFrame:
    """Window coverage cells over the (k_pre, k_ver) grid K_GRID x K_GRID at each of W_MAX, two prompts per
    task; a larger k adds candidates: higher coverage and a larger window."""
    rows = []
    for mi, model in enumerate(MODELS):
        for ci, cat in enumerate(CATEGORIES):
            for p in range(2):
                for k_pre in K_GRID:
                    for k_ver in K_GRID:
                        for w in W_MAX:
                            rows.append({"model": model, "prompt_set": "spec_bench", "category": cat,
                                         "language": "en", "prompt_id": f"{cat}-{p}", "analysis": "window",
                                         "tokens": 100 * (mi + 1) + 10 * ci + p, "k_pre": k_pre, "k_ver": k_ver,
                                         "sources": tables.DEFAULTS.sources, "w_max": w,
                                         "mean_active_vocab": 0.1 * w * (2 * k_pre + k_ver),
                                         "coverage": 0.4 + 0.04 * k_pre + 0.02 * k_ver + 0.1 * W_MAX.index(w)})
    return pl.DataFrame(rows)


def language_rows() -> pl.DataFrame:
    """Coverage cells of a `multilingual` set (task qa in each of LANGUAGES, two prompts each) at the papers'
    stream: `window` at each of W_MAX, `shortlist` at two K, and `distances` (reuse distance of the generated
    and the candidate stream: counts in three power-of-two bins and a never-seen count, bin null)."""
    rows = []
    d = tables.DEFAULTS
    stream = {"k_pre": d.k_pre, "k_ver": d.k_ver, "sources": d.sources}
    for mi, model in enumerate(MODELS):
        for li, lang in enumerate(LANGUAGES):
            for p in range(2):
                key = {"model": model, "prompt_set": "multilingual", "category": "qa", "language": lang,
                       "prompt_id": f"qa-{lang}-{p}", "tokens": 60 * (mi + 1) + 7 * li + 3 * p}
                for w in W_MAX:
                    rows.append({**key, **stream, "analysis": "window", "w_max": w, "mean_active_vocab": 0.9 * w,
                                 "coverage": 0.5 + 0.1 * W_MAX.index(w) + 0.05 * li})
                for k in (1024, 16384):
                    rows.append({**key, "analysis": "shortlist", "k": k, "coverage": 0.3 + 0.1 * (k > 1024)})
                for s in ("generated", "candidate"):
                    counts = [key["tokens"] // 4, key["tokens"] // 4, key["tokens"] // 4]
                    for b, n in enumerate([*counts, key["tokens"] - sum(counts)]):
                        lo = 2.0 ** (2 * b) if b < 3 else None
                        rows.append({**key, **stream, "analysis": "distances", "metric": "reuse_distance",
                                     "stream": s, "bin_lo": lo, "bin_hi": 4 * lo if lo else None, "count": n})
    return pl.DataFrame(rows, infer_schema_length=None)


CAL_G = (4.0, 8.0, 16.0, 32.0)                   # the calibration's measured draft sizes


def calibrate_rows() -> pl.DataFrame:
    """Calibrate cells (`sweeps.model_cells.calibrate_cell`'s columns): eagle and unispec on each model, on
    one CPU device: the measured tau(g), s(g), tau/s at CAL_G with their generated tokens and steps, a fit
    of 8 points, and g* (the measured g of the largest tau/s)."""
    rows = []
    for mi, model in enumerate(MODELS):
        for ci, method in enumerate(("eagle", "unispec")):
            tau = {g: 1.5 + 0.3 * np.log2(g) + 0.1 * ci for g in CAL_G}
            s_ms = {g: 20.0 + 10 * mi + 0.5 * g for g in CAL_G}
            g_star = max(CAL_G, key=lambda g: tau[g] / s_ms[g])
            cell = {"model": model, "method": method, "device": "cpu (2 threads)", "dtype": "bfloat16",
                    "threads": 2, "cell_id": f"{model}-{method}", "g_star": int(g_star), "policy": "full",
                    "vocab_size": None, "g_continuous": g_star,
                    "predicted_tokens_per_s": 1e3 * tau[g_star] / s_ms[g_star]}
            for g in CAL_G:
                new = 200 + 10 * int(g) + 50 * mi
                rows.append({**cell, "curve": "measured", "g": g, "tau": tau[g], "s_step_ms": s_ms[g],
                             "tokens_per_s": 1e3 * tau[g] / s_ms[g], "measured_new_tokens": new,
                             "measured_steps": round(new / tau[g])})
            for g in np.linspace(CAL_G[0], CAL_G[-1], 8):
                t, s = 1.5 + 0.3 * np.log2(g) + 0.1 * ci, 20.0 + 10 * mi + 0.5 * g
                rows.append({**cell, "curve": "fit", "g": float(g), "tau": t, "s_step_ms": s,
                             "tokens_per_s": 1e3 * t / s, "measured_new_tokens": None, "measured_steps": None})
            rows.append({**cell, "curve": "g_star", "g": g_star, "tau": tau[g_star], "s_step_ms": s_ms[g_star],
                         "tokens_per_s": 1e3 * tau[g_star] / s_ms[g_star], "measured_new_tokens": None,
                         "measured_steps": None})
    return pl.DataFrame(rows, infer_schema_length=None)


CHOICE_CENTRE = (512, 1, 4)                      # (M, router width, L) the synthetic choices vary around


def choices_rows() -> pl.DataFrame:
    """`engine.jobs.dynaspec_choices` rows of two fits (eagle on each model): M, router width and L varied
    one at a time around CHOICE_CENTRE, DynaSpec-PA (router, position) at two token budgets, the static
    baseline of each M; `rows`: the held-out draft rows each setting was scored on."""
    rows = []
    m0, w0, l0 = CHOICE_CENTRE
    settings = {(m, w0, l0) for m in (256, 512, 1024)} | {(m0, w, l0) for w in (1, 2)} | {(m0, w0, l) for l in (2, 4)}
    for mi, model in enumerate(MODELS):
        for m, w, l in sorted(settings):
            for scorer in ("router", "static"):
                for bt in (4096, 16384):
                    rows.append({"model": model, "drafter": "eagle", "num_clusters": m, "router_width": w,
                                 "top_l": l, "logged_top_l": 4, "scorer": scorer, "budget": "position",
                                 "budget_tokens": bt, "k_max": bt * m // 50000,
                                 "token_recall": (0.6 if scorer == "router" else 0.4) + 0.1 * (bt > 4096)
                                 + 0.01 * np.log2(m / 256) + 0.03 * (w - 1) - 0.02 * (l - 4),
                                 "top1_hit": 0.8, "cluster_recall": 0.7, "mean_row_vocab": float(bt) * 0.9,
                                 "train_s": 1.0, "kmeans_s": 0.0 if m == m0 else 2.0, "rows": 500 + 100 * mi,
                                 "centre_num_clusters": m0, "centre_router_width": w0, "centre_top_l": l0})
    return pl.DataFrame(rows)
