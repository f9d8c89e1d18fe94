"""Sweep what DynaSpec leaves open (§4.2: M, router width, L; k_max at evaluation) on the rows a fit logged.

    python -m specvocab.engine.jobs.dynaspec_choices --work-dir <fit work dir> --out DIR      # or: specvocab dynaspec choices

One factor at a time around the fit's settings; each router is scored offline on the prompts the fit held out (its
`split.json`; `engine.vocab.dynaspec_fit.router_metrics`). One Parquet file per setting; a rerun skips finished
settings. Every row records the centre it was varied around (`centre_num_clusters`, `centre_router_width`,
`centre_top_l`), which `sweeps.tables.choices_centre` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import polars as pl
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from specvocab.engine.artifacts import atomic_write, save_safetensors, sidecar_path
from specvocab.engine.jobs.args import add_debug, check_at_least, check_out, parse_ints, run_main
from specvocab.engine.models import load_model
from specvocab.engine.vocab.dynaspec import ClusterLayout, DynaSpecError, k_max_for_tokens, tokens_for_k_max
from specvocab.engine.vocab.dynaspec_fit import (SPLIT_FILE, RouterTraining, cluster_targets, load_rows,
                                                 router_metrics, shard_prompt, spherical_kmeans, train_router)


# --- sweeping what the paper leaves open (§4.2: M, router width, L; k_max at evaluation) ---------------------

@dataclass(frozen=True)
class ChoicesConfig:
    """A sweep of DynaSpec's unstated choices on the rows a fit logged (its work dir): one factor at a time
    around the fit's M, router width and L, each router evaluated on the fit's held-out prompts at every
    token budget in `budget_tokens` (k_max = round(tokens * M / V), so settings with different M are compared
    at the same head size), with both budgets (DynaSpec-PA and -F) and the static baseline of each M.

    What is measured is offline: token recall is the share of the full-vocabulary drafter's top-L_log tokens
    (the L the fit logged, whatever L a router was trained on) inside the row's shortlist, and top-1 hit the
    share of rows whose full-head argmax is in it. A row with both at 1 proposes exactly what the full head
    proposes (EAGLE-2 takes each row's top-k, k <= L_log), so tau follows these numbers."""

    work_dir: str                                       # a fit's work dir: fit.json + log-*.safetensors
    out: str                                            # a folder; one Parquet file per setting
    num_clusters: tuple[int, ...] = (256, 512, 1024, 2048)
    router_width: tuple[int, ...] = (128, 256, 512, 1024)
    top_l: tuple[int, ...] = (1, 3, 10)
    budget_tokens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    heldout: float | None = None                        # None: the fit's own split (its split.json); a
                                                        # fraction re-splits the logged prompts, the last ones
                                                        # held out (a work dir from before split.json)
    epochs: int = 12
    threads: int | None = 1
    progress: bool = True


def choice_settings(cfg: ChoicesConfig, base: dict) -> list[tuple[int, int, int]]:
    """(M, width, L) triples: the centre (the fit's M and L, RouterTraining's router width), then each factor
    varied with the others at the centre."""
    m0, w0, l0 = base["num_clusters"], base.get("router_width", RouterTraining.router_width), base["top_l"]
    out = [(m0, w0, l0)]
    out += [(m, w0, l0) for m in cfg.num_clusters]
    out += [(m0, w, l0) for w in cfg.router_width]
    out += [(m0, w0, el) for el in cfg.top_l]
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    for m, w, el in uniq:
        if el > base["top_l"]:
            raise DynaSpecError(f"top_l={el} is more than the {base['top_l']} tokens per row the fit logged — "
                                f"sweep L <= {base['top_l']} or refit with a larger --top-l")
        if m < 1 or w < 1 or el < 1:
            raise DynaSpecError(f"M, router width and L must be >= 1, got M={m}, width={w}, L={el}")
    return uniq


def _choice_clusters(work: Path, base: dict, weight: torch.Tensor, m: int) -> tuple[torch.Tensor, float]:
    """The fit's own clusters at its M; otherwise k-means at M with the fit's settings, cached in the work dir."""
    if m == base["num_clusters"] and (work / "clusters.safetensors").is_file():
        return load_file(str(work / "clusters.safetensors"))["assign"].long(), 0.0
    path = work / "choices" / f"clusters-M{m}.safetensors"
    if path.is_file():
        return load_file(str(path))["assign"].long(), 0.0
    t0 = time.perf_counter()
    sample = base["kmeans_init_sample"]
    km = spherical_kmeans(weight, m, iters=base["kmeans_iters"], seed=base["seed"], init=base["kmeans_init"],
                          init_sample=None if sample is None else max(sample, m))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors({"assign": km.assign.to(torch.int32)}, path)
    return km.assign, time.perf_counter() - t0


def fit_split(work: Path, shards: list[Path], heldout: float | None = None) -> tuple[list[Path], list[Path]]:
    """(train shards, held-out shards) of a fit's work dir: the fit's own split by prompt id (`split.json`,
    written by `fit`; for an older fit, its fitted file's sidecar beside the work dir), so the sweep scores its routers on the prompts the fit held out; with `heldout`, a
    re-split instead (the last round(heldout * n) shards, as `fit` splits)."""
    if heldout is not None:
        n_held = max(1, round(heldout * len(shards)))
        return shards[: len(shards) - n_held], shards[len(shards) - n_held:]
    path = work / SPLIT_FILE
    fitted = work.with_name(work.name[: -len(".work")]) if work.name.endswith(".work") else None
    if path.is_file():
        split = json.loads(path.read_text())
    elif fitted is not None and sidecar_path(fitted).is_file():      # a fit from before split.json: its sidecar
        path = sidecar_path(fitted)
        meta = json.loads(path.read_text())["training"]
        ids, n_held = meta["prompt_ids"], meta["heldout_prompts"]
        split = {"train_prompt_ids": ids[: len(ids) - n_held], "heldout_prompt_ids": ids[len(ids) - n_held:]}
    else:
        raise DynaSpecError(f"{work} has no {SPLIT_FILE} (the fit's held-out prompts), nor a fitted file's sidecar "
                            f"beside it: run the fit to its end (`python -m specvocab.engine.jobs.fit_dynaspec ... --work-dir "
                            f"{work}` resumes and writes it), or pass ChoicesConfig(heldout=...) to re-split")
    by_id = {shard_prompt(s): s for s in shards}
    missing = [p for p in split["train_prompt_ids"] + split["heldout_prompt_ids"] if p not in by_id]
    if missing:
        raise DynaSpecError(f"{path} names logged prompts {missing[:5]} that {work} has no log shard for — "
                            f"rerun the fit on this work dir")
    return [by_id[p] for p in split["train_prompt_ids"]], [by_id[p] for p in split["heldout_prompt_ids"]]


def sweep_choices(cfg: ChoicesConfig) -> Path:
    """Run the sweep (resumable: a setting whose Parquet file exists is skipped) and return the out folder;
    `pl.scan_parquet(out / "*.parquet")` reads it."""
    work = Path(cfg.work_dir).expanduser()
    key_file = work / "fit.json"
    shards = sorted(work.glob("log-*.safetensors"))
    if not key_file.is_file() or not shards:
        raise DynaSpecError(f"{work} is not a DynaSpec fit's work dir (it needs fit.json and log-*.safetensors) — "
                            f"run `python -m specvocab.engine.jobs.fit_dynaspec --model M --work-dir {work}` first")
    base = json.loads(key_file.read_text())
    settings = choice_settings(cfg, base)
    if len(shards) < 2:
        raise DynaSpecError(f"{work} holds {len(shards)} logged prompt — the sweep needs 2 or more (train + held out)")
    train_shards, held_shards = fit_split(work, shards, cfg.heldout)
    if not train_shards or not held_shards:
        raise DynaSpecError(f"the split of {work} leaves {len(train_shards)} training and {len(held_shards)} "
                            f"held-out prompts — the sweep needs both")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, _, _ = load_model(base["model"])
    weight = model.get_output_embeddings().weight.detach()
    vocab = weight.shape[0]
    budgets = [b for b in cfg.budget_tokens if 1 <= b <= vocab]
    if not budgets:
        raise DynaSpecError(f"no budget in {cfg.budget_tokens} is within [1, V={vocab}]")
    train_rows, held_rows = load_rows(train_shards), load_rows(held_shards)
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    wf = weight.float()
    for m, w, el in tqdm(settings, desc="dynaspec choices", disable=not cfg.progress):
        path = out / f"M={m}_width={w}_L={el}.parquet"
        if path.is_file():
            continue
        assign, km_s = _choice_clusters(work, base, weight, m)
        training = RouterTraining(router_width=w, epochs=cfg.epochs, seed=base["seed"], progress=cfg.progress)
        # the router checkpoints live with the sweep that trains them: another sweep of the same fit (other
        # epochs, another split) must not resume them (train_router refuses other hyper-parameters or rows)
        sub = out / "_routers" / f"M{m}-w{w}-L{el}"
        sub.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        router, losses = train_router(training, train_rows.first_l(el), weight, assign, sub)
        train_s = time.perf_counter() - t0
        layout = ClusterLayout.from_assign(assign, m)
        counts = cluster_targets(train_rows.first_l(el).top.long(), assign, m).sum(0)
        static = lambda tok, h: counts.expand(tok.numel(), -1)                              # noqa: E731
        recs = []
        for tokens in budgets:
            k_max = k_max_for_tokens(tokens, m, vocab)
            for scorer, budget, fn in (("router", "position", None), ("router", "fixed", None),
                                       ("static", "position", static)):
                o = router_metrics(router, held_rows, wf, layout, k_max, budget, scores_fn=fn)["overall"]
                recs.append({"model": base["model"], "drafter": base["drafter"], "num_clusters": m,
                             "router_width": w, "top_l": el, "logged_top_l": base["top_l"],
                             "centre_num_clusters": settings[0][0], "centre_router_width": settings[0][1],
                             "centre_top_l": settings[0][2], "scorer": scorer,
                             "budget": budget, "budget_tokens": tokens, "k_max": k_max, **o,
                             "train_rows": len(train_rows), "final_loss": float(np.mean(losses[-20:])),
                             "train_s": train_s, "kmeans_s": km_s})
        atomic_write(path, pl.DataFrame(recs).write_parquet)
    table = pl.read_parquet(sorted(out.glob("*.parquet")))
    ref = tokens_for_k_max(256, 1024, vocab)                   # the default budget's head size
    at = min(budgets, key=lambda b: abs(b - ref))
    show = (table.filter((pl.col("budget_tokens") == at) & (pl.col("budget") == "position"))
            .select("scorer", "num_clusters", "router_width", "top_l", pl.col("token_recall", "top1_hit").round(3),
                    pl.col("mean_row_vocab").round(0), pl.col("train_s").round(1))
            .sort("scorer", "num_clusters", "router_width", "top_l"))
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True, tbl_width_chars=160):
        print(f"[dynaspec] choices on {base['model']} ({len(held_rows)} held-out rows), budget {at} tokens "
              f"(k_max = round({at} * M / {vocab})), DynaSpec-PA:\n{show}")
    print(f"[dynaspec] {table.height} rows -> {out} (pl.scan_parquet('{out}/*.parquet'))")
    return out



