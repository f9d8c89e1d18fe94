"""Fit DynaSpec's clusters and router for one model and drafter (DynaSpec §4.2, App. A.2).

    python -m specvocab.engine.jobs.fit_dynaspec --model smollm2-135m-instruct --drafter eagle     # or: specvocab dynaspec fit

Three steps, each resumable from the work dir (`<out>.work`): spherical k-means over the L2-normalised LM-head
rows; logging router rows from full-vocabulary drafting on the training corpus, one shard per prompt
(`log_rows`); and training the router with the BCE of §4.2. The steps' pieces (`spherical_kmeans`, `RouterRows`,
`RouterDataLogger`, `train_router`, `router_metrics`) are the library's `engine.vocab.dynaspec_fit`; this job
holds the config (checked before a model loads, `FitConfig.validate`), the logging runs, the order of the
steps and the CLI. The fitted file is read at decode time by `engine.vocab.dynaspec` (which holds the layout,
the router module and the file format); the words are in its docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from specvocab.engine.artifacts import FINGERPRINT_KEY, head_fingerprint, save_safetensors
from specvocab.engine.config import ConfigError, SpecConfig, parse_overrides
from specvocab.engine.drafters import make_drafter
from specvocab.engine.harness import generate, resolve_config
from specvocab.engine.jobs.args import add_debug, add_fields, check_model, check_out, run_main
from specvocab.engine.metrics import DRAFTERS
from specvocab.engine.models import load_model
from specvocab.engine.prompts import PromptError, encode_prompt, load_prompts
from specvocab.engine.vocab.dynaspec import ClusterLayout, DynaSpecError, FittedDynaSpec, default_dynaspec_path, save_dynaspec
from specvocab.engine.vocab.dynaspec_fit import (RouterDataLogger, RouterTraining, cluster_targets, head_rows,
                                                 load_rows, router_metrics, shard_prompt, spherical_kmeans,
                                                 train_router, write_split)


# --- the fit's settings ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FitConfig:
    """Everything `fit` does, with defaults. The paper gives none of M, router width, L, k_max, the data size
    or the optimiser (§4.2, App. A.2); each default here says why it was chosen (the router training's in
    `engine.vocab.dynaspec_fit.RouterTraining`)."""

    model: str
    drafter: str = "layerskip"              # the drafter whose states the router reads (eagle: its head)
    spec: tuple[tuple[str, object], ...] = ()   # other SpecConfig fields for the logging runs (drafter_layers=...)
    prompts: str = "train_corpus"           # the training corpus: disjoint from every benchmark
    num_prompts: int = 64                   # prompts logged (held-out ones included)
    heldout: float = 0.125                  # fraction of the prompts held out for recall (split by prompt)
    max_new_tokens: int = 64                # tokens generated per prompt while logging
    max_prompt_tokens: int = 384            # longer prompts are skipped (drafting cost grows with context)
    num_clusters: int = 1024                # M: not stated (§4.2); 1024 = ~48 tokens per cluster on 49k, ~256 on 262k
    kmeans_iters: int = 25                  # Lloyd iterations at most (stops earlier once no row moves)
    kmeans_init: str = "k-means++"
    kmeans_init_sample: int | None = 16384  # k-means++ seeds on this many random rows (16 per cluster at
                                            # M = 1024): the seeding is sequential in M; Lloyd uses every row
    router_width: int = RouterTraining.router_width     # the router's training: `RouterTraining` says why
    top_l: int = 10                         # L: "e.g. the top-L tokens" (§4.2); 10 = EAGLE-2's per-node top-k,
                                            # every token the full head would put in the tree from that row
    epochs: int = RouterTraining.epochs
    batch_size: int = RouterTraining.batch_size
    lr: float = RouterTraining.lr
    weight_decay: float = RouterTraining.weight_decay
    k_max: int = 256                        # for the held-out recall only: SpecConfig.dynaspec_k_max's default
    seed: int = RouterTraining.seed
    out: str | None = None                  # default: `default_dynaspec_path` under the specvocab cache
    work_dir: str | None = None             # logs + checkpoints; default: <out>.work (resume from there)
    threads: int | None = 1                 # torch threads (None = leave as is)
    progress: bool = True

    def spec_config(self) -> SpecConfig:
        return SpecConfig.preset(self.drafter, vocab="full", max_new_tokens=self.max_new_tokens, **dict(self.spec))

    def validate(self) -> "FitConfig":
        """The settings checked before anything loads: a drafter with an LM head, the logging runs' SpecConfig,
        the sizes, the held-out fraction, the k-means seeding; DynaSpecError / ConfigError name the bad one."""
        if self.drafter not in DRAFTERS:
            raise DynaSpecError(f"drafter {self.drafter!r} has no LM head to restrict — use {', '.join(DRAFTERS)}")
        self.spec_config()
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "num_clusters", "kmeans_iters",
                     "router_width", "top_l", "epochs", "batch_size", "k_max"):
            if getattr(self, name) < 1:
                raise DynaSpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.heldout < 1:
            raise DynaSpecError(f"heldout must be a fraction in [0, 1), got {self.heldout}")
        if self.kmeans_init not in ("k-means++", "random"):
            raise DynaSpecError(f"unknown k-means init {self.kmeans_init!r} — choose 'k-means++' or 'random'")
        return self

    def router_training(self) -> RouterTraining:
        """The router's training settings of this fit (`train_router`)."""
        return RouterTraining(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RouterTraining)})

    def data_key(self) -> dict:
        """The settings the logged rows and clusters depend on: a work dir holds one of them."""
        keep = ("model", "drafter", "spec", "prompts", "num_prompts", "max_new_tokens", "max_prompt_tokens",
                "num_clusters", "kmeans_iters", "kmeans_init", "kmeans_init_sample", "top_l", "seed")
        return {k: (list(map(list, getattr(self, k))) if k == "spec" else getattr(self, k)) for k in keep}


