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

This module is the decode-time part: the cluster layout, the budget, the router's module, the union head, the
fitted file's format and lookup, and the policy `DynaSpecVocab`. Fitting (k-means, row logging, router
training and its held-out metrics) is `engine.vocab.dynaspec_fit`, which the job `engine.jobs.fit_dynaspec`
runs (`python -m specvocab.engine.jobs.fit_dynaspec --model M`, or `specvocab dynaspec fit`) to write a
`.safetensors` file with a JSON sidecar that `vocab="dynaspec"` loads; `engine.jobs.dynaspec_choices` sweeps the
choices the paper leaves open. Where the paper is silent the defaults are choices, each said where it is set
(`engine.jobs.fit_dynaspec.FitConfig`, `engine.vocab.dynaspec_fit.RouterTraining`, `engine.config.SpecConfig`'s
dynaspec_* fields).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from specvocab.engine.atomic import safe_filename
from specvocab.engine.artifacts import (FINGERPRINT_KEY, fingerprint_matches, save_safetensors, sidecar_path,
                              stored_fingerprint)
from specvocab.engine.catalog import EAGLE3_FOLDER, SHIPPED_HEADS
from specvocab.engine.config import SpecConfig
from specvocab.engine.models import cache_root
from specvocab.engine.vocab.base import VocabPolicy, softcap
from specvocab.kernels.head import indexed_head

FORMAT = 1                                   # version of the saved file layout


class DynaSpecError(ValueError):
    """A DynaSpec cannot be fitted, loaded or used as asked; the message names the problem and the fix."""


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
        raise DynaSpecError(f"unknown budget {budget!r} — choose 'position' (DynaSpec-PA) or 'fixed' (DynaSpec-F)")
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
                            f"`{side.name}` — fit again with `python -m specvocab.engine.jobs.fit_dynaspec`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DynaSpecError(f"{side} is not valid JSON ({e}) — fit again with "
                            f"`python -m specvocab.engine.jobs.fit_dynaspec`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("method") != "dynaspec":
        raise DynaSpecError(f"{side} is not a DynaSpec sidecar of format {FORMAT} — fit again with "
                            f"`python -m specvocab.engine.jobs.fit_dynaspec`")
    return meta


def check_head(meta: dict, weight: torch.Tensor, where: str = "this DynaSpec",
               fingerprint: list[float] | None = None) -> None:
    """Raise unless `meta` was fitted for LM head `weight [V, d]` (shape, and `engine.artifacts.fingerprint_matches`
    on its fingerprint, which may be passed in when several files are checked against one head)."""
    model = meta.get("model", "?")
    fix = "fit one for this model with `python -m specvocab.engine.jobs.fit_dynaspec --model <name>`"
    if (meta["vocab_size"], meta["hidden_size"]) != tuple(weight.shape):
        raise DynaSpecError(f"{where} was fitted for model {model!r} with vocabulary {meta['vocab_size']} and hidden "
                            f"size {meta['hidden_size']}, but this LM head is {weight.shape[0]} x {weight.shape[1]} — "
                            f"{fix}")
    if not fingerprint_matches(stored_fingerprint(meta), weight, fingerprint):
        raise DynaSpecError(f"{where} was fitted for model {model!r}, whose LM head has the same shape as this one "
                            f"but other weights (LM-head fingerprint differs) — {fix}")


