"""Sweeps over models, prompt sets, methods and their parameters, run on Ray (`python -m sweeps.run`), and
`load(DIR, kind)` to read their results as one polars LazyFrame. `sweeps.tables` (polars) and
`sweeps.charts` (altair) hold the figure notebooks' tables and charts."""

from sweeps.results import load

__all__ = ["load"]
