"""UniSpec's (Token Recycling's) successor store replayed as a stream: how often does the store row of the
root hold the next generated token in its top k?

The store (UniSpec App. A: Token Recycling's one-to-one n-gram store, an adjacency matrix) maps a token v
to the target's top-K next-token row the last time v was processed (overwrite semantics). Here it is filled
from the trace's own rows: position j of x = prompt ⊕ generated has input token x_j and row R_j =
prefill_topk[j] for j < L-1, step_topk[0] for j = L-1 (the last prompt position), step_topk[j-L+1] for
j >= L; positions are processed in order, so processing j writes store[x_j] = R_j. Token t is drafted from
store[root], root = x_{L+t-1} (prompt[-1] for t = 0), looked up just before the root itself is processed:
the row the root gets now is the target's answer, not a draft. Covered at k iff generated[t] is in
store[root][:k]. Every generated token is its own step here (as in autoregressive decoding), so the tables
count tokens.

- `from_prefill=True` writes the prompt positions (the store is updated from the prefill, default);
  False writes only positions >= L (the generated tokens).
- `persist=True` is UniSpec's deployment store (Alg. 1 initialises it once, before all prompts): it is kept
  across traces in list order, one store per `model` meta value; False starts every trace empty.
- Limitation: a real UniSpec step also writes the rows of rejected draft-tree nodes; a trace records only
  the committed positions, so this is the committed-path store.

One pass: a position is an entry of a stream (the dummy id U where nothing is written), a generated token
is a query for its root token; `StreamIndex` finds each root's latest earlier entry, then one vectorised row
compare gives the rank of generated[t] in that row, and coverage for k = 1..K is a cumulative histogram of ranks.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl

from specvocab.locality.coverage import with_groups, group_traces
from specvocab.locality.stream import LocalityError, Stream, StreamIndex, check_traces, has_rows
from specvocab.locality.trace import Trace


def successor_ranks(traces: Sequence[Trace], k: int | None = None, persist: bool = False,
                    from_prefill: bool = True) -> pl.DataFrame:
    """One row per generated token: `trace, position` (t), `store_hit` (the root has a row) and `rank`
    (0-based rank of generated[t] in the root's row[:k], null when there is no row or the token is not in it)."""
    traces = check_traces(traces)
    bare = next((i for i, t in enumerate(traces) if has_rows(t) and t.k == 0), None)
    if bare is not None:
        raise LocalityError(f"traces[{bare}] has no top-k rows (plain token ids) but the successor store is filled "
                            "from them — record traces with top-k rows (`specvocab record`)")
    ks = [t.k for t in traces if t.prefill_topk.shape[0] or t.step_topk.shape[0]]
    kk = min(ks) if k is None and ks else (k or 0)
    if k is not None:
        if k < 1:
            raise LocalityError(f"k must be >= 1, got {k}")
        for t in traces:
            if t.prefill_topk.shape[0] or t.step_topk.shape[0]:
                t.check_k(k, "k")
    # one stream per store: per trace (persist=False) or per model (persist=True), traces in list order
    store_of = (np.unique([str(t.meta.get("model")) for t in traces], return_inverse=True)[1] if persist
                else np.arange(len(traces)))
    n_store = int(store_of.max()) + 1
    dummy = max(int(max(t.prompt.max(), t.generated.max(initial=0))) for t in traces) + 1
    tok_parts: list[list[np.ndarray]] = [[] for _ in range(n_store)]
    row_parts: list[list[np.ndarray]] = [[] for _ in range(n_store)]
    offset = np.zeros(n_store, dtype=np.int64)
    q_pos, q_tok, q_store, q_y, q_trace, q_position = [], [], [], [], [], []
    for i, t in enumerate(traces):
        s, L, T = store_of[i], len(t.prompt), len(t.generated)
        x = np.concatenate([t.prompt, t.generated])                        # [L+T]
        rows = np.full((L + T, kk), -1, dtype=np.int64)                    # [L+T, k]; last row never written
        if L > 1:
            rows[:L - 1] = t.prefill_topk[:, :kk]
        if T:
            rows[L - 1:L - 1 + T] = t.step_topk[:, :kk]
        written = np.arange(L + T) < L + T - 1                            # position L+T-1 is never processed
        if not from_prefill:
            written &= np.arange(L + T) >= L
        tok_parts[s].append(np.where(written, x, dummy))
        row_parts[s].append(rows)
        q_pos.append(offset[s] + L - 1 + np.arange(T))                     # query before the root is processed
        q_tok.append(x[L - 1:L - 1 + T])                                   # root tokens
        q_store.append(np.full(T, s))
        q_y.append(t.generated)
        q_trace.append(np.full(T, i))
        q_position.append(np.arange(T))
        offset[s] += L + T
    cat = lambda xs: np.concatenate(xs).astype(np.int64)  # noqa: E731
    toks = [cat(p) for p in tok_parts]
    stream = Stream(tokens=cat(toks), bounds=np.concatenate([[0], np.cumsum([len(x) for x in toks])]),
                    query_pos=cat(q_pos), query_token=cat(q_tok), query_trace=cat(q_store),
                    query_step=cat(q_position), query_position=cat(q_position))
    idx = StreamIndex(stream)
    rows = np.concatenate([r for p in row_parts for r in p])              # [N, k] aligned with stream.tokens
    hit = idx.query_last >= 0
    at = stream.bounds[stream.query_trace] + np.maximum(idx.query_last, 0)
    y = cat(q_y)
    match = rows[at] == y[:, None]                                         # [Q, k]
    found = hit & match.any(axis=1)
    rank = np.where(found, match.argmax(axis=1), -1)
    return pl.DataFrame({"trace": cat(q_trace), "position": stream.query_position, "store_hit": hit,
                         "rank": rank}).with_columns(
        pl.when(pl.col("rank") >= 0).then(pl.col("rank")).otherwise(None).alias("rank"))


def successor_coverage(traces: Sequence[Trace], k: int | None = None, persist: bool = False,
                       from_prefill: bool = True, by: Sequence[str] = ()) -> pl.DataFrame:
    """Coverage of generated[t] by the store's top-k successors of its root, for every k = 1..K at once.

    Columns: the `by` meta columns, `k, coverage, store_hit_rate, tokens` (micro-averages over generated
    tokens). The store spans all traces (persist) whatever the grouping; groups only split the averaging.
    """
    traces = check_traces(traces)
    r = successor_ranks(traces, k, persist, from_prefill)
    kk = k if k is not None else min([t.k for t in traces if t.prefill_topk.shape[0] or t.step_topk.shape[0]]
                                     or [0])
    by = [by] if isinstance(by, str) else list(by)
    groups = group_traces(traces, by) if by else [({}, list(range(len(traces))))]
    rank = r["rank"].fill_null(kk).to_numpy()
    hit = r["store_hit"].to_numpy()
    trace_of = r["trace"].to_numpy()
    frames = []
    for values, members in groups:
        sel = np.isin(trace_of, members)
        tokens = int(sel.sum())
        hist = np.bincount(rank[sel], minlength=kk + 1)                    # rank kk = not in the row
        frames.append(with_groups(pl.DataFrame({
            "k": np.arange(1, kk + 1, dtype=np.int64),
            "coverage": np.cumsum(hist)[:kk] / max(tokens, 1),
            "store_hit_rate": np.full(kk, hit[sel].mean() if tokens else np.nan),
            "tokens": np.full(kk, tokens, dtype=np.int64),
        }), values))
    return pl.concat(frames, how="vertical_relaxed")
