"""Where a sweep's results live, how a cell's file is written, and `load(DIR, kind)` to read them back.

    DIR/sweep.json                                           the manifest: config hash, name, cell count,
                                                             the config as parsed
    DIR/kind=<kind>/model=<model>/method=<method>/<cell id>.parquet     one file per finished cell
    DIR/_rankings/<model>.parquet                            token-frequency rankings for shortlist coverage
    DIR/_errors/<cell id>.txt                                the full error (remote traceback) of a failed
                                                             cell; removed when the cell later finishes
    DIR/_superseded/<time>/...                               finished cells an `--extend` replaced by wider ones
    DIR/.sweep.lock, .sweep.lock.owner                       held by the driver running in DIR (pid, host)

Hive values are percent-encoded (`meta-llama%2FLlama-3.1-8B-Instruct`), which polars decodes. Each row also
carries `kind`, `model`, `method`, `cell_id`, `sweep`, `cell_s` (the cell's seconds on its worker) and the
cell's parameters as columns (lists and tables as JSON strings; the SpecConfig fields of a grid point,
`config`, also one column each), so a file read alone says what produced it. Files are written to a temporary name and
renamed into place: a file at its final path is complete; the file, its folder and every folder the write
created are fsynced, so a finished file survives a power cut.

"Finished" means a result file whose Parquet footer reads (`pyarrow.parquet.read_metadata`): a file that
exists but does not read (a disk that filled, a copy cut short) is moved aside to
`<id>.parquet.damaged-<time>` - never deleted - and its cell runs again.

One driver per folder: `lock_output` holds a lock file (`filelock`, released by the OS when the driver dies)
for the whole run; a second driver is refused with the first one's pid and host.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import quote

import polars as pl

from specvocab.engine.atomic import atomic_write, fsync_dir
from specvocab.engine.config import SpecConfig
from specvocab.engine.metrics import VERDICTS, with_task
from specvocab.sweeps.cell import Cell, SweepError, canonical_json

MANIFEST = "sweep.json"
HIVE_KEYS = ("kind", "model", "method")
RANKINGS = "_rankings"
ERRORS = "_errors"
DIAGNOSES = "_diagnoses"       # per model: bench rows that differ from ar's, diagnosed after its cells ran
DIAGNOSIS_KEY = ("cell_id", "prompt_id", "turn", "repeat")
# engine.jobs.bench.DIAGNOSIS: what `diagnose` measures (named here too: this module loads without torch)
DIAGNOSIS_COLUMNS = ("verdict", "first_divergence", "ar_margin", "ar_gap", "prompt_differs")
# a bench row and the ar row its output is compared with share these (`undiagnosed`, `with_exact_verdicts`)
PAIR = ("model", "prompt_set", "prompt_id", "turn", "repeat", "seed", "max_new_tokens")
SUPERSEDED = "_superseded"
LOCK = ".sweep.lock"
LOCK_OWNER = ".sweep.lock.owner"


def _enc(value: str) -> str:
    return quote(str(value), safe="")


def cell_path(out: str | Path, cell: Cell) -> Path:
    return (Path(out) / f"kind={_enc(cell.kind)}" / f"model={_enc(cell.model)}" / f"method={_enc(cell.method)}"
            / f"{cell.id}.parquet")


def ranking_path(out: str | Path, model_label: str) -> Path:
    return Path(out) / RANKINGS / f"{_enc(model_label)}.parquet"


def diagnosis_path(out: str | Path, model_label: str) -> Path:
    return Path(out) / DIAGNOSES / f"{_enc(model_label)}.parquet"


def error_path(out: str | Path, cell: Cell) -> Path:
    return Path(out) / ERRORS / f"{cell.id}.txt"


def make_dirs(folder: Path) -> None:
    """mkdir -p, fsyncing the parent of every folder it creates (so the new hive folders of a first result
    file are on disk with it)."""
    missing = []
    p = Path(folder)
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def write_frame(frame: pl.DataFrame, path: Path) -> Path:
    """Write `frame` to `path` as Parquet by `engine.artifacts.atomic_write`'s rule (a file at its path is
    complete; it and its folder fsynced), after creating (and fsyncing) any missing folders."""
    make_dirs(Path(path).parent)
    return atomic_write(path, frame.write_parquet)


def write_error(out: str | Path, cell: Cell, text: str) -> Path:
    """The full error of a failed cell, `DIR/_errors/<cell id>.txt`."""
    path = error_path(out, cell)
    make_dirs(path.parent)
    return atomic_write(path, text)


def _param_value(v):
    return canonical_json(v) if isinstance(v, (list, dict, tuple)) else v


def with_cell_columns(frame: pl.DataFrame, cell: Cell, sweep_name: str,
                      cell_s: float | None = None) -> pl.DataFrame:
    """The cell's identity (kind, model, method, cell_id, sweep) and `cell_s` (seconds the cell took on its
    worker) override same-named columns; its other parameters are added where the frame has no column of
    that name (a result's own value is more specific, e.g. bench's per-repeat `seed`)."""
    ident = {"kind": cell.kind, "model": cell.model, "method": cell.method, "cell_id": cell.id, "sweep": sweep_name}
    params = {**cell.params, **cell.params.get("config", {})}      # a grid point's fields get columns too
    extra = {k: _param_value(v) for k, v in params.items() if k not in frame.columns and k not in ident}
    cols = [pl.lit(v, dtype=pl.String).alias(k) for k, v in ident.items()]
    cols.append(pl.lit(cell_s, dtype=pl.Float64).alias("cell_s"))
    for k, v in extra.items():
        cols.append(pl.lit(v, dtype=pl.String if v is None else None).alias(k))
    return frame.with_columns(cols)


def write_cell(out: str | Path, cell: Cell, frame: pl.DataFrame, sweep_name: str,
               cell_s: float | None = None) -> Path:
    path = write_frame(with_cell_columns(frame, cell, sweep_name, cell_s), cell_path(out, cell))
    error_path(out, cell).unlink(missing_ok=True)            # an earlier failure of this cell is history now
    return path


def readable(path: Path) -> bool:
    """Whether `path` is a Parquet file whose footer reads."""
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except Exception:  # ArrowInvalid, OSError, ...: any file pyarrow cannot open is not a finished result
        return False
    return True


def set_aside(path: Path) -> Path:
    """Move a damaged file to `<name>.damaged-<time>` beside it (kept for a look, never deleted)."""
    target = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{n}")
        n += 1
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def is_finished(path: Path, damaged: list | None = None) -> bool:
    """A result file exists at `path` and reads; a file that does not read is set aside (appended to
    `damaged` as (path, where it went)) and counts as not finished."""
    if not path.is_file():
        return False
    if readable(path):
        return True
    moved = set_aside(path)
    if damaged is not None:
        damaged.append((path, moved))
    print(f"warning: {path} was damaged (its Parquet footer does not read); moved to {moved.name} and its cell "
          f"will run again", file=sys.stderr, flush=True)
    return False


def finished(out: str | Path, cells, damaged: list | None = None) -> set[str]:
    """Ids of the cells whose result file exists and reads (`is_finished`: damaged files are set aside)."""
    return {c.id for c in cells if is_finished(cell_path(out, c), damaged)}


# ----------------------------------------------------------------------------------------------------------
# One driver per output folder
# ----------------------------------------------------------------------------------------------------------

class OutputLock:
    """The lock of an output folder, held by one driver (`lock_output`); `release()` when done."""

    def __init__(self, lock, owner: Path):
        self._lock, self._owner = lock, owner

    def release(self) -> None:
        self._owner.unlink(missing_ok=True)
        self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def lock_output(out: str | Path) -> OutputLock:
    """Create `out` if needed and lock it for this process: SweepError naming the pid and host of the driver
    that holds it. The OS drops the lock when its process dies, so a killed driver leaves none behind (on a
    network file system without working locks, run one driver per folder yourself)."""
    from filelock import FileLock, Timeout

    out = Path(out)
    make_dirs(out)
    lock = FileLock(str(out / LOCK), timeout=0)
    owner = out / LOCK_OWNER
    try:
        lock.acquire()
    except Timeout:
        try:
            who = json.loads(owner.read_text())
        except (OSError, json.JSONDecodeError):
            who = {}
        raise SweepError(f"{out} is in use by another sweeps.run driver (pid {who.get('pid', '?')} on host "
                         f"{who.get('host', '?')}, since {who.get('since', '?')}) — wait for it to finish or stop "
                         f"it, or use another --out. Two drivers on one folder would run the same cells "
                         f"twice") from None
    atomic_write(owner, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                    "since": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    return OutputLock(lock, owner)


# ----------------------------------------------------------------------------------------------------------
# The manifest: one output folder holds one sweep config
# ----------------------------------------------------------------------------------------------------------

def _manifest_body(sweep, prov: dict | None) -> dict:
    return {"name": sweep.name, "config_hash": sweep.config_hash, "cells": len(sweep.cells),
            "kinds": list(sweep.kinds), "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": sweep.config,
            "provenance": prov}


def _wider(old: Cell, new: Cell) -> bool:
    """Whether coverage cell `new` computes everything `old` did and more: the same model and parameters
    except list-valued ones (w_max, shortlist_k, capacities, by) that hold the old values, and the traces of
    the same record cells or more."""
    if (old.kind, old.model, old.method) != (new.kind, new.model, new.method) or old.kind != "coverage":
        return False
    if set(old.params) != set(new.params) or not set(old.needs) <= set(new.needs):
        return False
    for k, v in old.params.items():
        w = new.params[k]
        if isinstance(v, list) and isinstance(w, list):
            if not set(map(canonical_json, v)) <= set(map(canonical_json, w)):
                return False
        elif v != w:
            return False
    return True


def extension(old_manifest: dict, sweep) -> tuple[list[Cell], str | None]:
    """Whether `sweep` extends the config recorded in `old_manifest`: every cell of the old config is a cell
    of the new one, or (coverage) is replaced by a wider one (`_wider`). Returns (old cells replaced by wider
    ones, None) or ([], why not)."""
    from specvocab.sweeps.config import parse_sweep

    try:
        old = parse_sweep(old_manifest.get("config") or {}, default_name=old_manifest.get("name", "sweep"))
    except SweepError as e:
        return [], f"the folder's own config no longer expands ({e})"
    ids = {c.id for c in sweep.cells}
    coverage = [c for c in sweep.cells if c.kind == "coverage"]
    replaced, dropped = [], []
    for c in old.cells:
        if c.id in ids:
            continue
        if any(_wider(c, n) for n in coverage):
            replaced.append(c)
        else:
            dropped.append(c)
    if dropped:
        return [], (f"{len(dropped)} of the folder's {len(old.cells)} cells are not cells of this config (e.g. "
                     f"{dropped[0].describe()}): a superset adds values (another seed, model, method, w_max ...) "
                     f"and changes none of the old ones")
    return replaced, None


def check_output_folder(out: Path) -> None:
    """Refuse an existing folder that is not a sweep's (no manifest) and holds anything but our lock files."""
    if (out / MANIFEST).is_file() or not out.exists():
        return
    if not out.is_dir() or any(p.name not in (LOCK, LOCK_OWNER) for p in out.iterdir()):
        raise SweepError(f"{out} exists and is not a sweep output folder (no {MANIFEST}) — pick a new or empty "
                         f"folder for --out. Nothing was deleted")


