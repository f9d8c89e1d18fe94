"""What a sweep's driver reports (`sweeps.run`): the Summary of a run, its failed cells, and an error's one line
and full text (OUT/_errors/<cell id>.txt).
"""

from __future__ import annotations

import re
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ray.exceptions import RayActorError, RayTaskError

from specvocab.sweeps.cell import Cell, canonical_json
from specvocab.sweeps.plan import draft_size_sources
from specvocab.sweeps.schema import Sweep


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


def error_text(e: BaseException) -> str:
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


def error_details(cell: Cell, error: str, e: BaseException | None) -> str:
    """What OUT/_errors/<cell id>.txt holds: the cell, the one-line error, the full error (a Ray error's text
    carries the remote traceback) and the driver's traceback."""
    parts = [f"cell {cell.id}: {cell.describe()}", f"params: {canonical_json(cell.params)}",
             f"when: {time.strftime('%Y-%m-%dT%H:%M:%S')}", f"error: {error}", ""]
    if e is not None:
        parts += ["--- full error ---", str(e), "", "--- traceback in the driver ---",
                  "".join(traceback.format_exception(e))]
    return "\n".join(parts)
