"""UniSpec: confidence-scored trees from the successor store, a broadened first level, top-g* selection.

Implements UniSpec Alg. 1 l.16-30 and 38-47 and App. A:

- level 1 = S[root] (+) C, where C is the cached top-k of the verifier distribution at the token
  before the root (the distribution that produced the root: "next-next" candidates); empty slots
  dropped, duplicate tokens merged keeping the max confidence [C]; the root's own entry in C is dropped
  (`cfg.cache_exclude_root`, default True: see `engine.config` for why and what it measured);
- levels 2..d: the children of the frontier (the top-k nodes of the previous level whose score >= r)
  are the frontier tokens' store rows; every child goes into the candidate pool;
- node confidence (`cfg.confidence`): "path" = product of the stored probabilities along the path
  (EAGLE-2 style, the spec's default), "node" = the node's own stored probability (literal Alg. 1 l.25);
- the draft tree = the top-g* pool nodes by confidence, kept closed under ancestors (best-first
  growth: a node is taken only once its parent is; see `select_top_g` for why not the spec's
  multi-pass walk), re-ordered level by level (BFS) so that parents come before children;
- after verification, every node's row (non-accepted nodes first, the accepted path last) is
  overwritten with the top-k of its verifier distribution, and C with the last accepted node's.

The per-level work is tensor ops over the whole frontier; the only Python loops are over the d levels.
`build_unispec_tree` is pure (store tensors in, `DraftTree` out) so tests can compare it with a plain
reference and notebooks can replay it.
"""

from __future__ import annotations

import time

import torch

from specvocab.engine.store import SuccessorStore, check_token_ids, drafter_store, prompt_rows, rows_tokens, topk_probs
from specvocab.engine.drafters import register_drafter
from specvocab.engine.methods import SAMPLING, STORE, TARGET, MethodSpec, unispec_candidates
from specvocab.engine.tree import Drafter, DraftTree, StepResult
from specvocab.kernels import cpu as cpu_kernels

# the method's description (engine.methods: read from this source without importing it); its drafter:
# UniSpecDrafter. Uncalibrated g: the per-device fallback (engine.calibration.FALLBACK_DRAFT_SIZE); cap: the
# candidate pool (App. A, Alg. 1).
METHOD = MethodSpec("unispec", order=40, max_draft_size=unispec_candidates,
                    calibration_fields=(*SAMPLING, *TARGET, *STORE, "tree_depth", "threshold_r", "confidence",
                                        "broaden_first_level", "threshold_scope", "cache_exclude_root"))


class UniSpecError(ValueError):
    """A UniSpec parameter or input is invalid; the message names it and the valid range."""


