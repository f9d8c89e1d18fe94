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

(Over 600 lines on purpose: the driver's scheduling and every failure it survives - dead or hung actors,
Ray system errors, crash bounds, the output lock - read in one place, top to bottom.)
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
import warnings
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import polars as pl
import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm.auto import tqdm

from specvocab.engine.calibration import calibration_source
from specvocab.engine.config import SpecConfig, calibration_fields
from specvocab.engine.jobs.args import add_debug, debugging, run_main
from specvocab.locality.trace import read_traces
from specvocab.sweeps.cluster import connect, cpu_nodes, is_local, physical_cores, resources
from specvocab.sweeps.cell import Cell, SweepError, canonical_json
from specvocab.sweeps.checks import check_contexts
from specvocab.sweeps.config import load_sweep
from specvocab.sweeps.coverage_cells import timed_coverage_cells
from specvocab.sweeps.model_cells import CALIBRATION, SHIPPED, ModelWorker, bench_config, data_files, shipped_prompts
from specvocab.sweeps.plan import draft_size_sources, mixed_sources, plan
from specvocab.sweeps.results import (DIAGNOSIS_KEY, cell_path, check_output_folder, diagnosis_path, finished, is_finished,
                            load, lock_output, prepare_output, ranking_path, undiagnosed, write_cell, write_error,
                            write_frame)
from specvocab.sweeps.schema import MODEL_KINDS, TIMED_KINDS, Sweep

WAIT_S = 1.0                      # how often the driver wakes to refresh the progress bar
BATCHES_PER_SLOT = 4              # coverage: tasks per worker slot and group of cells sharing traces
QUEUED_PER_SLOT = 2               # coverage: tasks submitted per worker slot when no --max-workers cap binds,
                                  # so a worker that finishes one starts the next while the driver writes


class _RayModelWorker(ModelWorker):
    """ModelWorker as a Ray actor: its stats also say whether Ray restarted this actor's process."""

    def stats(self) -> dict:
        ctx = ray.get_runtime_context()
        with warnings.catch_warnings():           # Ray's deprecation notice, not the cell's: kept off the console
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ctx.was_current_actor_reconstructed
        return {**super().stats(), "restarted": restarted, "node": ctx.get_node_id()}


