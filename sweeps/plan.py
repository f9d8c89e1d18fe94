"""The cells of a sweep: the grid sections of its config - `[record]`, `[[calibrate]]`, `[[bench]]`,
`[coverage]` - checked and expanded into a deterministic list of cells (`expand_cells`, called by
`sweeps.config.parse_sweep`), and `plan(sweep)`, what each cell generates, for `sweeps.run --dry-run`.

What a cell is and how bench cells find the g* of their calibrate cell: the `sweeps.config` docstring. A
cell's id is a hash of its parameters (`sweeps.cell.Cell`), so the order and the parameters written here
are what an output folder resumes by. Without torch: methods, policies, shipped heads and the
calibration key are read from `engine.catalog` and `engine.config`.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

from specvocab.engine.catalog import known_methods, shipped_eagle3_heads, shipped_heads
from specvocab.engine.config import DRAFTING_METHODS, POLICIES, REQUESTED_SIZE, SpecConfig, calibration_fields
from specvocab.engine.metrics import DRAFTERS
from specvocab.engine.prompts import load_prompts
from specvocab.sweeps.cell import NO_METHOD, Cell, SweepError, canonical_json
from specvocab.sweeps.schema import (ANALYSES, BY, COVERAGE_DEFAULTS, SECTION_KEYS, SOURCES, ModelSpec, PromptEntry, Sweep,
                           as_list, check_choices, check_int, check_keys, check_params, grid_points, positive_ints,
                           spec_config, suggest)


def expand_cells(config: dict, kinds: list[str], models: list[ModelSpec], entries: list[PromptEntry], *,
                 max_new: int, repeats: int, warmup: int, seeds: list, dtype: str | None,
                 draft_sizes: str = "default") -> list[Cell]:
    """Every cell of the sweep, in a fixed order: per model its record cells (prompt entry x split value),
    calibrate cells and bench cells; then the coverage cells. A SweepError names the first problem of a grid
    section, or cells the grid repeats. draft_sizes ("default" | "calibrate", `[sweep] draft_sizes`): what a
    bench point of a drafting method runs at when no draft_size, calibrate cell or calibration file gives one -
    the method's uncalibrated default, or the g* of a calibrate cell added here for it (`_bench_cells`)."""
    common = {"dtype": dtype}
    rec = config.get("record", {})
    check_keys(rec, SECTION_KEYS["record"], "[record]")
    record_topk = check_int(rec.get("topk", 16), "[record].topk")
    rec_new = check_int(rec.get("max_new_tokens", max_new), "[record].max_new_tokens")
    cells: list[Cell] = []
    record_ids: dict[tuple[str, int], list[str]] = {}
    for m in models:
        base = {"model_name": m.name, "model_options": m.options, **common}
        if "record" in kinds:
            for e in entries:
                for v in e.values:
                    c = Cell("record", m.label, NO_METHOD, {**base, **e.selection(v), "max_new_tokens": rec_new,
                                                            "topk": record_topk})
                    cells.append(c)
                    record_ids.setdefault((m.label, e.index), []).append(c.id)
        calibrations = _calibrate_cells(config, m, base, max_new) if "calibrate" in kinds else []
        cells += calibrations
        if "bench" in kinds:
            added: list[Cell] = []
            bench = _bench_cells(config, m, base, entries, max_new, repeats, warmup, seeds, calibrations,
                                 added if draft_sizes == "calibrate" and not config.get("sweep", {}).get("calibration")
                                 else None)
            cells += added + bench
    if "coverage" in kinds:
        cells += _coverage_cells(config, models, entries, record_ids, record_topk)

    ids = [c.id for c in cells]
    if len(set(ids)) != len(ids):
        dup = sorted({c.describe() for c in cells if ids.count(c.id) > 1})
        raise SweepError(f"the grid repeats cells ({dup[:3]}) — remove the duplicate values")
    return cells


