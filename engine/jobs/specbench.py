"""Spec-Bench model-answer files of a bench --out folder (`engine.specbench` writes them; the format is in its
docstring).

    python -m specvocab.engine.jobs.specbench runs/bench --out runs/bench/spec_bench_answers        # or: specvocab specbench
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import polars as pl

from specvocab.engine.jobs.args import add_debug, check_out, run_main
from specvocab.engine.specbench import SpecBenchError, tokenizer_decoder, write_answer_files


def read_rows(source: str | Path) -> pl.DataFrame:
    """Bench rows of an engine.jobs.bench --out folder (its results.parquet) or a results Parquet file."""
    source = Path(source)
    if source.is_file():
        return pl.read_parquet(source)
    if (source / "results.parquet").is_file():
        return pl.read_parquet(source / "results.parquet")
    if (source / "sweep.json").is_file():
        raise SpecBenchError(f"{source} is a sweep folder: `python -m specvocab.sweeps.render {source}` writes its answer "
                             f"files to {source}/spec_bench_answers (with its figures)")
    raise SpecBenchError(f"{source}: no results.parquet (an engine.jobs.bench --out folder) — pass one, or a "
                         f"results .parquet file")


def main(argv: Sequence[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description="Spec-Bench model-answer .jsonl files from bench rows (Spec-Bench's "
                                             "evaluation/speed.py and equal.py read them).")
    ap.add_argument("source", help="an engine.jobs.bench --out folder or its results.parquet")
    ap.add_argument("--out", required=True, help="the folder for <model>/<prompt set>/<run>.jsonl and index.json")
    add_debug(ap)
    a = ap.parse_args(argv)
    check_out("--out", a.out)
    rows = read_rows(a.source)                         # before any tokenizer loads
    written = write_answer_files(rows, a.out, tokenizer_decoder())
    for p in written:
        print(p)
    base = [p for p in written if p.stem == "ar"]
    if base:
        print(f"Spec-Bench: python evaluation/speed.py --file-path {written[0]} --base-path {base[0]} "
              f"--tokenizer-path <the model's folder>")
    return written


if __name__ == "__main__":
    sys.exit(run_main(main))