@dataclass
class Failure:
    cell: Cell
    error: str
    details: Path | None = None          # OUT/_errors/<cell id>.txt: the full error


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
    crashes: dict = field(default_factory=lambda: defaultdict(int))     # model label -> actor deaths seen
    stopped: dict = field(default_factory=dict)                         # model label -> why it was stopped
    damaged: list = field(default_factory=list)                         # (result file, where it was moved)
    actor_cores: dict = field(default_factory=dict)                     # actor process id -> CPUs pinned to
    diagnosed: int = 0                                                  # bench rows diagnosed against ar's
    driver_cpu_s: float = 0.0                                           # this process's CPU time (user + sys)
    timing: str = ""                                                    # how timed cells shared machines
    spans: list = field(default_factory=list)                           # (kind, node, began, ended, cell id)
    sources: dict = field(default_factory=dict)                         # draft size source -> {method: cells}
    warnings: list = field(default_factory=list)                        # distinct worker warnings, as printed
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
        out += source_lines(self.sources)
        if self.warnings:
            out.append(f"  {len(self.warnings)} distinct warnings from the workers (printed above as they came)")
        if self.calibration_saved:
            out.append(f"  calibrate: g* also saved in {', '.join(sorted(self.calibration_saved))} (later runs of "
                       f"that model, device and config there take it as the default draft size)")
        if self.actors:
            per = sorted(set(self.loads.values()))
            out.append(f"  actors: {self.actors} started, {self.restarts} restarted; models loaded per actor "
                       f"process: {per} ({sum(self.loads.values())} loads in the {len(self.loads)} processes that "
                       f"finished cells)")
        if self.timing:
            out.append(f"  timed cells (calibrate, bench): {self.timing}")
        if self.diagnosed:
            out.append(f"  {self.diagnosed} bench rows that differ from ar's diagnosed (exact / near-tie / mismatch: "
                       f"DIR/_diagnoses, joined by sweeps.load)")
        if self.actor_cores:
            cores = sorted({tuple(c) for c in self.actor_cores.values()})
            shared = len(cores) < len(self.actor_cores) and "; later actors reused the cores of finished ones" or ""
            out.append(f"  model actors pinned to physical cores (one CPU each, never two on one core at once): "
                       f"{', '.join('+'.join(map(str, c)) for c in cores)}{shared}")
        if self.wall_s:
            share = self.driver_cpu_s / self.wall_s
            out.append(f"  driver: {self.driver_cpu_s:.1f} s of CPU in {self.wall_s:.1f} s ({share:.0%} of one core) "
                       f"beside the timed actors" + (" - a share that can slow timed cells on a machine with no "
                                                     "spare core" if share > 0.1 else ""))
        for path, moved in self.damaged:
            out.append(f"  damaged result file {path} (no readable Parquet footer) moved to {moved.name}; its "
                       f"cell ran again")
        for label, why in self.stopped.items():
            out.append(f"  STOPPED model {label}: {why}")
        for f in self.failed:
            more = f" [full error: {f.details}]" if f.details else ""
            out.append(f"  FAILED {f.cell.id} ({f.cell.describe()}): {f.error}{more}")
        if self.missing and not self.failed:
            out.append(f"  {self.missing} cells have no result file (interrupted?): run the same command again")
        out.append(f"results: {self.out}  (read them with sweeps.load({str(self.out)!r}, kind))")
        return out


def by_prompts(cells: list[Cell]) -> list[Cell]:
    """Bench cells grouped by the prompts they run (model, prompt set, split value), in the order the groups
    first appear, the config's order within each: every method on one task's prompts runs back to back, so
    a speedup over `ar` (engine.metrics, per task) divides timings minutes closer together than in the
    config's method-major order - a shared VM's speed drifts by 10-40% over a run."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.model, c.params.get("prompt_set"), c.params.get("split_value")), []).append(c)
    return [c for group in groups.values() for c in group]


def _with_calibrated_size(cell: Cell, calibrated: dict, calibration: dict | None = None) -> tuple[dict, str | None]:
    """A bench cell of a method this sweep calibrated, with no draft size of its own, runs at the measured
    g* (UniSpec §3: g* per model, device and method) of the calibrate cell whose config agrees on every
    field that changes tau(g) or s(g) (`engine.config.calibration_fields`). Passed at run time: the
    cell's id and parameters stay as configured; the rows' `draft_size` says what ran and `draft_size_from`
    where it came from. A bench cell no calibrate cell covers gets `calibration` (the records of `[sweep]
    calibration`, `sweeps.model_cells.CALIBRATION`) when the sweep names a file; without one its worker
    takes the method's uncalibrated default - never the worker machine's calibration cache."""
    config = cell.params.get("config", {})
    if cell.kind != "bench" or config.get("draft_size") is not None:
        return cell.params, None
    if cell.method not in calibrated:
        return ({**cell.params, CALIBRATION: calibration} if calibration is not None and not
                cell.params.get("calibrate_cell") else cell.params), None
    mine = calibration_fields(SpecConfig.preset(cell.method, **bench_config(cell.params)))
    for fields, g, source in calibrated[cell.method]:
        if fields == mine:
            return {**cell.params, "config": {**config, "draft_size": g}}, source
    return cell.params, None


def _calibration_records(sweep: Sweep) -> dict | None:
    """The records of the calibration file `[sweep] calibration` names, with its label and path, as bench
    cells carry them (`sweeps.model_cells.CALIBRATION`); None without one."""
    if sweep.calibration is None:
        return None
    src = calibration_source(sweep.calibration)
    return {"records": src.records, "label": src.label, "path": src.path}


def source_counts(sweep: Sweep, cells=None) -> dict[str, dict[str, int]]:
    """{draft size source: {method: bench cells}} of `cells` (default every cell of the sweep)
    (`sweeps.plan.draft_size_source`)."""
    sources = draft_size_sources(sweep)
    out: dict = defaultdict(lambda: defaultdict(int))
    for c in sweep.cells if cells is None else cells:
        if sources.get(c.id) is not None:
            out[sources[c.id]][c.method] += 1
    return {k: dict(v) for k, v in out.items()}


def source_lines(counts: dict[str, dict[str, int]]) -> list[str]:
    """The draft sizes' sources, one line each, for the dry-run and the summary."""
    out = []
    for src, methods in sorted(counts.items()):
        what = ", ".join(f"{m} {n}" for m, n in sorted(methods.items()))
        hint = (" - the method's uncalibrated size: add a [[calibrate]] entry, [sweep] calibration = FILE or "
                "params.draft_size" if src == "default" else "")
        out.append(f"  draft sizes from {src}: {sum(methods.values())} bench cells ({what}){hint}")
    return out


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt): .*$", re.M)


