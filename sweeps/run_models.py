"""The model cells' phases of a sweep (`sweeps.run`): per model, record and calibrate cells, then bench cells -
grouped by their prompts (`by_prompts`), a calibrated method at the g* just measured (`with_calibrated_size`) -
on the model's pool of actors (`sweeps.run_actors`); each result collected, or the cell failed (its own error, a
crash, a timeout); then the rows that differ from ar's diagnosed, and the token ranking counted for the
shortlist coverage cells.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import polars as pl
import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from specvocab.engine.config import SpecConfig, calibration_fields
from specvocab.sweeps.cell import Cell, SweepError, canonical_json
from specvocab.sweeps.model_cells import CALIBRATION, SHIPPED, SIZE_SOURCE, bench_config, shipped_prompts
from specvocab.sweeps.results import (DIAGNOSIS_KEY, cell_path, diagnosis_path, is_finished, load, ranking_path,
                                      undiagnosed, write_frame)
from specvocab.sweeps.run_actors import WAIT_S, Actor, Job
from specvocab.sweeps.run_summary import error_text
from specvocab.sweeps.schema import TIMED_KINDS


def by_prompts(cells: list[Cell]) -> list[Cell]:
    """Bench cells grouped by the prompts they run (model, prompt set, split value), in the order the groups
    first appear, the config's order within each: every method on one task's prompts runs back to back, so
    a speedup over `ar` (engine.metrics, per task) divides timings minutes closer together than in the
    config's method-major order - a shared VM's speed drifts by 10-40% over a run."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.model, c.params.get("prompt_set"), c.params.get("split_value")), []).append(c)
    return [c for group in groups.values() for c in group]


def with_calibrated_size(cell: Cell, calibrated: dict, calibration: dict | None = None) -> tuple[dict, str | None]:
    """A bench cell of a method this sweep calibrated, with no draft size of its own, runs at the measured
    g* (UniSpec §3: g* per model, device and method) of the calibrate cell whose config agrees on every
    field that changes tau(g) or s(g) (`engine.config.calibration_fields`). Passed at run time: the
    cell's id and parameters stay as configured; the size travels as given, labelled "calibrate-cell"
    (`sweeps.model_cells.SIZE_SOURCE`), so the worker's one resolution of the run (`engine.resolve.resolve_run`)
    records it as its rows' `draft_size_source`; `draft_size_from` names the calibrate cell. A bench cell no
    calibrate cell covers gets `calibration` (the records of `[sweep] calibration`,
    `sweeps.model_cells.CALIBRATION`) when the sweep names a file; without one its worker takes the method's
    uncalibrated default - never the worker machine's calibration cache."""
    config = cell.params.get("config", {})
    if cell.kind != "bench" or config.get("draft_size") is not None:
        return cell.params, None
    if cell.method not in calibrated:
        return ({**cell.params, CALIBRATION: calibration} if calibration is not None and not
                cell.params.get("calibrate_cell") else cell.params), None
    mine = calibration_fields(SpecConfig.preset(cell.method, **bench_config(cell.params)))
    for fields, g, source in calibrated[cell.method]:
        if fields == mine:
            return {**cell.params, "config": {**config, "draft_size": g}, SIZE_SOURCE: "calibrate-cell"}, source
    return cell.params, None


class ModelPhases:
    """The driver's model cells (`run_model`): its phases (`_run_phase`), each result (`_collect`, `_warnings`,
    `_crashed`, `_expire`), the g* of finished calibrate cells (`_calibrated`), the prompts sent with a cell
    (`_with_prompts`) and the diagnosis of rows that differ from ar's (`_diagnose`). Uses the driver's
    `ActorPool` and bookkeeping (`_done`, `_fail`, `_tick`)."""

    def run_model(self, spec, cells: list[Cell], need_ranking: bool) -> None:
        """One pool of actors for `spec`'s model: record and calibrate cells first, then bench cells (so that
        a bench cell of a calibrated method can be given the g* measured here, `with_calibrated_size`). The
        pool keeps `slots(spec)` actors while cells wait, replacing those that died or were killed, until the
        model is stopped (`_stop`: it could not load, or its actors died `max_crashes` times). Under `[sweep]
        timing = "exclusive"` on CPUs the record cells run first at that width, then the calibrate and the
        bench cells on `timed_slots(spec)` actors: one per machine, each placed on its own when there are
        several (`_free_node`)."""
        pool: list[Actor] = []           # every live actor of this model: idle or running a cell
        idle: list[Actor] = []
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
                    self.bar.write(f"could not count the token ranking of {spec.label}: {error_text(e)}")
        finally:
            for a in pool:
                ray.kill(a.handle)
                self._release(a)

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
                params, source = with_calibrated_size(cell, calibrated, self.calibration)
                ref = actor.handle.run.remote(cell.kind, cell.method, self._with_prompts(cell, params))
                inflight[ref] = Job(actor, cell, source, time.monotonic(),
                                     alone if cell.kind in TIMED_KINDS else None)
            if not inflight:
                continue
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=WAIT_S)
            self._tick()
            for ref in ready:
                self._collect(spec, ref, inflight.pop(ref), pool, idle)
            self._expire(spec, inflight, pool)

    def _collect(self, spec, ref, job: Job, pool: list, idle: list) -> None:
        """The result of one cell: written, or the cell failed - its own exception (the actor serves on), its
        model could not load (the model stops), its actor died (a crash: counted; at `max_crashes` the model
        stops) or any other Ray error (worker crashed, out of memory, node died, object lost ...: a crash too;
        the actor is killed and replaced). Never raises: one cell's trouble does not end the sweep."""
        actor, cell = job.actor, job.cell
        try:
            frame, stats = ray.get(ref)
        except RayTaskError as e:
            self._fail(cell, error_text(e), e)
            idle.append(actor)
            return
        except RayActorError as e:
            # dead, or unavailable (restarting): either way this run has done with it - no stray actor left
            self._drop(actor, pool, kill=True)
            if e.actor_init_failed:
                why = f"the model could not load in its actor: {error_text(e)}"
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
            frame = frame.with_columns(pl.lit(job.source).alias("draft_size_from"))
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
        error = f"its actor died ({error_text(e)}); actor crash {n} of at most {limit} for {spec.label}"
        self._fail(cell, error, e)
        if n >= limit:
            self._stop(spec, f"its actors died {n} times ([sweep] max_crashes = {limit}; the last: "
                             f"{error_text(e)}) — fix the cause (memory? see the full errors) and run the same "
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
                self.bar.write(f"could not load the prompts of {cell.describe()} here ({error_text(e)}); the "
                               f"worker loads them from its own data root")
                self.prompts[key] = None
        return {**params, SHIPPED: self.prompts[key]}

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
                               f"ar's: {error_text(e)}")
                break
        if found:
            path = diagnosis_path(self.out, spec.label)
            old = [pl.read_parquet(path)] if path.is_file() else []
            merged = pl.concat([*old, *found], how="diagonal_relaxed").unique(list(DIAGNOSIS_KEY), keep="last")
            write_frame(merged, path)
            self.summary.diagnosed += sum(f.height for f in found)