def _methods(entry: dict, where: str) -> list[str]:
    # Checked against the methods whose drafter module ships in engine/drafters (engine.catalog.known_methods),
    # not engine.drafters.available_methods: a model cell runs on a Ray worker, which can run only the methods
    # whose module it can import; a drafter registered at run time in the driver is not on the workers.
    methods = as_list(entry.get("methods", []), f"{where}.methods", str) if "methods" in entry else []
    have = known_methods()
    if not methods:
        raise SweepError(f"{where}: needs `methods` (some of {have})")
    for m in methods:
        if m not in have:
            raise SweepError(f"{where}: unknown method {m!r}{suggest(m, have)} — choose from {have}")
    return methods


def _policy_points(b: dict, where: str, section: str, methods: list[str], m: ModelSpec):
    """(method, policy, the policy's size field, its size, params grid point) of a [[bench]] or [[calibrate]]
    entry's grid (`section`), the model's params under every point; the vocabulary policies and their sizes
    checked (drafters with an LM head only)."""
    policies = as_list(b.get("policies", ["full"]), f"{where}.policies", str)
    for p in policies:
        if p not in POLICIES:
            raise SweepError(f"{where}.policies: unknown vocabulary policy {p!r}{suggest(p, POLICIES)} — "
                             f"choose from {list(POLICIES)}")
    sizes = positive_ints(b["vocab_sizes"], f"{where}.vocab_sizes") if "vocab_sizes" in b else [None]
    axes = {**{k: [v] for k, v in m.params.items()}, **check_params(b.get("params", {}), where)}
    for method in methods:
        if method not in DRAFTERS and policies != ["full"]:
            raise SweepError(f"{where}: vocabulary policies {policies} restrict the LM head of a drafter "
                             f"({', '.join(DRAFTERS)}) — {method!r} has none - put it in its own [[{section}]] entry "
                             f"without `policies`")
        for policy in policies:
            size_field = REQUESTED_SIZE.get(policy)
            for size in (sizes if size_field else [None]):
                if size_field and size is not None and size_field in axes:
                    raise SweepError(f"{where}: both vocab_sizes and params.{size_field} set the {policy} size — "
                                     f"keep one")
                for point in grid_points(axes):
                    yield method, policy, size_field, size, point


def _check_eagle_head(cfg: SpecConfig, m: ModelSpec, where: str) -> None:
    if cfg.method == "eagle" and not cfg.eagle_head and m.name not in shipped_heads():
        raise SweepError(f"{where}: eagle needs a draft head for {m.name!r}: params.eagle_head = a local EAGLE "
                         f"checkpoint folder or hub id (heads ship for {sorted(shipped_heads())} only — train one "
                         f"with `python -m specvocab.engine.jobs.train_eagle`)")
    if cfg.method == "eagle3" and not cfg.eagle3_head and m.name not in shipped_eagle3_heads():
        raise SweepError(f"{where}: eagle3 needs an EAGLE-3 head for {m.name!r}: params.eagle3_head = a local "
                         f"EAGLE-3 checkpoint folder or hub id (EAGLE-3 heads ship for "
                         f"{sorted(shipped_eagle3_heads()) or 'no model yet'} — train one with `python -m "
                         f"specvocab.engine.jobs.train_eagle3`)")


def _calibrated_by(method: str, cfg: SpecConfig, calibrations: list[Cell], where: str) -> str | None:
    """The id of the calibrate cell whose g* a bench point (method, cfg) without a draft size of its own runs
    at: the one with the same calibration settings (`engine.config.calibration_fields`). None when the
    sweep calibrates no `method` for this model (the engine's default applies); a SweepError naming the
    settings that differ when it calibrates `method` but under other settings."""
    mine = calibration_fields(cfg)
    theirs = [(c, calibration_fields(SpecConfig.preset(method, **c.params["config"])))
              for c in calibrations if c.method == method]
    if not theirs:
        return None
    for c, fields in theirs:
        if fields == mine:
            return c.id
    diffs = [{k: (v, fields.get(k)) for k, v in mine.items() if fields.get(k) != v} for _, fields in theirs]
    nearest = min(diffs, key=len)
    what = ", ".join(f"{k} = {v!r} here, {w!r} there" for k, (v, w) in sorted(nearest.items()))
    raise SweepError(f"{where}: the sweep calibrates {method!r} for this model, but no [[calibrate]] cell has this "
                     f"bench point's settings (nearest: {what}) — a bench cell without draft_size runs at the g* "
                     f"calibrated for its own settings - add a [[calibrate]] entry with the same params / policies "
                     f"/ vocab_sizes, or set params.draft_size for a hand-set size")


