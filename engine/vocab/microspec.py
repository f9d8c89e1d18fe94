"""MicroSpec (§3.2): the in-context draft vocabulary, a sliding window of W_max over the candidate stream.

The pure stream builders (`prefill_entries`, `step_entries`, `ordered_unique`) are shared by the live policy
(`MicroSpecVocab`, on `kernels.streams.PackedLMHead`) and by `replay_trace` (a recorded `locality.Trace` fed
through the policy). The switches and their defaults are described in `engine.vocab`.
"""

from __future__ import annotations

import numpy as np
import torch

from specvocab.engine.tree import PrefillTopK
from specvocab.engine.vocab.base import VocabError, VocabPolicy, check_w_max, softcap
from specvocab.kernels import cpu as cpu_kernels
from specvocab.kernels.streams import PackedLMHead
from specvocab.kernels.tensor_ops import first_occurrence
from specvocab.locality.stream import step_bounds


# --- pure stream builders (token ids in, padded token ids out; no host sync) ---------------------------------

def ordered_unique(ids: torch.Tensor, keep: str = "first") -> torch.Tensor:
    """ids [m] -> [m]: each distinct id >= 0 once, at its first (or last) occurrence, the other lanes -1.
    Fixed shape and no boolean indexing, so it never syncs; the window skips -1 entries."""
    ids = ids.reshape(-1).long()
    if keep == "first":
        mask = first_occurrence(ids)
    elif keep == "last":
        mask = first_occurrence(ids.flip(0)).flip(0)
    else:
        raise VocabError(f"keep must be 'first' or 'last', got {keep!r}")
    return torch.where(mask & (ids >= 0), ids, torch.full_like(ids, -1))


def prefill_entries(prompt_ids: torch.Tensor, prefill_topk: torch.Tensor, sources: str = "ctx+ext",
                    order: str = "first") -> torch.Tensor:
    """S_init (Eq. 2) as padded entries.

    prompt_ids [L]; prefill_topk [L, k_pre]: row i = the target's top-k_pre at prompt position i (row L-1
    predicts the first generated token). ctx+ext / ctx: the prompt (repeats kept), then the union of all
    rows, each token at its first (order="first") or last ("last") occurrence in row-then-rank order (A3).
    ext: only the last row's tokens (A6).
    """
    prompt_ids = prompt_ids.reshape(-1).long()
    if prefill_topk.dim() != 2 or prefill_topk.shape[0] != prompt_ids.numel():
        raise VocabError(f"prefill_topk must be [L, k_pre] with L = {prompt_ids.numel()} prompt positions, got "
                         f"{tuple(prefill_topk.shape)}")
    prefill_topk = prefill_topk.to(prompt_ids.device).long()
    if sources == "ext":
        return ordered_unique(prefill_topk[-1])
    if sources not in ("ctx+ext", "ctx"):
        raise VocabError(f"unknown sources {sources!r} — choose ctx+ext, ctx or ext (MicroSpec §4.5, Table 3)")
    return torch.cat([prompt_ids, ordered_unique(prefill_topk.reshape(-1), keep=order)])


def step_entries(draft_tokens: torch.Tensor, ver_topk: torch.Tensor) -> torch.Tensor:
    """One step's Eq. 3 entries: C_draft = the draft tokens keep-first (tree node order), then
    C_ver = ver_topk [rows, k_ver] flattened row by row, keep-first. Padded with -1."""
    return torch.cat([ordered_unique(draft_tokens), ordered_unique(ver_topk.reshape(-1).to(draft_tokens.device))])


def ver_row_index(accepted: torch.Tensor, n: int, ver_rows: str) -> torch.Tensor:
    """Rows of the target's verify logits whose top-k_ver enter the stream (A1)."""
    if ver_rows == "accepted_path":
        return accepted
    if ver_rows == "last":
        return accepted[-1:]
    if ver_rows == "all_tree":
        return torch.arange(n, device=accepted.device)
    raise VocabError(f"unknown ver_rows {ver_rows!r} — choose accepted_path, last or all_tree (the paper does not say "
                     f"which verify rows; accepted_path is our default)")


