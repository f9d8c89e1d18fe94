"""Candidate stream construction and one-pass window coverage vs the per-step reference (exact equality), in
both event orders ("token": the window moves after every token; "engine": after every recorded step)."""

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import locality_reference as ref
from tests.locality_testing import random_trace, random_traces, spec_traces
from specvocab.locality import (LocalityError, Trace, TraceError, candidate_stream, coverage, coverage_by, coverage_report,
                      generated_stream)
from specvocab.locality.bench import one_pass, simulate_per_step, synthetic_traces, word_traces
from specvocab.locality.stream import StreamIndex

PARAGRAPHS = [
    "The cache keeps the most recent tokens. When a token is used again soon, the cache still holds it, and "
    "the draft model can propose it without the full vocabulary. The cache forgets a token only when many "
    "other tokens have been used since. A small cache is fast; a large cache misses less. The right size "
    "depends on how far back the text looks: code repeats names, stories repeat characters, and a "
    "translation repeats little of its source. " * 2,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nprint(add(1, 2), sub(3, 4))\n"
    "for i in range(10):\n    print(add(i, i), sub(i, 1))\n" * 3,
]


WS = [1, 2, 3, 5, 8, 13, 21, 40, 100, 10_000]


# --- event order, by hand -----------------------------------------------------------------------------

def hand_trace(draft=None):
    return Trace(prompt=[5, 6, 7], prefill_topk=[[6, 1], [7, 6]], generated=[8, 10],
                 step_topk=[[8, 1], [10, 8]], draft_tokens=draft)


def test_event_order_by_hand():
    s = candidate_stream([hand_trace()], k_pre=2, k_ver=1)
    # S_init = prompt ⊕ Dedup(rows 0, 1 and step_topk[0]) = [5,6,7] ⊕ [6,1,7,8]; query 0; + [8]; query 1; + [10]
    assert s.tokens.tolist() == [5, 6, 7, 6, 1, 7, 8, 8, 10]
    assert s.query_pos.tolist() == [7, 8] and s.query_token.tolist() == [8, 10]
    last = candidate_stream([hand_trace()], k_pre=2, k_ver=1, prefill_order="last")
    assert last.tokens[3:7].tolist() == [7, 6, 8, 1]           # ordered by last occurrence, then rank
    drafted = candidate_stream([hand_trace(draft=[[3, 3, 4], []])], k_pre=2, k_ver=1)
    assert drafted.tokens.tolist() == [5, 6, 7, 6, 1, 7, 8, 3, 4, 8, 10]
    assert drafted.query_pos.tolist() == [7, 10]
    per_step = hand_trace(draft=[[], [3, 3, 4]])          # step 0 = prefill (1 token), step 1 commits 1
    per_step.meta["step_sizes"] = [1, 1]
    assert candidate_stream([per_step], k_pre=2, k_ver=1).tokens.tolist() == [5, 6, 7, 6, 1, 7, 8, 8, 3, 4, 10]
    ctx = candidate_stream([hand_trace()], k_pre=2, k_ver=1, sources="ctx")
    assert ctx.tokens.tolist() == [5, 6, 7, 6, 1, 7, 8] and ctx.query_pos.tolist() == [7, 7]
    ext = candidate_stream([hand_trace()], k_pre=2, k_ver=1, sources="ext")
    assert ext.tokens.tolist() == [8, 1, 8, 10] and ext.query_pos.tolist() == [2, 3]
    gen = generated_stream([hand_trace()])
    assert gen.tokens.tolist() == [5, 6, 7, 8, 10] and gen.query_pos.tolist() == [3, 4]


def test_hand_coverage_values():
    # w=1: query 0 sees {8} -> covered; query 1 sees {8} -> 10 missed. w=2: {7,8} then {8} (S ends 8, 8).
    f = coverage([hand_trace()], w_max=[1, 2, 100], k_pre=2, k_ver=1)
    assert f["coverage"].to_list() == [0.5, 0.5, 0.5]
    assert f["mean_active_vocab"].to_list() == [1.0, 1.5, 5.0]   # |{5,6,7,1,8}| = 5 at both steps
    assert f["tokens"].to_list() == f["steps"].to_list() == [2, 2, 2]   # every token is a step here
    assert f["bonus_coverage"].to_list() == f["coverage"].to_list()


