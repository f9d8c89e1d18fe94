"""`Trace`: what a target model did on one prompt, and its Parquet format.

A trace file is a Parquet table with one row per trace:

| column         | type                 | meaning                                                          |
|----------------|----------------------|------------------------------------------------------------------|
| `prompt`       | list[int32]          | prompt ids, length L                                             |
| `prefill_topk` | list[list[int32]]    | [L-1, K]: row i = top-K at prompt position i (predicts prompt[i+1]) |
| `generated`    | list[int32]          | the target's greedy continuation, length T                        |
| `step_topk`    | list[list[int32]]    | [T, K]: row t = top-K of the distribution that produced generated[t] |
| `draft_tokens` | list[list[int32]]    | per step, the token ids of that step's draft tree (null if none)  |
| meta columns   | str / int            | `model, tokenizer, prompt_set, category, language, prompt_id, turn` |
| `meta_json`    | str                  | any further meta keys, JSON-encoded                               |

`turn` counts from 1 (MT-Bench's "turn 1", "turn 2"). A speculative run's trace
(`engine.harness.GenerateResult.to_trace`) holds one `draft_tokens` list per step (node order, root excluded;
the prefill's step 0 drafts none) and `meta["step_sizes"]`, the tokens each step committed; a trace without
draft tokens committed one token per step. `locality.stream` explains how both enter the candidate stream.

`pl.scan_parquet(path)` reads it like any other table; `read_traces` turns rows back into `Trace`s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import polars as pl

META_COLUMNS = ("model", "tokenizer", "prompt_set", "category", "language", "prompt_id", "turn")
_META_TYPES = {"turn": pl.Int32}
TRACE_SCHEMA = {
    "prompt": pl.List(pl.Int32),
    "prefill_topk": pl.List(pl.List(pl.Int32)),
    "generated": pl.List(pl.Int32),
    "step_topk": pl.List(pl.List(pl.Int32)),
    "draft_tokens": pl.List(pl.List(pl.Int32)),
    **{c: _META_TYPES.get(c, pl.String) for c in META_COLUMNS},
    "meta_json": pl.String,
}


class TraceError(ValueError):
    """A trace (or trace file) is malformed; the message says which field and how to fix it."""


def _ids_1d(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x.tolist() if hasattr(x, "tolist") else x, dtype=np.int64)
    if a.ndim != 1:
        raise TraceError(f"Trace.{name} must be a 1-D sequence of token ids, got shape {a.shape}")
    return a


def check_ids(x: Any) -> np.ndarray:
    """[n] int64 ids of one token stream (a sequence of ints or a 1-D array), checked: integers >= 0."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise TraceError(f"a token stream must be 1-D (one id per token), got shape {a.shape} — pass several "
                         "texts as a list of streams or a 2-D array with one row per text")
    if a.size and (a.dtype == bool or not np.issubdtype(a.dtype, np.integer)):
        raise TraceError(f"token ids must be integers, got dtype {a.dtype} — convert the stream with "
                         "np.asarray(ids, dtype=np.int64)")
    a = a.astype(np.int64)
    if a.size and a.min() < 0:
        at = int(np.argmax(a < 0))
        raise TraceError(f"token id {int(a[at])} at position {at} is negative — token ids index the vocabulary "
                         "(0 .. vocab_size - 1)")
    return a


def token_kind(item: Any) -> str:
    """What one element of a `traces` argument is: "trace", "id", "stream" or its type name."""
    if isinstance(item, Trace):
        return "trace"
    if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
        return "id"
    if isinstance(item, (list, tuple, np.ndarray)) or (hasattr(item, "__array__") and not isinstance(item, str)):
        return "id" if np.ndim(item) == 0 else "stream"
    return type(item).__name__


_KINDS = {"trace": "a Trace", "id": "a token id", "stream": "a sequence of token ids"}


