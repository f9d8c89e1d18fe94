"""Coverage cells: model-free analyses of recorded traces (`locality`, pure: token ids in, frames out).

One cell = one analysis of every trace a model recorded on one prompt entry, grouped by `by` (category,
language):

- window: MicroSpec's windowed candidate stream (MicroSpec §3.2, Eq. 4) - coverage and mean active
  vocabulary for every w_max at once (`locality.coverage_by`); `policy = "microspec"`.
- shortlist: FR-Spec's static top-K (FR-Spec §3) ranked on the training corpus - never on these traces -
  for every K (`locality.shortlist_coverage_by`); `policy = "frspec"`, `k` = the shortlist size.
- distances: power-of-two histograms of reuse and LRU stack distances (`locality.distance_histograms`).
- miss_ratio: an LRU vocabulary against MicroSpec's FIFO window of equal mean size
  (`locality.miss_ratio_curves`).
"""

from __future__ import annotations

import time
from typing import Sequence

import polars as pl

from specvocab.locality.coverage import coverage_by
from specvocab.locality.shortlist import shortlist_coverage_by
from specvocab.locality.temporal import distance_histograms, miss_ratio_curves
from specvocab.locality.trace import Trace


class CoverageCellError(ValueError):
    """A coverage cell cannot run on what it was given; the message says what is missing."""


def coverage_cell(p: dict, traces: Sequence[Trace], ranking: pl.DataFrame | None = None) -> pl.DataFrame:
    if not traces:
        raise CoverageCellError(f"coverage cell {p['analysis']} on {p['prompt_set']}: no traces to analyse")
    by = list(p["by"])
    a = p["analysis"]
    if a == "window":
        frame = coverage_by(traces, by, p["w_max"], p["k_pre"], p["k_ver"], p["sources"])
        return frame.with_columns(pl.lit("microspec").alias("policy"), pl.lit(a).alias("analysis"))
    if a == "shortlist":
        if ranking is None:
            raise CoverageCellError("a shortlist coverage cell needs the model's token-frequency ranking")
        frame = shortlist_coverage_by(ranking, traces, by, p["shortlist_k"])
        return frame.with_columns(pl.lit("frspec").alias("policy"), pl.lit(a).alias("analysis"))
    if a == "distances":
        frame = distance_histograms(traces, by, k_pre=p["k_pre"], k_ver=p["k_ver"], sources=p["sources"])
        return frame.with_columns(pl.lit(a).alias("analysis"))
    if a == "miss_ratio":
        frame = miss_ratio_curves(traces, p["capacities"], by, k_pre=p["k_pre"], k_ver=p["k_ver"],
                                  sources=p["sources"])
        return frame.with_columns(pl.lit(a).alias("analysis"))
    raise CoverageCellError(f"unknown analysis {a!r}")


def timed_coverage_cell(p: dict, traces: Sequence[Trace], ranking: pl.DataFrame | None = None
                        ) -> tuple[pl.DataFrame, dict]:
    """`coverage_cell` and the seconds it took (what a Ray task returns to the driver)."""
    t0 = time.perf_counter()
    frame = coverage_cell(p, traces, ranking)
    return frame, {"seconds": time.perf_counter() - t0}


def timed_coverage_cells(params: Sequence[dict], traces: Sequence[Trace], ranking: pl.DataFrame | None = None
                         ) -> list[tuple[pl.DataFrame | None, dict]]:
    """`timed_coverage_cell` for several cells on the same traces (one Ray task: see `sweeps.run`); a cell
    that raises gives (None, {"error": ...}) and the others still run."""
    out = []
    for p in params:
        try:
            out.append(timed_coverage_cell(p, traces, ranking))
        except Exception as e:   # one bad cell must not lose the batch; the driver reports it as failed
            lines = str(e).strip().splitlines()
            out.append((None, {"error": f"{type(e).__name__}: {lines[0] if lines else ''}"}))
    return out