def _bench_cells(config, m: ModelSpec, base: dict, entries, max_new, repeats, warmup, seeds,
                 calibrations: list[Cell] = (), added: list[Cell] | None = None) -> list[Cell]:
    """The bench cells of model `m`. added: when a list, a bench point of a drafting method that no calibrate
    cell covers (and with no draft_size) gets one of its own, appended there (default grid, 5 prompts, 2
    warm-up), and runs at its g* - calibrating on the spot."""
    benches = config.get("bench", [])
    if not isinstance(benches, list) or not benches:
        raise SweepError("[sweep].kinds lists 'bench' but there is no [[bench]] entry — add one with `methods`")
    cells = []
    for i, b in enumerate(benches):
        where = f"[[bench]] #{i + 1}"
        check_keys(b, SECTION_KEYS["bench"], where)
        methods = _methods(b, where)
        new = check_int(b.get("max_new_tokens", max_new), f"{where}.max_new_tokens")
        sets = as_list(b.get("prompt_sets", [e.set for e in entries]), f"{where}.prompt_sets", str)
        for name in sets:
            if name not in {e.set for e in entries}:
                raise SweepError(f"{where}.prompt_sets: {name!r} is not the set of any [[prompts]] entry "
                                 f"({sorted({e.set for e in entries})})")
        for method, policy, size_field, size, point in _policy_points(b, where, "bench", methods, m):
            fields = {**point, "vocab": policy, **({size_field: size} if size is not None else {})}
            cfg = spec_config(method, {**fields, "max_new_tokens": new}, where)
            _check_eagle_head(cfg, m, where)
            vocab_size = None if size_field is None else int(getattr(cfg, size_field))
            link = {}
            if method in DRAFTING_METHODS and point.get("draft_size") is None:
                if added is None:
                    source = _calibrated_by(method, cfg, list(calibrations), where)
                else:
                    try:
                        source = _calibrated_by(method, cfg, [*calibrations, *added], where)
                    except SweepError:                      # calibrated under other settings: add these
                        source = None
                    if source is None:
                        fields_cal = {**point, **({"vocab": policy} if policy != "full" else {}),
                                      **({size_field: size} if size is not None else {})}
                        cal = Cell("calibrate", m.label, method, {**base, "grid": None, "prompts": 5, "warmup": 2,
                                                                  "max_new_tokens": new, "policy": policy,
                                                                  "vocab_size": vocab_size, "config": fields_cal})
                        added.append(cal)
                        source = cal.id
                link = {} if source is None else {"calibrate_cell": source}
            for seed in seeds:
                for e in (e for e in entries if e.set in sets):
                    for v in e.values:
                        params = {**base, **e.selection(v), "policy": policy, "vocab_size": vocab_size,
                                  "config": point, "max_new_tokens": new, "repeats": repeats,
                                  "warmup": warmup, "seed": seed, **link}
                        cells.append(Cell("bench", m.label, method, params))
    return cells


