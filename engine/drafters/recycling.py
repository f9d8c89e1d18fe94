"""Token Recycling (Luo et al., 2025): a static tree template filled by BFS from the successor store.

The store is the same `[V, k]` successor store as UniSpec's (`engine.store`): every verified node's row
is overwritten with the top-k of its verifier distribution (non-accepted nodes first, accepted path
last), and the prefill fills it too; hot start = one store per deployment (UniSpec App. A: the
one-to-one store of Luo et al., 2025).

The template ("tr-default") is the imbalanced tree of the Token Recycling paper's Figure 5: 80 draft
nodes, depth 6, children always taken from the first slots of the parent's row (k = 8 is enough; the
store may be wider). It is written below as the number of children of every node, level by level, in
BFS order. Each step fills it top-down: a node's token is `S_tok[token(parent), slot]`.

Choices where the paper is silent [C]:
- a node whose store slot is empty (confidence 0: the row was never written, or, when sampling, the
  token lies outside the top-p nucleus and could never be accepted) is dropped with its subtree,
  instead of drafting token 0 as a zero-initialised matrix would: it changes no output, only the cost
  of verifying a useless node;
- `draft_size = g < 80` keeps the g template nodes with the smallest sum of slot indices along their
  path (then shallower, then BFS order): the chains through top-ranked slots first. That order is
  closed under ancestors. The default (`draft_size=None`, resolved by `engine.harness.resolve_config`)
  is the whole template, the paper's baseline; the "+device-aware" variant of UniSpec Table 17 is
  `draft_size = engine.jobs.calibrate.calibrate(..., method="recycling")["g_star"]`.
- `scores` = product of the stored probabilities along the path (for plots; unused for drafting).
"""

from __future__ import annotations

import time

import torch

from specvocab.engine.drafters.unispec import accepted_last_order
from specvocab.engine.store import SuccessorStore, check_token_ids, drafter_store, prompt_rows, rows_tokens, topk_probs
from specvocab.engine.drafters import register_drafter
from specvocab.engine.methods import SAMPLING, STORE, TARGET, MethodSpec
from specvocab.engine.tree import Drafter, DraftTree, StepResult

# the method's description (engine.methods: read from this source without importing it); its drafter:
# RecyclingDrafter. Uncalibrated g and cap: its whole static template (Token Recycling's Figure 5 tree: 80 nodes),
# named as strings so that reading the description imports nothing.
METHOD = MethodSpec("recycling", order=30, default_draft_size="specvocab.engine.drafters.recycling:whole_template",
                    max_draft_size="specvocab.engine.drafters.recycling:template_cap",
                    calibration_fields=(*SAMPLING, *TARGET, *STORE, "recycling_tree"))

# Children per node, level by level (root first), BFS order. Token Recycling Figure 5: 80 nodes, depth 6.
TEMPLATES: dict[str, list[list[int]]] = {
    "tr-default": [
        [8],
        [8, 4, 3, 2, 1, 1, 1, 1],
        [8, 3, 2, 1, 1, 1, 1, 1, 2, 1, 0, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0],
        [5, 2, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0],
        [3, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0],
        [2, 0, 0, 1, 0, 0, 0, 0],
    ],
}


class RecyclingError(ValueError):
    """Bad template name, draft size or store width; the message says what is valid."""


