"""`python -m specvocab.locality.bench`: speed of the one-pass coverage curve against the per-step set simulation.

What is compared: both compute, for every window size W in a list of 16, the coverage and the mean active
vocab of MicroSpec's candidate stream (`sources="ctx+ext"`, k_pre = k_ver = 3) over the same traces.
- one-pass: `candidate_stream` + `StreamIndex` (one sort, then O(N_repeat) per W), all 16 W at once;
- per-step: the obvious simulation (`simulate_per_step`): for each W and each step, `set()` of the last W
  stream entries, test membership, append the step's entries; and the stronger incremental simulation
  (`simulate_refcount`: a ring of W entries with reference counts, O(1) per event). Both are timed on a
  prefix of the traces (too slow for all of them), checked equal to the one-pass results there, and their
  rates in events/s are compared with the one-pass rate over all traces.
An event is one stream entry or one query (step), i.e. what a per-step simulation touches per window size.

Traces: synthetic Zipf-ish traces (`synthetic_traces`: a Zipf(1.1) unigram over a 128,256-id vocabulary
mixed with copies from the recent context, the top-1 of each top-K row = the next token), plus, with
`--traces PATH`, real trace files, and with `--text-jsonl PATH`, real text (e.g. the Vicuna MT-Bench answers
in shared/data/rest_vicuna7b_mtbench) split into word ids by a regex (a word-level stand-in tokenizer, so
the stream has the repetition structure of real text; the top-K rows are synthetic).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import deque
from pathlib import Path

import numpy as np

from specvocab.locality.stream import StreamIndex, candidate_stream
from specvocab.locality.trace import Trace, read_traces

W16 = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 16384)


def _topk_rows(rng, nxt: np.ndarray, context: np.ndarray, k: int, vocab_size: int) -> np.ndarray:
    """[n, k] top-k rows: column 0 = the true next token, the rest a mix of context tokens and Zipf draws."""
    n = len(nxt)
    rows = np.empty((n, k), dtype=np.int64)
    rows[:, 0] = nxt
    if k > 1:
        zipf = np.minimum(rng.zipf(1.1, (n, k - 1)) - 1, vocab_size - 1)
        ctx = context[rng.integers(0, len(context), (n, k - 1))] if len(context) else zipf
        rows[:, 1:] = np.where(rng.random((n, k - 1)) < 0.6, ctx, zipf)
    return rows


def synthetic_traces(n_traces: int = 64, prompt_len: int = 400, gen_len: int = 1024, vocab_size: int = 128256,
                     k: int = 8, draft_size: int = 0, p_copy: float = 0.55, seed: int = 0) -> list[Trace]:
    """Zipf-ish token traces with temporal locality (a copy from the last ~200 tokens with prob. p_copy).

    Top-K rows may repeat an id inside a row (they are not real distributions); the metrics do not care.
    `draft_size > 0` adds one draft-token list per step: the next few tokens plus noise.
    """
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_traces):
        n = prompt_len + gen_len
        x = np.minimum(rng.zipf(1.1, n) - 1, vocab_size - 1)
        copy = rng.random(n) < p_copy
        back = np.minimum(rng.geometric(1 / 60, n), np.arange(n))           # distance to copy from
        copy &= back > 0
        for j in np.flatnonzero(copy):                                    # sequential copies (setup only)
            x[j] = x[j - back[j]]
        prompt, gen = x[:prompt_len], x[prompt_len:]
        rows = _topk_rows(rng, x[1:], x, k, vocab_size)                    # row j predicts x[j+1]
        draft = None
        if draft_size:
            nd = rng.integers(0, draft_size + 1, gen_len)
            draft = [np.concatenate([gen[t:t + nd[t]], rng.integers(0, vocab_size, nd[t] // 3)])
                     for t in range(gen_len)]
        out.append(Trace(prompt=prompt, prefill_topk=rows[:prompt_len - 1], generated=gen,
                         step_topk=rows[prompt_len - 1:],
                         draft_tokens=draft, meta={"category": f"synthetic-{i % 4}", "model": "synthetic"}))
    return out


def word_traces(texts, k: int = 8, prompt_words: int = 64, categories=None, seed: int = 0) -> list[Trace]:
    """Traces from real text: each text is split into words (a regex stand-in tokenizer, ids by first
    appearance across all texts); the first `prompt_words` words are the prompt, the rest the generated
    tokens; top-K rows are synthetic around the true next id (column 0). Texts shorter than
    prompt_words + 16 words are skipped."""
    rng = np.random.default_rng(seed)
    vocab: dict[str, int] = {}
    out = []
    for i, text in enumerate(texts):
        words = re.findall(r"\w+|[^\w\s]|\n", text)
        ids = np.array([vocab.setdefault(w, len(vocab)) for w in words], dtype=np.int64)
        if len(ids) < prompt_words + 16:
            continue
        L = prompt_words
        rows = _topk_rows(rng, ids[1:], ids, k, max(len(vocab), 2))           # row j predicts ids[j+1]
        out.append(Trace(prompt=ids[:L], prefill_topk=rows[:L - 1], generated=ids[L:], step_topk=rows[L - 1:],
                         meta={"category": None if categories is None else categories[i], "model": "words"}))
    return out


def text_traces(path: str | Path, k: int = 8, max_traces: int | None = None) -> list[Trace]:
    """`word_traces` of every answer turn of a FastChat answer file (one JSON per line with `category` and
    `choices[0].turns`), e.g. shared/data/rest_vicuna7b_mtbench/baseline-vicuna-7b-v1.5-*.jsonl."""
    texts, cats = [], []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        for turn in rec["choices"][0]["turns"]:
            texts.append(turn)
            cats.append(rec.get("category"))
    return word_traces(texts[:max_traces], k=k, categories=cats[:max_traces])


def simulate_per_step(traces, ws, k_pre=3, k_ver=3):
    """The obvious per-step simulation: for each W, per step `set(S[-W:])`. Returns [(covered, sum|I|)]."""
    res = []
    for w in ws:
        cov = act = 0
        for tr in traces:
            rows = [r[:k_pre] for r in tr.prefill_topk] + [tr.step_topk[0][:k_pre]]
            seen, union = set(), []
            for r in rows:
                for v in r.tolist():
                    if v not in seen:
                        seen.add(v)
                        union.append(v)
            s = tr.prompt.tolist() + union
            gen, ver = tr.generated.tolist(), tr.step_topk[:, :k_ver].tolist()
            for t, y in enumerate(gen):
                active = set(s[-w:])
                cov += y in active
                act += len(active)
                if tr.draft_tokens is not None:
                    s.extend(dict.fromkeys(tr.draft_tokens[t].tolist()))
                s.extend(ver[t])
        res.append((cov, act))
    return res


def simulate_refcount(traces, ws, k_pre=3, k_ver=3):
    """The incremental per-step simulation (the ring + reference counts behind MicroSpec §3.3's device
    state): per W a ring of the last W entries with a reference count per token, O(1) per event.
    Returns [(covered, sum|I|)] like `simulate_per_step`."""
    res = []
    for w in ws:
        cov = act = 0
        for tr in traces:
            rows = [r[:k_pre] for r in tr.prefill_topk] + [tr.step_topk[0][:k_pre]]
            union = list(dict.fromkeys(v for r in rows for v in r.tolist()))
            ring, cnt = deque(), {}

            def push(entries):
                for v in entries:
                    ring.append(v)
                    cnt[v] = cnt.get(v, 0) + 1
                    if len(ring) > w:
                        old = ring.popleft()
                        cnt[old] -= 1
                        if not cnt[old]:
                            del cnt[old]

            push(tr.prompt.tolist() + union)
            gen, ver = tr.generated.tolist(), tr.step_topk[:, :k_ver].tolist()
            for t, y in enumerate(gen):
                cov += y in cnt
                act += len(cnt)
                if tr.draft_tokens is not None:
                    push(dict.fromkeys(tr.draft_tokens[t].tolist()))
                push(ver[t])
        res.append((cov, act))
    return res


def one_pass(traces, ws, k_pre=3, k_ver=3):
    idx = StreamIndex(candidate_stream(traces, k_pre, k_ver))
    return idx, idx.coverage_counts(ws), idx.active_vocab_sums(ws)


def main(traces: str | None = None, text_jsonl: str | None = None, n_traces: int = 256, gen_len: int = 1024,
         prompt_len: int = 400, draft_size: int = 0, prefix_traces: int = 4, repeats: int = 3, seed: int = 0):
    ws = np.array(W16)
    trs = synthetic_traces(n_traces, prompt_len, gen_len, draft_size=draft_size, seed=seed)
    pre = trs[:prefix_traces]             # the per-step simulations run on the first traces of each source
    what = [f"{n_traces} synthetic traces (prompt {prompt_len}, {gen_len} generated, draft size {draft_size})"]
    if text_jsonl:
        extra = text_traces(text_jsonl)
        trs, pre = trs + extra, pre + extra[:prefix_traces]
        what.append(f"{len(extra)} word-level traces from {text_jsonl}")
    if traces:
        extra = read_traces(traces)
        trs, pre = trs + extra, pre + extra[:prefix_traces]
        what.append(f"{len(extra)} recorded traces from {traces}")
    print("traces:", "; ".join(what))

    t_build, t_curve = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        stream = candidate_stream(trs, 3, 3)
        t1 = time.perf_counter()
        idx = StreamIndex(stream)
        cov, act = idx.coverage_counts(ws), idx.active_vocab_sums(ws)
        t2 = time.perf_counter()
        t_build.append(t1 - t0)
        t_curve.append(t2 - t1)
    ev = stream.events
    tb, tc = min(t_build), min(t_curve)
    print(f"stream: {len(stream.tokens):,} entries + {idx.tokens:,} queried tokens = {ev:,} events")
    print(f"one-pass, 16 window sizes: index+curve {tc:.3f} s = {ev / tc / 1e6:.2f} M events/s "
          f"(stream construction from traces {tb:.3f} s more; all together {ev / (tb + tc) / 1e6:.2f} M events/s)")

    pre_stream = candidate_stream(pre, 3, 3)
    _, pcov, pact = one_pass(pre, ws)
    for name, sim in [("per-step set simulation (set(S[-W:]) per step)", simulate_per_step),
                      ("incremental ring + refcount simulation", simulate_refcount)]:
        times = []
        for _ in range(repeats):             # best of `repeats`, like the one-pass timing
            t0 = time.perf_counter()
            res = sim(pre, ws)
            times.append(time.perf_counter() - t0)
        t_ref = min(times)
        assert [c for c, _ in res] == pcov.tolist() and [a for _, a in res] == pact.tolist(), \
            f"one-pass and {name} disagree on the prefix"
        ref_rate = pre_stream.events / t_ref
        print(f"{name}, on {len(pre)} traces (the first {prefix_traces} of each source; "
              f"{pre_stream.events:,} events), 16 window sizes: "
              f"{t_ref:.2f} s = {ref_rate / 1e6:.4f} M events/s; results identical to the one-pass")
        print(f"  speed ratio one-pass / this: {ev / tc / ref_rate:.0f}x (index+curve), "
              f"{ev / (tb + tc) / ref_rate:.0f}x including stream construction")
    print("coverage per W:", dict(zip(ws.tolist(), np.round(cov / idx.tokens, 4).tolist())))
    print("mean active vocab per W:", dict(zip(ws.tolist(), np.round(act / idx.tokens, 1).tolist())))


def cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", help="trace Parquet file or folder to add to the synthetic traces")
    ap.add_argument("--text-jsonl", help="FastChat answer jsonl to add as word-level traces "
                                         "(e.g. shared/data/rest_vicuna7b_mtbench/baseline-*.jsonl)")
    ap.add_argument("--n-traces", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--draft-size", type=int, default=0)
    ap.add_argument("--prefix-traces", type=int, default=4,
                    help="traces of each source the per-step simulations are timed on")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    main(traces=a.traces, text_jsonl=a.text_jsonl, n_traces=a.n_traces, gen_len=a.gen_len,
         prompt_len=a.prompt_len, draft_size=a.draft_size, prefix_traces=a.prefix_traces, repeats=a.repeats)


if __name__ == "__main__":
    cli()
