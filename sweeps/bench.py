"""The sweep machinery's own cost: `python -m specvocab.sweeps.bench [--out DIR] [--typical DIR]`.

On a grid of many cheap cells - MicroSpec window coverage (every k_pre x k_ver x sources) over traces a tiny
random model recorded through the sweep itself - it prints, with what was compared:

- the record phase: actors started and models loaded per actor process;
- the coverage cells called directly, one after another in this process (the floor);
- the same cells split over 2 plain processes (no Ray, nothing written): what two cores of this machine give
  on this work, the ceiling any scheduler can reach here;
- the same cells through `run_sweep` with 1 worker and with 2 workers (Ray tasks; the driver writes every
  cell's Parquet file): cells/s, overhead per cell over the direct call, and the 2-worker speedup (target
  >= 1.8x on 2 free cores), also as a share of the plain processes' ceiling;
- the overhead per cell against a typical bench cell: the median `cell_s` of the bench cells in `--typical`
  (a finished sweep's output folder, e.g. the quick sweep's), target <= 5%.

Workers are warmed by one untimed pass first (a fresh Ray worker imports polars and locality once), so the
timed passes measure steady-state scheduling, object transfer and file writing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from concurrent.futures import ProcessPoolExecutor

import ray

from specvocab.locality.trace import read_traces
from specvocab.sweeps.cluster import start_local
from specvocab.sweeps.config import parse_sweep
from specvocab.sweeps.coverage_cells import coverage_cell
from specvocab.sweeps.results import MANIFEST, cell_path, load
from specvocab.sweeps.run import run_sweep
from specvocab.sweeps.schema import Sweep

SOURCES = ("ctx+ext", "ctx", "ext")


def bench_sweep(k: int = 4, per_category: int = 4, max_new_tokens: int = 256, vocab_size: int = 4096) -> Sweep:
    """Record cells (a random Llama on Spec-Bench, one cell per category) and k x k x 3 window-coverage cells."""
    ks = list(range(1, k + 1))
    return parse_sweep({
        "sweep": {"name": "machinery", "kinds": ["record", "coverage"], "max_new_tokens": max_new_tokens},
        "models": [{"name": "random-llama", "label": "tiny",
                    "options": {"vocab_size": vocab_size, "hidden_size": 64, "num_layers": 2,
                                "max_context": 8192}}],
        "prompts": [{"set": "spec_bench", "per_category": per_category}],
        "record": {"topk": max(8, k)},
        "coverage": {"analyses": ["window"], "w_max": [256, 512, 1024, 2048, 3072, 4096, 8192], "k_pre": ks,
                     "k_ver": ks, "sources": list(SOURCES)},
    }, default_name="machinery")


def _copy_records(src: Path, dst: Path) -> Path:
    """A new output folder holding only `src`'s manifest and record cells (so a run there does coverage)."""
    dst.mkdir(parents=True)
    shutil.copy2(src / MANIFEST, dst / MANIFEST)
    shutil.copytree(src / "kind=record", dst / "kind=record")
    return dst


_TRACES: list = []


def _hold_traces(traces) -> None:
    _TRACES[:] = traces


def _plain_cells(params: list[dict]) -> float:
    """In a plain worker process: the cells on the traces it holds; the seconds they took."""
    t0 = time.perf_counter()
    for p in params:
        coverage_cell(p, _TRACES)
    return time.perf_counter() - t0


def _plain_two(params: list[dict], traces, repeats: int) -> float:
    """Best wall seconds of the cells split over 2 fresh (spawned) processes holding the traces already."""
    halves = [params[0::2], params[1::2]]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=ctx, initializer=_hold_traces, initargs=(traces,)) as pool:
        list(pool.map(_plain_cells, halves))                     # warm: imports, first-call costs
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(_plain_cells, halves))
            best = min(best, time.perf_counter() - t0)
    return best


def _timed_run(sweep: Sweep, out: Path, workers: int) -> tuple[float, float]:
    """(wall seconds, summed seconds the cells took on their workers) of one run_sweep."""
    t0 = time.perf_counter()
    s = run_sweep(sweep, out, max_workers=workers, progress=False, show=False)
    secs = time.perf_counter() - t0
    if not s.ok:
        raise RuntimeError("\n".join(s.lines()))
    return secs, sum(s.cell_s["coverage"])