class Template:
    """A static tree template: for each of its n draft nodes (BFS order) the parent (0 = root, else
    1 + index of a draft node) and the store slot the token comes from."""

    def __init__(self, children_per_level: list[list[int]]):
        parents, slots, depths = [], [], []
        level_nodes = [0]                              # node ids of the current level (root = 0)
        next_id = 1
        for d, counts in enumerate(children_per_level, start=1):
            if len(counts) != len(level_nodes):
                raise RecyclingError(f"template level {d} lists {len(counts)} child counts for "
                                     f"{len(level_nodes)} parent nodes")
            new_level = []
            for node, c in zip(level_nodes, counts):
                for slot in range(c):
                    parents.append(node)
                    slots.append(slot)
                    depths.append(d)
                    new_level.append(next_id)
                    next_id += 1
            level_nodes = new_level
        self.parents = torch.tensor(parents, dtype=torch.long)     # [n] in 0..n-1 (0 = root)
        self.slots = torch.tensor(slots, dtype=torch.long)         # [n]
        self.depths = torch.tensor(depths, dtype=torch.long)       # [n] 1..D
        self.size = len(parents)
        self.max_slot = int(self.slots.max()) + 1 if self.size else 0

    def truncated(self, g: int) -> "Template":
        """The g nodes with the smallest (slot-rank sum along the path, depth, BFS index)."""
        if g >= self.size:
            return self
        rank_sum = torch.zeros(self.size + 1, dtype=torch.long)
        for i in range(self.size):                      # template build time only (<= 80 nodes)
            rank_sum[i + 1] = rank_sum[self.parents[i]] + self.slots[i]
        key = [(int(rank_sum[i + 1]), int(self.depths[i]), i) for i in range(self.size)]
        keep = sorted(sorted(key)[:g], key=lambda x: x[2])           # back to BFS order
        keep_idx = torch.tensor([x[2] for x in keep], dtype=torch.long)
        new_id = torch.full((self.size + 1,), -1, dtype=torch.long)
        new_id[0] = 0
        new_id[keep_idx + 1] = torch.arange(1, g + 1)
        out = Template.__new__(Template)
        out.parents = new_id[self.parents[keep_idx]]
        if bool((out.parents < 0).any()):
            raise RecyclingError("template truncation broke ancestor closure (a bug)")
        out.slots = self.slots[keep_idx]
        out.depths = self.depths[keep_idx]
        out.size = g
        out.max_slot = int(out.slots.max()) + 1
        return out


def template_size(name: str) -> int:
    """Draft nodes of template `name` (root excluded): recycling's draft size when none is given."""
    if name not in TEMPLATES:
        raise RecyclingError(f"unknown recycling_tree {name!r} — choose one of {sorted(TEMPLATES)}")
    return sum(sum(level) for level in TEMPLATES[name])


def whole_template(cfg) -> int:
    """recycling's uncalibrated draft size: every node of `cfg.recycling_tree` (`METHOD`)."""
    return template_size(cfg.recycling_tree)


def template_cap(cfg) -> int | None:
    """recycling's largest draft size: the nodes of `cfg.recycling_tree`; None for a template it does not know
    (the drafter rejects it when built) (`METHOD`)."""
    return template_size(cfg.recycling_tree) if cfg.recycling_tree in TEMPLATES else None


def fill_template(root: int | torch.Tensor, template: Template, store_tok: torch.Tensor,
                  store_con: torch.Tensor) -> DraftTree:
    """Token Recycling's static-tree BFS (its Alg. 1), vectorised per level. Pure.

    Nodes whose slot is empty (confidence 0), and their subtrees, are dropped."""
    device = store_tok.device
    n = template.size + 1
    tokens = torch.zeros(n, dtype=torch.long, device=device)           # [n]
    scores = torch.ones(n, dtype=torch.float32, device=device)          # [n]
    alive = torch.ones(n, dtype=torch.bool, device=device)              # [n]
    tokens[0] = torch.as_tensor(root, dtype=torch.long, device=device)
    parents = torch.cat([torch.tensor([-1]), template.parents]).to(device)
    slots = torch.cat([torch.tensor([0]), template.slots]).to(device)
    depths = torch.cat([torch.tensor([0]), template.depths]).to(device)
    for d in range(1, int(depths.max()) + 1 if n > 1 else 1):          # depth loop only
        lvl = torch.nonzero(depths == d).reshape(-1)                     # [m]
        par = parents[lvl]
        tokens[lvl] = store_tok[tokens[par], slots[lvl]]
        p = store_con[tokens[par], slots[lvl]]
        scores[lvl] = scores[par] * p
        alive[lvl] = alive[par] & (p > 0)
    new_id = torch.cumsum(alive.long(), 0) - 1                          # [n] position among the alive
    keep = torch.nonzero(alive).reshape(-1)
    kept_par = parents[keep]
    new_par = torch.where(kept_par < 0, kept_par, new_id[kept_par.clamp(min=0)])
    return DraftTree(tokens[keep].cpu(), new_par.cpu(), scores[keep].cpu())