def _first_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def _error_text(e: BaseException) -> str:
    """One line: the exception's type and the first line of its message (for a cell's own exception, the
    remote one's)."""
    if isinstance(e, RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return f"{type(cause).__name__}: {_first_line(cause)}"
    if isinstance(e, RayActorError) and e.actor_init_failed:
        # "The actor died because of an error raised in its creation task, <remote traceback>": the last
        # line of that traceback names the exception that stopped the constructor
        found = _EXC_LINE.findall(str(e))
        return found[-1].strip() if found else _first_line(e)
    return f"{type(e).__name__}: {_first_line(e)}"


def _error_details(cell: Cell, error: str, e: BaseException | None) -> str:
    """What OUT/_errors/<cell id>.txt holds: the cell, the one-line error, the full error (a Ray error's text
    carries the remote traceback) and the driver's traceback."""
    parts = [f"cell {cell.id}: {cell.describe()}", f"params: {canonical_json(cell.params)}",
             f"when: {time.strftime('%Y-%m-%dT%H:%M:%S')}", f"error: {error}", ""]
    if e is not None:
        parts += ["--- full error ---", str(e), "", "--- traceback in the driver ---",
                  "".join(traceback.format_exception(e))]
    return "\n".join(parts)


@dataclass
class _Actor:
    """A model actor: its handle, when it was asked for, and a call queued behind its constructor whose
    result says when the model is loaded (a cell's clock starts then, not while the model loads)."""

    index: int
    handle: object
    created: float
    ready_ref: object
    ready_at: float | None = None
    cores: tuple[int, ...] = ()       # the physical cores it is pinned to (a local Ray on CPUs), else ()
    node: str | None = None           # the node it is placed on (`[sweep] timing = "exclusive"` on several)


@dataclass
class _Job:
    actor: _Actor
    cell: Cell
    source: str | None
    sent: float
    alone: bool | None = None         # a timed cell: whether nothing else of the sweep ran on its machine


class _Driver:
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

    def _with_prompts(self, cell: Cell, params: dict) -> dict:
        """A record / bench cell's run-time params with the driver's prompts (`sweeps.model_cells.SHIPPED`):
        workers do not read prompt sets from their own data root."""
        if cell.kind not in ("record", "bench"):
            return params
        key = canonical_json([params[k] for k in ("prompt_set", "per_category", "categories", "languages")])
        if key not in self.prompts:
            try:
                self.prompts[key] = shipped_prompts(params)
            except Exception as e:  # noqa: BLE001 - the config check loaded them once; if not now, the worker tries
                self.bar.write(f"could not load the prompts of {cell.describe()} here ({_error_text(e)}); the "
                               f"worker loads them from its own data root")
                self.prompts[key] = None
        return {**params, SHIPPED: self.prompts[key]}

    def slots(self, spec) -> int:
        """Actors of `spec`'s model at a time: one per GPU, or per `num_cpus` CPUs (default 1), capped."""
        per = spec.num_cpus or 1.0
        slots = self.gpus if self.gpus else max(int(self.cpus // per), 1)
        return max(1, min(slots, self.max_workers or slots))

    def timed_slots(self, spec) -> int:
        """Actors running `spec`'s timed cells (calibrate, bench) at a time. Under `[sweep] timing =
        "exclusive"` on CPUs, one per machine that has the actor's CPUs, and nothing else of the sweep beside
        it: cells side by side share a machine's memory bandwidth, and a one-row decode step (`ar`'s) is bound
        by it while a speculative step of 5-8 rows is much less, so speedups measured beside a neighbour read
        high (PERFORMANCE.md, section 3). Else `slots`: one per GPU, or per `num_cpus` CPUs."""
        if not self.exclusive:
            return self.slots(spec)
        machines = sum(cpus >= (spec.num_cpus or 1.0) for cpus in self.nodes.values()) or 1
        return max(1, min(machines, self.max_workers or machines))

    def _timing(self, size: int, timed: int) -> str:
        """How this model's timed cells shared their machines, for the summary."""
        if self.exclusive:
            machines = f"each of {timed} machines" if timed > 1 else "its machine"
            return (f'one at a time on {machines}, nothing else of the sweep beside them ([sweep] timing = '
                    f'"exclusive"); record cells {size} at a time')
        if self.gpus:
            return f"one per GPU, up to {timed} at once"
        if timed <= 1:
            return "one at a time (one slot)"
        return (f'up to {timed} at once ([sweep] timing = "shared"): cells side by side share a machine\'s memory '
                f'bandwidth, which slows ar most; for speedups, set "exclusive"')

    def _free_node(self, pool: list, spec) -> str | None:
        """A live machine with the actor's CPUs that no actor of `pool` is placed on (the node list is read
        again when none is free: a machine may have joined or died)."""
        need = spec.num_cpus or 1.0
        for attempt in range(2):
            taken = {a.node for a in pool}
            free = [n for n, cpus in sorted(self.nodes.items()) if cpus >= need and n not in taken]
            if free:
                return free[0]
            if attempt == 0:
                self.nodes = cpu_nodes()
        return None

    def _narrow(self, pool: list, idle: list, size: int, pinned: bool) -> None:
        """Before a timed phase (every actor idle): at most `size` actors stay, and when they must each hold a
        machine of their own (`pinned`), only actors placed that way; the others are killed."""
        keep = [a for a in pool if a.node is not None or not pinned][:size]
        for a in [a for a in pool if a not in keep]:
            self._drop(a, pool, kill=True)
            if a in idle:
                idle.remove(a)

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
            details = write_error(self.out, cell, _error_details(cell, error, exc))
        except OSError as e:              # a full disk must not stop the sweep's bookkeeping
            details = None
            self.bar.write(f"could not write the error of {cell.id}: {e}")
        self.summary.failed.append(Failure(cell, error, details))
        self.bar.write(f"FAILED {cell.describe()}: {error}" + (f" [full error: {details}]" if details else ""))
        self.bar.update(1)

    # --- model cells on actors ------------------------------------------------------------------------
    def _actor(self, spec, node: str | None = None) -> _Actor:
        """A new actor holding `spec`'s model, with the model's Ray resources (`memory`, `num_cpus`); on the
        machine `node` when given (Ray's node affinity, not soft: it runs there or not at all)."""
        per = spec.num_cpus or 1.0
        opts = dict(num_cpus=per, max_restarts=2, max_task_retries=2)
        if spec.memory:
            opts["memory"] = spec.memory
        if node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        if self.gpus:
            opts["num_gpus"] = 1          # only when the cluster has GPUs: an actor asking for one waits forever
        threads = None if self.gpus else max(1, int(per))
        cores = self._take_cores(threads or 1)
        s = self.sweep
        handle = ray.remote(_RayModelWorker).options(**opts).remote(
            spec.name, spec.options, s.dtype, threads, s.crash_once, s.delay_s,
            calibration_cache=self.calibration_cache, crash=s.crash, hang=s.hang, data=self._worker_data(),
            cores=cores or None)
        self.summary.actors += 1
        return _Actor(self.summary.actors, handle, time.monotonic(), handle.stats.remote(), cores=cores, node=node)

    def _take_cores(self, n: int) -> tuple[int, ...]:
        """`n` physical cores no live actor holds (a local Ray on CPUs), for a new actor to pin its threads
        to; () elsewhere, or when fewer are free (more actors than cores: they float, as without pinning)."""
        if self.free_cores is None or len(self.free_cores) < n:
            return ()
        taken, self.free_cores = tuple(self.free_cores[:n]), self.free_cores[n:]
        return taken

    def _release(self, actor: _Actor) -> None:
        """An actor's cores back to the free list, once (it was killed or dropped)."""
        if self.free_cores is not None and actor.cores:
            self.free_cores = sorted(set(self.free_cores) | set(actor.cores))
            actor.cores = ()

    def _worker_data(self):
        """The driver's training corpus (`sweeps.model_cells.data_files`) in Ray's object store, put once and
        handed to every actor (Ray resolves the reference where the actor starts); None without one here."""
        if self.data_ref is None:
            files = data_files()
            self.data_ref = False if files is None else ray.put(files)
        return self.data_ref or None

    def _note(self, actor: _Actor, stats: dict) -> None:
        self.summary.actor_pids[actor.index].add(stats["pid"])
        if stats.get("cores") and actor.cores:
            self.summary.actor_cores[stats["pid"]] = stats["cores"]
        self.summary.loads[stats["pid"]] = stats["loads"]
        if stats.get("restarted"):
            self.summary.restarted.add(stats["pid"])

    def _stop(self, spec, why: str) -> None:
        """No more actors for `spec`'s model this run: its queued and later cells fail with `why`."""
        if spec.label not in self.summary.stopped:
            self.summary.stopped[spec.label] = why
            self.bar.write(f"STOPPED model {spec.label}: {why}")

    def run_model(self, spec, cells: list[Cell], need_ranking: bool) -> None:
        """One pool of actors for `spec`'s model: record and calibrate cells first, then bench cells (so that
        a bench cell of a calibrated method can be given the g* measured here, `_with_calibrated_size`). The
        pool keeps `slots(spec)` actors while cells wait, replacing those that died or were killed, until the
        model is stopped (`_stop`: it could not load, or its actors died `max_crashes` times). Under `[sweep]
        timing = "exclusive"` on CPUs the record cells run first at that width, then the calibrate and the
        bench cells on `timed_slots(spec)` actors: one per machine, each placed on its own when there are
        several (`_free_node`)."""
        pool: list[_Actor] = []           # every live actor of this model: idle or running a cell
        idle: list[_Actor] = []
        inflight: dict = {}
        size = max(1, min(self.slots(spec), len(cells) or 1))
        timed = max(1, min(self.timed_slots(spec), len(cells) or 1))
        self.summary.timing = self._timing(size, timed)
        pinned = self.exclusive and timed > 1
        alone = self.exclusive or size <= 1            # whether each timed cell has its machine to itself
        bench = by_prompts([c for c in cells if c.kind == "bench"])
        if self.exclusive:                             # (cells, actors at a time, narrow the pool first)
            phases = [([c for c in cells if c.kind not in TIMED_KINDS], size, False),
                      ([c for c in cells if c.kind == "calibrate"], timed, True), (bench, timed, True)]
        else:
            phases = [([c for c in cells if c.kind != "bench"], size, False), (bench, size, False)]
        ranking_ref = None
        try:
            for phase, width, narrow in phases:
                if not phase:
                    continue
                if narrow:
                    self._narrow(pool, idle, width, pinned)
                calibrated = self._calibrated(spec) if phase is bench else {}
                self._run_phase(spec, deque(phase), pool, idle, inflight, calibrated, width,
                                pinned=pinned and narrow, alone=alone)
            if spec.label not in self.summary.stopped:
                self._diagnose(spec, pool, idle)
            if need_ranking and spec.label not in self.summary.stopped:
                actor = idle[0] if idle else self._actor(spec)
                if not idle:
                    pool.append(actor)
                limit = sum(self.sweep.timeouts[k] for k in ("load", "record")) or None
                try:
                    ranking_ref = actor.handle.ranking.remote()
                    write_frame(ray.get(ranking_ref, timeout=limit), ranking_path(self.out, spec.label))
                except RayError as e:
                    self.bar.write(f"could not count the token ranking of {spec.label}: {_error_text(e)}")
        finally:
            for a in pool:
                ray.kill(a.handle)
                self._release(a)

    def _diagnose(self, spec, pool: list, idle: list) -> None:
        """Bench rows of `spec`'s model whose output differs from ar's and that carry no verdict - ar runs in a
        cell of its own, so a cell cannot diagnose its rows as it goes - diagnosed on one of its actors
        (`ModelWorker.diagnose`: ar's top-2 margin at the first divergent token -> exact / near-tie /
        mismatch) into DIR/_diagnoses/<model>.parquet, which `sweeps.load` joins. Trouble here is
        reported, never fatal: the rows keep no verdict (the tables count them as mismatches)."""
        try:
            rows = load(self.out, "bench").filter(pl.col("model") == spec.label).collect()
        except SweepError:
            return                                                   # no bench results (yet)
        todo = undiagnosed(rows)
        if not todo:
            return
        cells = {c.id: c for c in self.sweep.cells}
        actor = idle[0] if idle else self._actor(spec)
        if not idle:
            pool.append(actor)
            idle.append(actor)
        limit = sum(self.sweep.timeouts[k] for k in ("load", "bench")) or None
        found = []
        for cell_id, frame in todo:
            cell = cells.get(cell_id)
            prompts = self._with_prompts(cell, cell.params).get(SHIPPED) if cell is not None else None
            try:
                found.append(ray.get(actor.handle.diagnose.remote(frame, prompts), timeout=limit))
            except RayError as e:
                self.bar.write(f"could not diagnose the rows of {spec.label}'s cell {cell_id} that differ from "
                               f"ar's: {_error_text(e)}")
                break
        if found:
            path = diagnosis_path(self.out, spec.label)
            old = [pl.read_parquet(path)] if path.is_file() else []
            merged = pl.concat([*old, *found], how="diagonal_relaxed").unique(list(DIAGNOSIS_KEY), keep="last")
            write_frame(merged, path)
            self.summary.diagnosed += sum(f.height for f in found)

    def _run_phase(self, spec, queue: deque, pool: list, idle: list, inflight: dict, calibrated: dict,
                   size: int, pinned: bool = False, alone: bool = False) -> None:
        """`queue`'s cells on at most `size` actors. pinned: each new actor on a machine of its own. alone:
        whether each timed cell ran with nothing else of the sweep on its machine (its rows' `timed_alone`)."""
        while queue or inflight:
            why = self.summary.stopped.get(spec.label)
            if why is not None:
                while queue:
                    self._fail(queue.popleft(), why)
            else:
                while queue and len(pool) < size:            # refill: the first actors, or replacements
                    node = self._free_node(pool, spec) if pinned else None
                    if pinned and node is None:
                        if not pool:
                            self._stop(spec, f"no live machine has the {spec.num_cpus or 1:g} CPUs of a timed "
                                             f"actor ([sweep] timing = \"exclusive\" places one on each)")
                        break
                    actor = self._actor(spec, node)
                    pool.append(actor)
                    idle.append(actor)
            while idle and queue:
                actor, cell = idle.pop(), queue.popleft()
                params, source = _with_calibrated_size(cell, calibrated, self.calibration)
                ref = actor.handle.run.remote(cell.kind, cell.method, self._with_prompts(cell, params))
                inflight[ref] = _Job(actor, cell, source, time.monotonic(),
                                     alone if cell.kind in TIMED_KINDS else None)
            if not inflight:
                continue
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=WAIT_S)
            self._tick()
            for ref in ready:
                self._collect(spec, ref, inflight.pop(ref), pool, idle)
            self._expire(spec, inflight, pool)

    def _drop(self, actor: _Actor, pool: list, kill: bool) -> None:
        if actor in pool:
            pool.remove(actor)
        if kill:
            ray.kill(actor.handle, no_restart=True)
        self._release(actor)

    def _collect(self, spec, ref, job: _Job, pool: list, idle: list) -> None:
        """The result of one cell: written, or the cell failed - its own exception (the actor serves on), its
        model could not load (the model stops), its actor died (a crash: counted; at `max_crashes` the model
        stops) or any other Ray error (worker crashed, out of memory, node died, object lost ...: a crash too;
        the actor is killed and replaced). Never raises: one cell's trouble does not end the sweep."""
        actor, cell = job.actor, job.cell
        try:
            frame, stats = ray.get(ref)
        except RayTaskError as e:
            self._fail(cell, _error_text(e), e)
            idle.append(actor)
            return
        except RayActorError as e:
            # dead, or unavailable (restarting): either way this run has done with it - no stray actor left
            self._drop(actor, pool, kill=True)
            if e.actor_init_failed:
                why = f"the model could not load in its actor: {_error_text(e)}"
                self._stop(spec, why)
                self._fail(cell, why, e)
                return
            self._crashed(spec, cell, e)
            return
        except RayError as e:
            self._drop(actor, pool, kill=True)
            self._crashed(spec, cell, e)
            return
        self._note(actor, stats)
        self.summary.spans.append((cell.kind, stats.get("node"), stats.get("began"), stats.get("ended"), cell.id))
        self._warnings(cell, stats)
        if job.source is not None:
            frame = frame.with_columns(pl.lit(job.source).alias("draft_size_from"),
                                       pl.lit("calibrate-cell").alias("draft_size_source"))
        if job.alone is not None:
            frame = frame.with_columns(pl.lit(job.alone).alias("timed_alone"))
        self._done(cell, frame, stats)
        idle.append(actor)

    def _warnings(self, cell: Cell, stats: dict) -> None:
        """The warnings a cell raised on its worker (`ModelWorker.run`'s stats; Ray does not forward a worker's
        stderr here), each printed once per run, the first time any cell raises it."""
        for warning in stats.get("warnings", ()):
            if warning not in self.warned:
                self.warned.add(warning)
                self.summary.warnings.append(warning)
                self.bar.write(f"warning from {cell.describe()}: {warning}")

    def _crashed(self, spec, cell: Cell, e: BaseException) -> None:
        limit = self.sweep.max_crashes
        self.summary.crashes[spec.label] += 1
        n = self.summary.crashes[spec.label]
        error = f"its actor died ({_error_text(e)}); actor crash {n} of at most {limit} for {spec.label}"
        self._fail(cell, error, e)
        if n >= limit:
            self._stop(spec, f"its actors died {n} times ([sweep] max_crashes = {limit}; the last: "
                             f"{_error_text(e)}); fix the cause (memory? see the full errors) and run the same "
                             f"command again")

    def _expire(self, spec, inflight: dict, pool: list) -> None:
        """Fail cells past their time (`[timeouts]`): the actor is killed (Ray does not restart it) and the
        pool replaces it. A cell's clock starts when its actor has loaded the model; until then the actor's
        load has its own limit (`[timeouts] load`)."""
        now = time.monotonic()
        for ref, job in list(inflight.items()):
            actor = job.actor
            if actor.ready_at is None and ray.wait([actor.ready_ref], timeout=0)[0]:
                actor.ready_at = now
            if actor.ready_at is None:
                what, limit, since = "load", self.sweep.timeouts["load"], actor.created
            else:
                what, limit, since = job.cell.kind, self.sweep.timeouts[job.cell.kind], max(job.sent, actor.ready_at)
            if not limit or now - since <= limit:
                continue
            inflight.pop(ref)
            self._drop(actor, pool, kill=True)
            doing = "loading its model" if what == "load" else "the cell"
            self._fail(job.cell, f"timed out: {doing} took more than {limit:g} s ([timeouts] {what} = {limit:g}); "
                                 f"its actor was killed and replaced. Raise [timeouts] {what} if it needs longer")

    def _calibrated(self, spec) -> dict[str, list[tuple[dict, int, str]]]:
        """{method: [(calibrate cell's config, g*, "calibrate:<cell id>")]} of this model's finished
        calibrate cells (this run's or an earlier one's)."""
        out: dict = defaultdict(list)
        for c in self.sweep.cells:
            path = cell_path(self.out, c)
            if c.kind == "calibrate" and c.model == spec.label and is_finished(path):
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
            missing = [i for i in cell.needs if not is_finished(cell_path(self.out, by_id[i]))]
            if missing:
                self._fail(cell, f"{len(missing)} of its {len(cell.needs)} record cells have no traces "
                                 f"(failed or not run): {missing[:3]}")
            elif cell.params["analysis"] == "shortlist" and not is_finished(ranking_path(self.out, cell.model)):
                self._fail(cell, f"no token ranking for {cell.model} ({ranking_path(self.out, cell.model)}); its "
                                 f"model actor could not count one - see the messages above")
            else:
                runnable.append(cell)
        traces: dict[tuple[str, ...], object] = {}
        rankings: dict[str, object] = {}
        queue = deque(self._batches(runnable))
        inflight: dict = {}
        sent: dict = {}
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
                ref = task.remote([c.params for c in batch], traces[needs], ranking)
                inflight[ref], sent[ref] = batch, time.monotonic()
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=WAIT_S)
            self._tick()
            limit = self.sweep.timeouts["coverage"]
            for ref in list(inflight):
                # a task waits in Ray's queue behind the others in flight: its clock is generous by that much
                if ref not in ready and limit and time.monotonic() - sent[ref] > limit * (len(inflight[ref]) + 1):
                    batch = inflight.pop(ref)
                    ray.cancel(ref, force=True)
                    for cell in batch:
                        self._fail(cell, f"timed out: its task of {len(batch)} coverage cells took more than "
                                         f"{limit:g} s per cell ([timeouts] coverage = {limit:g}) and was "
                                         f"cancelled. Raise [timeouts] coverage if it needs longer")
            for ref in ready:
                batch = inflight.pop(ref)
                try:
                    results = ray.get(ref)
                except RayError as e:     # the task raised, its worker crashed or ran out of memory, ...
                    for cell in batch:
                        self._fail(cell, _error_text(e), e)
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
                         f"({'; '.join(mixed)}); "
                         f"--strict refuses that: give every model the same source (a [[calibrate]] entry, "
                         f"[sweep] calibration = FILE or params.draft_size), or run without --strict")
    if mixed and show:
        print("\n".join(["warning: draft sizes from different sources on different models (their speedups "
                         "compare a measured g* with a guess; --strict refuses this):", *[f"  {m}" for m in mixed]]),
              file=sys.stderr, flush=True)
    if address is not None and not Path(out).expanduser().is_absolute():
        raise SweepError(f"--out {out} is a relative path; with --address give an absolute one (the driver of "
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
                                 f"sources ({'; '.join(mixed_sources(sweep))}); give every model the same source")
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