def first_level(root_tok: torch.Tensor, root_con: torch.Tensor, cache_tok: torch.Tensor | None,
                cache_con: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Level-1 candidates: S[root] (+) C, empty slots dropped, duplicates merged keeping the max
    confidence. Returns (tokens [m], confidences [m]) sorted by confidence descending; ties keep the
    order S[root] before C, slot order within each (stable sort)."""
    if cache_tok is not None:
        tok = torch.cat([root_tok, cache_tok.to(root_tok.device)])          # [<= 2k]
        con = torch.cat([root_con, cache_con.to(root_con.device)])          # [<= 2k]
    else:
        tok, con = root_tok, root_con
    order = torch.sort(con, descending=True, stable=True).indices
    tok, con = tok[order], con[order]
    same = tok[:, None] == tok[None, :]                                     # [m, m]
    seen_before = torch.tril(same, diagonal=-1).any(dim=1)                  # a higher-confidence copy exists
    keep = ~seen_before & (con > 0)
    return tok[keep], con[keep]


def _frontier(scores: torch.Tensor, k: int, r: float) -> torch.Tensor:
    """Indices (into this level) of the top-k scores that are >= r, best first (stable on ties)."""
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return order[scores[order] >= r]


def build_unispec_tree(root: int | torch.Tensor, store_tok: torch.Tensor, store_con: torch.Tensor,
                       cache_tok: torch.Tensor | None, cache_con: torch.Tensor | None, *,
                       k: int, depth: int, r: float, g: int, confidence: str = "path",
                       threshold_scope: str = "expand", cache_exclude_root: bool = False) -> DraftTree:
    """One UniSpec draft tree (UniSpec Alg. 1 l.16-30). Pure.

    root: the root token id. store_tok / store_con: [V, k_s] successor store (k_s >= 1; every stored
    slot of a frontier node becomes a child). cache_tok / cache_con: [k_c] first-level cache, or None
    (no broadening). k: frontier width per level. depth: d, the deepest level. r: expansion threshold.
    g: the most draft tokens (root excluded) to select. cache_exclude_root: drop the root's own token
    from C (under greedy decoding it is C's top-1: a "repeat the root" guess whose confidence is the
    root's own probability; a [C] choice, the paper keeps it). Returns a DraftTree with <= 1 + g nodes,
    `scores` = node confidences (root 1.0). A root or cache token outside [0, V) raises StoreError (checked
    for host values only: the drafter's device tensors hold ids checked in `begin`, and checking them
    here would cost a host sync every step).
    """
    if store_tok.dim() != 2 or store_con.shape != store_tok.shape:
        raise UniSpecError(f"store_tok and store_con must both be [V, k]; got {tuple(store_tok.shape)} and "
                           f"{tuple(store_con.shape)}")
    if confidence not in ("path", "node"):
        raise UniSpecError(f"confidence must be 'path' or 'node', got {confidence!r}")
    if threshold_scope not in ("expand", "expand+select"):
        raise UniSpecError(f"threshold_scope must be 'expand' or 'expand+select', got {threshold_scope!r}")
    if g <= 0 or k <= 0 or depth <= 0:
        raise UniSpecError(f"need g > 0, k > 0, depth > 0; got g={g}, k={k}, depth={depth}")
    device = store_tok.device
    if not isinstance(root, torch.Tensor) or root.device.type == "cpu":
        check_token_ids(torch.as_tensor(root).reshape(1), store_tok.shape[0], "the root token")
    if cache_tok is not None and cache_tok.device.type == "cpu":
        check_token_ids(cache_tok, store_tok.shape[0], "the first-level cache")
    root = torch.as_tensor(root, dtype=torch.long, device=device).reshape(())

    # ---- level 1 (broadened) ------------------------------------------------------------------
    if cache_tok is not None and cache_exclude_root:
        cache_con = torch.where(cache_tok.to(device) == root, torch.zeros_like(cache_con), cache_con)
    tok1, con1 = first_level(store_tok[root], store_con[root], cache_tok, cache_con)   # [m1]
    level_tok = [tok1]
    level_score = [con1]
    level_parent = [torch.full_like(tok1, -1)]        # pool index of the parent; -1 = root
    level_start = [0]
    size = tok1.numel()
    frontier = _frontier(con1, k, r)                  # [f] indices into level 1
    frontier_pool = frontier                          # [f] pool indices
    frontier_tok, frontier_score = tok1[frontier], con1[frontier]

    # ---- levels 2..d: expand the frontier, vectorised over it ---------------------------------------
    for _ in range(2, depth + 1):
        if frontier.numel() == 0:
            break
        ch_tok = store_tok[frontier_tok]                                     # [f, k_s]
        ch_p = store_con[frontier_tok]                                       # [f, k_s]
        ch_score = frontier_score[:, None] * ch_p if confidence == "path" else ch_p
        ch_parent = frontier_pool[:, None].expand_as(ch_tok)                 # [f, k_s]
        valid = ch_p > 0                                                     # empty slots are no nodes
        tok_l, score_l, parent_l = ch_tok[valid], ch_score[valid], ch_parent[valid]   # [m] row-major
        level_tok.append(tok_l)
        level_score.append(score_l)
        level_parent.append(parent_l)
        level_start.append(size)
        frontier = _frontier(score_l, k, r)
        frontier_pool = size + frontier
        frontier_tok, frontier_score = tok_l[frontier], score_l[frontier]
        size += tok_l.numel()

    return select_top_g(root, level_tok, level_score, level_parent, level_start, g=g,
                        min_score=r if threshold_scope == "expand+select" else 0.0)


def select_top_g(root: torch.Tensor, level_tok: list[torch.Tensor], level_score: list[torch.Tensor],
                 level_parent: list[torch.Tensor], level_start: list[int], *, g: int,
                 min_score: float = 0.0) -> DraftTree:
    """Top-g pool nodes, closed under ancestors, re-indexed level by level (UniSpec §3, Alg. 1 l.30).

    The pool is given per level (level i's nodes have pool indices level_start[i] + j; parents point to
    pool indices of the level above, -1 = root). Selection is best-first growth: repeatedly take the
    best node whose parent is already taken. That equals sorting by the bottleneck confidence
    `eff(i) = min(score(i), eff(parent(i)))` (descending; ties: depth asc, pool index asc - a parent
    always precedes its children) and taking the first g. In "path" mode scores already decrease
    along paths, so eff = score and this is the plain top-g of the spec.

    [C] The spec describes closure as a multi-pass walk over the score-sorted list and calls it
    equivalent to best-first growth; it is not: with root->a (.30), root->b (.25), a->c (.90),
    b->e (.10) and g = 3 the walk takes a, b, e (e is reached in the first pass) while best-first takes
    a, c, b. We implement best-first; it only differs in "node" mode."""
    device = root.device
    tok = torch.cat(level_tok)                                               # [P]
    score = torch.cat(level_score)                                           # [P]
    parent = torch.cat(level_parent)                                         # [P]
    depth = torch.cat([torch.full_like(t, i + 1) for i, t in enumerate(level_tok)])   # [P]
    n_pool = tok.numel()
    if n_pool == 0:
        return DraftTree(root.reshape(1).cpu(), torch.tensor([-1]), torch.ones(1))

    eff = score.clone()                                                      # [P] bottleneck confidence
    for lvl in range(1, len(level_tok)):                                     # depth loop only
        lo, hi = level_start[lvl], level_start[lvl] + level_tok[lvl].numel()
        eff[lo:hi] = torch.minimum(score[lo:hi], eff[parent[lo:hi]])

    # expand+select drops nodes under r; a kept node's parent was in a frontier (score >= r), so the
    # eligible set stays closed under ancestors
    eligible = (score >= min_score) & (score > 0)
    # order (eff desc, depth asc, pool index asc): stable sorts, last key first
    order = torch.sort(depth, stable=True).indices
    order = order[torch.sort(eff[order], descending=True, stable=True).indices]
    order = order[eligible[order]]
    chosen = order[:g]                                                       # [g'] pool indices
    rank = torch.empty(n_pool, dtype=torch.long, device=device)
    rank[order] = torch.arange(order.numel(), device=device)

    # topological re-index: depth asc, then selection rank
    chosen = chosen[torch.sort(rank[chosen], stable=True).indices]
    chosen = chosen[torch.sort(depth[chosen], stable=True).indices]
    new_index = torch.full((n_pool,), -1, dtype=torch.long, device=device)
    new_index[chosen] = torch.arange(1, chosen.numel() + 1, device=device)
    par = parent[chosen]
    new_par = torch.where(par < 0, torch.zeros_like(par), new_index[par.clamp(min=0)])
    tokens = torch.cat([root.reshape(1), tok[chosen]])
    parents = torch.cat([torch.tensor([-1], device=device), new_par])
    scores = torch.cat([torch.ones(1, device=device), score[chosen].float()])
    return DraftTree(tokens.cpu(), parents.cpu(), scores.cpu())


def accepted_last_order(n: int, accepted: torch.Tensor) -> torch.Tensor:
    """[n] node order for a store update: non-accepted nodes (tree order), then the accepted path."""
    is_acc = torch.zeros(n, dtype=torch.bool)
    acc = accepted.reshape(-1).cpu().long()
    is_acc[acc] = True
    return torch.cat([torch.nonzero(~is_acc).reshape(-1), acc])


@register_drafter("unispec")
class UniSpecDrafter(Drafter):
    """The `unispec` method. Store per deployment (or per prompt), first-level cache per prompt."""

    name = "unispec"
    store_method = "unispec"

    def __init__(self, target, cfg, *, store: SuccessorStore | None = None):
        super().__init__(target, cfg)
        self._given_store = store                       # checked against the vocabulary in begin()
        self._store = store
        self.draft_size = cfg.require_draft_size()      # g*, resolved with the config (engine.harness)
        self.cache_tok: torch.Tensor | None = None      # [k] C_tok
        self.cache_con: torch.Tensor | None = None      # [k] C_con
        self._t = {"tree": 0.0, "store_update": 0.0}

    # -- store ---------------------------------------------------------------------------------------
    @property
    def store(self) -> SuccessorStore:
        if self._store is None:
            raise UniSpecError("the store is made in begin() from the prefill logits' width — call begin first")
        return self._store

    def _ensure_store(self, vocab_size: int, device) -> None:
        self._store = drafter_store(self._given_store, self.target, self.store_method, vocab_size,
                                    self.cfg.store_k, device)

    # -- Drafter hooks ---------------------------------------------------------------------------------
    # the prefill's logits at the last occurrence of each prompt token only: the store keeps one row per token,
    # a later occurrence overwriting an earlier one (the other rows would be computed and thrown away)
    prefill_rows = staticmethod(prompt_rows)

    def begin(self, prompt_ids, prefill_logits, prefill_hidden):
        t0 = time.perf_counter()
        self._t = {"tree": 0.0, "store_update": 0.0}
        self._ensure_store(prefill_logits.shape[-1], prefill_logits.device)
        if self.cfg.store_persistence == "per_prompt":
            self.store.reset()
        prompt_ids = prompt_ids.reshape(-1)
        # once per prompt (a host sync): every later root and store row descends from these ids
        check_token_ids(prompt_ids, self.store.vocab_size, "the prompt",
                        fix="encode it with the target's tokenizer")
        # sampling: confidences from the distribution the verifier samples from (temperature, top-p)
        ids, probs = topk_probs(prefill_logits, self.store.k, self.cfg.temperature, self.cfg.top_p)
        self.store.update_topk(rows_tokens(prompt_ids, prefill_logits.shape[0]), ids, probs,
                               check_ids=False)                  # later positions win on repeats
        self.cache_tok, self.cache_con = ids[-1], probs[-1]
        self._t["store_update"] += time.perf_counter() - t0

    def propose(self, ids):
        t0 = time.perf_counter()
        cfg = self.cfg
        cache = (self.cache_tok, self.cache_con) if cfg.broaden_first_level else (None, None)
        tree = None
        if cfg.cpu_kernels and self.store.device.type == "cpu" and cpu_kernels.available_portable() is None:
            out = cpu_kernels.unispec_tree(         # the same tree in one C call (tests/test_drafters_unispec.py)
                int(ids[-1]), self.store.tok, self.store.con, *cache, k=cfg.store_k, depth=cfg.tree_depth,
                r=cfg.threshold_r, g=self.draft_size, path=cfg.confidence == "path",
                min_score=cfg.threshold_r if cfg.threshold_scope == "expand+select" else 0.0,
                exclude_root=cfg.cache_exclude_root)
            tree = None if out is None else DraftTree(*out)
        if tree is None:                            # elsewhere, and for ids the reference must name
            tree = build_unispec_tree(ids[-1], self.store.tok, self.store.con, *cache, k=cfg.store_k,
                                      depth=cfg.tree_depth, r=cfg.threshold_r, g=self.draft_size,
                                      confidence=cfg.confidence, threshold_scope=cfg.threshold_scope,
                                      cache_exclude_root=cfg.cache_exclude_root)
        self._t["tree"] += time.perf_counter() - t0
        return tree

    def observe(self, step: StepResult):
        t0 = time.perf_counter()
        ids, probs = topk_probs(step.logits, self.store.k, self.cfg.temperature, self.cfg.top_p)   # [n, k] each
        order = accepted_last_order(step.tree.size, step.accepted).to(ids.device)
        # in range by construction (this store's tree, the target's top-k): no per-step host sync
        self.store.update_topk(step.tree.tokens.to(ids.device)[order], ids[order], probs[order], check_ids=False)
        last = step.accepted.reshape(-1)[-1]
        self.cache_tok, self.cache_con = ids[last], probs[last]
        self._t["store_update"] += time.perf_counter() - t0

    def timings(self):
        return dict(self._t)