@register_drafter("recycling")
class RecyclingDrafter(Drafter):
    """The `recycling` method: Token Recycling's static template over the successor store."""

    name = "recycling"
    store_method = "recycling"

    def __init__(self, target, cfg, *, store: SuccessorStore | None = None):
        super().__init__(target, cfg)
        size = template_size(cfg.recycling_tree)
        full = Template(TEMPLATES[cfg.recycling_tree])
        g = cfg.require_draft_size()
        if g > size:
            raise RecyclingError(f"draft_size={g} exceeds the {size} nodes of template "
                                 f"{cfg.recycling_tree!r} — pass draft_size <= {size} or None (whole template)")
        if full.max_slot > cfg.store_k:
            raise RecyclingError(f"template {cfg.recycling_tree!r} uses {full.max_slot} store slots per node "
                                 f"but store_k={cfg.store_k} — set store_k >= {full.max_slot}")
        self.template = full.truncated(g)
        self._given_store = store                       # checked against the vocabulary in begin()
        self._store = store
        self._t = {"tree": 0.0, "store_update": 0.0}

    @property
    def store(self) -> SuccessorStore:
        if self._store is None:
            raise RecyclingError("the store is made in begin() from the prefill logits' width — call begin first")
        return self._store

    # the prefill's logits at the last occurrence of each prompt token only: the store keeps one row per token,
    # a later occurrence overwriting an earlier one (the other rows would be computed and thrown away)
    prefill_rows = staticmethod(prompt_rows)

    def begin(self, prompt_ids, prefill_logits, prefill_hidden):
        t0 = time.perf_counter()
        self._t = {"tree": 0.0, "store_update": 0.0}
        vocab = prefill_logits.shape[-1]
        self._store = drafter_store(self._given_store, self.target, self.store_method, vocab, self.cfg.store_k,
                                    prefill_logits.device)
        if self.store.k < self.template.max_slot:
            raise RecyclingError(f"the given store has k={self.store.k} slots per row but the template reads "
                                 f"{self.template.max_slot} — build it with k >= {self.template.max_slot}")
        if self.cfg.store_persistence == "per_prompt":
            self.store.reset()
        prompt_ids = prompt_ids.reshape(-1)
        # once per prompt (a host sync): every later root and store row descends from these ids
        check_token_ids(prompt_ids, vocab, "the prompt", fix="encode it with the target's tokenizer")
        # sampling: the top-k of the distribution the verifier samples from (temperature, top-p)
        ids, probs = topk_probs(prefill_logits, self.store.k, self.cfg.temperature, self.cfg.top_p)
        self.store.update_topk(rows_tokens(prompt_ids, prefill_logits.shape[0]), ids, probs, check_ids=False)
        self._t["store_update"] += time.perf_counter() - t0

    def propose(self, ids):
        t0 = time.perf_counter()
        tree = fill_template(ids[-1], self.template, self.store.tok, self.store.con)
        self._t["tree"] += time.perf_counter() - t0
        return tree

    def observe(self, step: StepResult):
        t0 = time.perf_counter()
        ids, probs = topk_probs(step.logits, self.store.k, self.cfg.temperature, self.cfg.top_p)
        order = accepted_last_order(step.tree.size, step.accepted).to(ids.device)
        # in range by construction (this store's tree, the target's top-k): no per-step host sync
        self.store.update_topk(step.tree.tokens.to(ids.device)[order], ids[order], probs[order], check_ids=False)
        self._t["store_update"] += time.perf_counter() - t0

    def timings(self):
        return dict(self._t)