def as_traces(traces: Any, prompt_len: int = 1, name: str = "traces") -> list[Trace]:
    """Every input the `locality` analyses accept, as a list of `Trace`s.

    `traces` is a `Trace`, a sequence of `Trace`s, one token-id stream (a sequence of ints or a 1-D array),
    or several streams, one per text (a sequence of them, or a 2-D array with one row per text). A stream
    becomes `Trace.from_tokens(stream, prompt_len)`; texts never share a window. One kind per call: a list
    mixing Traces, ids and streams is refused, as are negative or non-integer ids; errors call the
    argument `name`.

    >>> [t.generated.tolist() for t in as_traces([[1, 2, 1], [4, 4]])]
    [[2, 1], [4]]
    >>> as_traces([1, 2, 1])[0].generated.tolist()
    [2, 1]
    """
    if isinstance(traces, Trace):
        return [traces]
    if isinstance(traces, pl.DataFrame):
        raise TraceError(f"{name} is a polars DataFrame — turn a trace table into Traces with "
                         "locality.read_traces(path), or pass its token ids as one stream per text")
    if isinstance(traces, (str, bytes)) or not (hasattr(traces, "__iter__") or hasattr(traces, "__array__")):
        raise TraceError(f"{name} has type {type(traces).__name__} — pass Traces (locality.read_traces), one stream "
                         "of token ids, or a list of streams (one per text)")
    if isinstance(traces, np.ndarray) or (hasattr(traces, "__array__") and not isinstance(traces, (list, tuple))):
        a = np.asarray(traces)
        if a.ndim == 2:
            return [_stream_trace(row, f"{name}[{i}]", prompt_len) for i, row in enumerate(a)]
        return [_stream_trace(a, name, prompt_len)]
    items = list(traces)
    kinds = [token_kind(x) for x in items]
    bad = next((i for i, k in enumerate(kinds) if k not in _KINDS), None)
    if bad is not None:
        raise TraceError(f"{name}[{bad}] has type {kinds[bad]} — pass Traces (locality.read_traces), one stream of "
                         "token ids, or a list of streams (one per text)")
    if len(set(kinds)) > 1:
        j = next(i for i, k in enumerate(kinds) if k != kinds[0])
        raise TraceError(f"{name} mixes kinds: {name}[0] is {_KINDS[kinds[0]]} but {name}[{j}] is "
                         f"{_KINDS[kinds[j]]} — pass only Traces, one stream of ids, or only streams (one per text)")
    if not items or kinds[0] == "trace":
        return items
    if kinds[0] == "id":
        return [_stream_trace(items, name, prompt_len)]
    return [_stream_trace(x, f"{name}[{i}]", prompt_len) for i, x in enumerate(items)]


def _stream_trace(ids: Any, name: str, prompt_len: int) -> Trace:
    """`Trace.from_tokens`, its error prefixed with the argument it came from."""
    try:
        return Trace.from_tokens(ids, prompt_len)
    except TraceError as e:
        raise TraceError(f"{name}: {e}") from None


def _ids_2d(x: Any, name: str, rows: int) -> np.ndarray:
    # an ndarray keeps its shape even with no rows ([0, K]); other array types go through lists
    a = x.astype(np.int64) if isinstance(x, np.ndarray) else np.asarray(
        x.tolist() if hasattr(x, "tolist") else x, dtype=np.int64)
    if a.size == 0 and a.ndim != 2:                     # [] or [[]]: no rows; [rows, 0] keeps its rows
        a = a.reshape(0, 0)
    if a.ndim != 2:
        raise TraceError(f"Trace.{name} must be a 2-D [rows, K] array of token ids with equal-length rows, "
                         f"got shape {a.shape}")
    if a.shape[0] != rows:
        raise TraceError(f"Trace.{name} has {a.shape[0]} rows but must have {rows}")
    return a


