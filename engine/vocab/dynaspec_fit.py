"""Fitting DynaSpec's clusters and router (DynaSpec §4.2, App. A.2): what the fit and the sweep of its choices share.

Words as in `engine.vocab.dynaspec`'s docstring (which holds what a decode reads: the cluster layout, the budget,
the router's module, the fitted file). Here, below the jobs that run them:

- `spherical_kmeans`: the clusters, over the L2-normalised LM-head rows (§4.2 "Vocabulary partition").
- `RouterRows`, `RouterDataLogger`, `head_rows`: the router's training rows, logged from full-vocabulary
  drafting one shard per prompt (`load_rows`, `shard_prompt`), and the fit's split of them by prompt
  (`write_split`, `SPLIT_FILE`).
- `cluster_targets`, `router_loss`, `train_router` (`RouterTraining`: the optimiser's settings, resumable from
  a checkpoint): the BCE of §4.2.
- `router_metrics`: a router's held-out cluster recall, token recall and top-1 hit at a budget.

`engine.jobs.fit_dynaspec` runs one fit (clusters, logging, training, the fitted file);
`engine.jobs.dynaspec_choices` re-runs the clustering and the training at other M, router widths and L on a
fit's logged rows. Neither imports the other. Loaded by neither `engine.vocab` nor a decode.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from specvocab.engine.artifacts import atomic_write, save_torch
from specvocab.engine.vocab.dynaspec import ClusterLayout, DynaSpecError, Router, cluster_budget, select_clusters


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
        raise DynaSpecError(f"unknown k-means init {init!r} — choose 'k-means++', 'random' or a centroid tensor")
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
            raise DynaSpecError(f"{where} lacks {missing}: not a DynaSpec log shard — delete it and fit again")
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
            raise DynaSpecError("the drafter ran its head without routing the rows first — log with a drafter "
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


# --- the head a fit partitions ----------------------------------------------------------------------------

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


# --- the logged shards and the fit's split of them ---------------------------------------------------------

def shard_prompt(path: Path) -> str | None:
    """The prompt id a log shard was logged from (its safetensors metadata), or None."""
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("prompt_id")


SPLIT_FILE = "split.json"


def write_split(work: Path, train: list[Path], held: list[Path], fraction: float) -> None:
    """The fit's split of its logged prompts (`split.json` in the work dir), which `engine.jobs.dynaspec_choices` reuses."""
    split = {"heldout": fraction, "train_prompt_ids": [shard_prompt(s) for s in train],
             "heldout_prompt_ids": [shard_prompt(s) for s in held]}
    atomic_write(work / SPLIT_FILE, json.dumps(split, indent=1))


def load_rows(paths: list[Path]) -> RouterRows | None:
    """The rows of log shards, concatenated in order (None for no shards)."""
    parts = [RouterRows.from_tensors(load_file(str(p)), str(p)) for p in paths]
    return RouterRows.cat(parts) if parts else None


# --- a router's held-out quality (§4.2) --------------------------------------------------------------------

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


# --- training the router (§4.2) -----------------------------------------------------------------------------

@dataclass(frozen=True)
class RouterTraining:
    """How `train_router` trains a router. The paper states neither the router's width nor the optimiser
    (§4.2, App. A.2); each default says why it was chosen."""

    router_width: int = 512                 # not stated ("lightweight MLP"); 512 keeps the router below a
                                            # 2k-token shortlist head at d = 576 (see `Router`)
    epochs: int = 12
    batch_size: int = 256
    lr: float = 1e-3                        # AdamW, cosine decay to 0 (not stated in the paper)
    weight_decay: float = 0.01
    seed: int = 0
    progress: bool = True


def train_router(cfg: RouterTraining, train: RouterRows, weight: torch.Tensor, assign: torch.Tensor,
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
            raise DynaSpecError(f"{ckpt} is a router training with other hyper-parameters ({what}) — resume it with "
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

