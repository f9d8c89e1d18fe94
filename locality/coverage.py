"""Ground-truth coverage of MicroSpec's windowed candidate stream, for every window size in one pass.

coverage(W) = (1/tokens) Sum_t 1[generated[t] in I_t], I_t = Unique(Suffix(S, W)) with S the candidate
stream before the step of token t appends (event orders in `locality.stream`); bonus_coverage(W) the same
over the last token of every step; mean_active_vocab(W) = (1/steps) Sum_s |I_s|. All are micro-averages over
the queried tokens (steps) of all traces given (MicroSpec §2.2, Fig. 1b: the ground-truth coverage). In the
default "token" event order every generated token is a step, so tokens = steps and bonus_coverage =
coverage; the "engine" order counts what the live drafter counts (`engine.vocab.MicroSpecVocab.stats()`).
`coverage_by` does the same per group of meta columns (category, language, ...), `coverage_report` prints
the per-category table of the README's main job.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import polars as pl

from specvocab.locality.stream import (LocalityError, StreamIndex, candidate_stream, check_traces, check_windows,
                             generated_stream)
from specvocab.locality.trace import Trace

DEFAULT_W = (1024, 2048, 3072, 4096, 8192)
REPORT_W = (1024, 2048, 3072, 8192)


def build_index(traces: Sequence[Trace], stream: Literal["candidate", "generated"] = "candidate",
                k_pre: int = 3, k_ver: int = 3, sources: str = "ctx+ext",
                prefill_order: Literal["first", "last"] = "first",
                event_order: Literal["token", "engine"] = "token") -> StreamIndex:
    """The one-pass index of the candidate stream (or of the plain prompt ⊕ generated stream)."""
    if stream == "candidate":
        return StreamIndex(candidate_stream(traces, k_pre, k_ver, sources, prefill_order, event_order))
    if stream == "generated":
        return StreamIndex(generated_stream(traces))
    raise LocalityError(f"stream={stream!r} — choose 'candidate' (MicroSpec's S) or 'generated' (prompt ⊕ generated)")


def window_frame(index: StreamIndex, w_max) -> pl.DataFrame:
    """One row per w_max: w_max, coverage, bonus_coverage, mean_active_vocab, tokens, steps, mean_stream_len
    (micro-averages: coverage over tokens, the others over steps)."""
    ws = check_windows(w_max)
    tokens, steps = index.tokens, index.steps
    nan = np.full(len(ws), np.nan)
    return pl.DataFrame({
        "w_max": ws,
        "coverage": index.coverage_counts(ws) / tokens if tokens else nan,
        "bonus_coverage": index.bonus_counts(ws) / steps if steps else nan,
        "mean_active_vocab": index.active_vocab_sums(ws, per="step") / steps if steps else nan,
        "tokens": np.full(len(ws), tokens, dtype=np.int64),
        "steps": np.full(len(ws), steps, dtype=np.int64),
        "mean_stream_len": np.full(len(ws), index.stream.query_pos[index.step_first].mean() if steps else np.nan),
    })


def coverage(traces: Sequence[Trace], w_max=DEFAULT_W, k_pre: int = 3, k_ver: int = 3,
             sources: str = "ctx+ext", prefill_order: Literal["first", "last"] = "first",
             stream: Literal["candidate", "generated"] = "candidate",
             event_order: Literal["token", "engine"] = "token") -> pl.DataFrame:
    """Coverage and mean active vocab of the window for every w_max, from one pass over all traces.

    `traces`: Traces, or token ids (one stream, or one per text; see `locality.trace.as_traces`).
    Columns: `w_max, coverage, bonus_coverage, mean_active_vocab, tokens, steps, mean_stream_len` (mean |S|
    at query time: the raw stream length, repeats included). `sources`: "ctx+ext" | "ctx" | "ext" (MicroSpec
    Table 3, see `locality.stream`); `event_order`: "token" | "engine" (see `locality.stream`);
    `stream="generated"` measures the plain prompt ⊕ generated stream instead: for a token stream, the
    window of the last w_max tokens before each token (the candidate stream needs recorded top-k rows).

    A stream of 6 tokens: the first is the prompt, the other 5 are queried. The 1 at stream position 2 was
    last seen 2 entries back, the 2 and 1 at positions 4 and 5 3 entries back, the 2 and 3 at positions 1
    and 3 never: a window of 2 covers 1 of 5 tokens, a window of 3 covers 3 of 5.

    >>> f = coverage([1, 2, 1, 3, 2, 1], w_max=[2, 3], stream="generated")
    >>> f["coverage"].to_list(), f["tokens"].to_list()
    ([0.2, 0.6], [5, 5])

    The windows before the 5 queries hold {1}, {1,2}, {2,1}, {1,3}, {3,2} distinct tokens for w_max = 2:

    >>> f["mean_active_vocab"].to_list()
    [1.8, 2.2]
    >>> coverage([1, 2, 1, 3, 2, 1], w_max=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    specvocab.locality.stream.LocalityError: traces[0] has no top-k rows (plain token ids) but ...
    """
    check_windows(w_max)
    return window_frame(build_index(traces, stream, k_pre, k_ver, sources, prefill_order, event_order), w_max)


def group_traces(traces: Sequence[Trace], by: Sequence[str]) -> list[tuple[dict, list[int]]]:
    """[(group values, trace indices)] for the meta columns `by`, sorted by value (None last)."""
    traces = check_traces(traces)
    by = [by] if isinstance(by, str) else list(by)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(traces):
        groups.setdefault(tuple(t.meta.get(c) for c in by), []).append(i)
    order = sorted(groups, key=lambda key: tuple((v is None, str(v)) for v in key))
    return [(dict(zip(by, key)), groups[key]) for key in order]


def with_groups(frame: pl.DataFrame, values: dict) -> pl.DataFrame:
    return frame.select([pl.lit(v, dtype=pl.String if v is None or isinstance(v, str) else None).alias(c)
                         for c, v in values.items()] + frame.columns)


def coverage_by(traces: Sequence[Trace], by: Sequence[str] = ("category",), w_max=DEFAULT_W, k_pre: int = 3,
                k_ver: int = 3, sources: str = "ctx+ext", prefill_order: Literal["first", "last"] = "first",
                stream: Literal["candidate", "generated"] = "candidate",
                event_order: Literal["token", "engine"] = "token") -> pl.DataFrame:
    """`coverage` per group of meta columns (tidy: the group columns, then one row per w_max)."""
    check_windows(w_max)
    traces = check_traces(traces)
    frames = []
    for values, idx in group_traces(traces, by):
        sub = [traces[i] for i in idx]
        frames.append(with_groups(coverage(sub, w_max, k_pre, k_ver, sources, prefill_order, stream, event_order),
                                  values))
    return pl.concat(frames, how="vertical_relaxed")


def coverage_report(traces: Sequence[Trace], w_max=REPORT_W, by: str = "category", k_pre: int = 3, k_ver: int = 3,
                    sources: str = "ctx+ext", prefill_order: Literal["first", "last"] = "first",
                    event_order: Literal["token", "engine"] = "token", show: bool = True) -> pl.DataFrame:
    """Per-`by` table (rows) of coverage and mean active vocab per w_max (columns), plus an "(all)" row.

    Returns the wide frame (`by, tokens, steps, coverage@W..., mean_active_vocab@W...`) and prints it.
    """
    ws = check_windows(w_max)
    traces = check_traces(traces)
    kw = dict(k_pre=k_pre, k_ver=k_ver, sources=sources, prefill_order=prefill_order, event_order=event_order)
    long = pl.concat([
        coverage_by(traces, [by], ws, **kw).with_columns(pl.col(by).cast(pl.String)),
        coverage(traces, ws, **kw).select(pl.lit("(all)").alias(by), pl.all()),
    ], how="vertical_relaxed")
    rows = []
    for key, g in long.group_by(by, maintain_order=True):
        row = {by: key[0], "tokens": int(g["tokens"][0]), "steps": int(g["steps"][0])}
        row.update({f"coverage@{w}": c for w, c in zip(g["w_max"], g["coverage"])})
        row.update({f"mean_active_vocab@{w}": a for w, a in zip(g["w_max"], g["mean_active_vocab"])})
        rows.append(row)
    wide = pl.DataFrame(rows)
    if show:
        n_tr = len(traces)
        print(f"MicroSpec window coverage ({sources}, k_pre={k_pre}, k_ver={k_ver}, {event_order} event order) over "
              f"{n_tr} trace(s); cov@W = coverage (over tokens), |I|@W = mean active vocab (over steps)")
        with pl.Config(tbl_cols=-1, tbl_rows=-1, tbl_width_chars=250, tbl_hide_dataframe_shape=True,
                       tbl_hide_column_data_types=True, float_precision=3):
            print(wide.rename({c: c.replace("coverage@", "cov@").replace("mean_active_vocab@", "|I|@")
                               for c in wide.columns}))
    return wide
