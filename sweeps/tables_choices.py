"""The table of DynaSpec's unstated choices (§4.2: M, router width, L) for notebook 3 (`sweeps.tables`), from
the Parquet files `python -m specvocab.engine.jobs.dynaspec_choices --out FOLDER` writes (not a sweep kind);
polars only.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from specvocab.sweeps.tables_common import present


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
        print(f"skipped the DynaSpec choices: no Parquet files in {folder} — make them with `"
              f"{CHOICES_COMMAND.format(folder=folder)}` (FITWORK: the work dir of `python -m specvocab.engine.jobs.fit_dynaspec`, "
              f"<fitted file>.work)")
        return None
    frame = pl.read_parquet(files)
    return frame if present(frame, "the DynaSpec choices", *CHOICES_COLUMNS) else None


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
    if choices is None or not present(choices, "the DynaSpec choices", *CHOICES_COLUMNS):
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