def main(out: str | Path | None = None, typical: str | Path | None = None, k: int = 8, repeats: int = 1,
         per_category: int = 4, max_new_tokens: int = 256) -> dict:
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="sweeps-bench-"))
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} is not empty — pass a new folder to --out")
    sweep = bench_sweep(k, per_category, max_new_tokens)
    coverage = sweep.by_kind("coverage")
    n = len(coverage)
    own_ray = not ray.is_initialized()
    if own_ray:
        start_local(num_cpus=2)
    try:
        base = root / "base"
        # record once through the machinery (coverage cells included, untimed: this also warms the workers)
        t0 = time.perf_counter()
        rec = run_sweep(sweep, base, progress=False, show=False)
        first_s = time.perf_counter() - t0
        if not rec.ok:
            raise RuntimeError("\n".join(rec.lines()))
        traces = read_traces([cell_path(base, c) for c in sweep.by_kind("record")])
        tokens = sum(len(t.generated) for t in traces)

        direct, one, two = [], [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            for c in coverage:
                coverage_cell(c.params, traces)
            direct.append(time.perf_counter() - t0)
            one.append(_timed_run(sweep, _copy_records(base, root / f"w1-{r}"), 1))
            two.append(_timed_run(sweep, _copy_records(base, root / f"w2-{r}"), 2))
    finally:
        if own_ray:
            ray.shutdown()
    plain2 = _plain_two([c.params for c in coverage], traces, repeats)
    d, (t1, w1), (t2, w2) = min(direct), min(one), min(two)
    per_cell_ms = 1e3 * d / n
    overhead_ms = 1e3 * (t1 - d) / n
    lines = [
        f"sweeps machinery benchmark: {n} window-coverage cells (k_pre, k_ver in 1..{k}, sources {'/'.join(SOURCES)}, "
        f"7 window sizes each) over {len(traces)} traces / {tokens} generated tokens recorded by random-llama "
        f"(vocab {sweep.models[0].options['vocab_size']}) on Spec-Bench; best of {repeats}",
        f"  record phase (through the sweep, first pass incl. Ray start-up work and coverage): {first_s:.1f} s; "
        f"{rec.actors} actors, models loaded per actor process {sorted(set(rec.loads.values()))} "
        f"({sum(rec.loads.values())} loads for {rec.ran.get('record', 0)} record cells)",
        f"  direct calls, one process:   {d:7.2f} s  = {per_cell_ms:7.1f} ms per cell",
        f"  run_sweep, 1 worker:         {t1:7.2f} s  = {1e3 * t1 / n:7.1f} ms per cell, {n / t1:6.1f} cells/s; "
        f"overhead over direct {overhead_ms:+.1f} ms per cell ({(t1 - d) / d:+.0%} of a coverage cell)",
        f"  2 plain processes, no Ray:   {plain2:7.2f} s  = {d / plain2:.2f}x the direct calls: what 2 cores of this "
        f"machine give on these cells (the ceiling)",
        f"  run_sweep, 2 workers:        {t2:7.2f} s  = {n / t2:6.1f} cells/s; speedup over 1 worker "
        f"{t1 / t2:.2f}x (target >= 1.8x), over the direct calls {d / t2:.2f}x = {(d / t2) / (d / plain2):.0%} "
        f"of the ceiling",
        f"  on the workers: a cell took {1e3 * w1 / n:.1f} ms with 1 worker, {1e3 * w2 / n:.1f} ms with 2 side by side "
        f"({w2 / w1:.2f}x: above 1 the two cores were not free); workers busy {w1 / t1:.0%} (1) and "
        f"{w2 / 2 / t2:.0%} (2) of the wall time - the rest is the machinery",
    ]
    result = {"cells": n, "direct_s": d, "one_worker_s": t1, "two_workers_s": t2, "overhead_ms": overhead_ms,
              "speedup": t1 / t2, "plain_two_s": plain2, "ceiling": d / plain2, "busy_one": w1 / t1, "busy_two": w2 / 2 / t2, "cell_slowdown_two": w2 / w1,
              "loads": dict(rec.loads), "actors": rec.actors}
    if typical is not None:
        bench = load(typical, "bench").select("cell_id", "cell_s").unique().collect()
        typical_s = statistics.median(bench["cell_s"].drop_nulls().to_list())
        lines.append(f"  against a typical bench cell (median of {bench.height} in {typical}: {typical_s:.1f} s): "
                     f"overhead {overhead_ms / 1e3 / typical_s:.2%} per cell (target <= 5%)")
        result["typical_bench_cell_s"] = typical_s
    print("\n".join(lines), flush=True)
    print(f"(folders: {root})")
    return result


def cli(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specvocab.sweeps.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="a new folder for the benchmark's sweeps (default: a temp folder)")
    ap.add_argument("--typical", default=None, help="a finished sweep's --out folder: its bench cells' median "
                                                    "seconds are the 'typical bench cell'")
    ap.add_argument("--k", type=int, default=8, help="k_pre and k_ver run over 1..k (k*k*3 cells)")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes (the best is reported)")
    ap.add_argument("--per-category", type=int, default=4, help="Spec-Bench prompts per category to record")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per recorded turn (cell cost)")
    a = ap.parse_args(argv)
    return main(out=a.out, typical=a.typical, k=a.k, repeats=a.repeats, per_category=a.per_category,
                max_new_tokens=a.max_new_tokens)


if __name__ == "__main__":
    cli()