@dataclass
class Trace:
    """What a target model did on one prompt. Arrays are int64 numpy; see the module docstring for shapes."""

    prompt: np.ndarray                      # [L]
    prefill_topk: np.ndarray                # [L-1, K]
    generated: np.ndarray                   # [T]
    step_topk: np.ndarray                   # [T, K]
    draft_tokens: list[np.ndarray] | None = None   # T' lists of draft-tree token ids (T' = number of steps)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.prompt = _ids_1d(self.prompt, "prompt")
        if len(self.prompt) == 0:
            raise TraceError("Trace.prompt is empty: a trace needs at least one prompt token")
        self.generated = _ids_1d(self.generated, "generated")
        self.prefill_topk = _ids_2d(self.prefill_topk, "prefill_topk", len(self.prompt) - 1)
        self.step_topk = _ids_2d(self.step_topk, "step_topk", len(self.generated))
        if self.draft_tokens is not None:
            self.draft_tokens = [_ids_1d(d, "draft_tokens[i]") for d in self.draft_tokens]
        for name in ("prompt", "generated", "prefill_topk", "step_topk"):
            a = getattr(self, name)
            if a.size and a.min() < 0:
                raise TraceError(f"Trace.{name} holds a negative token id ({a.min()})")
        self.meta = dict(self.meta or {})

    @classmethod
    def from_tokens(cls, tokens: Any, prompt_len: int = 1, meta: dict | None = None) -> "Trace":
        """The trace of a plain token-id stream: no model behind it, so no top-k rows (K = 0) and no draft trees.

        `tokens [n]`: ids >= 0 (a sequence of ints or a 1-D array), n >= prompt_len. The first `prompt_len`
        ids are the prompt (context only, never queried: a window needs one entry before its first query),
        the other n - prompt_len are `generated`, each queried once. `meta` feeds the `by` groupings
        (category, language, ...). Every analysis of `locality` accepts such streams directly (`as_traces`);
        the window over the tokens themselves is `stream="generated"`, since the candidate stream's top-k
        sources (k_pre, k_ver) need rows recorded from a model (`specvocab record`).

        >>> t = Trace.from_tokens([1, 2, 1, 3], meta={"category": "toy"})
        >>> t.prompt.tolist(), t.generated.tolist(), t.k, t.step_topk.shape
        ([1], [2, 1, 3], 0, (3, 0))
        """
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or prompt_len < 1:
            raise TraceError(f"prompt_len must be an int >= 1 (the stream's first prompt_len ids are context), "
                             f"got {prompt_len!r}")
        ids = check_ids(tokens)
        if len(ids) < prompt_len:
            raise TraceError(f"a token stream of {len(ids)} id(s) is shorter than prompt_len={prompt_len} — a stream "
                             f"needs its prompt_len context id(s) before the first queried one")
        return cls(prompt=ids[:prompt_len], prefill_topk=np.zeros((prompt_len - 1, 0), dtype=np.int64),
                   generated=ids[prompt_len:], step_topk=np.zeros((len(ids) - prompt_len, 0), dtype=np.int64),
                   meta=meta or {})

    @property
    def k(self) -> int:
        """K of the recorded top-K rows (the smaller of prefill and step K when both exist)."""
        ks = [a.shape[1] for a in (self.prefill_topk, self.step_topk) if a.shape[0] > 0]
        return min(ks) if ks else 0

    def check_k(self, k: int, what: str = "K") -> None:
        if k > self.k:
            raise TraceError(f"{what}={k} is larger than the K={self.k} this trace was recorded with — "
                             f"re-record with `python -m specvocab.engine.jobs.record --topk {k}` or ask for {what} <= {self.k}")

    def to_row(self) -> dict:
        meta = dict(self.meta)
        row = {
            "prompt": self.prompt.tolist(),
            "prefill_topk": self.prefill_topk.tolist(),
            "generated": self.generated.tolist(),
            "step_topk": self.step_topk.tolist(),
            "draft_tokens": None if self.draft_tokens is None else [d.tolist() for d in self.draft_tokens],
        }
        for c in META_COLUMNS:
            v = meta.pop(c, None)
            row[c] = None if v is None else (int(v) if c == "turn" else str(v))
        row["meta_json"] = json.dumps(meta, sort_keys=True, default=str)
        return row

    @classmethod
    def from_row(cls, row: dict) -> "Trace":
        missing = [c for c in ("prompt", "prefill_topk", "generated", "step_topk") if c not in row]
        if missing:
            raise TraceError(f"trace row lacks column(s) {missing} — a trace file needs "
                             f"prompt, prefill_topk, generated, step_topk (see locality.trace)")
        meta = {c: row[c] for c in META_COLUMNS if row.get(c) is not None}
        if row.get("meta_json"):
            try:
                meta.update(json.loads(row["meta_json"]))
            except json.JSONDecodeError as e:
                raise TraceError(f"meta_json is not valid JSON: {e}") from e
        return cls(prompt=row["prompt"], prefill_topk=row["prefill_topk"], generated=row["generated"],
                   step_topk=row["step_topk"], draft_tokens=row.get("draft_tokens"), meta=meta)


def traces_to_frame(traces: Iterable[Trace]) -> pl.DataFrame:
    return pl.DataFrame([t.to_row() for t in traces], schema=TRACE_SCHEMA)


