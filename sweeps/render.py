"""Draw every figure of a sweep: `python -m specvocab.sweeps.render DIR [--out FIGURES] [--only 01,04]`.

    python -m specvocab.sweeps.run sweeps/configs/quick.toml --out results/quick
    python -m specvocab.sweeps.render results/quick                  # -> results/quick/figures/*.png, *.html

Each figure notebook `notebooks/NN_*.py` (jupytext percent format) is converted to a notebook in a temporary
folder and executed with papermill, its parameters cell given `results_dir = DIR` and `out_dir = FIGURES`
(default DIR/figures); notebooks run in parallel, one kernel process each (`--jobs`, default one per CPU).
Every notebook writes its figures there as PNG and self-contained HTML; the executed notebooks are kept as
FIGURES/notebooks/NN_*.ipynb (open them in JupyterLab to explore, or re-run them there). The PNGs each
notebook wrote are printed. A notebook that fails does not stop the others; the exit
status is 1 if any failed, 2 when DIR holds no sweep results.

The bench cells' rows also become Spec-Bench model-answer files, DIR/spec_bench_answers/<model>/<prompt
set>/<run>.jsonl (`engine.specbench`; Spec-Bench's evaluation/speed.py and equal.py read them), unless
`--no-answers`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import specvocab
from specvocab.engine.jobs.args import add_debug, debugging, run_main
from specvocab.engine.specbench import tokenizer_decoder, write_answer_files
from specvocab.sweeps.cell import SweepError
from specvocab.sweeps.results import MANIFEST, load, result_files

try:            # the notebooks extra (jupytext, papermill, altair, vl-convert); named in the error when missing
    import jupytext
    import papermill

    from specvocab.sweeps.charts import FIGURE_LINE
except ImportError as e:                                        # pragma: no cover - an install without it
    jupytext = papermill = None
    _IMPORT_ERROR = e

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"  # a checkout's notebooks/; a wheel's specvocab/notebooks/
PACKAGE_HOME = Path(specvocab.__file__).resolve().parents[1]  # the folder `import specvocab` found it in
KERNEL = "python3"


@dataclass
class Rendered:
    notebook: Path
    executed: Path
    seconds: float
    figures: list[Path] = field(default_factory=list)           # PNGs written by this notebook
    error: str | None = None


def notebooks(folder: str | Path = NOTEBOOKS, only: Sequence[str] | None = None) -> list[Path]:
    """The figure notebooks `NN_*.py` in `folder`, in order; `only`: their numbers or stems ("01", "03_methods")."""
    found = sorted(Path(folder).glob("[0-9][0-9]_*.py"))
    if not found:
        raise SweepError(f"no figure notebooks (NN_*.py) in {folder} — the default is the package's own "
                         f"({NOTEBOOKS})")
    if only:
        want = [str(o).strip() for o in only if str(o).strip()]
        picked = [p for p in found if p.stem[:2] in want or p.stem in want]
        unknown = [w for w in want if not any(p.stem[:2] == w or p.stem == w for p in found)]
        if unknown:
            raise SweepError(f"--only {unknown}: no such notebook — have {[p.stem for p in found]}")
        found = picked
    return found


def check_results(results_dir: str | Path) -> Path:
    """`results_dir` resolved, or SweepError when it holds no sweep results."""
    path = Path(results_dir).expanduser().resolve()
    if not path.is_dir():
        raise SweepError(f"{path} is not a folder — pass the --out folder of "
                         f"`python -m specvocab.sweeps.run CONFIG --out DIR`")
    if not result_files(path):
        what = "an unfinished sweep (no cell finished yet)" if (path / MANIFEST).is_file() else "not a sweep's output"
        raise SweepError(f"{path} holds no sweep results ({what}) — run "
                         f"`python -m specvocab.sweeps.run CONFIG --out {path}` first, then render")
    return path


def _figures(executed: Path) -> list[Path]:
    """The PNGs a notebook announced (`sweeps.charts.save_chart` prints FIGURE_LINE + path) in its outputs."""
    if not executed.is_file():
        return []
    out = []
    for cell in json.loads(executed.read_text()).get("cells", []):
        for output in cell.get("outputs", []):
            text = output.get("text", "")
            for line in (text if isinstance(text, str) else "".join(text)).splitlines():
                if line.startswith(FIGURE_LINE):
                    out.append(Path(line[len(FIGURE_LINE):].strip()))
    return sorted(set(out))


@contextmanager
def _this_checkout_first():
    """PYTHONPATH starts with the folder holding this `specvocab` (a checkout's root, or site-packages) while
    notebook kernels start: they import the package whose notebooks they run, whichever checkout an editable
    install points at (or with none)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_HOME), *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _execute(nb: Path, tmp: Path, executed: Path, parameters: dict) -> Rendered:
    ipynb = tmp / f"{nb.stem}.ipynb"
    jupytext.write(jupytext.read(nb), ipynb)
    item = Rendered(nb, executed, 0.0)
    t0 = time.perf_counter()
    try:
        # no cwd=: papermill would os.chdir this whole process from each thread, and the threads' restores
        # interleave - the process was left in the deleted temporary folder (the next render then failed on
        # os.getcwd()); the notebooks take absolute paths and write nothing relative
        papermill.execute_notebook(str(ipynb), str(executed), kernel_name=KERNEL, language="python",
                                   progress_bar=False, log_output=False, parameters=parameters)
    except papermill.PapermillExecutionError as e:
        item.error = f"{e.ename}: {e.evalue}".strip().splitlines()[0]
    item.seconds = time.perf_counter() - t0
    item.figures = _figures(executed)
    return item


