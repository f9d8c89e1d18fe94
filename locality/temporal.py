"""Temporal locality of generated tokens: reuse and LRU stack distances, and LRU vs FIFO vocabularies.

Two streams (`locality.stream`): `"generated"` = prompt ⊕ generated (token t looks back over prompt ⊕
generated[:t]: the in-context hit rate behind prompt lookup), and `"candidate"` = MicroSpec's S.

- reuse distance of token t: n_t - (latest occurrence of generated[t] in S[0:n_t]); a window of W covers it
  iff reuse distance <= W (FIFO, MicroSpec Eq. 4).
- stack distance: 1 + the number of distinct tokens in S after that occurrence; an LRU vocabulary of C
  unique tokens (I_t = the C most recently seen distinct tokens of S) covers it iff stack distance <= C.
  Its size is min(C, #distinct tokens in S[0:n_t]).
- `miss_ratio_curves` pairs, for each capacity C, the LRU vocabulary with the FIFO window whose MEAN active
  vocab matches: the smallest w_max whose mean |I_t| >= the LRU's mean size (found by bisection on w_max;
  one more entry in the window adds at most one token to each |I_t|, so the FIFO mean exceeds the LRU mean
  by less than one token).

Complexity: reuse distances O((N+Q) log N) (one sort, `StreamIndex`); stack distances O((N+Q) log N) more
(a wavelet matrix: per bit of N one cumsum and one stable partition over N, one gather over Q); each FIFO
bisection probe O(N_repeat) per capacity, ~log2(max |S|) probes.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import polars as pl

from specvocab.locality.coverage import with_groups, build_index, group_traces
from specvocab.locality.stream import NEVER, LocalityError, check_traces, check_windows
from specvocab.locality.trace import Trace

DEFAULT_BY = ("category", "language")
DEFAULT_CAPACITIES = (64, 128, 256, 512, 1024, 2048, 3072, 4096)


def token_distances(traces: Sequence[Trace], stream: Literal["candidate", "generated"] = "generated",
                    by: Sequence[str] = DEFAULT_BY, k_pre: int = 3, k_ver: int = 3, sources: str = "ctx+ext",
                    prefill_order: Literal["first", "last"] = "first",
                    event_order: Literal["token", "engine"] = "token") -> pl.DataFrame:
    """One row per queried generated token: the `by` meta columns, `trace` (index in `traces`), `step` (the
    step that committed it; = position in the "token" event order), `position` (t in `generated`), `token`,
    `reuse_distance` and `stack_distance` (null when the token never occurred before in the stream).

    `traces`: Traces, or token ids (one stream, or one per text; see `locality.trace.as_traces`). In the
    stream 1 2 3 3 3 2 (the first id is the prompt), the last 2 is 4 entries after its previous
    occurrence but only one distinct token (3) lies between them:

    >>> d = token_distances([1, 2, 3, 3, 3, 2], by=())
    >>> d["token"].to_list(), d["reuse_distance"].to_list(), d["stack_distance"].to_list()
    ([2, 3, 3, 3, 2], [None, None, 1, 1, 4], [None, None, 1, 1, 2])
    """
    traces = check_traces(traces)
    idx = build_index(traces, stream, k_pre, k_ver, sources, prefill_order, event_order)
    s = idx.stream
    reuse, stack = idx.reuse_distance, idx.stack_distance()
    cols = {c: [traces[r].meta.get(c) for r in range(len(traces))] for c in ([by] if isinstance(by, str) else by)}
    frame = pl.DataFrame({
        "trace": s.query_trace, "step": s.query_step, "position": s.query_position, "token": s.query_token,
        "reuse_distance": np.where(reuse == NEVER, -1, reuse),
        "stack_distance": np.where(stack == NEVER, -1, stack),
    }).with_columns(pl.when(pl.col(c) < 0).then(None).otherwise(pl.col(c)).alias(c)
                    for c in ("reuse_distance", "stack_distance"))
    meta = pl.DataFrame({"trace": np.arange(len(traces)), **cols},
                        schema_overrides={c: pl.String for c, v in cols.items() if all(x is None for x in v)})
    return meta.join(frame, on="trace", how="inner").select(*cols, "trace", "step", "position", "token",
                                                             "reuse_distance", "stack_distance")


def distance_histograms(traces: Sequence[Trace], by: Sequence[str] = DEFAULT_BY,
                        streams: Sequence[str] = ("generated", "candidate"), k_pre: int = 3, k_ver: int = 3,
                        sources: str = "ctx+ext", prefill_order: Literal["first", "last"] = "first",
                        event_order: Literal["token", "engine"] = "token") -> pl.DataFrame:
    """Power-of-two histograms of reuse and stack distances of generated tokens, per group and stream.

    Columns: `by..., stream, metric ("reuse_distance" | "stack_distance"), bin_lo, bin_hi, count, fraction,
    cum_fraction`; bins are [2^b, 2^(b+1) - 1]; the row with null bin_lo/bin_hi counts tokens never seen
    before. cum_fraction at bin_hi = the coverage of a FIFO window w_max = bin_hi (reuse distance) or of an
    LRU vocabulary of bin_hi tokens (stack distance).

    >>> h = distance_histograms([1, 2, 3, 3, 3, 2], by=(), streams=["generated"])
    >>> h.filter(pl.col("metric") == "reuse_distance").select("bin_lo", "bin_hi", "count").rows()
    [(1, 1, 2), (4, 7, 1), (None, None, 2)]
    """
    by = [by] if isinstance(by, str) else list(by)
    traces = check_traces(traces)
    frames = []
    for st in streams:
        d = token_distances(traces, st, by, k_pre, k_ver, sources, prefill_order, event_order)
        for metric in ("reuse_distance", "stack_distance"):
            v = d[metric].fill_null(0).to_numpy()
            lo = np.left_shift(1, np.frexp(np.maximum(v, 1))[1] - 1)       # 2^floor(log2 v), exact for ints
            lo = pl.Series("bin_lo", np.where(v > 0, lo, -1), dtype=pl.Int64).replace(-1, None)
            h = d.select(*by, lo).group_by(*by, "bin_lo").agg(pl.len().cast(pl.Int64).alias("count"))
            frames.append(h.with_columns(pl.lit(st).alias("stream"), pl.lit(metric).alias("metric"),
                                         (pl.col("bin_lo") * 2 - 1).alias("bin_hi")))
    out = pl.concat(frames, how="vertical_relaxed")
    keys = [*by, "stream", "metric"]
    out = out.sort([*keys, "bin_lo"], nulls_last=True).with_columns(
        (pl.col("count") / pl.col("count").sum().over(keys)).alias("fraction"))
    return out.with_columns(pl.col("fraction").cum_sum().over(keys).alias("cum_fraction")).select(
        *keys, "bin_lo", "bin_hi", "count", "fraction", "cum_fraction")


def _fifo_match(idx, targets: np.ndarray) -> np.ndarray:
    """[nC] the smallest w_max whose mean active vocab (over tokens) >= each target mean (vectorised bisection)."""
    tokens = idx.tokens
    top = max(int(idx.stream.query_pos.max(initial=1)), 1)            # beyond this nothing changes
    lo = np.ones(len(targets), dtype=np.int64)
    hi = np.full(len(targets), top, dtype=np.int64)
    while (lo < hi).any():
        mid = (lo + hi) // 2
        ok = idx.active_vocab_sums(mid) >= targets * tokens - 1e-9
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid + 1)
    return lo


def miss_ratio_curves(traces: Sequence[Trace], capacities=DEFAULT_CAPACITIES, by: Sequence[str] = ("category",),
                      stream: Literal["candidate", "generated"] = "candidate", k_pre: int = 3, k_ver: int = 3,
                      sources: str = "ctx+ext", prefill_order: Literal["first", "last"] = "first",
                      event_order: Literal["token", "engine"] = "token") -> pl.DataFrame:
    """Miss ratio of an LRU vocabulary of C unique tokens vs the FIFO window at equal mean size, per group.

    Columns: `by..., capacity, tokens, lru_mean_active_vocab, lru_miss_ratio, fifo_w_max,
    fifo_mean_active_vocab, fifo_miss_ratio` (micro-averages over the group's queried generated tokens).

    In the stream 1 2 3 3 3 2 (5 queries after the prompt id), an LRU vocabulary of 2 tokens still holds the
    last 2 (stack distance 2) and hits 3 of 5 tokens; its mean size is (1 + 2 + 2 + 2 + 2) / 5 = 1.8. The
    FIFO window of the same mean size is w_max = 3 (windows {1}, {1,2}, {1,2,3}, {2,3}, {3}), which has
    lost the 2 (reuse distance 4) and hits only the two repeated 3s:

    >>> f = miss_ratio_curves([1, 2, 3, 3, 3, 2], capacities=[2], by=(), stream="generated")
    >>> f.select("lru_mean_active_vocab", "lru_miss_ratio", "fifo_w_max", "fifo_miss_ratio").row(0)
    (1.8, 0.4, 3, 0.6)
    """
    caps = check_windows(capacities)
    traces = check_traces(traces)
    frames = []
    for values, members in group_traces(traces, by):
        sub = [traces[i] for i in members]
        idx = build_index(sub, stream, k_pre, k_ver, sources, prefill_order, event_order)
        tokens = idx.tokens
        if tokens == 0:
            raise LocalityError(f"group {values} has no generated tokens — drop empty traces or group differently")
        stack = np.sort(idx.stack_distance())
        distinct = idx.distinct_before()
        lru_mean = np.array([np.minimum(distinct, c).mean() for c in caps])
        lru_hit = np.searchsorted(stack, caps, side="right") / tokens
        w = _fifo_match(idx, lru_mean)
        frames.append(with_groups(pl.DataFrame({
            "capacity": caps, "tokens": np.full(len(caps), tokens),
            "lru_mean_active_vocab": lru_mean, "lru_miss_ratio": 1 - lru_hit,
            "fifo_w_max": w, "fifo_mean_active_vocab": idx.active_vocab_sums(w) / tokens,
            "fifo_miss_ratio": 1 - idx.coverage_counts(w) / tokens,
        }), values))
    return pl.concat(frames, how="vertical_relaxed")