def spec_hand_trace():
    """Step 0 (prefill) commits 8; step 1 drafts [10, 4, 10] under root 8 and commits 6 and 11."""
    return Trace(prompt=[5, 6, 7], prefill_topk=[[6, 1], [7, 6]], generated=[8, 6, 11],
                 step_topk=[[8, 1], [6, 8], [11, 3]], draft_tokens=[[], [10, 4, 10]], meta={"step_sizes": [1, 2]})


def test_engine_event_order_by_hand():
    s = candidate_stream([spec_hand_trace()], k_pre=2, k_ver=2, event_order="engine")
    # S_init = [5,6,7] ⊕ Dedup([6,1],[7,6],[8,1]) = [5,6,7,6,1,7,8]; step 1 queries 6 and 11 at n = 7 (the
    # window frozen for the step); then C_draft = Dedup(root 8, 10, 4, 10), C_ver = Dedup([6,8],[11,3])
    assert s.tokens.tolist() == [5, 6, 7, 6, 1, 7, 8] + [8, 10, 4] + [6, 8, 11, 3]
    assert s.query_pos.tolist() == [7, 7] and s.query_token.tolist() == [6, 11]
    assert s.query_step.tolist() == [1, 1] and s.query_position.tolist() == [1, 2]
    f = coverage([spec_hand_trace()], w_max=[2, 100], k_pre=2, k_ver=2, event_order="engine")
    assert f["coverage"].to_list() == [0.0, 0.5] and f["bonus_coverage"].to_list() == [0.0, 0.0]
    assert f["tokens"].to_list() == [2, 2] and f["steps"].to_list() == [1, 1]
    assert f["mean_active_vocab"].to_list() == [2.0, 5.0]          # |{7, 8}|, |{5, 6, 7, 1, 8}|
    # the "token" order of the same trace: one query per token (the prefill's included), trees after steps
    t = candidate_stream([spec_hand_trace()], k_pre=2, k_ver=2)
    assert t.query_pos.tolist() == [7, 9, 11] and t.query_step.tolist() == [0, 1, 2]
    # no drafts: every step commits one token and drafts its root alone
    ar = candidate_stream([hand_trace()], k_pre=2, k_ver=1, event_order="engine")
    assert ar.tokens.tolist() == [5, 6, 7, 6, 1, 7, 8, 8, 10] and ar.query_pos.tolist() == [7]
    assert ar.query_token.tolist() == [10]


# --- fast path == reference, exactly -------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("sources", ["ctx+ext", "ctx", "ext"])
def test_coverage_matches_reference(seed, sources):
    trs = random_traces(seed)
    rng = np.random.default_rng(1000 + seed)
    k_pre, k_ver = int(rng.integers(0, 5)), int(rng.integers(0, 5))   # includes K exactly (4) and 0
    order = ["first", "last"][seed % 2]
    f = coverage(trs, WS, k_pre, k_ver, sources, order)
    for row in f.iter_rows(named=True):
        covered, active, steps = ref.coverage(trs, row["w_max"], k_pre=k_pre, k_ver=k_ver, sources=sources,
                                              prefill_order=order)
        assert row["tokens"] == row["steps"] == steps
        if steps:
            assert row["coverage"] * steps == pytest.approx(covered, abs=1e-9)
            assert row["mean_active_vocab"] * steps == pytest.approx(active, abs=1e-9)
    idx = StreamIndex(candidate_stream(trs, k_pre, k_ver, sources, order))
    exp = [ref.coverage(trs, w, k_pre=k_pre, k_ver=k_ver, sources=sources, prefill_order=order) for w in WS]
    assert idx.coverage_counts(WS).tolist() == [c for c, _, _ in exp]      # integer sums, exactly
    assert idx.active_vocab_sums(WS).tolist() == [a for _, a, _ in exp]


@pytest.mark.parametrize("seed", range(6))
def test_generated_stream_matches_reference(seed):
    trs = random_traces(seed, V=20)
    idx = StreamIndex(generated_stream(trs))
    for w in WS:
        c, a, n = ref.coverage(trs, w, events=ref.generated_events)
        assert idx.coverage_counts([w])[0] == c and idx.active_vocab_sums([w])[0] == a and idx.tokens == n


