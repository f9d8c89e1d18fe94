"""Sweeps over models, prompt sets, methods and their parameters, run on Ray (`python -m specvocab.sweeps.run`), and
`load(DIR, kind)` to read their results as one polars LazyFrame. `sweeps.tables` (polars) and
`sweeps.charts` (altair) hold the figure notebooks' tables and charts; `sweeps.cli` is the `specvocab` command.
`load` is imported on first use, so that `specvocab --help` (sweeps.cli) loads nothing heavy."""

import importlib

__all__ = ["load"]


def __getattr__(name):
    if name == "load":
        return importlib.import_module("specvocab.sweeps.results").load
    raise AttributeError(f"module 'sweeps' has no attribute {name!r}")
