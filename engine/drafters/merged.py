"""`merged`: one verify tree from several drafters - a draft head's candidates and the n-gram candidates - under
one node budget.

Words as in the glossary (`locality.__doc__`). Sources (`cfg.merge_sources`, '+'-joined, `MERGE_SOURCES`): at most
one draft head, `eagle3` (EAGLE-3) or `eagle` (EAGLE-2), and the n-gram sources `pld` (prompt lookup: a chain
copied from the context) and `unispec` (UniSpec's successor store and first-level cache). Each source is the
method's own drafter, built with the run's config (the vocabulary policy `cfg.vocab` applies to the head's part,
as in a plain `eagle3` / `eagle` run), and proposes its own tree of up to g = `draft_size` nodes every step.
UniSpec's source keeps its own deployment store ("merged:unispec"), apart from a plain unispec run's.

The merged tree (`merge_trees`, pure):

    rank      each source's nodes best first, closed under ancestors: best-first growth, repeatedly the
              best-scored node whose parent is taken, ties by depth then node index (a chain's nodes, all
              scored 1, in chain order; EAGLE's and UniSpec's path scores never exceed the parent's, so this
              is the source's own top-g order and its first r nodes are the tree it drafts at g = r)
    share     one node at a time goes to the source whose next ranked node has the highest marginal acceptance
              a_s(r) (its profile below, r = the nodes it placed so far); ties to the source with fewer nodes
              placed, then the order of `merge_sources`. A source's share is thus as many nodes as its
              profile outbids the others for: a source whose r-th node is accepted more often gets it first.
    dedupe    the union is a trie over token paths: a node whose (merged parent, token) is already in the tree
              is that node - a token path appears once - and takes no budget; its source moves on to its next
              node. Nodes are added parent first, so the tree is in topological order.
    budget    stop at g draft nodes (root excluded) or when every source has placed all its nodes.
    scores    a node keeps the confidence of the source that placed it first.

Acceptance profile a_s(r), r = 1..g (`profile_from_curve`, `MergedDrafter.gains`): the calibration of the source
method on this model, device, dtype and config (`engine.calibration`, the record `python -m
specvocab.engine.jobs.calibrate --method <source>` writes) gives tau_s(g) on a grid; a_s(r) = tau_s(r) -
tau_s(r - 1), tau_s linear between measured sizes with tau_s(0) = 1 and flat past the grid: the tokens its r-th
node adds per step. A source with no record starts from a_s(r) = 1/2 for every r. During the run each rank's
measured acceptance refines it (`PRIOR_WEIGHT` pseudo-counts of the prior): a_s(r) = (accepted_s(r) +
w a_prior) / (placed_s(r) + w), where placed counts the steps the source's r-th node was placed (its own node or
a duplicate) and accepted those in which that node was on the committed path. The tree then depends on earlier
steps' verdicts only, never on the step's own target output, so verification stays exact.

Verification: every source proposes deterministic candidates (no `draft_probs`), so the merged tree is verified
as any point-mass tree (`engine.verify`): greedy equals `ar` token for token and sampling follows the target's
distribution whatever the tree. Each source observes the merged step (the tree, logits, hidden states and
accepted path the target produced): EAGLE re-runs the accepted path with the target's features, UniSpec writes
every verified row into its store, MicroSpec's window takes the tree's tokens.

Draft size: g = `draft_size`, the merged tree's draft nodes (root excluded); left None, the calibrated g* of the
merged method itself (its calibration key holds `merge_sources` and every source's fields, `METHOD` below), else
the per-device fallback. A run resolved by `engine.resolve.resolve_run` on this machine's cache first calibrates
on the spot each source that has no record, so the profiles above are measured, not assumed.

Attribution (`stats()`): `accepted_by_<source>` counts the committed draft tokens whose node that source placed
first; over a run they sum to the committed draft tokens, `accepted_draft_tokens` (per step min(a - 1, kept):
the accepted draft tokens, less those an eos / max_new_tokens cut dropped). `placed_by_<source>` counts the nodes
each placed. The head's policy statistics (`mean_active_vocab`, coverage) are passed through.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specvocab.engine.calibration import CalibrationSource, calibration_source, model_key
from specvocab.engine.config import SpecConfig
from specvocab.engine.drafters import make_drafter, register_drafter
from specvocab.engine.drafters.lmhead import DrafterError
from specvocab.engine.methods import MERGE_HEADS, MERGE_SOURCES, MethodSpec, calibration_fields_of
from specvocab.engine.shipped import default_eagle3_head, default_eagle_head
from specvocab.engine.tree import Drafter, DraftTree, StepResult

# the method's description (engine.methods: read from this source without importing it); its drafter:
# MergedDrafter. Calibration key: `merge_sources` and every source's fields (whichever it names); uncalibrated g:
# the per-device fallback; no cap of its own (each source drafts up to g, the union is cut at g).
METHOD = MethodSpec("merged", order=90,
                    calibration_fields=("merge_sources", *calibration_fields_of(*MERGE_SOURCES)))

PRIOR_WEIGHT = 4.0          # pseudo-counts of a source's prior profile against its measured acceptance
UNCALIBRATED_GAIN = 0.5     # a_s(r) before any measurement for a source with no calibration record


class MergeError(DrafterError):
    """A merged-tree config names sources that are unknown or cannot run on this model; the message names the
    missing part and the fix."""


def parse_sources(text: str) -> tuple[str, ...]:
    """'eagle3+pld+unispec' -> ('eagle3', 'pld', 'unispec'), checked: known sources, no repeats, at most one
    head, at least one source."""
    names = tuple(s.strip() for s in str(text).split("+") if s.strip())
    unknown = [s for s in names if s not in MERGE_SOURCES]
    if not names or unknown:
        raise MergeError(f"merge_sources={text!r}: {'unknown source(s) ' + str(unknown) if unknown else 'no source'} — "
                         f"join sources from {list(MERGE_SOURCES)} with '+', e.g. 'eagle3+pld+unispec'")
    if len(set(names)) != len(names):
        raise MergeError(f"merge_sources={text!r} names a source twice — name each once")
    heads = [s for s in names if s in MERGE_HEADS]
    if len(heads) > 1:
        raise MergeError(f"merge_sources={text!r} names two draft heads {heads} — a merged tree takes one head "
                         f"(eagle3 or eagle) plus the n-gram sources")
    return names


# --- the merged tree (pure) -------------------------------------------------------------------------------------

def ranked_nodes(tree: DraftTree) -> list[int]:
    """Node indices of `tree` but the root, best first and closed under ancestors (module docstring, "rank"):
    best-first growth, a heap of the nodes whose parent is taken, keyed (score desc, depth, index)."""
    n = tree.size
    score, par = tree.scores.double().tolist(), tree.parents.tolist()
    kids: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    for i in range(1, n):                                        # topological order: parents first
        kids[par[i]].append(i)
        depth[i] = depth[par[i]] + 1
    heap = [(-score[i], depth[i], i) for i in kids[0]]
    heapq.heapify(heap)
    order = []
    while heap:
        i = heapq.heappop(heap)[2]
        order.append(i)
        for c in kids[i]:
            heapq.heappush(heap, (-score[c], depth[c], c))
    return order


@dataclass
class MergedTree:
    tree: DraftTree              # the merged tree, root first, topological order
    owner: torch.Tensor          # [n] int64 index (into the sources) of the source that placed each node; -1 root
    rank_node: list[list[int]]   # per source: the merged node of its r-th ranked node, for r < nodes it placed


def merge_trees(trees: Sequence[DraftTree], gains: Sequence[Sequence[float]], g: int) -> MergedTree:
    """One tree of at most 1 + g nodes from `trees` (one per source, all rooted at the same token), by marginal
    acceptance `gains[s][r]` of source s's (r+1)-th ranked node (module docstring: rank, share, dedupe, budget).
    A rank past len(gains[s]) is worth 0."""
    if not trees:
        raise MergeError("merge_trees needs at least one source tree")
    root = int(trees[0].tokens[0])
    if any(int(t.tokens[0]) != root for t in trees):
        raise MergeError(f"the source trees have different roots {[int(t.tokens[0]) for t in trees]} — every source "
                         f"drafts from the same last committed token")
    ranks = [ranked_nodes(t) for t in trees]
    toks = [t.tokens.tolist() for t in trees]
    pars = [t.parents.tolist() for t in trees]
    scs = [t.scores.tolist() for t in trees]
    to_merged = [{0: 0} for _ in trees]                          # per source: its node -> merged node
    trie: dict[tuple[int, int], int] = {}                        # (merged parent, token) -> merged node
    tokens, parents, scores, owner = [root], [-1], [1.0], [-1]
    placed = [0] * len(trees)
    rank_node: list[list[int]] = [[] for _ in trees]
    while len(tokens) - 1 < g:
        best, best_key = None, None
        for s in range(len(trees)):
            r = placed[s]
            if r >= len(ranks[s]):
                continue
            value = float(gains[s][r]) if r < len(gains[s]) else 0.0
            key = (value, -r, -s)                                # highest gain, then fewer placed, then order
            if best_key is None or key > best_key:
                best, best_key = s, key
        if best is None:
            break
        s = best
        node = ranks[s][placed[s]]
        placed[s] += 1
        parent = to_merged[s][pars[s][node]]                     # ranked: the parent was placed before
        key = (parent, toks[s][node])
        m = trie.get(key)
        if m is None:
            m = len(tokens)
            trie[key] = m
            tokens.append(toks[s][node])
            parents.append(parent)
            scores.append(scs[s][node])
            owner.append(s)
        to_merged[s][node] = m
        rank_node[s].append(m)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores, dtype=torch.float32))
    return MergedTree(tree, torch.tensor(owner), rank_node)


def profile_from_curve(sizes: Sequence[float], taus: Sequence[float], g: int) -> list[float]:
    """a(r) for r = 1..g from a measured tau(g) curve (module docstring): tau linear between the sizes, tau(0) = 1,
    flat past the last size; negative increments (noise) count as 0."""
    order = np.argsort(np.asarray(sizes, dtype=np.float64))
    x = np.concatenate([[0.0], np.asarray(sizes, dtype=np.float64)[order]])
    y = np.concatenate([[1.0], np.asarray(taus, dtype=np.float64)[order]])
    tau = np.interp(np.arange(g + 1, dtype=np.float64), x, y)   # np.interp is flat past the ends
    return np.clip(np.diff(tau), 0.0, None).tolist()


def calibrated_profile(cfg: SpecConfig, target, g: int, source: CalibrationSource | None = None) -> list[float] | None:
    """a(r), r = 1..g, of cfg.method (a source's config) from its calibration record on this target, device,
    dtype and config in `source` (default this machine's cache); None without a record."""
    source = calibration_source() if source is None else source
    rec = source.records.get(model_key(target, cfg))
    if rec is None or not rec.get("rows"):
        return None
    return profile_from_curve([r["g"] for r in rec["rows"]], [r["tau"] for r in rec["rows"]], g)


def prior_profile(profile: Sequence[float] | None, g: int) -> np.ndarray:
    """[g] float64 a(r), r = 1..g, before any measurement: the profile given (cut to g, ranks past it worth 0),
    or UNCALIBRATED_GAIN at every rank for a source with none."""
    if profile is None:
        return np.full(g, UNCALIBRATED_GAIN)
    out = np.zeros(g)
    k = min(g, len(profile))
    out[:k] = np.asarray(profile, dtype=np.float64)[:k]
    return out


# --- the drafter ------------------------------------------------------------------------------------------------

def source_config(cfg: SpecConfig, name: str, target) -> SpecConfig:
    """The config source `name` runs with inside a merged run: the run's, with the method and, for a head left
    None, the head shipped for the target (as `engine.harness.resolve_config` resolves a plain run's)."""
    sub = cfg.replace(method=name)
    if name == "eagle3" and sub.eagle3_head is None:
        sub = sub.replace(eagle3_head=default_eagle3_head(target))
    if name == "eagle" and sub.eagle_head is None:
        sub = sub.replace(eagle_head=default_eagle_head(target))
    return sub


@register_drafter("merged")
class MergedDrafter(Drafter):
    """The `merged` method (module docstring). `profiles`: {source: a(r) list} instead of the calibration
    records (tests, replays); `calibration`: where the records are read (default this machine's cache)."""

    name = "merged"

    def __init__(self, target, cfg, *, profiles: dict[str, Sequence[float]] | None = None,
                 calibration: CalibrationSource | None = None):
        super().__init__(target, cfg)
        self.g = cfg.require_draft_size()
        self.sources = parse_sources(cfg.merge_sources)
        self.drafters: list[Drafter] = []
        for name in self.sources:
            sub = source_config(cfg, name, target)
            if name == "eagle3" and sub.eagle3_head is None:
                raise MergeError(f"merge_sources={cfg.merge_sources!r} needs an EAGLE-3 head and none ships for "
                                 f"this model: set eagle3_head=<checkpoint directory or hub id> (or 'random' for "
                                 f"tests), train one (`python -m specvocab.engine.jobs.train_eagle3 --model <name>`), "
                                 f"or drop eagle3 from merge_sources")
            if name == "eagle" and sub.eagle_head is None:
                raise MergeError(f"merge_sources={cfg.merge_sources!r} needs an EAGLE-2 head and none ships for "
                                 f"this model: set eagle_head=<checkpoint directory or hub id> (or 'random' for "
                                 f"tests), train one (`python -m specvocab.engine.jobs.train_eagle --model <name>`), "
                                 f"or drop eagle from merge_sources")
            try:
                drafter = make_drafter(target, sub)
            except ValueError as e:
                raise MergeError(f"merge_sources={cfg.merge_sources!r}: source {name!r} cannot run on this model: "
                                 f"{e}") from e
            if hasattr(drafter, "store_method"):
                # a deployment store of its own (engine.store.deployment_store): a plain unispec run on the same
                # target must not hand this one the rows it stored, nor take this one's
                drafter.store_method = f"merged:{drafter.store_method}"
            self.drafters.append(drafter)
        if profiles is None:
            profiles = {name: calibrated_profile(source_config(cfg, name, target), target, self.g, calibration)
                        for name in self.sources}
        self.calibrated = {name: profiles.get(name) is not None for name in self.sources}
        self.prior = [prior_profile(profiles.get(name), self.g) for name in self.sources]     # [g] per source
        self._reset()

    def _reset(self):
        k = len(self.sources)
        self.placed = np.zeros((k, self.g), dtype=np.int64)        # steps the source's r-th node was placed
        self.hits = np.zeros((k, self.g), dtype=np.int64)          # ... and on the committed path
        self.accepted_by = np.zeros(k, dtype=np.int64)
        self.placed_by = np.zeros(k, dtype=np.int64)
        self.accepted_drafts = 0
        self.steps = 0
        self._last: MergedTree | None = None
        self._t = {"merge": 0.0}

    def gains(self) -> list[list[float]]:
        """a_s(r) for every source, r = 1..g: the prior refined by the run's measured acceptance (module docstring)."""
        w = PRIOR_WEIGHT
        return [((self.hits[s] + w * self.prior[s]) / (self.placed[s] + w)).tolist() for s in range(len(self.sources))]

    # -- what the harness hands begin() --------------------------------------------------------------------------
    @property
    def uses_prefill_logits(self) -> bool:
        return any(getattr(d, "uses_prefill_logits", True) for d in self.drafters)

    def _row_wants(self, prompt_ids):
        """Per source: None (the last row alone), "all" (every row) or its rows [r] int64."""
        out = []
        for d in self.drafters:
            if not getattr(d, "uses_prefill_logits", True):
                out.append(None)
            elif getattr(d, "prefill_topk", None):
                out.append("all")                                  # top-K ids of every row: it takes them itself
            else:
                rows = d.prefill_rows(prompt_ids)
                out.append("all" if rows is None else rows.to(prompt_ids.device))
        return out

    def prefill_rows(self, prompt_ids):
        """The union of the sources' rows (ascending, ending at L - 1); None when one needs every row."""
        wants = [w for w in self._row_wants(prompt_ids) if w is not None]
        if any(isinstance(w, str) for w in wants):
            return None
        last = torch.tensor([prompt_ids.numel() - 1], device=prompt_ids.device)
        return torch.unique(torch.cat([*wants, last]))

    def begin(self, prompt_ids, prefill_logits, prefill_hidden):
        self._reset()
        prompt_ids = prompt_ids.reshape(-1)
        L = prompt_ids.numel()
        wants = self._row_wants(prompt_ids)
        have = None                                                # the prompt positions of prefill_logits' rows
        if self.uses_prefill_logits:
            rows = self.prefill_rows(prompt_ids)
            have = torch.arange(L, device=prompt_ids.device) if rows is None else rows
        for d, want in zip(self.drafters, wants):
            if want is None or have is None:
                logits = prefill_logits[-1:]
            elif isinstance(want, str):
                logits = prefill_logits                            # MicroSpec reads [L, V] as well as top-K ids
            else:
                logits = prefill_logits[torch.searchsorted(have, want)]
            d.begin(prompt_ids, logits, prefill_hidden)

    def propose(self, ids):
        trees = [d.propose(ids) for d in self.drafters]
        t0 = time.perf_counter()
        for name, t in zip(self.sources, trees):
            if t.draft_probs is not None:
                raise MergeError(f"source {name!r} proposed sampled children (draft_probs) — a merged tree verifies "
                                 f"point-mass candidates only")
        self._last = merge_trees(trees, self.gains(), self.g)
        self._t["merge"] += time.perf_counter() - t0
        self.steps += 1
        return self._last.tree

    def observe(self, step: StepResult):
        for d in self.drafters:
            d.observe(step)
        last = self._last
        if last is None:
            return
        t0 = time.perf_counter()
        acc = step.accepted.reshape(-1).tolist()                   # node indices, root first
        committed = acc[1: 1 + min(len(acc) - 1, int(step.new_tokens.numel()))]   # drafts kept after a cut
        owner = last.owner.tolist()
        for node in committed:
            self.accepted_by[owner[node]] += 1
        self.accepted_drafts += len(committed)
        on_path = set(committed)
        for s, nodes in enumerate(last.rank_node):
            r = len(nodes)
            self.placed[s, :r] += 1
            self.hits[s, :r] += np.fromiter((m in on_path for m in nodes), dtype=np.int64, count=r)
        self.placed_by += np.bincount(last.owner[1:].numpy(), minlength=len(self.sources))
        self._last = None
        self._t["merge"] += time.perf_counter() - t0

    def timings(self):
        out: dict[str, float] = dict(self._t)
        for d in self.drafters:
            for k, v in d.timings().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def stats(self):
        out: dict[str, float] = {}
        for d in self.drafters:
            if hasattr(d, "stats"):
                out.update(d.stats())
        out.update({f"accepted_by_{s}": float(self.accepted_by[i]) for i, s in enumerate(self.sources)})
        out.update({f"placed_by_{s}": float(self.placed_by[i]) for i, s in enumerate(self.sources)})
        out["accepted_draft_tokens"] = float(self.accepted_drafts)
        out["steps"] = float(self.steps)
        return out
