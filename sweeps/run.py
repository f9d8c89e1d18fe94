"""Run a sweep on Ray: `python -m sweeps.run CONFIG --out DIR [--address auto|HOST:PORT|ray://HOST:PORT]`.

    python -m sweeps.run sweeps/configs/quick.toml --out results/quick          # a local Ray on 127.0.0.1
    ray job submit --working-dir . --runtime-env-json '{"env_vars": {"SPECVOCAB_DATA": "/shared/data"}}' \\
        -- python -m sweeps.run sweeps/configs/paper.toml --out /shared/results/paper --address auto

Order: per model, one pool of actors (`ModelWorker`: the model loaded once per actor) runs that model's
record and calibrate cells, then its bench cells - a bench cell of a calibrated method without a draft size
of its own runs at the g* just measured (`draft_size_from` names the calibrate cell); the actors are then
released and the next model's pool starts. Last, the coverage cells run as plain Ray tasks (no model) on
the record cells' traces, several cells to a task (they take milliseconds each). On a cluster with GPUs
each actor takes one GPU; on CPUs each actor takes one core and runs torch on one thread, so timed cells
never share a core. Actors restart up to twice (`max_restarts=2`) and a cell whose actor died is retried
on the restarted actor (`max_task_retries=2`); an actor that fails to load its model fails that model's
cells.

The driver writes every finished cell's frame to `DIR/kind=.../model=.../method=.../<id>.parquet`
(`sweeps.results`), so results need no shared file system; a rerun of the same command skips cells whose
file exists. At the end the files are counted against the cell list and a summary says what ran, what was
skipped and what failed (with the error). Exit status: 0 when every cell has its file, 1 otherwise, 2 for a
bad config, output folder or address.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import polars as pl
import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError
from tqdm.auto import tqdm

from engine.calibration import calibration_fields
from engine.config import SpecConfig
from locality.trace import read_traces
from sweeps.cluster import connect, resources
from sweeps.cell import Cell, SweepError
from sweeps.config import MODEL_KINDS, Sweep, load_sweep, plan
from sweeps.coverage_cells import timed_coverage_cells
from sweeps.model_cells import ModelWorker, bench_config
from sweeps.results import cell_path, finished, prepare_output, ranking_path, write_cell, write_frame

WAIT_S = 1.0                      # how often the driver wakes to refresh the progress bar
BATCHES_PER_SLOT = 4              # coverage: tasks per worker slot and group of cells sharing traces
QUEUED_PER_SLOT = 2               # coverage: tasks submitted per worker slot when no --max-workers cap binds,
                                  # so a worker that finishes one starts the next while the driver writes


class _RayModelWorker(ModelWorker):
    """ModelWorker as a Ray actor: its stats also say whether Ray restarted this actor's process."""

    def stats(self) -> dict:
        return {**super().stats(), "restarted": ray.get_runtime_context().was_current_actor_reconstructed}


@dataclass
class Failure:
    cell: Cell
    error: str


@dataclass
class Summary:
    out: Path
    total: int
    skipped: int = 0
    ran: dict = field(default_factory=lambda: defaultdict(int))
    failed: list[Failure] = field(default_factory=list)
    files: int = 0
    actors: int = 0
    actor_pids: dict = field(default_factory=lambda: defaultdict(set))   # actor index -> process ids seen
    restarted: set = field(default_factory=set)                         # actor processes Ray restarted
    loads: dict = field(default_factory=dict)                           # actor process id -> models loaded
    cell_s: dict = field(default_factory=lambda: defaultdict(list))     # kind -> seconds per cell
    calibration_saved: set = field(default_factory=set)                 # calibration caches written
    wall_s: float = 0.0

    @property
    def missing(self) -> int:
        return self.total - self.files

    @property
    def ok(self) -> bool:
        return self.missing == 0 and not self.failed

    @property
    def restarts(self) -> int:
        return len(self.restarted)

    def lines(self) -> list[str]:
        ran = sum(self.ran.values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.ran.items())) or "none"
        out = [f"sweep: {self.total} cells - ran {ran} ({kinds}), skipped {self.skipped} (already finished), "
               f"failed {len(self.failed)}; {self.files}/{self.total} result files in {self.wall_s:.1f} s"]
        for kind, secs in sorted(self.cell_s.items()):
            out.append(f"  {kind}: {len(secs)} cells, {sum(secs) / len(secs):.2f} s per cell on its worker")
        if self.calibration_saved:
            out.append(f"  calibrate: g* also saved in {', '.join(sorted(self.calibration_saved))} (later runs of "
                       f"that model, device and config there take it as the default draft size)")
        if self.actors:
            per = sorted(set(self.loads.values()))
            out.append(f"  actors: {self.actors} started, {self.restarts} restarted; models loaded per actor "
                       f"process: {per} ({sum(self.loads.values())} loads in the {len(self.loads)} processes that "
                       f"finished cells)")
        for f in self.failed:
            out.append(f"  FAILED {f.cell.id} ({f.cell.describe()}): {f.error}")
        if self.missing and not self.failed:
            out.append(f"  {self.missing} cells have no result file (interrupted?): run the same command again")
        out.append(f"results: {self.out}  (read them with sweeps.load({str(self.out)!r}, kind))")
        return out