def write_traces(traces: Iterable[Trace], path: str | Path) -> Path:
    """Write traces to one Parquet file (parent folders are created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    traces_to_frame(traces).write_parquet(tmp)
    os.replace(tmp, path)                  # atomic: readers never see a half-written file
    return path


def _is_trace_file(path: Path) -> bool:
    """A Parquet file with the trace columns (an unreadable one counts, so that reading it names the error)."""
    try:
        names = pl.read_parquet_schema(path).keys()
    except Exception:  # polars raises several error types for a non-Parquet file
        return True
    return {"prompt", "prefill_topk", "generated", "step_topk"} <= set(names)


def read_traces(path: str | Path | Sequence[str | Path]) -> list[Trace]:
    """Read traces from a Parquet file, a folder (recursively: every Parquet file with the trace columns;
    others there, e.g. `coverage.parquet` written beside them, are results and are passed over), or a list
    of files."""
    if isinstance(path, (list, tuple)):
        return [t for p in path for t in read_traces(p)]
    path = Path(path)
    if path.is_dir():
        files = [f for f in sorted(path.rglob("*.parquet")) if _is_trace_file(f)]
        if not files:
            raise TraceError(f"no Parquet trace files under {path} — record some with "
                             f"`python -m specvocab.engine.jobs.record`")
        return [t for f in files for t in read_traces(f)]
    if not path.exists():
        raise TraceError(f"trace file {path} does not exist — record traces with "
                         f"`python -m specvocab.engine.jobs.record`")
    try:
        df = pl.read_parquet(path)
    except Exception as e:  # polars raises several error types for a non-Parquet file
        raise TraceError(f"{path} is not a readable Parquet trace file ({type(e).__name__}: {e}) — "
                         f"delete it and re-record with `python -m specvocab.engine.jobs.record`") from e
    try:
        return _frame_traces(df)
    except Exception:        # a malformed file: read it row by row, whose error names the row and the field
        pass
    out = []
    for i, row in enumerate(df.iter_rows(named=True)):
        try:
            out.append(Trace.from_row(row))
        except TraceError as e:
            raise TraceError(f"{path}, row {i}: {e}") from e
    return out


def _flat(column: pl.Series) -> tuple[np.ndarray, np.ndarray, Any]:
    """A list column -> (its values, row offsets [rows + 1], the Arrow list array) without a Python object per
    value (iter_rows builds one per token: ~4x slower on recorded traces)."""
    arr = column.to_arrow()
    offsets = np.asarray(arr.offsets)
    return arr.values, offsets - offsets[0], arr


def _frame_traces(df: pl.DataFrame) -> list[Trace]:
    """`Trace.from_row` for every row of a trace frame, column-wise. Raises on anything irregular (a null
    token list, top-K rows of different lengths within one trace); `read_traces` then reads row by row."""
    ids, prompt_off, _ = _flat(df["prompt"])
    prompt = np.asarray(ids, dtype=np.int64)
    ids, gen_off, _ = _flat(df["generated"])
    generated = np.asarray(ids, dtype=np.int64)
    tables = {}
    for name in ("prefill_topk", "step_topk"):
        rows_arr, row_off, outer = _flat(df[name])
        if outer.null_count or rows_arr.null_count:
            raise TraceError(f"{name} has null rows")
        values, inner = np.asarray(rows_arr.values, dtype=np.int64), np.asarray(rows_arr.offsets)
        inner = inner - inner[0]
        tables[name] = (values, row_off, inner)
    drafts = None
    if "draft_tokens" in df.columns:
        d_rows, d_off, d_outer = _flat(df["draft_tokens"])
        d_valid = np.asarray(d_outer.is_valid())
        d_inner = np.asarray(d_rows.offsets) - np.asarray(d_rows.offsets)[0]
        d_values = np.asarray(d_rows.values, dtype=np.int64)
        drafts = (d_valid, d_off, d_inner, d_values)
    if df["prompt"].null_count() or df["generated"].null_count():
        raise TraceError("null prompt or generated tokens")
    meta_cols = [c for c in (*META_COLUMNS, "meta_json") if c in df.columns]
    out = []
    for i, meta_row in enumerate(df.select(meta_cols).iter_rows(named=True)):
        arrays = {}
        for name, (values, row_off, inner) in tables.items():
            r0, r1 = row_off[i], row_off[i + 1]
            lo, hi = inner[r0], inner[r1]
            lengths = np.diff(inner[r0:r1 + 1])
            if len(lengths) and (lengths != lengths[0]).any():
                raise TraceError(f"{name} rows of different lengths")
            arrays[name] = values[lo:hi].reshape(r1 - r0, int(lengths[0]) if len(lengths) else 0)
        draft_tokens = None
        if drafts is not None and drafts[0][i]:
            _, d_off, d_inner, d_values = drafts
            draft_tokens = [d_values[d_inner[j]:d_inner[j + 1]] for j in range(d_off[i], d_off[i + 1])]
        meta = {c: meta_row[c] for c in META_COLUMNS if meta_row.get(c) is not None}
        if meta_row.get("meta_json"):
            meta.update(json.loads(meta_row["meta_json"]))
        out.append(Trace(prompt=prompt[prompt_off[i]:prompt_off[i + 1]], prefill_topk=arrays["prefill_topk"],
                         generated=generated[gen_off[i]:gen_off[i + 1]], step_topk=arrays["step_topk"],
                         draft_tokens=draft_tokens, meta=meta))
    return out
