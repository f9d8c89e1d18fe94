"""Tidy tables for the figure notebooks (`notebooks/NN_*.py`), from the frames a sweep wrote; polars only.

Every table builder takes the frames a sweep wrote (`read(DIR, kind)`, i.e. `sweeps.load(DIR, kind)`
collected) and returns a small aggregated polars frame (altair refuses frames over 5,000 rows), or None
after printing why it cannot (a kind or an axis the sweep did not run). `sweeps.charts` draws them; the
notebooks only call the two. No torch and no altair at import (tests/test_layering.py): a results folder is
read and summarised in a process that never loads a model.

This module is the one name the notebooks import; the builders live one family of figures per module, each
over the readers of `sweeps.tables_common`:

- `sweeps.tables_common`: `read`, `describe` (a figure's subtitle lines), `RECORD_COLUMNS`, `DEFAULTS`.
- `sweeps.tables_coverage`: the model-free coverage cells - MicroSpec Fig. 1(b) (`coverage_vs_vocab`), LRU vs
  FIFO (`miss_ratios`), window coverage per w_max and per (k_pre, k_ver) (`window_coverage`), reuse distances
  (`distances`), `languages_only`.
- `sweeps.tables_bench`: the bench rows - MicroSpec Table 2 (`method_summary`, `methods_wide`, `table_cells`),
  Table 2 on one head (`one_head_tables`), Fig. 4 (`phase_times`), Fig. 5 (`wmax_sweep`), `k_sweep`, UniSpec
  Fig. 4 (`language_speedup`), the merged drafter's tau by source (`tau_by_source`).
- `sweeps.tables_unispec`: UniSpec Fig. 3 (`confidence_bins`), App. F / Fig. 5 (`calibration_curves`,
  `g_stars`).
- `sweeps.tables_choices`: DynaSpec's unstated choices (`read_choices`, `dynaspec_choices`, `choices_table`).

The measures - tokens/s, speedup over ar, tau (bonus token included, ar = 1.00), draft time per drafted
step and by phase, draft_coverage - are `engine.metrics`' (its docstring names each once); the bench tables
(`method_summary`, the Table 2 of MicroSpec; `one_head_tables`, Table 2 on one head) are its summaries
with the sweep's run labels. Words as in `locality`'s glossary: the *window* is MicroSpec's FIFO suffix of the
candidate stream (MicroSpec §3.2, Eq. 4), its `w_max` counted in stream entries; a *static shortlist* is
FR-Spec's top-K of a token ranking counted on the training corpus (FR-Spec §3); *coverage* (the coverage
cells') = the fraction of generated tokens in the window or shortlist over a recorded trace.

`task` names what a paper calls a task (`engine.metrics.with_task`): the Spec-Bench category, or the language
for a prompt set split by language (the multilingual set), or both when a set has several of each; `panel`
adds the prompt set and the model when a sweep holds several. Every table keeps `model`: a sweep of several
models (`paper.toml`) is drawn per model (`sweeps.charts`).
"""

from __future__ import annotations

from specvocab.engine.methods import MERGE_SOURCES
from specvocab.engine.metrics import AVG, PHASES, with_task
from specvocab.sweeps.results import paper_stream, results_path
from specvocab.sweeps.tables_bench import (DRAFT_SIZE, k_sweep, language_speedup, method_summary, methods_wide,
                                           TARGET_PART, one_head_tables, phase_times, run_extras, run_order,
                                           table_cells, task_order, tau_by_source, with_run, wmax_sweep)
from specvocab.sweeps.tables_choices import (CENTRE_COLUMNS, CHOICE_FACTORS, CHOICES_COLUMNS, CHOICES_COMMAND,
                                             choices_centre, choices_table, dynaspec_choices, read_choices)
from specvocab.sweeps.tables_common import DEFAULTS, RECORD_COLUMNS, describe, read
from specvocab.sweeps.tables_coverage import (FIFO, LRU, STATIC, WINDOW, coverage_vs_vocab, default_point,
                                              distances, languages_only, miss_ratios, window_coverage)
from specvocab.sweeps.tables_unispec import FIT_POINTS, QUANTITIES, calibration_curves, confidence_bins, g_stars

__all__ = [
    # defined in engine.metrics and sweeps.results, re-exported for the notebooks and for analysis by hand
    "AVG", "PHASES", "with_task", "results_path", "paper_stream", "MERGE_SOURCES",
    # reading and describing (sweeps.tables_common)
    "read", "describe", "RECORD_COLUMNS", "DEFAULTS",
    # coverage (sweeps.tables_coverage)
    "WINDOW", "STATIC", "LRU", "FIFO", "default_point", "coverage_vs_vocab", "miss_ratios", "window_coverage",
    "languages_only", "distances",
    # bench (sweeps.tables_bench)
    "with_run", "method_summary", "run_extras", "one_head_tables", "run_order", "task_order", "DRAFT_SIZE",
    "methods_wide", "table_cells", "phase_times", "wmax_sweep", "k_sweep", "language_speedup", "tau_by_source",
    "TARGET_PART",
    # UniSpec (sweeps.tables_unispec)
    "confidence_bins", "QUANTITIES", "FIT_POINTS", "calibration_curves", "g_stars",
    # DynaSpec's choices (sweeps.tables_choices)
    "CHOICE_FACTORS", "CHOICES_COMMAND", "CHOICES_COLUMNS", "CENTRE_COLUMNS", "read_choices", "choices_centre",
    "dynaspec_choices", "choices_table",
]
