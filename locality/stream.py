"""The candidate stream of MicroSpec (MicroSpec §3.2, Eq. 2-4) built from traces, and the one-pass index that
answers every window size at once.

Event order of the candidate stream of one trace (`sources="ctx+ext"`, the paper's method)
-------------------------------------------------------------------------------------------
A trace holds `prompt [L]`, `prefill_topk [L-1, K]` (row i: prompt position i), `generated [T]` and
`step_topk [T, K]`, where `step_topk[t]` is the distribution that produced `generated[t]`; so `step_topk[0]`
comes from the last prompt position L-1 (it is a prompt position for Eq. 2 too). Two event orders share
S_init and differ in when entries are appended and which tokens are queried.

    S_init = prompt[0], ..., prompt[L-1]                                    (repeats kept)
           ⊕ Dedup(prefill_topk[0, :k_pre], ..., prefill_topk[L-2, :k_pre],
                   step_topk[0, :k_pre])                                    (Eq. 2: all L prompt positions)

`event_order="token"` (the default): one query per generated token, the window moves after every token.

    for t = 0 .. T-1:
        query  t : n_t = |S|;  I_t = Unique(S[max(0, n_t - w_max) : n_t]);  generated[t] covered iff in I_t
        append   : Dedup(draft_tokens[t])          (only if the trace has draft tokens; keep-first order)
        append   : step_topk[t, :k_ver]            (C_ver; top-K ids are distinct, appended as they are)

So query 0 sees S_init, which already holds the top-k_pre of row 0 (its top-1 is generated[0], so token 0 is
covered whenever that entry is inside the window); row 0's top-k_ver is appended right after query 0, i.e.
an offline replay of §2.2's ground-truth coverage (Fig. 1b: is the target's token y*_t in the vocabulary at
step t), appending TopK(z_t, K_ver) after every token. Each generated token is its own step here, as in
autoregressive decoding. `Dedup` keeps the first occurrence in row-then-rank order (`prefill_order="first"`,
the default asked for by this project); `prefill_order="last"` orders the prefill union by the position of
each token's last occurrence (Eq. 2 leaves the order of tuple(∪) open), which keeps the candidates of late
prompt positions nearest the window's end.

Draft tokens: either one list per generated token (`draft_tokens[t]` is appended after query t), or one
list per step together with `meta["step_sizes"]` (tokens committed by each step, the prefill's step 0
included): the tree of a step that commits tokens t..t+a is appended after query t+a, i.e. after the step,
and before the next step's first query (the last step's tree after the last query: it changes nothing).

`event_order="engine"`: the engine's own per-step window (`engine.vocab.MicroSpecVocab`, live). A step is
one draft-verify cycle (`meta["step_sizes"]`; without it every step committed one token); step s commits
generated[c[s] : c[s+1]] (`step_bounds`). The window is frozen during a step and all of the step's entries
are appended after it (Eq. 3, then Eq. 4 for the next step):

    for s = 1 .. S-1:                                  (step 0 is the prefill: its token is not queried)
        query  t, for c[s] <= t < c[s+1] : n = |S| (one n for the whole step); I_s = Unique(S[n - w_max : n])
        append : Dedup(root_s, draft_tokens[s])         (C_draft: the tree's tokens in node order, the root
                                                          root_s = generated[c[s] - 1] included; keep-first)
        append : Dedup(step_topk[c[s] : c[s+1], :k_ver]) (C_ver: the verify rows of the accepted path, row
                                                          order then rank; keep-first)

The bonus token of step s is its last token, generated[c[s+1] - 1]. This reproduces exactly the coverage and
bonus coverage the live drafter reports for `window_mode="eq4_exact"`, `ver_rows="accepted_path"`,
`draft_tree_tokens="final"` (the paper's settings; the other switches need rows a trace does not keep).

Sources (MicroSpec Table 3 ablation, §4.5)
------------------------------------------
- `"ctx+ext"`: everything above.
- `"ctx"` ("Ctx. Only": "restricted to tokens present in the input prompt and high-probability candidates
  from the prefill phase (S_init). No new candidates are added during decoding steps"): S = S_init; nothing
  is appended, every query sees the last w_max entries of S_init.
- `"ext"` ("Ext. Only": "solely of tokens from the draft tree and top candidates from the target model's
  latest verification ..., ignoring the prompt context"): S_init = step_topk[0, :k_pre] only (the last
  prompt position's candidates, without which nothing could be drafted), then the per-step appends above
  inside the same w_max window. (The reading with no window at all, I = C_draft ∪ C_ver of the latest step
  only, is not modelled.)

Flat layout and the one-pass index
----------------------------------
`Stream` concatenates many traces' streams (`tokens [N]`, `bounds [R+1]`) with their queries
(`query_pos [Q]` = n_t local to the trace, `query_token [Q]`, `query_trace [Q]`, `query_step [Q]`,
`query_position [Q]` = t). `StreamIndex` sorts one bit-packed int64 key per stream entry (trace | token |
2j+1) once and binary-searches the sorted query keys (trace | token | 2n; an entry j sorts before a query n
iff j < n): O(N log N + Q log N), then O(N + Q) passes. From that it reads off

- the reuse distance of each query, d = n - (latest occurrence of its token before n), NEVER if none;
  covered by a window of W iff d <= W, so coverage for every W is a searchsorted over the sorted d;
- the previous occurrence `prev[j]` of every entry, from which the active vocab size of every query and W is
  summed without a per-step loop: |Unique(S[a:n])| = (n - a) - #{j < n : prev[j] >= a}, a = max(0, n - W),
  and Sum_queries #{j < n : prev[j] >= n - W} = Sum_j #{queries n : j < n <= min(prev[j] + W, end)}
  = Sum_j max(0, Cq[min(prev[j] + W, end)] - Cq[j]) with Cq the cumulative count of query positions:
  O(N_repeat) gathers per window size (N_repeat = entries whose token occurred before in the trace);
  counting only each step's first query gives the sum over steps;
- LRU stack distances with a wavelet matrix over prev (see `StreamIndex.stack_distance`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from specvocab.locality.trace import Trace, TraceError, as_traces

SOURCES = ("ctx+ext", "ctx", "ext")
EVENT_ORDERS = ("token", "engine")
NEVER = np.int64(1) << np.int64(62)      # reuse/stack distance of a token that never occurred before
_CHUNK = 1 << 16                         # repeats per cache-resident chunk in StreamIndex.active_vocab_sums


class LocalityError(ValueError):
    """Bad arguments to a locality metric; the message names the argument and how to fix it."""


@dataclass(frozen=True)
class Stream:
    """Many traces' streams, concatenated, with one query per queried generated token. Queries are in trace
    order, then generated order, so the queries of one step are contiguous."""

    tokens: np.ndarray          # [N] int64 stream entries of all traces, trace after trace
    bounds: np.ndarray          # [R+1] int64: trace r owns tokens[bounds[r]:bounds[r+1]]
    query_pos: np.ndarray       # [Q] int64 n_t: stream length (local to its trace) when token t is queried
    query_token: np.ndarray     # [Q] int64 generated[t]
    query_trace: np.ndarray     # [Q] int64 r
    query_step: np.ndarray      # [Q] int64 the step that committed token t (= t in the "token" order)
    query_position: np.ndarray  # [Q] int64 t, the token's position in `generated`

    @property
    def num_traces(self) -> int:
        return len(self.bounds) - 1

    def trace_stream(self, r: int) -> np.ndarray:
        """[n_r] the stream entries of trace r."""
        return self.tokens[self.bounds[r]:self.bounds[r + 1]]

    @property
    def events(self) -> int:
        """Stream entries + queries: what a per-step simulation would touch once each."""
        return len(self.tokens) + len(self.query_pos)


# ---------------------------------------------------------------------------------------------------
# building streams
# ---------------------------------------------------------------------------------------------------

def check_k(k: int, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise LocalityError(f"{name} must be an int >= 0, got {k!r}")
    return int(k)


def check_windows(w_max) -> np.ndarray:
    """[nW] int64 window sizes, each >= 1."""
    ws = np.atleast_1d(np.asarray(w_max))
    if ws.size == 0:
        raise LocalityError("w_max is empty — pass one or more window sizes, e.g. w_max=[1024, 3072]")
    if not np.issubdtype(ws.dtype, np.integer) or (ws < 1).any():
        raise LocalityError(f"w_max must be integers >= 1 (stream entries), got {ws.tolist()}")
    return ws.astype(np.int64)


def check_traces(traces) -> list[Trace]:
    """A non-empty list of `Trace`s from any input `locality.trace.as_traces` accepts (Traces or token ids)."""
    traces = as_traces(traces)
    if not traces:
        raise LocalityError("the trace list is empty — read some with locality.read_traces(path), record them "
                            "with `specvocab record`, or pass token ids (one stream, or one per text)")
    return traces


def has_rows(t: Trace) -> bool:
    """Whether the trace holds any top-k row (prefill or step) for the stream to take from."""
    return bool(t.prefill_topk.shape[0] or t.step_topk.shape[0])


def _check_trace_k(t: Trace, k: int, what: str, i: int) -> None:
    if not has_rows(t):                                      # a trace with no rows has nothing to take
        return
    if k and t.k == 0:
        row = "prefill" if what == "k_pre" else "verify"
        raise LocalityError(f"traces[{i}] has no top-k rows (plain token ids) but the candidate stream takes the "
                            f"top-{k} of every {row} row ({what}={k}) — measure stream='generated' (the window "
                            "over the tokens themselves), pass k_pre=0, k_ver=0, or record traces with top-k rows "
                            "(`specvocab record`)")
    t.check_k(k, what)


def _dedup(flat: np.ndarray, order: str) -> np.ndarray:
    """Distinct ids of `flat` [n] in first-occurrence order, or ordered by their last occurrence."""
    if order == "last":
        return _dedup(flat[::-1], "first")[::-1]
    _, first = np.unique(flat, return_index=True)
    return flat[np.sort(first)]


def _dedup_ragged(tokens: np.ndarray, row: np.ndarray) -> np.ndarray:
    """Keep-first dedup of `tokens [n]` inside each row (`row [n]` ascending); returns a [n] keep mask."""
    if tokens.size == 0:
        return np.zeros(0, dtype=bool)
    key = row * (int(tokens.max()) + 1) + tokens
    _, first = np.unique(key, return_index=True)
    keep = np.zeros(tokens.size, dtype=bool)
    keep[first] = True
    return keep


def _stream_init(t: Trace, k_pre: int, sources: str, prefill_order: str) -> np.ndarray:
    """S_init of one trace (Eq. 2; "ext": the last prompt position's candidates only)."""
    last_row = t.step_topk[:1, :k_pre]                                   # [<=1, k_pre] prompt position L-1
    if sources == "ext":
        return last_row.reshape(-1)
    cands = np.concatenate([t.prefill_topk[:, :k_pre].reshape(-1), last_row.reshape(-1)])
    return np.concatenate([t.prompt, _dedup(cands, prefill_order)])


def _token_stream(t: Trace, k_pre: int, k_ver: int, sources: str, prefill_order: str):
    """(entries [n], query_pos [T], query_step [T], query_position [T]) of one trace, "token" order."""
    T = len(t.generated)
    init = _stream_init(t, k_pre, sources, prefill_order)
    tok = np.arange(T, dtype=np.int64)                                   # every token is its own step
    if sources == "ctx" or T == 0:
        return init, np.full(T, len(init), dtype=np.int64), tok, tok
    ver = t.step_topk[:, :k_ver]                                         # [T, k_ver]
    if t.draft_tokens is None:
        per_step = np.full(T, k_ver, dtype=np.int64)
        appended = ver.reshape(-1)
    else:
        lens = np.array([len(d) for d in t.draft_tokens], dtype=np.int64)
        draft = np.concatenate(t.draft_tokens) if lens.sum() else np.zeros(0, dtype=np.int64)
        step_of = np.repeat(draft_positions(t), lens)                   # [n_draft] generated position
        keep = _dedup_ragged(draft, step_of)
        draft, step_of = draft[keep], step_of[keep]
        n_draft = np.bincount(step_of, minlength=T)                      # [T] distinct draft tokens per step
        per_step = n_draft + k_ver
        # interleave: step t's draft tokens then its k_ver row, in one vectorised scatter
        offs = np.concatenate([[0], np.cumsum(per_step)[:-1]])           # [T] block start of each step
        appended = np.empty(int(per_step.sum()), dtype=np.int64)
        draft_start = np.concatenate([[0], np.cumsum(n_draft)[:-1]])
        appended[offs[step_of] + np.arange(len(draft)) - draft_start[step_of]] = draft
        ver_pos = (offs + n_draft)[:, None] + np.arange(k_ver)[None, :]  # [T, k_ver]
        appended[ver_pos.reshape(-1)] = ver.reshape(-1)
    query_pos = len(init) + np.concatenate([[0], np.cumsum(per_step)[:-1]])
    return np.concatenate([init, appended]), query_pos.astype(np.int64), tok, tok


def draft_positions(t: Trace) -> np.ndarray:
    """[len(draft_tokens)] the generated position after whose query each draft list is appended."""
    T, n = len(t.generated), len(t.draft_tokens)
    if n == T:
        return np.arange(T)
    sizes = t.meta.get("step_sizes")
    if sizes is not None and len(sizes) == n and (np.asarray(sizes) >= 0).all() and sum(sizes) >= T:
        return np.minimum(np.cumsum(np.asarray(sizes, dtype=np.int64)), T) - 1
    raise TraceError(f"trace has {n} draft_tokens lists but {T} generated tokens and no meta['step_sizes'] "
                     f"(tokens committed per step, {n} ints summing to >= {T}) — record step_sizes with the "
                     "draft trees, or store one list per generated token (see locality.stream)")


def step_bounds(t: Trace) -> np.ndarray:
    """[S+1] int64 c: step s committed generated[c[s]:c[s+1]]; step 0 is the prefill's one token.

    From `meta["step_sizes"]` (one int >= 1 per step, summing to >= T: a last step cut at an eos or
    max_new_tokens may be recorded whole), else one token per step (autoregressive decoding; then
    `draft_tokens`, if any, must hold one list per generated token)."""
    T = len(t.generated)
    sizes = t.meta.get("step_sizes")
    n = None if t.draft_tokens is None else len(t.draft_tokens)
    if sizes is None:
        if n is not None and n != T:
            raise TraceError(f"trace has {n} draft_tokens lists but {T} generated tokens and no "
                             f"meta['step_sizes'] — the engine event order needs the tokens committed per step "
                             f"(engine.harness.GenerateResult.to_trace writes them)")
        return np.arange(T + 1, dtype=np.int64)
    a = np.asarray(sizes)
    if (a.ndim != 1 or not np.issubdtype(a.dtype, np.integer) or (n is not None and len(a) != n)
            or (a < 1).any() or a.sum() < T or (T and a[0] != 1)):
        raise TraceError(f"meta['step_sizes'] = {list(sizes)} is not one int >= 1 per step "
                         f"({'any number of' if n is None else n} steps, the prefill's step 0 committing 1) "
                         f"summing to >= {T} generated tokens — re-record the trace with "
                         f"specvocab.engine.harness.GenerateResult.to_trace")
    return np.concatenate([[0], np.minimum(np.cumsum(a.astype(np.int64)), T)])


def _engine_stream(t: Trace, k_pre: int, k_ver: int, sources: str, prefill_order: str):
    """(entries [n], query_pos [Q], query_step [Q], query_position [Q]) of one trace, "engine" order."""
    init = _stream_init(t, k_pre, sources, prefill_order)
    c = step_bounds(t)                                                   # [S+1]
    S, T = len(c) - 1, len(t.generated)
    position = np.arange(min(1, T), T, dtype=np.int64)                   # [Q] every token but the prefill's
    step = np.searchsorted(c, position, side="right") - 1                # [Q] the step that committed it
    if sources == "ctx" or S <= 1:
        return init, np.full(len(position), len(init), dtype=np.int64), step, position
    steps = np.arange(1, S, dtype=np.int64)                              # the drafted steps
    # C_draft of step s: the root generated[c[s] - 1], then the tree's draft tokens in node order
    trees = [np.zeros(0, dtype=np.int64)] * S if t.draft_tokens is None else t.draft_tokens
    lens = np.array([len(trees[s]) for s in steps], dtype=np.int64) + 1  # [S-1] root included
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    draft = np.empty(int(lens.sum()), dtype=np.int64)
    draft[starts] = t.generated[c[1:S] - 1]
    if lens.sum() > len(lens):
        body = np.ones(len(draft), dtype=bool)
        body[starts] = False
        draft[body] = np.concatenate([trees[s] for s in steps])
    draft_step = np.repeat(steps, lens)
    # C_ver of step s: the top-k_ver of the rows that produced its tokens (the accepted path), row by row
    ver = t.step_topk[c[1]:c[S], :k_ver].reshape(-1)                      # [(c[S]-c[1]) * k_ver]
    ver_step = np.repeat(np.searchsorted(c, np.arange(c[1], c[S]), side="right") - 1, k_ver)
    keep_d, keep_v = _dedup_ragged(draft, draft_step), _dedup_ragged(ver, ver_step)   # keep-first, per step
    ent = np.concatenate([draft[keep_d], ver[keep_v]])
    ent_step = np.concatenate([draft_step[keep_d], ver_step[keep_v]])
    part = np.concatenate([np.zeros(int(keep_d.sum()), np.int64), np.ones(int(keep_v.sum()), np.int64)])
    order = np.argsort(2 * ent_step + part, kind="stable")                # per step: C_draft, then C_ver
    before = np.concatenate([[0], np.cumsum(np.bincount(ent_step, minlength=S))])   # [S+1] entries of steps < s
    return np.concatenate([init, ent[order]]), len(init) + before[step], step, position


def candidate_stream(traces: Sequence[Trace], k_pre: int = 3, k_ver: int = 3, sources: str = "ctx+ext",
                     prefill_order: Literal["first", "last"] = "first",
                     event_order: Literal["token", "engine"] = "token") -> Stream:
    """MicroSpec's candidate stream S of every trace, concatenated, with one query per generated token
    ("token" order) or per token a drafted step committed ("engine" order); see the module docstring."""
    traces = check_traces(traces)
    k_pre, k_ver = check_k(k_pre, "k_pre"), check_k(k_ver, "k_ver")
    if sources not in SOURCES:
        raise LocalityError(f"sources={sources!r} — choose one of {SOURCES} (MicroSpec Table 3)")
    if prefill_order not in ("first", "last"):
        raise LocalityError(f"prefill_order={prefill_order!r} — choose 'first' or 'last'")
    if event_order not in EVENT_ORDERS:
        raise LocalityError(f"event_order={event_order!r} — choose one of {EVENT_ORDERS} (see locality.stream)")
    build = _token_stream if event_order == "token" else _engine_stream
    parts, queries = [], []
    for i, t in enumerate(traces):
        _check_trace_k(t, k_pre, "k_pre", i)
        if sources != "ctx":
            _check_trace_k(t, k_ver, "k_ver", i)
        s, pos, step, position = build(t, k_pre, k_ver, sources, prefill_order)
        parts.append(s)
        queries.append((pos, step, position, t.generated[position]))
    return _assemble(parts, queries)


def generated_stream(traces: Sequence[Trace]) -> Stream:
    """The plain text stream: S = prompt ⊕ generated; step t queries generated[t] against prompt ⊕
    generated[:t] (prompt-lookup / in-context hit rate, MicroSpec §2.2). For token ids (`as_traces`), S is
    each text itself and every id after the first is queried; no top-k rows are needed."""
    traces = check_traces(traces)
    parts = [np.concatenate([t.prompt, t.generated]) for t in traces]
    queries = []
    for t in traces:
        tok = np.arange(len(t.generated), dtype=np.int64)
        queries.append((len(t.prompt) + tok, tok, tok, t.generated))
    return _assemble(parts, queries)


def _assemble(parts, queries) -> Stream:
    """parts: R stream arrays; queries: R tuples (query_pos, query_step, query_position, query_token)."""
    lens = np.array([len(p) for p in parts], dtype=np.int64)
    qlen = np.array([len(q[0]) for q in queries], dtype=np.int64)
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if len(xs) else np.zeros(0, np.int64)  # noqa: E731
    return Stream(
        tokens=cat(parts),
        bounds=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        query_pos=cat([q[0] for q in queries]),
        query_token=cat([q[3] for q in queries]),
        query_trace=np.repeat(np.arange(len(parts), dtype=np.int64), qlen),
        query_step=cat([q[1] for q in queries]),
        query_position=cat([q[2] for q in queries]),
    )


# ---------------------------------------------------------------------------------------------------
# the one-pass index
# ---------------------------------------------------------------------------------------------------

class StreamIndex:
    """Reuse distances, previous occurrences and per-window sums of one `Stream`, from one sort.

    Build: one `np.sort` of N int64 keys (trace | token | 2*position+1, bit-packed) and one `searchsorted`
    of the Q query keys (trace | token | 2*n): O(N log N + Q log N), plus O(N + Q) passes. Then
    `coverage_counts(ws)` costs O(nW log Q) and `active_vocab_sums(ws)` O(nW * N_repeat).
    """

    def __init__(self, stream: Stream):
        self.stream = s = stream
        R, N, Q = s.num_traces, len(s.tokens), len(s.query_pos)
        lens = np.diff(s.bounds)                                          # [R]
        tokens, qtok = s.tokens, s.query_token
        U = int(max(tokens.max(initial=-1), qtok.max(initial=-1))) + 1
        mb = (2 * int(max(lens.max(initial=0), s.query_pos.max(initial=0))) + 1).bit_length()
        rb = max(R - 1, 0).bit_length()
        if rb + max(U - 1, 0).bit_length() + mb > 62:     # relabel token ids densely so the key fits int64
            _, inv = np.unique(np.concatenate([tokens, qtok]), return_inverse=True)
            tokens, qtok, U = inv[:N], inv[N:], int(inv.max(initial=-1)) + 1
            if rb + max(U - 1, 0).bit_length() + mb > 62:
                raise LocalityError(f"{R} traces x {U} distinct tokens x streams of {int(lens.max())} entries "
                                    "do not fit one int64 sort key — split the trace list")
        tb = max(U - 1, 0).bit_length() + mb                              # shift of the trace field
        entry_trace = np.repeat(np.arange(R, dtype=np.int64), lens)        # [N]
        local2 = 2 * (np.arange(N, dtype=np.int64) - s.bounds[entry_trace]) + 1
        keys = np.sort((entry_trace << tb) | (tokens << mb) | local2)      # [N] sorted by (trace, token, pos)
        group = keys >> mb                                                # (trace, token)
        loc = (keys & ((1 << mb) - 1)) >> 1                               # [N] position inside the trace
        # an entry repeats iff the previous sorted key has the same (trace, token): that key is its prev
        rep = np.flatnonzero(group[1:] == group[:-1]) + 1                 # [N_rep] indices into keys
        self._rep_trace = keys[rep] >> tb                                 # [N_rep]
        self._rep_loc = loc[rep]                                          # [N_rep] j (local)
        self._rep_prev_loc = loc[rep - 1]                                 # [N_rep] prev[j] (local)
        self.num_repeats = len(rep)

        # queries: the latest entry with key < query key, if it has the same (trace, token). Sorted needles
        # make searchsorted ~8x faster; coverage needs only the multiset of reuse distances, so the
        # per-query order (`query_last`, `reuse_distance`) is restored lazily.
        qkey = (s.query_trace << tb) | (qtok << mb) | (2 * s.query_pos)   # [Q]
        qs = np.sort(qkey)
        at = np.searchsorted(keys, qs) - 1
        ok = at >= 0
        ok[ok] = group[at[ok]] == (qs[ok] >> mb)
        d = np.full(Q, NEVER, dtype=np.int64)
        d[ok] = ((qs[ok] & ((1 << mb) - 1)) >> 1) - loc[at[ok]]          # n - latest occurrence
        self._sorted_d = np.sort(d)
        self._query = (qkey, qs, ok, at, loc)      # for `query_last`, built on first use
        self._query_last = None

        # shifted slots: trace r occupies len_r + 1 slots, so a query at n = len_r never meets trace r+1
        small = N + R + 1 < 2 ** 31
        self._it = it = np.int32 if small else np.int64
        self._shift = shift = s.bounds[:-1] + np.arange(R)                # [R]
        rshift = shift[self._rep_trace]
        self._rep_slot = rshift + self._rep_loc                           # [N_rep] slot of the entry itself
        self._rep_prev_slot = (rshift + self._rep_prev_loc).astype(it)    # [N_rep]
        self._rep_end_slot = (rshift + lens[self._rep_trace]).astype(it)  # [N_rep]
        self._rep_gap = (self._rep_loc - self._rep_prev_loc).astype(it)   # [N_rep] j - prev[j] >= 1
        self._counted = {}                                                # per: (Cq, Cq at each repeat, n)
        self._prev = None
        # the queries of one step are contiguous: mark each step's first and last (bonus) query
        new = np.ones(Q, dtype=bool)
        new[1:] = (s.query_trace[1:] != s.query_trace[:-1]) | (s.query_step[1:] != s.query_step[:-1])
        self.step_first = new                                             # [Q]
        self.step_last = np.append(new[1:], True) if Q else new           # [Q]
        self._sorted_bonus_d = None

    @property
    def tokens(self) -> int:
        """Queried generated tokens."""
        return len(self.stream.query_pos)

    @property
    def steps(self) -> int:
        """Steps the queried tokens belong to (= tokens in the "token" event order)."""
        return int(self.step_first.sum())

    @property
    def query_last(self) -> np.ndarray:
        """[Q] local position of the latest occurrence of each query's token before it, or -1."""
        if self._query_last is None:
            qkey, qs, ok, at, loc = self._query
            found = np.full(len(qkey), -1, dtype=np.int64)
            found[ok] = loc[at[ok]]
            last = np.empty(len(qkey), dtype=np.int64)
            last[np.argsort(qkey, kind="stable")] = found   # equal keys have equal answers
            self._query_last, self._query = last, None
        return self._query_last

    @property
    def reuse_distance(self) -> np.ndarray:
        """[Q] reuse distance of each query (n - latest occurrence), NEVER if the token is new."""
        last = self.query_last
        return np.where(last >= 0, self.stream.query_pos - last, NEVER)

    @property
    def prev(self) -> np.ndarray:
        """[N] global index of the previous occurrence of each entry's token in its trace, or -1."""
        if self._prev is None:
            b = self.stream.bounds[self._rep_trace]
            prev = np.full(len(self.stream.tokens), -1, dtype=np.int64)
            prev[b + self._rep_loc] = b + self._rep_prev_loc
            self._prev = prev
        return self._prev

    def coverage_counts(self, ws) -> np.ndarray:
        """[nW] number of queries whose token is in the window of each w_max (reuse distance <= W)."""
        return np.searchsorted(self._sorted_d, check_windows(ws), side="right")

    def bonus_counts(self, ws) -> np.ndarray:
        """[nW] number of steps whose last queried token (the bonus token of a whole step) is in the window."""
        if self._sorted_bonus_d is None:
            self._sorted_bonus_d = np.sort(self.reuse_distance[self.step_last])
        return np.searchsorted(self._sorted_bonus_d, check_windows(ws), side="right")

    def _query_counts(self, per: str):
        """(Cq [N+R+1]: #counted queries at slots <= x, Cq at each repeat's own slot, counted query_pos)."""
        if per not in ("token", "step"):
            raise LocalityError(f"per={per!r} — choose 'token' (every query) or 'step' (one per step)")
        if per not in self._counted:
            s = self.stream
            sel = slice(None) if per == "token" else self.step_first
            qtrace, qpos = s.query_trace[sel], s.query_pos[sel]
            n_slots = len(s.tokens) + s.num_traces + 1
            cq = np.cumsum(np.bincount(self._shift[qtrace] + qpos, minlength=n_slots)).astype(self._it)
            self._counted[per] = (cq, cq[self._rep_slot], qpos)
        return self._counted[per]

    def active_vocab_sums(self, ws, per: Literal["token", "step"] = "token") -> np.ndarray:
        """[nW] Sum over queries (per="token") or over steps (per="step", the window of each step once) of
        |I_t| = |Unique(S[max(0, n-W):n])| for each window size W."""
        ws = check_windows(ws)
        cq, base, qpos = self._query_counts(per)
        out = np.empty(len(ws), dtype=np.int64)
        keep = self._rep_gap < int(ws.max())   # a repeat further back than every window never counts
        rp, re, rb = self._rep_prev_slot[keep], self._rep_end_slot[keep], base[keep]
        repeats = np.zeros(len(ws), dtype=np.int64)
        x = np.empty(min(len(rp), _CHUNK), dtype=rp.dtype)
        c = np.empty(min(len(rp), _CHUNK), dtype=rb.dtype)
        wl = ws.tolist()
        for a in range(0, len(rp), _CHUNK):    # chunks that stay in cache across the nW passes
            p_, e_, b_ = rp[a:a + _CHUNK], re[a:a + _CHUNK], rb[a:a + _CHUNK]
            xx, cc = x[:len(p_)], c[:len(p_)]
            for i, w in enumerate(wl):         # vectorised over the repeats; no per-step loop
                np.add(p_, w, out=xx)
                np.minimum(xx, e_, out=xx)     # last slot whose query still has prev[j] inside its window
                np.take(cq, xx, out=cc)
                cc -= b_                       # queries n with j < n <= min(prev[j] + W, end)
                np.maximum(cc, 0, out=cc)
                repeats[i] += int(cc.sum(dtype=np.int64))
        for i, w in enumerate(wl):
            out[i] = int(np.minimum(qpos, w).sum()) - repeats[i]
        return out

    def distinct_before(self) -> np.ndarray:
        """[Q] number of distinct tokens in the whole stream prefix S[0:n] of each query's trace."""
        s = self.stream
        first = np.concatenate([[0], np.cumsum(self.prev < 0)])          # [N+1]
        start = s.bounds[s.query_trace]
        return first[start + s.query_pos] - first[start]

    def stack_distance(self) -> np.ndarray:
        """[Q] LRU stack distance of each query: 1 + #distinct tokens in S[p+1:n] (p = latest occurrence
        of the query's token before n), NEVER if the token never occurred.

        #distinct in S[p+1:n] = #{j in [p+1, n) : prev[j] <= p} (first occurrences inside the range), a
        range-rank query answered for all queries at once by a wavelet matrix over prev+1: O((N+Q) log N)
        vectorised passes (one stable partition and one cumsum of N per bit, one gather of Q per bit).
        """
        s = self.stream
        found = self.query_last >= 0
        start = s.bounds[s.query_trace[found]]
        p = start + self.query_last[found]                                # [Qf] global latest occurrence
        lo, hi = p + 1, start + s.query_pos[found]
        count = range_count_less(self.prev + 1, lo, hi, p + 2)
        out = np.full(len(s.query_pos), NEVER, dtype=np.int64)
        out[found] = count + 1
        return out


def range_count_less(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, c: np.ndarray) -> np.ndarray:
    """[Q] #{i in [lo_q, hi_q) : values[i] < c_q} for non-negative int `values [N]`, by a wavelet matrix.

    One level per bit of max(values, c): the level stores the prefix count of zero bits and stably moves
    zero-bit values to the front; a query walks down the levels narrowing [lo, hi) to the values that
    agree with c on the higher bits, adding the zero-bit block whenever c has a one. O((N + Q) log max).
    """
    values = np.asarray(values, dtype=np.int64)
    lo, hi, c = (np.asarray(a, dtype=np.int64).copy() for a in (lo, hi, c))
    res = np.zeros(len(lo), dtype=np.int64)
    if len(lo) == 0:
        return res
    nbits = int(max(values.max(initial=0), c.max(initial=0))).bit_length()
    cur = values
    ar = np.arange(len(values), dtype=np.int64)
    for b in range(nbits - 1, -1, -1):
        bit = (cur >> b) & 1                                              # [N]
        zeros = np.concatenate([[0], np.cumsum(1 - bit)])                 # [N+1] rank of zero bits
        nz = zeros[-1]
        z_lo, z_hi = zeros[lo], zeros[hi]
        one = ((c >> b) & 1).astype(bool)
        res += np.where(one, z_hi - z_lo, 0)
        lo = np.where(one, nz + lo - z_lo, z_lo)
        hi = np.where(one, nz + hi - z_hi, z_hi)
        dest = np.where(bit == 0, zeros[:-1], nz + ar - zeros[:-1])       # stable partition by this bit
        nxt = np.empty_like(cur)
        nxt[dest] = cur
        cur = nxt
    return res