def test_edge_cases():
    rng = np.random.default_rng(7)
    trs = [random_trace(rng, T=0), random_trace(rng, L=1, T=5), random_trace(rng, L=1, T=0),
           random_trace(rng, draft=True, T=9), random_trace(rng, draft=False, T=9),
           random_trace(rng, L=30, T=1)]
    for w in [1, 10 ** 9]:                      # w_max = 1 and far beyond any stream
        f = coverage(trs, [w], k_pre=4, k_ver=4)
        c, a, n = ref.coverage(trs, w, k_pre=4, k_ver=4)
        assert f["tokens"][0] == n == 24
        assert f["coverage"][0] * n == pytest.approx(c) and f["mean_active_vocab"][0] * n == pytest.approx(a)
    no_draft = [random_trace(rng, draft=False, T=4) for _ in range(3)]
    empty = coverage(no_draft, [1, 5], k_pre=0, k_ver=0, sources="ext")     # an empty candidate stream
    assert empty["coverage"].to_list() == [0.0, 0.0] and empty["mean_active_vocab"].to_list() == [0.0, 0.0]
    only_empty = coverage([random_trace(rng, T=0)], [4])
    assert only_empty["tokens"][0] == 0 and only_empty["coverage"].is_nan()[0]


@pytest.mark.parametrize("seed", range(6))
def test_draft_lists_per_step_with_step_sizes(seed):
    """Speculative traces: one draft list per step + meta['step_sizes'] (the harness's layout)."""
    rng = np.random.default_rng(seed)
    trs = []
    for _ in range(4):
        t = random_trace(rng, draft=False)
        T = len(t.generated)
        sizes = []
        while sum(sizes) < T:
            sizes.append(int(rng.integers(1, 4)))
        t.draft_tokens = [rng.integers(0, 12, rng.integers(0, 6)) for _ in sizes]
        t.meta["step_sizes"] = sizes
        trs.append(t)
    for w in [1, 4, 17, 500]:
        f = coverage(trs, [w], k_pre=2, k_ver=3)
        c, a, n = ref.coverage(trs, w, k_pre=2, k_ver=3)
        if n:
            assert (f["coverage"][0] * n, f["mean_active_vocab"][0] * n) == pytest.approx((c, a))


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("sources", ["ctx+ext", "ctx", "ext"])
def test_engine_event_order_matches_reference(seed, sources):
    trs = spec_traces(seed, cut=bool(seed % 2)) + random_traces(seed, draft=False, n=2)   # + traces without drafts
    order = ["first", "last"][seed % 2]
    kw = dict(k_pre=int(seed % 4), k_ver=1 + int(seed % 3), sources=sources, prefill_order=order)
    f = coverage(trs, WS, event_order="engine", **kw)
    for row in f.iter_rows(named=True):
        covered, tokens, bonus, active, steps = ref.engine_coverage(trs, row["w_max"], **kw)
        assert (row["tokens"], row["steps"]) == (tokens, steps)
        if steps:
            assert row["coverage"] == covered / tokens and row["bonus_coverage"] == bonus / steps
            assert row["mean_active_vocab"] == active / steps
    idx = StreamIndex(candidate_stream(trs, event_order="engine", **kw))
    exp = [ref.engine_coverage(trs, w, **kw) for w in WS]
    assert idx.coverage_counts(WS).tolist() == [e[0] for e in exp]
    assert idx.bonus_counts(WS).tolist() == [e[2] for e in exp]
    assert idx.active_vocab_sums(WS, per="step").tolist() == [e[3] for e in exp]


def test_engine_event_order_errors():
    t = spec_hand_trace()
    for sizes in ([2, 1], [1, 1], [1, 0, 2], [1, 2, 1]):     # prefill != 1, too few tokens, a 0, a list too long
        t.meta["step_sizes"] = sizes
        with pytest.raises(TraceError, match="step_sizes"):
            candidate_stream([t], k_pre=2, k_ver=2, event_order="engine")
    bad = Trace(prompt=[1, 2], prefill_topk=[[1, 2]], generated=[3, 4, 5], step_topk=[[3, 1], [4, 1], [5, 1]],
                draft_tokens=[[], [1]])
    with pytest.raises(TraceError, match="tokens committed per step"):
        candidate_stream([bad], k_pre=2, k_ver=2, event_order="engine")
    with pytest.raises(LocalityError, match="event_order"):
        coverage([spec_hand_trace()], [5], event_order="step")