class MicroSpecVocab(VocabPolicy):
    """MicroSpec's in-context vocabulary (module docstring), on `kernels.streams.PackedLMHead`."""

    name = "microspec"
    uses_prefill_logits = True           # Eq. 2: the target's top-K_pre at every prompt position

    @property
    def prefill_topk(self) -> int:
        return self.cfg.k_pre

    def __init__(self, weight, cfg, *, softcap=None, timer=None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        check_w_max(cfg.w_max, self.vocab_size)
        for name in ("k_pre", "k_ver"):
            if getattr(cfg, name) > self.vocab_size:
                raise VocabError(f"{name}={getattr(cfg, name)} is larger than the vocabulary ({self.vocab_size}) — "
                                 f"use {name} <= {self.vocab_size} (the paper uses 3)")
        if cfg.sources not in ("ctx+ext", "ctx", "ext"):
            raise VocabError(f"unknown sources {cfg.sources!r} — choose ctx+ext, ctx or ext")
        if cfg.draft_tree_tokens not in ("final", "all_expanded"):
            raise VocabError(f"unknown draft_tree_tokens {cfg.draft_tree_tokens!r} — choose final or all_expanded (A2)")
        ver_row_index(torch.zeros(1, dtype=torch.long), 1, cfg.ver_rows)   # validates the name
        self.head = PackedLMHead(weight, cfg.w_max, mode=cfg.window_mode)
        self.w_max = cfg.w_max

    # id-level entry points (used live and by replay_trace) ---------------------------------------------
    def begin_ids(self, prompt_ids: torch.Tensor, prefill_topk: torch.Tensor) -> None:
        """prefill_topk [L, K >= k_pre]: the target's top-K at every prompt position, best first."""
        VocabPolicy.begin(self, prompt_ids, None)
        if prefill_topk.shape[-1] < self.cfg.k_pre:
            raise VocabError(f"k_pre={self.cfg.k_pre} is larger than the K={prefill_topk.shape[-1]} top-k ids "
                             f"available per prompt position — record more (record_topk / --topk) or lower k_pre")
        entries = prefill_entries(prompt_ids.to(self.device), prefill_topk[:, : self.cfg.k_pre], self.cfg.sources,
                                  self.cfg.prefill_order)
        with self.timer.phase("gather"):
            self.head.reset(entries)

    def observe_ids(self, draft_tokens: torch.Tensor, ver_topk: torch.Tensor) -> None:
        """One step: draft_tokens [n] (C_draft source, node order), ver_topk [rows, K >= k_ver]."""
        if self.cfg.sources == "ctx":
            return                                              # Ctx. Only: I stays Unique(Suffix(S_init))
        if ver_topk.shape[-1] < self.cfg.k_ver:
            raise VocabError(f"k_ver={self.cfg.k_ver} is larger than the K={ver_topk.shape[-1]} top-k ids available "
                             f"per verify row — record more (record_topk / --topk) or lower k_ver")
        with self.timer.phase("gather"):
            entries = step_entries(draft_tokens.to(self.device), ver_topk[:, : self.cfg.k_ver])   # -1 padded
            # All of them: the window skips the -1 lanes before it keeps the last w_max entries (Eq. 4), so
            # a step bringing more than w_max padded entries still ends with the last w_max real ones.
            self.head.update(entries)

    # live protocol ----------------------------------------------------------------------------------
    def begin(self, prompt_ids, prefill_logits):
        if isinstance(prefill_logits, PrefillTopK):             # the harness's top-K_pre ids (`prefill_topk`)
            if prefill_logits.ids.shape[0] != prompt_ids.numel():
                raise VocabError(f"microspec needs the target's top-{self.cfg.k_pre} at all {prompt_ids.numel()} "
                                 f"prompt positions (Eq. 2), got {prefill_logits.ids.shape[0]} rows")
            self.begin_ids(prompt_ids, prefill_logits.ids)
            return
        if prefill_logits is None or prefill_logits.dim() != 2 or prefill_logits.shape[0] != prompt_ids.numel():
            got = None if prefill_logits is None else tuple(prefill_logits.shape)
            raise VocabError(f"microspec needs the target's logits at all {prompt_ids.numel()} prompt positions "
                             f"([L, V], Eq. 2), got {got} — run the prefill LM head over every position")
        with self.timer.phase("gather"):
            topk = cpu_kernels.topk(prefill_logits, self.cfg.k_pre)[1]          # [L, k_pre] (C on CPU: one pass)
        self.begin_ids(prompt_ids, topk)

    def observe(self, step, tried_tokens=None):
        self._count_coverage(step.new_tokens)                   # against I_t, before the update
        if self.cfg.sources == "ctx":
            return
        with self.timer.phase("gather"):
            rows = ver_row_index(step.accepted.to(step.logits.device), step.logits.shape[0], self.cfg.ver_rows)
            ver_topk = cpu_kernels.topk(step.logits[rows], self.cfg.k_ver)[1]   # [rows, k_ver]
            if self.cfg.draft_tree_tokens == "all_expanded" and tried_tokens is not None:
                draft = torch.cat([step.tree.tokens[:1].to(self.device), tried_tokens.to(self.device)])
            else:
                draft = step.tree.tokens
        self.observe_ids(draft, ver_topk)

    def logits(self, h):
        h = self._check_h(h)
        return softcap(self.head.logits(h), self.softcap), self.head.tok_of_slot.long()

    def active_size(self):
        return self.head.active_size()

    def active_mask(self):
        return self.head.state.active

    def active_tokens(self) -> torch.Tensor:
        """The current active vocab I_t as sorted token ids (syncs)."""
        return self.head.state.active.nonzero().squeeze(1)

    def stats(self):
        out = super().stats()
        out.update(w_max=float(self.w_max), stream_len=float(self.head.state.stream_len))
        return out



# --- feeding a recorded trace through the live policy ------------------------------------------------------

def replay_trace(policy: "MicroSpecVocab", trace, event_order: str = "token") -> list[torch.Tensor]:
    """Feed a recorded `locality.Trace` through the live policy in one of `locality.stream`'s event orders;
    returns I (sorted token ids) at every query, as `locality.candidate_stream` queries them.

    Events: begin = the prompt + the top-K at all L prompt positions (`prefill_topk` rows, then
    `step_topk[0]`, the last position). "token": per generated token t, query I_t, append the trace's
    `draft_tokens[t]` (keep-first; none when the trace has no drafts) and the top-k_ver of `step_topk[t]`
    (T sets). "engine": per drafted step s, query I_s once for each token the step committed, then append
    the step's tree (its root, generated[c_s - 1], then `draft_tokens[s]`) and the top-k_ver of its rows
    `step_topk[c_s : c_s+1]`, as `observe` does live (T - 1 sets: the prefill's token is not drafted).
    """
    cfg = policy.cfg
    dev = policy.device
    T = len(trace.generated)
    drafts = trace.draft_tokens
    if event_order not in ("token", "engine"):
        raise VocabError(f"event_order={event_order!r} — choose 'token' or 'engine' (see locality.stream)")
    if event_order == "token" and drafts is not None and len(drafts) != T:
        raise VocabError(f"the trace has {len(drafts)} draft_tokens lists for {T} generated tokens — the token "
                         f"order needs one list per generated token (replay one list per step with "
                         f"event_order='engine')")
    trace.check_k(max(cfg.k_pre, cfg.k_ver if cfg.sources != "ctx" else 0), "k_pre/k_ver")
    prompt = torch.as_tensor(trace.prompt, device=dev)
    pre = torch.as_tensor(np.concatenate([trace.prefill_topk, trace.step_topk[:1]]), device=dev)   # [L, K]
    policy.begin_ids(prompt, pre)
    step_topk = torch.as_tensor(trace.step_topk, device=dev)        # [T, K]
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    out = []
    if event_order == "token":
        for t in range(T):          # a test/analysis utility: one window step per generated token
            out.append(policy.active_tokens())
            draft = empty if drafts is None else torch.as_tensor(drafts[t], dtype=torch.long, device=dev)
            policy.observe_ids(draft, step_topk[t: t + 1])
        return out
    c = step_bounds(trace).tolist()                                  # [S+1] step s committed c[s]:c[s+1]
    generated = torch.as_tensor(trace.generated, device=dev)
    for s in range(1, len(c) - 1):  # one window step per drafted step, frozen while the step is queried
        active = policy.active_tokens()
        out += [active] * (c[s + 1] - c[s])
        tree = empty if drafts is None else torch.as_tensor(drafts[s], dtype=torch.long, device=dev)
        policy.observe_ids(torch.cat([generated[c[s] - 1: c[s]], tree]), step_topk[c[s]: c[s + 1]])
    return out