def prepare_output(out: str | Path, sweep, *, extend: bool = False, strict_provenance: bool = False) -> Path:
    """Create `out` for this sweep, or check it holds this sweep's results. Raises SweepError (deleting
    nothing) when it holds another config's results or is a non-empty folder that is not a sweep's.

    `extend`: a config whose cells include every cell of the folder's config (`extension`) is taken in: the
    manifest takes the new config (the old one is kept in its `extended` history), finished cells stay and
    are not run again; coverage cells replaced by wider ones move to `_superseded/<time>/`, so `load` does
    not count their rows twice. Provenance (`sweeps.provenance`): recorded when the folder is made; on a
    resume a difference is a warning naming it, or with `strict_provenance` a SweepError."""
    from specvocab.sweeps.provenance import differences, provenance

    out = Path(out).expanduser().resolve()
    manifest = out / MANIFEST
    prov = provenance(sweep)
    if manifest.is_file():
        try:
            old = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SweepError(f"{manifest} is unreadable ({e}) — it marks {out} as a sweep's output folder. Point "
                             f"--out at another folder; nothing was deleted") from None
        changed = differences(old["provenance"], prov) if old.get("provenance") else []
        if changed and strict_provenance:
            raise SweepError(f"{out} was started under another environment: {'; '.join(changed)}. With "
                             f"--strict-provenance that is refused — run without it to resume anyway (a warning), "
                             f"or use another --out")
        if changed:
            print(f"warning: {out} was started under another environment: {'; '.join(changed)}; results in it "
                  f"will come from both (--strict-provenance refuses this)", file=sys.stderr, flush=True)
        if old.get("config_hash") != sweep.config_hash:
            replaced, why = extension(old, sweep)
            if not extend:
                hint = (" This config extends that one (a superset of its cells): pass --extend to add its "
                        "cells to the folder" if why is None else "")
                raise SweepError(f"{out} holds results of a different sweep config ({old.get('name')!r}, hash "
                                 f"{old.get('config_hash')}; this config {sweep.name!r} has hash "
                                 f"{sweep.config_hash}). Nothing was deleted: use another --out, or delete that "
                                 f"folder to start over.{hint}")
            if why is not None:
                raise SweepError(f"--extend: this config does not extend the one in {out}: {why}. Nothing was "
                                 f"changed — use another --out")
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for c in replaced:
                src = cell_path(out, c)
                if src.is_file():
                    dst = out / SUPERSEDED / stamp / src.relative_to(out)
                    make_dirs(dst.parent)
                    os.replace(src, dst)
                    fsync_dir(src.parent)
            history = old.get("extended", []) + [{k: old.get(k) for k in ("name", "config_hash", "cells",
                                                                          "created", "config")}]
            body = {**_manifest_body(sweep, old.get("provenance") or prov), "created": old.get("created"),
                    "extended": history, "runs": old.get("runs", [])}
            print(f"--extend: {out} now holds config {sweep.name!r} (hash {sweep.config_hash}, {len(sweep.cells)} "
                  f"cells; was {old.get('cells')}); {len(replaced)} coverage cells replaced by wider ones "
                  f"(old files in {SUPERSEDED}/{stamp})", file=sys.stderr, flush=True)
            old = body
        runs = old.get("runs", []) + [{"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname(),
                                       "pid": os.getpid(), "provenance": prov}]
        atomic_write(manifest, json.dumps({**old, "runs": runs[-100:]}, indent=1, sort_keys=True, default=str))
        return out
    check_output_folder(out)
    make_dirs(out)
    body = {**_manifest_body(sweep, prov), "runs": [{"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                     "host": socket.gethostname(), "pid": os.getpid(),
                                                     "provenance": prov}]}
    atomic_write(manifest, json.dumps(body, indent=1, sort_keys=True, default=str))
    return out


