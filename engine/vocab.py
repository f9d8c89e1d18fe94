"""Draft-vocabulary policies: which rows of the LM head a drafter scores at each step.

Words as in the glossary (`locality.__doc__`). A policy wraps the drafter's LM head `weight [V, d]` and
answers `logits(h [r, d]) -> (logits [r, m] fp32, slot_to_token [m] or None)`: m slots, each standing
for one full-vocabulary token (None = slot i is token i). Drafters take their top-k over the slots and
map them back, so draft token ids are always full-vocabulary ids. Slots outside the active vocab are
-inf. Every policy reports `stats()`: `mean_active_vocab`, `max_active_vocab` (over steps) and the
coverage of the committed tokens by the vocabulary the drafter had at that step.

Policies (`cfg.vocab`):

- `full`      the whole head, m = V (EAGLE-2).
- `frspec`    FR-Spec: a static top-K of a frequency ranking (`cfg.frequency_file`, made by
              `locality.shortlist`), K = `frspec_k` clipped to V; the K rows are packed once.
              `default_frequency_file` counts one on the bundled corpus (`CORPORA`) for a tokenizer.
- `microspec` MicroSpec (specs/microspec.md section 2): the active vocab is the distinct tokens among the
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

from pathlib import Path

import numpy as np
import torch

from kernels.tensor_ops import first_occurrence

POLICIES = ("full", "frspec", "microspec", "oracle")


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
        raise VocabError(f"unknown sources {sources!r}; choose ctx+ext, ctx or ext (specs/microspec.md 4.5)")
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
    raise VocabError(f"unknown ver_rows {ver_rows!r}; choose accepted_path, last or all_tree (specs/microspec.md A1)")


# --- policies ----------------------------------------------------------------------------------------------

def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.where(torch.isfinite(logits), torch.tanh(logits / cap) * cap, logits)   # keeps -inf slots


class VocabPolicy:
    """Base: the full head. Subclasses restrict it. See the module docstring for the protocol."""

    name = "full"

    def __init__(self, weight: torch.Tensor, cfg, *, softcap: float | None = None, timer=None):
        from engine.drafters.lmhead import PhaseTimer
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

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self._check_h(h)
        return _softcap(torch.nn.functional.linear(h, self.weight).float(), self.softcap), None

    def head_topk(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's LM-head step: log-probs [r, k'] and full-vocabulary ids [r, k']."""
        from engine.drafters.lmhead import head_topk
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
    JSON sidecar; checked against `vocab_size`), or from .npy / .pt / .txt (one id per line) files."""
    path = Path(path)
    if not path.exists():
        raise VocabError(f"frequency file {path} does not exist; build one with `python -m locality.shortlist` "
                         f"and pass frequency_file=<path>")
    if path.suffix == ".parquet":
        from locality.shortlist import load_ranking
        ranking = load_ranking(path, vocab_size=vocab_size).sort("rank")["token_id"].to_numpy()
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
        from kernels.streams import PackedLMHead
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
            entries = step_entries(draft_tokens.to(self.device), ver_topk[:, : self.cfg.k_ver])
            # Only the last w_max entries of S can be active: exact for eq4_exact; for fifo_unique it only
            # matters when one step brings more than w_max entries (w_max below ~75).
            self.head.update(entries[-self.w_max:])

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
        from engine.drafters.lmhead import head_topk
        from kernels.head import packed_head
        h = self._check_h(h)
        head_topk(_softcap(packed_head(h, self.tiny, self.tiny_tok), self.softcap), self.tiny_tok.long(), k)  # charged
        with self.timer.phase("oracle_uncharged"):
            return head_topk(*self.logits(h), k)

    def active_size(self):
        return self.w_max


def _check_w_max(w_max: int, vocab_size: int) -> None:
    if w_max <= 0 or w_max > vocab_size:
        raise VocabError(f"w_max={w_max} must be in [1, V={vocab_size}] (the window can never hold more distinct "
                         f"tokens than the vocabulary); the paper uses 3072 for V of 128k-152k")


_POLICIES = {"full": FullVocab, "frspec": FrSpecVocab, "microspec": MicroSpecVocab, "oracle": OracleVocab}


def make_policy(cfg, weight: torch.Tensor, *, softcap: float | None = None, timer=None) -> VocabPolicy:
    """The policy `cfg.vocab` over LM head `weight [V, d]`."""
    if cfg.vocab not in _POLICIES:
        raise VocabError(f"unknown vocab policy {cfg.vocab!r}; choose one of {list(POLICIES)}")
    return _POLICIES[cfg.vocab](weight, cfg, softcap=softcap, timer=timer)


# --- feeding a recorded trace through the live policy ------------------------------------------------------

def replay_trace(policy: "MicroSpecVocab", trace) -> list[torch.Tensor]:
    """Feed a recorded `locality.Trace` through the live policy in `locality.stream`'s event order; returns
    I_t (sorted token ids) before every generated token t, T sets.

    Events: begin = the prompt + the top-K at all L prompt positions (`prefill_topk` rows, then
    `step_topk[0]`, the last position); then per generated token t: query I_t, append the trace's
    `draft_tokens[t]` (keep-first; none when the trace has no drafts) and the top-k_ver of `step_topk[t]`.
    """
    cfg = policy.cfg
    dev = policy.device
    T = len(trace.generated)
    drafts = trace.draft_tokens
    if drafts is not None and len(drafts) != T:
        raise VocabError(f"the trace has {len(drafts)} draft_tokens lists for {T} generated tokens; replay needs one "
                         f"list per generated token (see locality.stream)")
    trace.check_k(max(cfg.k_pre, cfg.k_ver if cfg.sources != "ctx" else 0), "k_pre/k_ver")
    prompt = torch.as_tensor(trace.prompt, device=dev)
    pre = torch.as_tensor(np.concatenate([trace.prefill_topk, trace.step_topk[:1]]), device=dev)   # [L, K]
    policy.begin_ids(prompt, pre)
    step_topk = torch.as_tensor(trace.step_topk, device=dev)
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    out = []
    for t in range(T):          # a test/analysis utility: one window step per generated token
        out.append(policy.active_tokens())
        draft = empty if drafts is None else torch.as_tensor(drafts[t], dtype=torch.long, device=dev)
        policy.observe_ids(draft, step_topk[t: t + 1])
    return out


# --- a default FR-Spec ranking, counted once per tokenizer on the bundled corpus -----------------------------

# name -> (file under engine/data, dotted field of the texts, what it is). FR-Spec counts SlimPajama; offline,
# the bundled real text stands in: a chat model's answers (English) plus multilingual prompts.
CORPORA = {
    "rest_vicuna7b_mtbench": ("rest_vicuna7b_mtbench/baseline-vicuna-7b-v1.5-temperature-0.0-top_p-0.jsonl",
                              "choices.*.turns", "Vicuna-7B-v1.5 greedy answers to the 80 MT-Bench questions "
                                                 "(REST, Apache-2.0)"),
    "multilingual": ("multilingual/prompts.jsonl", "turns", "the 980 multilingual prompts (7 languages x 7 tasks)"),
}
DEFAULT_CORPORA = ("rest_vicuna7b_mtbench", "multilingual")


def corpus_texts(name: str) -> list[str]:
    """The texts of one bundled corpus (`CORPORA`)."""
    from locality.shortlist import read_texts

    if name not in CORPORA:
        raise VocabError(f"unknown corpus {name!r}; choose from {sorted(CORPORA)}")
    return read_texts(_corpus_file(name), CORPORA[name][1])


def _corpus_file(name: str) -> Path:
    from importlib import resources
    return Path(str(resources.files("engine").joinpath("data", *CORPORA[name][0].split("/"))))


def default_frequency_file(tokenizer, tokenizer_name: str, vocab_size: int,
                           corpora: tuple[str, ...] = DEFAULT_CORPORA, cache_dir: str | Path | None = None,
                           verbose: bool = True) -> Path:
    """A `locality.shortlist` ranking (Parquet + sidecar) of the bundled `corpora` tokenised with `tokenizer`
    over `vocab_size` ids - what `vocab='frspec'` uses when no `frequency_file` is given. Counted once and
    cached in `<specvocab cache>/rankings/` (`engine.models.cache_root`), keyed by tokenizer name, vocab size,
    corpus names and a digest of the corpus files. `tokenizer` None = a random model's byte tokenizer."""
    import hashlib
    import os

    from engine.models import cache_root
    import polars as pl

    from engine.prompts import ByteTokenizer
    from locality.shortlist import ShortlistError, load_ranking, ranking_from_texts, save_ranking

    if tokenizer is None:
        tokenizer, tokenizer_name = ByteTokenizer(), tokenizer_name or "bytes"
    if not tokenizer_name:
        raise VocabError("default_frequency_file needs the tokenizer's name (ModelInfo.tokenizer_name) to key its "
                         "cache; pass tokenizer_name=...")
    unknown = [c for c in corpora if c not in CORPORA]
    if unknown or not corpora:
        raise VocabError(f"unknown corpus {unknown or '(none)'}; choose from {sorted(CORPORA)}")
    digest = hashlib.sha256()
    for c in corpora:
        digest.update(_corpus_file(c).read_bytes())
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in tokenizer_name)
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "rankings"
    path = folder / f"{safe}-v{vocab_size}-{'+'.join(corpora)}-{digest.hexdigest()[:12]}.parquet"
    source = "; ".join(f"{c}: {CORPORA[c][2]}" for c in corpora)
    try:
        ranking = load_ranking(path, tokenizer=tokenizer_name, vocab_size=vocab_size)
        built = False
    except (ShortlistError, OSError, pl.exceptions.PolarsError):   # missing or unreadable: count (seconds)
        texts = [t for c in corpora for t in corpus_texts(c)]
        ranking = ranking_from_texts(texts, tokenizer, vocab_size)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.parquet")
        save_ranking(ranking, tmp, tokenizer=tokenizer_name, source=source)
        os.replace(tmp.with_name(tmp.name + ".json"), path.with_name(path.name + ".json"))
        os.replace(tmp, path)  # same content whoever writes last: concurrent builders cannot disagree
        built = True
    if verbose:
        seen = int((ranking["count"] > 0).sum())
        print(f"[specvocab] frspec ranking {'counted' if built else 'cached'}: {int(ranking['count'].sum())} "
              f"tokens, {seen} distinct of {vocab_size}, tokenizer {tokenizer_name}; corpus {source} -> {path}")
    return path
