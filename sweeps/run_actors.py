"""A sweep's model actors (`sweeps.run`): one Ray actor per loaded model (`RayModelWorker`), the pool's width
(one per GPU, or per `num_cpus` CPUs; under `[sweep] timing = "exclusive"` one timed actor per machine), where
each is placed (a machine of its own, physical cores of its own) and how it leaves the pool.

`ActorPool` is the part of the driver (`sweeps.run._Driver`) that owns the actors; the phases that run cells on
them are `sweeps.run_models` (record, calibrate, bench) and, without actors, `sweeps.run_coverage`.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from specvocab.sweeps.cell import Cell
from specvocab.sweeps.cluster import cpu_nodes
from specvocab.sweeps.model_cells import ModelWorker, data_files

WAIT_S = 1.0                      # how often the driver wakes to refresh the progress bar


class RayModelWorker(ModelWorker):
    """ModelWorker as a Ray actor: its stats also say whether Ray restarted this actor's process."""

    def stats(self) -> dict:
        ctx = ray.get_runtime_context()
        with warnings.catch_warnings():           # Ray's deprecation notice, not the cell's: kept off the console
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ctx.was_current_actor_reconstructed
        return {**super().stats(), "restarted": restarted, "node": ctx.get_node_id()}


@dataclass
class Actor:
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
class Job:
    """A cell sent to an actor: when, and where its draft size came from (`draft_size_from`)."""

    actor: Actor
    cell: Cell
    source: str | None
    sent: float
    alone: bool | None = None         # a timed cell: whether nothing else of the sweep ran on its machine


class ActorPool:
    """The driver's actors: how many at a time (`slots`, `timed_slots`), where (`_free_node`, `_take_cores`),
    starting (`_actor`), noting (`_note`), dropping (`_drop`, `_release`, `_narrow`) and stopping a model
    (`_stop`). State on the driver: sweep, summary, bar, cpus, gpus, max_workers, exclusive, nodes, free_cores,
    calibration_cache, data_ref."""

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

    def _actor(self, spec, node: str | None = None) -> Actor:
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
        handle = ray.remote(RayModelWorker).options(**opts).remote(
            spec.name, spec.options, s.dtype, threads, s.crash_once, s.delay_s,
            calibration_cache=self.calibration_cache, crash=s.crash, hang=s.hang, data=self._worker_data(),
            cores=cores or None)
        self.summary.actors += 1
        return Actor(self.summary.actors, handle, time.monotonic(), handle.stats.remote(), cores=cores, node=node)

    def _take_cores(self, n: int) -> tuple[int, ...]:
        """`n` physical cores no live actor holds (a local Ray on CPUs), for a new actor to pin its threads
        to; () elsewhere, or when fewer are free (more actors than cores: they float, as without pinning)."""
        if self.free_cores is None or len(self.free_cores) < n:
            return ()
        taken, self.free_cores = tuple(self.free_cores[:n]), self.free_cores[n:]
        return taken

    def _release(self, actor: Actor) -> None:
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

    def _note(self, actor: Actor, stats: dict) -> None:
        self.summary.actor_pids[actor.index].add(stats["pid"])
        if stats.get("cores") and actor.cores:
            self.summary.actor_cores[stats["pid"]] = stats["cores"]
        self.summary.loads[stats["pid"]] = stats["loads"]
        if stats.get("restarted"):
            self.summary.restarted.add(stats["pid"])

    def _drop(self, actor: Actor, pool: list, kill: bool) -> None:
        if actor in pool:
            pool.remove(actor)
        if kill:
            ray.kill(actor.handle, no_restart=True)
        self._release(actor)

    def _stop(self, spec, why: str) -> None:
        """No more actors for `spec`'s model this run: its queued and later cells fail with `why`."""
        if spec.label not in self.summary.stopped:
            self.summary.stopped[spec.label] = why
            self.bar.write(f"STOPPED model {spec.label}: {why}")