def render(results_dir: str | Path, out_dir: str | Path | None = None, only: Sequence[str] | None = None,
           folder: str | Path = NOTEBOOKS, jobs: int | None = None, show: bool = True) -> list[Rendered]:
    """Execute every figure notebook on `results_dir`, `jobs` at a time (default: one per CPU, at most one
    per notebook); returns what each wrote, in notebook order (see the module docstring)."""
    if papermill is None:
        raise SweepError(f"rendering needs the notebooks extra ({_IMPORT_ERROR}) — pip install -e '.[notebooks]'")
    results = check_results(results_dir)
    out = Path(out_dir).expanduser().resolve() if out_dir else results / "figures"
    executed_dir = out / "notebooks"
    executed_dir.mkdir(parents=True, exist_ok=True)
    todo = notebooks(folder, only)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    parameters = {"results_dir": str(results), "out_dir": str(out)}
    with _this_checkout_first(), tempfile.TemporaryDirectory(prefix="sweeps-render-") as tmp, \
            ThreadPoolExecutor(jobs) as pool:
        # each notebook runs in its own kernel process; the threads only wait on them
        futures = [pool.submit(_execute, nb, Path(tmp), executed_dir / f"{nb.stem}.ipynb", parameters)
                   for nb in todo]
        done = []
        for future in futures:
            item = future.result()
            done.append(item)
            if show:
                status = f"FAILED ({item.error}; see {item.executed})" if item.error else \
                    f"{len(item.figures)} figures in {item.seconds:.1f} s"
                print(f"{item.notebook.name}: {status}", flush=True)
                for p in item.figures:
                    print(f"  {p}", flush=True)
    if show:
        n = sum(len(r.figures) for r in done)
        print(f"figures: {out}  ({n} PNG + HTML; executed notebooks in {executed_dir})", flush=True)
    return done


def spec_bench_answers(results_dir: str | Path, out_dir: str | Path | None = None, show: bool = True) -> list[Path]:
    """Spec-Bench answer files of a sweep's bench cells (`engine.specbench`), in OUT (default
    DIR/spec_bench_answers); [] when the sweep has no bench results. Each model's tokenizer decodes its
    answers (a cell's `model` is its label; `model_name` is what loads)."""
    results = check_results(results_dir)
    if not result_files(results, "bench"):
        return []
    frame = load(results, "bench").collect()
    names = dict(frame.select("model", "model_name").unique().iter_rows()) if "model_name" in frame.columns else {}
    out = Path(out_dir).expanduser().resolve() if out_dir else results / "spec_bench_answers"
    written = write_answer_files(frame, out, tokenizer_decoder(names))
    if show:
        print(f"Spec-Bench answers: {out}  ({len(written)} files, one per model x prompt set x run; "
              f"index.json names them)", flush=True)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specvocab.sweeps.render", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a sweep's output folder (`python -m specvocab.sweeps.run CONFIG --out DIR`)")
    ap.add_argument("--out", default=None, help="where figures go (default: RESULTS/figures)")
    ap.add_argument("--only", default=None, help="comma list of notebook numbers or names, e.g. 01,04")
    ap.add_argument("--jobs", type=int, default=None, help="notebooks executed at once (default: one per CPU)")
    ap.add_argument("--no-answers", action="store_true",
                    help="skip the Spec-Bench answer files (RESULTS/spec_bench_answers)")
    add_debug(ap)
    a = ap.parse_args(argv)
    try:
        done = render(a.results, a.out, a.only.split(",") if a.only else None, jobs=a.jobs)
        if not a.no_answers:
            spec_bench_answers(a.results)
    except SweepError as e:
        if debugging():
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if any(r.error for r in done) else 0


if __name__ == "__main__":
    sys.exit(run_main(main))