def _calibrate_cells(config, m: ModelSpec, base: dict, max_new) -> list[Cell]:
    """One cell per method x policy x vocab size x params point of every [[calibrate]] entry. The policy and
    its size go into the cell's `config` (the SpecConfig it calibrates; `vocab` only where it is not the
    default "full") as well as its `policy` / `vocab_size` columns, like a bench cell's."""
    cals = config.get("calibrate", [])
    if not isinstance(cals, list) or not cals:
        raise SweepError("[sweep].kinds lists 'calibrate' but there is no [[calibrate]] entry — add one with "
                         "`methods = [\"unispec\"]`")
    cells = []
    for i, c in enumerate(cals):
        where = f"[[calibrate]] #{i + 1}"
        check_keys(c, SECTION_KEYS["calibrate"], where)
        methods = _methods(c, where)
        if "draft_size" in c.get("params", {}):
            raise SweepError(f"{where}.params: draft_size is what a calibration measures (its `grid`) — leave it "
                             f"out")
        for method in methods:
            if method not in DRAFTING_METHODS:
                raise SweepError(f"{where}: {method!r} drafts nothing, so it has no draft size to calibrate — "
                                 f"calibrate some of {list(DRAFTING_METHODS)}")
        grid = sorted(set(positive_ints(c["grid"], f"{where}.grid"))) if "grid" in c else None
        n = check_int(c.get("prompts", 5), f"{where}.prompts")
        warm = check_int(c.get("warmup", 2), f"{where}.warmup", 0)
        new = check_int(c.get("max_new_tokens", max_new), f"{where}.max_new_tokens")
        for method, policy, size_field, size, point in _policy_points(c, where, "calibrate", methods, m):
            fields = {**point, **({"vocab": policy} if policy != "full" else {}),
                      **({size_field: size} if size is not None else {})}
            cfg = spec_config(method, {**fields, "max_new_tokens": new}, where)
            _check_eagle_head(cfg, m, where)
            vocab_size = None if size_field is None else int(getattr(cfg, size_field))
            cells.append(Cell("calibrate", m.label, method, {**base, "grid": grid, "prompts": n, "warmup": warm,
                                                             "max_new_tokens": new, "policy": policy,
                                                             "vocab_size": vocab_size, "config": fields}))
    return cells


def _coverage_cells(config, models, entries, record_ids, record_topk) -> list[Cell]:
    cov = config.get("coverage", {})
    check_keys(cov, SECTION_KEYS["coverage"], "[coverage]")
    opt = {k: cov.get(k, v) for k, v in COVERAGE_DEFAULTS.items()}
    analyses = check_choices(opt["analyses"], "[coverage].analyses", ANALYSES, "a coverage analysis")
    w_max = sorted(set(positive_ints(opt["w_max"], "[coverage].w_max")))
    k_pre = positive_ints(opt["k_pre"], "[coverage].k_pre")
    k_ver = positive_ints(opt["k_ver"], "[coverage].k_ver")
    for k in k_pre + k_ver:
        if k > record_topk:
            raise SweepError(f"[coverage]: k_pre / k_ver {k} exceeds the recorded top-K ([record].topk = "
                             f"{record_topk}) — raise topk or lower k")
    sources = check_choices(opt["sources"], "[coverage].sources", SOURCES, "a candidate-stream source")
    by = check_choices(opt["by"], "[coverage].by", BY, "a recorded trace field")
    shortlist_k = sorted(set(positive_ints(opt["shortlist_k"], "[coverage].shortlist_k")))
    capacities = sorted(set(positive_ints(opt["capacities"], "[coverage].capacities")))
    cells = []
    for m in models:
        for e in entries:
            needs = tuple(record_ids[(m.label, e.index)])
            src = {"model_name": m.name, "prompt_set": e.set, "prompt_entry": e.index, "by": by}
            for a in analyses:
                if a == "shortlist":
                    cells.append(Cell("coverage", m.label, NO_METHOD,
                                      {**src, "analysis": a, "shortlist_k": shortlist_k}, needs))
                    continue
                extra = {"w_max": w_max} if a == "window" else {"capacities": capacities} if a == "miss_ratio" else {}
                for kp, kv, s in itertools.product(k_pre, k_ver, sources):
                    cells.append(Cell("coverage", m.label, NO_METHOD,
                                      {**src, "analysis": a, "k_pre": kp, "k_ver": kv, "sources": s, **extra}, needs))
    return cells


