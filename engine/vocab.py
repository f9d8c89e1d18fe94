"""Draft-vocabulary policies: which rows of the LM head a drafter scores at each step.

Words as in the glossary (`locality.__doc__`). A policy wraps the drafter's LM head `weight [V, d]` and
answers `logits(h [r, d]) -> (logits [r, m] fp32, slot_to_token [m] or None)`: m slots, each standing
for one full-vocabulary token (None = slot i is token i). Drafters take their top-k over the slots and
map them back, so draft token ids are always full-vocabulary ids. Slots outside the active vocab are
-inf. Every policy reports `stats()`: `mean_active_vocab`, `max_active_vocab` (over steps) and the
coverage of the committed tokens by the vocabulary the drafter had at that step.

Policies (`cfg.vocab`):

- `full`      the whole head, m = V (EAGLE-2).
- `frspec`    FR-Spec: a static top-K of a frequency list (`cfg.frequency_file`, made by `engine.jobs.frequency`,
              whose `default_frequency_file` counts one on the training corpus for a tokenizer), K =
              `frspec_k` clipped to the ids the list ranks (never-seen ids are not ranked); the K rows are
              packed once.
- `microspec` MicroSpec (§3.2): the active vocab is the distinct tokens among the
              last `w_max` entries of the candidate stream S (Eq. 4), fed live:
                begin:      S_init = prompt ⊕ union of the target's top-k_pre at every prompt position (Eq. 2)
                each step:  S ⊕= C_draft (the draft tree's tokens) ⊕ C_ver (the target's top-k_ver at the
                            verify rows) (Eq. 3)
              switches: `sources` ctx+ext | ctx (S_init only) | ext (S_init = top-k_pre of the last prompt
              position, A6); `ver_rows` accepted_path | last | all_tree (A1); `draft_tree_tokens`
              final | all_expanded (A2); `window_mode` eq4_exact | fifo_unique (A4). Orders (A3): the
              prefill union keep-first in row-then-rank order (`prefill_order` "first", locality.stream's
              default; "last" = by last occurrence); C_draft in tree node order (root included), C_ver in
              row order then rank, both keep-first. Backed by `kernels.streams.PackedLMHead` (device
              window state, packed [w_max, d] buffer, gather on a copy stream, masked dense head).
- `oracle`    "acceptance of full at the cost of a tiny head" (spec section 3.7). Every head call runs a
              tiny head for real - the dense [w_max, d] packed head with its masked log-softmax and top-k,
              result discarded - and that is the time charged to `lm_head`. The proposals come from the
              full head, whose time is recorded apart as `oracle_uncharged` and subtracted from
              `lm_head` by the drafter; the oracle's end-to-end speed is tokens / (wall - oracle_uncharged).
              Its active vocab is reported as w_max (the charged head's rows).

The pure stream builders (`prefill_entries`, `step_entries`, `ordered_unique`) are shared by the live
policy and by `replay_trace` (feeding a recorded `locality.Trace` through the policy).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch

from engine.config import POLICIES
from engine.dynaspec import DynaSpecHead, FittedDynaSpec, find_fitted, load_dynaspec
from engine.timing import PhaseTimer
from kernels.head import packed_head
from kernels.streams import PackedLMHead
from kernels.tensor_ops import first_occurrence
from locality.shortlist import load_ranking
from locality.stream import step_bounds

class VocabError(ValueError):
    """A vocabulary policy cannot be built or fed as asked; the message names the problem and the fix."""


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
        raise VocabError(f"unknown sources {sources!r}; choose ctx+ext, ctx or ext (MicroSpec §4.5, Table 3)")
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
    raise VocabError(f"unknown ver_rows {ver_rows!r}; choose accepted_path, last or all_tree (the paper does not say which verify rows; accepted_path is our default)")


# --- the drafter's LM-head step ----------------------------------------------------------------------------

def head_topk(logits: torch.Tensor, slot_to_token: torch.Tensor | None, k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [r, m] -> (log-probs [r, k'], full-vocabulary token ids [r, k']), k' = min(k, m).
    The log-softmax renormalises over the m slots (empty slots are -inf and get probability 0)."""
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(max=0.0)   # [r, m]; <= 0 keeps scores monotone
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    ids = top.indices if slot_to_token is None else slot_to_token[top.indices]
    # a -inf candidate (fewer live slots than k) may map to an empty slot (-1): give it a harmless id;
    # it is dropped from the tree, and so are its descendants (their scores are -inf too)
    ids = torch.where(torch.isfinite(top.values), ids.long(), torch.zeros_like(ids, dtype=torch.long))
    return top.values, ids


