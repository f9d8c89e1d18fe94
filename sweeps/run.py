"""Run a sweep on Ray: `python -m specvocab.sweeps.run CONFIG --out DIR [--address auto|HOST:PORT|ray://HOST:PORT]
[--extend] [--strict-provenance] [--strict]`.

    python -m specvocab.sweeps.run sweeps/configs/quick.toml --out results/quick          # a local Ray on 127.0.0.1
    ray job submit --working-dir . --runtime-env-json '{"env_vars": {"SPECVOCAB_DATA": "/shared/data"}, "excludes": ["tests/"]}' \\
        -- python -m specvocab.sweeps.run sweeps/configs/paper.toml --out /shared/results/paper --address auto

Order: per model, one pool of actors (`ModelWorker`: the model loaded once per actor) runs that model's
record and calibrate cells, then its bench cells - a bench cell of a calibrated method without a draft size
of its own runs at the g* just measured (`draft_size_from` names the calibrate cell); other bench cells take
theirs from `[sweep] calibration`'s file or the method's uncalibrated default, never from a worker's
calibration cache (`sweeps.plan.draft_size_source`: listed by `--dry-run` and the summary, carried by every
row as `draft_size_source`; models of one method on different sources are flagged, `--strict` refuses them).
A cell's warnings come back with its result and are printed here, each once. The actors are then
released and the next model's pool starts. The timed cells (calibrate, bench) of a CPU sweep run one at a
time on each machine, after its record cells (`[sweep] timing = "exclusive"`, the default; "shared" runs
them as wide as the record cells): their rows say so (`timed_alone`), and so does the summary. Bench cells
run grouped by their prompts (`by_prompts`: every method on one task back to back), so that each speedup
over `ar` divides timings taken close together. Last, the coverage cells run as plain Ray tasks (no model) on
the record cells' traces, several cells to a task (they take milliseconds each). On a cluster with GPUs
each actor takes one GPU; on CPUs each actor takes one core (or the model's `num_cpus`) and runs torch on
that many threads, so timed cells never share a core. The driver loads each record / bench cell's prompts
and sends them with it (`sweeps.model_cells.SHIPPED`).

Trouble fails cells, never the sweep:
- a cell that raises fails with its error; its actor serves on;
- an actor that dies is restarted by Ray up to twice (`max_restarts=2`) and its cell retried there
  (`max_task_retries=2`); when Ray gives up, or any other Ray error comes back (worker crashed, out of
  memory, node died, object lost, runtime env failed: `ray.exceptions.RayError`), the cell fails and counts
  as one crash of its model; the actor is killed and the pool replaces it. After `[sweep] max_crashes`
  (default 3) crashes the model is stopped: its remaining cells fail, naming the count;
- an actor whose constructor raised (the model could not load: `ActorDiedError.actor_init_failed`; Ray does
  not restart those) stops its model at once, for the rest of the run: every remaining cell of it fails with
  the load error;
- a cell past its kind's `[timeouts]` (from when its actor had loaded the model; the load itself has
  `[timeouts] load`) fails; its actor is killed (`ray.kill`, no restart) and replaced. A coverage task past
  its time is cancelled;
- every failed cell's full error (remote traceback included) goes to `DIR/_errors/<cell id>.txt`, named in
  the summary; the file goes when the cell later finishes.

The driver writes every finished cell's frame to `DIR/kind=.../model=.../method=.../<id>.parquet`
(`sweeps.results`: written atomically and fsynced), so results need no shared file system; a rerun of the
same command skips cells whose file reads (a damaged one is moved aside and its cell rerun). The folder is
locked while a driver runs in it: a second one is refused, naming the first one's pid and host.
`sweep.json` records the config, the package version and git commit, torch / transformers versions and a
digest of the data files (`sweeps.provenance`); a resume under another environment warns, naming what
changed (`--strict-provenance`: refused). `--extend` takes a config whose cells include every cell of the
folder's own (another seed, model, w_max ...) into the same folder, keeping what is finished. At the end
the files are counted against the cell list and a summary says what ran, what was skipped and what failed
(with the error). Exit status: 0 when every cell has its file, 1 otherwise, 2 for a bad config, output
folder or address.

Multi-node (`--address`): `--out` must be an absolute path (exit 2 otherwise); attaching from a checkout
ships it to the workers as the job's runtime_env working_dir (`sweeps.cluster.checkout_runtime_env`; not
inside `ray job submit`, which has its own); each model may ask for `memory` and `num_cpus` per actor; the
calibration cache defaults to off (a cluster's workers are not the machine you run `generate` on).

The driver (`_Driver`) in parts, one per phase: `sweeps.run_actors` (the model actors: how many, where, their
cores), `sweeps.run_models` (record, calibrate and bench cells on them; each result or failure; the diagnosis
of rows that differ from ar's), `sweeps.run_coverage` (the coverage tasks) and `sweeps.run_summary` (the
summary and the error files); this module holds the run: the output folder, its lock, the order of the phases,
and the CLI.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import polars as pl
import ray
from tqdm.auto import tqdm

from specvocab.engine.calibration import calibration_source
from specvocab.engine.jobs.args import add_debug, debugging, run_main
from specvocab.sweeps.cell import Cell, SweepError
from specvocab.sweeps.checks import check_contexts
from specvocab.sweeps.cluster import connect, cpu_nodes, is_local, physical_cores, resources
from specvocab.sweeps.config import load_sweep
from specvocab.sweeps.plan import mixed_sources, plan
from specvocab.sweeps.results import (check_output_folder, finished, is_finished, load, lock_output, prepare_output,
                                      ranking_path, undiagnosed, write_cell, write_error)
from specvocab.sweeps.run_actors import ActorPool
from specvocab.sweeps.run_coverage import QUEUED_PER_SLOT, CoveragePhase
from specvocab.sweeps.run_models import ModelPhases
from specvocab.sweeps.run_summary import Failure, Summary, error_details, source_counts, source_lines
from specvocab.sweeps.schema import MODEL_KINDS, Sweep


def _calibration_records(sweep: Sweep) -> dict | None:
    """The records of the calibration file `[sweep] calibration` names, with its label and path, as bench
    cells carry them (`sweeps.model_cells.CALIBRATION`); None without one."""
    if sweep.calibration is None:
        return None
    src = calibration_source(sweep.calibration)
    return {"records": src.records, "label": src.label, "path": src.path}


class _Driver(ModelPhases, CoveragePhase, ActorPool):
    """One run's driver: its state (below), the bookkeeping every phase shares (`_done`, `_fail`, `_tick`), and
    the phases - `run_model` per model (`sweeps.run_models`, on `sweeps.run_actors`' pool), then
    `run_coverage` (`sweeps.run_coverage`)."""

    def __init__(self, sweep: Sweep, out: Path, summary: Summary, bar, max_workers: int | None,
                 calibration_cache: bool | str | None = None):
        self.sweep, self.out, self.summary, self.bar = sweep, out, summary, bar
        self.calibration_cache = sweep.calibration_cache if calibration_cache is None else calibration_cache
        cpus, gpus = resources()
        self.cpus, self.gpus = cpus, gpus
        self.max_workers = max_workers
        self.task_slots = max(1, min(max(cpus, 1), max_workers or cpus or 1))
        # coverage tasks in flight: with every CPU a slot, QUEUED_PER_SLOT per slot (Ray starts a queued one
        # the moment a slot frees); under a --max-workers cap, one per slot, so the cap holds
        self.task_queue = QUEUED_PER_SLOT * self.task_slots if self.task_slots >= cpus else self.task_slots
        self.live = sys.stderr.isatty()
        self.prompts: dict[str, list | None] = {}     # selection -> the prompts sent with its cells
        self.data_ref = None                           # the training corpus for the actors (`_worker_data`)
        # a local Ray on CPUs: timed actors pinned to distinct physical cores (`_take_cores`), else None
        self.free_cores: list[int] | None = physical_cores() if not gpus and is_local() else None
        # [sweep] timing = "exclusive" on CPUs: a model's timed cells run on one actor per machine (`timed_slots`)
        self.exclusive = sweep.timing == "exclusive" and not gpus
        self.nodes = cpu_nodes()
        self.warned: set[str] = set()                  # worker warnings already printed (each once)
        self.calibration = _calibration_records(sweep)  # [sweep] calibration's records, sent with bench cells

    # --- bookkeeping ----------------------------------------------------------------------------------
    def _done(self, cell: Cell, frame: pl.DataFrame, stats: dict) -> None:
        write_cell(self.out, cell, frame, self.sweep.name, stats.get("seconds"))
        self.summary.ran[cell.kind] += 1
        self.summary.cell_s[cell.kind].append(stats.get("seconds", 0.0))
        if stats.get("calibration_cache"):
            self.summary.calibration_saved.add(stats["calibration_cache"])
        self.bar.update(1)

    def _tick(self) -> None:
        if self.live:
            self.bar.refresh()            # a terminal's ETA moves on while a long cell runs

    def _fail(self, cell: Cell, error: str, exc: BaseException | None = None) -> None:
        try:
            details = write_error(self.out, cell, error_details(cell, error, exc))
        except OSError as e:              # a full disk must not stop the sweep's bookkeeping
            details = None
            self.bar.write(f"could not write the error of {cell.id}: {e}")
        self.summary.failed.append(Failure(cell, error, details))
        self.bar.write(f"FAILED {cell.describe()}: {error}" + (f" [full error: {details}]" if details else ""))
        self.bar.update(1)


def _needs_diagnosis(out: Path, label: str) -> bool:
    """Whether finished bench rows of this model differ from ar's without a verdict (a rerun diagnoses them)."""
    try:
        return bool(undiagnosed(load(out, "bench").filter(pl.col("model") == label).collect()))
    except SweepError:
        return False


def run_sweep(sweep: Sweep, out: str | Path, *, address: str | None = None, max_workers: int | None = None,
              num_cpus: int | None = None, progress: bool = True, show: bool = True, extend: bool = False,
              strict_provenance: bool = False, strict: bool = False) -> Summary:
    """Run every unfinished cell of `sweep` into `out` (see the module docstring); returns the Summary.

    Uses the Ray this process already joined (tests), else attaches to `address`, else starts a local Ray
    of `num_cpus` CPUs on 127.0.0.1. `max_workers` caps the actors per model and the concurrent coverage
    tasks (default: one per GPU, or one per CPU). The output folder is locked for the run (a second driver
    is refused); `extend` and `strict_provenance` as `sweeps.results.prepare_output`. Under `address`, `out`
    must be absolute and the calibration cache is off unless the config sets `calibration_cache`. First, before
    anything is written: the prompts against every model's context (`sweeps.checks.check_contexts`), and
    whether a drafting method's bench cells take their draft sizes from different kinds of source on different
    models (`sweeps.plan.mixed_sources`: printed; with `strict`, a SweepError)."""
    t0 = time.perf_counter()
    check_contexts(sweep)
    mixed = mixed_sources(sweep)
    if mixed and strict:
        raise SweepError(f"the models of this sweep would run with draft sizes from different sources "
                         f"({'; '.join(mixed)}) — "
                         f"--strict refuses that: give every model the same source (a [[calibrate]] entry, "
                         f"[sweep] calibration = FILE or params.draft_size), or run without --strict")
    if mixed and show:
        print("\n".join(["warning: draft sizes from different sources on different models (their speedups "
                         "compare a measured g* with a guess; --strict refuses this):", *[f"  {m}" for m in mixed]]),
              file=sys.stderr, flush=True)
    if address is not None and not Path(out).expanduser().is_absolute():
        raise SweepError(f"--out {out} is a relative path — with --address give an absolute one (the driver of "
                         f"a cluster job runs in a copy of the working dir, so a relative folder would land "
                         f"there and vanish with it), e.g. --out /shared/results/{sweep.name}")
    out = Path(out).expanduser().resolve()
    check_output_folder(out)
    lock = lock_output(out)
    try:
        summary = _run_locked(sweep, out, address, max_workers, num_cpus, progress, False, extend,
                              strict_provenance, t0)
        summary.sources = source_counts(sweep)
        if show:
            print("\n".join(summary.lines()), flush=True)
        return summary
    finally:
        lock.release()


def _run_locked(sweep, out, address, max_workers, num_cpus, progress, show, extend, strict_provenance, t0):
    cpu0 = time.process_time()
    out = prepare_output(out, sweep, extend=extend, strict_provenance=strict_provenance)
    damaged: list = []
    done = finished(out, sweep.cells, damaged)
    summary = Summary(out=out, total=len(sweep.cells), skipped=len(done), damaged=damaged)
    todo = [c for c in sweep.cells if c.id not in done]
    diagnose = {spec.label for spec in sweep.models if _needs_diagnosis(out, spec.label)}   # from an earlier run
    started = connect(address, num_cpus) if todo or diagnose else False
    cache = sweep.calibration_cache if sweep.calibration_cache_set or address is None else False
    try:
        with tqdm(total=len(sweep.cells), initial=len(done), desc=f"sweep {sweep.name}", unit="cell",
                  disable=not progress, dynamic_ncols=True) as bar:
            if todo or diagnose:
                driver = _Driver(sweep, out, summary, bar, max_workers, calibration_cache=cache)
                shortlist_todo = {c.model for c in todo if c.kind == "coverage"
                                  and c.params["analysis"] == "shortlist"}
                for spec in sweep.models:
                    cells = [c for c in todo if c.model == spec.label and c.kind in MODEL_KINDS]
                    need_ranking = spec.label in shortlist_todo and not is_finished(ranking_path(out, spec.label))
                    if cells or need_ranking or spec.label in diagnose:
                        driver.run_model(spec, cells, need_ranking)
                driver.run_coverage([c for c in todo if c.kind == "coverage"])
    finally:
        if started:
            ray.shutdown()
    summary.files = len(finished(out, sweep.cells, summary.damaged))
    summary.wall_s = time.perf_counter() - t0
    summary.driver_cpu_s = time.process_time() - cpu0         # the driver's own work, counted
    if show:
        print("\n".join(summary.lines()), flush=True)
    return summary


def plan_table(sweep: Sweep) -> str:
    """The cells of a sweep per kind, model and method, with their prompt turns and the most tokens they
    generate."""
    frame = (pl.DataFrame(plan(sweep)).group_by("kind", "model", "method", "draft_size_source", maintain_order=True)
             .agg(cells=pl.len(), turns=pl.col("turns").sum(), tokens=pl.col("tokens").sum()))
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True,
                   tbl_width_chars=160, fmt_str_lengths=60):
        table = str(frame)
    mixed = mixed_sources(sweep)
    lines = source_lines(source_counts(sweep))
    if mixed:
        lines += ["  MIXED: draft sizes from different sources on different models (--strict refuses this):",
                  *[f"    {m}" for m in mixed]]
    return (f"sweep {sweep.name!r} (config hash {sweep.config_hash}): {len(sweep.cells)} cells, at most "
            f"{frame['tokens'].sum():,} generated tokens\n{table}" + "".join(f"\n{x}" for x in lines))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specvocab.sweeps.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="the sweep's TOML file (see sweeps.config)")
    ap.add_argument("--out", required=True, help="output folder (one sweep config per folder; rerun to resume)")
    ap.add_argument("--address", default=None,
                    help="an existing Ray cluster: auto (inside `ray job submit`), HOST:PORT or ray://HOST:PORT; "
                         "default: start a local Ray bound to 127.0.0.1")
    ap.add_argument("--max-workers", type=int, default=None, help="cap on actors per model / concurrent tasks")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--dry-run", action="store_true", help="validate, print the cells per kind / model / method "
                                                           "and the tokens they generate, and stop")
    ap.add_argument("--extend", action="store_true",
                    help="take a config that extends the folder's own (a superset of its cells: another seed, "
                         "model, w_max ...) into the same --out; finished cells are kept, not run again")
    ap.add_argument("--strict-provenance", action="store_true",
                    help="refuse to resume a folder started under another package version, git commit, torch, "
                         "transformers or data files (default: a warning naming what changed)")
    ap.add_argument("--strict", action="store_true",
                    help="refuse a sweep whose models would run a drafting method with draft sizes from different "
                         "sources (a calibrate cell on one, the uncalibrated default on another ...)")
    add_debug(ap)
    a = ap.parse_args(argv)
    try:
        sweep = load_sweep(a.config)
        if a.dry_run:
            check_contexts(sweep)                       # (run_sweep makes the same check first)
            print(plan_table(sweep))
            if a.strict and mixed_sources(sweep):
                raise SweepError(f"--strict: the models of this sweep would run with draft sizes from different "
                                 f"sources ({'; '.join(mixed_sources(sweep))}) — give every model the same source")
            return 0
        summary = run_sweep(sweep, a.out, address=a.address, max_workers=a.max_workers, num_cpus=a.num_cpus,
                            progress=a.progress, extend=a.extend, strict_provenance=a.strict_provenance,
                            strict=a.strict)
    except SweepError as e:
        if debugging():
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