def _select_prompts(cfg: FitConfig):
    try:
        prompts = load_prompts(cfg.prompts)
    except PromptError as e:
        raise DynaSpecError(f"cannot load the training prompts {cfg.prompts!r}: {e}") from e
    if not prompts:
        raise DynaSpecError(f"prompt set {cfg.prompts!r} is empty — point --prompts at a non-empty training corpus")
    perm = np.random.default_rng(cfg.seed).permutation(len(prompts))          # spread over languages and tasks
    return [prompts[i] for i in perm]


def log_rows(cfg: FitConfig, model, tokenizer, info, work: Path) -> list[Path]:
    """Run full-vocabulary drafting on `cfg.num_prompts` training prompts, one shard per prompt
    (`log-00000.safetensors`, written atomically; existing shards are kept, so a rerun resumes)."""
    spec = resolve_config(cfg.spec_config(), model=model)          # draft_size: the drafter's default
    drafter = logger = None                      # built when a prompt needs logging (not on a full resume)
    shards, skipped = [], 0
    candidates = iter(_select_prompts(cfg))
    bar = tqdm(total=cfg.num_prompts, desc="log draft rows", disable=not cfg.progress)
    while len(shards) < cfg.num_prompts:
        shard = work / f"log-{len(shards):05d}.safetensors"
        if shard.is_file():
            shards.append(shard)
            bar.update(1)
            continue
        try:
            p = next(candidates)
        except StopIteration:
            break
        # a prompt already logged under a lower shard number is skipped by its id
        if any(shard_prompt(s) == p.prompt_id for s in shards):
            continue
        try:
            ids = encode_prompt(tokenizer, info, p.turns[:1], [], max_new_tokens=cfg.max_new_tokens,
                                system_prompt=p.system_prompt, name=p.prompt_id)
        except PromptError:
            skipped += 1
            continue
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        if drafter is None:
            drafter = make_drafter(model, spec)
            if not hasattr(drafter, "policy"):
                raise DynaSpecError(f"drafter {cfg.drafter!r} has no LM head to restrict — use layerskip, eagle or "
                                    f"eagle3")
            logger = RouterDataLogger(drafter.policy, cfg.top_l, to_row=head_rows(drafter, model)[2])
            drafter.policy = logger
        logger.rows = []
        res = generate(model, ids, spec, drafter=drafter, tokenizer=tokenizer, info=info)
        rows = logger.take()
        if not rows:
            continue
        save_safetensors(rows.tensors(), shard, metadata={"prompt_id": str(p.prompt_id), "tau": f"{res.tau:.4f}",
                                                "tokens": str(res.new_tokens)})
        shards.append(shard)
        bar.update(1)
        bar.set_postfix(rows=len(rows), tau=f"{res.tau:.2f}", skipped=skipped)
    bar.close()
    if not shards:
        raise DynaSpecError(f"no prompt of {cfg.prompts!r} could be logged (all longer than max_prompt_tokens="
                            f"{cfg.max_prompt_tokens}?) — raise --max-prompt-tokens or use another corpus")
    return shards




