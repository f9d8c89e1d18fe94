"""Fit DynaSpec's clusters and router for one model and drafter (DynaSpec §4.2, App. A.2).

    python -m specvocab.engine.jobs.fit_dynaspec --model smollm2-135m-instruct --drafter eagle     # or: specvocab dynaspec fit

Three steps, each resumable from the work dir (`<out>.work`): spherical k-means over the L2-normalised LM-head
rows (`spherical_kmeans`); logging router rows from full-vocabulary drafting on the training corpus, one shard
per prompt (`log_rows`, `RouterRows`); and training the router with the BCE of §4.2 (`train_router`). The
fitted file is read at decode time by `engine.vocab.dynaspec` (which holds the layout, the router module and
the file format); the words are in its docstring.

Over 600 lines: the three steps, the config they share (checked before a model loads, `FitConfig.validate`)
and the CLI are one fit, over one work-dir layout; what a decode reads lives in `engine.vocab.dynaspec`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from specvocab.engine.artifacts import FINGERPRINT_KEY, atomic_write, head_fingerprint, save_safetensors, save_torch
from specvocab.engine.config import ConfigError, SpecConfig, parse_overrides
from specvocab.engine.drafters import make_drafter
from specvocab.engine.harness import generate, resolve_config
from specvocab.engine.jobs.args import add_debug, add_fields, check_model, check_out, run_main
from specvocab.engine.metrics import DRAFTERS
from specvocab.engine.models import load_model
from specvocab.engine.prompts import PromptError, encode_prompt, load_prompts
from specvocab.engine.vocab.dynaspec import (ClusterLayout, DynaSpecError, FittedDynaSpec, Router, cluster_budget,
                                   default_dynaspec_path, save_dynaspec, select_clusters)


# --- spherical k-means (§4.2) ---------------------------------------------------------------------------

@dataclass
class KMeansResult:
    assign: torch.Tensor          # [n] long, cluster of each row
    centroids: torch.Tensor       # [M, d] fp32, unit norm
    iterations: int               # Lloyd iterations run
    converged: bool               # assignments stopped changing before `iters`
    mean_cosine: float            # mean cosine between a row and its centroid (the objective)


def _nearest(x: torch.Tensor, c: torch.Tensor, chunk_bytes: int = 64 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, d], c [M, d] (unit rows) -> (argmax_m x.c_m [n] long, that cosine [n]); [chunk, M] at a time."""
    n, m = x.shape[0], c.shape[0]
    step = max(1, chunk_bytes // (4 * m))
    assign = torch.empty(n, dtype=torch.long, device=x.device)
    best = torch.empty(n, dtype=torch.float32, device=x.device)
    for a in range(0, n, step):
        sims = x[a:a + step] @ c.T                                            # [chunk, M]
        best[a:a + step], assign[a:a + step] = sims.max(dim=1)
    return assign, best


def _kmeanspp(x: torch.Tensor, m: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding on the unit sphere: the next centre is drawn with probability proportional to
    1 - cos(x, nearest centre) = ||x - c||^2 / 2, the squared Euclidean distance of Arthur & Vassilvitskii."""
    n = x.shape[0]
    idx = torch.empty(m, dtype=torch.long)
    idx[0] = int(torch.randint(n, (1,), generator=gen))
    dist = (1.0 - x @ x[idx[0]]).clamp(min=0.0)                              # [n]
    for i in range(1, m):
        w = dist.double().cpu()
        if float(w.sum()) <= 0:                  # every row coincides with a centre: any unused row will do
            w = torch.ones(n, dtype=torch.float64)
            w[idx[:i]] = 0
        idx[i] = int(torch.multinomial(w, 1, generator=gen))
        dist = torch.minimum(dist, (1.0 - x @ x[idx[i]]).clamp(min=0.0))
    return x[idx.to(x.device)].clone()


def _fill_empty(x: torch.Tensor, assign: torch.Tensor, best: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
    """Give every empty cluster one row: the rows their centroid serves worst (lowest cosine), taken only
    from clusters that keep at least one row. Returns the centroids of the refilled clusters' rows and how
    many were empty (assign is updated in place)."""
    counts = torch.bincount(assign, minlength=m)
    empty = (counts == 0).nonzero().flatten()
    if empty.numel() == 0:
        return x.new_zeros(0, x.shape[1]), 0
    order = torch.argsort(best)                                               # worst served first
    moved = []
    for row in order.tolist():                   # host loop over at most a few rows per empty cluster
        if len(moved) == empty.numel():
            break
        if counts[assign[row]] > 1:
            counts[assign[row]] -= 1
            moved.append(row)
    moved_t = torch.tensor(moved, dtype=torch.long, device=x.device)
    assign[moved_t] = empty
    best[moved_t] = 1.0
    return x[moved_t], empty.numel()


def spherical_kmeans(x: torch.Tensor, num_clusters: int, *, iters: int = 25, seed: int = 0,
                     init: str | torch.Tensor = "k-means++", init_sample: int | None = None) -> KMeansResult:
    """Spherical k-means (cosine similarity) of the rows of x [n, d] into `num_clusters` unbalanced clusters.

    Rows are L2-normalised; each Lloyd iteration assigns every row to the centroid of highest cosine and
    sets each centroid to the normalised sum of its rows. `init`: "k-means++" (seeded on `init_sample`
    random rows when given - the seeding is sequential in M, so a sample keeps it cheap on 262k-token
    vocabularies), "random" (distinct random rows) or a tensor [M, d] of initial centroids. An empty
    cluster is re-seeded with the row its old centroid serves worst, so every cluster of the result holds
    at least one row. Deterministic in `seed`. Stops when no assignment changes or after `iters`.
    """
    if x.dim() != 2 or x.shape[0] == 0:
        raise DynaSpecError(f"k-means needs a non-empty [n, d] matrix, got {tuple(x.shape)}")
    n = x.shape[0]
    if not 1 <= num_clusters <= n:
        raise DynaSpecError(f"num_clusters={num_clusters} must be in [1, {n}] (one row per cluster at least)")
    if iters < 1:
        raise DynaSpecError(f"iters must be >= 1, got {iters}")
    gen = torch.Generator().manual_seed(seed)
    x = F.normalize(x.float(), dim=1)                                         # [n, d] unit rows
    if isinstance(init, torch.Tensor):
        if tuple(init.shape) != (num_clusters, x.shape[1]):
            raise DynaSpecError(f"init centroids must be [{num_clusters}, {x.shape[1]}], got {tuple(init.shape)}")
        c = F.normalize(init.to(x.device, torch.float32), dim=1)
    elif init == "k-means++":
        pool = x
        if init_sample is not None and init_sample < n:
            if init_sample < num_clusters:
                raise DynaSpecError(f"init_sample={init_sample} must be >= num_clusters={num_clusters}")
            pool = x[torch.randperm(n, generator=gen)[:init_sample].to(x.device)]
        c = _kmeanspp(pool, num_clusters, gen)
    elif init == "random":
        c = x[torch.randperm(n, generator=gen)[:num_clusters].to(x.device)].clone()
    else:
        raise DynaSpecError(f"unknown k-means init {init!r}; choose 'k-means++', 'random' or a centroid tensor")
    assign, converged, it = None, False, 0
    for it in range(1, iters + 1):
        new_assign, best = _nearest(x, c)
        refill, n_empty = _fill_empty(x, new_assign, best, num_clusters)
        if assign is not None and n_empty == 0 and torch.equal(new_assign, assign):
            converged = True
            break
        assign = new_assign
        sums = torch.zeros_like(c).index_add_(0, assign, x)                  # [M, d]
        c = F.normalize(sums, dim=1)
    assign, best = _nearest(x, c)                # the result's assignment belongs to its centroids
    _fill_empty(x, assign, best, num_clusters)
    c = F.normalize(torch.zeros_like(c).index_add_(0, assign, x), dim=1)
    mean_cos = float((x * c[assign]).sum(1).mean())
    return KMeansResult(assign=assign, centroids=c, iterations=it, converged=converged, mean_cosine=mean_cos)



# --- router training targets and loss (§4.2) ----------------------------------------------------------

def cluster_targets(top_ids: torch.Tensor, assign: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """top_ids [n, L] (the full-vocabulary drafter's top-L tokens per row) -> multi-hot [n, M] fp32:
    y_m = 1 iff cluster m holds one of them (§4.2)."""
    y = torch.zeros(top_ids.shape[0], num_clusters, device=top_ids.device)
    return y.scatter_(1, assign[top_ids.long()], 1.0)


def router_loss(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """BCE over all M clusters (§4.2): summed over clusters, mean over rows."""
    return F.binary_cross_entropy_with_logits(scores, targets, reduction="none").sum(1).mean()


# --- the logged rows ----------------------------------------------------------------------------------------

@dataclass
class RouterRows:
    """Router training rows (App. A.2), one per row the drafter's head scored while drafting with the full
    vocabulary; a log shard holds these four tensors under these names."""

    tokens: torch.Tensor          # [n] int32   x: the token whose children the row's head call scores
    parent_h: torch.Tensor        # [n, d]      the drafter hidden state that proposed x (the router's h), in the
                                  #             drafter's own dtype: the values the router reads at decode time
    t: torch.Tensor               # [n] int8    draft step (0: the root's children)
    top: torch.Tensor             # [n, L] int32 the full head's top-L tokens at that row, best first, as rows
                                  #             of the head the clusters partition (`head_rows`: target ids, or
                                  #             an EAGLE-3 head's draft ids)

    def __len__(self) -> int:
        return self.tokens.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], where: str = "rows") -> "RouterRows":
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise DynaSpecError(f"{where} lacks {missing}: not a DynaSpec log shard; delete it and fit again")
        return cls(**{n: tensors[n] for n in names})

    @classmethod
    def cat(cls, parts: list["RouterRows"]) -> "RouterRows":
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    def first_l(self, el: int) -> "RouterRows":
        """The same rows labelled by their top-el tokens only (el <= L)."""
        return dataclasses.replace(self, top=self.top[:, :el])


# --- logging router training rows from full-vocabulary drafting (App. A.2) -----------------------------------

class RouterDataLogger:
    """Stands in for a drafter's full-vocabulary policy and records, per head call, the router's input rows
    (token x and hidden state h from `route`) and the full head's top-L tokens at those rows."""

    def __init__(self, inner, top_l: int, to_row: torch.Tensor | None = None):
        self.inner, self.top_l = inner, top_l
        self.to_row = to_row                     # [V] target id -> head row (eagle3's draft ids); None: identity
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending = None

    def __getattr__(self, name):                 # begin, observe, record_step, stats, ...: the inner policy
        return getattr(self.inner, name)

    def route(self, tokens, parent_h, t):
        # to the host at once: an offline logging run, where a sync per level costs nothing that matters.
        # parent_h keeps the drafter's dtype: at decode time `Router.forward` upcasts exactly these values to
        # fp32, so the router trains on what it will read (fp16 would round an fp32 model's states to 11 bits
        # and overflow a bf16 model's large activations to inf)
        self._pending = (tokens.reshape(-1).to("cpu", torch.int32), parent_h.detach().to("cpu"), t)

    def head_topk(self, h, k):
        logp, ids = self.inner.head_topk(h, max(k, self.top_l))                 # [r, K] sorted, best first
        if self._pending is None or self._pending[0].numel() != h.shape[0]:
            raise DynaSpecError("the drafter ran its head without routing the rows first; log with a drafter "
                                "built on LMHeadDrafter (layerskip, eagle, eagle3)")
        tokens, parent_h, t = self._pending
        self._pending = None
        top = ids[:, : self.top_l]
        if self.to_row is not None:
            top = self.to_row[top.long()]
        self.rows.append((tokens, parent_h, torch.full_like(tokens, t, dtype=torch.int8), top.to("cpu", torch.int32)))
        return logp[:, :k], ids[:, :k]

    def take(self) -> "RouterRows | None":
        rows, self.rows = self.rows, []
        if not rows:
            return None
        tok, h, t, top = (torch.cat(c) for c in zip(*rows))
        return RouterRows(tokens=tok, parent_h=h, t=t, top=top)


# --- fitting ---------------------------------------------------------------------------------------------------

def head_rows(drafter, model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What a fit partitions and reads for this drafter: (weight [K, d], the head rows the clusters split; embed
    [V, d], E(x) by target id; to_row [V] target id -> row of weight, or None when they are the same). eagle3
    (`engine.drafters.eagle3`): its own lm_head over the draft vocabulary, the target's LM head as E(x) and
    row_of_target; every other drafter: the target's LM head for both."""
    target = model.get_output_embeddings().weight.detach()
    maps = getattr(drafter, "maps", None)
    if maps is not None and hasattr(drafter, "router_embedding"):
        return drafter.head_weight.detach(), drafter.router_embedding(), maps.row_of_target
    return target, target, None


@dataclass(frozen=True)
class FitConfig:
    """Everything `fit` does, with defaults. The paper gives none of M, router width, L, k_max, the data size
    or the optimiser (§4.2, App. A.2); each default here says why it was chosen."""

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
    router_width: int = 512                 # not stated ("lightweight MLP"); 512 keeps the router below a
                                            # 2k-token shortlist head at d = 576 (see `Router`)
    top_l: int = 10                         # L: "e.g. the top-L tokens" (§4.2); 10 = EAGLE-2's per-node top-k,
                                            # every token the full head would put in the tree from that row
    epochs: int = 12
    batch_size: int = 256
    lr: float = 1e-3                        # AdamW, cosine decay to 0 (not stated in the paper)
    weight_decay: float = 0.01
    k_max: int = 256                        # for the held-out recall only: SpecConfig.dynaspec_k_max's default
    seed: int = 0
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
            raise DynaSpecError(f"drafter {self.drafter!r} has no LM head to restrict; use {', '.join(DRAFTERS)}")
        self.spec_config()
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "num_clusters", "kmeans_iters",
                     "router_width", "top_l", "epochs", "batch_size", "k_max"):
            if getattr(self, name) < 1:
                raise DynaSpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.heldout < 1:
            raise DynaSpecError(f"heldout must be a fraction in [0, 1), got {self.heldout}")
        if self.kmeans_init not in ("k-means++", "random"):
            raise DynaSpecError(f"unknown k-means init {self.kmeans_init!r}; choose 'k-means++' or 'random'")
        return self

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
        raise DynaSpecError(f"prompt set {cfg.prompts!r} is empty; point --prompts at a non-empty training corpus")
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
                raise DynaSpecError(f"drafter {cfg.drafter!r} has no LM head to restrict; use layerskip, eagle or "
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
                            f"{cfg.max_prompt_tokens}?); raise --max-prompt-tokens or use another corpus")
    return shards


def shard_prompt(path: Path) -> str | None:
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("prompt_id")


SPLIT_FILE = "split.json"


def write_split(work: Path, train: list[Path], held: list[Path], fraction: float) -> None:
    """The fit's split of its logged prompts (`split.json` in the work dir), which `dynaspec_choices` reuses."""
    split = {"heldout": fraction, "train_prompt_ids": [shard_prompt(s) for s in train],
             "heldout_prompt_ids": [shard_prompt(s) for s in held]}
    atomic_write(work / SPLIT_FILE, json.dumps(split, indent=1))


def load_rows(paths: list[Path]) -> RouterRows | None:
    """The rows of log shards, concatenated in order (None for no shards)."""
    parts = [RouterRows.from_tensors(load_file(str(p)), str(p)) for p in paths]
    return RouterRows.cat(parts) if parts else None


@torch.no_grad()
def router_metrics(router: Router, rows: RouterRows, weight: torch.Tensor, layout: ClusterLayout,
                   k_max: int, budget: str = "position", scores_fn=None, batch: int = 4096) -> dict:
    """Held-out quality of a router at the budget k_c(t) of each row (§4.2), overall and per draft step t:
    cluster recall (positives among the picked clusters / positives), token recall (top-L tokens inside the
    shortlist), top-1 hit (the full drafter's argmax inside the shortlist) and the mean shortlist size.
    `scores_fn(tokens, h) -> [n, M]` replaces the router (e.g. a static baseline). `weight` holds the rows E(x)
    by token id (`head_rows`' embed)."""
    m = layout.num_clusters
    sums: dict[int, np.ndarray] = {}
    n_rows = len(rows)
    for a in range(0, n_rows, batch):
        tok, h = rows.tokens[a:a + batch].long(), rows.parent_h[a:a + batch].float()
        t, top = rows.t[a:a + batch].long(), rows.top[a:a + batch].long()
        scores = scores_fn(tok, h) if scores_fn else router(h, weight[tok].float())
        for tv in t.unique().tolist():
            sel_rows = t == tv
            k = cluster_budget(tv, k_max, budget, num_clusters=m)
            picked = select_clusters(scores[sel_rows], k)                       # [n_t, M]
            pos = cluster_targets(top[sel_rows], layout.assign, m).bool()
            top_c = layout.assign[top[sel_rows]]                                # [n_t, L]
            in_sl = picked.gather(1, top_c)                                     # [n_t, L]
            vals = np.array([
                float(((picked & pos).sum(1) / pos.sum(1)).sum()),              # cluster recall
                float(in_sl.float().mean(1).sum()),                             # token recall
                float(in_sl[:, 0].float().sum()),                               # top-1 hit
                float((picked.long() * layout.sizes).sum(1).double().sum()),    # shortlist size
                float(sel_rows.sum())])
            sums[tv] = sums.get(tv, 0) + vals
    def summary(v):
        return {"cluster_recall": v[0] / v[4], "token_recall": v[1] / v[4], "top1_hit": v[2] / v[4],
                "mean_row_vocab": v[3] / v[4], "rows": int(v[4])}
    total = sum(sums.values())
    return {"overall": summary(total), "by_t": {str(t): summary(v) for t, v in sorted(sums.items())}}


def train_router(cfg: FitConfig, train: RouterRows, weight: torch.Tensor, assign: torch.Tensor,
                 work: Path, embed: torch.Tensor | None = None) -> tuple[Router, list[float]]:
    """AdamW on the BCE of §4.2; checkpoints `router.pt` atomically every 100 batches and at each epoch's
    end, and resumes from it (the shuffle of epoch e is seeded by (seed, e), so a resumed run sees the
    same batches). A checkpoint of other hyper-parameters (lr, batch size, weight decay, seed, epochs, width,
    or other rows) is refused with a DynaSpecError naming what changed."""
    d, m = weight.shape[1], int(assign.max()) + 1
    torch.manual_seed(cfg.seed)
    router = Router(d, m, cfg.router_width)
    opt = torch.optim.AdamW(router.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n = len(train)
    per_epoch = math.ceil(n / cfg.batch_size)
    total = per_epoch * cfg.epochs
    ckpt = work / "router.pt"
    hparams = {"lr": cfg.lr, "batch_size": cfg.batch_size, "weight_decay": cfg.weight_decay, "seed": cfg.seed,
               "epochs": cfg.epochs, "router_width": cfg.router_width, "train_rows": n, "num_clusters": m,
               "hidden_size": d}
    step, losses = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        saved = state.get("hparams")
        if saved != hparams:
            what = ("it records none (written before they were checked)" if saved is None else
                    ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in hparams.items() if saved.get(k) != v))
            raise DynaSpecError(f"{ckpt} is a router training with other hyper-parameters ({what}); resume it with "
                                f"its own settings, or delete it to train from scratch")
        router.load_state_dict(state["router"])
        opt.load_state_dict(state["opt"])
        step, losses = state["step"], list(state["losses"])
    emb = (weight if embed is None else embed).detach().float()            # E(x) by token id
    h_all, tok_all, top_all = train.parent_h, train.tokens.long(), train.top.long()
    bar = tqdm(total=total, initial=step, desc="train router", disable=not cfg.progress)
    router.train()
    perm_epoch, perm = -1, None
    while step < total:
        epoch, b = divmod(step, per_epoch)
        if epoch != perm_epoch:
            perm_epoch = epoch
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        idx = perm[b * cfg.batch_size:(b + 1) * cfg.batch_size]
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / total))
        for g in opt.param_groups:
            g["lr"] = lr
        scores = router(h_all[idx].float(), emb[tok_all[idx]])
        loss = router_loss(scores, cluster_targets(top_all[idx], assign, m))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.update(1)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", epoch=epoch)
        if step % 100 == 0 or step % per_epoch == 0 or step == total:
            save_torch({"router": router.state_dict(), "opt": opt.state_dict(), "step": step,
                        "losses": losses, "total": total, "hparams": hparams}, ckpt)
    bar.close()
    return router.eval(), losses


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
        raise DynaSpecError(f"drafter {cfg.drafter!r} has no LM head to restrict; use layerskip, eagle or eagle3")
    key_of_drafter = drafter.drafter_key()       # eagle/eagle3: the head's hash and the depth (a run checks both)
    weight, embed, _ = head_rows(drafter, model)  # [K, d] the rows clustered; [V, d] E(x) by target id
    del drafter
    out = Path(cfg.out).expanduser() if cfg.out else default_dynaspec_path(cfg.model, spec, key_of_drafter)
    work = Path(cfg.work_dir).expanduser() if cfg.work_dir else out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    key_file = work / "fit.json"
    key = cfg.data_key()
    if key_file.is_file() and json.loads(key_file.read_text()) != key:
        raise DynaSpecError(f"work dir {work} holds a fit with other settings ({key_file}); delete it or pass "
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
        raise DynaSpecError("no training rows were logged; raise --num-prompts")
    router, losses = train_router(cfg, train_rows, weight, assign, work, embed=embed)

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