# ----------------------------------------------------------------------------------------------------------
# Reading results
# ----------------------------------------------------------------------------------------------------------

RESULTS_ENV = "SPECVOCAB_RESULTS"     # the folder a relative results_dir is resolved against (`results_path`)
# what makes each kind's cells, for the line `results_path` prints when a folder lacks one (`sweeps.config`)
KIND_KEYS = {
    "record": '[sweep] kinds += "record" (with [[models]], [[prompts]])',
    "coverage": '[sweep] kinds += "record", "coverage" and a [coverage] table (analyses, w_max, shortlist_k ...)',
    "bench": '[sweep] kinds += "bench" and a [[bench]] table (methods, policies, vocab_sizes)',
    "calibrate": '[sweep] kinds += "calibrate" and a [[calibrate]] table (methods, grid)',
}


def results_root() -> Path:
    """The folder a relative results_dir is resolved against: `$SPECVOCAB_RESULTS` when set, else the
    repository checkout holding this package (the folder with `pyproject.toml` above `sweeps/`), else (an
    installed wheel) the working directory."""
    env = os.environ.get(RESULTS_ENV)
    if env:
        return Path(env).expanduser()
    checkout = Path(__file__).resolve().parents[1]
    return checkout if (checkout / "pyproject.toml").is_file() else Path.cwd()