def test_huge_token_ids_are_relabelled():
    trs = random_traces(4, n=40)
    big = 2 ** 55                     # 55 bits of token id + trace + position bits overflow one int64 key
    shifted = [Trace(prompt=t.prompt + big, prefill_topk=t.prefill_topk + big, generated=t.generated + big,
                     step_topk=t.step_topk + big, meta=t.meta,
                     draft_tokens=None if t.draft_tokens is None else [d + big for d in t.draft_tokens])
               for t in trs]
    assert coverage(shifted, WS).equals(coverage(trs, WS))
    a, b = StreamIndex(candidate_stream(shifted)), StreamIndex(candidate_stream(trs))
    assert (a.stack_distance() == b.stack_distance()).all()


def test_real_looking_trace():
    trs = word_traces(PARAGRAPHS, k=5, prompt_words=20, categories=["prose", "code"])
    assert len(trs) == 2 and all(len(t.generated) > 50 for t in trs)
    ws = [1, 16, 64, 256, 4096]
    f = coverage_by(trs, ["category"], ws, k_pre=3, k_ver=2)
    for cat, tr in zip(["prose", "code"], trs):
        g = f.filter(pl.col("category") == cat)
        for w, cov, act in zip(g["w_max"], g["coverage"], g["mean_active_vocab"]):
            c, a, n = ref.coverage([tr], w, k_pre=3, k_ver=2)
            assert cov * n == pytest.approx(c) and act * n == pytest.approx(a)
    # real text repeats itself: a big enough window covers most steps, more than a one-entry window
    g = coverage(trs, [1, 4096])["coverage"].to_list()
    assert g[1] > 0.8 and g[1] > g[0]


def test_bench_simulation_agrees_with_one_pass():
    trs = synthetic_traces(3, prompt_len=40, gen_len=60, vocab_size=500, k=4, draft_size=5, seed=3)
    ws = [1, 7, 50, 300]
    _, cov, act = one_pass(trs, ws)
    assert [c for c, _ in simulate_per_step(trs, ws)] == cov.tolist()
    assert [a for _, a in simulate_per_step(trs, ws)] == act.tolist()


# --- groups and the report ------------------------------------------------------------------------------

def test_coverage_by_groups_equal_subsets():
    trs = random_traces(3, n=9)
    f = coverage_by(trs, ["category", "language"], [2, 50])
    assert set(f.columns) >= {"category", "language", "w_max", "coverage", "bonus_coverage", "mean_active_vocab",
                              "tokens", "steps"}
    for (cat, lang), g in f.group_by(["category", "language"]):
        sub = [t for t in trs if t.meta["category"] == cat and t.meta["language"] == lang]
        assert g.sort("w_max").drop("category", "language").equals(coverage(sub, [2, 50]))


def test_coverage_report_prints_and_returns(capsys):
    trs = random_traces(4, n=6)
    wide = coverage_report(trs, w_max=(3, 30))
    out = capsys.readouterr().out
    assert wide["category"].to_list() == ["code", "math", "qa", "(all)"]
    assert {"coverage@3", "coverage@30", "mean_active_vocab@3", "mean_active_vocab@30"} <= set(wide.columns)
    assert all(name in out for name in ["code", "math", "qa", "(all)", "cov@30", "|I|@3"])
    total = coverage(trs, [3, 30])
    assert wide.filter(pl.col("category") == "(all)")["coverage@30"][0] == total["coverage"][1]


# --- bad input -------------------------------------------------------------------------------------------

def test_errors_name_the_problem():
    trs = random_traces(0, n=2, T=3)
    with pytest.raises(LocalityError, match="w_max"):
        coverage(trs, [0, 5])
    with pytest.raises(LocalityError, match="w_max"):
        coverage(trs, [-3])
    with pytest.raises(LocalityError, match="empty"):
        coverage([], [5])
    with pytest.raises(TraceError, match="k_pre=5 is larger than the K=4"):
        coverage(trs, [5], k_pre=5)
    with pytest.raises(TraceError, match="k_ver=9"):
        coverage(trs, [5], k_ver=9)
    with pytest.raises(LocalityError, match="sources"):
        coverage(trs, [5], sources="prompt")
    with pytest.raises(LocalityError, match="k_pre must be an int >= 0"):
        coverage(trs, [5], k_pre=-1)
    bad = Trace(prompt=[1, 2], prefill_topk=[[1, 2]], generated=[3, 4], step_topk=[[3, 1], [4, 1]],
                draft_tokens=[[1]])
    with pytest.raises(TraceError, match="2 generated tokens and no meta\\['step_sizes'\\]"):
        coverage([bad], [5], k_pre=2, k_ver=2)


