"""Static shortlists (FR-Spec, VocabTrim): token-frequency rankings and their coverage of generated tokens.

A ranking is a polars frame `token_id, count, rank` with one row per vocabulary id (0 .. vocab_size-1),
sorted by rank (0-based). Ids are ranked by count, descending; ties by first occurrence in the counted
arrays (FR-Spec's `collections.Counter` + stable sort); ids never seen come last, by id (rank >= the number
of distinct ids seen: a shortlist that reaches them holds tokens the corpus never showed). The shortlist of
size K is the ids of rank < K, so a token of rank r is covered for every K > r and the coverage-vs-K curve of
many K is one sort of the ranks of the generated tokens.

- FR-Spec counts a corpus tokenised by the caller (`count_tokens(arrays, vocab_size)`); tokenising text with
  a model's tokenizer lives beside the vocabulary policies (`engine.jobs.frequency`).
- VocabTrim counts the target's own generations (`ranking_from_traces(traces, vocab_size, "generated")`).

Files: `save_ranking(ranking, path, tokenizer)` writes Parquet plus a JSON sidecar (`<path>.json`: tokenizer,
vocab_size, total_tokens, source); `load_ranking(path, tokenizer=..., vocab_size=...)` refuses a mismatch.
The ids in rank order (what a drafter packs) are `shortlist(ranking, k)`, or `ranking["token_id"]`.

`python -m specvocab.locality.shortlist --traces T.parquet | --token-ids A.npy ... --vocab-size V --tokenizer NAME
--out rank.parquet` counts recorded traces (VocabTrim-style, `--what`) or pre-tokenised id arrays (FR-Spec
corpus counts) and prints the coverage-vs-K of the traces. Text corpora: `python -m specvocab.engine.jobs.frequency`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable, Literal, Sequence

import numpy as np
import polars as pl

from specvocab.locality.coverage import with_groups, group_traces
from specvocab.locality.stream import check_traces
from specvocab.locality.trace import Trace, TraceError, as_traces, check_ids, read_traces, token_kind


class ShortlistError(ValueError):
    """A ranking file or argument is unusable; the message names the problem and the fix."""


def count_tokens(arrays: Iterable[np.ndarray], vocab_size: int) -> pl.DataFrame:
    """Rank every id of a `vocab_size` vocabulary by its count in the token-id arrays (see module doc)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ShortlistError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)         # [n]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
        raise ShortlistError(f"token id {bad} is outside the vocabulary [0, {vocab_size}) — pass the tokenizer's "
                             "full vocab size (len(tokenizer)), not the model's or a smaller one")
    count = np.bincount(ids, minlength=vocab_size)                                  # [V]
    first = np.arange(vocab_size, dtype=np.int64) + ids.size                         # unseen: after, by id
    uniq, at = np.unique(ids, return_index=True)
    first[uniq] = at
    order = np.lexsort((first, -count))                                             # count desc, then first
    return pl.DataFrame({"token_id": order, "count": count[order],
                         "rank": np.arange(vocab_size, dtype=np.int64)})


def ranking_from_traces(traces: Sequence[Trace], vocab_size: int,
                        what: Literal["generated", "prompt", "prompt+generated"] = "generated") -> pl.DataFrame:
    """A frequency ranking counted from traces: the generated tokens (VocabTrim-style: the target's own
    outputs), the prompts, or both. Token-id streams count as `locality.trace.as_traces` splits them (the
    first id of each is its prompt); to count every id of a corpus, use `count_tokens`."""
    traces = check_traces(traces)
    pick = {"generated": lambda t: [t.generated], "prompt": lambda t: [t.prompt],
            "prompt+generated": lambda t: [t.prompt, t.generated]}
    if what not in pick:
        raise ShortlistError(f"what={what!r} — choose one of {sorted(pick)}")
    return count_tokens([a for t in traces for a in pick[what](t)], vocab_size)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def save_ranking(ranking: pl.DataFrame, path: str | Path, tokenizer: str, source: str = "") -> Path:
    """Write `ranking` to Parquet and its sidecar `<path>.json` (tokenizer name, vocab size, total tokens,
    distinct tokens seen, source). Returns the Parquet path."""
    _check_frame(ranking, "ranking")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranking.select("token_id", "count", "rank").sort("rank").write_parquet(path)
    meta = {"tokenizer": tokenizer, "vocab_size": ranking.height, "total_tokens": int(ranking["count"].sum()),
            "seen": int((ranking["count"] > 0).sum()), "source": source}
    _sidecar(path).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return path