def results_path(results_dir: str | Path, kinds: Sequence[str] = ()) -> Path:
    """A sweep's --out folder as an absolute path: `results_dir` itself when absolute, else under
    `results_root()` - the same folder wherever a notebook's kernel starts (JupyterLab starts it in
    `notebooks/`, papermill in the caller's folder). Prints one line when the folder lacks results of any of
    `kinds` (the kinds a notebook draws), naming them and the config keys that make them."""
    path = Path(results_dir).expanduser()
    if not path.is_absolute():
        path = results_root() / path
    if kinds:
        missing = [k for k in kinds if not result_files(path, k)]
        if not path.is_dir():
            print(f"missing: no folder {path} (results_dir {str(results_dir)!r}; a relative one is resolved "
                  f"against ${RESULTS_ENV} or the checkout's root) — run `python -m specvocab.sweeps.run CONFIG "
                  f"--out {path}` or set results_dir")
        elif missing:
            try:
                ran = set(json.loads((path / MANIFEST).read_text()).get("kinds", []))
            except (OSError, json.JSONDecodeError):
                ran = set()
            print(f"missing in {path}: " + "; ".join(
                f"{k} cells (in the sweep's config but none finished: rerun its sweeps.run command)" if k in ran
                else f"{k} cells ({KIND_KEYS.get(k, k)}, then sweeps.run --extend)" for k in missing))
    return path


