"""EAGLE-2 dynamic draft trees for drafters that end in an LM head (`layerskip`, `eagle`).

Words as in the glossary (`locality.__doc__`). One step of drafting (MicroSpec §4.1,
FR-Spec's EAGLE-2 with `--eagle-num-iter 5 --eagle-tree-size 60`, per-node top-k 10):

- depth 1: the backbone's hidden state at the root -> LM head -> log-softmax -> top-k: k candidates,
  score = their log-prob;
- depth j = 2..depth: the k best candidates of depth j-1 (the *frontier*) run through the backbone
  (k rows, tree attention to their ancestors), LM head, top-k per row: k*k candidates with cumulative
  log-prob = parent's + own; the k best of them by cumulative log-prob are the next frontier;
- the draft tree: the root plus the `total_tokens - 1` best of all candidates scored
  (k + k*k*(depth-1)) by cumulative log-prob, in creation order (BFS by depth). A child never scores
  above its parent (log-probs <= 0, and fp addition is monotone), and ties go to the earlier-created
  node (a stable sort), so the selection is closed under ancestors. `scores` = cumulative probability.

So there are `depth` LM-head calls and `depth - 1` tree forwards of the backbone per step.

The LM head goes through a vocabulary policy (`engine.vocab`): `policy.logits(h [r, d])` returns
`(logits [r, m], slot_to_token [m] or None)` and `policy.head_topk(h, k)` takes the log-softmax over the
m slots and the top-k, mapped back to full-vocabulary ids, so draft token ids are always full-vocabulary
ids. Slots outside the active vocab are -inf and never proposed (a candidate with score -inf is dropped;
a choice where the MicroSpec paper is silent).

Sampling mode: the children of a node are the deterministic top-k of the draft distribution, so the
tree carries no `draft_probs` (one-hot q). `engine.verify.verify_sampling` then examines siblings in
descending score and accepts child x with probability P(x) under the residual target distribution,
which is exactly lossless whatever the draft distribution is. Sampling children from q instead would
not be: EAGLE-2's pruning keeps children by their value, so the survivors are not i.i.d. draws from q
and recursive rejection sampling would be biased.

Phases timed per drafter (`timings()`, seconds since `begin`): `backbone` (catch-up of committed
tokens + tree forwards + cache compaction), `lm_head` (policy head + log-softmax + top-k), `tree`
(selection and tree build), `gather` (the policy's stream update, window step and row gather; on CUDA
the gather itself runs on a copy stream and only the wait lands in `lm_head`), `draft_prefill` (the
drafter's and its policy's pass over the prompt in `begin`, not part of any step: the policy's first
gather is moved here from `gather`), `oracle_uncharged` (oracle policy only:
its full head, already subtracted from `lm_head`), `router` (dynaspec policy only: its router, called
through `policy.route` before the backbone runs each level; on CUDA it runs on a side stream). `stats()`:
steps drafted, mean/max active vocab, coverage of the committed tokens by the vocab the drafter had.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from specvocab.engine.timing import PhaseTimer
from specvocab.engine.tree import DraftTree, Drafter, StepResult
from specvocab.engine.models import tokenizer_name
from specvocab.engine.vocab import make_policy
from specvocab.engine.vocab.dynaspec import drafter_key as dynaspec_drafter_key


class DrafterError(ValueError):
    """A drafter cannot be built for this target/config; the message names the mismatch and the fix."""


# --- tree expansion (pure: a backbone callable and a head callable in, a tree out) ----------------------

# head(h [r, d], k) -> (log-probs [r, k'], full-vocabulary ids [r, k']): a policy's `head_topk`
HeadFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
# forward(tokens [r], parent_h [r, d], tree_mask [r, T + r] bool, depth) -> h [r, d]; T = tree rows the
# backbone ran before in this step (its cache holds them); tree_mask[i, j] = tree row j is node i or
# one of its ancestors (the committed context is always visible).
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class Expansion:
    tree: DraftTree
    tried_tokens: torch.Tensor     # [n_tried] every candidate scored, in creation order (A2 all_expanded)
    tree_row: torch.Tensor         # [n] per tree node: row of the step's tree forwards that ran it, -1 = none
    num_tree_rows: int             # rows the backbone ran for this tree (its cache holds them until rollback)


def expand_tree(root: int | torch.Tensor, h_root: torch.Tensor, forward: ForwardFn, head: HeadFn, *,
                depth: int, topk: int, total_tokens: int,
                timer: PhaseTimer | None = None, prune: bool = False) -> Expansion:
    """EAGLE-2 dynamic tree (see the module docstring). h_root [1, d]: the backbone's hidden state at the
    root, ready for the head. `timer` (optional) gets the `lm_head` and `tree` phases; `forward` times
    its own work.

    prune: expand only what can reach the final tree of g = total_tokens - 1 nodes - min(topk, g) children
    per node and frontier nodes per level, min(depth, g) levels. The tree is the same: a child never scores
    above its parent, so a final node's parent is final too, and fewer than g tried nodes outrank it, hence
    it sits in the top g of its level and its node among its parent's top g children (ties keep creation
    order, as the sorts here do). What shrinks is the work: at g = 3 a level runs 3 rows instead of
    EAGLE-2's 10, and 3 levels instead of 5. `tried_tokens` then holds fewer candidates (MicroSpec's A2
    `all_expanded` source reads them: it keeps prune off)."""
    if prune:
        g = max(1, total_tokens - 1)
        topk, depth = min(topk, g), min(depth, g)
    timer = timer or PhaseTimer("cpu")
    dev = h_root.device
    with timer.phase("lm_head"):
        logp, ids = head(h_root, topk)                                  # [1, k1]
    with timer.phase("tree"):
        k1 = ids.shape[1]
        tried_tok, tried_score = [ids[0]], [logp[0]]                  # per depth, concatenated at the end
        tried_parent = [torch.full((k1,), -1, dtype=torch.long, device=dev)]   # -1 = child of the root
        ran_idx, ran_row = [], []                                       # candidates the backbone ran
        n_tried = k1
        front_idx = torch.arange(k1, device=dev)                        # [r] tried index of each frontier node
        front_tok, front_score = ids[0], logp[0]                        # [r], [r]
        front_parent_h = h_root.expand(k1, -1)                          # [r, d]
        tree_mask = torch.eye(k1, dtype=torch.bool, device=dev)         # [r, T + r]
        rows_done = 0
    for j in range(1, depth):
        h = forward(front_tok, front_parent_h, tree_mask, j)            # [r, d]
        r = h.shape[0]
        with timer.phase("lm_head"):
            logp, ids = head(h, topk)                                   # [r, kk]
        with timer.phase("tree"):
            ran_idx.append(front_idx)
            ran_row.append(rows_done + torch.arange(r, device=dev))
            rows_done += r
            kk = ids.shape[1]
            cum = (front_score[:, None] + logp).reshape(-1)             # [r*kk] cumulative log-prob
            child_idx = n_tried + torch.arange(r * kk, device=dev)
            tried_tok.append(ids.reshape(-1))
            tried_score.append(cum)
            tried_parent.append(front_idx.repeat_interleave(kk))
            n_tried += r * kk
            order = torch.sort(cum, descending=True, stable=True).indices[:topk]   # next frontier
            parent_row = order // kk
            front_idx, front_tok, front_score = child_idx[order], ids.reshape(-1)[order], cum[order]
            front_parent_h = h[parent_row]
            tree_mask = torch.cat([tree_mask[parent_row],
                                   torch.eye(order.numel(), dtype=torch.bool, device=dev)], dim=1)
    with timer.phase("tree"):
        tok = torch.cat(tried_tok)                                      # [n_tried]
        score = torch.cat(tried_score)
        parent = torch.cat(tried_parent)
        row = torch.full((n_tried,), -1, dtype=torch.long, device=dev)
        if ran_idx:
            row[torch.cat(ran_idx)] = torch.cat(ran_row)
        sel = torch.sort(score, descending=True, stable=True).indices[: total_tokens - 1]
        sel = torch.sort(sel).values                                    # creation order = BFS by depth
        # -inf candidates (fewer live slots than top-k) are dropped; their descendants are -inf too.
        # Host sync: the tree's size is data-dependent and the harness needs the tree on the host.
        sel = sel[torch.isfinite(score[sel])]
        new_index = torch.full((n_tried,), -1, dtype=torch.long, device=dev)
        new_index[sel] = torch.arange(1, sel.numel() + 1, device=dev)
        par = parent[sel]
        tree_parents = torch.where(par < 0, torch.zeros_like(par), new_index[par.clamp(min=0)])
        root_t = torch.as_tensor(root, dtype=torch.long, device=dev).reshape(1)
        tree = DraftTree(tokens=torch.cat([root_t, tok[sel]]).cpu(),
                         parents=torch.cat([torch.tensor([-1], device=dev), tree_parents]).cpu(),
                         scores=torch.cat([torch.ones(1, device=dev), score[sel].exp()]).float().cpu())
        tree_row = torch.cat([torch.tensor([-1], device=dev), row[sel]])
    return Expansion(tree=tree, tried_tokens=tok, tree_row=tree_row, num_tree_rows=rows_done)


# --- the drafter base class ------------------------------------------------------------------------------

class LMHeadDrafter(Drafter, ABC):
    """A drafter whose backbone ends in an LM head, drafting EAGLE-2 trees through a vocabulary policy.

    Subclasses implement the backbone:
      `_backbone_begin(prompt_ids, prefill_hidden)`   the drafter's pass over the prompt
      `_catch_up(ids) -> h_root [1, d]`               feed committed tokens not yet in its cache
      `_forward_tree(tokens, parent_h, tree_mask, depth) -> h [r, d]`   (see `ForwardFn`)
      `_after_step(step, expansion)`                  roll back / compact its cache after verification
    and set `self.head_weight` ([V, d], the LM head the policy restricts) and `self.softcap`.
    """

    name = "lmhead"

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.device = next(target.parameters()).device
        self.timer = PhaseTimer(self.device)
        self.policy = None
        self._last: Expansion | None = None
        self.steps = 0
        self._begin_gather = 0.0          # the policy's gather in `begin`, reported as draft_prefill (`timings`)

    def _make_policy(self):
        self.policy = make_policy(self.cfg, self.head_weight, softcap=self.softcap, timer=self.timer,
                                  drafter_key=self.drafter_key(), tokenizer=tokenizer_name(self.target))

    def drafter_key(self) -> dict:
        """What a DynaSpec router fitted on this drafter's states is keyed by (`engine.vocab.dynaspec.drafter_key`)."""
        return dynaspec_drafter_key(self.cfg)

    @property
    def uses_prefill_logits(self) -> bool:
        """Only MicroSpec's window reads the prompt's logits (Eq. 2); the other policies and the backbone need
        the last row alone (the backbone reads the target's hidden states)."""
        return self.policy is None or self.policy.uses_prefill_logits

    @property
    def prefill_topk(self) -> int | None:
        """MicroSpec reads only each prompt row's top-K_pre ids (`engine.tree.PrefillTopK`)."""
        return None if self.policy is None else self.policy.prefill_topk

    # Drafter hooks ------------------------------------------------------------------------------------
    def begin(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        self.timer.reset()
        self.steps = 0
        self._last = None
        self.policy.begin(torch.as_tensor(prompt_ids).reshape(-1), prefill_logits)   # times `gather`
        # the policy's pass over the prompt (MicroSpec's first window, DynaSpec's prompt clusters) is no step's
        # gather: `timings` moves it to draft_prefill, so every phase is per drafted step (MicroSpec Fig. 4)
        self._begin_gather = self.timer.totals().get("gather", 0.0)
        with self.timer.phase("draft_prefill"):
            self._backbone_begin(torch.as_tensor(prompt_ids, device=self.device).reshape(-1), prefill_hidden)

    @torch.no_grad()
    def propose(self, ids: torch.Tensor) -> DraftTree:
        ids = torch.as_tensor(ids, device=self.device).reshape(-1)
        with self.timer.phase("backbone"):
            h_root = self._catch_up(ids)                                # [1, d]
        self.policy.route(ids[-1:], h_root, 0)                          # the root row of draft step 0
        self._last = expand_tree(ids[-1], h_root, self._timed_forward, self._head_topk,
                                 depth=self.cfg.eagle_depth, topk=self.cfg.eagle_topk,
                                 total_tokens=self.cfg.require_draft_size() + 1, timer=self.timer,
                                 prune=self.cfg.draft_tree_tokens != "all_expanded")
        self.policy.record_step()
        self.steps += 1
        return self._last.tree

    @torch.no_grad()
    def observe(self, step: StepResult) -> None:
        tried = None if self._last is None else self._last.tried_tokens
        self.policy.observe(step, tried)                                # window update + gather (timed)
        with self.timer.phase("backbone"):
            self._after_step(step, self._last)

    def timings(self) -> dict[str, float]:
        out = self.timer.totals()
        if self._begin_gather and "gather" in out:
            out["gather"] -= self._begin_gather
            out["draft_prefill"] = out.get("draft_prefill", 0.0) + self._begin_gather
        if "oracle_uncharged" in out:      # the oracle's full head runs inside lm_head but is not charged
            out["lm_head"] = out.get("lm_head", 0.0) - out["oracle_uncharged"]
        return out

    def stats(self) -> dict[str, float]:
        """Steps drafted and the vocabulary policy's active-vocab statistics."""
        return {"steps": float(self.steps), **self.policy.stats()}

    def _head_topk(self, h, k):
        """The LM-head step of the tree (`HeadFn`): the policy's head over the backbone's output (a drafter
        whose head input is not its backbone's output, EAGLE-3's final norm, overrides this)."""
        return self.policy.head_topk(h, k)

    def _timed_forward(self, tokens, parent_h, tree_mask, depth):
        self.policy.route(tokens, parent_h, depth)      # before the backbone, so a router can overlap it
        with self.timer.phase("backbone"):
            return self._forward_tree(tokens, parent_h, tree_mask, depth)

    # backbone hooks -----------------------------------------------------------------------------------
    @abstractmethod
    def _backbone_begin(self, prompt_ids: torch.Tensor, prefill_hidden: torch.Tensor | None) -> None:
        """The drafter's pass over the prompt (fills its own KV cache)."""

    @abstractmethod
    def _catch_up(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed committed tokens not yet in the drafter's cache; returns h_root [1, d]."""

    @abstractmethod
    def _forward_tree(self, tokens, parent_h, tree_mask, depth) -> torch.Tensor:
        """One tree level through the backbone: h [r, d] (see `ForwardFn`)."""

    @abstractmethod
    def _after_step(self, step: StepResult, expansion: Expansion | None) -> None:
        """Roll back / compact the drafter's cache after verification."""


# --- a KV cache the drafters own ---------------------------------------------------------------------------

class DraftKVCache:
    """A minimal KV cache for running a model's own decoder-layer modules outside its forward.

    Speaks the one method transformers' attention modules call (`update(k, v, layer_idx)`: append and
    return everything cached for that layer). Rows are slots; `length` slots are live. The committed
    context occupies slots [0, n_ctx); tree rows are appended after it during a step and dropped or
    compacted afterwards. No sliding-window truncation happens here: sliding layers see every slot and
    the attention mask (`position`-based) restricts them, so tree rows and rollbacks stay exact.
    """

    def __init__(self, layer_ids: list[int], capacity: int = 256):
        self.layer_ids = list(layer_ids)
        self.capacity = capacity
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.length = 0             # live slots (before this forward's update)
        self._pending = 0           # slots appended by the forward in flight
        self.positions = torch.zeros(capacity, dtype=torch.long)   # [capacity] position of each slot

    # transformers' Cache protocol (the parts decoder layers use) ---------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states [1, H, q, hd]
        q = key_states.shape[2]
        end = self.length + q
        if layer_idx not in self.k:
            shape = (1, key_states.shape[1], self.capacity, key_states.shape[3])
            self.k[layer_idx] = key_states.new_zeros(shape)
            self.v[layer_idx] = value_states.new_zeros(shape)
        self.k[layer_idx][:, :, self.length:end] = key_states
        self.v[layer_idx][:, :, self.length:end] = value_states
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # our own bookkeeping -------------------------------------------------------------------------------
    def reserve(self, q: int, device) -> None:
        """Make room for q more slots (doubling); call before a forward of q rows."""
        need = self.length + q
        if need <= self.capacity:
            return
        cap = self.capacity
        while cap < need:
            cap *= 2
        for store in (self.k, self.v):
            for i, t in store.items():
                grown = t.new_zeros((*t.shape[:2], cap, t.shape[3]))
                grown[:, :, : self.length] = t[:, :, : self.length]
                store[i] = grown
        pos = torch.zeros(cap, dtype=torch.long, device=self.positions.device)
        pos[: self.capacity] = self.positions
        self.positions = pos
        self.capacity = cap

    def advance(self, q: int, positions: torch.Tensor) -> None:
        """Mark the q slots written by the last forward as live, with their positions."""
        self.positions = self.positions.to(positions.device)
        self.positions[self.length:self.length + q] = positions
        self.length += q

    def crop(self, n: int) -> None:
        self.length = min(self.length, n)

    def keep_rows(self, n_ctx: int, rows: torch.Tensor) -> None:
        """Keep the context [0, n_ctx) and move the given slots (absolute, >= n_ctx, ascending) right
        after it: the accepted path's tree rows become committed context without recomputation."""
        m = rows.numel()
        if m:
            dst = torch.arange(n_ctx, n_ctx + m, device=rows.device)
            for store in (self.k, self.v):
                for t in store.values():
                    t[:, :, dst] = t[:, :, rows.to(t.device)]
            self.positions[dst.to(self.positions.device)] = self.positions[rows.to(self.positions.device)]
        self.length = n_ctx + m


def attention_bias(q_pos: torch.Tensor, kv_pos: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype,
                   sliding_window: int | None) -> torch.Tensor:
    """Additive mask [1, 1, q, kv] (0 = attend, dtype min = masked) from a visibility matrix
    visible [q, kv] bool; a sliding layer additionally needs q_pos - kv_pos < sliding_window
    (transformers' `sliding_window_overlay`)."""
    if sliding_window is not None:
        visible = visible & ((q_pos[:, None] - kv_pos[None, :]) < sliding_window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    bias.masked_fill_(~visible, torch.finfo(dtype).min)
    return bias[None, None]