def load_dynaspec(path: str | Path, weight: torch.Tensor | None = None) -> FittedDynaSpec:
    """A fitted DynaSpec from `path` (+ `path.json`); with `weight`, checked against that LM head."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DynaSpecError(f"fitted DynaSpec {path} does not exist — fit one with "
                            f"`python -m specvocab.engine.jobs.fit_dynaspec --model <name>` (it is written under "
                            f"{cache_root() / 'dynaspec'})")
    meta = read_sidecar(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            file_id = (f.metadata() or {}).get("fit_id")
        tensors = load_file(str(path))
    except Exception as e:   # safetensors raises several error types for a damaged file
        raise DynaSpecError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}) — fit again") from e
    if file_id != meta.get("fit_id"):
        raise DynaSpecError(f"{path} and its sidecar {sidecar_path(path).name} come from different fits — fit again")
    if weight is not None:
        check_head(meta, weight, where=str(path))
    router = Router(meta["hidden_size"], meta["num_clusters"], meta["router_width"])
    state = {k[len("router."):]: v for k, v in tensors.items() if k.startswith("router.")}
    try:
        router.load_state_dict(state)
    except RuntimeError as e:
        raise DynaSpecError(f"{path}: router tensors do not match the sidecar's sizes ({e}) — fit again") from None
    assign = tensors["assign"].long()
    if assign.numel() != meta["vocab_size"]:
        raise DynaSpecError(f"{path}: {assign.numel()} cluster ids for a vocabulary of {meta['vocab_size']} — fit "
                            f"again")
    return FittedDynaSpec(assign=assign, router=router.eval(), meta=meta)


def drafter_key(cfg: SpecConfig, head_sha: str | None = None) -> dict:
    """What identifies the drafter whose hidden states a router was trained on: the drafter, the draft-tree
    depth (the router is trained on the steps t = 0..depth-1 it will score) and its weights - layerskip's layer
    choice, eagle's head by a hash of its weights (`engine.drafters.eagle.head_digest`; a head retrained into
    the same folder is another head). The drafter passes `head_sha`; a key built from `cfg` alone leaves it
    None, and None matches any value (`key_matches`): bench sizing, which needs only M and V, uses that."""
    if cfg.method == "layerskip":
        return {"drafter": "layerskip", "drafter_layers": cfg.drafter_layers, "eagle_depth": cfg.eagle_depth}
    if cfg.method == "eagle":
        return {"drafter": "eagle", "eagle_head_sha": head_sha, "eagle_depth": cfg.eagle_depth}
    if cfg.method == "eagle3":           # clusters over the head's own draft vocabulary (engine.drafters.eagle3)
        return {"drafter": "eagle3", "eagle3_head_sha": head_sha, "eagle_depth": cfg.eagle_depth}
    return {"drafter": cfg.method}


def key_matches(stored: dict | None, key: dict) -> bool:
    """A fit's `drafter_config` is this drafter's `key` (None values in `key` match anything). A fit whose key
    holds no depth or head hash matches no eagle or layerskip drafter: refit it."""
    stored = stored or {}
    return all(v is None or stored.get(k) == v for k, v in key.items())


def check_drafter(meta: dict, key: dict, where: str) -> None:
    """Raise unless the fit in `meta` was made for the drafter `key` (an explicit `dynaspec_file`)."""
    if not key_matches(meta.get("drafter_config"), key):
        raise DynaSpecError(f"{where} was fitted for drafter {meta.get('drafter_config')}, not for this one {key} "
                            f"(another head, another eagle_depth or layer choice, or a fit whose key records neither "
                            f"the head's hash nor the depth): its router would score steps and states it never saw "
                            f"— fit one for this drafter with `python -m specvocab.engine.jobs.fit_dynaspec --model "
                            f"<name> --drafter {key['drafter']}` (with the same --set eagle_depth=...)")


def default_dynaspec_path(model: str, cfg: SpecConfig, key: dict | None = None) -> Path:
    """Where `fit` writes by default: <specvocab cache>/dynaspec/<model>-<drafter>-<digest>.safetensors."""
    key = key or drafter_key(cfg)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    return cache_root() / "dynaspec" / f"{safe_filename(model)}-{key['drafter']}-{digest}.safetensors"


SHIPPED_FITS = SHIPPED_HEADS                                 # engine/heads/<model>/dynaspec-*.safetensors


def find_fitted(weight: torch.Tensor, cfg: SpecConfig, folder: str | Path | None = None,
                key: dict | None = None) -> Path:
    """The newest fitted DynaSpec in `folder` (default: the cache's dynaspec/, then the fits shipped beside
    the trained EAGLE heads in engine/heads/<model>/ and beside the EAGLE-3 heads in <model>/eagle3/) made for
    this LM head and this drafter (`key`, default `drafter_key(cfg)`); a clear error when there is none."""
    folders = [Path(folder)] if folder is not None else [cache_root() / "dynaspec", *sorted(SHIPPED_FITS.glob("*/")),
                                                         *sorted(SHIPPED_FITS.glob(f"*/{EAGLE3_FOLDER}/"))]
    key = key or drafter_key(cfg)
    fingerprint = None
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
        if key_matches(meta.get("drafter_config"), key) and path.is_file():
            found.append((meta.get("created", 0), path.name, path))
    if not found:
        raise DynaSpecError(f"vocab='dynaspec' needs a fitted DynaSpec for this model and drafter {key}, and none is "
                            f"in {folder} — fit one with `python -m specvocab.engine.jobs.fit_dynaspec --model "
                            f"<name> --drafter {key['drafter']}` or pass dynaspec_file=<path>")
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
    Sizes are accumulated on the device: per row |V_S,r| and per head call |union|.

    `weight` [K, d] holds the rows the clusters partition (the target's LM head, or an EAGLE-3 head's own
    lm_head over its draft vocabulary); `embed` [V, d] the rows E(x) the router reads for the token ids `route`
    gets (default: `weight`, when those ids index it)."""

    def __init__(self, fitted: FittedDynaSpec, weight: torch.Tensor, *, k_max: int, budget: str = "position",
                 k_min: int = 1, embed: torch.Tensor | None = None):
        if fitted.vocab_size != weight.shape[0] or fitted.router.hidden_size != weight.shape[1]:
            raise DynaSpecError(f"this DynaSpec is for V={fitted.vocab_size}, d={fitted.router.hidden_size}, but the "
                                f"LM head is {weight.shape[0]} x {weight.shape[1]} — fit one for this model")
        cluster_budget(0, k_max, budget, k_min=k_min)                             # validates the arguments
        self.weight = weight                                                      # [K, d] clustered rows
        self.embed = weight if embed is None else embed                           # [V_tokens, d] E(x)
        if self.embed.shape[1] != weight.shape[1]:
            raise DynaSpecError(f"the router's embedding rows are {self.embed.shape[1]} wide but the head's are "
                                f"{weight.shape[1]}")
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
        emb = self.embed[tokens.long()]                                           # [r, d] E(x): LM-head rows
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