def result_files(out: str | Path, kind: str | None = None) -> list[Path]:
    pattern = f"kind={_enc(kind)}/*/*/*.parquet" if kind else "kind=*/*/*/*.parquet"
    return sorted(Path(out).glob(pattern))


_NUMERIC = (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64,
            pl.Float32, pl.Float64)


def _union_schema(files: list[Path]) -> tuple[dict, bool]:
    """The union of the files' schemas (supertypes per column), and whether a plain cast reaches it from
    every file (numeric widening or from an all-null column); False when some column changes kind."""
    schemas = [pl.read_parquet_schema(f) for f in files]
    union = pl.concat([pl.DataFrame(schema=s) for s in schemas], how="diagonal_relaxed").schema
    castable = True
    for name, dtype in union.items():
        for s in schemas:
            have = s.get(name)
            if have is None or have == dtype or have == pl.Null:
                continue
            if not (have in _NUMERIC and dtype in _NUMERIC):
                castable = False
    return dict(union), castable


def load(out: str | Path, kind: str, *, analysis: str | None = None, stream: str | None = None
         ) -> pl.LazyFrame:
    """All finished cells of one kind (record | coverage | bench | calibrate) as one LazyFrame.

    Cells may differ in columns (a method with drafter phases, a newer engine's extra column): the scan
    uses the union of every file's schema, filling a file's missing columns with nulls. The hive columns
    `kind`, `model`, `method` allow pruning: `load(d, "bench").filter(pl.col("model") == "...")` reads only
    that model's files. Bench rows carry the driver's diagnoses (`with_diagnoses`) and `verdict` "exact"
    on every greedy row whose output equals ar's (`with_exact_verdicts`).

    Coverage: `load(d, "coverage")` holds the four analyses together, each with its own columns (the
    others' null). `analysis=` ("window" | "shortlist" | "distances" | "miss_ratio") gives one tidy frame
    instead (`coverage_analysis`): that analysis's cells and columns only, a `task` column whatever the
    prompt set's split, `by` as a list; `stream="paper"` keeps the papers' candidate stream
    (`paper_stream()`), else every (k_pre, k_ver, sources) point is there - group by those columns, or the
    means pool several streams."""
    out = Path(out)
    if not out.is_dir():
        raise SweepError(f"{out} is not a folder — pass the --out folder of `python -m specvocab.sweeps.run`")
    files = result_files(out, kind)
    if not files:
        kinds = sorted({p.name.split("=", 1)[1] for p in out.glob("kind=*")})
        raise SweepError(f"no {kind!r} results under {out} (kinds present: {kinds or 'none'}) — run the sweep "
                         f"with that kind first")
    if analysis is not None or stream is not None:
        if kind != "coverage":
            raise SweepError(f"analysis= and stream= select coverage rows — load(DIR, {kind!r}) takes neither")
        return coverage_analysis(out, files, analysis, stream)
    lazy = _scan(files)
    return with_exact_verdicts(with_diagnoses(lazy, out)) if kind == "bench" else lazy


def _scan(files: list[Path]) -> pl.LazyFrame:
    """The files as one LazyFrame over the union of their schemas (`load`)."""
    schema, castable = _union_schema(files)
    hive = {k: pl.String for k in HIVE_KEYS}
    if castable:
        casts = pl.ScanCastOptions(integer_cast=["upcast", "allow-float"], float_cast="upcast")
        return pl.scan_parquet(files, hive_partitioning=True, hive_schema=hive, schema=schema,
                               missing_columns="insert", cast_options=casts)
    # a column changed kind between cells (e.g. int in one, string in another): concatenate per file
    return pl.concat([pl.scan_parquet(f) for f in files], how="diagonal_relaxed")


