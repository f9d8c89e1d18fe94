"""A sweep's coverage results written without Ray or a model: the cells `sweeps.config` expands from a tiny
config (Spec-Bench split by category, the multilingual set split by language), each computed by
`sweeps.coverage_cells` on random traces and written as `sweeps.run` writes it (`sweeps.results.write_cell`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from specvocab.locality.trace import Trace
from specvocab.sweeps.config import load_sweep
from specvocab.sweeps.coverage_cells import coverage_cell
from specvocab.sweeps.results import write_cell
from tests.sweeps_testing import tiny_toml, write_toml

VOCAB, TOPK = 512, 8
MULTILINGUAL = '''
[[prompts]]
set = "multilingual"
per_category = 1
categories = ["qa"]
languages = ["de", "ja"]
split = "language"
'''
# the tasks each prompt set's coverage rows must name: categories for Spec-Bench, languages for multilingual
TASKS = {("spec_bench", "qa"), ("spec_bench", "writing"), ("multilingual", "de"), ("multilingual", "ja")}
GROUPS = {"spec_bench": [("qa", "en"), ("writing", "en")], "multilingual": [("qa", "de"), ("qa", "ja")]}


def traces(prompt_set: str, seed: int = 0) -> list[Trace]:
    """Two random traces per (category, language) of `prompt_set`, 12 prompt and 24 generated tokens each."""
    rng = np.random.default_rng(seed)
    out = []
    for category, language in GROUPS[prompt_set]:
        for i in range(2):
            out.append(Trace(prompt=rng.integers(0, VOCAB, 12), prefill_topk=rng.integers(0, VOCAB, (11, TOPK)),
                             generated=rng.integers(0, VOCAB, 24), step_topk=rng.integers(0, VOCAB, (24, TOPK)),
                             meta={"prompt_set": prompt_set, "category": category, "language": language,
                                   "prompt_id": f"{language}-{category}-{i}", "turn": 1}))
    return out


def write_coverage_sweep(folder: Path, out: Path, coverage: str = "k_pre = [1, 3]\nk_ver = [1, 3]") -> list:
    """Every coverage cell of the tiny config (more `[coverage]` lines: `coverage`) written into `out`;
    returns the cells."""
    sweep = load_sweep(write_toml(folder, tiny_toml(name="load", kinds=("record", "coverage"), coverage=coverage,
                                                    bench="", extra=MULTILINGUAL), "load.toml"))
    ranking = pl.DataFrame({"token_id": np.arange(VOCAB), "count": np.arange(VOCAB, 0, -1), "rank": np.arange(VOCAB)})
    cells = [c for c in sweep.cells if c.kind == "coverage"]
    for c in cells:
        write_cell(out, c, coverage_cell(c.params, traces(c.params["prompt_set"]), ranking), sweep.name, 0.0)
    return cells