# --- policies ----------------------------------------------------------------------------------------------

def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.where(torch.isfinite(logits), torch.tanh(logits / cap) * cap, logits)   # keeps -inf slots


class VocabPolicy:
    """Base: the full head. Subclasses restrict it. See the module docstring for the protocol."""

    name = "full"

    def __init__(self, weight: torch.Tensor, cfg, *, softcap: float | None = None, timer=None):
        if weight.dim() != 2:
            raise VocabError(f"the LM head weight must be [V, d], got {tuple(weight.shape)}")
        self.weight = weight                                   # [V, d]
        self.cfg = cfg
        self.softcap = softcap
        self.timer = timer or PhaseTimer(weight.device)
        self.vocab_size, self.hidden_size = weight.shape
        self.device = weight.device
        self._sizes: list[torch.Tensor] = []                   # per step |I_t| (0-d device tensors)
        self._hits = torch.zeros(2, dtype=torch.float64, device=self.device)   # committed tokens covered, bonus covered
        self._n = torch.zeros(2, dtype=torch.float64, device=self.device)

    # protocol ---------------------------------------------------------------------------------------
    def begin(self, prompt_ids: torch.Tensor, prefill_logits: torch.Tensor | None) -> None:
        self._sizes = []
        self._hits.zero_()
        self._n.zero_()

    def observe(self, step, tried_tokens: torch.Tensor | None = None) -> None:
        self._count_coverage(step.new_tokens)

    def route(self, tokens: torch.Tensor, parent_h: torch.Tensor, t: int) -> None:
        """Called by the drafter before its backbone runs the rows whose head call comes next (draft step t;
        t = 0: the root, with h_root): their tokens [r] and the hidden states that proposed them [r, d].
        Only DynaSpec's router reads them (DynaSpec §4.2-4.3)."""

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self._check_h(h)
        return _softcap(torch.nn.functional.linear(h, self.weight).float(), self.softcap), None

    def head_topk(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's LM-head step: log-probs [r, k'] and full-vocabulary ids [r, k']."""
        return head_topk(*self.logits(h), k)

    def active_size(self) -> torch.Tensor | int:
        return self.vocab_size

    def active_mask(self) -> torch.Tensor | None:
        """[V] bool membership of the current active vocab (None = every token)."""
        return None

    def record_step(self) -> None:
        """Called once per drafted step, after drafting: remembers |I_t| (no sync)."""
        size = self.active_size()
        self._sizes.append(size if isinstance(size, torch.Tensor) else torch.tensor(size))

    def stats(self) -> dict[str, float]:
        """mean/max active vocab over steps, coverage of committed / bonus tokens. Syncs: call after decoding."""
        out = {"vocab_size": float(self.vocab_size)}
        if self._sizes:
            sizes = torch.stack([s.to("cpu", torch.float64) for s in self._sizes])
            out.update(mean_active_vocab=float(sizes.mean()), max_active_vocab=float(sizes.max()))
        n, hits = self._n.cpu(), self._hits.cpu()
        if n[0] > 0:
            out.update(coverage=float(hits[0] / n[0]), bonus_coverage=float(hits[1] / n[1]))
        return out

    # helpers ----------------------------------------------------------------------------------------
    def _check_h(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.hidden_size:
            raise VocabError(f"hidden states have width {h.shape[-1]} but the LM head expects d={self.hidden_size}; "
                             f"the drafter's hidden size must match the head it projects with")
        return h.to(self.weight.dtype)

    def _count_coverage(self, new_tokens: torch.Tensor) -> None:
        """Coverage (glossary): committed tokens of this step that were in the vocabulary the drafter had;
        the bonus token (last) is the non-trivial part (accepted draft tokens are in I by construction)."""
        mask = self.active_mask()
        if mask is None:
            inside = torch.ones(new_tokens.numel(), dtype=torch.float64, device=self.device)
        else:
            inside = mask[new_tokens.to(mask.device).long()].double()
        self._hits += torch.stack([inside.sum(), inside[-1]])
        self._n += torch.tensor([float(new_tokens.numel()), 1.0], dtype=torch.float64, device=self.device)


class FullVocab(VocabPolicy):
    name = "full"


def load_frequency_ranking(path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """Token ids, most frequent first, from a ranking written by `locality.shortlist.save_ranking` (Parquet +
    JSON sidecar; checked against `vocab_size`; ids it never counted are left out), or from .npy / .pt / .txt
    (one id per line) files, e.g. `engine.jobs.frequency`'s lists (a sidecar `<file>.json` is checked too)."""
    path = Path(path)
    if not path.exists():
        raise VocabError(f"frequency file {path} does not exist; build one with `python -m engine.jobs.frequency` "
                         f"and pass frequency_file=<path>")
    side = path.with_name(path.name + ".json")
    if path.suffix != ".parquet" and side.exists() and vocab_size is not None:
        made_for = json.loads(side.read_text()).get("vocab_size")
        if made_for not in (None, vocab_size):
            raise VocabError(f"frequency file {path} was made for a vocabulary of {made_for} ids but the model has "
                             f"{vocab_size}; count a list with the target's tokenizer (python -m engine.jobs.frequency)")
    if path.suffix == ".parquet":
        frame = load_ranking(path, vocab_size=vocab_size).sort("rank")
        ranking = frame["token_id"].to_numpy()[frame["count"].to_numpy() > 0]   # never-seen ids are not ranked
    elif path.suffix == ".npy":
        ranking = np.load(path)
    elif path.suffix == ".pt":
        ranking = torch.load(path, map_location="cpu")
    elif path.suffix == ".txt":
        ranking = np.loadtxt(path, dtype=np.int64, ndmin=1)
    else:
        raise VocabError(f"cannot read frequency file {path}: use a ranking written by locality.shortlist "
                         f"(.parquet), or .npy, .pt or .txt (token ids, most frequent first)")
    ranking = np.asarray(ranking.tolist() if hasattr(ranking, "tolist") else ranking, dtype=np.int64).reshape(-1)
    if ranking.size == 0:
        raise VocabError(f"frequency file {path} holds no token ids; rebuild it from a non-empty corpus")
    return ranking


class FrSpecVocab(VocabPolicy):
    """Static top-K of a frequency ranking (FR-Spec); the K rows are packed once at construction."""

    name = "frspec"

    def __init__(self, weight, cfg, *, softcap=None, timer=None, ranking=None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        if ranking is None:
            if cfg.frequency_file is None:
                raise VocabError("vocab='frspec' needs a frequency ranking: build one with "
                                 "`python -m locality.shortlist` and pass frequency_file=<path>")
            ranking = load_frequency_ranking(cfg.frequency_file, self.vocab_size)
        ranking = torch.as_tensor(np.asarray(ranking), dtype=torch.long).reshape(-1)
        if ranking.numel() and (int(ranking.max()) >= self.vocab_size or int(ranking.min()) < 0):
            raise VocabError(f"the frequency ranking holds token id {int(ranking.max())} outside this model's "
                             f"vocabulary of {self.vocab_size}; build it with the same tokenizer as the target")
        _, first = np.unique(ranking.numpy(), return_index=True)
        ranking = ranking[np.sort(first)]                       # keep-first, in case of repeats
        self.k = min(cfg.frspec_k, self.vocab_size, ranking.numel())   # K clipped to V (and to what is ranked)
        if cfg.frspec_k > self.k < self.vocab_size:
            warnings.warn(f"frspec_k={cfg.frspec_k} exceeds the {ranking.numel()} ids the frequency list ranks "
                          f"(tokens its corpus showed + kept specials): the shortlist's true size is {self.k}",
                          stacklevel=2)
        self.ids = ranking[: self.k].to(self.device)            # [K] full-vocab ids, most frequent first
        self.packed = weight[self.ids].contiguous()             # [K, d]
        self.mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        self.mask[self.ids] = True

    def logits(self, h):
        h = self._check_h(h)
        return _softcap(torch.nn.functional.linear(h, self.packed).float(), self.softcap), self.ids

    def active_size(self):
        return self.k

    def active_mask(self):
        return self.mask


class MicroSpecVocab(VocabPolicy):
    """MicroSpec's in-context vocabulary (module docstring), on `kernels.streams.PackedLMHead`."""

    name = "microspec"

    def __init__(self, weight, cfg, *, softcap=None, timer=None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        _check_w_max(cfg.w_max, self.vocab_size)
        for name in ("k_pre", "k_ver"):
            if getattr(cfg, name) > self.vocab_size:
                raise VocabError(f"{name}={getattr(cfg, name)} is larger than the vocabulary ({self.vocab_size}); "
                                 f"use {name} <= {self.vocab_size} (the paper uses 3)")
        if cfg.sources not in ("ctx+ext", "ctx", "ext"):
            raise VocabError(f"unknown sources {cfg.sources!r}; choose ctx+ext, ctx or ext")
        if cfg.draft_tree_tokens not in ("final", "all_expanded"):
            raise VocabError(f"unknown draft_tree_tokens {cfg.draft_tree_tokens!r}; choose final or all_expanded (A2)")
        ver_row_index(torch.zeros(1, dtype=torch.long), 1, cfg.ver_rows)   # validates the name
        self.head = PackedLMHead(weight, cfg.w_max, mode=cfg.window_mode)
        self.w_max = cfg.w_max

    # id-level entry points (used live and by replay_trace) ---------------------------------------------
    def begin_ids(self, prompt_ids: torch.Tensor, prefill_topk: torch.Tensor) -> None:
        """prefill_topk [L, K >= k_pre]: the target's top-K at every prompt position, best first."""
        VocabPolicy.begin(self, prompt_ids, None)
        if prefill_topk.shape[-1] < self.cfg.k_pre:
            raise VocabError(f"k_pre={self.cfg.k_pre} is larger than the K={prefill_topk.shape[-1]} top-k ids "
                             f"available per prompt position; record more (record_topk / --topk) or lower k_pre")
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
                             f"per verify row; record more (record_topk / --topk) or lower k_ver")
        with self.timer.phase("gather"):
            entries = step_entries(draft_tokens.to(self.device), ver_topk[:, : self.cfg.k_ver])   # -1 padded
            # All of them: the window skips the -1 lanes before it keeps the last w_max entries (Eq. 4), so
            # a step bringing more than w_max padded entries still ends with the last w_max real ones.
            self.head.update(entries)

    # live protocol ----------------------------------------------------------------------------------
    def begin(self, prompt_ids, prefill_logits):
        if prefill_logits is None or prefill_logits.dim() != 2 or prefill_logits.shape[0] != prompt_ids.numel():
            got = None if prefill_logits is None else tuple(prefill_logits.shape)
            raise VocabError(f"microspec needs the target's logits at all {prompt_ids.numel()} prompt positions "
                             f"([L, V], Eq. 2), got {got}; run the prefill LM head over every position")
        with self.timer.phase("gather"):
            topk = prefill_logits.topk(self.cfg.k_pre, dim=-1).indices         # [L, k_pre]
        self.begin_ids(prompt_ids, topk)

    def observe(self, step, tried_tokens=None):
        self._count_coverage(step.new_tokens)                   # against I_t, before the update
        if self.cfg.sources == "ctx":
            return
        with self.timer.phase("gather"):
            rows = ver_row_index(step.accepted.to(step.logits.device), step.logits.shape[0], self.cfg.ver_rows)
            ver_topk = step.logits[rows].topk(self.cfg.k_ver, dim=-1).indices   # [rows, k_ver]
            if self.cfg.draft_tree_tokens == "all_expanded" and tried_tokens is not None:
                draft = torch.cat([step.tree.tokens[:1].to(self.device), tried_tokens.to(self.device)])
            else:
                draft = step.tree.tokens
        self.observe_ids(draft, ver_topk)

    def logits(self, h):
        h = self._check_h(h)
        return _softcap(self.head.logits(h), self.softcap), self.head.tok_of_slot.long()

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


class OracleVocab(VocabPolicy):
    """Full-vocabulary proposals, tiny-head cost (module docstring)."""

    name = "oracle"

    def __init__(self, weight, cfg, *, softcap=None, timer=None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        _check_w_max(cfg.w_max, self.vocab_size)
        self.w_max = cfg.w_max
        self.tiny = weight[: cfg.w_max].contiguous()                                 # [w_max, d]
        self.tiny_tok = torch.arange(cfg.w_max, dtype=torch.int32, device=self.device)  # [w_max]

    def head_topk(self, h, k):
        h = self._check_h(h)
        head_topk(_softcap(packed_head(h, self.tiny, self.tiny_tok), self.softcap), self.tiny_tok.long(), k)  # charged
        with self.timer.phase("oracle_uncharged"):
            return head_topk(*self.logits(h), k)

    def active_size(self):
        return self.w_max


# --- DynaSpec ----------------------------------------------------------------------------------------------

class DynaSpecVocab(VocabPolicy):
    """DynaSpec's routed cluster shortlists (DynaSpec §4.2-4.3; the pieces are in `engine.dynaspec`).

    Before the backbone runs a tree level the drafter calls `route(tokens, parent_h, t)`: the router picks
    each row's top-k_c(t) clusters (`dynaspec_k_max`, `dynaspec_budget`, `dynaspec_k_min`), on its own
    stream on CUDA. `logits(h)` runs the head once over the union of the level's shortlists, each row
    masked to its own. The clusters and router come from `cfg.dynaspec_file`, or when None from the newest
    DynaSpec in `<specvocab cache>/dynaspec/` fitted for this LM head and drafter (`find_fitted`).
    Active vocab of a step = its mean per-row shortlist (the paper's "vocab size", Table 1); coverage counts
    committed tokens inside the union of the step's shortlists; `stats()` adds `mean_row_vocab` (over all
    rows) and `mean_union_vocab` / `max_union_vocab` (rows of W the head read per call)."""

    name = "dynaspec"

    def __init__(self, weight, cfg, *, softcap=None, timer=None, fitted: FittedDynaSpec | None = None):
        super().__init__(weight, cfg, softcap=softcap, timer=timer)
        if fitted is None:
            fitted = load_dynaspec(cfg.dynaspec_file or find_fitted(weight, cfg), weight)
        self.head = DynaSpecHead(fitted, weight, k_max=cfg.dynaspec_k_max, budget=cfg.dynaspec_budget,
                                 k_min=cfg.dynaspec_k_min)

    def begin(self, prompt_ids, prefill_logits):
        super().begin(prompt_ids, prefill_logits)
        self.head.reset()

    def route(self, tokens, parent_h, t):
        with self.timer.phase("router"):
            self.head.route(tokens, parent_h, t)

    def logits(self, h):
        logits, idx = self.head.logits(self._check_h(h))
        return _softcap(logits, self.softcap), idx

    def active_size(self):
        return self.head.step_row_mean()

    def active_mask(self):
        return self.head.step_mask

    def stats(self):
        return {**super().stats(), **self.head.stats()}


def _check_w_max(w_max: int, vocab_size: int) -> None:
    if w_max <= 0 or w_max > vocab_size:
        raise VocabError(f"w_max={w_max} must be in [1, V={vocab_size}] (the window can never hold more distinct "
                         f"tokens than the vocabulary); the paper uses 3072 for V of 128k-152k")


_POLICIES = {"full": FullVocab, "frspec": FrSpecVocab, "microspec": MicroSpecVocab, "oracle": OracleVocab,
             "dynaspec": DynaSpecVocab}


def make_policy(cfg, weight: torch.Tensor, *, softcap: float | None = None, timer=None) -> VocabPolicy:
    """The policy `cfg.vocab` over LM head `weight [V, d]`."""
    if cfg.vocab not in _POLICIES:
        raise VocabError(f"unknown vocab policy {cfg.vocab!r}; choose one of {list(POLICIES)}")
    return _POLICIES[cfg.vocab](weight, cfg, softcap=softcap, timer=timer)


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
        raise VocabError(f"event_order={event_order!r}; choose 'token' or 'engine' (see locality.stream)")
    if event_order == "token" and drafts is not None and len(drafts) != T:
        raise VocabError(f"the trace has {len(drafts)} draft_tokens lists for {T} generated tokens; the token "
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
