"""Where a sweep's results live, how a cell's file is written, and `load(DIR, kind)` to read them back.

    DIR/sweep.json                                           the manifest: config hash, name, cell count,
                                                             the config as parsed
    DIR/kind=<kind>/model=<model>/method=<method>/<cell id>.parquet     one file per finished cell
    DIR/_rankings/<model>.parquet                            token-frequency rankings for shortlist coverage

Hive values are percent-encoded (`meta-llama%2FLlama-3.1-8B-Instruct`), which polars decodes. Each row also
carries `kind`, `model`, `method`, `cell_id`, `sweep`, `cell_s` (the cell's seconds on its worker) and the
cell's parameters as columns (lists and tables as JSON strings; the SpecConfig fields of a grid point,
`config`, also one column each), so a file read alone says what produced it. Files are written to a temporary name and
renamed into place: a file at its final path is complete.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import quote

import polars as pl

from engine.atomic import atomic_write
from sweeps.cell import Cell, SweepError, canonical_json

MANIFEST = "sweep.json"
HIVE_KEYS = ("kind", "model", "method")
RANKINGS = "_rankings"


def _enc(value: str) -> str:
    return quote(str(value), safe="")


def cell_path(out: str | Path, cell: Cell) -> Path:
    return (Path(out) / f"kind={_enc(cell.kind)}" / f"model={_enc(cell.model)}" / f"method={_enc(cell.method)}"
            / f"{cell.id}.parquet")


def ranking_path(out: str | Path, model_label: str) -> Path:
    return Path(out) / RANKINGS / f"{_enc(model_label)}.parquet"


def write_frame(frame: pl.DataFrame, path: Path) -> Path:
    """Write `frame` to `path` as Parquet by `engine.artifacts.atomic_write`'s rule (a file at its path is complete)."""
    return atomic_write(path, frame.write_parquet)


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
    return write_frame(with_cell_columns(frame, cell, sweep_name, cell_s), cell_path(out, cell))


def finished(out: str | Path, cells) -> set[str]:
    """Ids of the cells whose result file exists."""
    return {c.id for c in cells if cell_path(out, c).is_file()}


# ----------------------------------------------------------------------------------------------------------
# The manifest: one output folder holds one sweep config
# ----------------------------------------------------------------------------------------------------------

def prepare_output(out: str | Path, sweep) -> Path:
    """Create `out` for this sweep, or check it holds this sweep's results. Raises SweepError (deleting
    nothing) when it holds another config's results or is a non-empty folder that is not a sweep's."""
    out = Path(out).expanduser().resolve()
    manifest = out / MANIFEST
    if manifest.is_file():
        try:
            old = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SweepError(f"{manifest} is unreadable ({e}); it marks {out} as a sweep's output folder. Point "
                             f"--out at another folder; nothing was deleted") from None
        if old.get("config_hash") != sweep.config_hash:
            raise SweepError(f"{out} holds results of a different sweep config ({old.get('name')!r}, hash "
                             f"{old.get('config_hash')}; this config {sweep.name!r} has hash {sweep.config_hash}). "
                             f"Nothing was deleted: use another --out, or delete that folder to start over")
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SweepError(f"{out} exists and is not a sweep output folder (no {MANIFEST}); pick a new or empty "
                         f"folder for --out. Nothing was deleted")
    out.mkdir(parents=True, exist_ok=True)
    body = {"name": sweep.name, "config_hash": sweep.config_hash, "cells": len(sweep.cells),
            "kinds": list(sweep.kinds), "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": sweep.config}
    atomic_write(manifest, json.dumps(body, indent=1, sort_keys=True, default=str))
    return out


# ----------------------------------------------------------------------------------------------------------
# Reading results
# ----------------------------------------------------------------------------------------------------------

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


def load(out: str | Path, kind: str) -> pl.LazyFrame:
    """All finished cells of one kind (record | coverage | bench | calibrate) as one LazyFrame.

    Cells may differ in columns (a method with drafter phases, a newer engine's extra column): the scan
    uses the union of every file's schema, filling a file's missing columns with nulls. The hive columns
    `kind`, `model`, `method` allow pruning: `load(d, "bench").filter(pl.col("model") == "...")` reads only
    that model's files."""
    out = Path(out)
    if not out.is_dir():
        raise SweepError(f"{out} is not a folder; pass the --out folder of `python -m sweeps.run`")
    files = result_files(out, kind)
    if not files:
        kinds = sorted({p.name.split("=", 1)[1] for p in out.glob("kind=*")})
        raise SweepError(f"no {kind!r} results under {out} (kinds present: {kinds or 'none'}); run the sweep "
                         f"with that kind first")
    schema, castable = _union_schema(files)
    hive = {k: pl.String for k in HIVE_KEYS}
    if castable:
        casts = pl.ScanCastOptions(integer_cast=["upcast", "allow-float"], float_cast="upcast")
        return pl.scan_parquet(files, hive_partitioning=True, hive_schema=hive, schema=schema,
                               missing_columns="insert", cast_options=casts)
    # a column changed kind between cells (e.g. int in one, string in another): concatenate per file
    return pl.concat([pl.scan_parquet(f) for f in files], how="diagonal_relaxed")
