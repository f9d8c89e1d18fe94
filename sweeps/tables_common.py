"""Reading and describing a sweep's results for the figure tables (`sweeps.tables`); polars only.

`read(DIR, kind)` collects `sweeps.load(DIR, kind)` (None and one printed line when the sweep has no results of
that kind), `describe` says in subtitle lines what produced a frame, and `present` / `distinct_values` are the
checks and lookups every table builder (`sweeps.tables_coverage`, `_bench`, `_unispec`, `_choices`) starts
from. No torch and no altair at import (tests/test_layering.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import polars as pl

from specvocab.engine.config import SpecConfig
from specvocab.sweeps.cell import KINDS, SweepError
from specvocab.sweeps.results import load

# a record cell's scalar columns: enough to say what was recorded without reading the traces' token lists
RECORD_COLUMNS = ("model", "model_name", "prompt_set", "category", "language", "prompt_id", "turn",
                  "max_new_tokens", "topk", "dtype")
DEFAULTS = SpecConfig()                                     # the papers' defaults: w_max 3072, k_pre = k_ver = 3


def read(results_dir: str | Path, kind: str, columns: Sequence[str] | None = None) -> pl.DataFrame | None:
    """`sweeps.load(results_dir, kind)` collected (only `columns`, those present, when given), or None with
    a printed line when the sweep has no results of that kind - a notebook draws what it has."""
    if kind not in KINDS:
        raise ValueError(f"unknown result kind {kind!r} — choose from {list(KINDS)}")
    try:
        lazy = load(results_dir, kind)
    except SweepError as e:
        print(f"missing: {e}")
        return None
    if columns is not None:
        have = lazy.collect_schema().names()
        lazy = lazy.select([c for c in columns if c in have])
    return lazy.collect()


def present(frame: pl.DataFrame | None, what: str, *columns: str) -> bool:
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


def distinct_values(frame: pl.DataFrame, column: str) -> list:
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
                src = src.filter(pl.col(col).is_in(distinct_values(frame, col)))
    models = distinct_values(frame, "model")
    names = distinct_values(frame, "model_name")
    who = ", ".join(models) or "?"
    if names and names != models:
        who += f" ({', '.join(names)})"
    lines = [f"model: {who}"]
    sets = []
    for name in distinct_values(src, "prompt_set"):
        part = src.filter(pl.col("prompt_set") == name)
        bits = []
        if {"prompt_id", "turn"} <= set(part.columns):
            bits.append(f"{part.select('prompt_id', 'turn').unique().height} turns")
        for col, word in (("category", "categories"), ("language", "languages")):
            n = len(distinct_values(part, col))
            if n > 1:
                bits.append(f"{n} {word}")
        sets.append(f"{name} ({', '.join(bits)})" if bits else name)
    if sets:
        lines.append("prompts: " + "; ".join(sets))
    if not sets and {"curve", "prompts", "grid"} <= set(frame.columns):     # calibrate cells (engine.jobs.calibrate)
        grids = "; ".join(", ".join(map(str, json.loads(g))) for g in distinct_values(frame, "grid") if g != "null")
        grids = grids or "the device's default grid"
        warm = distinct_values(frame, "warmup")
        lines.append(f"prompts: {'/'.join(map(str, distinct_values(frame, 'prompts')))} training-corpus prompts (English)"
                     + (f" after {'/'.join(map(str, warm))} warm-up" if warm else "") + f"; draft sizes g = {grids}")
    tokens = _span(distinct_values(src, "max_new_tokens"), "new tokens per turn")
    if tokens:
        lines.append(tokens + (", greedy" if "temperature" not in frame.columns
                               or set(distinct_values(frame, "temperature")) <= {0.0} else ""))
    where = []
    for col, fmt in (("device", "{}"), ("dtype", "{}"), ("backend", "{} target forward"),
                     ("threads", "torch threads: {}")):
        vals = distinct_values(frame, col)
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