# --- property test and the command lines ------------------------------------------------------------------

@settings(max_examples=80, deadline=None, database=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), w=st.integers(1, 60), k_pre=st.integers(0, 4), k_ver=st.integers(0, 4),
       sources=st.sampled_from(["ctx+ext", "ctx", "ext"]), order=st.sampled_from(["first", "last"]))
def test_property_one_pass_equals_reference(seed, w, k_pre, k_ver, sources, order):
    V = int(np.random.default_rng(seed).integers(1, 9))
    trs = random_traces(seed, V=V)
    k_pre, k_ver = min(k_pre, V), min(k_ver, V)                  # random_trace records K = min(4, V)
    idx = StreamIndex(candidate_stream(trs, k_pre, k_ver, sources, order))
    c, a, n = ref.coverage(trs, w, k_pre=k_pre, k_ver=k_ver, sources=sources, prefill_order=order)
    assert (idx.coverage_counts([w])[0], idx.active_vocab_sums([w])[0], idx.tokens) == (c, a, n)


def test_trace_files_read_column_wise_as_row_by_row(tmp_path, monkeypatch):
    """read_traces builds traces from whole columns; what it returns equals Trace.from_row on every row (empty
    prefills and generations, with and without draft tokens, extra meta), and a malformed file still gets
    the row-by-row error that names the row."""
    from specvocab.locality import read_traces, write_traces
    from specvocab.locality.trace import traces_to_frame

    rng = np.random.default_rng(5)
    trs = [random_trace(rng, L=1, T=0), random_trace(rng, draft=True, T=5), random_trace(rng, draft=False),
           *random_traces(6, n=5), *spec_traces(7)]
    path = write_traces(trs, tmp_path / "t.parquet")
    rows = [Trace.from_row(r) for r in pl.read_parquet(path).iter_rows(named=True)]
    with monkeypatch.context() as m:                   # a well-formed file never goes row by row
        m.setattr(Trace, "from_row", classmethod(lambda cls, row: pytest.fail("read row by row")))
        got = read_traces(path)
    assert len(got) == len(rows) == len(trs)
    for a, b in zip(got, rows):
        for name in ("prompt", "prefill_topk", "generated", "step_topk"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
        assert (a.draft_tokens is None) == (b.draft_tokens is None) and a.meta == b.meta
        if a.draft_tokens is not None:
            assert [d.tolist() for d in a.draft_tokens] == [d.tolist() for d in b.draft_tokens]
    bad = traces_to_frame(trs[:3]).with_row_index().with_columns(
        step_topk=pl.when(pl.col("index") == 1).then(pl.lit([[1, 2]])).otherwise(pl.col("step_topk"))
    ).drop("index")
    bad.write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(TraceError, match="bad.parquet, row 1"):
        read_traces(tmp_path / "bad.parquet")


def test_cli_and_bench_run(tmp_path, capsys):
    from specvocab.locality import bench, write_traces
    from specvocab.locality.__main__ import main

    trs = random_traces(11, n=5, T=6)
    write_traces(trs, tmp_path / "tr" / "t.parquet")
    f = main(["coverage", str(tmp_path / "tr"), "--w-max", "3", "30", "--out", str(tmp_path / "c.parquet")])
    assert pl.read_parquet(tmp_path / "c.parquet").equals(f)
    assert f.equals(coverage_by(trs, ["category"], [3, 30]))
    main(["lru", str(tmp_path / "tr"), "--capacity", "2", "8", "--by", "language"])
    write_traces(spec_traces(3), tmp_path / "spec" / "t.parquet")
    e = main(["coverage", str(tmp_path / "spec"), "--w-max", "4", "--event-order", "engine"])
    assert e.equals(coverage_by(spec_traces(3), ["category"], [4], event_order="engine"))
    main(["successor", str(tmp_path / "tr"), "--persist"])
    bench.main(n_traces=3, gen_len=40, prompt_len=20, prefix_traces=2, repeats=1)
    out = capsys.readouterr().out
    assert "(all)" in out and "fifo_w_max" in out and "store_hit_rate" in out
    assert out.count("results identical to the one-pass") == 2 and "speed ratio" in out