# --- the policy ------------------------------------------------------------------------------------------

class DynaSpecVocab(VocabPolicy):
    """DynaSpec's routed cluster shortlists (DynaSpec §4.2-4.3; the pieces are above in this module).

    Before the backbone runs a tree level the drafter calls `route(tokens, parent_h, t)`: the router picks
    each row's top-k_c(t) clusters (`dynaspec_k_max`, `dynaspec_budget`, `dynaspec_k_min`), on its own
    stream on CUDA. `logits(h)` runs the head once over the union of the level's shortlists, each row
    masked to its own. The clusters and router come from `fitted`, else from `cfg.dynaspec_file` of a resolved
    config (`engine.resolve.resolve_run` fills it with the newest fit for this LM head and drafter,
    `find_fitted`; the policy looks nothing up), checked against the drafter (`check_drafter`: head hash, depth,
    layer choice); a config left unresolved is a DynaSpecError naming the fix.
    Active vocab of a step = its mean per-row shortlist (the paper's "vocab size", Table 1); coverage counts
    committed tokens inside the union of the step's shortlists; `stats()` adds `mean_row_vocab` (over all
    rows) and `mean_union_vocab` / `max_union_vocab` (rows of W the head read per call)."""

    name = "dynaspec"

    def __init__(self, weight, cfg, *, softcap=None, timer=None, fitted: FittedDynaSpec | None = None,
                 drafter_key: dict | None = None, embed: torch.Tensor | None = None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        key = drafter_key or globals()["drafter_key"](cfg)
        if fitted is None:
            path = cfg.dynaspec_file
            if not path:
                raise DynaSpecError("vocab='dynaspec' with dynaspec_file=None: the config was not resolved — resolve "
                                    "the run first (engine.resolve.resolve_run(cfg, model) picks the newest fit for "
                                    "this head and drafter) or pass dynaspec_file=<path>")
            fitted = load_dynaspec(path, weight)
            check_drafter(fitted.meta, key, str(path))
        self.head = DynaSpecHead(fitted, weight, k_max=cfg.dynaspec_k_max, budget=cfg.dynaspec_budget,
                                 k_min=cfg.dynaspec_k_min, embed=embed)

    def begin(self, prompt_ids, prefill_logits):
        super().begin(prompt_ids, prefill_logits)
        self.head.reset()

    def route(self, tokens, parent_h, t):
        with self.timer.phase("router"):
            self.head.route(tokens, parent_h, t)

    def logits(self, h):
        logits, idx = self.head.logits(self._check_h(h))
        return softcap(logits, self.softcap), idx

    def active_size(self):
        return self.head.step_row_mean()

    def active_mask(self):
        return self.head.step_mask

    def stats(self):
        return {**super().stats(), **self.head.stats()}
