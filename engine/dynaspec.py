"""DynaSpec (Zhang et al., 2025): a context-aware draft vocabulary of token clusters picked by a router.

Words as in the glossary (`locality.__doc__`). Offline, the LM-head rows are split into M clusters; at each
draft step a small router scores the clusters from the drafter's input, the top-k_c(t) clusters of a row
are its shortlist, and the drafter's LM head scores only shortlisted tokens. Verification is unchanged
(full vocabulary), so decoding stays lossless whatever the router picks.

- Clusters (§4.2 "Vocabulary partition"): `spherical_kmeans` over the L2-normalised LM-head rows W[v] /
  ||W[v]|| (PyTorch's `weight [V, d]`: a row per token is the paper's column of W_LM in R^{d x |V|});
  unbalanced - |C_m| may vary - with k-means++ or random initialisation, a fixed seed, and empty clusters
  re-seeded with the tokens their centroid serves worst.
- Router (§4.2 "Low-cost router", App. A.2): `Router`, an MLP from [h; E(x)] to M cluster scores, where x
  is the token whose children the drafter scores next and h the drafter hidden state that proposed x
  (the paper's r_theta(E(x_t), H~_{t-1})). Both are known *before* the backbone runs x, which is what lets
  the router run on its own CUDA stream beside the backbone (§4.3, Alg. 1 l.3/l.8). At the root (t = 0)
  there is no such state common to every drafter - EAGLE's is the target's feature (Alg. 1 l.3),
  layerskip's was computed in the previous step or not at all - so the root row uses [h_root; E(root)],
  h_root being the drafter's own state at the root; the router is trained on the same two kinds of rows.
  E(x) is the token's row of the LM head: the input embedding itself for tied models (SmolLM2, Gemma 3),
  the output embedding otherwise (a choice: every policy sees only the head; the router normalises each
  half of its input, so the embedding scale does not matter).
- Training (§4.2 "Training the router", App. A.2): rows logged from full-vocabulary drafting on a training
  corpus; target y_m = 1 iff cluster m holds one of the drafter's top-L tokens at that row; BCE summed over
  all M clusters, mean over rows.
- Budget (§4.2 "Position-aware cluster selection", Alg. 1 l.7): `cluster_budget`. With t = 0 the first
  drafted token (the root's children), k_c(t) = k_max for t in {0, 1} and floor(k_max / ((t + 1) * 2))
  for t >= 2 (DynaSpec-PA), clamped to [k_min, M] (the paper names k_min but never sets it: default 1);
  DynaSpec-F (Fig. 2) keeps k_max at every t. Alg. 1 l.7 writes `k_max / ((i + 1) * 2)` with an undefined
  `i` and no floor; we read i = t and take the floor of §4.2.
- Head (§4.3, Alg. 1 l.11): the k rows of a tree level may each have their own shortlist; the head runs
  ONCE over the union of the level's shortlists and each row is masked to its own before the softmax
  (`union_shortlist` + `shortlist_logits`): the same proposals as separate per-row heads
  (`per_row_reference_logits`, the plain reference) while reading every union row of W once. Both sizes
  are reported: the mean per-row shortlist (the paper's "vocab size", Table 1) and the union the head read.

Where the paper is silent the defaults below are choices, each said where it is set (`FitConfig`,
`engine.config.SpecConfig`'s dynaspec_* fields). `python -m engine.dynaspec fit --model M` fits clusters and
router for one model and drafter and writes a `.safetensors` file with a JSON sidecar; `vocab="dynaspec"`
(`engine.vocab.DynaSpecVocab`) loads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from engine.artifacts import (FINGERPRINT_KEY, atomic_write, fingerprint_matches, head_fingerprint, save_safetensors,
                              save_torch, sidecar_path, stored_fingerprint)
from engine.config import ConfigError, SpecConfig, parse_overrides
from engine.models import cache_root, load_model
from engine.prompts import PromptError, encode_prompt, load_prompts
from kernels.head import indexed_head

FORMAT = 1                                   # version of the saved file layout


class DynaSpecError(ValueError):
    """A DynaSpec cannot be fitted, loaded or used as asked; the message names the problem and the fix."""


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


# --- clusters as a CSR layout -----------------------------------------------------------------------------

@dataclass
class ClusterLayout:
    """The partition tau: V -> [M] (§4.2) laid out for gathers: token ids sorted by cluster."""

    assign: torch.Tensor          # [V] long, cluster of each token
    order: torch.Tensor           # [V] long, token ids sorted by cluster (ascending id within a cluster)
    order_cluster: torch.Tensor   # [V] long, cluster of each entry of `order` (non-decreasing)
    sizes: torch.Tensor           # [M] long, |C_m|
    offsets: torch.Tensor         # [M + 1] long, cluster m = order[offsets[m]:offsets[m + 1]]

    @property
    def num_clusters(self) -> int:
        return self.sizes.numel()

    @classmethod
    def from_assign(cls, assign: torch.Tensor, num_clusters: int) -> "ClusterLayout":
        assign = assign.long()
        if assign.numel() and (int(assign.min()) < 0 or int(assign.max()) >= num_clusters):
            raise DynaSpecError(f"cluster ids must be in [0, {num_clusters}); got {int(assign.min())}.."
                                f"{int(assign.max())}")
        order = torch.sort(assign, stable=True).indices
        sizes = torch.bincount(assign, minlength=num_clusters)
        offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        return cls(assign=assign, order=order, order_cluster=assign[order], sizes=sizes, offsets=offsets)

    def to(self, device) -> "ClusterLayout":
        return ClusterLayout(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


# --- the position-aware budget (§4.2, Alg. 1 l.7) ----------------------------------------------------------

BUDGETS = ("position", "fixed")


def cluster_budget(t: int, k_max: int, budget: str = "position", *, k_min: int = 1,
                   num_clusters: int | None = None) -> int:
    """Clusters a row may pick at draft step t (t = 0: the root's children).

    "position" (DynaSpec-PA, §4.2): k_max for t in {0, 1}, floor(k_max / ((t + 1) * 2)) for t >= 2.
    "fixed" (DynaSpec-F, Fig. 2): k_max at every t. Clamped to [k_min, num_clusters]."""
    if budget not in BUDGETS:
        raise DynaSpecError(f"unknown budget {budget!r}; choose 'position' (DynaSpec-PA) or 'fixed' (DynaSpec-F)")
    if t < 0 or k_max < 1 or k_min < 1:
        raise DynaSpecError(f"need t >= 0, k_max >= 1 and k_min >= 1, got t={t}, k_max={k_max}, k_min={k_min}")
    k = k_max if budget == "fixed" or t < 2 else k_max // ((t + 1) * 2)
    k = max(k_min, k)
    return min(k, num_clusters) if num_clusters is not None else k


# --- router (§4.2, App. A.2) ------------------------------------------------------------------------------

class Router(nn.Module):
    """r_theta: [h; E(x)] -> M cluster scores (logits of sigma(s_m), §4.2).

    The paper says only "a lightweight MLP". Ours: RMSNorm on each half (the hidden state and the
    embedding differ in scale, e.g. Gemma's embedding is scaled by sqrt(d)), Linear(2d, width), SiLU,
    Linear(width, M). At d = 576, width 512, M = 1024 that is 1.1M multiply-adds per row, about as many as
    a shortlist head over 2,000 tokens."""

    def __init__(self, hidden_size: int, num_clusters: int, width: int):
        super().__init__()
        if min(hidden_size, num_clusters, width) < 1:
            raise DynaSpecError(f"router sizes must be >= 1, got d={hidden_size}, M={num_clusters}, width={width}")
        self.hidden_size, self.num_clusters, self.width = hidden_size, num_clusters, width
        self.norm_h = nn.RMSNorm(hidden_size)
        self.norm_e = nn.RMSNorm(hidden_size)
        self.fc1 = nn.Linear(2 * hidden_size, width)
        self.fc2 = nn.Linear(width, num_clusters)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """h [r, d], emb [r, d] -> scores [r, M] fp32."""
        x = torch.cat([self.norm_h(h.float()), self.norm_e(emb.float())], dim=-1)   # [r, 2d]
        return self.fc2(F.silu(self.fc1(x)))


def cluster_targets(top_ids: torch.Tensor, assign: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """top_ids [n, L] (the full-vocabulary drafter's top-L tokens per row) -> multi-hot [n, M] fp32:
    y_m = 1 iff cluster m holds one of them (§4.2)."""
    y = torch.zeros(top_ids.shape[0], num_clusters, device=top_ids.device)
    return y.scatter_(1, assign[top_ids.long()], 1.0)


def router_loss(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """BCE over all M clusters (§4.2): summed over clusters, mean over rows."""
    return F.binary_cross_entropy_with_logits(scores, targets, reduction="none").sum(1).mean()


def select_clusters(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [r, M] -> [r, M] bool, each row's top-k clusters (TopK_{k_c(t)}(s), §4.2)."""
    k = min(k, scores.shape[1])
    top = scores.topk(k, dim=1).indices                                        # [r, k]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)


# --- option B: one head over the union, each row masked to its own shortlist --------------------------------

def union_shortlist(cluster_mask: torch.Tensor, layout: ClusterLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """cluster_mask [r, M] bool -> (idx [u] token ids of the union of the rows' shortlists, in cluster
    order; row_ok [r, u] bool, slot j is in row i's own shortlist).

    Host sync: u depends on the router's choice, and the gathered head needs its size (the paper's fused
    kernel takes the index list I likewise, Alg. 1 l.3)."""
    union = cluster_mask.any(dim=0)                                            # [M]
    idx = layout.order[union[layout.order_cluster]]                           # [u]
    row_ok = cluster_mask[:, layout.assign[idx]]                              # [r, u]
    return idx, row_ok


def shortlist_logits(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, row_ok: torch.Tensor) -> torch.Tensor:
    """h [r, d] -> logits [r, u] fp32 over the union rows weight[idx]; -inf outside a row's own shortlist."""
    return indexed_head(h.to(weight.dtype), weight, idx).masked_fill(~row_ok, float("-inf"))


def per_row_reference_logits(h: torch.Tensor, weight: torch.Tensor, assign: torch.Tensor,
                             cluster_mask: torch.Tensor) -> torch.Tensor:
    """The plain reference of option B: for each row separately, its logits over the whole vocabulary
    with every token outside its own clusters at -inf. [r, V] fp32."""
    logits = h.float() @ weight.float().T                                     # [r, V]
    return logits.masked_fill(~cluster_mask[:, assign.long()], float("-inf"))


# --- a fitted DynaSpec: clusters + router, saved as safetensors + JSON sidecar ------------------------------

@dataclass
class FittedDynaSpec:
    assign: torch.Tensor          # [V] long
    router: Router
    meta: dict                    # the JSON sidecar (model, sizes, training data, held-out recall, ...)

    @property
    def num_clusters(self) -> int:
        return self.router.num_clusters

    @property
    def vocab_size(self) -> int:
        return self.assign.numel()


def save_dynaspec(fitted: FittedDynaSpec, path: str | Path) -> Path:
    """Write `path` (safetensors: `assign` and `router.*`) and `path.json` (the sidecar) atomically
    (`engine.artifacts.atomic_write`); a fit id in both tells a matching pair from a torn one."""
    path = Path(path)
    missing = [k for k in ("model", FINGERPRINT_KEY) if k not in fitted.meta]
    if missing:
        raise DynaSpecError(f"a DynaSpec needs meta {missing} to be saved (the model's name and "
                            f"head_fingerprint(weight)), so that loading it for another model fails clearly")
    path.parent.mkdir(parents=True, exist_ok=True)
    fit_id = uuid.uuid4().hex
    meta = {**fitted.meta, "format": FORMAT, "method": "dynaspec", "fit_id": fit_id,
            "vocab_size": fitted.vocab_size, "hidden_size": fitted.router.hidden_size,
            "num_clusters": fitted.num_clusters, "router_width": fitted.router.width}
    tensors = {"assign": fitted.assign.to("cpu", torch.int32).contiguous()}
    tensors.update({f"router.{k}": v.detach().to("cpu", torch.float32).contiguous()
                    for k, v in fitted.router.state_dict().items()})
    save_safetensors(tensors, path, metadata={"fit_id": fit_id, "format": str(FORMAT)}, sidecar=meta)
    fitted.meta = meta
    return path


def read_sidecar(path: str | Path) -> dict:
    side = sidecar_path(path)
    try:
        meta = json.loads(side.read_text())
    except FileNotFoundError:
        raise DynaSpecError(f"{side} is missing: a fitted DynaSpec is `{Path(path).name}` plus its JSON sidecar "
                            f"`{side.name}`; fit again with `python -m engine.dynaspec fit`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DynaSpecError(f"{side} is not valid JSON ({e}); fit again with `python -m engine.dynaspec fit`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("method") != "dynaspec":
        raise DynaSpecError(f"{side} is not a DynaSpec sidecar of format {FORMAT}; fit again with "
                            f"`python -m engine.dynaspec fit`")
    return meta


def check_head(meta: dict, weight: torch.Tensor, where: str = "this DynaSpec",
               fingerprint: list[float] | None = None) -> None:
    """Raise unless `meta` was fitted for LM head `weight [V, d]` (shape, and `engine.artifacts.fingerprint_matches`
    on its fingerprint, which may be passed in when several files are checked against one head)."""
    model = meta.get("model", "?")
    fix = "fit one for this model with `python -m engine.dynaspec fit --model <name>`"
    if (meta["vocab_size"], meta["hidden_size"]) != tuple(weight.shape):
        raise DynaSpecError(f"{where} was fitted for model {model!r} with vocabulary {meta['vocab_size']} and hidden "
                            f"size {meta['hidden_size']}, but this LM head is {weight.shape[0]} x {weight.shape[1]}; "
                            f"{fix}")
    if not fingerprint_matches(stored_fingerprint(meta), weight, fingerprint):
        raise DynaSpecError(f"{where} was fitted for model {model!r}, whose LM head has the same shape as this one "
                            f"but other weights (row-norm fingerprint differs); {fix}")


def load_dynaspec(path: str | Path, weight: torch.Tensor | None = None) -> FittedDynaSpec:
    """A fitted DynaSpec from `path` (+ `path.json`); with `weight`, checked against that LM head."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DynaSpecError(f"fitted DynaSpec {path} does not exist; fit one with `python -m engine.dynaspec fit "
                            f"--model <name>` (it is written under {cache_root() / 'dynaspec'})")
    meta = read_sidecar(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            file_id = (f.metadata() or {}).get("fit_id")
        tensors = load_file(str(path))
    except Exception as e:   # safetensors raises several error types for a damaged file
        raise DynaSpecError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); fit again") from e
    if file_id != meta.get("fit_id"):
        raise DynaSpecError(f"{path} and its sidecar {sidecar_path(path).name} come from different fits; fit again")
    if weight is not None:
        check_head(meta, weight, where=str(path))
    router = Router(meta["hidden_size"], meta["num_clusters"], meta["router_width"])
    state = {k[len("router."):]: v for k, v in tensors.items() if k.startswith("router.")}
    try:
        router.load_state_dict(state)
    except RuntimeError as e:
        raise DynaSpecError(f"{path}: router tensors do not match the sidecar's sizes ({e}); fit again") from None
    assign = tensors["assign"].long()
    if assign.numel() != meta["vocab_size"]:
        raise DynaSpecError(f"{path}: {assign.numel()} cluster ids for a vocabulary of {meta['vocab_size']}; fit again")
    return FittedDynaSpec(assign=assign, router=router.eval(), meta=meta)


def drafter_key(cfg: SpecConfig) -> dict:
    """What identifies the drafter whose hidden states a router was trained on."""
    if cfg.method == "layerskip":
        return {"drafter": "layerskip", "drafter_layers": cfg.drafter_layers}
    if cfg.method == "eagle":
        return {"drafter": "eagle", "eagle_head": cfg.eagle_head}
    return {"drafter": cfg.method}


def default_dynaspec_path(model: str, cfg: SpecConfig) -> Path:
    """Where `fit` writes by default: <specvocab cache>/dynaspec/<model>-<drafter>-<digest>.safetensors."""
    key = drafter_key(cfg)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
    return cache_root() / "dynaspec" / f"{safe}-{key['drafter']}-{digest}.safetensors"


SHIPPED_FITS = Path(__file__).resolve().parent / "heads"    # engine/heads/<model>/dynaspec-*.safetensors


def find_fitted(weight: torch.Tensor, cfg: SpecConfig, folder: str | Path | None = None) -> Path:
    """The newest fitted DynaSpec in `folder` (default: the cache's dynaspec/, then the fits shipped beside
    the trained EAGLE heads in engine/heads/<model>/) made for this LM head and this drafter (`drafter_key`);
    a clear error when there is none."""
    folders = [Path(folder)] if folder is not None else [cache_root() / "dynaspec",
                                                         *sorted(SHIPPED_FITS.glob("*/"))]
    key = drafter_key(cfg)
    fingerprint = head_fingerprint(weight)
    found = []
    sides = [side for f in folders if f.is_dir() for side in sorted(f.glob("*.safetensors.json"))]
    folder = folders[0]
    for side in sides:
        path = side.with_name(side.name[: -len(".json")])
        try:
            meta = read_sidecar(path)
            check_head(meta, weight, fingerprint=fingerprint)
        except (DynaSpecError, KeyError):
            continue
        if all(meta.get("drafter_config", {}).get(k) == v for k, v in key.items()) and path.is_file():
            found.append((meta.get("created", 0), path.name, path))
    if not found:
        raise DynaSpecError(f"vocab='dynaspec' needs a fitted DynaSpec for this model and drafter {key}, and none is "
                            f"in {folder}; fit one with `python -m engine.dynaspec fit --model <name> --drafter "
                            f"{key['drafter']}` or pass dynaspec_file=<path>")
    return max(found)[2]


# --- sizing in tokens (what `engine.jobs.bench`'s `dynaspec:N` means) ---------------------------------------------
# The paper's budget knob is k_max, a number of *clusters* (§4.2); a vocabulary sweep is read in *tokens*
# (frspec:K keeps K tokens, microspec:W a window of W). A token budget N maps to the k_max whose clusters
# hold N tokens when each has the mean size V / M: the shortlist of a row at draft steps 0-1 then holds
# about N tokens (exactly N only if the router picked clusters of mean size; the measured per-row size is
# the bench's `mean_active_vocab`), and fewer at later steps under the position-aware budget.

def fitted_sizes(path: str | Path) -> tuple[int, int]:
    """(M clusters, V vocabulary) of a fitted DynaSpec, read from its sidecar (no tensors loaded)."""
    meta = read_sidecar(path)
    return int(meta["num_clusters"]), int(meta["vocab_size"])


def k_max_for_tokens(tokens: int, num_clusters: int, vocab_size: int) -> int:
    """k_max for a token budget at draft steps 0-1: round(tokens * M / V) clusters of the mean size V / M,
    at least 1 and at most M. `tokens` must be in [1, V]."""
    if isinstance(tokens, bool) or not 1 <= int(tokens) <= vocab_size:
        raise DynaSpecError(f"a DynaSpec token budget must be in [1, V={vocab_size}], got {tokens!r}")
    return min(num_clusters, max(1, round(int(tokens) * num_clusters / vocab_size)))


def tokens_for_k_max(k_max: int, num_clusters: int, vocab_size: int) -> int:
    """The token budget k_max clusters stand for: round(min(k_max, M) * V / M) (the inverse of
    `k_max_for_tokens` up to rounding)."""
    return round(min(int(k_max), num_clusters) * vocab_size / num_clusters)


# --- the runtime: router on its own stream, option-B head, sizes ---------------------------------------------

class DynaSpecHead:
    """What `engine.vocab.DynaSpecVocab` runs per draft step.

    `route(tokens [r], parent_h [r, d], t)` - called by the drafter before its backbone runs the rows -
    scores the clusters and picks each row's top-k_c(t); on CUDA it runs on a side stream, overlapping the
    backbone (§4.3). `logits(h [r, d])` waits for it, builds the union and runs the masked head once.
    Sizes are accumulated on the device: per row |V_S,r| and per head call |union|."""

    def __init__(self, fitted: FittedDynaSpec, weight: torch.Tensor, *, k_max: int, budget: str = "position",
                 k_min: int = 1):
        if fitted.vocab_size != weight.shape[0] or fitted.router.hidden_size != weight.shape[1]:
            raise DynaSpecError(f"this DynaSpec is for V={fitted.vocab_size}, d={fitted.router.hidden_size}, but the "
                                f"LM head is {weight.shape[0]} x {weight.shape[1]}; fit one for this model")
        cluster_budget(0, k_max, budget, k_min=k_min)                             # validates the arguments
        self.weight = weight                                                      # [V, d]
        self.device = weight.device
        self.k_max, self.budget, self.k_min = k_max, budget, k_min
        self.router = fitted.router.to(self.device).eval()
        self.layout = ClusterLayout.from_assign(fitted.assign, fitted.num_clusters).to(self.device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: torch.Tensor | None = None                                # [r, M] bool
        self.reset()

    def reset(self) -> None:
        dev = self.device
        self._row_sum = torch.zeros((), dtype=torch.float64, device=dev)          # sum over rows of |V_S,r|
        self._rows = 0
        self._union_sum, self._calls, self._union_max = 0, 0, 0                   # host ints (u is on the host)
        self.new_step()

    def new_step(self) -> None:
        self._step_row_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._step_rows = 0
        self.step_mask = torch.zeros(self.weight.shape[0], dtype=torch.bool, device=self.device)   # [V]

    def _select(self, tokens: torch.Tensor, parent_h: torch.Tensor, k: int) -> torch.Tensor:
        emb = self.weight[tokens.long()]                                          # [r, d] E(x): LM-head rows
        return select_clusters(self.router(parent_h, emb), k)                    # [r, M]

    @torch.no_grad()
    def route(self, tokens: torch.Tensor, parent_h: torch.Tensor, t: int) -> None:
        if t == 0:
            self.new_step()
        tokens = tokens.reshape(-1).to(self.device)
        if parent_h.shape != (tokens.numel(), self.weight.shape[1]):
            raise DynaSpecError(f"route needs parent_h [{tokens.numel()}, {self.weight.shape[1]}] for "
                                f"{tokens.numel()} tokens, got {tuple(parent_h.shape)}")
        k = cluster_budget(t, self.k_max, self.budget, k_min=self.k_min, num_clusters=self.layout.num_clusters)
        if self.stream is None:
            self._pending = self._select(tokens, parent_h, k)
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)                  # the inputs were written on the main stream
        with torch.cuda.stream(self.stream):
            mask = self._select(tokens, parent_h, k)
        tokens.record_stream(self.stream)              # keep the inputs alive until the side stream is done
        parent_h.record_stream(self.stream)
        mask.record_stream(main)                       # used on the main stream by `logits`
        self._pending = mask

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [r, d] -> (logits [r, u] fp32, slot_to_token = idx [u])."""
        mask = self._pending
        if mask is None or mask.shape[0] != h.shape[0]:
            got = None if mask is None else mask.shape[0]
            raise DynaSpecError(f"the DynaSpec head got {h.shape[0]} rows but the router last routed {got}: the "
                                f"drafter must call policy.route(tokens, parent_h, t) before every head call "
                                f"(LMHeadDrafter does)")
        self._pending = None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        idx, row_ok = union_shortlist(mask, self.layout)
        logits = shortlist_logits(h, self.weight, idx, row_ok)
        row_sizes = (mask.long() * self.layout.sizes).sum(1)                    # [r] |V_S,r|
        self._row_sum += row_sizes.sum()
        self._step_row_sum += row_sizes.sum()
        self._rows += mask.shape[0]
        self._step_rows += mask.shape[0]
        u = idx.numel()
        self._union_sum, self._calls, self._union_max = self._union_sum + u, self._calls + 1, max(self._union_max, u)
        self.step_mask[idx] = True
        return logits, idx

    def step_row_mean(self) -> torch.Tensor:
        """Mean |V_S,r| over this step's rows (0-d, on the device)."""
        return self._step_row_sum / max(self._step_rows, 1)

    def stats(self) -> dict[str, float]:
        out = {"num_clusters": float(self.layout.num_clusters), "k_max": float(self.k_max)}
        if self._rows:
            out["mean_row_vocab"] = float(self._row_sum) / self._rows
        if self._calls:
            out.update(mean_union_vocab=self._union_sum / self._calls, max_union_vocab=float(self._union_max))
        return out


# --- logging router training rows from full-vocabulary drafting (App. A.2) -----------------------------------

class RouterDataLogger:
    """Stands in for a drafter's full-vocabulary policy and records, per head call, the router's input rows
    (token x and hidden state h from `route`) and the full head's top-L tokens at those rows."""

    def __init__(self, inner, top_l: int):
        self.inner, self.top_l = inner, top_l
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending = None

    def __getattr__(self, name):                 # begin, observe, record_step, stats, ...: the inner policy
        return getattr(self.inner, name)

    def route(self, tokens, parent_h, t):
        # to the host at once: an offline logging run, where a sync per level costs nothing that matters
        self._pending = (tokens.reshape(-1).to("cpu", torch.int32), parent_h.to("cpu", torch.float16), t)

    def head_topk(self, h, k):
        logp, ids = self.inner.head_topk(h, max(k, self.top_l))                 # [r, K] sorted, best first
        if self._pending is None or self._pending[0].numel() != h.shape[0]:
            raise DynaSpecError("the drafter ran its head without routing the rows first; log with a drafter "
                                "built on LMHeadDrafter (layerskip, eagle)")
        tokens, parent_h, t = self._pending
        self._pending = None
        self.rows.append((tokens, parent_h, torch.full_like(tokens, t, dtype=torch.int8),
                          ids[:, : self.top_l].to("cpu", torch.int32)))
        return logp[:, :k], ids[:, :k]

    def take(self) -> dict[str, torch.Tensor]:
        rows, self.rows = self.rows, []
        if not rows:
            return {}
        tok, h, t, top = (torch.cat(c) for c in zip(*rows))
        return {"tokens": tok, "parent_h": h, "t": t, "top": top}


# --- fitting ---------------------------------------------------------------------------------------------------

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
    # late imports (allow-listed in tests/test_layering.py): fitting runs the harness and the drafters, which
    # (through the registry) run engine.vocab, which imports this module for the policy side. At the top,
    # importing the policies would load the harness and the registry; fitting moves to engine/jobs with #17
    from engine.drafters import make_drafter
    from engine.harness import generate, resolve_config

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
        if any(_shard_prompt(s) == p.prompt_id for s in shards):
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
                raise DynaSpecError(f"drafter {cfg.drafter!r} has no LM head to restrict; use layerskip or eagle")
            logger = RouterDataLogger(drafter.policy, cfg.top_l)
            drafter.policy = logger
        logger.rows = []
        res = generate(model, ids, spec, drafter=drafter, tokenizer=tokenizer, info=info)
        rows = logger.take()
        if not rows:
            continue
        save_safetensors(rows, shard, metadata={"prompt_id": str(p.prompt_id), "tau": f"{res.tau:.4f}",
                                                "tokens": str(res.new_tokens)})
        shards.append(shard)
        bar.update(1)
        bar.set_postfix(rows=int(rows["tokens"].numel()), tau=f"{res.tau:.2f}", skipped=skipped)
    bar.close()
    if not shards:
        raise DynaSpecError(f"no prompt of {cfg.prompts!r} could be logged (all longer than max_prompt_tokens="
                            f"{cfg.max_prompt_tokens}?); raise --max-prompt-tokens or use another corpus")
    return shards


def _shard_prompt(path: Path) -> str | None:
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("prompt_id")


def _load_rows(paths: list[Path]) -> dict[str, torch.Tensor]:
    parts = [load_file(str(p)) for p in paths]
    if not parts:
        return {}
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@torch.no_grad()
def router_metrics(router: Router, rows: dict[str, torch.Tensor], weight: torch.Tensor, layout: ClusterLayout,
                   k_max: int, budget: str = "position", scores_fn=None, batch: int = 4096) -> dict:
    """Held-out quality of a router at the budget k_c(t) of each row (§4.2), overall and per draft step t:
    cluster recall (positives among the picked clusters / positives), token recall (top-L tokens inside the
    shortlist), top-1 hit (the full drafter's argmax inside the shortlist) and the mean shortlist size.
    `scores_fn(tokens, h) -> [n, M]` replaces the router (e.g. a static baseline)."""
    m = layout.num_clusters
    sums: dict[int, np.ndarray] = {}
    n_rows = rows["tokens"].numel()
    for a in range(0, n_rows, batch):
        tok, h = rows["tokens"][a:a + batch].long(), rows["parent_h"][a:a + batch].float()
        t, top = rows["t"][a:a + batch].long(), rows["top"][a:a + batch].long()
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


def train_router(cfg: FitConfig, train: dict[str, torch.Tensor], weight: torch.Tensor, assign: torch.Tensor,
                 work: Path) -> tuple[Router, list[float]]:
    """AdamW on the BCE of §4.2; checkpoints `router.pt` atomically every 100 batches and at each epoch's
    end, and resumes from it (the shuffle of epoch e is seeded by (seed, e), so a resumed run sees the
    same batches)."""
    d, m = weight.shape[1], int(assign.max()) + 1
    torch.manual_seed(cfg.seed)
    router = Router(d, m, cfg.router_width)
    opt = torch.optim.AdamW(router.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n = train["tokens"].numel()
    per_epoch = math.ceil(n / cfg.batch_size)
    total = per_epoch * cfg.epochs
    ckpt = work / "router.pt"
    step, losses = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if state.get("total") == total and state.get("width") == cfg.router_width:
            router.load_state_dict(state["router"])
            opt.load_state_dict(state["opt"])
            step, losses = state["step"], list(state["losses"])
    emb = weight.detach().float()
    h_all, tok_all, top_all = train["parent_h"], train["tokens"].long(), train["top"].long()
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
                        "losses": losses, "total": total, "width": cfg.router_width}, ckpt)
    bar.close()
    return router.eval(), losses


def fit(cfg: FitConfig) -> Path:
    """Clusters, logged rows, router; writes the fitted DynaSpec and returns its path. Resumable: the work
    dir keeps the clusters, one log shard per prompt and the router checkpoint."""
    from engine.harness import resolve_config   # late: see log_rows (the harness sits above engine.vocab)

    t_start = time.perf_counter()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, tokenizer, info = load_model(cfg.model)
    # resolved as a run resolves it, so the key names the drafter a run will use (eagle: the shipped head)
    spec = resolve_config(cfg.spec_config(), model=model)
    out = Path(cfg.out).expanduser() if cfg.out else default_dynaspec_path(cfg.model, spec)
    work = Path(cfg.work_dir).expanduser() if cfg.work_dir else out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    key_file = work / "fit.json"
    key = cfg.data_key()
    if key_file.is_file() and json.loads(key_file.read_text()) != key:
        raise DynaSpecError(f"work dir {work} holds a fit with other settings ({key_file}); delete it or pass "
                            f"another --work-dir")
    key_file.write_text(json.dumps(key, indent=1, sort_keys=True))

    weight = model.get_output_embeddings().weight.detach()                    # [V, d]
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
    train_rows, held_rows = _load_rows(shards[: len(shards) - n_held]), _load_rows(shards[len(shards) - n_held:])
    if not train_rows:
        raise DynaSpecError("no training rows were logged; raise --num-prompts")
    router, losses = train_router(cfg, train_rows, weight, assign, work)

    layout = ClusterLayout.from_assign(assign, cfg.num_clusters)
    metrics = {}
    if held_rows:
        counts = cluster_targets(train_rows["top"].long(), assign, cfg.num_clusters).sum(0)   # label frequency
        static = lambda tok, h: counts.expand(tok.numel(), -1)                                 # noqa: E731
        metrics = {"router": router_metrics(router, held_rows, weight.float(), layout, cfg.k_max),
                   "static_baseline": router_metrics(router, held_rows, weight.float(), layout, cfg.k_max,
                                                     scores_fn=static),
                   "router_fixed_budget": router_metrics(router, held_rows, weight.float(), layout, cfg.k_max,
                                                         budget="fixed")}
    fit_s = time.perf_counter() - t_start
    meta = {"model": cfg.model, "drafter_config": drafter_key(spec), "created": time.time(),
            FINGERPRINT_KEY: head_fingerprint(weight), "top_l": cfg.top_l, "kmeans": {
                "iters": cfg.kmeans_iters, "init": cfg.kmeans_init, "init_sample": cfg.kmeans_init_sample,
                "seed": cfg.seed, **km_info},
            "training": {"prompts": cfg.prompts, "prompt_ids": [_shard_prompt(s) for s in shards],
                         "heldout_prompts": n_held, "max_new_tokens": cfg.max_new_tokens,
                         "train_rows": int(train_rows["tokens"].numel()),
                         "heldout_rows": int(held_rows["tokens"].numel()) if held_rows else 0,
                         "epochs": cfg.epochs, "batch_size": cfg.batch_size, "lr": cfg.lr,
                         "weight_decay": cfg.weight_decay, "final_loss": float(np.mean(losses[-20:]))},
            "heldout": metrics, "eval_k_max": cfg.k_max, "fit_seconds": fit_s}
    path = save_dynaspec(FittedDynaSpec(assign=assign, router=router, meta=meta), out)
    print(f"[dynaspec] fitted in {fit_s:.0f} s -> {path} (logged rows, clusters, router checkpoint: {work}; "
          f"`python -m engine.dynaspec choices --work-dir {work} --out DIR` sweeps M, router width and L on them)")
    if metrics:
        for name, res in metrics.items():
            o = res["overall"]
            print(f"[dynaspec] held-out {name} (k_max={cfg.k_max}): cluster recall {o['cluster_recall']:.3f}, token "
                  f"recall {o['token_recall']:.3f}, top-1 hit {o['top1_hit']:.3f}, mean row shortlist "
                  f"{o['mean_row_vocab']:.0f} of {weight.shape[0]} ({o['rows']} rows)")
    return path


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
    heldout: float = 0.125                              # as the fit split its prompts
    epochs: int = 12
    threads: int | None = 1
    progress: bool = True


def choice_settings(cfg: ChoicesConfig, base: dict) -> list[tuple[int, int, int]]:
    """(M, width, L) triples: the centre (the fit's M and L, FitConfig's router width), then each factor varied
    with the others at the centre."""
    m0, w0, l0 = base["num_clusters"], base.get("router_width", FitConfig.router_width), base["top_l"]
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
            raise DynaSpecError(f"top_l={el} is more than the {base['top_l']} tokens per row the fit logged; "
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


def sweep_choices(cfg: ChoicesConfig) -> Path:
    """Run the sweep (resumable: a setting whose Parquet file exists is skipped) and return the out folder;
    `pl.scan_parquet(out / "*.parquet")` reads it."""
    work = Path(cfg.work_dir).expanduser()
    key_file = work / "fit.json"
    shards = sorted(work.glob("log-*.safetensors"))
    if not key_file.is_file() or not shards:
        raise DynaSpecError(f"{work} is not a DynaSpec fit's work dir (it needs fit.json and log-*.safetensors); "
                            f"run `python -m engine.dynaspec fit --model M --work-dir {work}` first")
    base = json.loads(key_file.read_text())
    settings = choice_settings(cfg, base)
    if len(shards) < 2:
        raise DynaSpecError(f"{work} holds {len(shards)} logged prompt; the sweep needs 2 or more (train + held out)")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, _, _ = load_model(base["model"])
    weight = model.get_output_embeddings().weight.detach()
    vocab = weight.shape[0]
    budgets = [b for b in cfg.budget_tokens if 1 <= b <= vocab]
    if not budgets:
        raise DynaSpecError(f"no budget in {cfg.budget_tokens} is within [1, V={vocab}]")
    n_held = max(1, round(cfg.heldout * len(shards)))
    train_rows, held_rows = _load_rows(shards[: len(shards) - n_held]), _load_rows(shards[len(shards) - n_held:])
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    wf = weight.float()
    for m, w, el in tqdm(settings, desc="dynaspec choices", disable=not cfg.progress):
        path = out / f"M={m}_width={w}_L={el}.parquet"
        if path.is_file():
            continue
        assign, km_s = _choice_clusters(work, base, weight, m)
        fit_cfg = FitConfig(model=base["model"], num_clusters=m, router_width=w, top_l=el, epochs=cfg.epochs,
                            seed=base["seed"], progress=cfg.progress)
        sub = work / "choices" / f"M{m}-w{w}-L{el}"
        sub.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        router, losses = train_router(fit_cfg, {**train_rows, "top": train_rows["top"][:, :el]}, weight, assign, sub)
        train_s = time.perf_counter() - t0
        layout = ClusterLayout.from_assign(assign, m)
        counts = cluster_targets(train_rows["top"][:, :el].long(), assign, m).sum(0)
        static = lambda tok, h: counts.expand(tok.numel(), -1)                              # noqa: E731
        recs = []
        for tokens in budgets:
            k_max = k_max_for_tokens(tokens, m, vocab)
            for scorer, budget, fn in (("router", "position", None), ("router", "fixed", None),
                                       ("static", "position", static)):
                o = router_metrics(router, held_rows, wf, layout, k_max, budget, scores_fn=fn)["overall"]
                recs.append({"model": base["model"], "drafter": base["drafter"], "num_clusters": m,
                             "router_width": w, "top_l": el, "logged_top_l": base["top_l"], "scorer": scorer,
                             "budget": budget, "budget_tokens": tokens, "k_max": k_max, **o,
                             "train_rows": int(train_rows["tokens"].numel()), "final_loss": float(np.mean(losses[-20:])),
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
        print(f"[dynaspec] choices on {base['model']} ({held_rows['tokens'].numel()} held-out rows), budget {at} tokens "
              f"(k_max = round({at} * M / {vocab})), DynaSpec-PA:\n{show}")
    print(f"[dynaspec] {table.height} rows -> {out} (pl.scan_parquet('{out}/*.parquet'))")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engine.dynaspec", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit clusters and router for one model and drafter")
    defaults = {fld.name: fld.default for fld in dataclasses.fields(FitConfig)}
    f.add_argument("--model", required=True)
    for fld in dataclasses.fields(FitConfig):
        if fld.name in ("model", "spec", "progress"):
            continue
        typ = {int: int, float: float}.get(type(fld.default), str)
        f.add_argument("--" + fld.name.replace("_", "-"), type=typ, default=fld.default,
                       help=f"default {defaults[fld.name]}")
    f.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a SpecConfig field for the logging runs, e.g. drafter_layers=skip:12,14")
    f.add_argument("--no-progress", action="store_true")
    c = sub.add_parser("choices", help="sweep M, router width and L (one at a time) on a fit's logged rows")
    c.add_argument("--work-dir", required=True, help="a fit's work dir (fit.json + log-*.safetensors)")
    c.add_argument("--out", required=True, help="a folder for the Parquet files (one per setting; resumable)")
    for fld in dataclasses.fields(ChoicesConfig):
        if isinstance(fld.default, tuple):
            c.add_argument("--" + fld.name.replace("_", "-"), default=",".join(map(str, fld.default)),
                           help=f"comma-separated, default {','.join(map(str, fld.default))}")
    c.add_argument("--epochs", type=int, default=ChoicesConfig.epochs)
    c.add_argument("--threads", type=int, default=ChoicesConfig.threads)
    c.add_argument("--no-progress", action="store_true")
    args = vars(ap.parse_args(argv))
    cmd = args.pop("cmd")
    if cmd == "choices":
        progress = not args.pop("no_progress")
        for k, v in list(args.items()):
            if k in ("num_clusters", "router_width", "top_l", "budget_tokens"):
                try:
                    args[k] = tuple(int(x) for x in str(v).split(",") if x.strip())
                except ValueError:
                    raise SystemExit(f"--{k.replace('_', '-')} {v!r}: expected comma-separated integers") from None
        sweep_choices(ChoicesConfig(**args, progress=progress))
    elif cmd == "fit":
        try:
            spec = tuple(parse_overrides(args.pop("set")).items())
        except ConfigError as e:
            raise SystemExit(str(e)) from None
        progress = not args.pop("no_progress")
        fit(FitConfig(**args, spec=spec, progress=progress))


if __name__ == "__main__":
    main()
