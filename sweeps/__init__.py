"""Sweeps over models, prompt sets, methods and their parameters, run on Ray (`python -m sweeps.run`), and
`load(DIR, kind)` to read their results as one polars LazyFrame. `sweeps.figures` holds the notebooks'
chart helpers."""

from sweeps.results import load

__all__ = ["load"]
