"""UniSpec's figures' tables (`sweeps.tables`): acceptance by confidence from the bench rows (Fig. 3), and
the draft-size calibration from the calibrate cells (App. F / Fig. 5: tau(g), s(g), tau/s, their fits and g*);
polars only.
"""

from __future__ import annotations

import polars as pl

from specvocab.sweeps.tables_common import present


def confidence_bins(bench: pl.DataFrame | None) -> pl.DataFrame | None:
    """UniSpec Fig. 3: per model and method, draft nodes proposed and accepted per confidence-score bin
    (`engine.harness.SCORE_BINS` equal bins over [0, 1], as many as the rows' lists hold) summed over every
    bench row: acceptance_rate = accepted / proposed, density = proposed / all proposed. Methods whose every
    node sits in one bin (no confidence score, e.g. pld) are left out (printed)."""
    if not present(bench, "acceptance vs confidence", "score_bins_proposed", "score_bins_accepted"):
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
    if not present(cal, "the calibration fits", "curve", "g", "tau", "s_step_ms", "tokens_per_s"):
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
    if not present(cal, "g* per device", "g_star", "device"):
        return None
    cols = [c for c in ("predicted_tokens_per_s", "g_continuous", "threads") if c in cal.columns]
    keys = ["model", "method", "device", "dtype", *[c for c in ("policy", "vocab_size") if c in cal.columns],
            "cell_id"]
    out = cal.group_by(keys).agg(pl.col("g_star").first(), *[pl.col(c).first() for c in cols])
    return out.with_columns(setting=_setting(out)).sort("model", "method", "device", "setting")