def load_ranking(path: str | Path, tokenizer: str | None = None, vocab_size: int | None = None) -> pl.DataFrame:
    """Read a ranking written by `save_ranking`; with `tokenizer` / `vocab_size`, refuse a file made for
    another vocabulary (ids would mean different tokens)."""
    path = Path(path)
    side = _sidecar(path)
    if not path.exists() or not side.exists():
        raise ShortlistError(f"ranking {path} or its sidecar {side.name} is missing — write both with "
                             "specvocab.locality.shortlist.save_ranking")
    meta = json.loads(side.read_text())
    if tokenizer is not None and meta.get("tokenizer") != tokenizer:
        raise ShortlistError(f"ranking {path} was counted with tokenizer {meta.get('tokenizer')!r}, not "
                             f"{tokenizer!r} — recount the corpus with {tokenizer!r} (count_tokens + save_ranking)")
    if vocab_size is not None and meta.get("vocab_size") != vocab_size:
        raise ShortlistError(f"ranking {path} covers a vocabulary of {meta.get('vocab_size')} ids but the model "
                             f"has {vocab_size} — recount with vocab_size={vocab_size} for this tokenizer")
    ranking = pl.read_parquet(path)
    _check_frame(ranking, str(path))
    if ranking.height != meta.get("vocab_size"):
        raise ShortlistError(f"{path} has {ranking.height} rows but its sidecar says vocab_size="
                             f"{meta.get('vocab_size')} — the files are out of sync, write them again")
    return ranking


def _check_frame(ranking: pl.DataFrame, what: str) -> None:
    missing = {"token_id", "count", "rank"} - set(ranking.columns)
    if missing:
        raise ShortlistError(f"{what} lacks column(s) {sorted(missing)} — build rankings with count_tokens")


def shortlist(ranking: pl.DataFrame, k: int, always_include: Sequence[int] = ()) -> np.ndarray:
    """[<= k + len(always_include)] the ids of rank < k, then any `always_include` ids (e.g. the
    terminators FR-Spec forces in) not already there."""
    _check_frame(ranking, "ranking")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ShortlistError(f"k must be an int >= 0, got {k!r}")
    top = ranking.sort("rank")["token_id"].to_numpy()[:k]
    extra = np.array([v for v in dict.fromkeys(int(x) for x in always_include) if v not in set(top.tolist())],
                     dtype=np.int64)
    return np.concatenate([top, extra]).astype(np.int64)


def token_ranks(ranking: pl.DataFrame, tokens: np.ndarray) -> np.ndarray:
    """[n] the rank of each token id (ids outside the ranking's vocabulary raise)."""
    _check_frame(ranking, "ranking")
    tokens = np.asarray(tokens, dtype=np.int64)
    v = ranking.height
    if tokens.size and (tokens.min() < 0 or tokens.max() >= v):
        bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
        raise ShortlistError(f"token id {bad} is outside the ranking's vocabulary of {v} ids — "
                             "the ranking was made for another tokenizer")
    rank_of = np.empty(v, dtype=np.int64)
    rank_of[ranking["token_id"].to_numpy()] = ranking["rank"].to_numpy()
    return rank_of[tokens]


def counted_ids(tokens) -> np.ndarray:
    """[n] the ids `shortlist_coverage` counts: every id of token-id input (one stream, a list of streams or an
    array; a static shortlist needs no context, so no id is a prompt), the generated tokens of Traces."""
    if isinstance(tokens, Trace):
        return tokens.generated
    if isinstance(tokens, (list, tuple)) and any(token_kind(x) != "id" for x in tokens):
        kinds = {token_kind(x) for x in tokens}
        if kinds == {"stream"}:
            parts = []
            for i, x in enumerate(tokens):
                try:
                    parts.append(check_ids(np.asarray(x).reshape(-1)))
                except TraceError as e:
                    raise ShortlistError(f"tokens[{i}]: {e}") from None
            return np.concatenate(parts)
        return np.concatenate([t.generated for t in as_traces(tokens, name="tokens")])  # refuses a mix of kinds
    try:
        return check_ids(np.asarray(tokens).reshape(-1))
    except TraceError as e:
        raise ShortlistError(f"tokens: {e}") from None