def _with_calibrated_size(cell: Cell, calibrated: dict) -> tuple[dict, str | None]:
    """A bench cell of a method this sweep calibrated, with no draft size of its own, runs at the measured
    g* (UniSpec §3: g* per model, device and method) of the calibrate cell whose config agrees on every
    field that changes tau(g) or s(g) (`engine.calibration.calibration_fields`). Passed at run time: the
    cell's id and parameters stay as configured; the rows' `draft_size` says what ran and `draft_size_from`
    where it came from."""
    config = cell.params.get("config", {})
    if cell.kind != "bench" or config.get("draft_size") is not None or cell.method not in calibrated:
        return cell.params, None
    mine = calibration_fields(SpecConfig.preset(cell.method, **bench_config(cell.params)))
    for fields, g, source in calibrated[cell.method]:
        if fields == mine:
            return {**cell.params, "config": {**config, "draft_size": g}}, source
    return cell.params, None


def _error_text(e: BaseException) -> str:
    if isinstance(e, RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        text = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {text[0] if text else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class _Driver:
    def __init__(self, sweep: Sweep, out: Path, summary: Summary, bar, max_workers: int | None):
        self.sweep, self.out, self.summary, self.bar = sweep, out, summary, bar
        cpus, gpus = resources()
        self.gpus = gpus
        slots = gpus if gpus else max(cpus, 1)
        self.slots = max(1, min(slots, max_workers or slots))
        self.task_slots = max(1, min(max(cpus, 1), max_workers or cpus or 1))
        # coverage tasks in flight: with every CPU a slot, QUEUED_PER_SLOT per slot (Ray starts a queued one
        # the moment a slot frees); under a --max-workers cap, one per slot, so the cap holds
        self.task_queue = QUEUED_PER_SLOT * self.task_slots if self.task_slots >= cpus else self.task_slots
        self.live = sys.stderr.isatty()

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

    def _fail(self, cell: Cell, error: str) -> None:
        self.summary.failed.append(Failure(cell, error))
        self.bar.write(f"FAILED {cell.describe()}: {error}")
        self.bar.update(1)

    # --- model cells on actors ------------------------------------------------------------------------
    def _actor(self, spec) -> tuple[int, object]:
        """(index, handle) of a new actor holding `spec`'s model."""
        opts = dict(num_cpus=1, max_restarts=2, max_task_retries=2)
        if self.gpus:
            opts["num_gpus"] = 1          # only when the cluster has GPUs: an actor asking for one waits forever
        threads = None if self.gpus else 1
        handle = ray.remote(_RayModelWorker).options(**opts).remote(
            spec.name, spec.options, self.sweep.dtype, threads, self.sweep.crash_once, self.sweep.delay_s,
            calibration_cache=self.sweep.calibration_cache)
        self.summary.actors += 1
        return self.summary.actors, handle

    def _note(self, actor: tuple[int, object], stats: dict) -> None:
        self.summary.actor_pids[actor[0]].add(stats["pid"])
        self.summary.loads[stats["pid"]] = stats["loads"]
        if stats.get("restarted"):
            self.summary.restarted.add(stats["pid"])

    def run_model(self, spec, cells: list[Cell], need_ranking: bool) -> None:
        """One pool of actors for `spec`'s model: record and calibrate cells first, then bench cells (so that
        a bench cell of a calibrated method can be given the g* measured here, `_with_calibrated_size`)."""
        n = max(1, min(self.slots, len(cells)))
        idle = [self._actor(spec) for _ in range(n)]
        inflight: dict = {}
        ranking_ref = idle[0][1].ranking.remote() if need_ranking else None
        try:
            first = [c for c in cells if c.kind != "bench"]
            for phase in (first, [c for c in cells if c.kind == "bench"]):
                calibrated = self._calibrated(spec) if phase is not first else {}
                self._run_phase(spec, deque(phase), idle, inflight, calibrated)
            if ranking_ref is not None:
                try:
                    write_frame(ray.get(ranking_ref), ranking_path(self.out, spec.label))
                except (RayTaskError, RayActorError) as e:
                    self.bar.write(f"could not count the token ranking of {spec.label}: {_error_text(e)}")
        finally:
            for _, handle in idle + [v[0] for v in inflight.values()]:      # (actor, cell, source)
                ray.kill(handle)

    def _run_phase(self, spec, queue: deque, idle: list, inflight: dict, calibrated: dict) -> None:
        while queue or inflight:
            while idle and queue:
                actor, cell = idle.pop(), queue.popleft()
                params, source = _with_calibrated_size(cell, calibrated)
                inflight[actor[1].run.remote(cell.kind, cell.method, params)] = (actor, cell, source)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=WAIT_S)
            self._tick()
            for ref in ready:
                actor, cell, source = inflight.pop(ref)
                try:
                    frame, stats = ray.get(ref)
                except RayTaskError as e:
                    self._fail(cell, _error_text(e))
                    idle.append(actor)
                    continue
                except (ActorDiedError, RayActorError) as e:
                    # the actor is gone after its restarts: this cell fails; if it could not even load the
                    # model, so does every queued cell of this model
                    self._fail(cell, f"actor died: {_error_text(e)}")
                    if "creation task" in str(e):
                        while queue:
                            self._fail(queue.popleft(), f"the model's actor could not start: {_error_text(e)}")
                    else:
                        idle.append(self._actor(spec))
                    continue
                self._note(actor, stats)
                if source is not None:
                    frame = frame.with_columns(pl.lit(source).alias("draft_size_from"))
                self._done(cell, frame, stats)
                idle.append(actor)

    def _calibrated(self, spec) -> dict[str, list[tuple[dict, int, str]]]:
        """{method: [(calibrate cell's config, g*, "calibrate:<cell id>")]} of this model's finished
        calibrate cells (this run's or an earlier one's)."""
        out: dict = defaultdict(list)
        for c in self.sweep.cells:
            path = cell_path(self.out, c)
            if c.kind == "calibrate" and c.model == spec.label and path.is_file():
                g = pl.read_parquet(path, columns=["g_star"])["g_star"].drop_nulls()
                if g.len():
                    fields = calibration_fields(SpecConfig.preset(c.method, **c.params["config"]))
                    out[c.method].append((fields, int(g[0]), f"calibrate:{c.id}"))
        return out

    # --- coverage cells as tasks ----------------------------------------------------------------------
    def run_coverage(self, cells: list[Cell]) -> None:
        """Coverage cells as plain Ray tasks, several cells per task (`_batches`), `task_queue` of them
        submitted at a time (Ray runs one per free CPU; the others wait queued); the traces of a model and
        prompt entry are read once and shared through the object store by every task that needs them."""
        by_id = {c.id: c for c in self.sweep.cells}
        task = ray.remote(timed_coverage_cells).options(num_cpus=1, max_retries=2)
        runnable = []
        for cell in cells:
            missing = [i for i in cell.needs if not cell_path(self.out, by_id[i]).is_file()]
            if missing:
                self._fail(cell, f"{len(missing)} of its {len(cell.needs)} record cells have no traces "
                                 f"(failed or not run): {missing[:3]}")
            elif cell.params["analysis"] == "shortlist" and not ranking_path(self.out, cell.model).is_file():
                self._fail(cell, f"no token ranking for {cell.model} ({ranking_path(self.out, cell.model)}); its "
                                 f"model actor could not count one - see the messages above")
            else:
                runnable.append(cell)
        traces: dict[tuple[str, ...], object] = {}
        rankings: dict[str, object] = {}
        queue = deque(self._batches(runnable))
        inflight: dict = {}
        while queue or inflight:
            while queue and len(inflight) < self.task_queue:
                batch = queue.popleft()
                needs, model = batch[0].needs, batch[0].model
                if needs not in traces:           # read once per (model, prompt entry), shared by its cells
                    traces[needs] = ray.put(read_traces([cell_path(self.out, by_id[i]) for i in needs]))
                ranking = None
                if any(c.params["analysis"] == "shortlist" for c in batch):
                    if model not in rankings:
                        rankings[model] = ray.put(pl.read_parquet(ranking_path(self.out, model)))
                    ranking = rankings[model]
                inflight[task.remote([c.params for c in batch], traces[needs], ranking)] = batch
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=WAIT_S)
            self._tick()
            for ref in ready:
                batch = inflight.pop(ref)
                try:
                    results = ray.get(ref)
                except (RayTaskError, RayActorError) as e:
                    for cell in batch:
                        self._fail(cell, _error_text(e))
                    continue
                for cell, (frame, stats) in zip(batch, results):
                    if frame is None:
                        self._fail(cell, stats["error"])
                    else:
                        self._done(cell, frame, stats)

    def _batches(self, cells: list[Cell]) -> list[list[Cell]]:
        """The cells of each (model, record cells read), cut into about BATCHES_PER_SLOT tasks per slot. A
        coverage cell takes tens of milliseconds: one task per cell left each worker idle while the driver
        wrote the previous result and started the next task (2 workers ran 1.6x one, not 2x); a few tasks per
        slot still share the work out evenly."""
        groups: dict[tuple, list[Cell]] = {}
        for c in cells:
            groups.setdefault((c.model, c.needs), []).append(c)
        out = []
        for group in groups.values():
            size = -(-len(group) // min(len(group), BATCHES_PER_SLOT * self.task_slots))
            out += [group[i:i + size] for i in range(0, len(group), size)]
        return out


def run_sweep(sweep: Sweep, out: str | Path, *, address: str | None = None, max_workers: int | None = None,
              num_cpus: int | None = None, progress: bool = True, show: bool = True) -> Summary:
    """Run every unfinished cell of `sweep` into `out` (see the module docstring); returns the Summary.

    Uses the Ray this process already joined (tests), else attaches to `address`, else starts a local Ray
    of `num_cpus` CPUs on 127.0.0.1. `max_workers` caps the actors per model and the concurrent coverage
    tasks (default: one per GPU, or one per CPU)."""
    t0 = time.perf_counter()
    out = prepare_output(out, sweep)
    done = finished(out, sweep.cells)
    summary = Summary(out=out, total=len(sweep.cells), skipped=len(done))
    todo = [c for c in sweep.cells if c.id not in done]
    started = connect(address, num_cpus) if todo else False
    try:
        with tqdm(total=len(sweep.cells), initial=len(done), desc=f"sweep {sweep.name}", unit="cell",
                  disable=not progress, dynamic_ncols=True) as bar:
            if todo:
                driver = _Driver(sweep, out, summary, bar, max_workers)
                shortlist_todo = {c.model for c in todo if c.kind == "coverage"
                                  and c.params["analysis"] == "shortlist"}
                for spec in sweep.models:
                    cells = [c for c in todo if c.model == spec.label and c.kind in MODEL_KINDS]
                    need_ranking = spec.label in shortlist_todo and not ranking_path(out, spec.label).is_file()
                    if cells or need_ranking:
                        driver.run_model(spec, cells, need_ranking)
                driver.run_coverage([c for c in todo if c.kind == "coverage"])
    finally:
        if started:
            ray.shutdown()
    summary.files = len(finished(out, sweep.cells))
    summary.wall_s = time.perf_counter() - t0
    if show:
        print("\n".join(summary.lines()), flush=True)
    return summary


def plan_table(sweep: Sweep) -> str:
    """The cells of a sweep per kind, model and method, with their prompt turns and the most tokens they
    generate."""
    frame = (pl.DataFrame(plan(sweep)).group_by("kind", "model", "method", maintain_order=True)
             .agg(cells=pl.len(), turns=pl.col("turns").sum(), tokens=pl.col("tokens").sum()))
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True,
                   tbl_width_chars=160, fmt_str_lengths=60):
        table = str(frame)
    return (f"sweep {sweep.name!r} (config hash {sweep.config_hash}): {len(sweep.cells)} cells, at most "
            f"{frame['tokens'].sum():,} generated tokens\n{table}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.run", description=__doc__.split("\n\n")[0])
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
    a = ap.parse_args(argv)
    try:
        sweep = load_sweep(a.config)
        if a.dry_run:
            print(plan_table(sweep))
            return 0
        summary = run_sweep(sweep, a.out, address=a.address, max_workers=a.max_workers, num_cpus=a.num_cpus,
                            progress=a.progress)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