STREAM = ("k_pre", "k_ver", "sources")       # the candidate stream's columns (window, distances, miss_ratio)
LIST_PARAMS = {"by": pl.List(pl.String), "shortlist_k": pl.List(pl.Int64), "capacities": pl.List(pl.Int64)}


def paper_stream() -> pl.Expr:
    """The papers' candidate stream as a filter: prompt, prefill top-3 and verify top-3 (k_pre = k_ver = 3,
    sources ctx+ext; MicroSpec §3.2, Eq. 4 - SpecConfig's defaults). `load(d, "coverage",
    analysis="window").filter(paper_stream())` is `load(d, "coverage", analysis="window", stream="paper")`."""
    d = SpecConfig()
    return (pl.col("k_pre") == d.k_pre) & (pl.col("k_ver") == d.k_ver) & (pl.col("sources") == d.sources)


def _analysis_of(path: Path) -> str | None:
    first = pl.scan_parquet(path, hive_partitioning=False).select("analysis").head(1).collect()
    return first["analysis"][0] if first.height else None


def coverage_analysis(out: str | Path, files: Sequence[Path], analysis: str | None,
                      stream: str | None = None) -> pl.LazyFrame:
    """One coverage analysis of a sweep as a tidy frame (`load(out, "coverage", analysis=..., stream=...)`):
    the rows and columns of that analysis's cells only (`files`: the coverage result files), `model`,
    `prompt_set` and `task` first (`engine.metrics.with_task`: the category, or the language in a set split by
    language), the list-valued cell parameters (`by`, `shortlist_k`, `capacities`) as lists. stream: None
    (every (k_pre, k_ver, sources) point of the grid) or "paper" (`paper_stream()`; shortlist rows have no
    stream and are all kept). SweepError when the sweep ran no such analysis, or no row is at the paper's
    stream."""
    from specvocab.sweeps.schema import ANALYSES

    if analysis not in ANALYSES:
        raise SweepError(f"analysis={analysis!r}: choose one of {list(ANALYSES)} (load(DIR, 'coverage') without "
                         f"analysis= holds them all)")
    if stream not in (None, "paper"):
        raise SweepError(f"stream={stream!r}: pass stream='paper' (k_pre = k_ver = 3, sources ctx+ext) or None "
                         f"(every point; filter k_pre, k_ver, sources yourself)")
    by_analysis: dict[str, list[Path]] = {}
    for f in files:
        by_analysis.setdefault(_analysis_of(f), []).append(f)
    mine = by_analysis.get(analysis, [])
    if not mine:
        raise SweepError(f"no {analysis!r} coverage cells under {out} (analyses present: "
                         f"{sorted(a for a in by_analysis if a)}) — add it to [coverage] analyses and rerun with "
                         f"--extend")
    frame = _scan(mine).filter(pl.col("analysis") == analysis).collect()
    frame = frame.with_columns(pl.col(c).str.json_decode(dtype) for c, dtype in LIST_PARAMS.items()
                               if frame.schema.get(c) == pl.String)
    if stream == "paper" and all(c in frame.columns for c in STREAM):
        at = frame.filter(paper_stream())
        if at.is_empty():
            have = frame.select(*STREAM).unique().sort(*STREAM).rows()
            d = SpecConfig()
            raise SweepError(f"no {analysis!r} rows at the papers' stream ((k_pre, k_ver, sources) = "
                             f"{(d.k_pre, d.k_ver, d.sources)}) — this sweep has {have}: pass stream=None and "
                             f"filter those columns")
        frame = at
    frame = with_task(frame).drop("panel")
    first = ["model", "prompt_set", "task"]
    return frame.select(*first, pl.exclude(first)).lazy()