def fit(cfg: FitConfig) -> Path:
    """Clusters, logged rows, router; writes the fitted DynaSpec and returns its path. Resumable: the work
    dir keeps the clusters, one log shard per prompt and the router checkpoint."""
    t_start = time.perf_counter()
    cfg.validate()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, tokenizer, info = load_model(cfg.model)
    # resolved as a run resolves it, so the key names the drafter a run will use (eagle: the shipped head)
    spec = resolve_config(cfg.spec_config(), model=model)
    drafter = make_drafter(model, spec)
    if not hasattr(drafter, "drafter_key"):
        raise DynaSpecError(f"drafter {cfg.drafter!r} has no LM head to restrict — use layerskip, eagle or eagle3")
    key_of_drafter = drafter.drafter_key()       # eagle/eagle3: the head's hash and the depth (a run checks both)
    weight, embed, _ = head_rows(drafter, model)  # [K, d] the rows clustered; [V, d] E(x) by target id
    del drafter
    out = Path(cfg.out).expanduser() if cfg.out else default_dynaspec_path(cfg.model, spec, key_of_drafter)
    work = Path(cfg.work_dir).expanduser() if cfg.work_dir else out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    key_file = work / "fit.json"
    key = cfg.data_key()
    if key_file.is_file() and json.loads(key_file.read_text()) != key:
        raise DynaSpecError(f"work dir {work} holds a fit with other settings ({key_file}) — delete it or pass "
                            f"another --work-dir")
    key_file.write_text(json.dumps(key, indent=1, sort_keys=True))

    clusters = work / "clusters.safetensors"
    if clusters.is_file():
        assign = load_file(str(clusters))["assign"].long()
        km_info = json.loads((work / "clusters.json").read_text())
    else:
        t0 = time.perf_counter()
        km = spherical_kmeans(weight, cfg.num_clusters, iters=cfg.kmeans_iters, seed=cfg.seed,
                              init=cfg.kmeans_init, init_sample=cfg.kmeans_init_sample)
        assign = km.assign
        sizes = torch.bincount(assign, minlength=cfg.num_clusters)
        km_info = {"iterations": km.iterations, "converged": km.converged, "mean_cosine": km.mean_cosine,
                   "seconds": time.perf_counter() - t0, "size_min": int(sizes.min()),
                   "size_median": float(sizes.float().median()), "size_max": int(sizes.max())}
        (work / "clusters.json").write_text(json.dumps(km_info, indent=1))
        save_safetensors({"assign": assign.to(torch.int32), "centroids": km.centroids.cpu()}, clusters)
        print(f"[dynaspec] {cfg.num_clusters} clusters in {km_info['seconds']:.1f} s ({km.iterations} iterations"
              f"{', converged' if km.converged else ''}); sizes {km_info['size_min']}..{km_info['size_max']}, "
              f"median {km_info['size_median']:.0f}", flush=True)

    shards = log_rows(cfg, model, tokenizer, info, work)
    n_held = max(1, round(cfg.heldout * len(shards))) if len(shards) > 1 else 0
    train_rows, held_rows = load_rows(shards[: len(shards) - n_held]), load_rows(shards[len(shards) - n_held:])
    write_split(work, shards[: len(shards) - n_held], shards[len(shards) - n_held:], cfg.heldout)
    if not train_rows:
        raise DynaSpecError("no training rows were logged — raise --num-prompts")
    router, losses = train_router(cfg.router_training(), train_rows, weight, assign, work, embed=embed)

    layout = ClusterLayout.from_assign(assign, cfg.num_clusters)
    metrics = {}
    if held_rows:
        counts = cluster_targets(train_rows.top.long(), assign, cfg.num_clusters).sum(0)   # label frequency
        static = lambda tok, h: counts.expand(tok.numel(), -1)                                 # noqa: E731
        emb = embed.float()
        metrics = {"router": router_metrics(router, held_rows, emb, layout, cfg.k_max),
                   "static_baseline": router_metrics(router, held_rows, emb, layout, cfg.k_max, scores_fn=static),
                   "router_fixed_budget": router_metrics(router, held_rows, emb, layout, cfg.k_max, budget="fixed")}
    fit_s = time.perf_counter() - t_start
    meta = {"model": cfg.model, "drafter_config": key_of_drafter, "created": time.time(),
            FINGERPRINT_KEY: head_fingerprint(weight), "top_l": cfg.top_l, "kmeans": {
                "iters": cfg.kmeans_iters, "init": cfg.kmeans_init, "init_sample": cfg.kmeans_init_sample,
                "seed": cfg.seed, **km_info},
            "training": {"prompts": cfg.prompts, "prompt_ids": [shard_prompt(s) for s in shards],
                         "heldout_prompts": n_held, "max_new_tokens": cfg.max_new_tokens,
                         "train_rows": len(train_rows),
                         "heldout_rows": len(held_rows) if held_rows else 0,
                         "epochs": cfg.epochs, "batch_size": cfg.batch_size, "lr": cfg.lr,
                         "weight_decay": cfg.weight_decay, "final_loss": float(np.mean(losses[-20:]))},
            "heldout": metrics, "eval_k_max": cfg.k_max, "fit_seconds": fit_s}
    path = save_dynaspec(FittedDynaSpec(assign=assign, router=router, meta=meta), out)
    print(f"[dynaspec] fitted in {fit_s:.0f} s -> {path} (logged rows, clusters, router checkpoint: {work}; "
          f"`python -m specvocab.engine.jobs.dynaspec_choices --work-dir {work} --out DIR` sweeps M, router width and L on them)")
    if metrics:
        for name, res in metrics.items():
            o = res["overall"]
            print(f"[dynaspec] held-out {name} (k_max={cfg.k_max}): cluster recall {o['cluster_recall']:.3f}, token "
                  f"recall {o['token_recall']:.3f}, top-1 hit {o['top1_hit']:.3f}, mean row shortlist "
                  f"{o['mean_row_vocab']:.0f} of {weight.shape[0]} ({o['rows']} rows)")
    return path



def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m specvocab.engine.jobs.fit_dynaspec", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    add_fields(ap, FitConfig, {"model", "spec", "progress"})
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a SpecConfig field for the logging runs, e.g. drafter_layers=skip:12,14")
    ap.add_argument("--no-progress", action="store_true")
    add_debug(ap)
    args = vars(ap.parse_args(argv))
    try:
        spec = tuple(parse_overrides(args.pop("set")).items())
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    progress = not args.pop("no_progress")
    cfg = FitConfig(**args, spec=spec, progress=progress).validate()
    # before `fit` loads a model: the name, the paths, the training prompts (an unknown set, no data root)
    check_model(cfg.model)
    if cfg.out:
        check_out("--out", cfg.out, file=True)
    if cfg.work_dir:
        check_out("--work-dir", cfg.work_dir)
    _select_prompts(cfg)
    return fit(cfg)


if __name__ == "__main__":
    sys.exit(run_main(main))