def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.dynaspec_choices", description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", required=True, help="a fit's work dir (fit.json + log-*.safetensors)")
    ap.add_argument("--out", required=True, help="a folder for the Parquet files (one per setting; resumable)")
    for fld in fields(ChoicesConfig):
        if isinstance(fld.default, tuple):
            ap.add_argument("--" + fld.name.replace("_", "-"), default=",".join(map(str, fld.default)),
                            help=f"comma-separated, default {','.join(map(str, fld.default))}")
    ap.add_argument("--epochs", type=int, default=ChoicesConfig.epochs)
    ap.add_argument("--threads", type=int, default=ChoicesConfig.threads)
    ap.add_argument("--no-progress", action="store_true")
    add_debug(ap)
    args = vars(ap.parse_args(argv))
    progress = not args.pop("no_progress")
    for k in ("num_clusters", "router_width", "top_l", "budget_tokens"):
        args[k] = tuple(parse_ints("--" + k.replace("_", "-"), args[k]))
    check_at_least("--epochs", args["epochs"], 1)
    check_at_least("--threads", args["threads"], 1)
    check_out("--out", args["out"])
    # sweep_choices checks the work dir, the settings and the fit's split before it loads the model
    return sweep_choices(ChoicesConfig(**args, progress=progress))


if __name__ == "__main__":
    sys.exit(run_main(main))