def with_diagnoses(bench: pl.LazyFrame, out: str | Path) -> pl.LazyFrame:
    """Bench rows with the verdicts the driver measured after their cells ran (`DIR/_diagnoses/`: ar runs in
    a cell of its own, so a cell cannot diagnose its rows against ar's as it goes) filled in where the row has
    none."""
    files = sorted((Path(out) / DIAGNOSES).glob("*.parquet"))
    have = bench.collect_schema()
    if not files or any(k not in have for k in DIAGNOSIS_KEY):
        return bench
    diag = (pl.concat([pl.scan_parquet(f) for f in files], how="diagonal_relaxed")
            .select(*[pl.col(k).cast(have[k]) for k in DIAGNOSIS_KEY],
                    *[pl.col(c).alias(f"{c}__diagnosed") for c in DIAGNOSIS_COLUMNS])
            .unique(list(DIAGNOSIS_KEY), keep="last"))
    filled = [pl.coalesce(pl.col(c), pl.col(f"{c}__diagnosed").cast(have[c])).alias(c) if c in have
              else pl.col(f"{c}__diagnosed").alias(c) for c in DIAGNOSIS_COLUMNS]
    return (bench.join(diag, on=list(DIAGNOSIS_KEY), how="left", maintain_order="left").with_columns(filled)
            .drop([f"{c}__diagnosed" for c in DIAGNOSIS_COLUMNS]))


def with_exact_verdicts(bench: pl.LazyFrame) -> pl.LazyFrame:
    """Bench rows with `verdict` "exact" (`engine.divergence`'s verdict for equal tokens) on every greedy row
    without one whose output equals ar's for the same model, prompt set, prompt, turn, repeat, seed and
    max_new_tokens - ar runs in a cell of its own, so a method's cell cannot say so itself, and the driver
    diagnoses only the rows that differ. A verdict a row has (its cell's, or the driver's diagnosis joined by
    `with_diagnoses` first: a later turn whose prompt already differed keeps that turn's) stays, as
    `engine.metrics.row_verdicts` - the tables' verdicts - counts them."""
    have = bench.collect_schema()
    need = {*PAIR, "method", "temperature", "output_ids", "verdict"}
    if not need <= set(have):
        return bench
    ar = (bench.filter((pl.col("method") == "ar") & (pl.col("temperature") == 0))
          .unique(list(PAIR), keep="first", maintain_order=True)
          .select(*PAIR, pl.col("output_ids").alias("output_ids__ar")))
    equal = (pl.col("verdict").is_null() & (pl.col("temperature") == 0)
             & (pl.col("output_ids") == pl.col("output_ids__ar")).fill_null(False))
    return (bench.join(ar, on=list(PAIR), how="left", maintain_order="left", nulls_equal=True)
            .with_columns(pl.when(equal).then(pl.lit(VERDICTS[0])).otherwise(pl.col("verdict")).alias("verdict"))
            .drop("output_ids__ar"))


def undiagnosed(bench: pl.DataFrame) -> list[tuple[str, pl.DataFrame]]:
    """(cell id, rows to diagnose) per bench cell that holds greedy rows whose output differs from ar's and
    that carry no verdict: the cell's rows of those prompts with the ar rows they are compared with (same
    model, prompt set, prompt, repeat, seed and max_new_tokens; every turn, since a later turn's prompt holds
    the run's own earlier answers)."""
    need = {"cell_id", "method", "model", "prompt_set", "prompt_id", "turn", "repeat", "seed", "max_new_tokens",
            "temperature", "output_ids", "verdict"}
    if not need <= set(bench.columns):
        return []
    pair = list(PAIR)
    greedy = bench.filter(pl.col("temperature") == 0)
    ar = greedy.filter(pl.col("method") == "ar").unique(pair, keep="first").select(*pair, ar_output="output_ids")
    rows = greedy.filter(pl.col("method") != "ar").join(ar, on=pair, how="inner")
    bad = rows.filter(pl.col("verdict").is_null() & (pl.col("output_ids") != pl.col("ar_output")))
    out = []
    prompt = ["model", "prompt_set", "prompt_id", "repeat", "seed", "max_new_tokens"]
    for (cell,), wrong in bad.partition_by("cell_id", as_dict=True, maintain_order=True).items():
        keys = wrong.select(prompt).unique()
        mine = greedy.filter(pl.col("cell_id") == cell).join(keys, on=prompt, how="semi")
        theirs = greedy.filter(pl.col("method") == "ar").join(keys, on=prompt, how="semi").unique(
            pair, keep="first")
        out.append((cell, pl.concat([theirs, mine], how="diagonal_relaxed")))
    return out