def calibration_sha(sweep: Sweep) -> str | None:
    """The SHA-256 (hex) of the calibration file `[sweep] calibration` names; None without one."""
    if sweep.calibration is None:
        return None
    return hashlib.sha256(Path(sweep.calibration).read_bytes()).hexdigest()


def draft_size_source(cell: Cell, sha: str | None = None) -> str | None:
    """Where a bench cell's draft size comes from, decided before it runs: "config" (params.draft_size),
    "calibrate-cell" (the g* of the sweep's calibrate cell it names, `calibrate_cell`),
    "calibration-file:<sha8>" (a record of `[sweep] calibration`, whose SHA-256 is `sha`) or "default" (the
    method's uncalibrated default); None for cells that draft nothing (record, calibrate, coverage, ar).
    The machine's calibration cache is none of these: a sweep never reads it."""
    if cell.kind != "bench" or cell.method not in DRAFTING_METHODS:
        return None
    if cell.params["config"].get("draft_size") is not None:
        return "config"
    if cell.params.get("calibrate_cell"):
        return "calibrate-cell"
    return f"calibration-file:{sha[:8]}" if sha else "default"


def draft_size_sources(sweep: Sweep) -> dict[str, str | None]:
    """{cell id: `draft_size_source`} of every cell of the sweep."""
    sha = calibration_sha(sweep)
    return {c.id: draft_size_source(c, sha) for c in sweep.cells}


def mixed_sources(sweep: Sweep, sources: dict[str, str | None] | None = None) -> list[str]:
    """One line per drafting method whose bench cells take their draft sizes from different kinds of source
    on different models ("eagle: draft sizes from calibrate-cell (smollm2), default (gemma)"): their speedups
    compare a measured g* with a guess. [] when every method's models agree."""
    sources = draft_size_sources(sweep) if sources is None else sources
    per: dict[str, dict[str, set]] = {}
    for c in sweep.cells:
        src = sources.get(c.id)
        if src is not None:
            per.setdefault(c.method, {}).setdefault(src.split(":")[0], set()).add(c.model)
    lines = []
    for method, kinds in per.items():
        models = {m for ms in kinds.values() for m in ms}
        if len(kinds) > 1 and len(models) > 1:
            what = ", ".join(f"{k} ({', '.join(sorted(ms))})" for k, ms in sorted(kinds.items()))
            lines.append(f"{method}: draft sizes from {what}")
    return lines


def plan(sweep: Sweep) -> list[dict]:
    """Per cell: kind, model, method, id, its draft size's source (`draft_size_source`), prompt turns and the
    most tokens it can generate (turns x
    max_new_tokens x repeats; calibrate: prompts x grid points; coverage: 0) - for `sweeps.run --dry-run`."""
    turns: dict[str, int] = {}
    sources = draft_size_sources(sweep)
    rows = []
    for c in sweep.cells:
        p = c.params
        n_turns, tokens = 0, 0
        if c.kind in ("record", "bench"):
            key = canonical_json([p[k] for k in ("prompt_set", "per_category", "categories", "languages")])
            if key not in turns:
                turns[key] = sum(len(q.turns) for q in load_prompts(p["prompt_set"], per_category=p["per_category"],
                                                                    categories=p["categories"],
                                                                    languages=p["languages"]))
            n_turns = turns[key]
            tokens = n_turns * p["max_new_tokens"] * p.get("repeats", 1)
        elif c.kind == "calibrate":
            n_turns = p["prompts"] + p["warmup"]
            tokens = p["prompts"] * p["max_new_tokens"] * (len(p["grid"]) if p["grid"] else 10)
        rows.append({"kind": c.kind, "model": c.model, "method": c.method, "cell_id": c.id,
                     "draft_size_source": sources[c.id], "turns": n_turns, "tokens": tokens})
    return rows
