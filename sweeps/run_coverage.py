"""The coverage cells' phase of a sweep (`sweeps.run`): plain Ray tasks on the record cells' traces, no model,
several cells to a task (`_batches`); each batch collected, failed, or cancelled past its time.
"""

from __future__ import annotations

import time
from collections import deque

import polars as pl
import ray
from ray.exceptions import RayError

from specvocab.locality.trace import read_traces
from specvocab.sweeps.cell import Cell
from specvocab.sweeps.coverage_cells import timed_coverage_cells
from specvocab.sweeps.results import cell_path, is_finished, ranking_path
from specvocab.sweeps.run_actors import WAIT_S
from specvocab.sweeps.run_summary import error_text

BATCHES_PER_SLOT = 4              # coverage: tasks per worker slot and group of cells sharing traces
QUEUED_PER_SLOT = 2               # coverage: tasks submitted per worker slot when no --max-workers cap binds,
                                  # so a worker that finishes one starts the next while the driver writes


class CoveragePhase:
    """The driver's coverage cells (`run_coverage`). Uses the driver's `task_slots`, `task_queue` and
    bookkeeping (`_done`, `_fail`, `_tick`)."""

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
                        self._fail(cell, error_text(e), e)
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