def shortlist_coverage(ranking: pl.DataFrame, tokens, k=(512, 1024, 2048, 4096, 8192, 16384, 32768)) -> pl.DataFrame:
    """Coverage of `tokens` by the top-K shortlist, for every K at once. Columns: `k, coverage, tokens`.

    `tokens`: token ids (one stream, a list of streams or an array: every id counts) or Traces (their
    generated tokens); `k`: one or more shortlist sizes. A token of rank r is covered for every K > r.

    >>> r = count_tokens([[1, 1, 1, 2, 2, 3]], vocab_size=5)    # ranks: 1, 2, 3, then unseen 0, 4
    >>> r["token_id"].to_list()
    [1, 2, 3, 0, 4]
    >>> f = shortlist_coverage(r, [1, 2, 4, 1], k=[1, 2, 5])     # ranks of the tokens: 0, 1, 4, 0
    >>> f["coverage"].to_list(), f["tokens"].to_list()
    ([0.5, 0.75, 1.0], [4, 4, 4])
    """
    tokens = counted_ids(tokens)
    ranks = np.sort(token_ranks(ranking, tokens))
    ks = np.atleast_1d(np.asarray(k, dtype=np.int64))
    if (ks < 0).any():
        raise ShortlistError(f"k must be >= 0, got {ks.tolist()}")
    n = len(ranks)
    return pl.DataFrame({"k": ks, "coverage": np.searchsorted(ranks, ks, side="left") / max(n, 1)
                         if n else np.full(len(ks), np.nan), "tokens": np.full(len(ks), n, dtype=np.int64)})


def shortlist_coverage_by(ranking: pl.DataFrame, traces: Sequence[Trace], by: Sequence[str] = ("category",),
                          k=(512, 1024, 2048, 4096, 8192, 16384, 32768)) -> pl.DataFrame:
    """`shortlist_coverage` of the traces' generated tokens per group of meta columns (`traces`: Traces or
    token ids, see `locality.trace.as_traces`)."""
    traces = check_traces(traces)
    frames = []
    for values, members in group_traces(traces, by):
        f = shortlist_coverage(ranking, np.concatenate([traces[i].generated for i in members]), k)
        frames.append(with_groups(f, values))
    return pl.concat(frames, how="vertical_relaxed")


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m specvocab.locality.shortlist", description="build a frequency ranking "
                                 "from token ids (text corpora: python -m specvocab.engine.jobs.frequency)")
    ap.add_argument("--traces", help="trace Parquet file or folder to count (see --what)")
    ap.add_argument("--what", default="generated", choices=["generated", "prompt", "prompt+generated"])
    ap.add_argument("--token-ids", nargs="+", default=[], help=".npy files of token ids (a tokenised corpus)")
    ap.add_argument("--vocab-size", type=int, required=True, help="the tokenizer's full vocabulary size")
    ap.add_argument("--tokenizer", required=True, help="tokenizer name, stored in the sidecar and checked on load")
    ap.add_argument("--out", required=True, help="ranking Parquet path (a .json sidecar is written beside it)")
    ap.add_argument("--k", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    a = ap.parse_args(argv)
    if not a.traces and not a.token_ids:
        ap.error("give --traces and/or --token-ids (to count text, use python -m specvocab.engine.jobs.frequency)")
    traces = read_traces(a.traces) if a.traces else []
    pick = {"generated": ("generated",), "prompt": ("prompt",), "prompt+generated": ("prompt", "generated")}
    arrays = [getattr(t, f) for t in traces for f in pick[a.what]] + [np.load(p) for p in a.token_ids]
    ranking = count_tokens(arrays, a.vocab_size)
    source = "; ".join(filter(None, [f"{a.what} tokens of {a.traces}" if a.traces else "",
                                     f"token ids {a.token_ids}" if a.token_ids else ""]))
    path = save_ranking(ranking, a.out, a.tokenizer, source)
    print(f"ranking of {a.vocab_size} ids from {int(ranking['count'].sum())} tokens ({source}) -> {path}")
    if traces:
        print(shortlist_coverage(ranking, traces, a.k))
    return path


if __name__ == "__main__":
    main()
